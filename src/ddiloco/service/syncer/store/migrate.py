"""Bring a syncer state folder of the previous format (3) to this one (4), in place.

Format 4 keeps every durable mark twice (``durable.log`` and ``durable.mirror.log``); format 3
kept it once. Every other file reads the same in both. So the migration writes the mirror as a
copy of ``durable.log`` (the restore accepts a torn last mark in either, and rewrites both when
they differ), then ``FORMAT``. Each step is a temp file fsynced and renamed into place, so a
crash at any point leaves either the format-3 folder (run it again) or the format-4 one; the
folder's lock is held throughout, so a syncer running on it is never migrated under it.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from ddiloco.service.syncer.store.errors import StateError
from ddiloco.service.syncer.store.frames import FORMAT, LOCK, MARKS, MIRROR

PREVIOUS = 3
"""The one format this build migrates from."""


def state_dirs(run_dir: Path) -> list[Path]:
    """The syncer state folders of a run folder: ``state/``, or one per shard."""
    root = run_dir / "state"
    shards = sorted(root.glob("shard-*"))
    return shards if shards else [root] if (root / "FORMAT").exists() else []


def format_of(state_dir: Path) -> object:
    """The format a state folder says it is (None: no FORMAT file; "unreadable")."""
    try:
        return json.loads((state_dir / "FORMAT").read_bytes()[:256]).get("format")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError):
        return "unreadable"


def migrate_state(state_dir: Path) -> str | None:
    """Migrate one state folder from format 3 to 4; what it did (None: it was format 4 already).
    StateError for anything else: another format, a syncer holding it, a disk that refuses."""
    found = format_of(state_dir)
    if found == FORMAT:
        return None
    if found != PREVIOUS:
        raise StateError(
            f"{state_dir} holds syncer state of format {found}; `ddiloco migrate` moves format {PREVIOUS} to "
            f"{FORMAT} only: finish that run with the ddiloco that wrote it"
        )
    with open(state_dir / LOCK, "a+") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StateError(f"{state_dir} is in use by a running syncer: stop it, then migrate") from None
        try:
            if not (state_dir / MARKS).exists():
                raise StateError(
                    f"{state_dir / MARKS} is missing from a format-{PREVIOUS} folder: it is damaged; restore it from "
                    "a backup first"
                )
            marks = (state_dir / MARKS).read_bytes()
            _replace(state_dir, MIRROR, marks)
            _replace(state_dir, "FORMAT", json.dumps({"format": FORMAT}).encode())
        except OSError as e:
            raise StateError(f"cannot migrate {state_dir}: {e}") from None
    return f"{state_dir}: syncer state format {PREVIOUS} -> {FORMAT} ({MIRROR} written, {len(marks)} bytes of marks)"


def _replace(d: Path, name: str, data: bytes) -> None:
    """Write ``d/name`` whole or not at all: a temp file, fsynced, renamed, the folder fsynced."""
    tmp = d / f"{name}.migrate.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, d / name)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
