"""Whole-model events (issue 32, "what it must show"): what a restart, a replacement, the
evaluator and the final sync move and how long they take, with real processes behind emulated
links, beside the same harness on the sources of an older commit.

    python bench/events.py                       # this tree at 100M (about 15 min), then the report
    python bench/events.py --baseline 470a882    # the same cell on that commit's sources (cached)
    python bench/events.py --quick               # 30M, shorter: a smoke test (bench/cache/events/quick)
    python bench/events.py --report              # the report from cached cells only, training nothing

One cell is one ``ddiloco train`` run of the scale workload (bench/scale.py: the synthetic task,
a student of 4 hidden layers sized to 100M parameters; N = its fp32 bytes) with 4 learners at
one thread each, every learner behind ``ddiloco link`` at the rate that carries N in 30 s
(``chaos.links``: about 107 Mbit/s at 100M), int4 both ways with error feedback (the encodings
the steady-traffic figures come from), the evaluator on at its defaults, everything else at its
defaults. While it runs, this script:

1. SIGKILLs learner 1 at ``kill_s`` after the run's start; the launcher starts it again on the
   same run folder (its own saved state in RUN/learners/learner-1, ``runtime.local_state_s``).
2. 150 s after that kill (the restart's own events, a hand-off included where the code makes
   one, are over by then), SIGKILLs learner 2 and deletes its saved state before the launcher starts it again
   (``runtime.restart_delay_s`` = 3 s): a fresh learner with no local state, which joins and
   takes a live peer's optimizer state.
3. Samples, every 0.5 s: each process's peak resident size (by role), the syncer's traffic
   meter (``metrics/traffic.json``: bytes per learner, direction and kind) and its status
   ``memory``; the run ends at ``runtime.duration_s`` with the final sync.

Per event, from the traffic meter over the event's window and from the tape, step logs and
``metrics/startup.jsonl``: bytes each way and wall time, against the issue's targets. Around the
run, in processes of their own (bench/scale.py's workers): an idle process with the roles'
imports (the baseline memory peaks are taken above) and a plain AdamW loop on the same model.

The baseline cell runs the same script against ``git archive COMMIT src`` (unpacked into
bench/cache/events/src-COMMIT): the same config, no setting the old code does not know.
``SyncerServer``'s memory with GPT-2 124M is bench/syncer_memory.py's figure (``--syncer-server``
runs it and caches it here). Cells are cached in bench/cache/events/ (one JSON per cell, keyed
by its settings and the sources' digest). Writes docs/results/events.md and .json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.cells import CellCache, cell_key, digest  # noqa: E402  (bench/harness, beside this script)
from harness.cluster import Launch  # noqa: E402
from harness.files import read_json_dict, read_jsonl, step_logs  # noqa: E402
from harness.paths import CACHE, ENV, RESULTS, ROOT, SRC  # noqa: E402
from harness.sampling import descendants, role_of, started_at, status_bytes  # noqa: E402
from harness.tables import facts, met, publish, table  # noqa: E402

CELLS = CACHE / "events"
CACHE_VERSION = 1
LEARNERS = 4
RESTARTED, REPLACED = 1, 2
"""Learner 1 restarts on its machine (its saved state kept); learner 2 is replaced (state deleted)."""
LINK_S = 30.0
"""Each learner's link carries N in this many seconds."""
STEADY = ("contribution", "version", "request", "ack", "heartbeat")
ONE_OFF = ("registration", "rejoin", "handoff")
"""What a (re)start moves: registration, the join's fragments (or the chain's changes), the hand-off."""


class Plan:
    """One cell's size and timeline (seconds from the launcher's start)."""

    def __init__(self, name: str, params: int, kill_s: float, replace_after_s: float, duration_s: float) -> None:
        from scale import hidden_for, params_of  # bench/scale.py: the scale workload

        self.name = name
        self.hidden = hidden_for(params)
        self.params = params_of(self.hidden)
        self.model_bytes = 4 * self.params
        self.kill_s, self.replace_after_s, self.duration_s = kill_s, replace_after_s, duration_s
        self.rate_bps = self.model_bytes * 8 / LINK_S
        """The link rate (bits/s) that carries N in ``LINK_S``."""

    def config(self) -> dict[str, Any]:
        from scale import BATCH, DEPTH, TEACHER_HIDDEN

        rate = f"{self.rate_bps / 1e6:.1f}mbit"
        return {
            "run": {"num_learners": LEARNERS, "processed_tokens": 10**15, "seed": 0, "threads": 1},
            "workload": {
                "factory": "ddiloco.workloads.synthetic:make_workload",
                "batch_size": BATCH,
                "options": {"hidden": self.hidden, "depth": DEPTH, "teacher_hidden": TEACHER_HIDDEN},
            },
            "inner": {"warmup_frac": 0.0},
            "algo": {"up_encoding": "int4", "down_encoding": "int4", "error_feedback": True},
            "chaos": {
                "enabled": True,
                "downtime_fraction": 0.0,
                "failures_per_learner": 0,
                "links": [f"{m}:{rate}" for m in range(LEARNERS)],
            },  # fmt: skip
            "runtime": {
                "duration_s": self.duration_s,
                "step_log": True,
                "status_interval_s": 0.5,
                "restart_delay_s": 3.0,
                "final_eval": False,
                "progress_interval_s": 30.0,
            },  # fmt: skip
        }


