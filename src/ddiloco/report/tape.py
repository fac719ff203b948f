"""Reading an event tape back: the one reader for tape.jsonl files, whoever wrote them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_tape(path: str | Path) -> list[dict[str, Any]]:
    """The records in a tape.jsonl; a missing file is an empty tape, and a torn or garbled line
    (a crash mid-write) is skipped rather than failing the whole report."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
