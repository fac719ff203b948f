"""Durable syncer state: per-fragment rotating logs, meta snapshots, durable marks, the event tape.

Layout of ``RUN_DIR/state/`` (``RUN_DIR/state/shard-{i}/`` when there are several syncer shards):

- ``frag-{p}.log``: one record per durable version of fragment p. Each record is the fragment's
  *full* state (values, outer momentum, counters) plus the syncer's meta state, so the newest
  valid record alone restores the fragment; older records are kept only until the log rotates.
- Bounded disk: an append that would take ``frag-{p}.log`` past ``log_bound`` times the record's
  size (``runtime.store_log_bound``, default 2), or the first append to it after a snapshot,
  *rotates* the log: the record is written to ``frag-{p}.next.log`` (fsynced, its directory entry
  fsynced), marked, and only then renamed over ``frag-{p}.log``, dropping every older record. No
  byte is copied (each version is written once), and the folder never holds more than
  ``log_bound`` records of each fragment plus one record in flight. A restore finishes a rotation
  whose record was marked (a crash before the rename) and drops one that was not (never
  acknowledged). So a fragment whose state is S bytes takes at most ``(log_bound + 1) * S`` (one
  fragment at a time), and the folder ``log_bound * state + the largest fragment + small files``.
- ``snapshot.bin``: the syncer's meta state, the layout signature, the owned list and each
  fragment's durable version (no tensors: the logs hold every fragment), written to a temp file
  and renamed into place; a snapshot also makes durable any record given to it that is newer
  than its log's, and rewrites the mark files to one mark per fragment. Folders written before
  the logs rotated may still hold tensors in ``snapshot.bin`` and a ``snapshot.prev.bin``: they
  are read as before, and the next snapshot replaces them.
- ``durable.log``: the high-water marks. After a record is fsynced, one fixed-size, CRC'd mark
  ``(fragment, version, end of that record in frag-{p}.log)`` is appended and fsynced; only then is
  the version acknowledged (a rotation's mark gives the end in ``frag-{p}.next.log``, which becomes
  ``frag-{p}.log`` with the rename that follows). A restore that cannot reach a marked version, or finds damaged bytes
  below a marked end (bytes that were fsynced), is a hard error: a deleted, zeroed, truncated or
  bit-flipped log can no longer roll a fragment back silently. Only an unmarked tail is cut.
- ``durable.mirror.log``: the same marks again, so that every durable version is written down in
  three files (its record, durable.log, the mirror): damage to any two of the state's files either
  leaves every durable version restorable or is a one-line StateError, never a silent rollback.
  The mirror's marks are written through at once (a killed process loses none) and fsynced with
  the tape (``tape_sync_s``, ``snapshot``, ``close``): only an OS crash inside that window, followed
  by damage to two more files, could go unnoticed. A restore that finds the two mark files
  different (a crash between them, one of them lost) writes both anew from what it restored;
  deleting *both* is how to accept the versions still readable after real damage.
- ``syncer.lock``: ``flock``ed from ``restore`` to ``close`` (holds the owner's pid), so a second
  syncer on the same folder is refused instead of mixing its history into ours.
- ``tape.jsonl``: the event tape, one JSON object a line; written through at once (a killed process
  loses nothing), fsynced at most every ``tape_sync_s`` and on ``flush_tape``/``snapshot``/``close``.
- ``FORMAT``: ``{"format": 4}`` (rotating logs and tensor-free snapshots are still format 4: a
  ddiloco from before reads such a folder, and refuses one with a ``frag-{p}.next.log`` left by a
  crash in one line); a folder of another format is refused, never guessed at. It is
  written (with empty mark files) when a fresh folder is first restored, so a state folder that
  was deleted can be told from one that never held anything.

A run folder whose syncer state is missing or empty but which holds a run (its run log, a
sibling shard's marks, a summary or a final model) is refused at restore: starting again at
version 0 would silently throw the run away and write the initial weights as its final model.
``start_over`` (``--start-over``, ``start_over=True``) is the explicit way to do that.

Records and snapshots share one framing: ``magic(4) | body length (u64) | crc32(body) (u32)``,
then the body ``json length (u32) | JSON header | raw little-endian tensor bytes``. No pickle. A
header is checked for its shape after its checksum (a CRC is no signature): a body whose header
is not the JSON object we write is corruption, said in one line.
A disk that fills up raises ``StoreFull`` and leaves no half record and no mark behind.

For benchmarks the store counts what it costs: ``disk_bytes()`` (the folder now, read from the
disk), ``peak_disk_bytes`` (the largest the folder was while this store wrote it),
``bytes_written`` / ``record_bytes_written`` / ``records_written`` and ``fsyncs``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import struct
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
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
MARKS, MIRROR, LOCK = "durable.log", "durable.mirror.log", "syncer.lock"
FORMAT = 4
"""Version of the files in ``state/`` (2: records carry incarnations and sequence numbers, the
folder has a FORMAT file; 3: durable.log marks and syncer.lock; 4: durable.mirror.log, and FORMAT
with empty mark files from the first restore). Another version is refused at restore."""
_MAX_INT = 2**53  # versions, counters and sequence numbers in a header (JSON numbers past it lose bits)
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
    body: list[Any] = [_JLEN.pack(len(js)), js, *bufs]
    crc = 0
    for b in body:
        crc = zlib.crc32(b, crc)
    return [_FRAME.pack(magic, sum(memoryview(b).nbytes for b in body), crc), *body]


def _parse(buf: bytearray, pos: int, magic: bytes) -> tuple[int, dict[str, Any]] | str:
    """Verify the frame at ``pos``: (end offset, JSON header), or why it is not valid. A frame
    whose checksum holds but whose header is not ours says so ("bad header: ..."): that is never
    a torn append, and it must never surface as a traceback."""
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
    end = start + n
    if n < _JLEN.size:
        return "bad header: the body is shorter than its length field"
    (jn,) = _JLEN.unpack_from(buf, start)
    data = start + _JLEN.size + jn
    if data > end:
        return f"bad header: a {jn}-byte header in a {n}-byte body"
    try:
        header = json.loads(bytes(buf[start + _JLEN.size : data]))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        return f"bad header: not JSON ({type(e).__name__})"
    if not isinstance(header, dict):
        return f"bad header: a JSON {type(header).__name__}, not an object"
    why = _check_tensors(header.get("tensors"), end - data)
    if why is not None:
        return f"bad header: {why}"
    header["_data"] = data  # where the tensor bytes begin
    return end, header


def _is_int(x: object, lo: int = 0, hi: int = _MAX_INT) -> bool:
    return type(x) is int and lo <= x <= hi


def _check_tensors(entries: object, nbytes: int) -> str | None:
    """Why the header's tensor list cannot describe the ``nbytes`` that follow it, or None."""
    if not isinstance(entries, list):
        return "no tensor list"
    total = 0
    for e in entries:
        if not (isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and e[1] in _DTYPES):
            return f"tensor entry {str(e)[:80]} is not [name, dtype, shape, bytes]"
        shape, size = e[2], e[3]
        if not (isinstance(shape, list) and len(shape) <= 8 and all(_is_int(d, 0, 2**31) for d in shape)):
            return f"tensor {e[0][:80]!r} has the shape {str(shape)[:80]}"
        numel = 1
        for d in shape:
            numel *= d
        if size != numel * _DTYPES[e[1]].itemsize:
            return f"tensor {e[0][:80]!r} of shape {shape} claims {str(size)[:40]} bytes"
        total += size
    if total != nbytes:
        return f"its tensors need {total} bytes, the body holds {nbytes}"
    return None