PLANS = {
    "100M": lambda: Plan("100M", 100_000_000, kill_s=360.0, replace_after_s=150.0, duration_s=840.0),
    "30M": lambda: Plan("30M", 30_000_000, kill_s=200.0, replace_after_s=60.0, duration_s=420.0),
}


# ----------------------------------------------------------------------------- the run


class Watch:
    """What the run does, sampled: processes' peaks by role, the traffic meter, the syncer's memory."""

    def __init__(self, root: int, run_dir: Path) -> None:
        self.root, self.run_dir = root, run_dir
        self.procs: dict[int, dict[str, Any]] = {}
        self.traffic: list[tuple[float, dict[str, Any]]] = []
        """(time, metrics/traffic.json's by_learner) each time it changed."""
        self.syncer_memory: dict[str, float] = {}
        """The largest of each figure of the syncer's status ``memory``."""
        self.events: dict[str, Any] = {}

    def poll(self) -> None:
        now = time.time()
        for pid in descendants(self.root):
            role = role_of(pid)
            if role is None or role == "launcher":
                continue
            mem = status_bytes(pid)
            if not mem:
                continue
            rec = self.procs.get(pid)
            if rec is None or rec["role"] != role:
                rec = self.procs[pid] = {"pid": pid, "role": role, "started": started_at(pid), "peak": 0,
                                         "first_seen": now}  # fmt: skip
            rec["peak"] = max(rec["peak"], mem.get("VmHWM", 0))
            rec["last_seen"] = now
        by = read_json_dict(self.run_dir / "metrics" / "traffic.json").get("by_learner")
        if isinstance(by, dict) and (not self.traffic or self.traffic[-1][1] != by):
            self.traffic.append((now, by))
        memory = self.status("syncer-0").get("memory")
        for k, v in memory.items() if isinstance(memory, dict) else ():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.syncer_memory[k] = max(self.syncer_memory.get(k, 0), v)

    def status(self, name: str) -> dict[str, Any]:
        return read_json_dict(self.run_dir / "status" / f"{name}.json")

    def to_dict(self) -> dict[str, Any]:
        return {"procs": list(self.procs.values()), "traffic": self.traffic, "syncer_memory": self.syncer_memory,
                "events": self.events, "root": self.root}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any], run_dir: Path) -> Watch:
        w = cls(d["root"], run_dir)
        w.procs = {r["pid"]: r for r in d["procs"]}
        w.traffic = [(t, by) for t, by in d["traffic"]]
        w.syncer_memory, w.events = d["syncer_memory"], d["events"]
        return w

    def learner_pid(self, m: int) -> int | None:
        st = self.status(f"learner-{m}")
        pid = st.get("pid")
        return pid if isinstance(pid, int) and role_of(pid) == f"learner-{m}" else None

    def kill(self, m: int, what: str, drop_state: bool = False) -> bool:
        """SIGKILL learner ``m``'s process (and, ``drop_state``, delete its saved state once it is
        dead, before the launcher's restart delay is over). False when it is not running."""
        pid = self.learner_pid(m)
        st = self.status(f"learner-{m}")
        if pid is None:
            return False
        saved = read_json_dict(self.run_dir / "learners" / f"learner-{m}" / "current" / "meta.json")
        versions = self.status("syncer-0").get("versions")
        os.kill(pid, signal.SIGKILL)
        end = time.time() + 10
        while os.path.exists(f"/proc/{pid}") and role_of(pid) is not None and time.time() < end:
            time.sleep(0.01)
        if drop_state:
            shutil.rmtree(self.run_dir / "learners" / f"learner-{m}", ignore_errors=True)
        self.events[what] = {
            "at": time.time(), "pid": pid, "incarnation": st.get("incarnation"), "steps": st.get("steps"),
            "saved_at": saved.get("saved_at"), "save_stats": st.get("local_state"), "dropped_state": drop_state,
            "saved_versions": saved.get("versions"), "syncer_versions": versions,
        }  # fmt: skip
        print(f"  SIGKILLed learner {m} (pid {pid}, {what}) after {st.get('steps')} steps", flush=True)
        return True


