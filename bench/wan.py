"""Thin links (issue 20, "what it must show" 1-4): bytes per step, training through emulated links,
faults on the link, and the relay's accuracy, with real processes on this machine.

    python bench/wan.py                      # everything (~40 min on 2 idle cores; resumes from its cache)
    python bench/wan.py --only i-int4,hold   # some cells only (cached ones are reused)
    python bench/wan.py --quick              # short cells into bench/cache/wan/quick (a smoke test, not a result)
    python bench/wan.py --report             # the report from cached cells only, training nothing
    python bench/wan.py --sim-encodings int4,fp32   # the simulator's rows for fp32 too (~3 min more)

Every cell is one ``ddiloco train --chaos`` run (syncer, 2 learners at one thread each, the
evaluator, and the relays of ``ddiloco link``) of the default workload (byte-level GPT on
Shakespeare, P = auto = 24, H = 24), with ``chaos.downtime_fraction=0`` and
``chaos.failures_per_learner=0``: the chaos section only puts the learners behind relays (no
process is killed unless a cell says so).

1. Bytes: the unlimited-link cells (i) of every encoding: measured steady-state bytes per learner
   per inner step up and down (summary.json ``traffic``), the ratio to data-parallel's fp32 ring
   all-reduce, one-off bytes apart, and the planner's prediction
   (``goodput.bandwidth.traffic_per_step`` at the run's params, P, H, M, encodings, tensors and
   measured step time) with its error.
2. Links: fp32, bf16, int8 and int4 (+ error feedback) on (i) unlimited relays, (ii) 100mbit,25ms,
   (iii) 10mbit,50ms, (iv) 2mbit,100ms,stall=0.01:200ms, (v) learner 0 unlimited and learner 1
   at 2mbit, (vi) both behind one 10mbit site link. Each cell ends at the same processed tokens
   (``run.processed_tokens``; a time cap as a guard). Per cell against (i) of its encoding: merged
   share, staleness, round latency (the tape), eval loss at equal processed tokens (the
   evaluator's points, the processed tokens at each point's fetch from the learners' step logs),
   what the encoding needs of the link against its rate. ``ddiloco simulate`` given the same
   link and the measured step times predicts merged share and round latency.
3. Faults on learner 1's link (int4 both ways + error feedback): a 30 s hold, a 30 s cut, a
   reset every 10 s, a flapping link (10 s up, 5 s cut), and a join over link (iv) (learner 1
   SIGKILLed mid-run by this script, restarted at once by the launcher): invariants
   (``report.invariants.check_run`` with the final sync and the restarted incarnation), goodput,
   learner 1's post-partition merges, learner 0's steps/s during the fault against before it.
4. The relay's accuracy: bytes through a relay at a 10 Mbit/s cap (one route, then two routes
   sharing a 10 Mbit/s site cap), measured throughput against the cap.

Cells are cached in bench/cache/wan/ (one JSON per cell, keyed by its settings), their run
folders in runs/bench-wan/. Writes docs/results/wan.md and .json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.cells import CellCache, cell_key  # noqa: E402  (bench/harness, beside this script)
from harness.cluster import Launch  # noqa: E402
from harness.files import read_json_dict as _json  # noqa: E402
from harness.files import read_jsonl as _jsonl  # noqa: E402
from harness.files import started_at as _started_at  # noqa: E402
from harness.files import step_logs  # noqa: E402
from harness.paths import CACHE, ENV, RESULTS, ROOT, sets  # noqa: E402
from harness.sampling import quantile_low  # noqa: E402
from harness.sampling import rate as _rate  # noqa: E402
from harness.tables import machine, met, publish, utc_now  # noqa: E402

CACHE_VERSION = 1
TOKENS = 400_000
"""Tokens the fleet processes in each link cell (about 45 s of training for 2 learners here)."""
QUICK_TOKENS = 60_000
CAP_S = 240.0
"""A link cell's time budget: a guard only (the cells end at their tokens)."""
TOKENS_PER_STEP = 1024
"""The default workload's batch: 8 sequences of 128 bytes."""
COMMON = [
    "run.num_learners=2",
    "run.seed=0",
    "chaos.enabled=true",
    "chaos.downtime_fraction=0",
    "chaos.failures_per_learner=0",
    "runtime.step_log=true",
    "runtime.eval_interval_s=2",
    "runtime.eval_every_tokens=40000",  # about every 8 s here (the automatic cadence is sized for long runs)
    "runtime.status_interval_s=0.5",
]
NO_DEMO_STRAGGLER = "chaos.stragglers=[]"
"""For a ``ddiloco simulate`` of a real cell: without a config file it adds the demo's 2x
straggler, which no real cell has (the simulated learners would run at 1x and 0.5x)."""
ENCODINGS: dict[str, list[str]] = {
    "fp32": ["algo.up_encoding=fp32", "algo.down_encoding=fp32", "algo.error_feedback=false"],
    "bf16": ["algo.up_encoding=bf16", "algo.down_encoding=bf16", "algo.error_feedback=false"],
    "int8": ["algo.up_encoding=int8", "algo.down_encoding=int8", "algo.error_feedback=false"],
    "int4": ["algo.up_encoding=int4", "algo.down_encoding=int4", "algo.error_feedback=true"],
    "int2": ["algo.up_encoding=int2", "algo.down_encoding=int2", "algo.error_feedback=true"],
}
"""The encoding both ways; int4 and int2 with error feedback (which changes no byte on the wire)."""
LINK_ENCODINGS = ("fp32", "bf16", "int8", "int4")
SKIP = ("iii-bf16", "iv-bf16", "v-bf16", "vi-bf16")
"""Cells left out by default so that the run fits about 40 minutes here (a link cell takes 75-110 s
of wall time with its start and final sync): bf16 on the slow links, the first cut the issue
allows (bf16 is int8's and fp32's neighbour; its bytes are measured on (i) and (ii)).
``--skip ''`` runs them too."""
BYTES_ONLY = ("int2",)
"""Encodings run on the unlimited link only (item 1's bytes)."""


@dataclass(frozen=True)
class Link:
    label: str
    settings: tuple[str, ...]
    up_bps: tuple[float, float]
    """Each learner's own cap (0: none)."""
    site_bps: float = 0.0
    """The cap both learners share (0: none)."""
    links: tuple[str, ...] = ()
    site: str = ""


def _link(label: str, links: tuple[str, ...] = (), site: str = "", caps=(0.0, 0.0), site_bps=0.0) -> Link:
    settings = [f"chaos.links={json.dumps(list(links))}"] if links else []
    if site:
        settings.append(f"chaos.site_link={site}")
    return Link(label, tuple(settings), caps, site_bps, links, site)


LINKS: dict[str, Link] = {
    "i": _link("unlimited (relays, no caps)", ("0:inf", "1:inf")),
    "ii": _link("100mbit,25ms", ("0:100mbit,25ms", "1:100mbit,25ms"), caps=(100e6, 100e6)),
    "iii": _link("10mbit,50ms", ("0:10mbit,50ms", "1:10mbit,50ms"), caps=(10e6, 10e6)),
    "iv": _link(
        "2mbit,100ms,stall=0.01:200ms",
        ("0:2mbit,100ms,stall=0.01:200ms", "1:2mbit,100ms,stall=0.01:200ms"),
        caps=(2e6, 2e6),
    ),
    "v": _link("learner 0 unlimited, learner 1 2mbit", ("0:inf", "1:2mbit"), caps=(0.0, 2e6)),
    "vi": _link("both behind one 10mbit site link", site="10mbit", site_bps=10e6),
}

FAULT_LINK = "10mbit,50ms"
"""Learner 1's link in the fault cells (learner 0 dials the syncer directly)."""


@dataclass(frozen=True)
class Fault:
    duration_s: float
    settings: tuple[str, ...]
    window: tuple[float, float] | None = None
    """The partition's [start, end) on the run's clock, for the before/during/after figures."""
    kill_at: float | None = None
    """This script SIGKILLs learner 1 at this time of the run's clock (the launcher restarts it)."""
    note: str = ""


