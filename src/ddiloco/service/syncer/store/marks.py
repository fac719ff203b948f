"""The high-water marks: durable.log and its mirror durable.mirror.log. A version is acknowledged
only once its mark is in both (see the package docstring): writing, rewriting and reading them."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ddiloco.service.syncer.store.errors import StateError
from ddiloco.service.syncer.store.folder import StateFolder, _write_all
from ddiloco.service.syncer.store.frames import MARK_SIZE, MARKS, MIRROR, _pack_mark, _unpack_mark

log = logging.getLogger(__name__)


class MarkFiles(StateFolder):
    """The state folder with its two mark files (the mirror is open for appends, fsynced with the tape)."""

    def __init__(self, run_dir: str | Path, shard: int = 0, num_shards: int = 1, fsync: bool = True) -> None:
        super().__init__(run_dir, shard, num_shards, fsync)
        self._mirror_fd: int | None = None  # durable.mirror.log, open for appends; fsynced with the tape
        self._mirror_dirty = False

    def _mark(self, p: int, version: int, end: int) -> None:
        """Append the mark to durable.log (fsynced) and the mirror; neither is left on a failure."""
        mark = _pack_mark(p, version, end)
        marks = self.dir / MARKS
        mark_at, _ = self._append_bytes(marks, [mark])
        try:
            self._append_mirror(mark)
        except BaseException:
            self._undo(lambda: self._cut(marks, mark_at), marks)
            raise

    def _append_mirror(self, mark: bytes) -> None:
        """Write ``mark`` through to durable.mirror.log (no fsync here: see ``flush_tape``); on a
        failure the file is cut back, so no half mark is left before the next one."""
        if self._mirror_fd is None:
            self._mirror_fd = os.open(self.dir / MIRROR, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        fd = self._mirror_fd
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            _write_all(fd, [mark])
        except BaseException:
            self._undo(lambda: os.ftruncate(fd, start), self.dir / MIRROR)
            raise
        self.bytes_written += len(mark)
        self._size(MIRROR, start + len(mark))
        self._mirror_dirty = True

    def _close_mirror(self) -> None:
        if self._mirror_fd is not None:
            os.close(self._mirror_fd)
            self._mirror_fd = None

    def _rewrite_marks(self, ends: dict[int, int]) -> None:
        """Replace durable.log, then durable.mirror.log, with one mark per fragment: its durable
        version and how many bytes of its log are fsynced records. A crash between the two
        renames leaves the mirror with the same versions and ends plus older marks; a restore
        finds them different and writes both anew."""
        marks = [_pack_mark(p, v, ends.get(p, 0)) for p, v in sorted(self._durable.items()) if v > 0]
        self._close_mirror()  # its file is replaced: appends must go to the new one
        for name in (MARKS, MIRROR):
            tmp = self.dir / f"{name}.tmp"
            self._write_new(tmp, marks)
            os.replace(tmp, self.dir / name)
            self._moved(tmp.name, name)
        self._mirror_dirty = False
        self._fsync_dir()

    def _damaged(self, what: str) -> StateError:
        return StateError(
            f"{what}; it was made durable, so this is damage, not a crash: restore {self.dir} from a backup or "
            f"use a fresh --run-dir; to go on from the versions still readable (learners rebase onto them), "
            f"delete both {self.dir / MARKS} and {self.dir / MIRROR}"
        )

    def _read_marks(self, name: str) -> tuple[dict[int, tuple[int, int]], bytes] | None:
        """The newest mark per fragment in ``name``: {p: (durable version, fsynced bytes of its
        log)} and the file's bytes; None when the file is missing. Only a torn tail is cut: a
        partial last mark (a crash mid-append) or, in the mirror (fsynced lazily), zeros to the end."""
        path = self.dir / name
        if not path.exists():
            return None
        buf = path.read_bytes()
        marks: dict[int, tuple[int, int]] = {}
        for pos in range(0, len(buf), MARK_SIZE):
            got = _unpack_mark(buf, pos)
            if got is None:
                torn = len(buf) - pos <= MARK_SIZE or (name == MIRROR and not any(buf[pos:]))
                if not torn:
                    raise self._damaged(f"{path} is corrupt at byte {pos}")
                log.warning("cutting a torn mark off %s at byte %d", path, pos)
                self._cut(path, pos)
                buf = buf[:pos]
                break
            p, version, end = got
            if p not in self.owned:
                raise StateError(
                    f"{path} marks fragment {p}, which this syncer shard does not own {self.owned}; use the same "
                    "shards or a fresh --run-dir"
                )
            old_version, old_end = marks.get(p, (0, 0))
            marks[p] = (version, end) if version >= old_version else (old_version, old_end)
        return marks, buf

    def _all_marks(self) -> tuple[dict[int, tuple[int, int]] | None, bool]:
        """Both mark files merged: per fragment the highest version, and for it the larger end
        (see ``_rewrite_marks``); None when both are missing. True when they differ (one lost,
        damaged or behind): the restore then writes both anew."""
        got = [self._read_marks(name) for name in (MARKS, MIRROR)]
        if got[0] is None and got[1] is None:
            return None, True
        merged: dict[int, tuple[int, int]] = {}
        for one in got:
            for p, (version, end) in (one[0] if one is not None else {}).items():
                old_version, old_end = merged.get(p, (0, 0))
                if version > old_version or (version == old_version and end > old_end):
                    merged[p] = (version, end)
        differ = got[0] is None or got[1] is None or got[0][1] != got[1][1]
        if differ:
            lost = [name for name, one in zip((MARKS, MIRROR), got) if one is None]
            log.warning(
                "%s: %s; restoring against the marks still there and writing both mark files anew",
                self.dir,
                f"{lost[0]} is missing" if lost else f"{MARKS} and {MIRROR} differ (a crash between them, or damage)",
            )
        return merged, differ