def first_merged(tape: Path, m: int, incarnation: Any) -> float | None:
    """Wall time of the first round that merged a contribution of learner ``m`` from a process
    other than ``incarnation`` (the tape's rounds, in order)."""
    from ddiloco.core.tape import RoundRecord, parse_tape_record, was_merged
    from ddiloco.report.tape import read_tape

    if not tape.exists():
        return None
    for rec in read_tape(tape):
        rd = parse_tape_record(rec)
        if isinstance(rd, RoundRecord) and any(
            e.learner == m and e.incarnation != incarnation and was_merged(e) for e in rd.merged
        ):
            return float(rd.closed_at + rec.get("wall_offset", 0.0))
    return None


def run_cell(plan: Plan, src: Path, work: Path) -> dict[str, Any]:
    """One run; the raw figures (everything the report needs, nothing of the run folder)."""
    import tomli_w

    cfg, run_dir = work / "events.toml", work / "run"
    cfg.write_text(tomli_w.dumps(plan.config()))
    env = {**ENV, "PYTHONPATH": str(src)}
    t0 = time.time()
    launcher = Launch([str(cfg), "--run-dir", str(run_dir)], work / "train.log", env=env)
    watch = Watch(launcher.pid, run_dir)
    deadline = t0 + plan.duration_s + 300 + plan.model_bytes / 20e6
    try:
        while launcher.running() and time.time() < deadline:
            watch.poll()
            now = time.time() - t0
            ev = watch.events
            if "restart" not in ev and now >= plan.kill_s:
                watch.kill(RESTARTED, "restart")
            elif "restart" in ev and "replace" not in ev and time.time() - ev["restart"]["at"] >= plan.replace_after_s:
                # (a fixed delay, the same for every source: the restart's own events, a hand-off
                # of 2 N included where the code makes one, are over by then)
                watch.kill(REPLACED, "replace", drop_state=True)
            time.sleep(0.5)
    finally:
        launcher.stop(signal.SIGTERM, 180)
        rc = launcher.wait()
        for pid, rec in watch.procs.items():  # whatever of ours is left
            if role_of(pid) == rec["role"] and started_at(pid) == rec["started"]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    watch.poll()
    (work / "watch.json").write_text(json.dumps(watch.to_dict()))  # for --refigure (with --keep)
    kept = {"t0": t0, "run_dir": str(run_dir), "watch": str(work / "watch.json")}
    return {"raw": raw_figures(plan, watch, run_dir, t0), "launcher_rc": rc, "wall_s": time.time() - t0, "kept": kept}


def refigure(cell: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The cell's figures again from what it kept (``--refigure``: a change to this script's
    arithmetic, not to the run; its run folder must still be there, ``--keep``)."""
    kept = cell["kept"]
    run_dir = Path(kept["run_dir"])
    if not run_dir.is_dir():
        raise SystemExit(f"--refigure: the cell's run folder {run_dir} is gone (run it again with --keep)")
    watch = Watch.from_dict(json.loads(Path(kept["watch"]).read_text()), run_dir)
    return {**cell, "raw": raw_figures(plan, watch, run_dir, kept["t0"])}


# ----------------------------------------------------------------------------- figures


def _bytes(by: Mapping[str, Any], who: str, direction: str, cats: tuple[str, ...] | None) -> int:
    """Bytes of ``who`` (a learner id as a string, or "unattributed") one way, of ``cats`` (None: all)."""
    cells = by.get(who, {}).get(direction, {}) if isinstance(by.get(who), dict) else {}
    return sum(int(c.get("bytes", 0)) for k, c in cells.items() if cats is None or k in cats)


def at(traffic: list[tuple[float, dict[str, Any]]], t: float) -> dict[str, Any]:
    """The traffic meter as it stood at wall time ``t`` (the last sample at or before it)."""
    last: dict[str, Any] = {}
    for when, by in traffic:
        if when > t:
            break
        last = by
    return last


def window(traffic: list[tuple[float, dict[str, Any]]], m: int, a: float, b: float) -> dict[str, int]:
    """Learner ``m``'s bytes between wall times ``a`` and ``b``: one-off (registration, join or
    chain fetches, hand-off) and steady, each way."""
    x, y, who = at(traffic, a), at(traffic, b), str(m)
    out = {}
    for d in ("up", "down"):
        out[f"one_off_{d}"] = _bytes(y, who, d, ONE_OFF) - _bytes(x, who, d, ONE_OFF)
        out[f"steady_{d}"] = _bytes(y, who, d, STEADY) - _bytes(x, who, d, STEADY)
        out[f"handoff_{d}"] = _bytes(y, who, d, ("handoff",)) - _bytes(x, who, d, ("handoff",))
    return out


def incarnations_of(run_dir: Path, m: int) -> list[int]:
    """Learner ``m``'s process incarnations in metrics/startup.jsonl, oldest first (an
    incarnation is its process's start time in microseconds)."""
    recs = read_jsonl(run_dir / "metrics" / "startup.jsonl")
    mine = [r for r in recs if r.get("role") == "learner" and r.get("id") == m]
    return sorted(r["incarnation"] for r in mine if isinstance(r.get("incarnation"), int))