def faults(quick: bool = False) -> dict[str, Fault]:
    """The fault cells; ``quick``: shorter ones (a smoke test of the code, not a result)."""
    link = f'chaos.links=["1:{FAULT_LINK}"]'
    if quick:
        return {
            "hold": Fault(45, (link, 'chaos.link_faults=["1:hold:10s@25s"]'), (25, 35), note="quick hold"),
            "cut": Fault(45, (link, 'chaos.link_faults=["1:cut:10s@25s"]'), (25, 35), note="quick cut"),
            "reset": Fault(45, (link, 'chaos.link_faults=["1:reset_every:10s"]'), note="quick resets"),
            "flap": Fault(45, (link, 'chaos.link_faults=["1:flap:10s/5s"]'), note="quick flap"),
            "join": Fault(60, ('chaos.links=["1:2mbit,100ms,stall=0.01:200ms"]',), kill_at=30.0, note="quick join"),
        }
    return {
        "hold": Fault(95, (link, 'chaos.link_faults=["1:hold:30s@30s"]'), (30, 60),
                      note="learner 1's link holds everything for 30 s from 30 s"),
        "cut": Fault(95, (link, 'chaos.link_faults=["1:cut:30s@30s"]'), (30, 60),
                     note="learner 1's link resets every connection for 30 s from 30 s"),
        "reset": Fault(150, (link, 'chaos.link_faults=["1:reset_every:10s"]'),
                       note="learner 1's connections reset every 10 s for 2.5 min (5 min cut short: the budget)"),
        "flap": Fault(80, (link, 'chaos.link_faults=["1:flap:10s/5s"]'),
                      note="learner 1's link up 10 s, cut 5 s, over and over"),
        "join": Fault(95, ('chaos.links=["1:2mbit,100ms,stall=0.01:200ms"]',), kill_at=35.0,
                      note="learner 1 behind link (iv), SIGKILLed at 35 s, restarted at once: its join over 2 Mbit/s"),
    }  # fmt: skip


FAULTS = faults()
FAULT_SETTINGS = ["run.processed_tokens=100000000", "inner.warmup_frac=0", *ENCODINGS["int4"]]
"""The fault cells run on their time budget (the LR at its peak, no warm-up over 1e8 tokens)."""


def key_of(name: str, settings: list[str], extra: dict[str, Any]) -> str:
    """A cell's cache key: its name and a digest of its settings (bench/cache/wan/KEY.json)."""
    return cell_key(name, {"v": CACHE_VERSION, "name": name, "settings": sorted(settings), **extra})


# ----------------------------------------------------------------------------- one run


def train(run_dir: Path, settings: list[str], timeout_s: float, kill_at: float | None = None) -> dict[str, Any]:
    """One ``ddiloco train --chaos`` run into ``run_dir``; with ``kill_at``, SIGKILL learner 1's
    process at that time of the run's clock. Returns what the driver saw."""
    import shutil

    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    run = Launch(["--chaos", "--run-dir", str(run_dir), *sets(settings)], run_dir.parent / f"{run_dir.name}.out")
    seen: dict[str, Any] = {"argv": ["ddiloco", *run.argv[3:]]}
    killed = False
    while run.running():
        if run.elapsed() > timeout_s:
            seen["timed_out"] = True
            run.stop(signal.SIGINT, 60)  # the launcher stops its children and writes the summary
            break
        if kill_at is not None and not killed:
            t0 = _started_at(run_dir)
            st = _json(run_dir / "status" / "learner-1.json")
            if t0 is not None and time.time() >= t0 + kill_at and st.get("pid"):
                try:
                    os.kill(int(st["pid"]), signal.SIGKILL)
                    seen["killed"] = {"pid": st["pid"], "incarnation": st.get("incarnation"), "t": time.time() - t0}
                except ProcessLookupError:
                    seen["killed"] = {"pid": st["pid"], "missing": True}
                killed = True
        time.sleep(0.1)
    seen["rc"] = run.wait()
    seen["wall_s"] = run.elapsed()
    return seen


# ----------------------------------------------------------------------------- reading a run folder


def rate(rows: list[tuple[float, float, int]], a: float, b: float) -> float | None:
    """Steps per second of a step log in [a, b) (None for an empty window)."""
    return None if b <= a else _rate([t for t, _, _ in rows], a, b)


def fetch_times(tape_rounds: list[Any], evals: list[dict[str, Any]]) -> list[float | None]:
    """When the evaluator fetched the model it evaluated: after the close of every round that made
    the versions it saw (the record's time is after the evaluation, which runs niced)."""
    made: dict[tuple[int, int], float] = {}
    for r in tape_rounds:
        if r.is_merge:
            made[(r.fragment, r.version)] = r.closed_at
    out: list[float | None] = []
    for e in evals:
        versions = e.get("versions")
        if e.get("final") or not isinstance(versions, dict):
            out.append(None)
            continue
        ts = [made.get((int(p), int(v)), 0.0) for p, v in versions.items() if int(v) > 0]
        out.append(max(ts) if ts else None)  # nothing merged yet: the initial model, at no known time
    return out


def tokens_at(steps: dict[int, list[tuple[float, float, int]]], t: float) -> int:
    return TOKENS_PER_STEP * sum(1 for rows in steps.values() for s, _, _ in rows if s <= t)


