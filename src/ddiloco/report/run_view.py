"""A run folder read for the report (``load_run``: its metrics, accounting, tape and summary, times
in seconds since the run started), and the series the report draws from it (the learners'
counters by the rules of ``core.counters``, goodput per time bucket)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.core.counters import IncarnationCounters, Increment
from ddiloco.core.tape import RoundRecord
from ddiloco.errors import DDiLoCoError
from ddiloco.report.summary import fleet_size
from ddiloco.report.tape import MAX_RECORDS, read_json, read_jsonl_cut, read_toml, rounds_of

# --- reading ---------------------------------------------------------------------------------


def _num(x: Any) -> float | None:
    """A finite float, or None (JSON may hold strings, nulls, NaN or booleans)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


@dataclass
class Run:
    """One run folder, read."""

    path: Path
    label: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    accounting: dict[str, Any] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)
    learners: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    tape: list[dict[str, Any]] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    """The tape's well-formed round records, typed (times as seconds since the start)."""
    notes: list[str] = field(default_factory=list)
    """What the page should say about how this folder was read (cut files, old format ...)."""

    @property
    def name(self) -> str:
        return self.path.name or str(self.path)

    @property
    def method(self) -> str:
        m = self.summary.get("method") or self.config.get("run", {}).get("method")
        return str(m) if m else "?"

    @property
    def clock(self) -> str:
        c = self.summary.get("clock")
        if c in ("virtual", "wall"):
            return str(c)
        by = str(self.meta.get("by", ""))
        return "virtual" if "simulate" in by else "wall" if by else "unknown"

    @property
    def loss_unit(self) -> str:
        u = self.summary.get("loss_unit")
        return str(u) if u else "loss"

    @property
    def num_learners(self) -> int:
        """M, by the summary's rule (``report.summary.fleet_size``)."""
        return fleet_size(self.config, self.accounting, self.learners)


def _key(x: Any) -> Any:
    """A learner id as a hashable, sortable key (ints stay ints)."""
    return x if isinstance(x, int) and not isinstance(x, bool) else str(x)


def _sort_key(x: Any) -> tuple[int, Any]:
    return (0, x) if isinstance(x, int) else (1, str(x))


def load_run(path: str | Path) -> Run:
    """Read a run folder (format 2; an older one is read as far as its files allow)."""
    d = Path(path)
    if not d.is_dir():
        raise DDiLoCoError(f"{d} is not a folder; ddiloco report needs run folders (see docs/operations.md)")
    run = Run(path=d, meta=read_json(d / "run.json"), summary=read_json(d / "summary.json"))
    run.config = read_toml(d / "config.toml")
    run.accounting = read_json(d / "metrics" / "accounting.json")
    fmt = run.meta.get("format")
    if not run.meta:
        run.notes.append("no readable run.json: the folder's format is unknown")
    elif fmt != 2:
        run.notes.append(f"run.json says format {fmt}; this report reads format 2")
    if not run.summary:
        run.notes.append("no readable summary.json (the table shows what it can)")
    sources = {"eval": "evals", "learner": "learners", "fault": "faults"}
    files = {"eval": "eval.jsonl", "learner": "learners.jsonl", "fault": "faults.jsonl"}
    if (d / "metrics").is_dir():
        for event, attr in sources.items():
            records, cut = read_jsonl_cut(d / "metrics" / files[event])
            setattr(run, attr, [r for r in records if r.get("event", event) == event])
            if cut:
                run.notes.append(f"metrics/{files[event]} has more than {MAX_RECORDS:,} records; the rest is not shown")
    else:  # no metrics/ (an older folder, or only the merged file was copied): split metrics.jsonl
        records, cut = read_jsonl_cut(d / "metrics.jsonl")
        for event, attr in sources.items():
            setattr(run, attr, [r for r in records if r.get("event") == event])
        if cut:
            run.notes.append(f"metrics.jsonl has more than {MAX_RECORDS:,} records; the rest is not shown")
    tape_path = d / "tape.jsonl" if (d / "tape.jsonl").exists() else d / "state" / "tape.jsonl"
    tape, cut = read_jsonl_cut(tape_path)
    if cut:
        run.notes.append(f"tape.jsonl has more than {MAX_RECORDS:,} records; the rest is not shown")
    run.tape = _tape_times(tape, _num(run.meta.get("started_at")), run.notes)
    run.rounds = rounds_of(run.tape)
    return run