def startup_of(run_dir: Path, m: int, incarnation: Any) -> dict[str, float]:
    """The start-up phases of learner ``m``'s process ``incarnation`` (metrics/startup.jsonl)."""
    for rec in read_jsonl(run_dir / "metrics" / "startup.jsonl"):
        if rec.get("role") == "learner" and rec.get("id") == m and rec.get("incarnation") == incarnation:
            return {k: float(v) for k, v in rec.get("phases", {}).items()}
    return {}


def successor(watch: Watch, m: int, killed: dict[str, Any]) -> dict[str, Any] | None:
    """Learner ``m``'s first process started after the kill ``killed``."""
    later = [
        r for r in watch.procs.values()
        if r["role"] == f"learner-{m}" and r["pid"] != killed["pid"] and (r["started"] or 0) > killed["at"] - 1
    ]  # fmt: skip
    return min(later, key=lambda r: r["started"]) if later else None


def grew_at(
    traffic: list[tuple[float, dict[str, Any]]], m: int, direction: str, cat: str, a: float, b: float = math.inf
) -> list[float]:
    """The samples in (a, b] at which learner ``m``'s ``cat`` bytes one way grew."""
    out, prev = [], _bytes(at(traffic, a), str(m), direction, (cat,))
    for when, by in traffic:
        if when <= a or when > b:
            continue
        now = _bytes(by, str(m), direction, (cat,))
        if now > prev:
            out.append(when)
        prev = now
    return out


def event_figures(plan: Plan, watch: Watch, run_dir: Path, m: int, what: str) -> dict[str, Any]:
    """A killed learner's successor: its bytes from the kill to its first merged contribution
    (or, replaced, to its peer's state loaded, whichever is later), its times."""
    ev = watch.events.get(what)
    if ev is None:
        return {"happened": False}
    succ = successor(watch, m, ev)
    started = succ["started"] if succ else None
    later = [i for i in incarnations_of(run_dir, m) if i > (ev["incarnation"] or 0)]  # (they grow with time)
    phases = startup_of(run_dir, m, later[0]) if later else {}
    at_phase = lambda k: started + phases[k] if started is not None and k in phases else None  # noqa: E731
    merged = at_phase("first_merged") or first_merged(run_dir / "state" / "tape.jsonl", m, ev["incarnation"])
    handoff = at_phase("handoff") or max(grew_at(watch.traffic, m, "down", "handoff", ev["at"]), default=None)
    first_step = at_phase("first_step")
    end = max(t for t in (merged, handoff, first_step, ev["at"] + 1) if t is not None)
    moved = window(watch.traffic, m, ev["at"], end + 2.0)
    one_off = moved["one_off_up"] + moved["one_off_down"]
    rate = plan.rate_bps / 8
    since = lambda t: None if t is None or started is None else round(t - started, 2)  # noqa: E731
    out: dict[str, Any] = {
        "happened": True,
        "killed_after_steps": ev["steps"],
        "save_age_at_kill_s": round(ev["at"] - ev["saved_at"], 1) if ev.get("saved_at") else None,
        "save_stats_at_kill": ev.get("save_stats"),
        "versions_behind_at_kill": behind(ev),
        "restart_delay_s": round(started - ev["at"], 2) if started else None,
        "phases": phases,
        "first_step_s": since(first_step),
        "state_loaded_s": since(handoff),
        "first_merged_s": since(merged),
        "join_to_first_merged_s": round(merged - started - phases["join"], 2)
        if merged is not None and started is not None and "join" in phases
        else None,
        "bytes": moved,
        "moved_over_n": round(one_off / plan.model_bytes, 4),
        "down_over_n": round(moved["one_off_down"] / plan.model_bytes, 4),
        "up_over_n": round(moved["one_off_up"] / plan.model_bytes, 4),
        "bytes_over_rate_s": round(one_off / rate, 2),
    }
    if what == "restart":
        out["target_s"] = round(one_off / rate + 10, 2)
        out["met_bytes"] = one_off <= 0.25 * plan.model_bytes
        out["met_time"] = out["first_merged_s"] is not None and out["first_merged_s"] <= out["target_s"]
    else:
        out["target_s"] = round(3 * plan.model_bytes / rate + 10, 2)
        out["met_time"] = out["first_step_s"] is not None and out["first_step_s"] <= out["target_s"]
        out["serving"] = serving_figures(watch, run_dir, ev["at"], end + 2.0)
    return out


def behind(ev: dict[str, Any]) -> dict[str, Any] | None:
    """How far the killed learner's save was behind the syncer when it died: per fragment, the
    versions the syncer had merged since the save's (mean, largest, and how many fragments)."""
    saved, now = ev.get("saved_versions"), ev.get("syncer_versions")
    if not isinstance(saved, list) or not isinstance(now, dict):
        return None
    gaps = [int(now.get(str(p), v)) - int(v) for p, v in enumerate(saved)]
    return {"mean": round(statistics.fmean(gaps), 2), "max": max(gaps), "fragments_behind": sum(g > 0 for g in gaps),
            "fragments": len(gaps)}  # fmt: skip