def analyse(run_dir: Path, seen: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run folder (everything the report needs; cached)."""
    from ddiloco.core.tape import RoundRecord

    t0 = _started_at(run_dir) or 0.0
    summary = _json(run_dir / "summary.json")
    steps = step_logs(run_dir, t0)
    tape = _jsonl(run_dir / "tape.jsonl")  # relative times (the summary wrote it)
    rounds = [r for r in (RoundRecord.from_json(x) for x in tape) if r is not None]
    steady = [r for r in rounds if r.close_reason != "final"]
    merges = [r for r in steady if r.is_merge]
    lat = sorted(r.closed_at - r.opened_at for r in merges)
    entries = [(r, e) for r in steady for e in r.took_part]
    P = int(summary.get("num_fragments") or 24)
    processed = float(summary.get("tokens_processed") or 0.0)
    evals = _jsonl(run_dir / "metrics" / "eval.jsonl")
    fetched = fetch_times(rounds, evals)
    eval_points = []
    for e, tf in zip(evals, fetched):
        tok = processed if e.get("final") else (tokens_at(steps, tf) if tf is not None else None)
        eval_points.append({"time": e.get("time"), "fetched_at": tf, "tokens": tok, "loss": e.get("loss"),
                            "final": bool(e.get("final"))})  # fmt: skip
    faults = _jsonl(run_dir / "metrics" / "faults.jsonl")
    per_learner: dict[str, Any] = {}
    for m, rows in sorted(steps.items()):
        ds = [d for _, d, _ in rows]
        mine = [(r, e) for r, e in entries if e.learner == m]
        per_learner[str(m)] = {
            "steps": len(rows),
            "first_step": rows[0][0] if rows else None,
            "last_step": rows[-1][0] if rows else None,
            "step_s_mean": statistics.fmean(ds) if ds else None,
            # steps/s while it trained: the steady rate (learners never block, so it says little)
            "steps_per_s": (len(rows) - 1) / (rows[-1][0] - rows[0][0]) if len(rows) > 2 else None,
            "merged": len(mine),
            "staleness_mean": statistics.fmean(e.staleness for _, e in mine) if mine else None,
            "tokens_merged": sum(e.tokens for _, e in mine) / P,
            "merge_times": [round(r.closed_at, 2) for r, _ in mine],
            "incarnations": sorted({e.incarnation for _, e in mine}),
        }
    all_ds = [d for rows in steps.values() for _, d, _ in rows]
    sync_merged = sum(e.tokens for _, e in entries) / P
    out: dict[str, Any] = {
        "seen": seen,
        "run_dir": str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else str(run_dir),
        "summary": {
            k: summary.get(k)
            for k in (
                "ended",
                "eval_loss",
                "tokens_processed",
                "tokens_merged",
                "merged_share",
                "goodput",
                "blocked",
                "down",
                "restarting",
                "starting",
                "failures",
                "num_fragments",
                "run_time_s",
                "rounds_per_fragment",
                "learners_per_merge",
                "late",
                "rejected",
                "invariant_violations",
                "traffic",
            )
        },  # fmt: skip
        "steady_merged_share": sync_merged / processed if processed else None,
        "step_s_mean": statistics.fmean(all_ds) if all_ds else None,
        "learners": per_learner,
        "rounds": len(merges),
        "round_latency_s": {
            "mean": statistics.fmean(lat) if lat else None,
            "median": statistics.median(lat) if lat else None,
            "p90": quantile_low(lat, 0.9),
        },
        "staleness_mean": statistics.fmean(e.staleness for _, e in entries) if entries else None,
        "staleness_max": max((e.staleness for _, e in entries), default=None),
        "evals": eval_points,
        "faults": [{"t": f.get("time"), "kind": f.get("kind"), "target": f.get("target")} for f in faults],
        "training_s": _training_span(steps),
    }
    return out


def _training_span(steps: dict[int, list[tuple[float, float, int]]]) -> float | None:
    firsts = [rows[0][0] for rows in steps.values() if rows]
    lasts = [rows[-1][0] for rows in steps.values() if rows]
    return max(lasts) - min(firsts) if firsts else None


def check_invariants(run_dir: Path, fragments: int, min_life_s: float) -> dict[str, Any]:
    """The soak's invariants on this run: check_run on the tape (nothing merged twice, versions
    increase, every learner process that ran long enough merged, the final sync), and the final
    model finite."""
    from safetensors.torch import load_file

    from ddiloco.report.invariants import Incarnation, check_run

    tape = _jsonl(run_dir / "tape.jsonl")
    learners = _jsonl(run_dir / "metrics" / "learners.jsonl")
    span: dict[tuple[int, int], list[float]] = {}
    for r in learners:
        if isinstance(r.get("learner"), int) and isinstance(r.get("incarnation"), int):
            span.setdefault((r["learner"], r["incarnation"]), []).append(float(r.get("time", 0.0)))
    ends = [r for r in _jsonl(run_dir / "metrics" / "run.jsonl") if r.get("what") == "end"]
    run_end = float(ends[-1]["time"]) if ends else None
    incs = []
    for (m, inc), ts in span.items():
        died = max(ts) if run_end is not None and max(ts) < run_end - 10 else None
        incs.append(Incarnation(m, inc, min(ts), died))
    # As the soak checks them (no run_end: a final-sync round that waited out a learner's liveness
    # timeout closes as "flush", which check_run's no_final_sync does not count; see final_sync below).
    v = check_run(tape, incarnations=incs, min_life_s=min_life_s)
    violations = [f"{x.kind}: {x.detail}" for x in v]
    stops = [r for r in _jsonl(run_dir / "metrics" / "run.jsonl") if r.get("what") == "end"]
    last: dict[int, str] = {}
    for r in tape:
        if r.get("event") == "round" and isinstance(r.get("fragment"), int):
            last[r["fragment"]] = str(r.get("close_reason"))
    final_sync = {"final": sum(1 for x in last.values() if x == "final"),
                  "flushed": sum(1 for x in last.values() if x == "flush"), "fragments": fragments}  # fmt: skip
    final = run_dir / "final" / "model.safetensors"
    if not final.exists():
        violations.append("no_final_model")
    elif not all(bool(t.isfinite().all()) for t in load_file(str(final)).values() if t.is_floating_point()):
        violations.append("global_not_finite: final model")
    return {"violations": violations, "incarnations": len(incs), "run_end": run_end, "final_sync": final_sync,
            "ended": bool(stops)}  # fmt: skip


def fault_figures(run_dir: Path, a: dict[str, Any], f: Fault, seen: dict[str, Any]) -> dict[str, Any]:
    """What the fault did: learner 0's steps/s before and during it, learner 1's steps during it
    and its merges after it; for the join, its times."""
    t0 = _started_at(run_dir) or 0.0
    steps = step_logs(run_dir, t0)
    out: dict[str, Any] = {}
    l0, l1 = steps.get(0, []), steps.get(1, [])
    start = max(rows[0][0] for rows in (l0, l1) if rows) if l0 and l1 else 0.0
    if f.window is not None:
        a0, b0 = f.window
        out["window"] = list(f.window)
        out["l0_steps_per_s_before"] = rate(l0, start + 2, a0)
        out["l0_steps_per_s_during"] = rate(l0, a0, b0)
        out["l0_steps_per_s_after"] = rate(l0, b0, b0 + 30)
        before = sorted(d for t, d, _ in l0 if start + 2 <= t < a0)
        out["l0_p99_step_before_s"] = quantile_low(before, 0.99)
        out["l0_max_step_during_s"] = max((d for t, d, _ in l0 if a0 <= t < b0), default=None)
        out["l1_steps_per_s_before"] = rate(l1, start + 2, a0)
        out["l1_steps_per_s_during"] = rate(l1, a0, b0)
        m1 = a["learners"].get("1", {}).get("merge_times", [])
        after = [t for t in m1 if t >= b0]
        out["l1_merges_before"] = sum(1 for t in m1 if t < a0)
        out["l1_merges_during"] = sum(1 for t in m1 if a0 <= t < b0)
        out["l1_merges_after"] = len(after)
        out["l1_first_merge_after_s"] = after[0] - b0 if after else None
        out["l1_steps_during"] = sum(1 for t, _, _ in l1 if a0 <= t < b0)
    else:
        m1 = a["learners"].get("1", {}).get("merge_times", [])
        m0 = a["learners"].get("0", {}).get("merge_times", [])
        span = (a.get("training_s") or 1.0) / 60
        out["l1_merges_per_min"] = len(m1) / span
        out["l0_merges_per_min"] = len(m0) / span
        out["l0_steps_per_s"] = a["learners"].get("0", {}).get("steps_per_s")
        out["l1_steps_per_s"] = a["learners"].get("1", {}).get("steps_per_s")
    link_faults = [x for x in a["faults"] if str(x.get("kind", "")).startswith("link")]
    kinds: dict[str, int] = {}
    for x in link_faults:
        kinds[x["kind"]] = kinds.get(x["kind"], 0) + 1
    out["link_faults_logged"] = kinds
    if f.kill_at is not None:
        out["join"] = join_figures(run_dir, t0, a, seen)
    return out


def join_figures(run_dir: Path, t0: float, a: dict[str, Any], seen: dict[str, Any]) -> dict[str, Any]:
    """The restarted learner 1: process start (the launcher's restart), 'joined the run' in its
    log, its first step, its first merged contribution."""
    from ddiloco.core.tape import RoundRecord

    restarts = [x["t"] for x in a["faults"] if x.get("kind") == "restart" and x.get("target") == "learner-1"]
    out: dict[str, Any] = {"killed": seen.get("killed"), "restart_at": restarts[0] if restarts else None}
    if not restarts:
        return out
    r0 = restarts[0]
    joined = []
    progress = 0
    for line in (run_dir / "logs" / "learner-1.log").read_text(errors="replace").splitlines():
        if "joined the run" in line or "joining:" in line:
            try:
                ts = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + float(line[20:23]) / 1000 - t0
            except ValueError:
                continue
            if ts >= r0 - 1 and "joined the run" in line:
                joined.append(ts)
            elif ts >= r0 - 1:
                progress += 1
    out["joined_at"] = joined[0] if joined else None
    out["join_s"] = joined[0] - r0 if joined else None
    out["join_progress_lines"] = progress
    steps = step_logs(run_dir, t0).get(1, [])
    old_pid = (seen.get("killed") or {}).get("pid")
    new = [t for t, _, pid in steps if pid != old_pid and t >= r0]
    out["first_step_s"] = new[0] - r0 if new else None
    old_inc = (seen.get("killed") or {}).get("incarnation")
    first = None
    for x in _jsonl(run_dir / "tape.jsonl"):
        r = RoundRecord.from_json(x)
        if r is None:
            continue
        for e in r.took_part:
            if e.learner == 1 and e.incarnation != old_inc and r.closed_at >= r0:
                first = r.closed_at if first is None else min(first, r.closed_at)
    out["first_merge_s"] = first - r0 if first is not None else None
    return out


# ----------------------------------------------------------------------------- cells


@dataclass
class Bench:
    cache: Path
    runs: Path
    tokens: int
    quick: bool
    only: set[str] | None
    report_only: bool
    trained: list[str] = field(default_factory=list)

    def wanted(self, name: str) -> bool:
        return self.only is None or name in self.only or (name.startswith("sim-") and "sim" in self.only)

    def cached(self, key: str) -> dict[str, Any] | None:
        return CellCache(self.cache).get(key)

    def store(self, key: str, rec: dict[str, Any]) -> None:
        CellCache(self.cache).put(key, rec)

    def link_cell(self, link: str, enc: str) -> dict[str, Any] | None:
        name = f"{link}-{enc}"
        settings = [*COMMON, f"run.processed_tokens={self.tokens}", f"runtime.duration_s={CAP_S:g}",
                    *ENCODINGS[enc], *LINKS[link].settings]  # fmt: skip
        key = key_of(name, settings, {})
        got = self.cached(key)
        if got is not None or self.report_only or not self.wanted(name):
            return got
        print(f"[{time.strftime('%H:%M:%S')}] cell {name}: training ...", flush=True)
        seen = train(self.runs / key, settings, CAP_S + 120)
        rec = {"name": name, "key": key, "link": link, "encoding": enc, "settings": settings,
               **analyse(self.runs / key, seen)}  # fmt: skip
        step_s = rec.get("step_s_mean") or 0.2
        rec["invariants"] = check_invariants(self.runs / key, rec["summary"].get("num_fragments") or 24,
                                             3 * 24 * step_s + 10)  # fmt: skip
        rec["cadence"] = contribution_cadence(self.runs / key, rec["summary"].get("num_fragments") or 24)
        self.store(key, rec)
        self.trained.append(name)
        _say(rec)
        return rec

    def fault_cell(self, name: str) -> dict[str, Any] | None:
        f = faults(self.quick)[name]
        dur = f.duration_s
        settings = [*COMMON, *FAULT_SETTINGS, f"runtime.duration_s={dur:g}", *f.settings]
        key = key_of(name, settings, {"kill_at": f.kill_at})
        got = self.cached(key)
        if got is not None or self.report_only or not self.wanted(name):
            return got
        print(f"[{time.strftime('%H:%M:%S')}] fault {name}: training {dur:.0f} s ...", flush=True)
        seen = train(self.runs / key, settings, dur + 180, kill_at=f.kill_at)
        a = analyse(self.runs / key, seen)
        rec = {"name": name, "key": key, "settings": settings, "note": f.note, **a}
        step_s = a.get("step_s_mean") or 0.2
        # a learner process that ran 3 H-cycles of steps (and 10 s of joining) must have merged
        rec["invariants"] = check_invariants(self.runs / key, a["summary"].get("num_fragments") or 24,
                                             3 * 24 * step_s + 10)  # fmt: skip
        rec["fault"] = fault_figures(self.runs / key, a, f, seen)
        self.store(key, rec)
        self.trained.append(name)
        _say(rec)
        return rec

    def sim_cell(self, real: dict[str, Any]) -> tuple[str, list[str], Path] | dict[str, Any] | None:
        """The simulator given the real cell's link and step times: cached result, or the job."""
        name = f"sim-{real['name']}"
        step_s = real.get("step_s_mean")
        per = [real["learners"].get(str(m), {}).get("step_s_mean") for m in (0, 1)]
        if not step_s or not all(per):
            return None
        speeds = [round(step_s / s, 4) for s in per]
        link = LINKS[real["link"]]
        settings = [*COMMON[:5], NO_DEMO_STRAGGLER, f"run.processed_tokens={self.tokens}",
                    *ENCODINGS[real["encoding"]], *link.settings, f"sim.step_time_s={step_s:.5f}",
                    f"sim.speeds={json.dumps(speeds)}", "run.eval_points=1"]  # fmt: skip
        key = key_of(name, settings, {})
        got = self.cached(key)
        if got is not None or self.report_only or not self.wanted(name):
            return got
        return key, settings, self.runs / key

    def run_sims(self, jobs: list[tuple[str, list[str], Path]], workers: int = 2) -> None:
        """Simulations are virtual time: two at once, while no real cell runs."""
        import shutil

        pending, running = list(jobs), []
        while pending or running:
            while pending and len(running) < workers:
                key, settings, run_dir = pending.pop(0)
                if run_dir.exists():
                    shutil.rmtree(run_dir)
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                argv = [sys.executable, "-m", "ddiloco", "simulate", "--run-dir", str(run_dir), *sets(settings)]
                out = open(run_dir.parent / f"{key}.out", "wb")
                print(f"[{time.strftime('%H:%M:%S')}] simulate {key} ...", flush=True)
                running.append((key, settings, run_dir, subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                                                         env=ENV), time.time()))  # fmt: skip
            for job in list(running):
                key, settings, run_dir, p, t = job
                if p.poll() is None:
                    continue
                running.remove(job)
                a = analyse_sim(run_dir)
                a.update({"key": key, "settings": settings, "rc": p.returncode, "wall_s": time.time() - t})
                self.store(key, a)
                self.trained.append(key)
            time.sleep(0.2)


