"""``SyncerStore``: the syncer's durable state, what the service calls (restore, append, the tape,
snapshot, close). The files and their guarantees: see the package docstring."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.core.fragments import FragmentLayout
from ddiloco.core.syncer import FragmentRecord
from ddiloco.report.tape import read_tape
from ddiloco.service.syncer.store.errors import StateError
from ddiloco.service.syncer.store.folder import _write_all, has_state
from ddiloco.service.syncer.store.frames import (
    _SNAPSHOT,
    MARKS,
    MIRROR,
    _check_snapshot,
    _decode,
    _frame,
    _parse,
    _signature,
    _tensors,
)
from ddiloco.service.syncer.store.logs import FragmentLogs
from ddiloco.service.syncer.store.run_state import check_state

log = logging.getLogger(__name__)

_LOG_NAME = re.compile(r"^frag-(\d{1,5})(?:\.next)?\.log$")


@dataclass
class Restored:
    """What a restore found: the newest durable record of each fragment and the syncer's meta
    state of the newest record or snapshot."""

    fragments: dict[int, FragmentRecord] = field(default_factory=dict)
    syncer_meta: dict[str, Any] | None = None


class SyncerStore(FragmentLogs):
    """Durable syncer state in RUN_DIR/state/ (per shard: RUN_DIR/state/shard-{i}/ when num_shards > 1).

    Call ``restore`` once at start-up (it locks the folder and returns None on a fresh one), then
    ``append`` every new version before sending it anywhere, ``append_tape`` as the tape grows,
    ``snapshot`` now and then, and ``close`` at the end (it fsyncs the tape and releases the lock).
    It stores records; it never sees the syncer itself. ``tape_sync_s``: the longest time tape lines
    may sit unfsynced (they are written through at once; only an OS crash can lose them).
    ``log_bound``: a fragment's log rotates when an append would take it past this many times the
    record's size (``runtime.store_log_bound``; see the package docstring).
    """

    def __init__(
        self,
        run_dir: str | Path,
        shard: int = 0,
        num_shards: int = 1,
        fsync: bool = True,
        tape_sync_s: float = 5.0,
        log_bound: float = 2.0,
    ) -> None:
        if not 1.0 <= log_bound < 1e6:  # NaN fails too
            raise ValueError(f"log_bound = {log_bound} must be at least 1 (records of a fragment a log may hold)")
        super().__init__(run_dir, shard, num_shards, fsync, log_bound)
        self.tape_sync_s = tape_sync_s
        self._restored = False
        self._closed = False
        self._snap_no = 0
        self._tape_fd: int | None = None
        self._tape_dirty = False
        self._tape_synced = time.monotonic()

    # -- writing -------------------------------------------------------------------------------

    def _need_restore(self) -> None:
        if self._broken is not None:
            raise StateError(f"{self._broken}; restart the syncer: its restore checks {self.dir} and cuts it")
        if self._closed:
            raise RuntimeError("this SyncerStore is closed; open a new one (and restore it) to write again")
        if not self._restored:  # else we could append after a torn tail or reuse sequence numbers
            raise RuntimeError("SyncerStore.restore(layout, owned) must be called once before append or snapshot")

    def append(self, rec: FragmentRecord, syncer_meta: dict[str, Any]) -> None:
        """Make a fragment's new version durable before returning: its record in frag-{p}.log is
        fsynced, then its mark in durable.log is (2 fsyncs), then the mark is written through to
        durable.mirror.log (fsynced with the tape). When the record would take the log past
        ``log_bound`` records, or it is the fragment's first after a snapshot, the log rotates
        instead (3 fsyncs: the record in frag-{p}.next.log, the folder, the mark; then the rename
        over frag-{p}.log). A version that is already durable is not written again. A full disk
        raises StoreFull and leaves neither record nor mark."""
        self._need_restore()
        p = rec.fragment
        if p not in self.owned:
            raise ValueError(f"fragment {p} is not owned by this syncer shard (owned: {self.owned})")
        if rec.version <= self._durable.get(p, -1):
            return
        self._write_record(rec, syncer_meta)

    def append_tape(self, records: list[dict[str, Any]]) -> None:
        """Append JSON lines to tape.jsonl. They reach the OS at once (a killed syncer loses none);
        the fsync waits for ``tape_sync_s``, ``flush_tape``, ``snapshot`` or ``close``: the tape is
        for people and reports, versions are what must be durable, and a rejection is no reason
        to wait for the disk."""
        if not records:
            return
        if self._closed:
            raise RuntimeError("this SyncerStore is closed; open a new one to append to the tape")
        with self._disk("appending to the event tape"):
            fd = self._open_tape()
            data = "".join(json.dumps(r) + "\n" for r in records).encode()
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                _write_all(fd, [data])
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)  # no half line before the next one
                raise
            self.bytes_written += len(data)
            self._size("tape.jsonl", start + len(data))
            self._tape_dirty = True
            if time.monotonic() - self._tape_synced >= self.tape_sync_s:
                self.flush_tape()

    def _open_tape(self) -> int:
        if self._tape_fd is not None:
            return self._tape_fd
        self._init_dir()
        path = self.dir / "tape.jsonl"
        if path.exists():
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):  # torn last line from a crash: drop it
                os.truncate(path, data.rfind(b"\n") + 1)
        self._tape_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return self._tape_fd

    def flush_tape(self) -> None:
        """Make every tape line and mirror mark appended so far durable (an fsync each, none if
        nothing is new)."""
        if self._tape_fd is not None and self._tape_dirty:
            with self._disk("syncing the event tape"):
                self._sync_fd(self._tape_fd)
        if self._mirror_fd is not None and self._mirror_dirty:
            with self._disk(f"syncing {MIRROR}"):
                self._sync_fd(self._mirror_fd)
        self._tape_dirty = self._mirror_dirty = False
        self._tape_synced = time.monotonic()

    def read_tape(self) -> list[dict[str, Any]]:
        """The tape as written so far (a torn last line is skipped)."""
        return read_tape(self.dir / "tape.jsonl")

    def snapshot(self, records: Iterable[FragmentRecord], syncer_meta: dict[str, Any]) -> Path:
        """Write the meta state and every owned fragment's version atomically to snapshot.bin
        (no tensors: a record newer than its log's is appended first, so the logs hold every
        fragment), rewrite the mark files to one mark per fragment, and have each fragment's next
        append rotate its log. A full disk raises StoreFull; the previous snapshot and every
        durable version stay as they were.

        ``records`` (every owned fragment's) is read one at a time: given as a generator, each
        record (a copy of its fragment's momentum) is let go before the next is made, so a
        snapshot costs one fragment's copy at most, not the model's."""
        self._need_restore()
        seen = []
        for rec in records:  # the syncer appends every version first: this is for other callers, and
            # for a version that only an older store's snapshot.bin held, which this one replaces
            seen.append(rec.fragment)
            if rec.version > self._logged.get(rec.fragment, 0):
                self._write_record(rec, syncer_meta)
            del rec
        if sorted(seen) != self.owned:
            raise ValueError(f"a snapshot needs every owned fragment {self.owned}")
        header = {
            "snapshot": self._snap_no + 1,
            "seq": self._seq + 1,
            "signature": self.signature,
            "owned": self.owned,
            "fragments": [],  # a format-4 reader finds no tensors here and restores from the logs
            "versions": {str(p): v for p, v in sorted(self._durable.items())},
            "syncer": syncer_meta,
        }
        tmp, final, prev = self.dir / "snapshot.tmp", self.dir / "snapshot.bin", self.dir / "snapshot.prev.bin"
        with self._disk("writing a snapshot"):
            self._init_dir()
            self._write_new(tmp, _frame(_SNAPSHOT, header, {}))
            self._seq += 1
            self._snap_no += 1
            os.replace(tmp, final)
            self._moved(tmp.name, final.name)
            if prev.exists():  # left by a store whose snapshots held tensors: the logs hold them all
                prev.unlink()
                self._size(prev.name, None)
            self._fsync_dir()
            self._rewrite_marks({p: end for p, (_, end) in self._last.items()})
            self._rotate = set(self.owned)
            self.flush_tape()
        return final

    def close(self) -> None:
        """Fsync the tape and release the folder's lock; the store cannot write after this."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                self.flush_tape()
            finally:
                if self._tape_fd is not None:
                    os.close(self._tape_fd)
                    self._tape_fd = None
                self._close_mirror()
        finally:
            self._release_lock()

    def __enter__(self) -> SyncerStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -------------------------------------------------------------------------------

    def durable_versions(self) -> dict[int, int]:
        """Last durable version per owned fragment (known after ``restore``)."""
        return dict(self._durable)

    def _load_snapshot(self, layout: FragmentLayout, found: Restored) -> int | None:
        """Read the newest snapshot that verifies into ``found``; its sequence number."""
        for name in ("snapshot.bin", "snapshot.prev.bin"):
            path = self.dir / name
            if not path.exists():
                continue
            buf = bytearray(path.read_bytes())
            got = _parse(buf, 0, _SNAPSHOT)
            why = got if isinstance(got, str) else "trailing bytes" if got[0] != len(buf) else _check_snapshot(got[1])
            if isinstance(got, str) or why is not None:
                log.warning("ignoring %s: %s", path, why)  # the marks say whether anything is lost
                continue
            header = got[1]
            sig = header["signature"]
            if len(sig) != layout.num_fragments:
                raise StateError(
                    f"snapshot in {self.dir} has {len(sig)} fragments, this model {layout.num_fragments}; "
                    "use a fresh --run-dir"
                )
            self._check_layout(sig, list(range(len(sig))), "snapshot")
            if header["owned"] != self.owned:
                raise StateError(
                    f"{self.dir} belongs to a syncer shard owning fragments {header['owned']}, this one owns "
                    f"{self.owned}; use the same shards or a fresh --run-dir"
                )
            tensors = _tensors(buf, header)
            for meta in header["fragments"]:
                p = meta["fragment"]
                if p not in self.owned:
                    raise self._damaged(f"{path} holds fragment {p}, which its own owned list {self.owned} lacks")
                prefix = f"{p}/"
                mine = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
                found.fragments[p] = _decode(mine, meta, layout.fragments[p], str(path))
            self._snap_no = header["snapshot"]
            found.syncer_meta = header["syncer"]
            return int(header["seq"])
        return None

    def _check_marks(self, marks: dict[int, tuple[int, int]], found: Restored) -> None:
        """No fragment may restore below its mark: that would hand out a version number twice."""
        for p, (version, _) in sorted(marks.items()):
            have = found.fragments[p].version if p in found.fragments else 0
            if have < version:
                raise self._damaged(
                    f"fragment {p} was durable at version {version} but {self.dir} now holds only version {have} "
                    "(a log or snapshot was deleted or damaged)"
                )

    def restore(self, layout: FragmentLayout, owned: list[int]) -> Restored | None:
        """Lock the folder (StoreLocked if another syncer holds it), check it against ``layout``
        and ``owned``, then find the newest valid snapshot and the newest record of each fragment
        log; None for a fresh folder. StateError if that is below a durable mark. Call it once,
        before any write; ``close`` releases the lock."""
        self.signature = _signature(layout)
        self.owned = sorted(owned)
        self._check_dirs()
        self._closed = False
        with self._disk("taking the syncer lock"):
            self._take_lock()
        try:
            found = self._restore(layout)
        except BaseException:
            self.close()  # a failed restore must not keep the folder locked
            raise
        self._restored = True
        return found

    def _restore(self, layout: FragmentLayout) -> Restored | None:
        self._durable = {p: 0 for p in self.owned}
        if not has_state(self.dir):
            check_state(self.root.parent, self.dir)
            # Written now, not at the first merge: from here on a deleted folder is told from a fresh one.
            with self._disk("creating the syncer state folder"):
                self._init_dir()
            self._rescan()
            return None
        self._check_format()
        self._dir_ready = True
        marks, differ = self._all_marks()
        if marks is None and (any(self.dir.glob("frag-*.log")) or any(self.dir.glob("snapshot*.bin"))):
            log.warning(
                "%s and %s are both missing: restoring what %s holds, unchecked, and marking that durable",
                MARKS, MIRROR, self.dir,
            )  # fmt: skip
        found = Restored()
        seqs: list[tuple[int, dict[str, Any]]] = []
        snap_seq = self._load_snapshot(layout, found)
        if snap_seq is not None and found.syncer_meta is not None:
            seqs.append((snap_seq, found.syncer_meta))
        logs = set()
        for path in self.dir.glob("frag-*.log"):
            m = _LOG_NAME.match(path.name)
            if m is None:
                raise StateError(f"{path} is not a fragment log of ours; move it out of {self.dir}")
            logs.add(int(m.group(1)))
        for p in sorted(logs | set(marks or {})):
            if p not in self.owned:
                raise StateError(
                    f"{self.dir / f'frag-{p}.log'} belongs to fragment {p}, which this syncer shard does not own "
                    f"{self.owned}; use the same shards or a fresh --run-dir"
                )
            self._finish_rotation(p, marks)
            newest = self._scan_log(p, (marks or {}).get(p, (0, 0))[1])
            if newest is None:
                continue
            buf, header = newest
            seqs.append((header["seq"], header["syncer"]))
            have = found.fragments.get(p)
            if have is None or header["meta"]["version"] > have.version:
                found.fragments[p] = _decode(
                    _tensors(buf, header), header["meta"], layout.fragments[p], str(self.dir / f"frag-{p}.log")
                )
        self._check_marks(marks or {}, found)
        self._rescan()
        self._durable.update({p: rec.version for p, rec in found.fragments.items()})
        if differ:  # one lost or behind: both again, so that a later loss of one is still caught
            with self._disk(f"writing {MARKS} and {MIRROR} anew"):
                self._rewrite_marks({p: end for p, (_, end) in self._last.items()})
        if not seqs and not found.fragments:
            return None
        if seqs:
            self._seq, found.syncer_meta = max(seqs, key=lambda x: x[0])
        return found