def gap_figures(run_dir: Path, m: int, first: float, last: float) -> dict[str, Any]:
    """Learner ``m``'s step gaps (step end to step end) between ``first`` and ``last`` (and two
    median steps after), against its median gap over the run."""
    ends = [t for t, _, _ in step_logs(run_dir).get(m, [])]
    gaps = [(t1, t1 - t0) for t0, t1 in zip(ends, ends[1:])]
    median = statistics.median(g for _, g in gaps) if gaps else None
    during = [g for t, g in gaps if first <= t <= last + (median or 0) * 2]
    return {
        "median_step_s": round(median, 3) if median else None,
        "longest_gap_s": round(max(during), 3) if during else None,
        "longest_gap_over_median": round(max(during) / median, 2) if during and median else None,
        "steps": len(during),
    }


def serving_figures(watch: Watch, run_dir: Path, a: float, b: float) -> dict[str, Any]:
    """The peer that served the replaced learner's optimizer state: when its hand-off bytes went
    up (first and last sample that grew), its longest step gap then against its median step, and
    the same for a learner that served nothing over the same span (the machine's own noise)."""
    peers = [m for m in range(LEARNERS) if m != REPLACED]
    grew = {m: t for m in peers if (t := grew_at(watch.traffic, m, "up", "handoff", a, b + 60))}
    if not grew:
        return {"served_by": None}
    m = max(grew, key=lambda k: len(grew[k]))
    first, last = min(grew[m]) - 1.0, max(grew[m])  # a sample is up to 0.5 s late; a piece starts before
    before = _bytes(at(watch.traffic, a), str(m), "up", ("handoff",))
    served = _bytes(at(watch.traffic, last + 1), str(m), "up", ("handoff",)) - before
    gaps = gap_figures(run_dir, m, first, last)
    controls = {
        str(k): gap_figures(run_dir, k, first, last) for k in range(LEARNERS) if k not in (m, REPLACED, RESTARTED)
    }
    ratio = gaps["longest_gap_over_median"]
    return {
        "served_by": m, "span_s": round(last - first, 1), "served_bytes": served, **gaps,
        "controls": controls, "met": ratio is not None and ratio < 2,
    }  # fmt: skip


def raw_figures(plan: Plan, watch: Watch, run_dir: Path, t0: float) -> dict[str, Any]:
    final = read_json_dict(run_dir / "metrics" / "traffic.json").get("by_learner") or {}
    learners = [str(m) for m in range(LEARNERS)]
    steady = sum(_bytes(final, m, d, STEADY) for m in learners for d in ("up", "down"))
    observer = sum(_bytes(final, "unattributed", d, ("observer",)) for d in ("up", "down"))
    evals = read_jsonl(run_dir / "metrics" / "eval.jsonl")
    final_sync = {m: {d: _bytes(final, m, d, ("final_sync",)) for d in ("up", "down")} for m in learners}
    first_joins = {}
    for m in range(LEARNERS):
        first = min((r for r in watch.procs.values() if r["role"] == f"learner-{m}" and r["started"]),
                    key=lambda r: r["started"], default=None)  # fmt: skip
        if first is None:
            continue
        incs = incarnations_of(run_dir, m)
        phases = startup_of(run_dir, m, incs[0]) if incs else {}
        stepped = first["started"] + phases["first_step"] if "first_step" in phases else None
        moved = window(watch.traffic, m, t0, stepped) if stepped else {}
        down = moved.get("one_off_down", 0)
        first_joins[str(m)] = {"phases": phases, "down_over_n": round(down / plan.model_bytes, 3)}
    peaks: dict[str, list[int]] = {}
    learner_peaks = []
    for rec in sorted(watch.procs.values(), key=lambda r: r["started"] or 0):
        if rec.get("last_seen", 0.0) - (rec.get("first_seen") or rec["started"] or 0.0) < 1.0:
            continue  # a child between fork and exec (its parent's command line and pages): not a role
        role = "learner" if rec["role"].startswith("learner-") else rec["role"]
        peaks.setdefault(role, []).append(rec["peak"])
        if role == "learner":
            learner_peaks.append({"role": rec["role"], "pid": rec["pid"], "peak": rec["peak"]})
    return {
        "plan": {
            "size": plan.name,
            "params": plan.params,
            "model_bytes": plan.model_bytes,
            "rate_bps": plan.rate_bps,
            "kill_s": plan.kill_s,
            "replace_after_s": plan.replace_after_s,
            "duration_s": plan.duration_s,
        },
        "restart": event_figures(plan, watch, run_dir, RESTARTED, "restart"),
        "replace": event_figures(plan, watch, run_dir, REPLACED, "replace"),
        "first_joins": first_joins,
        "evaluator": {
            "observer_bytes": observer,
            "learners_steady_bytes": steady,
            "share": round(observer / steady, 4) if steady else None,
            "evaluations": len(evals),
        },  # fmt: skip
        "final_sync": final_sync,
        "final_sync_over_n": {
            d: round(max(v[d] for v in final_sync.values()) / plan.model_bytes, 4) for d in ("up", "down")
        },
        "peaks": peaks,
        "learner_peaks": learner_peaks,
        "syncer_memory": watch.syncer_memory,
        "invariants": invariants(run_dir),
        "summary": {
            k: v
            for k, v in read_json_dict(run_dir / "summary.json").items()
            if k in ("traffic", "goodput", "ended_by", "tokens_merged", "tokens_processed")
        },  # fmt: skip
    }