def analyse_sim(run_dir: Path) -> dict[str, Any]:
    from ddiloco.core.tape import RoundRecord

    s = _json(run_dir / "summary.json")
    rounds = [r for r in (RoundRecord.from_json(x) for x in _jsonl(run_dir / "tape.jsonl")) if r is not None]
    merges = [r for r in rounds if r.close_reason != "final" and r.is_merge]
    lat = [r.closed_at - r.opened_at for r in merges]
    entries = [e for r in merges for e in r.took_part]
    P = int(s.get("num_fragments") or 24)
    processed = float(s.get("tokens_processed") or 0.0)
    return {
        "merged_share": s.get("merged_share"),
        "steady_merged_share": sum(e.tokens for e in entries) / P / processed if processed else None,
        "round_latency_s": {
            "mean": statistics.fmean(lat) if lat else None,
            "median": statistics.median(lat) if lat else None,
        },  # fmt: skip
        "staleness_mean": statistics.fmean(e.staleness for e in entries) if entries else None,
        "eval_loss": s.get("eval_loss"),
        "traffic": s.get("traffic"),
        "run_time_s": s.get("run_time_s"),
    }


def _say(rec: dict[str, Any]) -> None:
    s = rec["summary"]
    tr = s.get("traffic") or {}
    lat = rec["round_latency_s"]
    print(
        f"    {rec['name']}: {rec['seen'].get('wall_s', 0):.0f} s wall, training {rec.get('training_s') or 0:.0f} s, "
        f"step {1000 * (rec.get('step_s_mean') or 0):.0f} ms, merged {s.get('merged_share') or 0:.3f} "
        f"(steady {rec.get('steady_merged_share') or 0:.3f}), latency {lat['median'] or 0:.2f} s, "
        f"up {tr.get('up_bytes_per_step') or 0:,.0f} B/step, down {tr.get('down_bytes_per_step') or 0:,.0f} B/step, "
        f"loss {s.get('eval_loss') or 0:.4f}, violations {len(rec['invariants']['violations'])}",
        flush=True,
    )


# ----------------------------------------------------------------------------- the relay's accuracy


