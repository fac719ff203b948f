"""The frontier's headline through thin links, and its bytes counted twice (issue 37).

    python bench/frontier_links.py            # 3 real runs and one simulation (~6 min; resumes)
    python bench/frontier_links.py --report   # the report from cached cells only (trains nothing)

The setting is the one the README recommends: ``headline.settings`` of docs/results/frontier.json
(run bench/frontier.py first). Every cell is one ``ddiloco train --chaos`` run of the default
workload (byte-level GPT on Shakespeare, 2 learners at one thread each, the evaluator, one
relay per learner: bench/wan.py's harness and its ``COMMON`` settings) with that setting, to the
same processed tokens:

- unlimited: relays without caps (the reference);
- 10 Mbit/s, 50 ms each way, for both learners;
- 2 Mbit/s, 100 ms, for both learners, and both links cut for 20 s from 30 s of the run's clock
  (every connection reset, nothing passes).

Per cell, against unlimited: merged share (tokens merged into the global model / tokens
processed, the final sync included), final eval loss, the run's invariants.

Bytes: the unlimited cell's payload bytes (contributions and versions) and wire bytes (with
requests, acks and heartbeats) per learner per inner step each way, as the syncer's meter counted
them (metrics/traffic*.json), against what ``ddiloco simulate`` counts for the same settings,
given the cell's measured step times: the simulator's count that bench/frontier.py quotes,
checked once against real processes.

Cells are cached in bench/cache/frontier_links/, run folders in runs/bench-frontier-links/.
Writes docs/results/frontier_links.md and .json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from frontier import bytes_per_step  # noqa: E402
from harness.cells import CellCache, cell_key  # noqa: E402
from harness.files import read_json_dict  # noqa: E402
from harness.paths import CACHE, ENV, RESULTS, ROOT, sets  # noqa: E402
from harness.tables import machine, publish, table, utc_now  # noqa: E402
from wan import COMMON, NO_DEMO_STRAGGLER, analyse, check_invariants, train  # noqa: E402

CACHE_VERSION = 1
TOKENS = 800_000
"""Tokens each cell processes: ~46 s of training for 2 learners here (from ~24 s of the run's
clock, after the processes start), so that the partition (30 s to 50 s) falls inside it with
time to recover."""
CAP_S = 420.0
"""A cell's time budget: a guard only (the cells end at their tokens)."""
CELLS: dict[str, tuple[str, ...]] = {
    "unlimited": ('chaos.links=["0:inf", "1:inf"]',),
    "10mbit,50ms": ('chaos.links=["0:10mbit,50ms", "1:10mbit,50ms"]',),
    "2mbit,100ms + 20 s partition": (
        'chaos.links=["0:2mbit,100ms", "1:2mbit,100ms"]',
        'chaos.link_faults=["0:cut:20s@30s", "1:cut:20s@30s"]',
    ),
}
"""Each cell's links (``chaos.links``, ``chaos.link_faults``)."""


def headline_settings() -> list[str]:
    """The README's setting, from the frontier's report."""
    rep = read_json_dict(RESULTS / "frontier.json")
    head = rep.get("headline") or {}
    if not head.get("measured") or not head.get("settings"):
        raise SystemExit("docs/results/frontier.json has no measured headline: run python bench/frontier.py first")
    return [str(s) for s in head["settings"]]


def metered_bytes(run_dir: Path) -> dict[str, Any] | None:
    """Payload and wire bytes per learner per inner step each way, from the meter's files, and
    their two factors up: the bytes of one contribution and the contributions per inner step."""
    from ddiloco.protocol.traffic import merge_traffic

    parts = [read_json_dict(p) for p in sorted((run_dir / "metrics").glob("traffic*.json"))]
    parts = [p for p in parts if p]
    if not parts:
        return None
    traffic = merge_traffic(parts)
    out: dict[str, Any] = bytes_per_step(traffic)
    sent = [e["up"].get("contribution", {}) for e in traffic["by_learner"].values()]
    n, total = sum(c.get("messages", 0) for c in sent), sum(c.get("bytes", 0) for c in sent)
    steps = out["steps"]  # the learners' steps, as bytes_per_step summed them
    out["contribution_bytes"] = total / n if n else None
    out["contributions_per_step"] = n / steps if steps else None
    return out