def invariants(run_dir: Path) -> dict[str, Any]:
    """bench/wan.py's check (the tape's invariants with every incarnation, the final sync, a finite
    final model)."""
    from wan import check_invariants

    return check_invariants(run_dir, 0, 60.0)


# ----------------------------------------------------------------------------- cells


def sources(baseline: str | None) -> tuple[str, Path]:
    """(label, src folder): this tree, or ``git archive COMMIT src`` unpacked under the cache."""
    if baseline is None:
        return "now", SRC
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", baseline], capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    dest = CELLS / f"src-{commit}"
    if not (dest / "src" / "ddiloco").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return f"at-{commit}", dest / "src"


def src_digest(src: Path) -> str:
    files = sorted(p for p in (src / "ddiloco").rglob("*.py"))
    return digest([str(p.relative_to(src)) + ":" + digest(p.read_bytes().decode(errors="replace")) for p in files])


def memory_baselines(plan: Plan) -> dict[str, Any]:
    """An idle process with the roles' imports and the plain AdamW loop (bench/scale.py's workers)."""
    from scale import DEPTH, run_worker

    idle = run_worker(["idle"], 300)["vmhwm"]
    plain = run_worker(["plain", "--hidden", str(plan.hidden), "--depth", str(DEPTH), "--seconds", "10"], 900)
    return {"idle": idle, "plain": plain["vmhwm"], "plain_step_s": plain["step_s"]}


def syncer_server_figures() -> dict[str, Any]:
    """bench/syncer_memory.py at GPT-2 124M (its own processes; prints one JSON object)."""
    cmd = [sys.executable, str(ROOT / "bench" / "syncer_memory.py"), "--size", "124M", "--sync-every", "24",
           "--steps", "48", "--step-s", "0.8"]  # fmt: skip
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"bench/syncer_memory.py failed: {out.stderr.strip().splitlines()[-1:]}")
    return {"command": "python bench/syncer_memory.py " + " ".join(cmd[2:]),
            **json.loads(out.stdout[out.stdout.index("{"):])}  # fmt: skip


# ----------------------------------------------------------------------------- report


def _mb(b: float | None) -> str:
    return "-" if b is None else f"{b / 1e6:,.0f} MB"


def _x(v: float | None, n: int = 2) -> str:
    return "-" if v is None else f"{v:.{n}f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} s"


def _behind(ev: dict[str, Any]) -> str:
    b = ev.get("versions_behind_at_kill") or {}
    age = f"{_s(ev.get('save_age_at_kill_s'))} old"
    return f"{age}, {b.get('mean', '-')} versions behind on average ({b.get('max', '-')} at most)" if b else age


def memory_of(cell: dict[str, Any]) -> dict[str, Any]:
    raw, base = cell["raw"], cell["memory_baselines"]
    model = raw["plan"]["model_bytes"]
    out = {}
    for role, ps in raw["peaks"].items():
        out[role] = round((max(ps) - base["idle"]) / model, 2)
    if "learner" in raw["peaks"]:
        out["learner_above_plain"] = round((max(raw["peaks"]["learner"]) - base["plain"]) / model, 2)
    out["plain"] = round((base["plain"] - base["idle"]) / model, 2)
    return out