def relay_accuracy(nbytes: int = 6_000_000, cap: str = "10mbit") -> dict[str, Any]:
    """Bytes through relays on this machine's loopback: one route at the cap, then two routes
    at once sharing it as a site cap; received bytes over the time they took, against the cap."""
    from ddiloco.link.config import parse_link, parse_rate, parse_site_rate
    from ddiloco.link.relay import RelayThread, Route

    def sink(srv: socket.socket, got: list[tuple[float, int]]) -> None:
        conn, _ = srv.accept()
        while True:
            data = conn.recv(1 << 16)
            if not data:
                break
            got.append((time.monotonic(), len(data)))
        conn.close()

    def measure(routes_n: int, link: str, site: float) -> dict[str, Any]:
        servers, got, threads = [], [], []
        for _ in range(routes_n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(1)
            servers.append(s)
            got.append([])
        routes = [Route(f"acc-{i}", ("127.0.0.1", 0), ("127.0.0.1", s.getsockname()[1]), parse_link(link))
                  for i, s in enumerate(servers)]  # fmt: skip
        relay = RelayThread(routes, time.monotonic, site_rate_bps=site)
        try:
            for s, g in zip(servers, got):
                th = threading.Thread(target=sink, args=(s, g), daemon=True)
                th.start()
                threads.append(th)
            clients = []
            for port in relay.ports:
                c = socket.create_connection(("127.0.0.1", port))
                clients.append(c)
            block = b"\0" * (1 << 16)
            senders = []
            for c in clients:

                def send(c: socket.socket = c) -> None:
                    left = nbytes // routes_n
                    while left > 0:
                        n = c.send(block[: min(left, len(block))])
                        left -= n
                    c.shutdown(socket.SHUT_WR)

                th = threading.Thread(target=send, daemon=True)
                th.start()
                senders.append(th)
            for th in senders:
                th.join(120)
            for th in threads:
                th.join(120)
            for c in clients:
                c.close()
        finally:
            relay.close()
            for s in servers:
                s.close()
        chunks = sorted(x for g in got for x in g)
        total = sum(n for _, n in chunks)
        t_first, t_last = chunks[0][0], chunks[-1][0]
        measured = (total - chunks[0][1]) * 8 / (t_last - t_first)  # bytes after the first read, over their time
        return {"bytes": total, "seconds": t_last - t_first, "measured_bps": measured}

    rate_bps = parse_rate(cap)
    one = measure(1, cap, 0.0)
    one.update({"cap_bps": rate_bps, "ratio": one["measured_bps"] / rate_bps, "what": f"one route at {cap}"})
    site = measure(2, "inf", parse_site_rate(cap))
    site.update({"cap_bps": rate_bps, "ratio": site["measured_bps"] / rate_bps,
                 "what": f"two routes (no own cap) sharing a {cap} site link, both sending at once"})  # fmt: skip
    return {"rows": [one, site]}


# ----------------------------------------------------------------------------- the report


def planner(rec: dict[str, Any]) -> dict[str, Any]:
    """traffic_per_step at the run's params, P, H, M, encodings, tensors and measured step time."""
    from ddiloco.config import load_config
    from ddiloco.goodput.bandwidth import traffic_per_step
    from ddiloco.training.layout import synced_tensors
    from ddiloco.workloads.config import load_workload

    cfg = load_config(None, rec["settings"])
    wl = load_workload(cfg.workload)
    tensors = len(synced_tensors(wl.build_model(cfg.run.seed)))
    tr = rec["summary"]["traffic"]
    st = traffic_per_step(int(tr["params"]), int(rec["summary"]["num_fragments"]), cfg.algo.sync_every,
                          cfg.run.num_learners, cfg.algo.up_encoding, cfg.algo.down_encoding, tensors=tensors,
                          step_s=rec["step_s_mean"] or None,
                          heartbeat_interval_s=cfg.runtime.heartbeat_interval_s)  # fmt: skip
    return {"tensors": tensors, "H": cfg.algo.sync_every, **st.to_json()}


def interp(points: list[tuple[float, float]], x: float) -> float | None:
    pts = sorted(points)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if pts and abs(pts[-1][0] - x) < 1e-9:
        return pts[-1][1]
    return None


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def build_report(cells: dict[str, dict[str, Any]], sims: dict[str, dict[str, Any]], faults: dict[str, dict[str, Any]],
                 relay: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    rep: dict[str, Any] = {"bytes": [], "links": [], "sim": [], "faults": {}, "relay": relay, "checks": []}
    # 1. bytes, from the unlimited cells
    for enc in ENCODINGS:
        rec = cells.get(f"i-{enc}")
        if rec is None or not (rec["summary"].get("traffic") or {}).get("up_bytes_per_step"):
            continue
        tr = rec["summary"]["traffic"]
        pred = planner(rec)
        by = tr.get("by_learner", {})
        cadence = rec.get("cadence") or contribution_cadence(
            ROOT / rec["run_dir"], int(rec["summary"]["num_fragments"])
        )
        rep["bytes"].append({
            "encoding": enc + (" +EF" if "algo.error_feedback=true" in rec["settings"] else ""),
            "up": tr["up_bytes_per_step"], "down": tr["down_bytes_per_step"],
            "dp": tr["dp_bytes_per_step"], "dp_ratio_up": tr["dp_ratio_up"], "dp_ratio_down": tr["dp_ratio_down"],
            "pred_up": pred["up_bytes_per_step"], "pred_down": pred["down_bytes_per_step"],
            "pred_dp_ratio_up": pred["dp_ratio_up"], "pred_dp_ratio_down": pred["dp_ratio_down"],
            "err_up": tr["up_bytes_per_step"] / pred["up_bytes_per_step"] - 1,
            "err_down": tr["down_bytes_per_step"] / pred["down_bytes_per_step"] - 1,
            "one_off_up_learners": sum(v.get("one_off_up_bytes", 0) for k, v in by.items() if k != "unattributed"),
            "one_off_down_learners": sum(v.get("one_off_down_bytes", 0) for k, v in by.items() if k != "unattributed"),
            "one_off_down_observers": (by.get("unattributed") or {}).get("one_off_down_bytes", 0),
            "steps": tr.get("steps"), "step_s": rec["step_s_mean"], "planner": pred, **cadence,
        })  # fmt: skip
    # 2. links: each cell against (i) of its encoding
    for enc in LINK_ENCODINGS:
        group = {lk: cells[f"{lk}-{enc}"] for lk in LINKS if f"{lk}-{enc}" in cells}
        base = group.get("i")
        # eval loss at equal processed tokens: the smallest last periodic evaluation's tokens
        finals = [max((p["tokens"] or 0 for p in g["evals"] if not p["final"]), default=0) for g in group.values()]
        common = min(finals) if finals else 0
        for lk, rec in group.items():
            s = rec["summary"]
            tr = s.get("traffic") or {}
            base_tr = (base["summary"].get("traffic") or {}) if base else {}
            loss_eq = interp(
                [(p["tokens"], p["loss"]) for p in rec["evals"] if not p["final"] and p["tokens"] is not None], common
            )
            need = need_bps(rec, base_tr, LINKS[lk])
            row = {
                "link": lk, "label": LINKS[lk].label, "encoding": enc,
                "merged_share": s.get("merged_share"), "steady_merged_share": rec.get("steady_merged_share"),
                "staleness_mean": rec.get("staleness_mean"), "staleness_max": rec.get("staleness_max"),
                "latency_median": rec["round_latency_s"]["median"], "latency_mean": rec["round_latency_s"]["mean"],
                "latency_p90": rec["round_latency_s"]["p90"], "rounds": rec["rounds"],
                "tokens": s.get("tokens_processed"), "loss_final": s.get("eval_loss"),
                "loss_at_common": loss_eq, "common_tokens": common, "step_s": rec.get("step_s_mean"),
                "up_bytes_per_step": tr.get("up_bytes_per_step"), "down_bytes_per_step": tr.get("down_bytes_per_step"),
                "training_s": rec.get("training_s"), "wall_s": rec["seen"].get("wall_s"),
                "late": s.get("late"), "violations": len(rec["invariants"]["violations"]),
                "learner_staleness": {m: v.get("staleness_mean") for m, v in rec["learners"].items()},
                **need,
            }  # fmt: skip
            if base:
                b = base["summary"]
                row["share_vs_i"] = _ratio(s.get("merged_share"), b.get("merged_share"))
                row["steady_share_vs_i"] = _ratio(rec.get("steady_merged_share"), base.get("steady_merged_share"))
                row["latency_vs_i"] = _ratio(row["latency_median"], base["round_latency_s"]["median"])
                base_loss = interp(
                    [(p["tokens"], p["loss"]) for p in base["evals"] if not p["final"] and p["tokens"] is not None],
                    common,
                )
                row["loss_vs_i"] = _ratio(loss_eq, base_loss)
                row["final_loss_vs_i"] = _ratio(s.get("eval_loss"), b.get("eval_loss"))
            rep["links"].append(row)
    # simulator vs measured
    for name, sim in sims.items():
        real = cells[name]
        rep["sim"].append({
            "cell": name, "link": real["link"], "encoding": real["encoding"],
            "share": real["summary"].get("merged_share"), "share_sim": sim.get("merged_share"),
            "share_err": _ratio(sim.get("merged_share"), real["summary"].get("merged_share")),
            "steady_share": real.get("steady_merged_share"), "steady_share_sim": sim.get("steady_merged_share"),
            "latency": real["round_latency_s"]["median"], "latency_sim": sim["round_latency_s"]["median"],
            "latency_err": _ratio(sim["round_latency_s"]["median"], real["round_latency_s"]["median"]),
            "latency_mean": real["round_latency_s"]["mean"], "latency_mean_sim": sim["round_latency_s"]["mean"],
            "staleness": real.get("staleness_mean"), "staleness_sim": sim.get("staleness_mean"),
            "sim_step_s": real.get("step_s_mean"),
        })  # fmt: skip
    # 3. faults
    for name, rec in faults.items():
        s = rec["summary"]
        rep["faults"][name] = {
            "note": rec["note"], "goodput": s.get("goodput"), "merged_share": s.get("merged_share"),
            "starting": s.get("starting"), "restarting": s.get("restarting"), "down": s.get("down"),
            "violations": rec["invariants"]["violations"], "summary_violations": s.get("invariant_violations"),
            "final_sync": rec["invariants"].get("final_sync"),
            "eval_loss": s.get("eval_loss"), "training_s": rec.get("training_s"), **rec["fault"],
            "l1_merged": rec["learners"].get("1", {}).get("merged"),
            "l0_merged": rec["learners"].get("0", {}).get("merged"),
            "staleness_l1": rec["learners"].get("1", {}).get("staleness_mean"),
            "l1_incarnations_merged": len(rec["learners"].get("1", {}).get("incarnations", [])),
        }  # fmt: skip
    checks(rep)
    return rep


def contribution_cadence(run_dir: Path, fragments: int, H: int = 24) -> dict[str, Any]:
    """How often the learners answered, against the planner's one contribution per fragment per H
    steps (metrics/traffic.json of the run folder, when it is still there), and the measured
    bytes of one contribution."""
    t = _json(run_dir / "metrics" / "traffic.json").get("by_learner") or {}
    rows = [v for k, v in t.items() if k != "unattributed" and isinstance(v, dict)]
    steps = sum(v.get("steps", 0) for v in rows)
    msgs = sum(((v.get("up") or {}).get("contribution") or {}).get("messages", 0) for v in rows)
    nbytes = sum(((v.get("up") or {}).get("contribution") or {}).get("bytes", 0) for v in rows)
    if not steps or not msgs:
        return {}
    return {"cadence": msgs / steps * H / fragments, "bytes_per_contribution": nbytes / msgs}


def need_bps(rec: dict[str, Any], base_tr: dict[str, Any], link: Link) -> dict[str, Any]:
    """What the encoding needs of the link at this cell's step rate (the unlimited cell's steady
    bytes per step, times steps/s, per direction), against the link's rate; and what it carried
    (all bytes of the learners' links, one-off included, over the run's length)."""
    up = base_tr.get("up_bytes_per_step")
    down = base_tr.get("down_bytes_per_step")
    out: dict[str, Any] = {}
    if not up or not down:
        return out
    needs = []
    for m in ("0", "1"):
        sps = rec["learners"].get(m, {}).get("steps_per_s") or 0.0
        needs.append((8 * up * sps, 8 * down * sps))
    out["need_up_bps"] = [n[0] for n in needs]
    out["need_down_bps"] = [n[1] for n in needs]
    loads = []
    for m, (nu, nd) in enumerate(needs):
        if link.up_bps[m]:
            loads.append(max(nu, nd) / link.up_bps[m])
    if link.site_bps:
        loads.append(max(sum(n[0] for n in needs), sum(n[1] for n in needs)) / link.site_bps)
    out["load"] = max(loads) if loads else 0.0
    out["saturated"] = bool(loads) and max(loads) > 1.0
    tr = rec["summary"].get("traffic") or {}
    by = tr.get("by_learner") or {}
    span = rec["summary"].get("run_time_s") or 0.0
    if span:
        out["carried_down_bps"] = [8 * ((by.get(m) or {}).get("down_bytes", 0) + (by.get(m) or {}).get(
            "one_off_down_bytes", 0)) / span for m in ("0", "1")]  # fmt: skip
    return out


def checks(rep: dict[str, Any]) -> None:
    c = rep["checks"]

    def add(what: str, value: str, target: str, met: bool | None) -> None:
        c.append({"what": what, "value": value, "target": target, "met": met})

    int4 = next((r for r in rep["bytes"] if r["encoding"].startswith("int4")), None)
    if int4:
        lo = min(int4["dp_ratio_up"], int4["dp_ratio_down"])
        add("int4 both ways: x fewer bytes per step than data-parallel's fp32 ring (up, down)",
            f"{int4['dp_ratio_up']:.0f}x, {int4['dp_ratio_down']:.0f}x", ">= 150x", lo >= 150)  # fmt: skip
    if rep["bytes"]:
        worst = max(max(abs(r["err_up"]), abs(r["err_down"])) for r in rep["bytes"])
        add("planner vs measured steady bytes per step, every encoding both ways (largest error)",
            f"{worst:.1%}", "<= 10%", worst <= 0.10)  # fmt: skip
    iii = next((r for r in rep["links"] if r["link"] == "iii" and r["encoding"] == "int4"), None)
    if iii and iii.get("share_vs_i") is not None:
        add(
            "int4 on (iii) 10mbit,50ms: merged share vs (i)",
            f"{iii['share_vs_i']:.3f}",
            "within 5%",
            abs(iii["share_vs_i"] - 1) <= 0.05,
        )
        if iii.get("loss_vs_i") is not None:
            add(
                f"int4 on (iii): eval loss vs (i) at equal processed tokens ({iii['common_tokens']:,})",
                f"{iii['loss_vs_i']:.4f}",
                "within 1%",
                abs(iii["loss_vs_i"] - 1) <= 0.01,
            )
    for r in rep["sim"]:
        for what, e in (("merged share", r["share_err"]), ("round latency (median)", r["latency_err"])):
            if e is not None:
                add(
                    f"simulator vs measured, {r['encoding']} on ({r['link']}): {what}",
                    f"{e:.3f}",
                    "within 15%",
                    abs(e - 1) <= 0.15,
                )
    for name, f in rep["faults"].items():
        add(f"fault '{name}': invariant violations", str(len(f["violations"])), "0", not f["violations"])
        if "l1_merges_after" in f:
            add(
                f"fault '{name}': learner 1's merges after the partition",
                str(f["l1_merges_after"]),
                "> 0",
                f["l1_merges_after"] > 0,
            )
            b, d = f.get("l0_steps_per_s_before"), f.get("l0_steps_per_s_during")
            if b and d is not None:
                add(
                    f"fault '{name}': learner 0's steps/s during / before",
                    f"{d / b:.3f}",
                    ">= 0.9 (never waits)",
                    d / b >= 0.9,
                )
        if "join" in f:
            j = f["join"]
            add("join over link (iv): completed (joined, then merged)",
                f"joined in {_f(j.get('join_s'), '{:.1f}')} s, first merge {_f(j.get('first_merge_s'), '{:.1f}')} s",
                "completes", j.get("join_s") is not None and j.get("first_merge_s") is not None)  # fmt: skip
    if rep["relay"]:
        for r in rep["relay"]["rows"]:
            add(
                f"relay accuracy: {r['what']}",
                f"{r['measured_bps'] / 1e6:.2f} Mbit/s = {r['ratio']:.3f} x cap",
                "within 10%",
                abs(r["ratio"] - 1) <= 0.10,
            )


def _f(x: Any, fmt: str = "{:.3f}", none: str = "-") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x)) else none


