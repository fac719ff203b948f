"""Status files: each process writes its latest figures to RUN_DIR/status/NAME.json (atomically,
so a reader never sees half a file); the launcher, the benchmarks and the tests read them."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_warned: set[Path] = set()  # paths whose write failed once: said once, then silent


def write_status(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` with ``data`` as JSON via write-then-rename. A status file is a courtesy
    to readers, so a failed write (a full disk, a read-only folder) logs one warning per path
    and returns: it must never stop the process that writes it."""
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()  # no half-written temp file left behind to fill the disk further
        if path not in _warned:
            _warned.add(path)
            log.warning("cannot write the status file %s (%s); going on without it", path, e)


def read_status(path: Path) -> dict[str, Any] | None:
    """The figures in ``path``, or None if it is missing or being replaced."""
    try:
        figures: dict[str, Any] = json.loads(path.read_text())  # written by write_status: an object
        return figures
    except (OSError, json.JSONDecodeError):
        return None
