"""Reading a run folder's files back (JSONL tapes and metrics, JSON and TOML files), bounded and
tolerant of damage, and appending to its run log: the one place for both, whoever wrote them."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ddiloco.core.tape import RoundRecord, TapeRecord, parse_tape_record

MAX_RECORDS = 1_000_000
"""Most records read from one file: a runaway file cannot eat the reader's memory."""
MAX_LINE_BYTES = 4 << 20
"""A longer line is skipped without being held in memory."""
MAX_JSON_BYTES = 16 << 20
"""A larger JSON file (summary.json, run.json, accounting.json) is not read."""


def read_json(path: str | Path) -> dict[str, Any]:
    """A JSON object file; missing, too large, garbled or not an object: ``{}``."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_JSON_BYTES:
            return {}
        value = json.loads(p.read_bytes())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def read_jsonl_cut(path: str | Path, limit: int = MAX_RECORDS) -> tuple[list[dict[str, Any]], bool]:
    """The JSON objects in a JSONL file and whether it was cut at ``limit`` records.

    A missing or unreadable file is empty; a torn, garbled, non-object or over-long line is
    skipped (a crash mid-write must not lose the report).
    """
    out: list[dict[str, Any]] = []
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; a missing file is an empty list)
    except OSError:
        return out, False
    with f:
        while True:
            try:
                line = f.readline(MAX_LINE_BYTES)
            except OSError:
                break
            if not line:
                break
            if not line.endswith(b"\n") and len(line) >= MAX_LINE_BYTES:
                while True:  # skip the rest of an over-long line in bounded pieces
                    rest = f.readline(MAX_LINE_BYTES)
                    if not rest or rest.endswith(b"\n"):
                        break
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                if len(out) >= limit:
                    return out, True
                out.append(record)
    return out, False


def read_jsonl(path: str | Path, limit: int = MAX_RECORDS) -> list[dict[str, Any]]:
    """The JSON objects in ``path`` (at most ``limit``, the first ones); see ``read_jsonl_cut``."""
    return read_jsonl_cut(path, limit)[0]


def read_tape(path: str | Path) -> list[dict[str, Any]]:
    """The records of an event tape (``tape.jsonl``), as the JSON objects written."""
    return read_jsonl(path)


def parse_tape(records: Iterable[dict[str, Any]]) -> list[TapeRecord]:
    """Tape lines as typed records (``RoundRecord``, ``Rejection``, ``Late``), in order; a
    malformed or unknown line is skipped (``core.tape.parse_tape_record``)."""
    return [r for d in records if (r := parse_tape_record(d)) is not None]


def rounds_of(records: Iterable[dict[str, Any] | TapeRecord]) -> list[RoundRecord]:
    """The well-formed round records among tape lines or typed records, in order."""
    out = []
    for d in records:
        r = d if isinstance(d, RoundRecord) else parse_tape_record(d) if isinstance(d, dict) else None
        if isinstance(r, RoundRecord):
            out.append(r)
    return out


def read_tape_records(path: str | Path) -> list[TapeRecord]:
    """The typed records of an event tape (``tape.jsonl``); damaged lines are skipped."""
    return parse_tape(read_jsonl(path))


def read_rounds(path: str | Path) -> list[RoundRecord]:
    """The closed rounds of an event tape (``tape.jsonl``), typed; damaged lines are skipped."""
    return rounds_of(read_jsonl(path))


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file (a run's config.toml); missing, too large or garbled: ``{}``."""
    from ddiloco.config import tomllib

    p = Path(path)
    try:
        if p.stat().st_size > MAX_JSON_BYTES:
            return {}
        return tomllib.loads(p.read_text(errors="replace"))
    except (OSError, ValueError):
        return {}


def append_run_event(run_dir: str | Path, time_s: float, what: str, reason: str, **extra: float) -> None:
    """Append one record to RUN_DIR/metrics/run.jsonl (start, resume, interrupted, end; an end
    may say its ``processed_tokens``, the count that ended the run)."""
    d = Path(run_dir) / "metrics"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "run.jsonl", "a") as f:
        f.write(json.dumps({"event": "run", "time": time_s, "what": what, "reason": reason, **extra}) + "\n")