def _check_meta(meta: object) -> str | None:
    if not isinstance(meta, dict):
        return "fragment meta is not an object"
    for key in ("fragment", "version", "tokens_merged"):
        if not _is_int(meta.get(key)):
            return f"fragment meta {key} = {str(meta.get(key))[:40]} is not an integer in 0..2^53"
    return None


def _check_record(header: dict[str, Any]) -> str | None:
    """Why a fragment log record's header is not the shape ``append`` writes, or None."""
    if not _is_int(header.get("seq")):
        return "bad header: no sequence number"
    if not isinstance(header.get("syncer"), dict) or not isinstance(header.get("pieces"), list):
        return "bad header: no syncer state or pieces"
    why = _check_meta(header.get("meta"))
    return None if why is None else f"bad header: {why}"


def _check_snapshot(header: dict[str, Any]) -> str | None:
    """Why a snapshot's header is not the shape ``snapshot`` writes, or None."""
    if not (_is_int(header.get("seq")) and _is_int(header.get("snapshot"))):
        return "bad header: no sequence or snapshot number"
    if not isinstance(header.get("syncer"), dict) or not isinstance(header.get("signature"), list):
        return "bad header: no syncer state or layout signature"
    owned, frags = header.get("owned"), header.get("fragments")
    if not (isinstance(owned, list) and all(_is_int(p, 0, 65535) for p in owned)):
        return "bad header: no owned fragment list"
    if not isinstance(frags, list):
        return "bad header: no fragment list"
    for meta in frags:
        why = _check_meta(meta)
        if why is not None:
            return f"bad header: {why}"
    return None


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