def _tape_times(tape: list[dict[str, Any]], started_at: float | None, notes: list[str]) -> list[dict[str, Any]]:
    """Tape records with their times as seconds since the run started.

    A real run's records keep the syncer's monotonic times and carry ``wall_offset``:
    ``time + wall_offset - started_at``. Simulated ones are already seconds since the start.
    """
    keys = ("opened_at", "closed_at", "time")
    offsets = [_num(r.get("wall_offset")) for r in tape]
    if started_at is None and any(o is not None for o in offsets):
        # run.json lacks started_at: take the earliest wall time on the tape as the start
        walls = [_num(r.get(k)) + o for r, o in zip(tape, offsets) if o is not None for k in keys if _num(r.get(k))]
        started_at = min(walls, default=0.0)
        notes.append("run.json has no started_at: tape times are counted from the tape's first record")
    out = []
    for r, off in zip(tape, offsets):
        if off is not None and started_at is not None:
            r = dict(r)
            for k in keys:
                v = _num(r.get(k))
                if v is not None:
                    r[k] = v + off - started_at
        out.append(r)
    return out


# --- derived series ---------------------------------------------------------------------------


def _by_learner(records: list[dict[str, Any]]) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("learner") is None or _num(r.get("time")) is None:
            continue
        out.setdefault(_key(r["learner"]), []).append(r)
    for rs in out.values():
        rs.sort(key=lambda r: r["time"])
    return dict(sorted(out.items(), key=lambda kv: _sort_key(kv[0])))


def _one_learner(records: list[dict[str, Any]], key: str) -> list[Increment]:
    """What each of one learner's readings of counter ``key`` added (``core.counters`` rules)."""
    return IncarnationCounters.of_records([{**r, "learner": 0} for r in records], key)[1]


def busy_increments(records: list[dict[str, Any]], key: str = "busy_s") -> list[tuple[float, float, float]]:
    """(start, end, seconds) pieces of one learner's cumulative busy-time counter.

    Counters restart from 0 when the learner's process restarts (a new incarnation, or for
    records without one, a decrease): the new value is what was done since, inside
    ``[end - value, end]`` at the latest (and so is the first report's value)."""
    return [(i.start, i.end, i.amount) for i in _one_learner(records, key) if i.amount > 0]


def goodput_series(run: Run, buckets: int | None = None) -> tuple[list[float], list[float], float] | None:
    """Bucket edges, goodput per bucket (sum of busy seconds / (M x bucket length)) and the mean.

    Busy seconds add up by the rule the summary uses (``core.counters``: per incarnation, restarts
    handled). A run without accounting (started by hand) has for goodput in its summary that busy
    share over its run length; the series spans the same length, so the mean shown is it."""
    per = _by_learner(run.learners)
    counters, steps = IncarnationCounters.of_records(run.learners, "busy_s")
    pieces = [(i.start, i.end, i.amount) for i in steps if i.amount > 0]
    horizon = max((i.end for i in steps), default=0.0)
    length = _num(run.summary.get("run_time_s"))
    if not run.accounting and length is not None and length > 0:
        horizon = length
    m = run.num_learners
    if not pieces or horizon <= 0 or m <= 0:
        return None
    n = buckets or max(5, min(60, max(len(rs) for rs in per.values()) // 2))
    width = horizon / n
    by_learner: dict[int, list[float]] = {}
    for step in (i for i in steps if i.amount > 0):
        s, e, amount = step.start, step.end, step.amount
        busy = by_learner.setdefault(step.learner, [0.0] * n)
        if e <= s:
            busy[min(n - 1, max(0, int(e / width)))] += amount
            continue
        i0, i1 = int(s / width), min(n - 1, int(e / width))
        for i in range(max(0, i0), i1 + 1):
            overlap = min(e, (i + 1) * width) - max(s, i * width)
            if overlap > 0:
                busy[i] += amount * overlap / (e - s)
    # A learner is busy at most the whole bucket: a restarted process's first reading is placed at
    # the latest it can have started, which may overlap its predecessor's last (share over 100%).
    busy = [sum(min(width, b[i]) for b in by_learner.values()) for i in range(n)]
    edges = [i * width for i in range(n + 1)]
    return edges, [b / (m * width) for b in busy], counters.total() / (m * horizon)


def cumulative(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """Times and the counter summed over the learner's incarnations (restarts handled)."""
    ts, vs, total = [], [], 0.0
    for i in _one_learner(records, key):
        total += i.amount
        ts.append(i.end)
        vs.append(total)
    return ts, vs
