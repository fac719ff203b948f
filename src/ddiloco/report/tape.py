"""Reading JSON-lines files back (tapes, metrics): the one reader for them, whoever wrote them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_RECORDS = 1_000_000
"""Most records read from one file: a runaway file cannot eat the reader's memory."""


def read_jsonl(path: str | Path, limit: int = MAX_RECORDS) -> list[dict[str, Any]]:
    """The JSON objects in ``path``, one a line; a missing file is empty, and a torn or garbled
    line (a crash mid-write) or a line that is not an object is skipped rather than failing the
    whole report. At most ``limit`` records (the first ones)."""
    p = Path(path)
    out: list[dict[str, Any]] = []
    try:
        f = p.open("rb")
    except OSError:
        return out
    with f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
                if len(out) >= limit:
                    break
    return out


def read_tape(path: str | Path) -> list[dict[str, Any]]:
    """The records of an event tape (``tape.jsonl``)."""
    return read_jsonl(path)