def real_cell(name: str, head: list[str], runs: Path, cache: CellCache, report_only: bool) -> dict[str, Any] | None:
    settings = [*COMMON, f"run.processed_tokens={TOKENS}", f"runtime.duration_s={CAP_S:g}", *head, *CELLS[name]]
    key = cell_key("links-" + name.split(",")[0], {"v": CACHE_VERSION, "name": name, "settings": sorted(settings)})
    got = cache.get(key)
    if got is not None or report_only:
        return got
    print(f"[{time.strftime('%H:%M:%S')}] {name}: training ...", flush=True)
    seen = train(runs / key, settings, CAP_S + 120)
    a = analyse(runs / key, seen)
    step_s = a.get("step_s_mean") or 0.2
    rec = {"name": name, "key": key, "settings": settings, **a, "bytes": metered_bytes(runs / key)}
    rec["invariants"] = check_invariants(runs / key, a["summary"].get("num_fragments") or 24, 3 * 24 * step_s + 10)
    cache.put(key, rec)
    s = rec["summary"]
    print(
        f"    merged {s.get('merged_share')}, loss {s.get('eval_loss')}, violations {rec['invariants']['violations']}"
    )
    return rec


def sim_settings(real: dict[str, Any]) -> list[str] | None:
    """The real cell's settings less the runtime's, with its measured step time and speeds (None
    without them). Chaos stays as it was: on, with no failures or downtime (without those two
    the simulator would draw its default failures), and no straggler (``ddiloco simulate``
    without a config file adds the demo's 2x straggler)."""
    per = [real["learners"].get(str(m), {}).get("step_s_mean") for m in (0, 1)]
    step_s = real.get("step_s_mean")
    if not step_s or not all(per):
        return None
    speeds = [round(step_s / s, 4) for s in per]
    settings = [s for s in real["settings"] if not s.startswith("runtime.")]
    sim = [f"sim.step_time_s={step_s:.5f}", f"sim.speeds={json.dumps(speeds)}", "run.eval_points=1"]
    return [*settings, NO_DEMO_STRAGGLER, *sim]


def sim_cell(real: dict[str, Any], runs: Path, cache: CellCache, report_only: bool) -> dict[str, Any] | None:
    """``ddiloco simulate`` with the real cell's settings, step time and speeds."""
    settings = sim_settings(real)
    if settings is None:
        return None
    key = cell_key("links-sim", {"v": CACHE_VERSION, "settings": sorted(settings)})
    got = cache.get(key)
    if got is not None or report_only:
        return got
    run_dir = runs / key
    print(f"[{time.strftime('%H:%M:%S')}] simulate the unlimited cell ...", flush=True)
    argv = [sys.executable, "-m", "ddiloco", "simulate", "--run-dir", str(run_dir), *sets(settings)]
    with open(runs / f"{key}.out", "wb") as out:
        rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=ENV, check=False).returncode
    summary = read_json_dict(run_dir / "summary.json")
    rec = {"key": key, "settings": settings, "rc": rc, "bytes": metered_bytes(run_dir),
           "merged_share": summary.get("merged_share"), "eval_loss": summary.get("eval_loss")}  # fmt: skip
    cache.put(key, rec)
    return rec


def ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def build(cells: dict[str, dict[str, Any] | None], sim: dict[str, Any] | None, head: list[str]) -> dict[str, Any]:
    base = cells.get("unlimited")
    rows = []
    for name, rec in cells.items():
        if rec is None:
            rows.append({"cell": name, "measured": False})
            continue
        s = rec["summary"]
        b = rec.get("bytes") or {}
        rows.append(
            {
                "cell": name,
                "measured": True,
                "merged_share": s.get("merged_share"),
                "merged_share_vs_unlimited": ratio(s.get("merged_share"), base and base["summary"].get("merged_share")),
                "final_loss": s.get("eval_loss"),
                "final_loss_vs_unlimited": ratio(s.get("eval_loss"), base and base["summary"].get("eval_loss")),
                "tokens_processed": s.get("tokens_processed"),
                "round_latency_median_s": rec["round_latency_s"]["median"],
                "staleness_max": rec.get("staleness_max"),
                "step_ms": 1000 * (rec.get("step_s_mean") or 0.0),
                "rejected": s.get("rejected"),
                "violations": rec["invariants"]["violations"],
                "bytes": b,
                "wall_s": rec["seen"].get("wall_s"),
            }
        )
    check = []
    if base and sim and base.get("bytes") and sim.get("bytes"):
        for k in ("payload_up", "payload_down", "wire_up", "wire_down", "contribution_bytes", "contributions_per_step"):
            real_v, sim_v = base["bytes"].get(k), sim["bytes"].get(k)
            ring = base["bytes"].get("dp_ring") if k.startswith(("payload", "wire")) else None  # not the factors
            check.append({"what": k, "real": real_v, "simulated": sim_v, "sim_over_real": ratio(sim_v, real_v),
                          "x_fewer_real": ratio(ring, real_v), "x_fewer_simulated": ratio(ring, sim_v)})  # fmt: skip
    return {"headline": head, "tokens": TOKENS, "rows": rows, "bytes_check": check,
            "sim": sim and {k: sim.get(k) for k in ("rc", "merged_share", "eval_loss", "settings")}}  # fmt: skip


