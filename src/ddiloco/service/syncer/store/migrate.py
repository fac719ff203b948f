"""Bring a syncer state folder of the previous format (3) to this one (4), in place.

Format 4 keeps every durable mark twice (``durable.log`` and ``durable.mirror.log``); format 3
kept it once. Every other file reads the same in both. So the migration writes the mirror as a
copy of ``durable.log`` (the restore accepts a torn last mark in either, and rewrites both when
they differ), then ``FORMAT``. Each step is a temp file fsynced and renamed into place, so a
crash at any point leaves either the format-3 folder (run it again) or the format-4 one; the
folders' locks are held throughout, so a syncer running on one is never migrated under it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from ddiloco.service.base.durable import fsync_dir
from ddiloco.service.syncer.store.errors import StateError
from ddiloco.service.syncer.store.folder import format_of
from ddiloco.service.syncer.store.frames import FORMAT, LOCK, MARKS, MIRROR

PREVIOUS = 3
"""The one format this build migrates from."""


def state_dirs(run_dir: Path) -> list[Path]:
    """The syncer state folders of a run folder: ``state/``, or one per shard."""
    root = run_dir / "state"
    shards = sorted(root.glob("shard-*"))
    return shards if shards else [root] if (root / "FORMAT").exists() else []


@contextlib.contextmanager
def locked(state_dirs: list[Path]) -> Iterator[None]:
    """Hold every state folder's lock (as a syncer does from restore to close): StateError, and
    nothing held, if a running syncer holds any of them."""
    with contextlib.ExitStack() as stack:
        for d in state_dirs:
            lock = stack.enter_context(open(d / LOCK, "a+"))
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StateError(f"{d} is in use by a running syncer: stop it, then migrate") from None
        yield


def check_state(state_dir: Path) -> bool:
    """Whether the folder needs migrating (False: it is format 4 already); StateError when it is
    of a format this build does not migrate, or damaged."""
    found = format_of(state_dir)
    if found == FORMAT:
        return False
    if found != PREVIOUS:
        raise StateError(
            f"{state_dir} holds syncer state of format {found}; `ddiloco migrate` moves format {PREVIOUS} to "
            f"{FORMAT} only: finish that run with the ddiloco that wrote it"
        )
    if not (state_dir / MARKS).exists():
        raise StateError(
            f"{state_dir / MARKS} is missing from a format-{PREVIOUS} folder: it is damaged; restore it from a "
            "backup first"
        )
    return True


def migrate_state(state_dir: Path) -> str:
    """Move one format-3 state folder (checked by ``check_state``, its lock held: ``locked``) to
    format 4: the mirror first, FORMAT last, so a crash between them leaves a format-3 folder that
    a second run migrates again."""
    try:
        marks = (state_dir / MARKS).read_bytes()
        replace_whole(state_dir / MIRROR, marks)
        replace_whole(state_dir / "FORMAT", json.dumps({"format": FORMAT}).encode())
    except OSError as e:
        raise StateError(f"cannot migrate {state_dir}: {e}") from None
    return f"{state_dir}: syncer state format {PREVIOUS} -> {FORMAT} ({MIRROR} written, {len(marks)} bytes of marks)"


def replace_whole(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: a temp file, fsynced, renamed, its folder fsynced."""
    tmp = path.with_name(f"{path.name}.migrate.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
