"""How long a process took to become useful, by phase (``RUN/metrics/startup.jsonl``).

A learner's phases: ``imports`` (the interpreter and its imports, up to the driver's first
line), ``model`` (the model and optimizer built), ``join`` (the syncer accepted it), ``download``
(the global fragments applied), ``handoff`` (a peer's optimizer state loaded; a first start has
none), ``first_step`` and ``first_merged`` (a version that merged its own contribution arrived).
A syncer's: ``imports``, ``restore`` (its durable state read back) and ``first_merge``. Each is
the seconds from the process's start (as the kernel counts it, so the interpreter's own start
is in ``imports``) to the phase's end; a phase that did not happen is missing. A learner that
takes back its own saved state has a ``restore`` phase (after ``model``). Beside each phase's
time, ``peak_mib`` has the process's peak resident size when the phase ended (it only grows:
the phase where it jumps is the one that needed the memory). The record is written once, when
the last phases are reached or the process stops, whichever comes first.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ddiloco.service.base.heap import peak_resident_bytes

log = logging.getLogger(__name__)

LEARNER_LAST = ("first_step", "first_merged")
"""A learner's record is complete once it has stepped and been merged."""


def process_age_s() -> float:
    """Seconds since this process started, from ``/proc`` (0 where that is not readable)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - started)


class StartupTimes:
    """The phases of one process start, marked as they end (the first mark of each counts)."""

    def __init__(self, role: str, last: tuple[str, ...], **who: Any) -> None:
        """``last``: the phases after which the record is complete and written."""
        self.role, self.last, self.who = role, last, who
        self.started = time.monotonic() - process_age_s()
        self.phases: dict[str, float] = {}
        self.peak_mib: dict[str, float] = {}
        self.run_dir: Path | None = None
        self.written = False

    def mark(self, phase: str) -> None:
        if phase in self.phases:
            return
        self.phases[phase] = round(time.monotonic() - self.started, 4)
        self.peak_mib[phase] = round(peak_resident_bytes() / (1 << 20), 1)
        if all(p in self.phases for p in self.last):
            self.write()

    def record(self) -> dict[str, Any]:
        return {"role": self.role, **self.who, "phases": dict(self.phases), "peak_mib": dict(self.peak_mib)}

    def write(self) -> None:
        """Append the record to ``RUN/metrics/startup.jsonl`` once (no run folder: log it only)."""
        if self.written:
            return
        self.written = True
        rec = self.record()
        log.info("%s start-up: %s", self.role, ", ".join(f"{k} {v:.2f} s" for k, v in rec["phases"].items()))
        if self.run_dir is None:
            return
        try:
            path = self.run_dir / "metrics" / "startup.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:
            log.warning("cannot write the start-up record in %s: %s", self.run_dir, e)
