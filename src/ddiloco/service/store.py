"""Durable syncer state: per-fragment append-only logs, whole-state snapshots, durable marks, the event tape.

Layout of ``RUN_DIR/state/`` (``RUN_DIR/state/shard-{i}/`` when there are several syncer shards):

- ``frag-{p}.log``: one record per durable version of fragment p. Each record is the fragment's
  *full* state (values, outer momentum, counters) plus the syncer's meta state, so the newest
  valid record alone restores the fragment; older records only matter until the next snapshot.
- ``snapshot.bin`` / ``snapshot.prev.bin``: every owned fragment, the meta state, the layout
  signature and the owned list, written to a temp file and renamed into place.
- ``durable.log``: the high-water marks. After a record is fsynced, one fixed-size, CRC'd mark
  ``(fragment, version, end of that record in frag-{p}.log)`` is appended and fsynced; only then is
  the version acknowledged. A restore that cannot reach a marked version, or finds damaged bytes
  below a marked end (bytes that were fsynced), is a hard error: a deleted, zeroed, truncated or
  bit-flipped log can no longer roll a fragment back silently. Only an unmarked tail is cut.
- ``syncer.lock``: ``flock``ed from ``restore`` to ``close`` (holds the owner's pid), so a second
  syncer on the same folder is refused instead of mixing its history into ours.
- ``tape.jsonl``: the event tape, one JSON object a line; written through at once (a killed process
  loses nothing), fsynced at most every ``tape_sync_s`` and on ``flush_tape``/``snapshot``/``close``.
- ``FORMAT``: ``{"format": 3}``; a folder of another format is refused, never guessed at.

Records and snapshots share one framing: ``magic(4) | body length (u64) | crc32(body) (u32)``,
then the body ``json length (u32) | JSON header | raw little-endian tensor bytes``. No pickle.
A disk that fills up raises ``StoreFull`` and leaves no half record and no mark behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import struct
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from ddiloco.core.fragments import FragmentLayout
from ddiloco.core.syncer import FragmentRecord
from ddiloco.errors import DDiLoCoError
from ddiloco.report.tape import read_tape

log = logging.getLogger(__name__)

_FRAME = struct.Struct("<4sQI")  # magic, body length, crc32 of the body
_JLEN = struct.Struct("<I")
_RECORD, _SNAPSHOT = b"DDLR", b"DDLS"
_MARK = struct.Struct("<4sIQQ")  # magic, fragment, version, end of its record in frag-{p}.log
_MARK_CRC = struct.Struct("<I")
_MARK_MAGIC = b"DDLM"
MARK_SIZE = _MARK.size + _MARK_CRC.size
MARKS, LOCK = "durable.log", "syncer.lock"
FORMAT = 3
"""Version of the files in ``state/`` (2: records carry incarnations and sequence numbers, the
folder has a FORMAT file; 3: durable.log marks and syncer.lock). Another version is refused at restore."""
# Only these dtypes may be named in a file; the name is never eval'd or used to import anything.
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


class StateError(DDiLoCoError):
    """The run dir's syncer state is unusable (another model layout, corruption)."""


class StoreFull(StateError):
    """The disk under the state folder is full (or over quota): the version being written is not
    durable and was not marked; nothing before it is lost. Stop serving, free space, restart."""


class StoreLocked(StateError):
    """Another syncer holds this state folder (its ``syncer.lock``)."""


