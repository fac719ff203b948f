"""Helpers shared by the tests that run a syncer and learners (imported as ``helpers``: pytest
puts this folder on the path of the test modules)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddiloco.core.tape import RoundRecord
from ddiloco.report.tape import read_rounds


def wait_for(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition", poll: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something true (returned), or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def merges(run_dir: Path) -> list[RoundRecord]:
    """The rounds on a syncer's tape that merged something (an entry took part: ``was_merged``)."""
    return [r for r in read_rounds(Path(run_dir) / "state" / "tape.jsonl") if r.took_part]
