"""Frontier benchmark: quality and bytes from the same runs (issue 37).

    python bench/frontier.py                 # the benchmark (~7 CPU-hours; resumes from its cells)
    python bench/frontier.py --report        # the report from the cached cells only (trains nothing)
    python bench/frontier.py --quick         # a few-minute smoke version (not a result)

The regime is the quality benchmark's (bench/quality.py: a d = 64 byte-level GPT of ~0.24M
parameters, M = 4 learners at batch 8 x 64 bytes, 4.1M tokens, simulated in virtual time by
the same code a real run executes). Each cell is one method at one H with one payload:

- methods: Decoupled DiLoCo and synchronous DiLoCo, each at its inner LR from the quality
  report's sweep (``INNER_LR``);
- H in ``H_GRID``;
- payloads (``PAYLOADS``): fp32; int4 and int2 both ways with error feedback; the k largest of every
  4,096 values (3 % and 1 %) at 2 bits both ways with error feedback, and 3 % at 4 bits (the
  12-bit positions dominate a sparse payload: 4-bit values cost ~15 % more than 2-bit ones).

Every cell gets the same search, in the same order: the outer LR and momentum over
``SEARCH`` on seed 0 (the configurations tried are counted in the report). The best of them
(lowest eval loss) then runs on the other seeds. Data-parallel runs at the quality report's LR
on every seed. Each ratio is paired by seed, with a 95% t-interval.

The headline (``HEADLINE``: the setting the README recommends) and its fp32 reference run on
``HEADLINE_SEEDS``; beside it, a run with the defaults (``DEFAULT_ALGO``) on ``SEEDS``. Decoupled
and synchronous DiLoCo at the same H and payload send the same bytes (the whole model once per H
inner steps); the report sets them against each other as a paired difference.

Bytes are counted at the simulated wire (``protocol.traffic``: what the service meter counts for
real processes): *payload* bytes per learner per inner step each way are the contributions
(up) and merged versions (down) with their message headers; *wire* bytes add requests, acks and
heartbeats (the steady state). Both are set against data-parallel's fp32 ring all-reduce of the
same model (``dp_ring_bytes``). Every run is cached in bench/cache/frontier/ (one JSON per run,
keyed by its settings and the code digest), so an interrupted benchmark resumes.
Writes docs/results/frontier.md and .json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.cells import CellCache, digest  # noqa: E402
from harness.paths import RESULTS, ROOT  # noqa: E402
from harness.tables import machine, table, utc_now  # noqa: E402
from harness.tables import publish as _publish  # noqa: E402
from quality import COMMON, TOKENS, M, ci95, code_digest, simulate_job  # noqa: E402  (the same regime and code)

CACHE_VERSION = 1
"""Bump when a change outside src/ddiloco makes cached runs stale."""
H_GRID = (12, 24)
"""H of every cell (the issue's {12, 24, 48} less 48: the budget is 8 CPU-hours)."""
SEEDS = (0, 1, 2)
INNER_LR = {"decoupled": 0.004, "diloco": 0.008}
"""Each method's inner LR from the quality report's sweep (docs/results/quality.json "best")."""
DP_LR = 0.0113137
"""Data-parallel's LR from the same sweep."""
SEARCH = tuple((lr, mom) for mom in (0.9, 0.8, 0.0) for lr in (0.5, 1.0))
"""(outer LR, outer momentum) tried for every cell on seed 0, in this order: the quality report's
choices (0.5 with 0.8 or 0.9) and their neighbours up, and no momentum (SparseLoCo's choice
with error feedback, which itself carries the past updates forward)."""
PAYLOADS: dict[str, list[str]] = {
    "fp32": ["algo.up_encoding=fp32", "algo.down_encoding=fp32", "algo.error_feedback=false"],
    "int4+EF": ["algo.up_encoding=int4", "algo.down_encoding=int4", "algo.error_feedback=true"],
    "int2+EF": ["algo.up_encoding=int2", "algo.down_encoding=int2", "algo.error_feedback=true"],
    "top3%+int2+EF": [
        "algo.up_encoding=int2",
        "algo.down_encoding=int2",
        "algo.up_density=0.03",
        "algo.down_density=0.03",
        "algo.error_feedback=true",
    ],
    "top3%+int4+EF": [
        "algo.up_encoding=int4",
        "algo.down_encoding=int4",
        "algo.up_density=0.03",
        "algo.down_density=0.03",
        "algo.error_feedback=true",
    ],
    "top1%+int2+EF": [
        "algo.up_encoding=int2",
        "algo.down_encoding=int2",
        "algo.up_density=0.01",
        "algo.down_density=0.01",
        "algo.error_feedback=true",
    ],
}
METHODS = ("decoupled", "diloco")
HEADLINE = ("decoupled", 24, "int4+EF")
"""The setting the README recommends, picked from this frontier: the most payload bytes saved
within 1.01x of fp32 Decoupled at the same H. It, its fp32 reference and data-parallel run on
``HEADLINE_SEEDS``; the other cells on ``SEEDS``."""
HEADLINE_SEEDS = (0, 1, 2, 3, 4)
DEFAULT_ALGO = ("algo.sync_every=24", "algo.outer_lr=0.7", "algo.outer_momentum=0.9", "algo.up_encoding=fp32",
                "algo.down_encoding=fp32", "algo.error_feedback=false")  # fmt: skip
"""What a run gets without flags (``core.config``'s defaults, spelled out so that the cell
records them): set against the headline on the same seeds, at this regime's inner LR."""

Job = tuple[str, str, tuple[str, ...]]
"""(label, method, overrides)."""


def run_one(job: Job) -> dict[str, Any]:
    """Run one configuration in this worker process: the quality benchmark's figures and its bytes."""
    from ddiloco.protocol.traffic import traffic_figures

    out, result = simulate_job(job)
    traffic = getattr(result, "traffic", None)
    if traffic:
        out["bytes"] = bytes_per_step(traffic)
        out["traffic_figures"] = {k: v for k, v in traffic_figures(traffic).items() if k != "learners"}
    return out


def bytes_per_step(traffic: dict[str, Any]) -> dict[str, float | None]:
    """Payload and wire bytes per learner per inner step each way, from a run's traffic dict
    (steps and bytes summed over the learners), and data-parallel's fp32 ring per step."""
    from ddiloco.protocol.traffic import STEADY, dp_ring_bytes

    steps = 0
    sums = {"payload_up": 0, "payload_down": 0, "wire_up": 0, "wire_down": 0}
    for entry in traffic.get("by_learner", {}).values():
        steps += int(entry.get("steps", 0))
        for d in ("up", "down"):
            cells = entry.get(d, {})
            sums[f"wire_{d}"] += sum(c["bytes"] for k, c in cells.items() if k in STEADY)
            sums[f"payload_{d}"] += sum(c["bytes"] for k, c in cells.items() if k in ("contribution", "version"))
    out: dict[str, float | None] = {k: (v / steps if steps else None) for k, v in sums.items()}
    out["steps"] = steps
    out["dp_ring"] = dp_ring_bytes(traffic["params"], traffic["learners"]) if traffic.get("params") else None
    return out


# ----------------------------------------------------------------------------- running


class Runner:
    """Jobs on a process pool, each run at most once: cached by settings and code digest."""

    def __init__(self, cells: CellCache, workers: int, code: str) -> None:
        self.cells, self.code = cells, code
        self.pool = ProcessPoolExecutor(max_workers=workers) if workers else None
        self.trained = 0

    def key(self, method: str, overrides: Iterable[str]) -> str:
        blob = {"v": CACHE_VERSION, "method": method, "over": sorted(overrides), "code": self.code}
        return f"{method}-" + digest(blob, 16)

    def cached(self, job: Job) -> dict[str, Any] | None:
        hit = self.cells.get(self.key(job[1], job[2]))
        return hit if hit is not None and hit.get("code") == self.code else None

    def run(self, jobs: list[Job]) -> list[dict[str, Any] | None]:
        """Every job's result, in order (None for one not cached when there is no pool: --report)."""
        results: list[dict[str, Any] | None] = [self.cached(j) for j in jobs]
        todo = {i: j for i, j in enumerate(jobs) if results[i] is None}
        if not todo or self.pool is None:
            return results
        pending: dict[Future[dict[str, Any]], int] = {self.pool.submit(run_one, j): i for i, j in todo.items()}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                i = pending.pop(f)
                r = {**f.result(), "code": self.code}
                self.cells.put(self.key(jobs[i][1], jobs[i][2]), r)
                self.trained += 1
                results[i] = r
                b = r.get("bytes", {})
                print(
                    f"  {r['label']:<44} loss {r['eval_loss']:.4f}  merged {r['merged_share']:.1%}  "
                    f"payload {b.get('payload_up') or 0:,.0f}/{b.get('payload_down') or 0:,.0f} B/step  "
                    f"({r['wall_s']:.0f} s)",
                    flush=True,
                )
        return results


def cell_jobs(base: list[str], method: str, h: int, payload: str, seed: int, lr: float, mom: float) -> Job:
    over = (
        *base,
        f"algo.sync_every={h}",
        f"inner.lr={INNER_LR[method]}",
        f"algo.outer_lr={lr}",
        f"algo.outer_momentum={mom}",
        *PAYLOADS[payload],
        f"run.seed={seed}",
    )
    return (f"{method} H={h} {payload} ({lr}, {mom}) seed {seed}", method, over)


def dp_job(base: list[str], seed: int) -> Job:
    return (f"dp seed {seed}", "dp", (*base, f"inner.lr={DP_LR}", f"run.seed={seed}"))


def default_job(base: list[str], seed: int) -> Job:
    over = (*base, *DEFAULT_ALGO, f"inner.lr={INNER_LR['decoupled']}", f"run.seed={seed}")
    return (f"decoupled defaults seed {seed}", "decoupled", over)


def seeds_for(method: str, h: int, payload: str, seeds: tuple[int, ...]) -> tuple[int, ...]:
    """The headline cell and its fp32 reference run on more seeds (unless a smoke run asked for one)."""
    head_method, head_h, head_payload = HEADLINE
    if len(seeds) > 1 and (method, h) == (head_method, head_h) and payload in (head_payload, "fp32"):
        return HEADLINE_SEEDS
    return seeds


# ----------------------------------------------------------------------------- the report


def summarise(
    cells: dict[tuple[str, int, str], dict[str, Any]], dp: dict[int, dict[str, Any]], grid: list[tuple[float, float]]
) -> list[dict[str, Any]]:
    """One row per cell: its search, its best configuration on every seed, and its figures."""
    rows = []
    for (method, h, payload), cell in cells.items():
        runs = [r for r in cell["seeds"] if r is not None]
        row: dict[str, Any] = {
            "method": method,
            "H": h,
            "payload": payload,
            "settings": [*PAYLOADS[payload], f"algo.sync_every={h}", f"inner.lr={INNER_LR[method]}"],
            "configurations_tried": sum(r is not None for r in cell["search"]),
            "configurations_planned": len(grid),
            "search": [
                {"outer_lr": lr, "outer_momentum": mom, "eval_loss": r["eval_loss"] if r else None}
                for (lr, mom), r in zip(grid, cell["search"])
            ],
            "best": {"outer_lr": cell["best"][0], "outer_momentum": cell["best"][1]} if cell["best"] else None,
            "seeds": [int(r["overrides"][-1].split("=")[1]) for r in runs],
        }
        if runs:
            row["losses"] = [r["eval_loss"] for r in runs]  # in the order of "seeds"
            row["eval_loss"] = statistics.fmean(row["losses"])
            paired = [r["eval_loss"] / dp[s]["eval_loss"] for r, s in zip(runs, row["seeds"]) if s in dp]
            if paired:
                row["over_dp"], lo, hi = ci95(paired)
                row["over_dp_ci95"] = [lo, hi]
            row["merged_share"] = statistics.fmean(r["merged_share"] for r in runs)
            row["rejected"] = sum(int(r.get("rejected", 0)) for r in runs)
            b = [r["bytes"] for r in runs if r.get("bytes")]
            for k in ("payload_up", "payload_down", "wire_up", "wire_down"):
                vals = [x[k] for x in b if x.get(k)]
                row[k] = statistics.fmean(vals) if vals else None
                ring = b[0]["dp_ring"] if b else None
                row[f"{k}_x_fewer"] = ring / row[k] if ring and row[k] else None
            row["_runs"] = runs
        rows.append(row)
    # against fp32 Decoupled (or DiLoCo) at the same H, paired by seed
    by = {(r["method"], r["H"], r["payload"]): r for r in rows}
    for r in rows:
        ref = by.get((r["method"], r["H"], "fp32"))
        if ref and "_runs" in r and "_runs" in ref:
            ref_by_seed = dict(zip(ref["seeds"], ref["_runs"]))
            pairs = [(x, ref_by_seed[s]) for x, s in zip(r["_runs"], r["seeds"]) if s in ref_by_seed]
            paired = [x["eval_loss"] / y["eval_loss"] for x, y in pairs]
            if paired:
                r["over_fp32_same_h"], lo, hi = ci95(paired)
                r["over_fp32_same_h_ci95"] = [lo, hi]
    for r in rows:
        r.pop("_runs", None)
    return rows


def saved(r: dict[str, Any]) -> float:
    """How many times fewer payload bytes than data-parallel, the smaller of up and down."""
    return min(r.get("payload_up_x_fewer") or 0.0, r.get("payload_down_x_fewer") or 0.0)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's two frontier targets, per H: a Decoupled point with at least ``fewer`` times
    fewer payload bytes than data-parallel each way at most ``loss`` x the fp32 Decoupled arm's
    loss at the same H (mean over seeds). Each names the point that meets it with the most bytes
    saved, and, met or not, the two nearest: the closest loss among the points that save enough
    bytes, and the most bytes saved among the points within the loss."""
    out = []

    def brief(r: dict[str, Any] | None) -> dict[str, Any] | None:
        if r is None:
            return None
        return {"payload": r["payload"], "x_fewer": saved(r), "over_fp32": r["over_fp32_same_h"],
                "over_dp": r.get("over_dp"), "seeds": len(r["seeds"])}  # fmt: skip

    for h in sorted({r["H"] for r in rows}):
        cells = [r for r in rows if r["method"] == "decoupled" and r["H"] == h and r.get("over_fp32_same_h")]
        cells = [r for r in cells if saved(r)]
        if not cells:
            continue  # not measured at this H
        for fewer, loss in ((1000.0, 1.03), (150.0, 1.01)):
            enough = [r for r in cells if saved(r) >= fewer]
            close = [r for r in cells if r["over_fp32_same_h"] <= loss]
            met = [r for r in enough if r["over_fp32_same_h"] <= loss]
            out.append(
                {
                    "H": h,
                    "target": f">= {fewer:,.0f}x fewer payload bytes each way at <= {loss}x fp32 Decoupled",
                    "met": bool(met),
                    "met_by": brief(max(met, key=saved, default=None)),
                    "enough_bytes_closest_loss": brief(min(enough, key=lambda r: r["over_fp32_same_h"], default=None)),
                    "within_loss_most_bytes": brief(max(close, key=saved, default=None)),
                }
            )
    return out


def paired(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[float, float]]:
    """Two rows' eval losses on the seeds both ran."""
    bs = dict(zip(b.get("seeds", []), b.get("losses", [])))
    return [(x, bs[s]) for s, x in zip(a.get("seeds", []), a.get("losses", [])) if s in bs]


def versus(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Decoupled against synchronous DiLoCo at equal bytes (the same H and payload: both send the
    whole model once per H inner steps), as the paired difference of eval loss with its 95%
    interval, and the ratio."""
    by = {(r["method"], r["H"], r["payload"]): r for r in rows}
    out = []
    for (method, h, payload), dec in by.items():
        syn = by.get(("diloco", h, payload))
        if method != "decoupled" or syn is None:
            continue
        pairs = paired(dec, syn)
        if not pairs:
            continue
        diff, dlo, dhi = ci95([x - y for x, y in pairs])
        ratio, rlo, rhi = ci95([x / y for x, y in pairs])
        out.append({"H": h, "payload": payload, "seeds": len(pairs),  # the means over the paired seeds
                    "decoupled": statistics.fmean(x for x, _ in pairs),
                    "diloco": statistics.fmean(y for _, y in pairs), "difference": diff, "difference_ci95": [dlo, dhi],
                    "ratio": ratio, "ratio_ci95": [rlo, rhi], "x_fewer_decoupled": saved(dec),
                    "x_fewer_diloco": saved(syn)})  # fmt: skip
    return out


def headline(
    rows: list[dict[str, Any]], defaults: list[dict[str, Any]], dp: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """The README's setting: its quality and bytes from the same runs, its settings in full, and
    what a run with the defaults gets on the same seeds."""
    method, h, payload = HEADLINE
    row = next((r for r in rows if (r["method"], r["H"], r["payload"]) == HEADLINE), None)
    if row is None or not row.get("best"):
        return {"cell": list(HEADLINE), "measured": False}
    settings = [f"algo.sync_every={h}", *PAYLOADS[payload], f"algo.outer_lr={row['best']['outer_lr']}",
                f"algo.outer_momentum={row['best']['outer_momentum']}"]  # fmt: skip
    out: dict[str, Any] = {"cell": list(HEADLINE), "measured": True, "settings": settings,
                           "inner_lr": INNER_LR[method], **{k: row.get(k) for k in (
                               "seeds", "eval_loss", "over_dp", "over_dp_ci95", "over_fp32_same_h",
                               "over_fp32_same_h_ci95", "merged_share", "rejected", "payload_up", "payload_down",
                               "wire_up", "wire_down", "payload_up_x_fewer", "payload_down_x_fewer",
                               "wire_up_x_fewer", "wire_down_x_fewer")}}  # fmt: skip
    if defaults:
        seeds = [int(r["overrides"][-1].split("=")[1]) for r in defaults]
        d_row = {"seeds": seeds, "losses": [r["eval_loss"] for r in defaults]}
        vs_head = paired(d_row, row)
        vs_dp = [(x, dp[s]["eval_loss"]) for s, x in zip(seeds, d_row["losses"]) if s in dp]
        b = [r["bytes"] for r in defaults if r.get("bytes")]
        out["defaults"] = {
            "settings": list(DEFAULT_ALGO),
            "seeds": seeds,
            "eval_loss": statistics.fmean(d_row["losses"]),
            "over_dp": ci95([x / y for x, y in vs_dp]) if vs_dp else None,
            "over_headline": ci95([x / y for x, y in vs_head]) if vs_head else None,
            "payload_up": statistics.fmean(x["payload_up"] for x in b) if b else None,
            "payload_down": statistics.fmean(x["payload_down"] for x in b) if b else None,
            "payload_x_fewer": min(b[0]["dp_ring"] / x[k] for x in b for k in ("payload_up", "payload_down"))
            if b
            else None,
            "merged_share": statistics.fmean(r["merged_share"] for r in defaults),
        }
    return out


def markdown(rep: dict[str, Any]) -> str:
    def f(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    lines = [
        "# Frontier: quality and bytes from the same runs",
        "",
        f"`{rep['command']}` · {rep['date']} · code {rep['code_digest']} · {rep['runs']} runs "
        f"({rep['runs_trained_this_invocation']} trained by this invocation)",
        "",
        "Regime: the quality benchmark's (d = 64 byte-level GPT, ~0.24M parameters, M = 4, 4.1M tokens). "
        "Every cell: the outer LR and momentum searched over the same "
        f"{len(SEARCH)} configurations on seed 0 (`SEARCH`), the best on seeds {', '.join(map(str, SEEDS))}. "
        "Ratios paired by seed with 95% t-intervals. Bytes per learner per inner step, counted at the "
        "simulated wire; x fewer is against data-parallel's fp32 ring all-reduce of the same model.",
        "",
    ]
    rows = []
    for r in rep["rows"]:
        rows.append(
            [
                r["method"],
                r["H"],
                r["payload"],
                f"{r['configurations_tried']}/{r['configurations_planned']}",
                f"({r['best']['outer_lr']}, {r['best']['outer_momentum']})" if r.get("best") else "-",
                len(r["seeds"]),
                f(r.get("eval_loss"), ".4f"),
                f(r.get("over_dp"), ".4f")
                + (f" [{r['over_dp_ci95'][0]:.3f}, {r['over_dp_ci95'][1]:.3f}]" if r.get("over_dp_ci95") else ""),
                f(r.get("over_fp32_same_h"), ".4f")
                + (
                    f" [{r['over_fp32_same_h_ci95'][0]:.3f}, {r['over_fp32_same_h_ci95'][1]:.3f}]"
                    if r.get("over_fp32_same_h_ci95")
                    else ""
                ),
                f(r.get("payload_up"), ",.0f"),
                f(r.get("payload_down"), ",.0f"),
                f(r.get("payload_up_x_fewer"), ",.0f"),
                f(r.get("payload_down_x_fewer"), ",.0f"),
                f(r.get("wire_up_x_fewer"), ",.0f"),
                f(r.get("wire_down_x_fewer"), ",.0f"),
                f(r.get("merged_share"), ".3f"),
                r.get("rejected", "-"),
            ]
        )
    lines += table(
        [
            "method",
            "H",
            "payload",
            "configs",
            "best (outer LR, mom.)",
            "seeds",
            "eval loss",
            "/ DP",
            "/ fp32 same method and H",
            "payload up B/step",
            "payload down B/step",
            "x fewer up",
            "x fewer down",
            "wire x fewer up",
            "wire x fewer down",
            "merged share",
            "refused",
        ],
        rows,
    )
    if rep.get("targets"):

        def point(t: dict[str, Any] | None) -> str:
            if not t:
                return "-"
            return f"{t['payload']}: {t['x_fewer']:,.0f}x at {t['over_fp32']:.4f} ({t['seeds']} seeds)"

        lines += ["", "Targets (issue 37), payload bytes each way (the smaller of up and down):", ""]
        lines += table(
            ["H", "target", "met", "met by", "enough bytes, closest loss", "within the loss, most bytes"],
            [
                [
                    t["H"],
                    t["target"],
                    "yes" if t["met"] else "**no**",
                    point(t["met_by"]),
                    point(t["enough_bytes_closest_loss"]),
                    point(t["within_loss_most_bytes"]),
                ]
                for t in rep["targets"]
            ],  # fmt: skip
        )
    if rep.get("decoupled_vs_diloco"):
        lines += ["", "Decoupled against synchronous DiLoCo at equal bytes (same H and payload), paired by seed:", ""]
        lines += table(
            [
                "H",
                "payload",
                "seeds",
                "Decoupled",
                "DiLoCo",
                "difference [95%]",
                "ratio [95%]",
                "x fewer (Dec. / DiLoCo)",
            ],
            [
                [
                    v["H"],
                    v["payload"],
                    v["seeds"],
                    f(v["decoupled"], ".4f"),
                    f(v["diloco"], ".4f"),
                    f"{v['difference']:+.4f} [{v['difference_ci95'][0]:+.4f}, {v['difference_ci95'][1]:+.4f}]",
                    f"{v['ratio']:.4f} [{v['ratio_ci95'][0]:.3f}, {v['ratio_ci95'][1]:.3f}]",
                    f"{v['x_fewer_decoupled']:,.0f} / {v['x_fewer_diloco']:,.0f}",
                ]
                for v in rep["decoupled_vs_diloco"]
            ],  # fmt: skip
        )
    head = rep.get("headline") or {}
    if head.get("measured"):
        ci = head.get("over_dp_ci95") or [None, None]
        cf = head.get("over_fp32_same_h_ci95") or [None, None]
        lines += [
            "",
            "## Headline: the setting the README recommends",
            "",
            f"`{' '.join(head['settings'])}` (Decoupled; the rest at their defaults; this regime's inner LR "
            f"{head['inner_lr']}), {len(head['seeds'])} seeds ({', '.join(map(str, head['seeds']))}):",
            "",
            f"- eval loss {f(head['eval_loss'], '.4f')}: {f(head['over_dp'], '.4f')} x data-parallel "
            f"[{f(ci[0], '.3f')}, {f(ci[1], '.3f')}], {f(head['over_fp32_same_h'], '.4f')} x fp32 Decoupled at "
            f"the same H [{f(cf[0], '.3f')}, {f(cf[1], '.3f')}]; merged share {f(head['merged_share'], '.3f')}; "
            f"{head['rejected']} contributions refused;",
            f"- payload bytes per learner per inner step {f(head['payload_up'], ',.0f')} up and "
            f"{f(head['payload_down'], ',.0f')} down: {f(head['payload_up_x_fewer'], ',.0f')}x and "
            f"{f(head['payload_down_x_fewer'], ',.0f')}x fewer than data-parallel's fp32 ring; with requests, "
            f"acks and heartbeats (wire) {f(head['wire_up_x_fewer'], ',.0f')}x and "
            f"{f(head['wire_down_x_fewer'], ',.0f')}x.",
        ]
        d = head.get("defaults")
        if d:
            lines += [
                f"- A run with the defaults (`{' '.join(d['settings'])}`, the same inner LR, seeds "
                f"{', '.join(map(str, d['seeds']))}): eval loss {f(d['eval_loss'], '.4f')}, "
                f"{f((d['over_dp'] or [None])[0], '.4f')} x data-parallel, "
                f"{f((d['over_headline'] or [None])[0], '.4f')} x the headline, "
                f"{f(d['payload_x_fewer'], ',.0f')}x fewer payload bytes than data-parallel.",
            ]
    dp = rep.get("dp", {})
    lines += ["", f"Data-parallel: eval loss {f(dp.get('eval_loss'), '.4f')} over {dp.get('seeds', 0)} seeds."]
    if rep.get("plot"):
        lines += ["", f"![the frontier]({rep['plot']})"]
    if rep.get("partial"):
        lines += ["", f"**Partial**: {rep['partial']}"]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """The frontier: loss over data-parallel against how many times fewer payload bytes than
    data-parallel (the smaller of up and down), one curve per method and H. None without
    matplotlib (pip install 'ddiloco[plot]')."""
    try:
        from ddiloco.report.plotting import pyplot

        plt = pyplot()
    except Exception as e:  # noqa: BLE001  (the report stands without its figure)
        print(f"no plot: {e}")
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for method in METHODS:
        for h in sorted({r["H"] for r in rows}):
            pts = sorted(
                (min(r["payload_up_x_fewer"], r["payload_down_x_fewer"]), r["over_dp"], r["payload"])
                for r in rows
                if r["method"] == method
                and r["H"] == h
                and r.get("over_dp")
                and r.get("payload_up_x_fewer")
                and r.get("payload_down_x_fewer")
            )
            if not pts:
                continue
            name = {"decoupled": "Decoupled DiLoCo", "diloco": "DiLoCo"}[method]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if method == "decoupled" else "s--",
                    label=f"{name}, H = {h}")  # fmt: skip
            for x, y, label in pts:
                ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("payload bytes per learner per step: x fewer than data-parallel (fp32 ring)")
    ax.set_ylabel("eval loss / data-parallel (paired by seed)")
    ax.set_title("Quality against bytes, same runs (0.24M GPT, M = 4, 4.1M tokens)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="runs at once (one thread each)")
    ap.add_argument("--report", action="store_true", help="write the report from cached cells only")
    ap.add_argument("--quick", action="store_true", help="a smoke version: 150k tokens, one config, one seed")
    ap.add_argument("--methods", default=",".join(METHODS), help="methods to run, in this order")
    ap.add_argument("--h", default=",".join(map(str, H_GRID)), help="H values to run, in this order")
    ap.add_argument("--payloads", default=",".join(PAYLOADS), help="payloads to run, in this order")
    ap.add_argument("--out", default=str(RESULTS), help="folder for frontier.md/.json")
    args = ap.parse_args()
    tokens = 150_000 if args.quick else TOKENS
    seeds = (0,) if args.quick else SEEDS
    grid = list(SEARCH[:1] if args.quick else SEARCH)
    base = [*COMMON, f"run.num_learners={M}", f"run.processed_tokens={tokens}"]
    code = code_digest()
    cells_dir = ROOT / "bench" / "cache" / "frontier" / ("quick" if args.quick else "")
    runner = Runner(CellCache(cells_dir), 0 if args.report else args.workers, code)
    started = time.time()
    methods = [m for m in args.methods.split(",") if m]
    hs = [int(h) for h in args.h.split(",") if h]
    payloads = [p for p in args.payloads.split(",") if p]
    unknown = sorted({*methods} - {*METHODS}) + sorted({*payloads} - {*PAYLOADS})
    if unknown:
        ap.error(f"unknown {', '.join(unknown)}: methods are {', '.join(METHODS)}; payloads {', '.join(PAYLOADS)}")
    print(f"code {code}; cells in {cells_dir}", flush=True)

    all_seeds = seeds if args.quick else HEADLINE_SEEDS
    dp_runs = runner.run([dp_job(base, s) for s in all_seeds])
    dp = {s: r for s, r in zip(all_seeds, dp_runs) if r is not None}
    cells: dict[tuple[str, int, str], dict[str, Any]] = {}
    missing = 0
    for method in methods:
        for h in hs:
            # the search of every payload at this (method, H) in one batch, so the workers stay busy
            jobs = [cell_jobs(base, method, h, p, 0, lr, mom) for p in payloads for lr, mom in grid]
            found = iter(runner.run(jobs))
            for p in payloads:
                tried = [next(found) for _ in grid]
                done = [(cfg, r) for cfg, r in zip(grid, tried) if r is not None]
                best = min(done, key=lambda x: x[1]["eval_loss"])[0] if len(done) == len(grid) else None
                first: list[dict[str, Any] | None] = [tried[grid.index(best)]] if best else []
                cells[(method, h, p)] = {"search": tried, "best": best, "seeds": first}
                missing += sum(r is None for r in tried)
            more = [
                cell_jobs(base, method, h, p, s, *cells[(method, h, p)]["best"])
                for p in payloads
                if cells[(method, h, p)]["best"]
                for s in seeds_for(method, h, p, seeds)[1:]
            ]
            results = iter(runner.run(more))
            for p in payloads:
                if cells[(method, h, p)]["best"]:
                    got = [next(results) for _ in seeds_for(method, h, p, seeds)[1:]]
                    missing += sum(r is None for r in got)
                    cells[(method, h, p)]["seeds"] += got
    defaults = [] if args.quick else runner.run([default_job(base, s) for s in seeds])
    rows = summarise(cells, dp, grid)
    rep = {
        "command": "python bench/frontier.py"
        + (" --quick" if args.quick else "")
        + (f" --methods {args.methods}" if args.methods != ",".join(METHODS) else "")
        + (f" --h {args.h}" if args.h != ",".join(map(str, H_GRID)) else "")
        + (f" --payloads {args.payloads}" if args.payloads != ",".join(PAYLOADS) else ""),
        "date": utc_now(),
        "machine": machine(python=True, workers=args.workers),
        "code_digest": code,
        "wall_s_this_invocation": time.time() - started,
        "runs_trained_this_invocation": runner.trained,
        "runs": sum(1 for _ in runner.cells.cells()),
        "regime": {"common": base, "inner_lr": INNER_LR, "dp_lr": DP_LR, "search": SEARCH, "payloads": PAYLOADS},
        "dp": {
            "eval_loss": statistics.fmean(r["eval_loss"] for r in dp.values()) if dp else None,
            "seeds": len(dp),
        },
        "rows": rows,
        "targets": targets(rows),
        "headline": headline(rows, [r for r in defaults if r is not None], dp),
        "decoupled_vs_diloco": versus(rows),
        "covers": {"methods": methods, "H": hs, "payloads": payloads},
        "partial": "; ".join(
            part
            for part in (
                f"{missing} runs of these cells are not cached yet" if missing else "",
                (
                    f"this report covers {', '.join(methods)} at H = {', '.join(map(str, hs))} with "
                    f"{', '.join(payloads)} of the plan's {', '.join(METHODS)} at H = "
                    f"{', '.join(map(str, H_GRID))} with {', '.join(PAYLOADS)}"
                )
                if (set(methods), set(hs), set(payloads)) != (set(METHODS), set(H_GRID), set(PAYLOADS))
                else "",
            )
            if part
        )
        or None,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    figure = plot(rows, Path(args.out) / "frontier.png")
    rep["plot"] = figure.name if figure else None
    _publish(Path(args.out), "frontier", rep, markdown(rep), indent=1)
    if runner.pool:
        runner.pool.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
