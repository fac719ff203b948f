"""Status files: each process writes its latest figures to RUN_DIR/status/NAME.json (atomically,
so a reader never sees half a file); the launcher, the benchmarks and the tests read them."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_status(path: Path, data: dict) -> None:
    """Replace ``path`` with ``data`` as JSON via write-then-rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_status(path: Path) -> dict | None:
    """The figures in ``path``, or None if it is missing or being replaced."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
