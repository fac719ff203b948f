"""Processes measured from /proc (CPU seconds, RSS and peaks, start times, roles), sampled over
time, and the small statistics the benches report (quantiles, rates, the spread of repeats)."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def read_proc(path: str) -> str | None:
    """A /proc file's text; None when the process is gone."""
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def status_bytes(pid: int) -> dict[str, int]:
    """VmHWM and VmRSS of ``pid`` in bytes (empty when it is gone)."""
    out = {}
    for line in (read_proc(f"/proc/{pid}/status") or "").splitlines():
        if line.startswith(("VmHWM:", "VmRSS:")):
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def rss_kb(pid: int) -> int | None:
    """Resident memory of ``pid`` in kB (None when it is gone)."""
    got = status_bytes(pid).get("VmRSS")
    return None if got is None else got // 1024


def cpu_seconds(pid: int) -> float | None:
    """User and system CPU time of ``pid`` so far (/proc/PID/stat); None when it is gone."""
    stat = read_proc(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def children_map() -> dict[int, list[int]]:
    """ppid -> pids, over every process on the machine."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = read_proc(f"/proc/{entry}/stat")
        if not stat:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(root: int) -> list[int]:
    """``root`` and every process under it."""
    kids, out, todo = children_map(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def started_at(pid: int) -> float | None:
    """The wall time ``pid`` started, to 10 ms: its start in clock ticks since boot (/proc/PID/stat)
    against the time since boot now (/proc/uptime; /proc/stat's btime is whole seconds)."""
    stat, up = read_proc(f"/proc/{pid}/stat"), read_proc("/proc/uptime")
    if not stat or not up:
        return None
    return time.time() - float(up.split()[0]) + int(stat.rsplit(")", 1)[1].split()[19]) / CLK_TCK


def role_of(pid: int) -> str | None:
    """``syncer``, ``learner-M``, ``evaluator``, ``launcher``, ``links`` from a ddiloco command line."""
    argv = (read_proc(f"/proc/{pid}/cmdline") or "").split("\0")
    if "ddiloco" not in argv:
        return None
    i = argv.index("ddiloco")
    role = argv[i + 1] if i + 1 < len(argv) else ""
    if role == "learner" and "--id" in argv:
        return f"learner-{argv[argv.index('--id') + 1]}"
    return {"train": "launcher", "syncer": "syncer", "evaluator": "evaluator", "link": "links"}.get(role)


def disk_bytes(folder: Path) -> int:
    """What ``du`` says of ``folder``: allocated blocks of every file under it."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                pass
    return total


@dataclass(frozen=True)
class Sample:
    """One look at one process."""

    t: float
    """Seconds since the sampler's start."""
    pid: int
    """The process (a restarted role has a new one)."""
    rss_kb: int
    """Resident memory."""
    cpu_s: float
    """CPU seconds it has used since it started."""


@dataclass
class Sampler:
    """CPU seconds and RSS of named processes over time (``sample`` once per tick of a bench's loop)."""

    t0: float = field(default_factory=time.time)
    """The samples' clock origin (wall time)."""
    series: dict[str, list[Sample]] = field(default_factory=dict)
    """Role name -> its samples, oldest first."""

    def sample(self, name: str, pid: int) -> Sample | None:
        """Look at ``pid`` now, as role ``name``; None (nothing kept) when it is gone."""
        kb, cpu = rss_kb(pid), cpu_seconds(pid)
        if not kb or cpu is None:
            return None
        s = Sample(round(time.time() - self.t0, 2), pid, kb, cpu)
        self.series.setdefault(name, []).append(s)
        return s

    def cpu_share(self, name: str) -> float | None:
        """The role's CPU seconds over wall seconds, across its last process's samples."""
        xs = self.series.get(name, [])
        last = [s for s in xs if xs and s.pid == xs[-1].pid]
        if len(last) < 2 or last[-1].t <= last[0].t:
            return None
        return (last[-1].cpu_s - last[0].cpu_s) / (last[-1].t - last[0].t)


# -- statistics --------------------------------------------------------------------------------


def quantile_low(xs: Sequence[float], q: float) -> float | None:
    """The element at index floor(q (n - 1)) of sorted ``xs`` (no interpolation); None when empty."""
    s = sorted(xs)
    return s[int(q * (len(s) - 1))] if s else None


def quantile_rank(xs: Sequence[float], q: float) -> float:
    """The element at index min(n - 1, floor(q n)) of sorted ``xs``; NaN when empty."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def rate(times: Sequence[float], t0: float, t1: float) -> float:
    """Events per second of ``times`` in [t0, t1)."""
    return sum(1 for t in times if t0 <= t < t1) / (t1 - t0)


def spread(xs: Sequence[float]) -> dict[str, float]:
    """Mean, min, max and the sample standard deviation of repeated measurements (NaN below 2)."""
    if not xs:
        return {"n": 0, "mean": math.nan, "min": math.nan, "max": math.nan, "stdev": math.nan}
    return {
        "n": len(xs),
        "mean": statistics.fmean(xs),
        "min": min(xs),
        "max": max(xs),
        "stdev": statistics.stdev(xs) if len(xs) > 1 else math.nan,
    }
