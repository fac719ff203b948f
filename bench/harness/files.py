"""A run folder read back: JSON files, JSON-lines files, the tape as it grows, step logs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> Any:
    """The JSON document at ``path``; None when it is missing or not (yet) whole JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_json_dict(path: Path) -> dict[str, Any]:
    """The JSON object at ``path``; {} when it is missing, torn or not an object (status files are
    rewritten while a bench reads them)."""
    got = read_json(path)
    return got if isinstance(got, dict) else {}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file, skipping torn or foreign lines; [] when it is missing."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def write_json_atomic(path: Path, obj: Any, indent: int | None = 1) -> None:
    """Write ``obj`` to ``path`` through a temporary file: a reader (or an interrupted bench) never
    sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=indent))
    tmp.replace(path)


class TapeReader:
    """Reads a growing JSON-lines file (RUN/state/tape.jsonl) incrementally, complete lines only."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = Path(path), 0
        self.records: list[dict[str, Any]] = []
        """Every record read so far."""

    def poll(self) -> list[dict[str, Any]]:
        """The records written since the last poll."""
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        new = []
        for line in data[:end].splitlines():
            try:
                new.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        self.records += new
        return new


StepRow = tuple[float, float, int]
"""(time, step duration in seconds, pid) of one inner step in a learner's step log."""


def step_logs(run_dir: Path, t0: float = 0.0) -> dict[int, list[StepRow]]:
    """Learner -> its steps from RUN/metrics/steps-M-PID.csv (``runtime.step_log``), times relative
    to ``t0``, sorted; every incarnation of a learner in one list."""
    out: dict[int, list[StepRow]] = {}
    for f in sorted((Path(run_dir) / "metrics").glob("steps-*-*.csv")):
        _, m, pid = f.stem.split("-")
        rows = out.setdefault(int(m), [])
        for line in f.read_text().splitlines():
            try:
                t, d = line.split(",")
                rows.append((float(t) - t0, float(d), int(pid)))
            except ValueError:
                pass
    for rows in out.values():
        rows.sort()
    return out


def started_at(run_dir: Path) -> float | None:
    """The run's start on the wall clock (RUN/run.json, written by ``ddiloco train``)."""
    v = read_json_dict(Path(run_dir) / "run.json").get("started_at")
    return float(v) if isinstance(v, (int, float)) else None