def _is_full(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


def _write_all(fd: int, pieces: list[Any]) -> None:
    """Write every piece to ``fd`` unbuffered: after a failure no hidden buffer can be flushed later
    behind a truncation (a buffered file flushes again on truncate and close)."""
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while view:
            view = view[os.write(fd, view) :]


def _pack_mark(p: int, version: int, end: int) -> bytes:
    body = _MARK.pack(_MARK_MAGIC, p, version, end)
    return body + _MARK_CRC.pack(zlib.crc32(body))


def _unpack_mark(buf: bytes, pos: int) -> tuple[int, int, int] | None:
    """(fragment, version, end) of the mark at ``pos``, or None if it does not verify."""
    if len(buf) - pos < MARK_SIZE:
        return None
    body = buf[pos : pos + _MARK.size]
    (crc,) = _MARK_CRC.unpack_from(buf, pos + _MARK.size)
    magic, p, version, end = _MARK.unpack(body)
    if magic != _MARK_MAGIC or zlib.crc32(body) != crc:
        return None
    return p, version, end


def _torn_shape(buf: bytearray, pos: int, why: str) -> bool:
    """Whether damage at ``pos`` looks like an interrupted append: a prefix of the record, zeros
    to the end, or a full-length last record whose bytes never reached the disk (ext4)."""
    whole = why == "checksum mismatch" and _FRAME.size + _FRAME.unpack_from(buf, pos)[1] + pos == len(buf)
    return why.startswith("truncated") or not any(buf[pos:]) or whole


Tensors = dict[str, torch.Tensor]


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _frame(magic: bytes, header: dict[str, Any], tensors: Tensors) -> list[Any]:
    """The pieces of one framed body, zero-copy where possible (fragments can be large)."""
    bufs, entries = [], []
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        bufs.append(t.reshape(-1).view(torch.uint8).numpy())  # raw bytes, little-endian hosts only
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size()])
    js = json.dumps({**header, "format": FORMAT, "tensors": entries}).encode()
    body = [_JLEN.pack(len(js)), js, *bufs]
    crc = 0
    for b in body:
        crc = zlib.crc32(b, crc)
    return [_FRAME.pack(magic, sum(memoryview(b).nbytes for b in body), crc), *body]


def _parse(buf: bytearray, pos: int, magic: bytes) -> tuple[int, dict[str, Any]] | str:
    """Verify the frame at ``pos``: (end offset, JSON header), or why it is not valid."""
    if len(buf) - pos < _FRAME.size:
        return "truncated header"
    m, n, crc = _FRAME.unpack_from(buf, pos)
    start = pos + _FRAME.size
    if m != magic:
        return "bad magic"
    if start + n > len(buf):
        return "truncated body"
    if zlib.crc32(memoryview(buf)[start : start + n]) != crc:
        return "checksum mismatch"
    (jn,) = _JLEN.unpack_from(buf, start)
    header = json.loads(bytes(buf[start + _JLEN.size : start + _JLEN.size + jn]))
    header["_data"] = start + _JLEN.size + jn  # where the tensor bytes begin
    return start + n, header


def _describe(piece: list[Any] | None) -> str:
    return "nothing" if piece is None else f"{piece[0]!r} rows {piece[1]}:{piece[2]} shape {tuple(piece[3])}"


def _tensors(buf: bytearray, header: dict[str, Any]) -> Tensors:
    out, off = {}, header["_data"]
    for name, dtype, shape, nbytes in header["tensors"]:
        dt = _DTYPES[dtype]
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=dt)
        else:  # clone first: frombuffer at an odd offset may be misaligned for the dtype
            out[name] = (
                torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=off).clone().view(dt).reshape(shape)
            )
        off += nbytes
    return out


def _signature(layout: FragmentLayout) -> list[list[list[Any]]]:
    """The layout signature split per fragment, as JSON gives it back (lists, not tuples)."""
    return [[[pc.name, pc.row_start, pc.row_end, list(pc.shape)] for pc in pieces] for pieces in layout.fragments]


def _encode(rec: FragmentRecord) -> tuple[Tensors, dict[str, int]]:
    tensors = {f"v{i}": v for i, v in enumerate(rec.values)}
    tensors.update({f"m{i}": m for i, m in enumerate(rec.momentum or [])})
    return tensors, {"fragment": rec.fragment, "version": rec.version, "tokens_merged": rec.tokens_merged}


def _decode(tensors: Tensors, meta: dict[str, Any], num_pieces: int) -> FragmentRecord:
    values = [tensors[f"v{i}"] for i in range(num_pieces)]
    momentum = [tensors[f"m{i}"] for i in range(num_pieces)] if "m0" in tensors else None
    return FragmentRecord(int(meta["fragment"]), int(meta["version"]), int(meta["tokens_merged"]), values, momentum)


@dataclass
class Restored:
    """What a restore found: the newest durable record of each fragment and the syncer's meta
    state of the newest record or snapshot."""

    fragments: dict[int, FragmentRecord] = field(default_factory=dict)
    syncer_meta: dict[str, Any] | None = None


