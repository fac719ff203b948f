"""Scale benchmark (issue 21): memory, disk, start-up, the protocol's share of a step and the
syncer's load of the real runtime at 1M, 30M, 100M and the largest model this machine holds.

    python bench/scale.py                          # every size (about 30 min; cached cells are reused)
    python bench/scale.py --sizes 1M,30M --seconds 60
    python bench/scale.py --report                 # the report from cached cells only, training nothing

The workload at every size is **the scale workload**: the synthetic task with a small fixed
teacher (``teacher_hidden = 64``, ``d_in = 16``, ``d_out = 8``) and a student of ``depth = 4``
hidden ``hidden x hidden`` layers, ``hidden`` chosen so that the student has the size's
parameters; the data and the teacher stay the same at every size, so what grows is the model.

Each size is one cell: ``ddiloco train`` of a generated config (4 learners up to 100M, 2 above;
one thread each; ``runtime.duration_s`` = the cell's seconds), with learner 1 SIGKILLed by pid at
30% of the fleet's training time and the syncer at 65% (the launcher restarts each at once). While
it runs, every 0.5 s, the VmHWM of every descendant of the launcher (role from its command line)
and, every 1 s, the disk use of ``RUN/state``. Around it, in their own processes: an idle process
with the roles' imports (the baseline every peak is taken above) and a plain single-process AdamW
loop on the same model and batch. After it: the learners' status files (time inside
``Learner.step()`` over step time, as bench/library.py measures it), the tape (first merged
contribution of the restarted learner, round intervals), and, when the runtime writes them,
``metrics/startup.jsonl`` (start-up by phase) and ``metrics/syncer-load.json`` (merge time per
round, per shard).

Memory is checked by arithmetic before a cell runs: the per-role ratios of the largest cell
measured (from 30M up) predict the cell's total; a cell over ``--budget-gib`` is recorded as
skipped (``--force`` runs it anyway), and a run whose processes' resident total passes
``--abort-gib`` is stopped. The largest size is found the same way (``largest_size``).

Cells are cached in bench/cache/scale/size/ (one JSON per cell, keyed by its settings and a digest
of the runtime's source). Writes docs/results/scale.md and .json (``write_report``; the fleet
and merge sections come from bench/scale_fleet.py and bench/scale_merge.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.cells import CellCache, source_digest  # noqa: E402  (bench/harness, beside this script)
from harness.cells import cell_key as _cell_key  # noqa: E402
from harness.cluster import Launch  # noqa: E402
from harness.files import read_json as _json  # noqa: E402
from harness.files import read_jsonl as _jsonl  # noqa: E402
from harness.paths import CACHE as BENCH_CACHE  # noqa: E402
from harness.paths import ENV, RESULTS, SRC  # noqa: E402
from harness.sampling import cpu_seconds, descendants, disk_bytes, role_of, started_at, status_bytes  # noqa: E402
from harness.sampling import read_proc as _read  # noqa: E402

CACHE = BENCH_CACHE / "scale" / "size"
CACHE_VERSION = 1
"""Bump when a cell's measurement changes (the runtime's own changes are caught by ``code_digest``)."""
GiB = 1024**3

DEPTH = 4
"""Hidden layers of the scale workload's student at every size."""
TEACHER_HIDDEN = 64
"""The scale workload's fixed teacher width."""
BATCH = 8
"""Examples per step (the workload's default batch_size): the plain loop's too."""
SIZES = {"1M": 1_000_000, "30M": 30_000_000, "100M": 100_000_000}
"""Named sizes (parameters); "max" is the largest that fits, found by ``largest_size``."""
SECONDS = {"1M": 90.0, "30M": 120.0, "100M": 600.0, "max": 240.0}
"""Each cell's run (runtime.duration_s). 100M runs 10 minutes: the store's peak over a 10-minute
run (the issue's measure) is taken there; the other sizes' store peaks are over their shorter runs."""
MIN_MAX_PARAMS = 300_000_000
"""The issue's floor for the largest size."""
MAX_STEP = 50_000_000
"""The largest size is rounded down to a multiple of this."""
KILL_AT = 0.3
"""Learner 1 is SIGKILLed at this fraction of the run (counted from the fleet's first step)."""
KILLED = 1
SYNCER_KILL_AT = 0.65
"""The syncer is SIGKILLed at this fraction (the launcher restarts it at once): its restart to its
first merge is timed the same way."""
HANDOFF_GBPS = 0.5
"""The restart target's transfer rate: (model + optimizer-state bytes) / 0.5 GB/s + 5 s + one step."""
CODE_DIRS = ("core", "protocol", "service", "training", "workloads", "link", "report", "chaos")
"""The packages whose source a cell's numbers depend on (plus src/ddiloco/*.py)."""


# ----------------------------------------------------------------------------- sizes


def params_of(hidden: int, depth: int = DEPTH, d_in: int = 16, d_out: int = 8) -> int:
    """The scale workload's student parameters: embed, ``depth`` hidden layers, head."""
    return (d_in + 1) * hidden + depth * (hidden + 1) * hidden + (hidden + 1) * d_out


def hidden_for(params: int, depth: int = DEPTH) -> int:
    """The width whose student is closest to ``params`` parameters."""
    h = max(1, int((-(depth + 25) + math.sqrt((depth + 25) ** 2 + 4 * depth * params)) / (2 * depth)))
    return min((h, h + 1), key=lambda x: abs(params_of(x, depth) - params))


@dataclass(frozen=True)
class Size:
    """One cell's model and fleet."""

    name: str
    """"1M", "30M", "100M" or "max"."""
    hidden: int
    """The student's width."""
    depth: int
    """The student's hidden layers."""
    learners: int
    """Learners in the run (4 up to 100M, 2 above)."""
    seconds: float
    """The run's time budget."""

    @property
    def params(self) -> int:
        return params_of(self.hidden, self.depth)

    @property
    def model_bytes(self) -> int:
        return 4 * self.params

    @property
    def options(self) -> dict[str, int]:
        return {"hidden": self.hidden, "depth": self.depth, "teacher_hidden": TEACHER_HIDDEN}


def size_of(name: str, params: int, seconds: float | None) -> Size:
    learners = 4 if params <= 100_000_000 else 2
    return Size(name, hidden_for(params), DEPTH, learners, seconds if seconds is not None else SECONDS[name])


def label(params: int) -> str:
    return f"{params / 1e6:.0f}M" if params >= 1e6 else f"{params / 1e3:.0f}k"


# ----------------------------------------------------------------------------- memory arithmetic


ROLES = ("syncer", "learner", "evaluator")


def ratios(cell: dict[str, Any]) -> dict[str, float] | None:
    """Per role, peak RSS above the idle process over the model's bytes (None: not measured)."""
    mem = cell.get("memory") or {}
    if not mem or not all(mem.get(r) for r in ROLES):
        return None
    return {r: mem[r]["above_idle_x"] for r in ROLES}


