"""Cached cells: one configuration run = one cell, one JSON file under ``bench/cache/NAME/``.

A cell's file is named by its key, ``LABEL-DIGEST``: the digest of every setting that decides its
numbers (the bench's cache version, the config overrides, and where the code matters a digest of
the source), so a changed setting misses the cache and an unchanged one is never rerun. A cell is
written the moment it ends (through a temporary file), so an interrupted bench resumes where it
stopped. The key formats of the cells already cached are these functions' outputs: a bench that
changes what goes into its key bumps its own cache version, and keeps a reader for the old files.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from harness.files import read_json, write_json_atomic
from harness.paths import CACHE, SRC


def digest(blob: Any, n: int = 12) -> str:
    """The first ``n`` hex digits of the SHA-256 of ``blob`` as canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:n]


def cell_key(label: str, blob: dict[str, Any], n: int = 12) -> str:
    """``label-DIGEST``: a readable file name that changes with every setting in ``blob``."""
    return f"{label}-{digest(blob, n)}"


def files_digest(files: Iterable[Path], src: Path = SRC, n: int = 16) -> str:
    """A hash of ``files`` (each path relative to ``src``, then its bytes), in sorted order:
    equal digests, equal code behind a cell's numbers."""
    h = hashlib.sha256()
    for p in sorted(files):
        h.update(p.relative_to(src).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:n]


def source_digest(packages: Iterable[str], n: int = 16, src: Path = SRC) -> str:
    """``files_digest`` of ddiloco's top-level modules and every module of ``packages``."""
    base = src / "ddiloco"
    return files_digest([*base.glob("*.py"), *(p for d in packages for p in (base / d).rglob("*.py"))], src, n)


class CellCache:
    """The cells of one bench (or one part of it): ``bench/cache/NAME/KEY.json``."""

    def __init__(self, folder: Path | str, indent: int | None = 1) -> None:
        self.folder = Path(folder) if isinstance(folder, Path) else CACHE / folder
        self.indent = indent
        """The JSON indent the cells are written with (a bench keeps its own, the files diff cleanly)."""

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        """The cached cell ``key``; None when it is not cached (or not a whole JSON object)."""
        got = read_json(self.path(key))
        return got if isinstance(got, dict) and got else None

    def put(self, key: str, cell: Any) -> None:
        write_json_atomic(self.path(key), cell, self.indent)

    def get_or_run(self, key: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The cached cell, or ``run()``'s, cached the moment it returns."""
        got = self.get(key)
        if got is None:
            got = run()
            self.put(key, got)
        return got

    def cells(self, pattern: str = "*.json") -> Iterator[tuple[Path, dict[str, Any]]]:
        """Every cached cell (its path and contents), in file-name order; foreign files skipped."""
        for p in sorted(self.folder.glob(pattern)):
            got = read_json(p)
            if isinstance(got, dict):
                yield p, got


def cached_runs(
    work: Path,
    arms: Iterable[str],
    reps: int,
    duration_s: float,
    run_one: Callable[[Path, str, int, float], dict[str, Any]],
    say: Callable[[dict[str, Any]], str],
    phase: str,
) -> list[dict[str, Any]]:
    """Every (repetition, arm) run of a soak phase, repetition-major (an interrupted phase has
    whole repetitions first), each cached as ``work/ARM-REP.json`` and taken back when it was
    made at the same ``duration_s``; ``say``: the line printed after each new run."""
    work.mkdir(parents=True, exist_ok=True)
    arms = list(arms)
    runs = []
    for rep in range(reps):
        for arm in arms:
            cached = work / f"{arm}-{rep}.json"
            if cached.exists():
                r = json.loads(cached.read_text())
                if r.get("duration_s") == duration_s:
                    runs.append(r)
                    continue
            print(f"{phase}: {arm} repetition {rep} ({duration_s:.0f} s)", flush=True)
            r = run_one(work, arm, rep, duration_s)
            r["duration_s"] = duration_s
            cached.write_text(json.dumps(r, indent=2, default=str))
            print(f"  {say(r)}", flush=True)
            runs.append(r)
    return runs
