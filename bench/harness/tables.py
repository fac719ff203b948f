"""Markdown tables and the published ``docs/results/NAME.md`` + ``NAME.json`` pair."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def met(ok: bool | None) -> str:
    """A check's cell: ``yes``, ``**no**`` (bold, so a miss stands out), or ``-`` (reported only)."""
    return "-" if ok is None else ("yes" if ok else "**no**")


def row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table's lines: the header, its rule, one line per row."""
    return [row(header), "|" + "---|" * len(header), *(row(r) for r in rows)]


def utc_now() -> str:
    """The report's date: UTC, to the second."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def machine(python: bool = False, **extra: Any) -> dict[str, Any]:
    """What a report says of the machine that produced it (``python``: the Python version too)."""
    version = {"python": platform.python_version()} if python else {}
    return {"platform": platform.platform(), **version, "cpus": os.cpu_count(), **extra}


def facts(command: str, **extra: Any) -> dict[str, Any]:
    """Command, date and machine: what every report says about how it was made."""
    return {"command": command, "date": utc_now(), "machine": machine(), **extra}


def publish(
    out: Path,
    name: str,
    report: dict[str, Any],
    markdown: str,
    indent: int | None = 2,
    default: Callable[[Any], Any] | None = None,
    echo: bool = True,
) -> None:
    """Write ``out/NAME.json`` (the report, with its command, date, machine and config) and
    ``out/NAME.md`` (the markdown made from it); print the markdown (``echo``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=indent, default=default))
    (out / f"{name}.md").write_text(markdown)
    if echo:
        print(markdown, flush=True)
