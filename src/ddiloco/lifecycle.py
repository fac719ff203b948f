"""A long-running process's life: how it stops on a signal and how it reports progress.

Every ddiloco command that runs for long (``train``, ``simulate``, ``syncer``, ``learner``,
``evaluator``) handles SIGINT and SIGTERM the same way: the first asks for a clean stop (keep
what was done, write the partial results), and a second one, while that cleanup runs, is said
to be ignored rather than leaving half-written files and orphaned children behind.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130
"""Exit status of a run stopped by a signal before its end (its partial results are written);
128 + SIGINT, as shells report an interrupted command."""

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Within ``with StopSignals(what):``, SIGINT/SIGTERM set ``requested`` (and call
    ``on_stop`` once) instead of raising; later ones are logged and ignored. The previous
    handlers are restored on exit. Main thread only (Python delivers signals there)."""

    def __init__(self, what: str, on_stop: Callable[[], None] | None = None) -> None:
        self.what = what
        self.on_stop = on_stop
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            log.warning("%s: %s ignored: already stopping cleanly, please wait", self.what, name)
            return
        self.requested, self.signal_name = True, name
        log.warning(
            "%s: %s received: stopping cleanly and writing what was done (another signal is ignored)",
            self.what,
            name,
        )
        if self.on_stop is not None:
            self.on_stop()

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class ProgressLines:
    """A one-line progress report every ``interval_s`` seconds, through logging, for output
    that is not a terminal (nohup, Slurm, a pipe), where live tables never show."""

    def __init__(self, interval_s: float, enabled: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.enabled, self.clock = interval_s, enabled and interval_s > 0, clock
        self._next = clock() + interval_s

    def maybe(self, line: Callable[[], str]) -> bool:
        """Log ``line()`` if one is due (the text is only built then); True when it was."""
        if not self.enabled or self.clock() < self._next:
            return False
        self._next = self.clock() + self.interval_s
        log.info("progress: %s", line())
        return True
