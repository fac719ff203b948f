"""One shard's state folder: its paths, every write to it (counted, fsynced, undone on failure, a
full disk said in one line), its FORMAT file and its lock. ``MarkFiles``, ``FragmentLogs`` and
``SyncerStore`` build on it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from ddiloco.service.base.durable import fsync_dir
from ddiloco.service.syncer.store.errors import StateError, StoreFull, StoreLocked
from ddiloco.service.syncer.store.frames import FORMAT, LOCK, MARKS, MIRROR


def _is_full(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


def _write_all(fd: int, pieces: list[Any]) -> None:
    """Write every piece to ``fd`` unbuffered: after a failure no hidden buffer can be flushed later
    behind a truncation (a buffered file flushes again on truncate and close)."""
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while view:
            view = view[os.write(fd, view) :]


def format_of(state_dir: Path) -> object:
    """The format a state folder's FORMAT file says (None: there is none; "unreadable")."""
    try:
        return json.loads((state_dir / "FORMAT").read_bytes()[:256]).get("format")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError):
        return "unreadable"


def has_state(d: Path) -> bool:
    """Whether ``d`` holds anything besides the lock file and a FORMAT.tmp that a crash left before
    its rename (a locked but fresh folder is empty)."""
    return d.is_dir() and any(x.name not in (LOCK, "FORMAT.tmp") for x in d.iterdir())