def write_report(cells: dict[str, dict[str, Any]], server: dict[str, Any] | None, out: Path, command: str) -> None:
    now, others = cells.get("now"), {k: v for k, v in cells.items() if k != "now"}
    if now is None:
        raise SystemExit("no cell of this tree is cached: run python bench/events.py first")
    base = next(iter(others.values()), None)
    base_label = next(iter(others), "-")
    raw = now["raw"]
    plan = raw["plan"]
    n = plan["model_bytes"]
    rs, rp, ev, fs = raw["restart"], raw["replace"], raw["evaluator"], raw["final_sync_over_n"]
    braw = base["raw"] if base else {}

    mem = memory_of(now)
    bmem = memory_of(base) if base else {}
    serving = rp.get("serving", {})
    here, there = {**raw, "mem": mem}, {**braw, "mem": bmem}

    def get(root: dict[str, Any], path: str) -> Any:
        v: Any = root
        for k in path.split("."):
            v = v.get(k) if isinstance(v, dict) else None
        return v

    def row(event: str, measure: str, path: str, fmt: Any, target: str, ok: bool | None) -> list[Any]:
        """One line of the table: ``path`` ("restart.first_step_s", "mem.syncer") in this cell and
        in the baseline's, shown by ``fmt``."""
        return [event, measure, fmt(get(here, path)), fmt(get(there, path)) if base else "-", target, met(ok)]

    syncer_x, above_plain = mem.get("syncer"), mem.get("learner_above_plain")
    share = ev.get("share")
    rows: list[tuple[str, str, str, Any, str, bool | None]] = [
        ("restart with its saved state", "bytes moved (over N)", "restart.moved_over_n", _x, "<= 0.25",
         rs.get("met_bytes")),
        ("", "first merged contribution", "restart.first_merged_s", _s,
         f"<= {_s(rs.get('target_s'))} (bytes / rate + 10 s)", rs.get("met_time")),
        ("", "its registration -> first merged", "restart.join_to_first_merged_s", _s, "-", None),
        ("", "first step", "restart.first_step_s", _s, "-", None),
        ("replacement without state", "bytes moved (over N)", "replace.moved_over_n", _x, "-", None),
        ("", "first step", "replace.first_step_s", _s, f"<= {_s(rp.get('target_s'))} (3 N / rate + 10 s)",
         rp.get("met_time")),
        ("", "peer's state loaded", "replace.state_loaded_s", _s, "-", None),
        ("", "serving peer's longest step gap / median", "replace.serving.longest_gap_over_median", _x, "< 2",
         serving.get("met")),
        ("evaluator", "bytes / learners' steady bytes", "evaluator.share", lambda v: _x(v, 3), "<= 0.1",
         share is not None and share <= 0.1),
        ("final sync", "largest learner's bytes up / N", "final_sync_over_n.up", lambda v: _x(v, 3), "<= 0.25",
         fs["up"] <= 0.25),
        ("", "largest learner's bytes down / N", "final_sync_over_n.down", lambda v: _x(v, 3), "<= 0.25",
         fs["down"] <= 0.25),
        ("memory", "syncer peak above idle / N", "mem.syncer", _x, "<= 4", syncer_x is not None and syncer_x <= 4),
        ("", "learner peak above the plain loop / N", "mem.learner_above_plain", _x, "<= 1.5",
         above_plain is not None and above_plain <= 1.5),
        ("", "evaluator peak above idle / N", "mem.evaluator", _x, "-", None),
        ("invariants", "violations", "invariants.violations", lambda v: "-" if v is None else len(v), "0",
         not raw["invariants"]["violations"]),
    ]  # fmt: skip
    lines = [
        "# Whole-model events: what a restart, a replacement, the evaluator and the final sync move",
        "",
        f"`{command}` on {now['date']} ({now['machine']['cpus']} cores, other work beside it: timings are this "
        f"machine's). The scale workload at {plan['size']} ({plan['params'] / 1e6:.1f}M parameters, N = "
        f"{n / 1e6:,.0f} MB in fp32), {LEARNERS} learners at one thread each, every learner behind `ddiloco link` at "
        f"{plan['rate_bps'] / 1e6:.1f} Mbit/s (N in {LINK_S:.0f} s), int4 both ways with error feedback, the evaluator "
        f"on at its defaults, a final sync at `runtime.duration_s` = {plan['duration_s']:.0f} s. Learner {RESTARTED} "
        f"is SIGKILLed at {plan['kill_s']:.0f} s and restarted on its machine (its saved state kept); learner "
        f"{REPLACED} is SIGKILLed {plan['replace_after_s']:.0f} s later and replaced by a process with no saved "
        f"state. Bytes are the syncer's traffic meter over each event's window (registration, join or chain "
        f"fetches, hand-off; both ways), times from the new process's start. Baseline: the same script on the "
        f"sources of {base_label} (`python bench/events.py --baseline {base_label[3:]}`).",
        "",
        *table(["event", "measure", "now", base_label, "target", "met"], [row(*spec) for spec in rows]),
        "",
    ]
    merged = raw.get("summary", {}).get("tokens_merged")
    bev = braw.get("evaluator", {}) if braw else {}
    lines += [
        f"The evaluator (on the launcher's machine, straight to the syncer: not behind a link) made "
        f"{ev.get('evaluations')} evaluations and moved {_mb(ev.get('observer_bytes'))} "
        f"({base_label}: {bev.get('evaluations', '-')} evaluations, {_mb(bev.get('observer_bytes'))}): its "
        f"default cadence is one evaluation per 40 H B / (u + d) merged tokens, here 40 x 24 x 8 / 1 = 7,680, and "
        f"the run merged {merged if merged is None else f'{merged:,.0f}'} (4 learners at about 4 s a step on "
        "2 cores); a longer run evaluates once per that many tokens, fetching only the fragments that moved.",
        "",
    ]
    lines += [
        f"The restart: its save was {_behind(rs)} (the syncer's versions at the kill against the save's; "
        f"its save costs so far: {rs.get('save_stats_at_kill')}). The serving peer's step gaps against a learner "
        f"that served nothing over the same span: {serving.get('controls')}.",
        "",
    ]
    phases = ", ".join(f"{k} {v:.1f}" for k, v in rs.get("phases", {}).items())
    lines += [
        f"The restarted process's start-up (seconds from its start, `metrics/startup.jsonl`): {phases}. From its "
        "start, its first merged contribution includes the interpreter's imports and the read of its save, which "
        "the target (bytes over the link rate + 10 s) does not; from its registration it is the catch-up, one step "
        "and the round that merges it.",
        "",
        "Memory, against the targets: with error feedback a learner holds its base copy and its residual (2 N "
        "over a plain loop by design: bench/scale.py's 1.5x target is for fp32 payloads), and the syncer the "
        "served copy of a lossy down-link (N) and the chain's history (`algo.chain_history` x N / 8); the "
        "baseline column is the same configuration on the older code.",
        "",
    ]
    per = ", ".join(f"{r['role']} {r['peak'] / 2**20:,.0f}" for r in raw.get("learner_peaks", []))
    base_mem = now["memory_baselines"]
    lines += [
        f"Learner processes' peaks (MiB, in start order; the restarted and the replaced learner appear twice): {per}. "
        f"Idle process with the roles' imports {base_mem['idle'] / 2**20:,.0f} MiB, the plain AdamW loop "
        f"{base_mem['plain'] / 2**20:,.0f} MiB. The syncer's status `memory` at its largest (bytes over N): "
        + ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(raw.get("syncer_memory", {}).items()) if k != "rss"),
        "",
    ]
    if server:
        lines += [
            f"`SyncerServer` with GPT-2 124M (`{server['command']}`): peak {_x(server.get('peak_above_idle_x'))}x the "
            f"model above idle (target <= 3.5: {met(server.get('peak_above_idle_x', 99) <= 3.5)}).",
            "",
        ]
    lines += ["## Detail", "", "```json", json.dumps({"now": raw, base_label: braw}, indent=1, default=str)[:20000],
              "```", ""]  # fmt: skip
    publish(out.parent, out.stem, {"command": command, "cells": cells, "syncer_server": server}, "\n".join(lines))


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="run the cell on the sources of this commit instead of this tree")
    ap.add_argument("--quick", action="store_true", help="30M, shorter (a smoke test; cached apart, not reported)")
    ap.add_argument("--report", action="store_true", help="the report from cached cells only")
    ap.add_argument("--syncer-server", action="store_true", help="also measure SyncerServer with GPT-2 124M")
    ap.add_argument("--keep", action="store_true", help="keep the run folder")
    ap.add_argument("--refigure", action="store_true", help="recompute cached figures (kept run folders)")
    ap.add_argument("--out", default=str(RESULTS / "events.md"))
    args = ap.parse_args(argv)
    plan = PLANS["30M" if args.quick else "100M"]()
    cache = CellCache(CELLS / ("quick" if args.quick else "cells"))
    command = "python bench/events.py" + (" --quick" if args.quick else "")
    if not args.report:
        label, src = sources(args.baseline)
        key = cell_key(label, {"v": CACHE_VERSION, "config": plan.config(), "src": src_digest(src)})

        def run() -> dict[str, Any]:
            print(f"events: {label} at {plan.name} (about {plan.duration_s / 60 + 2:.0f} min)", flush=True)
            work = Path(tempfile.mkdtemp(prefix=f"ddiloco-events-{label}-"))
            try:
                cell = run_cell(plan, src, work)
            except BaseException:
                print(f"  the run's folder is kept: {work}", flush=True)
                raise
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
            else:
                print(f"  run folder: {work}", flush=True)
            cell["memory_baselines"] = memory_baselines(plan)
            cell.update(label=label, **facts(command))
            return cell

        cache.get_or_run(key, run)
    if args.refigure:
        for path, cell in cache.cells():
            if "kept" in cell and Path(cell["kept"]["run_dir"]).is_dir():
                path.write_text(json.dumps(refigure(cell, plan), indent=1))
    if args.syncer_server:
        CellCache(CELLS / "server").get_or_run("gpt2-124m", syncer_server_figures)
    cells = {}
    for _, cell in sorted(cache.cells(), key=lambda pc: pc[1].get("date", "")):
        if "raw" in cell:  # (a cell of an older cache version has none: not reported)
            cells[cell.get("label", "?")] = cell  # the newest of each label
    server = CellCache(CELLS / "server").get("gpt2-124m")
    if args.quick:
        out = CELLS / "quick" / "events.md"
    else:
        out = Path(args.out)
    write_report(cells, server, out, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