def to_markdown(rep: dict[str, Any]) -> str:
    L = [
        "# Thin links: bytes, emulated WAN links, link faults (issue 20)",
        "",
        f"Command: `{rep['command']}` ({rep['date']}, {rep['machine']['cpus']} CPUs, {rep['machine']['platform']}; "
        f"{len(rep['trained_this_invocation'])} cells trained in {rep['wall_s_this_invocation'] / 60:.0f} min this "
        "invocation, the rest from bench/cache/wan/)." + (f" {rep['note']}" if rep.get("note") else ""),
        "",
        "Every cell is one `ddiloco train --chaos` run: a syncer, 2 learners at one thread each, the evaluator, and "
        "one relay per learner (`ddiloco link`), on this machine's loopback, with the default workload (byte-level "
        f"GPT on Shakespeare, {rep['params']:,} parameters, P = 24 fragments, H = 24) and "
        f"`{' '.join(COMMON)}`. The link cells end at {rep['tokens']:,} processed tokens; the fault cells run on "
        "their time budget. The chaos section only places relays and link faults: no process is killed unless a "
        "row says so.",
        "",
        "## 1. Bytes per learner per inner step (unlimited relays, cells (i))",
        "",
        "Measured: summary.json `traffic` (steady state: contributions, versions, requests, acks, heartbeats, per "
        "learner per inner step). Predicted: `traffic_per_step(params, P, H, M = 2, encoding, down_encoding, "
        "tensors, step_s = measured mean step, heartbeat 0.5 s)`. Data-parallel: fp32 ring all-reduce, "
        f"{rep['bytes'][0]['dp'] if rep['bytes'] else 0:,.0f} bytes per learner per step each way.",
        "",
        "| encoding | up measured | up predicted | error | down measured | down predicted | error | x fewer than "
        "DP (up / down) | predicted x fewer | contributions per fragment per H steps | bytes per contribution "
        "| one-off up / down, learners | one-off down, evaluator |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["bytes"]:
        L.append(
            f"| {r['encoding']} | {r['up']:,.0f} | {r['pred_up']:,.0f} | {r['err_up']:+.1%} | {r['down']:,.0f} | "
            f"{r['pred_down']:,.0f} | {r['err_down']:+.1%} | {r['dp_ratio_up']:.1f} / {r['dp_ratio_down']:.1f} | "
            f"{r['pred_dp_ratio_up']:.1f} / {r['pred_dp_ratio_down']:.1f} | {_f(r.get('cadence'))} | "
            f"{_f(r.get('bytes_per_contribution'), '{:,.0f}')} | {r['one_off_up_learners']:,.0f} / "
            f"{r['one_off_down_learners']:,.0f} | {r['one_off_down_observers']:,.0f} |"
        )
    L += [
        "",
        "The planner assumes one contribution per fragment per H inner steps (1.000 in the cadence column); the "
        "runs answered less often (the syncer's round clock ticks at its estimate of the step time, the median of "
        "the learners' reported step-time EMAs, and the start and the final sync have no steady rounds), which is "
        "where measured bytes per step fall short of the planner; per contribution the bytes are the planner's "
        "payload plus headers.",
        "",
        "One-off bytes (not in the per-step figures): registration, each learner's join (the full model in fp32), "
        "rejoins, the final sync and the run's end; the evaluator's fetches of the global model (fp32, never "
        "relayed) are the last column.",
        "",
        "## 2. Training through emulated links",
        "",
        "Per cell, against (i) of the same encoding. Merged share: summary.json `merged_share` (tokens merged into "
        "the global model / tokens processed, the final sync included); steady: rounds before the final sync only. "
        "Round latency: the tape's merged rounds before the final sync, `closed_at - opened_at` (median). Loss: "
        "the evaluator's points, each at the processed tokens of its fetch (the tape's rounds bound when it "
        "fetched), interpolated at the encoding's common token count (the smallest last periodic point among its "
        "cells); final: after the final sync. Need: the encoding's steady bytes per step on (i) times this cell's "
        "steps/s, against the link's rate (per learner; summed for the site link); > 1.0 = saturated.",
        "",
        "| link | enc | merged share (vs i) | steady share (vs i) | staleness mean / max | round latency median (vs i) "
        "| p90 | loss at common tokens (vs i) | final loss (vs i) | step ms | need / rate | saturated |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["links"]:
        L.append(
            f"| ({r['link']}) {r['label']} | {r['encoding']} | {_f(r['merged_share'])} ({_f(r.get('share_vs_i'))}) | "
            f"{_f(r['steady_merged_share'])} ({_f(r.get('steady_share_vs_i'))}) | "
            f"{_f(r['staleness_mean'], '{:.2f}')} / "
            f"{_f(r['staleness_max'], '{:.0f}')} | {_f(r['latency_median'], '{:.2f} s')} "
            f"({_f(r.get('latency_vs_i'), '{:.2f}x')}) | {_f(r['latency_p90'], '{:.2f} s')} | "
            f"{_f(r['loss_at_common'], '{:.4f}')} ({_f(r.get('loss_vs_i'), '{:.4f}')}) | "
            f"{_f(r['loss_final'], '{:.4f}')} ({_f(r.get('final_loss_vs_i'), '{:.4f}')}) | "
            f"{_f(r['step_s'] and 1000 * r['step_s'], '{:.0f}')} | {_f(r.get('load'), '{:.2f}')} | "
            f"{'**yes**' if r.get('saturated') else 'no'} |"
        )
    if rep["links"]:
        commons = {r["encoding"]: r["common_tokens"] for r in rep["links"]}
        L += ["", "Common token counts: " + ", ".join(f"{e} {t:,}" for e, t in commons.items()) + "."]
    if rep.get("skipped"):
        L += ["", f"Left out to fit the run into about 40 minutes: {', '.join(rep['skipped'])} (bf16 on the slow "
              "links, the first cut allowed; `--skip ''` runs them)."]  # fmt: skip
    if rep["sim"]:
        L += [
            "",
            "### The simulator given the same link",
            "",
            "`ddiloco simulate` with the cell's config (the same `chaos.links` / `chaos.site_link`), "
            "`sim.step_time_s` = the cell's measured mean step time and `sim.speeds` from each learner's.",
            "",
            "| link | enc | merged share measured / simulated (ratio) | steady share measured / simulated | round "
            "latency median measured / simulated (ratio) | mean measured / simulated | staleness measured / "
            "simulated |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rep["sim"]:
            L.append(
                f"| ({r['link']}) | {r['encoding']} | {_f(r['share'])} / {_f(r['share_sim'])} ({_f(r['share_err'])}) | "
                f"{_f(r['steady_share'])} / {_f(r['steady_share_sim'])} | {_f(r['latency'], '{:.2f}')} / "
                f"{_f(r['latency_sim'], '{:.2f}')} s ({_f(r['latency_err'])}) | {_f(r['latency_mean'], '{:.2f}')} / "
                f"{_f(r['latency_mean_sim'], '{:.2f}')} s | {_f(r['staleness'], '{:.2f}')} / "
                f"{_f(r['staleness_sim'], '{:.2f}')} |"
            )
    if rep["faults"]:
        L += [
            "",
            f"## 3. Faults on learner 1's link (int4 both ways + error feedback; learner 1 behind {FAULT_LINK} "
            "unless said)",
            "",
            "| fault | what | goodput | merged share | invariant violations | learner 0 steps/s before / during | "
            "learner 0 step p99 before / longest during | learner 1 steps/s during | learner 1 merges before / "
            "during / after | first merge after the end |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, f in rep["faults"].items():
            if "window" in f:
                L.append(
                    f"| {name} | {f['note']} | {_f(f['goodput'], '{:.1%}')} | {_f(f['merged_share'])} | "
                    f"{len(f['violations'])} | {_f(f['l0_steps_per_s_before'], '{:.2f}')} / "
                    f"{_f(f['l0_steps_per_s_during'], '{:.2f}')} | {_f(f.get('l0_p99_step_before_s'), '{:.3f}')} / "
                    f"{_f(f.get('l0_max_step_during_s'), '{:.3f}')} s | {_f(f['l1_steps_per_s_during'], '{:.2f}')} | "
                    f"{f['l1_merges_before']} / {f['l1_merges_during']} / {f['l1_merges_after']} | "
                    f"{_f(f['l1_first_merge_after_s'], '{:.1f} s')} |"
                )
            else:
                L.append(
                    f"| {name} | {f['note']} | {_f(f['goodput'], '{:.1%}')} | {_f(f['merged_share'])} | "
                    f"{len(f['violations'])} | {_f(f.get('l0_steps_per_s'), '{:.2f}')} (whole run) | "
                    "- | "
                    f"{_f(f.get('l1_steps_per_s'), '{:.2f}')} (whole run) | merges/min: learner 0 "
                    f"{_f(f.get('l0_merges_per_min'), '{:.1f}')}, "
                    f"learner 1 {_f(f.get('l1_merges_per_min'), '{:.1f}')} | "
                    "- |"
                )
        L += ["", "| fault | link faults logged (metrics/faults.jsonl) | starting / restarting / down | "
                  "final eval loss | final sync: fragments closed final / flushed | violations |",
              "|---|---|---|---|---|---|"]  # fmt: skip
        for name, f in rep["faults"].items():
            kinds = ", ".join(f"{k} x{n}" for k, n in f["link_faults_logged"].items()) or "-"
            fs = f.get("final_sync") or {}
            L.append(
                f"| {name} | {kinds} | {_f(f['starting'], '{:.1%}')} / {_f(f['restarting'], '{:.1%}')} / "
                f"{_f(f['down'], '{:.1%}')} | {_f(f['eval_loss'], '{:.4f}')} | {fs.get('final', '-')} / "
                f"{fs.get('flushed', '-')} of {fs.get('fragments', '-')} | {'; '.join(f['violations']) or 'none'} |"
            )
        j = (rep["faults"].get("join") or {}).get("join")
        if j:
            L += [
                "",
                f"Join over link (iv): learner 1 SIGKILLed at {_f((j.get('killed') or {}).get('t'), '{:.1f}')} s, "
                f"restarted at {_f(j.get('restart_at'), '{:.1f}')} s; it logged 'joined the run' "
                f"{_f(j.get('join_s'), '{:.1f}')} s after its restart ({j.get('join_progress_lines', 0)} progress "
                f"lines on the way), its first step {_f(j.get('first_step_s'), '{:.1f}')} s and its first merged "
                f"contribution {_f(j.get('first_merge_s'), '{:.1f}')} s after the restart.",
            ]
    if rep["relay"]:
        L += ["", "## 4. The relay's accuracy on real time", "",
              "| what | bytes | seconds | measured | cap | ratio |", "|---|---|---|---|---|---|"]  # fmt: skip
        for r in rep["relay"]["rows"]:
            L.append(
                f"| {r['what']} | {r['bytes']:,} | {r['seconds']:.2f} | {r['measured_bps'] / 1e6:.3f} Mbit/s | "
                f"{r['cap_bps'] / 1e6:.0f} Mbit/s | {r['ratio']:.3f} |"
            )
    L += ["", "## Checks", "", "| check | value | target | met |", "|---|---|---|---|"]
    for c in rep["checks"]:
        L.append(f"| {c['what']} | {c['value']} | {c['target']} | {met(c['met'])} |")
    if rep.get("reading"):
        L += ["", "## Reading", "", rep["reading"]]
    return "\n".join(L) + "\n"


def reading(rep: dict[str, Any]) -> str:
    """A few key ratios in words (the numbers are in the tables)."""
    parts = []
    b = {r["encoding"].split()[0]: r for r in rep["bytes"]}
    if "int4" in b and "fp32" in b:
        r = b["int4"]
        parts.append(
            f"int4 both ways (with error feedback) sends {r['dp_ratio_up']:.0f}x (up) and {r['dp_ratio_down']:.0f}x "
            f"(down) fewer bytes per learner per step than data-parallel's fp32 ring, against fp32's "
            f"{b['fp32']['dp_ratio_up']:.1f}x; the planner is within {max(abs(r['err_up']), abs(r['err_down'])):.1%} "
            "for it."
        )
    sat = sorted({(r["encoding"], r["link"]) for r in rep["links"] if r.get("saturated")})
    if sat:
        parts.append("Saturated links (the encoding needs more than the link's rate at the measured step rate): "
                     + ", ".join(f"{e} on ({lk})" for e, lk in sat) + ".")  # fmt: skip
    iii = next((r for r in rep["links"] if r["link"] == "iii" and r["encoding"] == "int4"), None)
    if iii and iii.get("share_vs_i") is not None:
        parts.append(
            f"On 10mbit,50ms, int4 keeps {iii['share_vs_i']:.3f}x (i)'s merged share and "
            f"{_f(iii.get('loss_vs_i'), '{:.4f}')}x its eval loss at equal processed tokens."
        )
    v = next((r for r in rep["links"] if r["link"] == "v" and r["encoding"] == "int4"), None)
    if v and v.get("share_vs_i") is not None:
        parts.append(
            f"One learner on 2 Mbit/s (v) costs the whole fleet: int4's merged share falls to {v['share_vs_i']:.2f}x "
            f"(i)'s and the median round takes {v['latency_median']:.2f} s, though int4 needs only "
            f"{_f(v.get('load'), '{:.2f}')} of that link: with M = 2 the robust merge waits for both answers (up to "
            "H steps), the fast learner's progress made while a round waits is overwritten by the version, and a "
            "learner that misses a version gets it in full, in fp32."
        )
    if rep["sim"]:
        ok_s = sum(1 for r in rep["sim"] if r["share_err"] is not None and abs(r["share_err"] - 1) <= 0.15)
        ok_l = sum(1 for r in rep["sim"] if r["latency_err"] is not None and abs(r["latency_err"] - 1) <= 0.15)
        parts.append(
            f"The simulator given the same link predicts the merged share within 15% on {ok_s} of {len(rep['sim'])} "
            f"links and the median round latency on {ok_l}: it has no term for the real round's fixed cost (relay "
            "hops, ZeroMQ, the syncer's loop: about 30 ms on (i)), so it is low wherever that dominates."
        )
    fl = rep["faults"]
    if fl:
        bad = sum(len(f["violations"]) for f in fl.values())
        parts.append(f"Link faults: {bad} invariant violations over {len(fl)} runs.")
        h = fl.get("hold")
        if h and h.get("l0_steps_per_s_before"):
            parts.append(
                f"During a 30 s hold learner 0 kept {h['l0_steps_per_s_during'] / h['l0_steps_per_s_before']:.2f}x "
                f"its steps/s and learner 1 trained on ({h['l1_steps_per_s_during']:.2f} steps/s); learner 1's "
                f"first merge came {h['l1_first_merge_after_s']:.1f} s after the hold, but what it trained during "
                "the hold was not merged: it rejoined (its link silent past the liveness timeout) and took the "
                "global state, overwriting that progress."
            )
        j = (fl.get("join") or {}).get("join")
        if j and j.get("join_s") is not None:
            parts.append(
                f"A restarted learner logged its join over 2 Mbit/s {j['join_s']:.1f} s after the launcher restarted "
                "it (its process start and 3.5 MB of fp32 state); taking a peer's optimizer state (6.4 MB) over the "
                "same link then kept that link busy for about 30 s more."
            )
    return " ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated cells: i-fp32 ... vi-int4, hold, cut, reset, flap, "
                    "join, relay, sim (the simulations of the cells there are)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="short cells in bench/cache/wan/quick (not a result)")
    ap.add_argument("--report", action="store_true", help="cached cells only: train nothing")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulator rows")
    ap.add_argument("--skip", default=",".join(SKIP), help="link cells left out (default: bf16 on links iii-vi)")
    ap.add_argument("--sim-encodings", default="int4",
                    help="encodings the simulator predicts, on every link (int4,fp32: ~3 min more)")  # fmt: skip
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--note", default="", help="a sentence for the report on how its cells were made")
    args = ap.parse_args()
    started = time.time()
    import torch

    torch.set_num_threads(1)
    cache = CACHE / "wan" / ("quick" if args.quick else "")
    only = {x.strip() for x in args.only.split(",") if x.strip()} or None
    bench = Bench(cache, ROOT / "runs" / "bench-wan" / ("quick" if args.quick else "full"),
                  QUICK_TOKENS if args.quick else TOKENS, args.quick, only, args.report)  # fmt: skip
    cells: dict[str, dict[str, Any]] = {}
    fault_recs: dict[str, dict[str, Any]] = {}
    relay = bench.cached("relay")
    # What must be there first (an interrupted run resumes; if the budget runs out, what is left
    # is int8 and bf16 on the slower links): int4 and fp32 everywhere, every encoding's bytes,
    # the faults, the relay's accuracy; then int8 and bf16 on links (ii)-(vi).
    first = [(lk, e) for e in ("int4", "fp32") for lk in LINKS] + [("i", e) for e in ("int8", "bf16", *BYTES_ONLY)]
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    later = [(lk, e) for e in ("int8", "bf16") for lk in LINKS if lk != "i" and f"{lk}-{e}" not in skip]
    for stage in ("first", "faults", "later"):
        if stage == "faults":
            for name in FAULTS:
                rec = bench.fault_cell(name)
                if rec is not None:
                    fault_recs[name] = rec
            if relay is None and not args.report and bench.wanted("relay"):
                print(f"[{time.strftime('%H:%M:%S')}] relay accuracy ...", flush=True)
                relay = relay_accuracy()
                bench.store("relay", relay)
                bench.trained.append("relay")
            continue
        for lk, enc in first if stage == "first" else later:
            rec = bench.link_cell(lk, enc)
            if rec is not None:
                cells[f"{lk}-{enc}"] = rec
    sims: dict[str, dict[str, Any]] = {}
    if not args.no_sim:
        sim_encs = {e.strip() for e in args.sim_encodings.split(",")}
        mine = {name: rec for name, rec in cells.items() if rec["encoding"] in sim_encs}
        bench.run_sims([job for rec in mine.values() if isinstance(job := bench.sim_cell(rec), tuple)])
        bench.report_only = True  # now every simulation wanted is cached
        for name, rec in mine.items():
            if isinstance(got := bench.sim_cell(rec), dict):
                sims[name] = got
    fault_plan = faults(args.quick)
    rep = build_report(cells, sims, fault_recs, relay)
    params = next((c["summary"]["traffic"]["params"] for c in cells.values() if c["summary"].get("traffic")), 0)
    argv = " ".join(x for x in sys.argv[1:] if x != args.note and not x.startswith("--note"))
    rep.update({
        "command": "python bench/wan.py" + (f" {argv}" if argv else ""),
        "date": utc_now(),
        "machine": machine(python=True),
        "wall_s_this_invocation": time.time() - started,
        "trained_this_invocation": bench.trained,
        "tokens": bench.tokens,
        "skipped": sorted(skip),
        "note": args.note,
        "params": params,
        "config": {"common": COMMON, "encodings": ENCODINGS, "links": {k: list(v.settings) for k, v in LINKS.items()},
                   "faults": {k: [*FAULT_SETTINGS, *v.settings] for k, v in fault_plan.items()}, "cap_s": CAP_S},
        "cells": {k: {"settings": v["settings"], "run_dir": v["run_dir"], "argv": v["seen"].get("argv"),
                      "wall_s": v["seen"].get("wall_s")} for k, v in {**cells, **fault_recs}.items()},
    })  # fmt: skip
    rep["reading"] = reading(rep)
    out = cache if args.quick else Path(args.out)  # a smoke test is no result
    publish(out, "wan", rep, to_markdown(rep), indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