class StateFolder:
    """RUN_DIR/state/ (RUN_DIR/state/shard-{i}/ when num_shards > 1) and the bytes written to it.

    ``fsync``: whether writes are fsynced (tests and benchmarks turn it off). ``signature`` and
    ``owned`` are set by the restore; the durable versions are said in a full disk's message.
    """

    def __init__(self, run_dir: str | Path, shard: int = 0, num_shards: int = 1, fsync: bool = True) -> None:
        if not 0 <= shard < num_shards:
            raise StateError(
                f"syncer shard {shard} is out of range for {num_shards} shards; allowed: 0..{num_shards - 1}"
            )
        if sys.byteorder != "little":
            raise StateError("syncer state files are little-endian; this host is big-endian")
        self.root = Path(run_dir) / "state"
        self.dir = self.root if num_shards == 1 else self.root / f"shard-{shard}"
        self.num_shards = num_shards
        self.fsync = fsync
        self._sizes: dict[str, int] = {}  # bytes of each file in the folder, as this store left them
        self._disk_now = 0
        self.peak_disk_bytes = 0
        """The most bytes the folder held while this store wrote it (a rotation's record in flight included)."""
        self.bytes_written = 0
        """Bytes this store wrote: records, marks (both files), snapshots, tape lines."""
        self.fsyncs = 0
        """fsync calls made (files and the folder), 0 when fsync is off."""
        self._broken: str | None = None  # why writing must stop (a failed write could not be undone)
        self._lock: IO[str] | None = None
        self._durable: dict[int, int] = {}
        self._dir_ready = False
        self.signature: list[list[list[Any]]] = []  # per fragment, set by restore
        self.owned: list[int] = []

    # -- low-level writes ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _disk(self, what: str) -> Iterator[None]:
        """Turn a full disk into one StoreFull line that says what was lost and what to do."""
        try:
            yield
        except OSError as e:
            if not _is_full(e):
                raise
            raise StoreFull(
                f"no space left on the disk of {self.dir} while {what}; that was not made durable, the durable "
                f"versions (fragment: version) {self._durable} are safe; free space there (or move --run-dir to a "
                "larger disk) and restart the syncer"
            ) from e

    def _sync_fd(self, fd: int) -> None:
        if self.fsync:
            os.fsync(fd)
            self.fsyncs += 1

    def _size(self, name: str, size: int | None) -> None:
        """Note that file ``name`` now holds ``size`` bytes (None: it is gone); tracks the peak."""
        old = self._sizes.pop(name, 0)
        if size is not None:
            self._sizes[name] = size
        self._disk_now += (size or 0) - old
        self.peak_disk_bytes = max(self.peak_disk_bytes, self._disk_now)

    def _moved(self, src: str, dst: str) -> None:
        size = self._sizes.pop(src, 0)
        self._disk_now -= size
        self._size(dst, size)

    def _rescan(self) -> None:
        """Read every file's size from the folder (after a restore, which may have cut or renamed)."""
        self._sizes = {}
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.dir):
                if e.is_file(follow_symlinks=False):
                    self._sizes[e.name] = e.stat(follow_symlinks=False).st_size
        self._disk_now = sum(self._sizes.values())
        self.peak_disk_bytes = max(self.peak_disk_bytes, self._disk_now)

    def disk_bytes(self) -> int:
        """The bytes the state folder's files hold now, read from the disk (sizes, not blocks)."""
        total = 0
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.dir):
                if e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
        return total

    def _append_bytes(self, path: Path, pieces: list[Any]) -> tuple[int, int]:
        """Append ``pieces`` to ``path`` and fsync; (start, end) offsets. On any failure the file
        is cut back to ``start``, so no half record is left before the next append."""
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                _write_all(fd, pieces)
                self._sync_fd(fd)
            except BaseException:
                self._undo(lambda: os.ftruncate(fd, start), path)  # shrinking a file needs no free space
                raise
            end = os.lseek(fd, 0, os.SEEK_CUR)
            self.bytes_written += end - start
            self._size(path.name, end)
            return start, end
        finally:
            os.close(fd)

    def _write_new(self, path: Path, pieces: list[Any]) -> None:
        """Write a whole new file (a temp file before its rename) and fsync it; removed on failure."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, pieces)
            self._sync_fd(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        os.close(fd)
        size = sum(memoryview(b).nbytes for b in pieces)
        self.bytes_written += size
        self._size(path.name, size)

    def _cut(self, path: Path, at: int) -> None:
        """Drop what follows ``at`` in ``path``, durably."""
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, at)
            self._sync_fd(fd)
        finally:
            os.close(fd)
        self._size(path.name, at)

    def _undo(self, undo: Any, path: Path) -> None:
        """Undo a failed write; if even that fails, refuse further writes: appending behind a half
        record would turn it into damage inside fsynced bytes. A restart's restore cuts it."""
        try:
            undo()
        except OSError as e:
            self._broken = f"a failed write to {path} could not be undone ({e})"

    def _fsync_dir(self) -> None:
        if self.fsync:
            fsync_dir(self.dir)
            self.fsyncs += 1

    def _remove(self, path: Path) -> None:
        path.unlink()
        self._size(path.name, None)

    def _size_of(self, path: Path) -> int:
        return self._sizes.get(path.name, 0)

    # -- the folder itself ---------------------------------------------------------------------

    def _check_dirs(self) -> None:
        """A run dir written with another number of syncer shards must not look empty."""
        flat = self.root.exists() and any(self.root.glob("frag-*.log")) or (self.root / "snapshot.bin").exists()
        sharded = self.root.exists() and any(has_state(d) for d in self.root.glob("shard-*"))
        if (self.num_shards > 1 and flat) or (self.num_shards == 1 and sharded):
            other = "1 syncer shard" if flat else "several syncer shards"
            raise StateError(
                f"{self.root} was written by {other}, not {self.num_shards}; use the same number of shards or a "
                "fresh --run-dir"
            )

    def _check_format(self) -> None:
        """Files of another format are refused with what to do, never read as if they were ours."""
        path = self.dir / "FORMAT"
        found = format_of(self.dir)
        if found is None:
            if (self.dir / MARKS).exists() or (self.dir / MIRROR).exists():  # formats 3+ always have FORMAT
                raise StateError(
                    f"{path} is missing but {self.dir} holds durable marks: the folder is damaged; restore it from a "
                    f'backup, or write {{"format": {FORMAT}}} into {path} if you know it is this format'
                )
            found = 1  # format 1 had no FORMAT file
        if found == 3:
            run_dir = self.root.parent
            raise StateError(
                f"{self.dir} holds syncer state of format 3 (one durable.log, before durable.mirror.log), this "
                f"ddiloco reads format {FORMAT}: stop every syncer of the run and migrate it in place with "
                f"`ddiloco migrate {run_dir}` (then start it again: it resumes)"
            )
        if found != FORMAT:
            raise StateError(
                f"{self.dir} holds syncer state of format {found}, this ddiloco reads format {FORMAT}; "
                "finish that run with the ddiloco that wrote it, or start this one in a fresh --run-dir"
            )

    def _init_dir(self) -> None:
        """Create the state folder with its FORMAT file and an empty durable.log on the first write."""
        if self._dir_ready:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "FORMAT"
        if not path.exists():  # FORMAT first: a crash before it leaves a folder that still reads as fresh
            tmp = self.dir / "FORMAT.tmp"
            tmp.write_text(json.dumps({"format": FORMAT}))
            os.replace(tmp, path)
            (self.dir / MARKS).touch()
            (self.dir / MIRROR).touch()
            self._fsync_dir()
        self._dir_ready = True

    def _take_lock(self) -> None:
        """Keep a second syncer out of this folder until ``close`` (or this process ends)."""
        if self._lock is not None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        f = open(self.dir / LOCK, "a+")  # noqa: SIM115 (held open until close: the open file holds the flock)
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip() or "unknown"
            f.close()
            raise StoreLocked(
                f"{self.dir} is in use by another syncer (pid {pid}); stop that one first, or give this one "
                "another --run-dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._lock = f

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file releases the flock
            self._lock = None