class SyncerStore:
    """Durable syncer state in RUN_DIR/state/ (per shard: RUN_DIR/state/shard-{i}/ when num_shards > 1).

    Call ``restore`` once at start-up (it locks the folder and returns None on a fresh one), then
    ``append`` every new version before sending it anywhere, ``append_tape`` as the tape grows,
    ``snapshot`` now and then, and ``close`` at the end (it fsyncs the tape and releases the lock).
    It stores records; it never sees the syncer itself. ``tape_sync_s``: the longest time tape lines
    may sit unfsynced (they are written through at once; only an OS crash can lose them).
    """

    def __init__(
        self, run_dir: str | Path, shard: int = 0, num_shards: int = 1, fsync: bool = True, tape_sync_s: float = 5.0
    ) -> None:
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
        self.tape_sync_s = tape_sync_s
        self._restored = False
        self._closed = False
        self._broken: str | None = None  # why writing must stop (a failed write could not be undone)
        self._lock: IO[str] | None = None
        self._durable: dict[int, int] = {}
        self._last: dict[int, tuple[int, int]] = {}  # p -> (offset, end) of the newest record in frag-p.log
        self._seq = 0  # orders records and snapshots across logs: the newest one's meta state wins
        self._snap_no = 0
        self._final_bad = False  # snapshot.bin failed to verify at restore: never rotate it into prev
        self._tape_fd: int | None = None
        self._tape_dirty = False
        self._tape_synced = time.monotonic()
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
            return start, os.lseek(fd, 0, os.SEEK_CUR)
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

    def _cut(self, path: Path, at: int) -> None:
        """Drop what follows ``at`` in ``path``, durably."""
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, at)
            self._sync_fd(fd)
        finally:
            os.close(fd)

    def _undo(self, undo: Any, path: Path) -> None:
        """Undo a failed write; if even that fails, refuse further writes: appending behind a half
        record would turn it into damage inside fsynced bytes. A restart's restore cuts it."""
        try:
            undo()
        except OSError as e:
            self._broken = f"a failed write to {path} could not be undone ({e})"

    def _fsync_dir(self) -> None:
        if self.fsync:
            _fsync_dir(self.dir)

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
        fsynced, then its mark in durable.log is (2 fsyncs). A version that is already durable
        is not written again. A full disk raises StoreFull and leaves neither record nor mark."""
        self._need_restore()
        p = rec.fragment
        if p not in self.owned:
            raise ValueError(f"fragment {p} is not owned by this syncer shard (owned: {self.owned})")
        if rec.version <= self._durable.get(p, -1):
            return
        tensors, meta = _encode(rec)
        header = {"seq": self._seq + 1, "meta": meta, "syncer": syncer_meta, "pieces": self.signature[p]}
        pieces = _frame(_RECORD, header, tensors)
        path = self.dir / f"frag-{p}.log"
        with self._disk(f"appending version {rec.version} of fragment {p}"):
            self._init_dir()
            new = not path.exists()
            start, end = self._append_bytes(path, pieces)
            try:
                if new:
                    self._fsync_dir()  # the new file's directory entry must survive a crash too
                # Only now, with the record on disk, may the mark say so.
                self._append_bytes(self.dir / MARKS, [_pack_mark(p, rec.version, end)])
            except BaseException:
                self._undo(lambda: self._cut(path, start), path)  # never acknowledged: a restore must not bring it back
                raise
        self._seq += 1
        self._last[p] = (start, end)
        self._durable[p] = rec.version

    def append_tape(self, records: list[dict]) -> None:
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
        """Make every tape line appended so far durable (one fsync, none if nothing is new)."""
        if self._tape_fd is not None and self._tape_dirty:
            with self._disk("syncing the event tape"):
                self._sync_fd(self._tape_fd)
        self._tape_dirty = False
        self._tape_synced = time.monotonic()

    def read_tape(self) -> list[dict[str, Any]]:
        """The tape as written so far (a torn last line is skipped)."""
        return read_tape(self.dir / "tape.jsonl")

    def snapshot(self, records: list[FragmentRecord], syncer_meta: dict[str, Any]) -> Path:
        """Write every owned fragment + meta state atomically to snapshot.bin (the previous one
        becomes snapshot.prev.bin), then compact durable.log and the fragment logs. A full disk
        raises StoreFull; the previous snapshot and every durable version stay as they were."""
        self._need_restore()
        if sorted(r.fragment for r in records) != self.owned:
            raise ValueError(f"a snapshot needs every owned fragment {self.owned}")
        tensors: Tensors = {}
        frags = []
        for rec in records:
            ts, meta = _encode(rec)
            tensors.update({f"{rec.fragment}/{k}": v for k, v in ts.items()})
            frags.append(meta)
        header = {
            "snapshot": self._snap_no + 1,
            "seq": self._seq + 1,
            "signature": self.signature,
            "owned": self.owned,
            "fragments": frags,
            "syncer": syncer_meta,
        }
        tmp, final, prev = self.dir / "snapshot.tmp", self.dir / "snapshot.bin", self.dir / "snapshot.prev.bin"
        with self._disk("writing a snapshot"):
            self._init_dir()
            self._write_new(tmp, _frame(_SNAPSHOT, header, tensors))
            self._seq += 1
            self._snap_no += 1
            # A crash between the two renames leaves prev + tmp: restore then uses prev + the logs,
            # which are only compacted after both renames are durable.
            if final.exists() and not self._final_bad:
                os.replace(final, prev)
            os.replace(tmp, final)
            self._final_bad = False
            self._fsync_dir()
            for meta in frags:
                self._durable[meta["fragment"]] = max(self._durable.get(meta["fragment"], 0), meta["version"])
            # Marks first: their ends are the compacted lengths, which the old logs still exceed,
            # so a crash between the two steps never makes a later torn append look fsynced.
            self._rewrite_marks({p: end - start for p, (start, end) in self._last.items()})
            self._compact()
            self.flush_tape()
        return final

    def _rewrite_marks(self, ends: dict[int, int]) -> None:
        """Replace durable.log with one mark per fragment: its durable version and how many bytes
        of its log are fsynced records."""
        marks = [_pack_mark(p, v, ends.get(p, 0)) for p, v in sorted(self._durable.items()) if v > 0]
        tmp = self.dir / f"{MARKS}.tmp"
        self._write_new(tmp, marks)
        os.replace(tmp, self.dir / MARKS)
        self._fsync_dir()

    def _compact(self) -> None:
        """Cut every log down to its newest record. That record is kept (not dropped as covered
        by the snapshot) so a corrupt snapshot.bin never loses a version: prev + logs still hold it."""
        for p, (start, end) in list(self._last.items()):
            if start == 0:
                continue  # already a single record
            path, tmp = self.dir / f"frag-{p}.log", self.dir / f"frag-{p}.log.tmp"
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(end - start)
            self._write_new(tmp, [data])
            os.replace(tmp, path)
            self._last[p] = (0, end - start)
        self._fsync_dir()

    def close(self) -> None:
        """Fsync the tape and release the folder's lock; the store cannot write after this."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._tape_fd is not None:
                try:
                    self.flush_tape()
                finally:
                    os.close(self._tape_fd)
                    self._tape_fd = None
        finally:
            if self._lock is not None:
                self._lock.close()  # closing the file releases the flock
                self._lock = None

    def __enter__(self) -> SyncerStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -------------------------------------------------------------------------------

    def durable_versions(self) -> dict[int, int]:
        """Last durable version per owned fragment (known after ``restore``)."""
        return dict(self._durable)

    def _check_dirs(self) -> None:
        """A run dir written with another number of syncer shards must not look empty."""
        flat = self.root.exists() and any(self.root.glob("frag-*.log")) or (self.root / "snapshot.bin").exists()
        sharded = self.root.exists() and any(_has_state(d) for d in self.root.glob("shard-*"))
        if (self.num_shards > 1 and flat) or (self.num_shards == 1 and sharded):
            other = "1 syncer shard" if flat else "several syncer shards"
            raise StateError(
                f"{self.root} was written by {other}, not {self.num_shards}; use the same number of shards or a "
                "fresh --run-dir"
            )

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

    def _check_format(self) -> None:
        """Files of another format are refused with what to do, never read as if they were ours."""
        path = self.dir / "FORMAT"
        try:
            found = json.loads(path.read_text()).get("format")
        except FileNotFoundError:
            found = 1  # format 1 had no FORMAT file
        except (OSError, ValueError, AttributeError):
            found = "unreadable"
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

    def _load_snapshot(self, layout: FragmentLayout, found: Restored) -> int | None:
        """Read the newest snapshot that verifies into ``found``; its sequence number."""
        for name in ("snapshot.bin", "snapshot.prev.bin"):
            path = self.dir / name
            if not path.exists():
                continue
            buf = bytearray(path.read_bytes())
            got = _parse(buf, 0, _SNAPSHOT)
            if isinstance(got, str) or got[0] != len(buf):
                log.warning("ignoring %s: %s", path, got if isinstance(got, str) else "trailing bytes")
                self._final_bad |= name == "snapshot.bin"
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
                prefix = f"{p}/"
                mine = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
                found.fragments[p] = _decode(mine, meta, len(layout.fragments[p]))
            self._snap_no = header["snapshot"]
            found.syncer_meta = header["syncer"]
            return int(header["seq"])
        return None

    def _damaged(self, what: str) -> StateError:
        return StateError(
            f"{what}; it was made durable, so this is damage, not a crash: restore {self.dir} from a backup or "
            f"use a fresh --run-dir; to go on from the versions still readable (learners rebase onto them), "
            f"delete {self.dir / MARKS}"
        )

    def _read_marks(self) -> dict[int, tuple[int, int]] | None:
        """The newest mark per fragment: (durable version, fsynced bytes of its log); None when
        durable.log is missing. Only a damaged last mark (a crash mid-append) is cut."""
        path = self.dir / MARKS
        if not path.exists():
            return None
        buf = path.read_bytes()
        marks: dict[int, tuple[int, int]] = {}
        for pos in range(0, len(buf), MARK_SIZE):
            got = _unpack_mark(buf, pos)
            if got is None:
                if len(buf) - pos > MARK_SIZE:
                    raise self._damaged(f"{path} is corrupt at byte {pos}")
                log.warning("cutting a torn mark off %s at byte %d", path, pos)
                self._cut(path, pos)
                break
            p, version, end = got
            if p not in self.owned:
                raise StateError(
                    f"{path} marks fragment {p}, which this syncer shard does not own {self.owned}; use the same "
                    "shards or a fresh --run-dir"
                )
            marks[p] = (max(version, marks.get(p, (0, 0))[0]), end)
        return marks

    def _scan_log(self, p: int, fsynced: int) -> tuple[bytearray, dict[str, Any]] | None:
        """Verify every record of frag-p.log, cut a torn tail; the newest record (buffer, header).
        The first ``fsynced`` bytes were acknowledged: damage there is never a torn tail."""
        path = self.dir / f"frag-{p}.log"
        buf = bytearray(path.read_bytes()) if path.exists() else bytearray()
        if len(buf) < fsynced:
            raise self._damaged(f"{path} has {len(buf)} bytes but {fsynced} were fsynced: it was truncated or deleted")
        pos, newest = 0, None
        while pos < len(buf):
            got = _parse(buf, pos, _RECORD)
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
            if newest is None or header["meta"]["version"] > newest[1]["meta"]["version"]:
                newest = (buf, header)
                self._last[p] = (pos, end)
            pos = end
        return newest

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
        if not _has_state(self.dir):
            return None
        self._check_format()
        self._dir_ready = True
        marks = self._read_marks()
        if marks is None and (any(self.dir.glob("frag-*.log")) or any(self.dir.glob("snapshot*.bin"))):
            log.warning("%s is missing: restoring what %s holds, unchecked, and marking that durable", MARKS, self.dir)
        found = Restored()
        seqs: list[tuple[int, dict[str, Any]]] = []
        snap_seq = self._load_snapshot(layout, found)
        if snap_seq is not None and found.syncer_meta is not None:
            seqs.append((snap_seq, found.syncer_meta))
        logs = {int(path.stem.removeprefix("frag-")) for path in self.dir.glob("frag-*.log")}
        for p in sorted(logs | set(marks or {})):
            if p not in self.owned:
                raise StateError(
                    f"{self.dir / f'frag-{p}.log'} belongs to fragment {p}, which this syncer shard does not own "
                    f"{self.owned}; use the same shards or a fresh --run-dir"
                )
            newest = self._scan_log(p, (marks or {}).get(p, (0, 0))[1])
            if newest is None:
                continue
            buf, header = newest
            seqs.append((header["seq"], header["syncer"]))
            have = found.fragments.get(p)
            if have is None or header["meta"]["version"] > have.version:
                found.fragments[p] = _decode(_tensors(buf, header), header["meta"], len(layout.fragments[p]))
        self._check_marks(marks or {}, found)
        self._durable.update({p: rec.version for p, rec in found.fragments.items()})
        if marks is None:
            with self._disk(f"recreating {MARKS}"):
                self._rewrite_marks({p: end for p, (_, end) in self._last.items()})
        if not seqs and not found.fragments:
            return None
        if seqs:
            self._seq, found.syncer_meta = max(seqs, key=lambda x: x[0])
        return found


def _has_state(d: Path) -> bool:
    """Whether ``d`` holds anything besides the lock file and a FORMAT.tmp that a crash left before
    its rename (a locked but fresh folder is empty)."""
    return d.is_dir() and any(x.name not in (LOCK, "FORMAT.tmp") for x in d.iterdir())