def estimate_bytes(cell: dict[str, Any], model_bytes: int, learners: int, scale: float = 1.0) -> float:
    """The run's resident total at ``model_bytes`` with ``learners``, from ``cell``'s measured
    ratios (times ``scale``): idle baseline per process, the launcher as measured, the rest as the
    model grows. ``scale``: the plain loop's ratio at the new size over the cell's (``gate``)."""
    r = ratios(cell)
    assert r is not None
    idle = cell["idle_bytes"]
    fixed = (learners + 2) * idle + cell["memory"].get("launcher", {}).get("peak_bytes", idle) + 0.5 * GiB
    return fixed + scale * model_bytes * (r["syncer"] + r["evaluator"] + learners * r["learner"])


def reference_cell(cells: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The largest measured cell from 30M up (smaller ones are all fixed overhead)."""
    ok = [c for c in cells.values() if ratios(c) and c["params"] >= 20_000_000]
    return max(ok, key=lambda c: c["params"]) if ok else None


def largest_size(cells: dict[str, dict[str, Any]], budget_gib: float, learners: int = 2) -> dict[str, Any]:
    """The largest model (a multiple of 50M parameters) whose 2-learner run stays under the budget by
    the reference cell's ratios. ``params`` is 0 when nothing is measured yet."""
    ref = reference_cell(cells)
    if ref is None:
        return {"params": 0, "why": "no cell from 30M up measured yet"}
    r = ratios(ref)
    assert r is not None
    per_byte = r["syncer"] + r["evaluator"] + learners * r["learner"]
    fixed = estimate_bytes(ref, 0, learners)
    fits = max(0.0, (budget_gib * GiB - fixed) / per_byte) / 4
    params = int(fits // MAX_STEP * MAX_STEP)
    return {
        "params": params,
        "from": ref["size"],
        "per_model_byte": per_byte,
        "fixed_gib": fixed / GiB,
        "budget_gib": budget_gib,
        "estimate_gib": estimate_bytes(ref, 4 * params, learners) / GiB if params else None,
        "at_floor_gib": estimate_bytes(ref, 4 * MIN_MAX_PARAMS, learners) / GiB,
    }


# ----------------------------------------------------------------------------- /proc


# ----------------------------------------------------------------------------- workers


def idle_worker() -> dict[str, Any]:
    """Import what the roles import, then report this process's peak."""
    import torch

    torch.set_num_threads(1)
    import ddiloco.cli  # noqa: F401
    import ddiloco.service.learner.process  # noqa: F401
    import ddiloco.service.ops.evaluator  # noqa: F401
    import ddiloco.service.syncer.service  # noqa: F401
    import ddiloco.workloads.synthetic  # noqa: F401

    time.sleep(0.5)
    return {"vmhwm": status_bytes(os.getpid())["VmHWM"]}


def plain_worker(hidden: int, depth: int, seconds: float) -> dict[str, Any]:
    """The plain single-process loop: the same model, batch, AdamW and step as a learner's, no
    ddiloco around it. At least 3 steps (AdamW's state exists after the first)."""
    import torch

    torch.set_num_threads(1)
    from ddiloco.training.inner import InnerConfig, inner_step, make_optimizer
    from ddiloco.workloads.config import WorkloadConfig
    from ddiloco.workloads.synthetic import SyntheticWorkload

    options = {"hidden": hidden, "depth": depth, "teacher_hidden": TEACHER_HIDDEN}
    wl = SyntheticWorkload(WorkloadConfig(factory="ddiloco.workloads.synthetic:make_workload", batch_size=BATCH,
                                          options=options))  # fmt: skip
    model = wl.build_model(0)
    opt = make_optimizer(model, InnerConfig())
    stream = wl.train_stream(0, 1, 0)
    times, end = [], time.time() + seconds
    while len(times) < 3 or time.time() < end:
        t0 = time.perf_counter()
        inner_step(model, opt, wl.loss(model, stream.next_batch()), 1e-3, 1.0)
        times.append(time.perf_counter() - t0)
    return {"vmhwm": status_bytes(os.getpid())["VmHWM"], "steps": len(times), "step_s": statistics.median(times[1:])}


def run_worker(args: list[str], timeout: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--worker", *args], env=ENV, capture_output=True, text=True,
                         timeout=timeout)  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"bench/scale.py worker {args[0]} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- one cell


def config_for(size: Size) -> dict[str, Any]:
    """The cell's config: defaults except the workload, the fleet and the time budget."""
    return {
        "run": {"num_learners": size.learners, "processed_tokens": 10**15, "seed": 0, "threads": 1},
        "workload": {
            "factory": "ddiloco.workloads.synthetic:make_workload",
            "batch_size": BATCH,
            "options": size.options,
        },  # fmt: skip
        "inner": {"warmup_frac": 0.0},
        "runtime": {"duration_s": size.seconds, "progress_interval_s": 30.0},
    }


def write_toml(data: dict[str, Any], path: Path) -> None:
    import tomli_w

    path.write_text(tomli_w.dumps(data))


class Watch:
    """Peaks of every process under the launcher, the state folder's disk use, the kill."""

    def __init__(self, root: int, run_dir: Path, learners: int) -> None:
        self.root, self.run_dir, self.learners = root, run_dir, learners
        self.procs: dict[int, dict[str, Any]] = {}
        """pid -> role, start time, peak VmHWM, first and last seen."""
        self.disk_peak = 0
        self.disk_series: list[tuple[float, int]] = []
        self.rss_peak = 0
        """The largest resident total of the run's processes at one poll."""
        self.first_step_at: float | None = None
        self.kill: dict[str, Any] | None = None
        self.syncer_kill: dict[str, Any] | None = None
        self.syncer_load: Any = None
        """The first syncer's metrics/syncer-load.json, read just before it was killed."""

    def poll(self) -> int:
        """One look at every descendant; returns their resident total now."""
        total, now = 0, time.time()
        for pid in descendants(self.root):
            role = role_of(pid)
            if role is None or (role == "launcher" and pid != self.root):
                continue  # (a child between fork and exec still shows the launcher's command line)
            mem = status_bytes(pid)
            if not mem:
                continue
            rec = self.procs.get(pid)
            if rec is None or rec["role"] != role:
                rec = self.procs[pid] = {"pid": pid, "role": role, "started": started_at(pid), "first_seen": now,
                                         "peak": 0}  # fmt: skip
            rec["peak"] = max(rec["peak"], mem.get("VmHWM", 0))
            rec["last_seen"] = now
            rec["cpu_s"] = cpu_seconds(pid) or rec.get("cpu_s", 0.0)
            total += mem.get("VmRSS", 0)
        self.rss_peak = max(self.rss_peak, total)
        return total

    def disk(self) -> None:
        b = disk_bytes(self.run_dir / "state")
        self.disk_peak = max(self.disk_peak, b)
        self.disk_series.append((time.time(), b))

    def status(self, name: str) -> dict[str, Any]:
        try:
            return json.loads((self.run_dir / "status" / f"{name}.json").read_text())
        except (OSError, ValueError):
            return {}

    def maybe_kill(self, run_end: float) -> None:
        """SIGKILL learner ``KILLED`` once the fleet has trained ``KILL_AT`` of its time (from its
        first step to the run's end): the successor has the rest to start and contribute."""
        if self.kill is not None:
            return
        if self.first_step_at is None:
            steps = [self.status(f"learner-{m}").get("first_step_at") for m in range(self.learners)]
            if any(steps):
                self.first_step_at = min(s for s in steps if s)
            return
        st = self.status(f"learner-{KILLED}")
        if time.time() - self.first_step_at < KILL_AT * (run_end - self.first_step_at) or st.get("steps", 0) < 2:
            return
        pid = st.get("pid")
        if not pid or role_of(pid) != f"learner-{KILLED}":
            return
        os.kill(pid, signal.SIGKILL)
        self.kill = {"at": time.time(), "pid": pid, "incarnation": st.get("incarnation"), "steps": st.get("steps")}
        print(f"  SIGKILLed learner {KILLED} (pid {pid}) after {st.get('steps')} steps", flush=True)

    def maybe_kill_syncer(self, run_end: float) -> None:
        """SIGKILL the syncer once the fleet has trained ``SYNCER_KILL_AT`` of its time and the
        restarted learner has stepped (its restart is timed first), but not in the run's last 10%.
        Its ``metrics/syncer-load.json`` is kept first: its successor starts anew."""
        if self.syncer_kill is not None or self.first_step_at is None or self.kill is None:
            return
        now, span = time.time(), run_end - self.first_step_at
        if now - self.first_step_at < SYNCER_KILL_AT * span or now - self.first_step_at > 0.9 * span:
            return
        st = self.status(f"learner-{KILLED}")
        if st.get("incarnation") == self.kill["incarnation"] or not (st.get("answered") or st.get("first_step_at")):
            return
        pid = self.status("syncer-0").get("pid")
        if not pid or role_of(pid) != "syncer":
            return
        self.syncer_load = _json(self.run_dir / "metrics" / "syncer-load.json")
        os.kill(pid, signal.SIGKILL)
        self.syncer_kill = {"at": now, "pid": pid}
        print(f"  SIGKILLed the syncer (pid {pid})", flush=True)


def train(size: Size, work: Path, abort_gib: float) -> dict[str, Any]:
    """One ``ddiloco train`` run of ``size``, watched; returns the raw figures and the run folder."""
    cfg_path, run_dir = work / "scale.toml", work / "run"
    write_toml(config_for(size), cfg_path)
    t_start = time.time()
    launcher = Launch([str(cfg_path), "--run-dir", str(run_dir)], work / "train.log")
    watch = Watch(launcher.pid, run_dir, size.learners)
    deadline = t_start + size.seconds * 1.5 + 300 + size.model_bytes / 20e6  # start-up and the end grow with the model
    aborted, last_disk = None, 0.0
    try:
        while launcher.running():
            total = watch.poll()
            if total > abort_gib * GiB and aborted is None:
                aborted = f"the run's processes held {total / GiB:.1f} GiB (over --abort-gib {abort_gib})"
            if time.time() > deadline and aborted is None:
                aborted = f"the run did not end within {deadline - t_start:.0f} s"
            if aborted:
                print(f"  stopping: {aborted}", flush=True)
                break
            if time.time() - last_disk >= 1.0:
                last_disk = time.time()
                watch.disk()
            watch.maybe_kill(t_start + size.seconds)
            watch.maybe_kill_syncer(t_start + size.seconds)
            time.sleep(0.5)
    finally:
        rc = stop(launcher, watch)
    watch.disk()
    return {"watch": watch, "run_dir": run_dir, "wall_s": time.time() - t_start, "aborted": aborted,
            "launcher_rc": rc}  # fmt: skip


def stop(launcher: Launch, watch: Watch) -> int:
    """The launcher stops its children on SIGTERM; whatever of ours is left is SIGKILLed by pid.
    Returns the launcher's exit status."""
    launcher.stop(signal.SIGTERM, 120)
    rc = launcher.wait()
    for pid, rec in watch.procs.items():
        if pid != launcher.pid and role_of(pid) == rec["role"] and started_at(pid) == rec["started"]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return rc


# ----------------------------------------------------------------------------- figures


def memory_figures(watch: Watch, idle: int, model_bytes: int, plain: dict[str, Any]) -> dict[str, Any]:
    """Per role: the peak over its processes, above idle, over the model; learners also per id."""
    by_role: dict[str, list[dict[str, Any]]] = {}
    for rec in watch.procs.values():
        role = "learner" if rec["role"].startswith("learner-") else rec["role"]
        by_role.setdefault(role, []).append(rec)
    out: dict[str, Any] = {}
    for role, recs in by_role.items():
        peak = max(r["peak"] for r in recs)
        out[role] = {"peak_bytes": peak, "above_idle_x": (peak - idle) / model_bytes, "processes": len(recs)}
    if "learner" in out:
        out["learner"]["per_process"] = sorted(
            ({"role": r["role"], "pid": r["pid"], "peak_bytes": r["peak"]} for r in by_role["learner"]),
            key=lambda r: (r["role"], r["pid"]),
        )
        out["learner"]["above_plain_x"] = (out["learner"]["peak_bytes"] - plain["vmhwm"]) / model_bytes
    out["plain"] = {"peak_bytes": plain["vmhwm"], "above_idle_x": (plain["vmhwm"] - idle) / model_bytes}
    out["run_total_peak_bytes"] = watch.rss_peak
    return out


def restart_figures(run_dir: Path, watch: Watch, size: Size, step_s: float | None) -> dict[str, Any]:
    """The SIGKILLed learner's successor: process start, first step, first merged contribution
    (from the tape: the first round that merged an entry of a newer incarnation), against the target."""
    kill = watch.kill
    if kill is None:
        return {"killed": False}
    from ddiloco.core.tape import RoundRecord, parse_tape_record, was_merged
    from ddiloco.report.tape import read_tape

    later = [r for r in watch.procs.values() if r["role"] == f"learner-{KILLED}" and r["pid"] != kill["pid"]]
    succ = min(later, key=lambda r: r["started"] or math.inf) if later else None
    started = succ["started"] if succ else None
    st = watch.status(f"learner-{KILLED}")
    first_merged = None
    for rec in read_tape(run_dir / "state" / "tape.jsonl"):
        rd = parse_tape_record(rec)
        if isinstance(rd, RoundRecord) and any(
            m.learner == KILLED and m.incarnation != kill["incarnation"] and was_merged(m) for m in rd.merged
        ):
            first_merged = rd.closed_at + rec.get("wall_offset", 0.0)
            break
    # AdamW: two states per parameter
    target = 3 * size.model_bytes / (HANDOFF_GBPS * 1e9) + 5.0 + (step_s or 0.0)
    since = lambda t: None if t is None or started is None else t - started  # noqa: E731
    return {
        "killed": True,
        "killed_after_steps": kill["steps"],
        "restart_delay_s": None if started is None else started - kill["at"],
        "imports_model_s": since(st.get("started")) if st.get("incarnation") != kill["incarnation"] else None,
        "first_step_s": since(st.get("first_step_at")) if st.get("incarnation") != kill["incarnation"] else None,
        "first_merged_s": since(first_merged),
        "target_s": target,
    }


def syncer_restart_figures(run_dir: Path, watch: Watch) -> dict[str, Any]:
    """The SIGKILLed syncer's successor: process start, up (its status file), first merge (the
    first merging round it closed, from the tape), in seconds from its start."""
    kill = watch.syncer_kill
    if kill is None:
        return {"killed": False}
    from ddiloco.core.tape import RoundRecord, parse_tape_record
    from ddiloco.report.tape import read_tape

    later = [r for r in watch.procs.values() if r["role"] == "syncer" and r["pid"] != kill["pid"]]
    succ = min(later, key=lambda r: r["started"] or math.inf) if later else None
    started = succ["started"] if succ else None
    first_merge = None
    for rec in read_tape(run_dir / "state" / "tape.jsonl"):
        rd = parse_tape_record(rec)
        closed = rd.closed_at + rec.get("wall_offset", 0.0) if isinstance(rd, RoundRecord) else None
        if isinstance(rd, RoundRecord) and rd.is_merge and started is not None and closed > started:
            first_merge = closed
            break
    return {
        "killed": True,
        "restart_delay_s": None if started is None else started - kill["at"],
        "first_merge_s": None if first_merge is None or started is None else first_merge - started,
    }


def startup_figures(run_dir: Path, watch: Watch) -> dict[str, Any]:
    """``metrics/startup.jsonl`` when the runtime writes it; the first learners' start from outside
    (process start -> status ``started`` (imports, model) -> first step) either way."""
    first = {}
    for rec in watch.procs.values():
        role = rec["role"]
        if role.startswith("learner-") and (role not in first or rec["started"] < first[role]["started"]):
            first[role] = rec
    learners = []
    for role, rec in sorted(first.items()):
        st = _learner_status_of(run_dir, role, rec["pid"])
        if st and rec["started"]:
            learners.append({"role": role, "imports_model_s": st["started"] - rec["started"],
                             "to_first_step_s": (st.get("first_step_at") or math.nan) - rec["started"]})  # fmt: skip
    syncers = [r for r in watch.procs.values() if r["role"] == "syncer"]
    return {"startup_jsonl": _jsonl(run_dir / "metrics" / "startup.jsonl"), "learners_outside": learners,
            "syncer_processes": len(syncers)}  # fmt: skip


def _learner_status_of(run_dir: Path, role: str, pid: int) -> dict[str, Any] | None:
    """The last status a given learner process wrote (kept per pid by this bench's snapshots)."""
    st = _json(run_dir / "status" / f"{role}.json")
    return st if st and st.get("pid") == pid else None


def step_figures(watch: Watch) -> dict[str, Any]:
    """Time inside ``Learner.step()`` over the step's time (sync_s / compute_s, as bench/library.py),
    per learner that was never killed, from its last status file."""
    rows = []
    for m in range(watch.learners):
        if m == KILLED and watch.kill is not None:
            continue
        st = watch.status(f"learner-{m}")
        if st.get("compute_s") and st.get("steps"):
            rows.append({"learner": m, "steps": st["steps"], "step_s": st["compute_s"] / st["steps"],
                         "step_share": st["sync_s"] / st["compute_s"]})  # fmt: skip
    return {
        "learners": rows,
        "step_share": statistics.fmean(r["step_share"] for r in rows) if rows else None,
        "step_s": statistics.fmean(r["step_s"] for r in rows) if rows else None,
    }


def syncer_figures(run_dir: Path, watch: Watch) -> dict[str, Any]:
    """Per shard: ``metrics/syncer-load.json`` when the runtime writes it; from the tape either way,
    the mean interval between a fragment's merging rounds, and the syncer's CPU share."""
    from ddiloco.report.tape import read_rounds

    rounds = read_rounds(run_dir / "state" / "tape.jsonl")
    by_frag: dict[int, list[float]] = {}
    for rd in rounds:
        if rd.is_merge:
            by_frag.setdefault(rd.fragment, []).append(rd.closed_at)
    gaps = [b - a for ts in by_frag.values() for a, b in zip(ts, ts[1:])]
    # The first syncer's load (its successor's file covers only the end of the run); CPU over the
    # syncer processes' lives, from /proc (a restarted syncer's status counts from its own start).
    load = watch.syncer_load if watch.syncer_kill is not None else _json(run_dir / "metrics" / "syncer-load.json")
    syncers = [r for r in watch.procs.values() if r["role"] == "syncer" and r["started"]]
    life = sum(r["last_seen"] - r["started"] for r in syncers)
    return {
        "load": load if isinstance(load, (list, dict)) else None,
        "load_after_restart": _json(run_dir / "metrics" / "syncer-load.json") if watch.syncer_kill else None,
        "fragments": len(by_frag),
        "merging_rounds": sum(len(v) for v in by_frag.values()),
        "round_interval_s_mean": statistics.fmean(gaps) if gaps else None,
        "cpu_share": sum(r.get("cpu_s", 0.0) for r in syncers) / life if life > 0 else None,
    }


def store_figures(watch: Watch, model_bytes: int, seconds: float) -> dict[str, Any]:
    final = watch.disk_series[-1][1] if watch.disk_series else 0
    return {"peak_bytes": watch.disk_peak, "peak_x": watch.disk_peak / model_bytes, "final_x": final / model_bytes,
            "over_s": seconds}  # fmt: skip


def measure(
    size: Size, abort_gib: float, keep: bool, gate: Callable[[dict[str, Any]], str | None] = lambda _: None
) -> dict[str, Any]:
    """One cell: the idle baseline, the plain loop, the run and its figures; ``gate`` (given the
    idle and plain figures) may refuse the run with a reason, before anything large starts."""
    print(f"{size.name}: {size.params:,} parameters (hidden {size.hidden}, depth {size.depth}), "
          f"{size.learners} learners, {size.seconds:.0f} s", flush=True)  # fmt: skip
    idle = run_worker(["idle"], 300)["vmhwm"]
    plain = run_worker(["plain", "--hidden", str(size.hidden), "--depth", str(size.depth), "--seconds", "10"], 900)
    print(f"  idle {idle / 2**20:.0f} MiB, plain loop {plain['vmhwm'] / 2**20:.0f} MiB, "
          f"{plain['step_s'] * 1e3:.0f} ms/step", flush=True)  # fmt: skip
    why = gate({"idle_bytes": idle, "plain": plain, "plain_x": (plain["vmhwm"] - idle) / size.model_bytes})
    if why:
        print(f"  skipped: {why}", flush=True)
        return {"size": size.name, **asdict(size), "params": size.params, "skipped": why, "idle_bytes": idle,
                "plain": plain}  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix=f"ddiloco-scale-{size.name}-"))
    try:
        got = train(size, work, abort_gib)
        watch, run_dir = got["watch"], got["run_dir"]
        steps = step_figures(watch)
        cell = {
            "size": size.name,
            **asdict(size),
            "params": size.params,
            "model_bytes": size.model_bytes,
            "batch_size": BATCH,
            "workload": f"synthetic, teacher_hidden = {TEACHER_HIDDEN}, depth = {size.depth}, hidden = {size.hidden}",
            "idle_bytes": idle,
            "plain": plain,
            "memory": memory_figures(watch, idle, size.model_bytes, plain),
            "store": store_figures(watch, size.model_bytes, size.seconds),
            "steps": steps,
            "restart": restart_figures(run_dir, watch, size, steps["step_s"]),
            "syncer_restart": syncer_restart_figures(run_dir, watch),
            "startup": startup_figures(run_dir, watch),
            "syncer": syncer_figures(run_dir, watch),
            "accounting": _json(run_dir / "metrics" / "accounting.json"),
            "wall_s": got["wall_s"],
            "aborted": got["aborted"],
            "launcher_rc": got["launcher_rc"],
            "date": dt.datetime.now().isoformat(timespec="seconds"),
        }
        if got["aborted"] or got["launcher_rc"] != 0:
            cell["log_tail"] = (work / "train.log").read_text(errors="replace")[-2000:]
        return cell
    finally:
        if keep:
            print(f"  kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


# ----------------------------------------------------------------------------- cache


def code_digest() -> str:
    """A hash of the runtime's source (CODE_DIRS and the top-level modules): equal digests,
    equal code behind a cell's numbers."""
    return source_digest(CODE_DIRS, src=SRC)


def cell_key(size: Size, code: str) -> str:
    return _cell_key(size.name, {"v": CACHE_VERSION, "size": asdict(size), "batch": BATCH, "teacher": TEACHER_HIDDEN,
                                 "code": code})  # fmt: skip


CELLS = CellCache(CACHE)


def cached(key: str) -> dict[str, Any] | None:
    return CELLS.get(key)


def save(key: str, cell: dict[str, Any]) -> None:
    CELLS.put(key, cell)


def latest_cells(code: str | None) -> dict[str, dict[str, Any]]:
    """Every cached cell of this code (None: of any code), the newest per size name."""
    out: dict[str, dict[str, Any]] = {}
    for _, c in CELLS.cells():
        if not (c.get("size") and code in (None, c.get("code_digest"))):
            continue
        if c["size"] not in out or c.get("date", "") > out[c["size"]].get("date", ""):
            out[c["size"]] = c
    return out


# ----------------------------------------------------------------------------- the report


BEFORE = CACHE / "before"
"""Cells measured on the code before issue 21's cuts (commit a30c8ff with the scale workload's
options added), shown beside the new ones: the "before" figures."""
BEFORE_NOTE = (
    "Before: commit a30c8ff (plus the scale workload's options), measured on this machine while other jobs ran "
    "(load 5 to 12: timings are slow, memory is not affected). The issue's own probe at 100M (depth 1, hidden "
    "10000, a teacher as large as the student, 4 learners, 120 s): syncer 11.5x, learner 3.8 to 5.0 GB against "
    "a plain loop's 3.0 GB, evaluator 5.5x, state folder 6x after 2 minutes."
)


def before_cells() -> list[dict[str, Any]]:
    cells = [c for p in sorted(BEFORE.glob("*.json")) if isinstance(c := _json(p), dict) and c.get("memory")]
    return sorted(cells, key=lambda c: (c["params"], c["seconds"]))


def _x(v: Any, fmt: str = "{:.2f}x") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def _s(v: Any) -> str:
    return _x(v, "{:.1f} s")


def _mb(v: Any) -> str:
    return _x(None if v is None else v / 2**20, "{:,.0f} MiB")


def _order(cells: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((c for c in cells.values() if c.get("memory")), key=lambda c: c["params"])


def sizes_section(cells: dict[str, dict[str, Any]]) -> list[str]:
    """Memory, disk, start-up, step share and syncer load per size."""
    rows = _order(cells)
    out = ["## Per size", ""]
    if not rows:
        return [*out, "No size cell measured yet.", *before_lines(before_cells()), ""]
    skipped = [c for c in cells.values() if c.get("skipped")]
    out += [
        "Every size trains the scale workload (synthetic, `teacher_hidden = 64`, `depth = 4`, batch 8) with "
        "`ddiloco train` on this machine, one thread per process. Peaks are VmHWM above an idle process with "
        "the same imports, over the model's fp32 bytes.",
        "",
        "### Memory (peak RSS above idle, over the model's bytes)",
        "",
        "| size | params | model | learners | syncer | learner | evaluator | plain AdamW loop | learner above plain "
        "| run's total |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in rows:
        m = c["memory"]
        out.append(
            f"| {c['size']} | {c['params'] / 1e6:,.1f}M | {_mb(c['model_bytes'])} | {c['learners']} "
            f"| {_x(m.get('syncer', {}).get('above_idle_x'))} | {_x(m.get('learner', {}).get('above_idle_x'))} "
            f"| {_x(m.get('evaluator', {}).get('above_idle_x'))} | {_x(m['plain']['above_idle_x'])} "
            f"| {_x(m.get('learner', {}).get('above_plain_x'))} | {_mb(m.get('run_total_peak_bytes'))} |"
        )
    idle = rows[-1]["idle_bytes"]
    out += [
        "",
        f"Idle process with the roles' imports: {_mb(idle)}. Targets from 100M up: syncer at most 4x with 4 learners; "
        "learner at most 1.5x above the plain loop (fp32 payloads).",
    ]
    out += before_lines(before_cells())
    out += [
        "",
        "### Store, start-up, step share, syncer load",
        "",
        "| size | store peak / model (run) | restarted learner: first merged (target) | first step | "
        "step() share | step | rounds merged | round interval | merge / interval (per shard) | syncer CPU "
        "| learners' time starting | restarted syncer: first merge |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in rows:
        r, s, sy = c["restart"], c["steps"], c["syncer"]
        out.append(
            f"| {c['size']} | {_x(c['store']['peak_x'])} ({c['store']['over_s']:.0f} s) "
            f"| {_s(r.get('first_merged_s'))} ({_s(r.get('target_s'))}) | {_s(r.get('first_step_s'))} "
            f"| {_x(s['step_share'], '{:.2%}')} | {_x(s['step_s'], '{:.3f} s')} | {sy['merging_rounds']} "
            f"| {_s(sy['round_interval_s_mean'])} | {_load(sy.get('load'))} | {_x(sy['cpu_share'], '{:.0%}')} "
            f"| {_x(_starting(c.get('accounting')), '{:.0%}')} "
            f"| {_s(c.get('syncer_restart', {}).get('first_merge_s'))} |"
        )
    out += [
        "",
        "The store's peak is the disk use of `RUN/state` polled every second; the issue's 10-minute run is the 100M "
        "cell's. The restart target is (model + AdamW state bytes) / 0.5 GB/s + 5 s + one step, counted from the "
        "new process's start (learner 1 is SIGKILLed at 30% of the fleet's training time; the syncer at 65%, its "
        "successor's first merge counted the same way). step() share: time inside `Learner.step()` over step "
        "time, the learners never killed "
        "(bench/library.py's measure). Target from 30M up: at most 2%. Learners' time starting: the launcher's "
        "account (`metrics/accounting.json`, starting and restarting) over the learners' time in the run.",
        "",
        *startup_lines(rows),
    ]
    for c in skipped:
        out.append(f"- {c['size']}: not run: {c['skipped']}")
    if skipped:
        out.append("")
    return out


def before_lines(cells: list[dict[str, Any]]) -> list[str]:
    """The "before" cells: memory and store as in the tables above, and the restart."""
    if not cells:
        return []
    out = [
        "",
        "Before the cuts:",
        "",
        "| size (run) | syncer | learner | evaluator | plain AdamW loop | learner above plain | learner peaks (MiB) "
        "| store peak / model | restarted: first merged (target) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        m, r = c["memory"], c["restart"]
        peaks = ", ".join(f"{p['peak_bytes'] / 2**20:,.0f}" for p in m["learner"].get("per_process", []))
        out.append(
            f"| {c['size']} ({c['seconds']:.0f} s) | {_x(m['syncer']['above_idle_x'])} "
            f"| {_x(m['learner']['above_idle_x'])} | {_x(m['evaluator']['above_idle_x'])} "
            f"| {_x(m['plain']['above_idle_x'])} | {_x(m['learner'].get('above_plain_x'))} | {peaks} "
            f"| {_x(c['store']['peak_x'])} | {_s(r.get('first_merged_s'))} ({_s(r.get('target_s'))}) |"
        )
    return [*out, "", BEFORE_NOTE]


def _starting(acc: dict[str, Any] | None) -> float | None:
    if not acc or not acc.get("horizon_s") or not acc.get("learners"):
        return None
    return (acc.get("starting_s", 0.0) + acc.get("restarting_s", 0.0)) / (acc["horizon_s"] * acc["learners"])


def _load(load: Any) -> str:
    """merge_s_mean / round_interval_s_mean per shard, from metrics/syncer-load.json."""
    shards = load if isinstance(load, list) else (load or {}).get("shards", [load] if load else [])
    parts = []
    for sh in shards:
        if isinstance(sh, dict) and sh.get("round_interval_s_mean"):
            parts.append(f"{sh.get('shard', 0)}: {sh['merge_s_mean'] / sh['round_interval_s_mean']:.1%}")
    return ", ".join(parts) or "-"


def startup_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Start-up by phase (metrics/startup.jsonl): the mean of each phase per role and size."""
    out = ["### Start-up by phase (seconds from the process's start)", ""]
    any_phase = False
    for c in rows:
        recs = c["startup"]["startup_jsonl"]
        for role in ("learner", "syncer"):
            mine = [r for r in recs if r.get("role") == role and isinstance(r.get("phases"), dict)]
            if not mine:
                continue
            any_phase = True
            firsts = {}  # per learner id (per shard), its first process; later ones are restarts
            for r in sorted(mine, key=lambda r: r.get("incarnation", 0)):
                firsts.setdefault(r.get("id", r.get("shard")), r)
            first = list(firsts.values())
            restarted = [r for r in mine if all(r is not f for f in first)]
            for what, group in (("first start", first), ("restarted", restarted)):
                if not group:
                    continue
                names = list(dict.fromkeys(k for r in group for k in r["phases"]))
                means = {k: statistics.fmean(r["phases"][k] for r in group if k in r["phases"]) for k in names}
                out.append(f"- {c['size']} {role} ({what}, {len(group)}): " + ", ".join(
                    f"{k} {v:.1f}" for k, v in means.items()))  # fmt: skip
        outside = c["startup"]["learners_outside"]
        if outside:
            imp = statistics.fmean(x["imports_model_s"] for x in outside)
            first_step = [x["to_first_step_s"] for x in outside if math.isfinite(x["to_first_step_s"])]
            to_step = statistics.fmean(first_step) if first_step else math.nan
            out.append(f"- {c['size']} learners seen from outside: imports and model {imp:.1f} s, first step "
                       f"{to_step:.1f} s after the process started")  # fmt: skip
    if not any_phase:
        out.append("(`metrics/startup.jsonl` not written by this runtime: only what is seen from outside.)")
    return [*out, ""]


def _pending(what: str, module: str) -> Callable[[Any], list[str]]:
    def render(data: Any) -> list[str]:
        return [f"## {what.capitalize()}", "", f"Not measured in this report ({module}).", ""]

    return render


FLEET_LEARNERS, FLEET_SHARDS, FLEET_ENCODINGS, FLEET_SECONDS = (32, 64), (1, 2, 4), ("int4", "fp32"), 40.0
"""The fleet cells: 32 and 64 fake learners at 1, 2 and 4 shards, int4 both ways then fp32."""
MERGE_CACHE = BENCH_CACHE / "scale" / "merge"


def run_fleet(force: bool = False) -> list[dict[str, Any]]:
    """Every fleet cell (bench/scale_fleet.py; cached in its own folder)."""
    import scale_fleet

    out = []
    for enc in FLEET_ENCODINGS:
        for n in FLEET_LEARNERS:
            for shards in FLEET_SHARDS:
                try:
                    cell = scale_fleet.run_fleet_cell(n, shards, enc, FLEET_SECONDS, scale_fleet.CACHE, force=force)
                    out.append(cell)
                except (RuntimeError, ValueError) as e:  # one cell that could not run is said, the rest go on
                    out.append({"encoding": enc, "learners": n, "shards": shards, "error": str(e)})
                print(f"fleet {enc} {n} learners, {shards} shards: done", flush=True)
    return out


def run_merge(code: str) -> dict[str, Any]:
    """The merge against an in-place add (bench/scale_merge.py), cached per code digest."""
    path = MERGE_CACHE / f"merge-{code}.json"
    got = _json(path)
    if isinstance(got, dict):
        return got
    import scale_merge

    rows = []
    for name, numel in scale_merge.SIZES.items():
        for merge in scale_merge.MERGES:
            for threads in sorted({1, os.cpu_count() or 1}):
                row = scale_merge.merge_throughput(numel, 4, threads, merge, "delta")
                rows.append({**row, "fragment": name})
    result = {"rows": rows, "code_digest": code, "cores": os.cpu_count()}
    MERGE_CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


def fleet_cached() -> list[dict[str, Any]]:
    """The fleet cells already measured (their cache), in the run's order."""
    import scale_fleet

    out = []
    for enc in FLEET_ENCODINGS:
        for n in FLEET_LEARNERS:
            for shards in FLEET_SHARDS:
                key = scale_fleet.cell_key(n, shards, enc, FLEET_SECONDS, scale_fleet.HIDDEN)
                got = _json(scale_fleet.CACHE / f"{key}.json")
                if isinstance(got, dict):
                    out.append(got)
    return out


def fleet_section(cells: Any) -> list[str]:
    if not cells:
        return _pending("fleet", "bench/scale_fleet.py")(cells)
    import scale_fleet

    ok = [c for c in cells if "error" not in c]
    lines = [
        "## Fleet: many learners against 1, 2 and 4 shards",
        "",
        "Fake learners (bench/scale_fleet.py: the real learner session, comm thread, transport and wire; a 1 s "
        "sleep for a step; pre-built fragments of a 100M model at P = 24, H = 24, so each learner answers one "
        f"request a second) against real `ddiloco syncer` shard processes, {FLEET_SECONDS:.0f} s measured per cell "
        "after every learner is live. Late: a round that closed more than 100 ms after its quorum-and-grace "
        "condition was met (computed from the learners' send times and the tape). Everything (the syncers and "
        "the fake learners) shares this machine's 2 cores, so the syncer's figures are what it got beside them.",
        "",
        scale_fleet.table(ok),
        "",
    ]
    lines += [f"- {c['encoding']}, {c['learners']} learners, {c['shards']} shards: not measured ({c['error']})"
              for c in cells if "error" in c]  # fmt: skip
    return lines


def merge_section(data: Any) -> list[str]:
    if not data:
        return _pending("merge", "bench/scale_merge.py")(data)
    lines = [
        "## Merge against an in-place add",
        "",
        "One fragment's round as the syncer does it (4 delta payloads: each measured and added into the running "
        "merge, then the outer Nesterov step; bench/scale_merge.py) against `add_` of the same payloads, best of 3, "
        f"on 1 thread and on all {data.get('cores')} cores. `recycled`: the new version written into a buffer "
        "that left (the allocation's page faults are the difference).",
        "",
        "| fragment | merge | threads | merge GB/s | add GB/s | merge / add | recycled / add |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['fragment']} | {r['merge']} | {r['threads']} | {r['merge_gb_per_s']:.2f} | {r['add_gb_per_s']:.2f} "
            f"| {r['merge_over_add']:.2f}x | {r['recycled_over_add']:.2f}x |"
        )
    return [*lines, ""]


RENDERERS: dict[str, Callable[[Any], list[str]]] = {
    "sizes": sizes_section,
    "fleet": fleet_section,
    "merge": merge_section,
}
"""One section per key of the report's cells, in this order; the fleet and merge hooks are
replaced by their modules' renderers (``RENDERERS["fleet"] = scale_fleet.report_lines``)."""


READING = """## Reading (the cells of this report's code digest)

- **Memory.** The syncer's peak is values + outer momentum + open rounds + what it decodes: 3.85x
  the model at 100M with 4 learners (target 4x: met), 3.26x at 200M. Before the cuts it was
  10-11.5x: four past versions kept as anchors, a merge buffer per fragment, a model (and a
  teacher as large as it) beside the core, a final sync with every round open at once, a final
  model assembled and serialised in memory, a restart that built a model and copied every record.
  A learner that trains and answers holds 1.3-1.4x the model above the plain loop (target 1.5x:
  met); the one serving a peer's optimizer state holds one parameter's moments more (the scale
  workload's hidden layers are 25M parameters at 100M: 200 MB a piece, so 1.8x), and a restarted
  learner that started cold holds its own moments until the peer's have all arrived (1.8x at
  100M, 2.2x at 200M: not met; loading the peer's state piece by piece as it arrives would cut
  it). 30M reads high for every role, the plain loop too: its 30 MB tensors sit under glibc's
  mmap threshold and freed ones stay in the heap.
- **Disk.** The store's folder peaks at 2.0x the model (240 s runs) and 2.38x over the 10-minute
  100M run of the first measurement (same store code): the target was 5x.
- **Start-up.** Not met on this machine: 4 learners, a syncer and an evaluator share 2 cores, so a
  restarted 100M learner spends 17 s on imports and the model build alone (2.9 s of imports and
  about 1 s of build when it has a core), and its first merged contribution comes at 33 s
  against the 15 s target. The transfer itself (join download and hand-off) is a few seconds.
- **step() share.** 2.5% at 100M and 3.1% at 200M against a 2% target: the boundary's copies
  are a few ms, and the rest is the training thread waiting for the comm thread (which holds
  the session while it decodes 17 MB versions) on 2 crowded cores.
- **Merge against the round's interval.** 1.3% at 1M. From 30M up no fragment merged twice
  within one syncer process (each cell kills the syncer at 65% of its time), so the per-shard
  column is empty; against the tape's round interval the mean merge work per round is 1.2% at
  100M (1.6 s of 130 s) and 0.4% at 200M, and it was 0.7% in the first, 600 s, 100M run.
- **Largest size.** 300M with 2 learners would need 24.6 GiB by the measured ratios (two learners
  at 5x the model for their own training, the syncer, the evaluator, the imports): 200M is the
  largest that fits this 24 GiB machine.
- **Fleet.** See the table: with int4 both ways every round closes late at 32 learners on 1 and
  on 2 shards. Each int4 answer costs the syncer about 40 ms of CPU (decode, checks, norm, merge)
  and a round closes at its quorum, so most of the 32 answers arrive after it and are decoded
  only to be dropped as late; beside 32 fake learners on the same 2 cores a shard gets under one
  core. Not met (0 late rounds at 32 learners with 2 shards); dropping an answer whose round has
  closed before decoding it is the next step.
"""
"""What the cells say, written for the cells of the commit the report was made at."""


def write_report(cells: dict[str, Any], path: Path) -> None:
    """``cells``: {"sizes": {name: cell}, "fleet": ..., "merge": ...} (a missing key is "not
    measured"). Writes ``path`` (markdown) and the same name with .json."""
    path = Path(path)
    meta = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {_mem_total() / GiB:.0f} GiB",
        "code_digest": cells.get("code_digest") or code_digest(),
        "largest": cells.get("largest"),
    }
    lines = [
        "# Scale: memory, disk, start-up and the syncer's load from 1M to the largest size here",
        "",
        f"`python bench/scale.py` on {meta['machine']}, {meta['date']}; code digest `{meta['code_digest']}`.",
        "",
    ]
    big = meta["largest"]
    if big:
        lines += [_largest_line(big), ""]
    for key, render in RENDERERS.items():
        lines += render(cells.get(key) or {})
    lines += READING.splitlines()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip() + "\n")
    path.with_suffix(".json").write_text(json.dumps({**meta, **{k: cells.get(k) for k in RENDERERS}}, indent=1) + "\n")


def _largest_line(big: dict[str, Any]) -> str:
    if not big.get("params"):
        return f"Largest size: not found ({big.get('why')})."
    fits = big["params"] >= MIN_MAX_PARAMS
    return (
        f"Largest size with 2 learners under {big['budget_gib']:.0f} GiB, by the {big['from']} cell's ratios: "
        f"{big['params'] / 1e6:,.0f}M parameters (about {big['estimate_gib']:.1f} GiB; 300M would need "
        f"{big['at_floor_gib']:.1f} GiB)" + ("." if fits else ": below the issue's 300M floor.")
    )


def _mem_total() -> int:
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


# ----------------------------------------------------------------------------- main


def plan_sizes(names: list[str], seconds: float | None, cells: dict[str, dict[str, Any]], budget_gib: float
               ) -> tuple[list[Size], dict[str, Any] | None]:  # fmt: skip
    """The cells to run; "max" is sized from what is measured (the cells of this run before it)."""
    out, largest = [], None
    for name in names:
        if name == "max":
            largest = largest_size(cells, budget_gib)
            if largest["params"] < MIN_MAX_PARAMS:
                print(f"max: {_largest_line(largest)}", flush=True)
            if largest["params"]:
                out.append(size_of("max", largest["params"], seconds))
        else:
            out.append(size_of(name, SIZES[name], seconds))
    return out, largest


def parse_sizes(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in (*SIZES, "max")]
    if bad or not names:
        raise SystemExit(f"--sizes takes a comma-separated list of {', '.join([*SIZES, 'max'])}; got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,30M,100M,max", help="comma-separated: 1M, 30M, 100M, max (default: all)")
    ap.add_argument("--seconds", type=float, help="each run's length (default: 90, 120, 600 and 240 s by size)")
    ap.add_argument("--budget-gib", type=float, default=18.0, help="the memory a cell may plan for (default 18)")
    ap.add_argument("--abort-gib", type=float, default=20.0, help="stop a run whose processes hold more (default 20)")
    ap.add_argument("--force", action="store_true", help="run a cell even when the arithmetic says it does not fit")
    ap.add_argument("--report", action="store_true", help="write the report from cached cells only")
    ap.add_argument("--any-code", action="store_true", help="with --report: the newest cells whatever their code")
    ap.add_argument("--out", default=str(RESULTS / "scale.md"), help="the report (and its .json)")
    ap.add_argument("--keep", action="store_true", help="keep each cell's run folder (they are large)")
    ap.add_argument("--parts", default="sizes,fleet,merge", help="which parts to run (default all three)")
    ap.add_argument("--worker", choices=["idle", "plain"], help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--depth", type=int, default=DEPTH, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "idle":
        print(json.dumps(idle_worker()))
        return 0
    if args.worker == "plain":
        print(json.dumps(plain_worker(args.hidden, args.depth, args.seconds or 10.0)))
        return 0
    if args.seconds is not None and not (args.seconds > 0 and math.isfinite(args.seconds)):
        raise SystemExit(f"--seconds must be a positive number of seconds, got {args.seconds}")
    names, code = parse_sizes(args.sizes), code_digest()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"sizes", "fleet", "merge"}:
        raise SystemExit(f"--parts takes a comma-separated list of sizes, fleet, merge; got {args.parts!r}")
    cells = latest_cells(None if args.report and args.any_code else code)
    largest = None
    if not args.report and "sizes" in parts:
        for name in names:  # in size order: "max" is sized from the cells before it
            sizes, big = plan_sizes([name], args.seconds, cells, args.budget_gib)
            largest = big or largest
            for size in sizes:
                key = cell_key(size, code)
                cell = cached(key)
                if cell is None:
                    cell = run_cell(size, cells, args)
                    cell.update(code_digest=code, key=key)
                    if not cell.get("skipped"):  # (a skip is decided again next time: --force, new ratios)
                        save(key, cell)
                else:
                    print(f"{size.name}: cached ({key})", flush=True)
                cells[size.name] = cell
    sizes_cells = {k: v for k, v in cells.items() if k in names}
    fleet = run_fleet(args.force) if "fleet" in parts and not args.report else fleet_cached()
    merge = run_merge(code) if "merge" in parts and not args.report else _json(MERGE_CACHE / f"merge-{code}.json")
    write_report({"sizes": sizes_cells, "fleet": fleet, "merge": merge, "code_digest": code,
                  "largest": largest or largest_size(cells, args.budget_gib)}, Path(args.out))  # fmt: skip
    print(f"wrote {args.out} and its .json", flush=True)
    return 0


def run_cell(size: Size, cells: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Measure ``size``, unless the arithmetic from the reference cell says it would not fit.

    The reference's ratios are scaled by the plain loop's ratio here over there (at most 1): at
    30M every tensor is 30 MB, under glibc's 32 MiB mmap ceiling, and freed ones stay in the heap,
    which inflates every role's ratio there against larger sizes (the plain loop shows by how much)."""
    ref = reference_cell(cells)
    if ref is None or ref["size"] == size.name or args.force:
        return measure(size, args.abort_gib, args.keep)

    def gate(here: dict[str, Any]) -> str | None:
        scale = min(1.0, here["plain_x"] / ref["memory"]["plain"]["above_idle_x"])
        need = estimate_bytes(ref, size.model_bytes, size.learners, scale) / GiB
        if need <= args.budget_gib:
            return None
        return (f"about {need:.1f} GiB by the {ref['size']} cell's ratios (x{scale:.2f}, the plain loops' ratio), "
                f"over the {args.budget_gib:.0f} GiB budget")  # fmt: skip

    return measure(size, args.abort_gib, args.keep, gate)


if __name__ == "__main__":
    sys.exit(main())
