"""The per-fragment logs ``frag-{p}.log``: appending a record, rotating the log, and at restore
verifying each record, cutting a torn tail and finishing (or dropping) a rotation a crash cut short."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ddiloco.core.syncer import FragmentRecord
from ddiloco.service.syncer.store.errors import StateError
from ddiloco.service.syncer.store.frames import _RECORD, _check_record, _describe, _encode, _frame, _parse, _torn_shape
from ddiloco.service.syncer.store.marks import MarkFiles

log = logging.getLogger(__name__)


class FragmentLogs(MarkFiles):
    """The state folder with its fragment logs. ``log_bound``: a fragment's log rotates when an
    append would take it past this many times the record's size."""

    def __init__(
        self, run_dir: str | Path, shard: int = 0, num_shards: int = 1, fsync: bool = True, log_bound: float = 2.0
    ) -> None:
        super().__init__(run_dir, shard, num_shards, fsync)
        self.log_bound = log_bound
        self._rotate: set[int] = set()  # fragments whose next append starts a new log (after a snapshot)
        self.record_bytes_written = 0
        """Bytes of fragment records written (a rotation writes none more: no record is ever copied)."""
        self.records_written = 0
        """Fragment records written (one per durable version)."""
        self._last: dict[int, tuple[int, int]] = {}  # p -> (offset, end) of the newest record in frag-p.log
        self._logged: dict[int, int] = {}  # p -> the version of that record
        self._seq = 0  # orders records and snapshots across logs: the newest one's meta state wins

    def _write_record(self, rec: FragmentRecord, syncer_meta: dict[str, Any]) -> None:
        p = rec.fragment
        tensors, meta = _encode(rec)
        header = {"seq": self._seq + 1, "meta": meta, "syncer": syncer_meta, "pieces": self.signature[p]}
        pieces = _frame(_RECORD, header, tensors)
        size = sum(memoryview(b).nbytes for b in pieces)
        path = self.dir / f"frag-{p}.log"
        held = self._sizes.get(path.name, 0)
        with self._disk(f"appending version {rec.version} of fragment {p}"):
            self._init_dir()
            if held > 0 and (p in self._rotate or held + size > self.log_bound * size):
                start, end = self._rotate_log(p, rec.version, pieces)
            else:
                start, end = self._append_record(p, rec.version, pieces)
        self.records_written += 1
        self.record_bytes_written += size
        self._seq += 1
        self._last[p] = (start, end)
        self._durable[p] = max(self._durable.get(p, 0), rec.version)
        self._logged[p] = rec.version

    def _append_record(self, p: int, version: int, pieces: list[Any]) -> tuple[int, int]:
        path = self.dir / f"frag-{p}.log"
        new = not path.exists()
        start, end = self._append_bytes(path, pieces)
        try:
            if new:
                self._fsync_dir()  # the new file's directory entry must survive a crash too
            self._mark(p, version, end)  # only now, with the record on disk, may the mark say so
        except BaseException:
            self._undo(lambda: self._cut(path, start), path)  # never acknowledged: a restore must not bring it back
            raise
        return start, end

    def _rotate_log(self, p: int, version: int, pieces: list[Any]) -> tuple[int, int]:
        """Write the record as a new log and drop the old one: the record (and the folder) is
        fsynced in frag-{p}.next.log, marked there, then renamed over frag-{p}.log. Until the mark
        the old log is untouched (a failure removes the new file); after it, a crash before the
        rename is finished by the restore."""
        path, nxt = self.dir / f"frag-{p}.log", self.dir / f"frag-{p}.next.log"
        self._write_new(nxt, pieces)
        try:
            self._fsync_dir()  # a mark must never name a file whose directory entry a crash can lose
            end = self._size_of(nxt)
            self._mark(p, version, end)
        except BaseException:
            self._undo(lambda: self._remove(nxt), nxt)
            raise
        try:
            os.replace(nxt, path)  # no fsync needed: a restore finishes a marked rotation itself
        except OSError as e:
            self._broken = f"version {version} of fragment {p} is durable in {nxt} but could not replace {path} ({e})"
            raise StateError(f"{self._broken}; restart the syncer: its restore finishes the rotation") from e
        self._moved(nxt.name, path.name)
        self._rotate.discard(p)
        return 0, end

    def _check_layout(self, saved: list[Any], fragments: list[int], what: str) -> None:
        mine = self.signature
        for p, pieces in zip(fragments, saved):
            ours = mine[p] if p < len(mine) else []
            for i in range(max(len(pieces), len(ours))):
                a = pieces[i] if i < len(pieces) else None
                b = ours[i] if i < len(ours) else None
                if a != b:
                    raise StateError(
                        f"{what} in {self.dir} holds a different model layout: fragment {p} piece {i} is "
                        f"{_describe(a)} there but {_describe(b)} here; use a fresh --run-dir"
                    )

    def _scan_log(self, p: int, fsynced: int) -> tuple[bytearray, dict[str, Any]] | None:
        """Verify every record of frag-p.log, cut a torn tail; the newest record (buffer, header).
        The first ``fsynced`` bytes were acknowledged: damage there is never a torn tail."""
        path = self.dir / f"frag-{p}.log"
        buf = bytearray(path.read_bytes()) if path.exists() else bytearray()
        if len(buf) < fsynced:
            raise self._damaged(f"{path} has {len(buf)} bytes but {fsynced} were fsynced: it was truncated or deleted")
        pos = 0
        newest_: tuple[bytearray, dict[str, Any]] | None = None
        while pos < len(buf):
            got = _parse(buf, pos, _RECORD)
            if not isinstance(got, str):  # its checksum holds: a bad header is what was written, never torn
                why = _check_record(got[1])
                if why is None and got[1]["meta"]["fragment"] != p:
                    why = f"bad header: a record of fragment {got[1]['meta']['fragment']}"
                got = why if why is not None else got
            if isinstance(got, str):
                # A crash mid-append leaves a prefix of the last record (or zeros after it on some
                # file systems), always past the marked end: anything else is corruption.
                if pos < fsynced:
                    raise self._damaged(f"{path} is corrupt at byte {pos} ({got}), inside its fsynced records")
                if not _torn_shape(buf, pos, got):
                    raise StateError(
                        f"{path} is corrupt at byte {pos} ({got}); restore the run dir from a backup or use a "
                        "fresh --run-dir"
                    )
                log.warning("cutting a torn record off %s at byte %d (%s)", path, pos, got)
                self._cut(path, pos)
                break
            end, header = got
            self._check_layout([header["pieces"]], [p], f"log {path.name}")
            if newest_ is None or header["meta"]["version"] > newest_[1]["meta"]["version"]:
                newest_ = (buf, header)
                self._last[p] = (pos, end)
                self._logged[p] = header["meta"]["version"]
            pos = end
        return newest_

    def _finish_rotation(self, p: int, marks: dict[int, tuple[int, int]] | None) -> None:
        """A crash inside a rotation left frag-{p}.next.log: finish the rotation when its record is
        the one marked (or no mark file is left to say), drop it when it was never marked (that
        version was never acknowledged; a torn record is such a one too). Any other content is
        damage: one line, and the file is left as evidence."""
        nxt, path = self.dir / f"frag-{p}.next.log", self.dir / f"frag-{p}.log"
        if not nxt.exists():
            return
        buf = bytearray(nxt.read_bytes())
        got = _parse(buf, 0, _RECORD) if buf else "truncated header"
        if not isinstance(got, str):
            why = _check_record(got[1])
            if why is None and got[1]["meta"]["fragment"] != p:
                why = f"bad header: a record of fragment {got[1]['meta']['fragment']}"
            got = why if why is not None else got if got[0] == len(buf) else "bytes after its record"
        mark = None if marks is None else marks.get(p)
        if not isinstance(got, str):
            version, end = got[1]["meta"]["version"], got[0]
            if marks is None or mark == (version, end):
                log.warning("%s: finishing the rotation a crash interrupted (version %d)", nxt, version)
                self._check_layout([got[1]["pieces"]], [p], f"log {nxt.name}")
                with self._disk(f"renaming {nxt.name}"):
                    os.replace(nxt, path)
                    self._fsync_dir()
                return
            if mark is None or version > mark[0]:
                log.warning("%s: dropping version %d, written but never marked (a crash before its mark)", nxt, version)
                with self._disk(f"removing {nxt.name}"):
                    nxt.unlink()
                return
            raise self._damaged(f"{nxt} holds version {version} ending at byte {end}, but the marks say {mark}")
        if not _torn_shape(buf, 0, got):
            raise StateError(
                f"{nxt} is corrupt at byte 0 ({got}); restore the run dir from a backup or use a fresh --run-dir"
            )
        log.warning("%s: dropping a torn record (a crash while it was written, before its mark)", nxt)
        with self._disk(f"removing {nxt.name}"):
            nxt.unlink()
