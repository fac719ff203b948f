"""Quality of each wire encoding, in the quality benchmark's regime (issue 20, item 4).

    python bench/encodings.py            # 27 simulated runs (~45 min on 2 cores idle; resumes)

Decoupled DiLoCo, healthy, M = 4, at the settings ``bench/quality.py`` chose (read from
docs/results/quality.json), three seeds, with the same encoding both ways: fp32 (the
reference), bf16, int8, int4 and int2, each with and without error feedback. Each arm's loss is
paired by seed with fp32's (a 95% t-interval of the ratio). Runs are cached in
bench/cache/quality/ like the quality benchmark's (keyed by settings and code digest), so an
interrupted run resumes. Writes docs/results/encodings.md and .json.

Targets: int8 and int4 with error feedback at most 1.01x fp32's loss (mean); int2 as measured
(the paper's pattern: 4-bit near-lossless, 2-bit clearly worse).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality as q  # noqa: E402  (the quality benchmark's regime, runner and statistics)

from ddiloco.core.compress import ENCODINGS, encoded_nbytes  # noqa: E402

TARGET = 1.01
"""int8 and int4 with error feedback: at most this times fp32's loss (mean over seeds)."""


def arms(base: list[str], best: list[str]) -> dict[str, list[str]]:
    """Arm name -> overrides: fp32, then every lossy encoding without and with error feedback."""
    out = {"fp32": [*base, *best]}
    for enc in ENCODINGS[1:]:
        for ef in (False, True):
            name = f"{enc}{' +EF' if ef else ''}"
            out[name] = [
                *base,
                *best,
                f"algo.up_encoding={enc}",
                f"algo.down_encoding={enc}",
                f"algo.error_feedback={'true' if ef else 'false'}",
            ]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="runs at once (one thread each)")
    ap.add_argument("--cache", default=str(q.ROOT / "bench" / "cache" / "quality"), help="folder of cached runs")
    ap.add_argument("--out", default=str(q.ROOT / "docs" / "results"), help="folder for encodings.md/.json")
    ap.add_argument("--seeds", type=int, default=len(q.SEEDS), help="seeds per arm (the first N of the benchmark's)")
    args = ap.parse_args()
    started = time.time()
    try:
        published = json.loads((Path(args.out) / "quality.json").read_text())
        best = [str(o) for o in published["best"]["decoupled"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: needs the quality benchmark's report {Path(args.out) / 'quality.json'} with its settings ({e})")
        return 2
    base = [*q.COMMON, f"run.num_learners={q.M}", f"run.processed_tokens={q.TOKENS}"]
    code = q.code_digest()
    runner = q.Runner(Path(args.cache), args.workers, code)
    seeds = q.SEEDS[: args.seeds]
    table = arms(base, best)
    # Seed-major: an interrupted run has whole seeds of every arm first.
    jobs = [(f"{a} seed {s}", "decoupled", (*over, f"run.seed={s}")) for s in seeds for a, over in table.items()]
    print(f"encodings: {len(jobs)} runs ({len(table)} arms x {len(seeds)} seeds), code digest {code}", flush=True)
    by_arm = q.run_by_arm(runner, jobs, table)
    ref = {q.seed_of(r): r for r in by_arm["fp32"]}
    params = q.regime(q.TOKENS, False)["params"]
    rows = []
    for a, runs in by_arm.items():
        ratios = [r["eval_loss"] / ref[q.seed_of(r)]["eval_loss"] for r in runs]
        mean, lo, hi = q.ci95(ratios)
        enc = a.split()[0]
        rows.append(
            {
                "arm": a,
                "encoding": enc,
                "error_feedback": a.endswith("+EF"),
                "eval_loss": statistics.fmean(r["eval_loss"] for r in runs),
                "ratio": mean,
                "ratio_ci95": [lo, hi],
                "per_seed": [{"seed": q.seed_of(r), "eval_loss": r["eval_loss"]} for r in runs],
                "payload_x_fewer_than_fp32": 4 * params / encoded_nbytes(params, enc),
            }
        )
    checks = []
    for a in ("int8 +EF", "int4 +EF"):
        row = next(r for r in rows if r["arm"] == a)
        checks.append({"what": f"{a} loss / fp32's (mean)", "value": row["ratio"], "limit": TARGET,
                       "met": row["ratio"] <= TARGET})  # fmt: skip
    report = {
        **q.invocation_facts(argparse.Namespace(quick=False, verify="", workers=args.workers), started, runner, code),
        "command": "python bench/encodings.py",
        "settings": {"common": base, "decoupled": best, "seeds": list(seeds)},
        "rows": rows,
        "checks": checks,
    }
    q.publish(Path(args.out), "encodings", report, to_markdown(report))
    runner.pool.shutdown()
    return 0


def to_markdown(rep: dict[str, Any]) -> str:
    lines = [
        "# Quality of each wire encoding",
        "",
        f"Command: `{rep['command']}` ({rep['date']}, {rep['machine']['cpus']} CPUs, {rep['machine']['workers']} runs "
        f"at once; {rep['runs_trained_this_invocation']} runs trained in {rep['wall_s_this_invocation'] / 60:.0f} min, "
        f"{rep['cpu_s_all_runs'] / 3600:.1f} CPU-hours in all). Code digest `{rep['code_digest']}`.",
        "",
        "Decoupled DiLoCo, healthy, M = 4, in the quality benchmark's regime and at its chosen settings "
        f"(`{' '.join(rep['settings']['decoupled'])}`), seeds {rep['settings']['seeds']}; the same encoding up and "
        "down. The ratio is each arm's final eval loss over fp32's, paired by seed, with a 95% t-interval.",
        "",
        "| arm | eval loss | / fp32 | 95% interval | payload, x fewer bytes than fp32 |",
        "|---|---|---|---|---|",
    ]
    for r in rep["rows"]:
        lo, hi = r["ratio_ci95"]
        lines.append(
            f"| {r['arm']} | {r['eval_loss']:.4f} | {r['ratio']:.4f} | [{lo:.4f}, {hi:.4f}] | "
            f"{r['payload_x_fewer_than_fp32']:.1f} |"
        )
    lines += ["", "| check | value | limit | met |", "|---|---|---|---|"]
    for c in rep["checks"]:
        lines.append(f"| {c['what']} | {c['value']:.4f} | {c['limit']} | {'yes' if c['met'] else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
