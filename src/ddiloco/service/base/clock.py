"""The clocks the service reads, injectable so tests can skew or jump them.

The core is handed ``monotonic()`` as its ``now``: liveness, quorum and grace decisions never
move when the wall clock is stepped (NTP, a VM resume, an operator). Wall time is only used to
stamp logs, metrics and status files.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """A source of time for one process."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards (the core's ``now``)."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch, for stamps only."""
        ...


class SystemClock:
    """The operating system's clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class SkewedClock:
    """The system clocks with offsets a test can change at any time (a wall-clock jump, or a
    process whose monotonic clock started elsewhere)."""

    def __init__(self, monotonic_offset: float = 0.0, wall_offset: float = 0.0) -> None:
        self.monotonic_offset = monotonic_offset
        self.wall_offset = wall_offset

    def monotonic(self) -> float:
        return time.monotonic() + self.monotonic_offset

    def wall(self) -> float:
        return time.time() + self.wall_offset


SYSTEM_CLOCK = SystemClock()