def markdown(rep: dict[str, Any]) -> str:
    def f(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    lines = [
        "# The frontier's headline through thin links (issue 37)",
        "",
        f"`{rep['command']}` · {rep['date']} · {rep['machine']['cpus']} CPUs, {rep['machine']['platform']}",
        "",
        f"Setting (docs/results/frontier.json's headline): `{' '.join(rep['headline'])}`. Every cell: one "
        "`ddiloco train --chaos` run of the default workload (byte-level GPT on Shakespeare, 875,264 parameters), "
        f"2 learners behind relays, to {rep['tokens']:,} processed tokens, with bench/wan.py's settings.",
        "",
    ]
    lines += table(
        ["links", "merged share (vs unlimited)", "final eval loss (vs unlimited)", "round latency median",
         "staleness max", "step ms", "refused", "invariant violations", "payload B/step up / down", "wall s"],
        [
            [r["cell"], "not run", "-", "-", "-", "-", "-", "-", "-", "-"]
            if not r["measured"]
            else [r["cell"], f"{f(r['merged_share'], '.3f')} ({f(r['merged_share_vs_unlimited'], '.3f')})",
                  f"{f(r['final_loss'], '.4f')} ({f(r['final_loss_vs_unlimited'], '.4f')})",
                  f"{f(r['round_latency_median_s'], '.2f')} s", r["staleness_max"], f(r["step_ms"], ".0f"),
                  r["rejected"], len(r["violations"]),
                  f"{f(r['bytes'].get('payload_up'), ',.0f')} / {f(r['bytes'].get('payload_down'), ',.0f')}",
                  f(r["wall_s"], ".0f")]
            for r in rep["rows"]
        ],
    )  # fmt: skip
    if rep["bytes_check"]:
        lines += [
            "",
            "Bytes per learner per inner step on the unlimited cell, as the real syncer's meter counted them and as "
            "`ddiloco simulate` counts them given the same settings and the cell's measured step times "
            "(payload: contributions and versions with their headers; wire: with requests, acks and heartbeats; "
            "x fewer: against data-parallel's fp32 ring of the same model). Payload up is the bytes of one "
            "contribution times the contributions per inner step, both shown:",
            "",
        ]
        lines += table(
            ["bytes", "real", "simulated", "simulated / real", "x fewer than DP, real", "x fewer, simulated"],
            [[c["what"], f(c["real"], fmt), f(c["simulated"], fmt), f(c["sim_over_real"], ".3f"),
              f(c["x_fewer_real"], ",.0f"), f(c["x_fewer_simulated"], ",.0f")]
             for c in rep["bytes_check"]
             for fmt in [".3f" if c["what"] == "contributions_per_step" else ",.0f"]],
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", action="store_true", help="write the report from cached cells only")
    args = ap.parse_args()
    head = headline_settings()
    cache = CellCache(CACHE / "frontier_links")
    runs = ROOT / "runs" / "bench-frontier-links"
    runs.mkdir(parents=True, exist_ok=True)
    started = time.time()
    cells = {name: real_cell(name, head, runs, cache, args.report) for name in CELLS}
    base = cells["unlimited"]
    sim = sim_cell(base, runs, cache, args.report) if base else None
    rep = {
        "command": "python bench/frontier_links.py" + (" --report" if args.report else ""),
        "date": utc_now(),
        "machine": machine(),
        "wall_s_this_invocation": time.time() - started,
        **build(cells, sim, head),
    }
    publish(RESULTS, "frontier_links", rep, markdown(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