def _decode(tensors: Tensors, meta: dict[str, Any], pieces: Sequence[Any], where: str) -> FragmentRecord:
    """The record of one fragment; StateError (one line) when its tensors do not fit the layout
    (a checksum proves no more than that the bytes are the ones written)."""
    p = meta["fragment"]
    momentum = "m0" in tensors
    for i, pc in enumerate(pieces):
        for kind in ("v", "m") if momentum else ("v",):
            t = tensors.get(f"{kind}{i}")
            if t is None or tuple(t.shape) != tuple(pc.shape) or not t.is_floating_point():
                got = "nothing" if t is None else f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
                raise StateError(
                    f"{where} holds {got} as {kind}{i} of fragment {p}, whose layout wants a float tensor of "
                    f"shape {tuple(pc.shape)}: the file is damaged; restore the run dir from a backup or use a "
                    "fresh --run-dir"
                )
    values = [tensors[f"v{i}"] for i in range(len(pieces))]
    moms = [tensors[f"m{i}"] for i in range(len(pieces))] if momentum else None
    return FragmentRecord(int(p), int(meta["version"]), int(meta["tokens_merged"]), values, moms)


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
    ``log_bound``: a fragment's log rotates when an append would take it past this many times the
    record's size (``runtime.store_log_bound``; see the module docstring).
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
        self.log_bound = log_bound
        self._rotate: set[int] = set()  # fragments whose next append starts a new log (after a snapshot)
        self._sizes: dict[str, int] = {}  # bytes of each file in the folder, as this store left them
        self._disk_now = 0
        self.peak_disk_bytes = 0
        """The most bytes the folder held while this store wrote it (a rotation's record in flight included)."""
        self.bytes_written = 0
        """Bytes this store wrote: records, marks (both files), snapshots, tape lines."""
        self.record_bytes_written = 0
        """Bytes of fragment records written (a rotation writes none more: no record is ever copied)."""
        self.records_written = 0
        """Fragment records written (one per durable version)."""
        self.fsyncs = 0
        """fsync calls made (files and the folder), 0 when fsync is off."""
        self._restored = False
        self._closed = False
        self._broken: str | None = None  # why writing must stop (a failed write could not be undone)
        self._lock: IO[str] | None = None
        self._durable: dict[int, int] = {}
        self._last: dict[int, tuple[int, int]] = {}  # p -> (offset, end) of the newest record in frag-p.log
        self._logged: dict[int, int] = {}  # p -> the version of that record
        self._seq = 0  # orders records and snapshots across logs: the newest one's meta state wins
        self._snap_no = 0
        self._tape_fd: int | None = None
        self._tape_dirty = False
        self._mirror_fd: int | None = None  # durable.mirror.log, open for appends; fsynced with the tape
        self._mirror_dirty = False
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
            _fsync_dir(self.dir)
            self.fsyncs += 1

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

    def _remove(self, path: Path) -> None:
        path.unlink()
        self._size(path.name, None)

    def _size_of(self, path: Path) -> int:
        return self._sizes.get(path.name, 0)

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

    def snapshot(self, records: list[FragmentRecord], syncer_meta: dict[str, Any]) -> Path:
        """Write the meta state and every owned fragment's version atomically to snapshot.bin
        (no tensors: a record newer than its log's is appended first, so the logs hold every
        fragment), rewrite the mark files to one mark per fragment, and have each fragment's next
        append rotate its log. A full disk raises StoreFull; the previous snapshot and every
        durable version stay as they were."""
        self._need_restore()
        if sorted(r.fragment for r in records) != self.owned:
            raise ValueError(f"a snapshot needs every owned fragment {self.owned}")
        for rec in records:  # the syncer appends every version first: this is for other callers, and
            # for a version that only an older store's snapshot.bin held, which this one replaces
            if rec.version > self._logged.get(rec.fragment, 0):
                self._write_record(rec, syncer_meta)
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
            found = json.loads(path.read_bytes()[:256]).get("format")
        except FileNotFoundError:
            if (self.dir / MARKS).exists() or (self.dir / MIRROR).exists():  # formats 3+ always have FORMAT
                raise StateError(
                    f"{path} is missing but {self.dir} holds durable marks: the folder is damaged; restore it from a "
                    f'backup, or write {{"format": {FORMAT}}} into {path} if you know it is this format'
                ) from None
            found = 1  # format 1 had no FORMAT file
        except (OSError, ValueError, AttributeError):
            found = "unreadable"
        if found == 3:
            raise StateError(
                f"{self.dir} holds syncer state of format 3 (one durable.log, before durable.mirror.log), this "
                f"ddiloco reads format {FORMAT}; finish that run with the ddiloco that wrote it, or start this one "
                "in a fresh --run-dir"
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


_LOG_NAME = re.compile(r"^frag-(\d{1,5})(?:\.next)?\.log$")
_HISTORY_RECORDS = 100_000  # lines of metrics/run.jsonl looked at (it holds a few per session)


def run_history(run_dir: Path, state_dir: Path) -> str | None:
    """What in ``run_dir`` shows that a run went on there, for a syncer whose state folder
    ``state_dir`` is missing or empty; None for a run folder that never got that far.

    Evidence: another shard's (or the flat folder's) durable marks, a summary, a final model, and
    for the only or first shard the run log (only shard 0 writes it, after its own restore, so a
    second shard starting beside a fresh first one never sees it too early)."""
    root = run_dir / "state"
    for d in [root, *sorted(root.glob("shard-*"))] if root.is_dir() else []:
        if d != state_dir and any((d / name).is_file() and (d / name).stat().st_size > 0 for name in (MARKS, MIRROR)):
            return f"durable marks in {d}"
    for name in ("summary.json", "tape.jsonl"):
        if (run_dir / name).is_file():
            return name
    final = run_dir / "final"
    if final.is_dir() and any(final.glob("*.safetensors")):
        return "a final model"
    if state_dir in (root, root / "shard-0"):
        runlog = run_dir / "metrics" / "run.jsonl"
        try:
            with open(runlog, "rb") as f:
                lines = sum(1 for _, line in zip(range(_HISTORY_RECORDS), f) if line.strip())
        except OSError:
            lines = 0
        if lines:
            return f"{lines} records in metrics/run.jsonl"
    return None


def check_state(run_dir: str | Path, state_dir: Path | None = None, shard: int = 0, num_shards: int = 1) -> None:
    """StateError (one line) when ``run_dir`` holds a run but this shard's syncer state is missing
    or empty (``state_dir``, default that of ``shard`` of ``num_shards``): a start would silently
    begin at version 0 and write the initial weights as the run's final model."""
    root = Path(run_dir) / "state"
    d = state_dir if state_dir is not None else root if num_shards == 1 else root / f"shard-{shard}"
    if _has_state(d):
        return
    history = run_history(Path(run_dir), d)
    if history is not None:
        raise StateError(
            f"{run_dir} holds a run ({history}) but its syncer state {d} is missing or empty: starting at "
            "version 0 would throw the run away; restore that folder from a backup, or start the run over from "
            "its initial model with --start-over (start_over=True in Python)"
        )


def start_over(run_dir: str | Path, shard: int = 0, num_shards: int = 1, by: str = "--start-over") -> None:
    """Start a run over from its initial model in ``run_dir``, whose syncer state is missing or
    empty (``--start-over``): the state folder is made anew (FORMAT, empty marks) and the run log
    says so, so that the syncer's restore starts at version 0 instead of refusing. A state folder
    that still holds anything is refused (this never deletes a version): resume it without the flag."""
    store = SyncerStore(run_dir, shard, num_shards, fsync=True)
    d = store.dir
    with store._disk("taking the syncer lock"):
        store._take_lock()
    try:
        if _has_state(d):
            raise StateError(
                f"{by}: {d} holds syncer state; a start resumes from it without {by}: drop it (to train from "
                "scratch, use a fresh run folder)"
            )
        history = run_history(store.root.parent, d)
        with store._disk("creating the syncer state folder"):
            store._init_dir()
        log.warning(
            "%s: %s starts over from its initial model at version 0 (%s)", by, store.root.parent,
            f"its state was missing; the run had {history}" if history else "nothing was there",
        )  # fmt: skip
        if shard == 0:  # the run log is the run's own record of what happened to it
            from ddiloco.report.summary import run_started_at
            from ddiloco.report.tape import append_run_event

            started = run_started_at(store.root.parent)
            age = max(0.0, time.time() - started) if started is not None else 0.0
            append_run_event(store.root.parent, age, "start_over", f"{by}: the syncer state was missing ({history})")
    finally:
        store.close()


def _has_state(d: Path) -> bool:
    """Whether ``d`` holds anything besides the lock file and a FORMAT.tmp that a crash left before
    its rename (a locked but fresh folder is empty)."""
    return d.is_dir() and any(x.name not in (LOCK, "FORMAT.tmp") for x in d.iterdir())
