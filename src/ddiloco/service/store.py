"""Durable syncer state: per-fragment append-only logs, whole-state snapshots, the event tape.

Layout of ``RUN_DIR/state/`` (``RUN_DIR/state/shard-{i}/`` when there are several syncer shards):

- ``frag-{p}.log``: one record per durable version of fragment p. Each record is the fragment's
  *full* state (values, outer momentum, counters) plus the syncer's meta state, so the newest
  valid record alone restores the fragment; older records only matter until the next snapshot.
- ``snapshot.bin`` / ``snapshot.prev.bin``: every owned fragment, the meta state, the layout
  signature and the owned list, written to a temp file and renamed into place.
- ``tape.jsonl``: the event tape, one JSON object a line.
- ``FORMAT``: ``{"format": 2}``; a folder of another format is refused, never guessed at.

Records and snapshots share one framing: ``magic(4) | body length (u64) | crc32(body) (u32)``,
then the body ``json length (u32) | JSON header | raw little-endian tensor bytes``. No pickle.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddiloco.core.fragments import FragmentLayout
from ddiloco.core.syncer import FragmentRecord
from ddiloco.errors import DDiLoCoError
from ddiloco.report.tape import read_tape

log = logging.getLogger(__name__)

_FRAME = struct.Struct("<4sQI")  # magic, body length, crc32 of the body
_JLEN = struct.Struct("<I")
_RECORD, _SNAPSHOT = b"DDLR", b"DDLS"
FORMAT = 2
"""Version of the files in ``state/`` (2: records carry incarnations and sequence numbers;
the folder has a FORMAT file). Another version is refused at restore."""
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

    Call ``restore`` once at start-up (it returns None on a fresh dir), then ``append`` every new
    version before sending it anywhere, ``append_tape`` as the tape grows, ``snapshot`` now and then.
    It stores records; it never sees the syncer itself.
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
        self._restored = False
        self._durable: dict[int, int] = {}
        self._last: dict[int, tuple[int, int]] = {}  # p -> (offset, end) of the newest record in frag-p.log
        self._seq = 0  # orders records and snapshots across logs: the newest one's meta state wins
        self._snap_no = 0
        self._final_bad = False  # snapshot.bin failed to verify at restore: never rotate it into prev
        self._tape_checked = False
        self._dir_ready = False
        self.signature: list[list[list[Any]]] = []  # per fragment, set by restore
        self.owned: list[int] = []

    # -- writing -------------------------------------------------------------------------------

    def _sync(self, f: Any) -> None:
        f.flush()
        if self.fsync:
            os.fsync(f.fileno())

    def _need_restore(self) -> None:
        if not self._restored:  # else we could append after a torn tail or reuse sequence numbers
            raise RuntimeError("SyncerStore.restore(layout, owned) must be called once before append or snapshot")

    def append(self, rec: FragmentRecord, syncer_meta: dict[str, Any]) -> None:
        """Make a fragment's new version durable (one record in frag-{p}.log, fsynced) before
        returning. A version that is already durable is not written again."""
        self._need_restore()
        p = rec.fragment
        if p not in self.owned:
            raise ValueError(f"fragment {p} is not owned by this syncer shard (owned: {self.owned})")
        if rec.version <= self._durable.get(p, -1):
            return
        tensors, meta = _encode(rec)
        self._seq += 1
        header = {"seq": self._seq, "meta": meta, "syncer": syncer_meta, "pieces": self.signature[p]}
        pieces = _frame(_RECORD, header, tensors)
        path = self.dir / f"frag-{p}.log"
        new = not path.exists()
        self._init_dir()
        with open(path, "ab") as f:
            start = f.tell()
            try:
                for b in pieces:
                    f.write(b)
                self._sync(f)
            except BaseException:
                f.truncate(start)  # e.g. disk full: never leave a half record before the next one
                raise
            self._last[p] = (start, f.tell())
        if new and self.fsync:
            _fsync_dir(self.dir)  # the new file's directory entry must survive a crash too
        self._durable[p] = rec.version

    def append_tape(self, records: list[dict]) -> None:
        """Append JSON lines to tape.jsonl and fsync them."""
        if not records:
            return
        self._init_dir()
        path = self.dir / "tape.jsonl"
        if not self._tape_checked and path.exists():
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):  # torn last line from a crash: drop it
                with open(path, "r+b") as f:
                    f.truncate(data.rfind(b"\n") + 1)
        self._tape_checked = True
        with open(path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
            self._sync(f)

    def read_tape(self) -> list[dict[str, Any]]:
        """The durable tape (a torn last line is skipped)."""
        return read_tape(self.dir / "tape.jsonl")

    def snapshot(self, records: list[FragmentRecord], syncer_meta: dict[str, Any]) -> Path:
        """Write every owned fragment + meta state atomically to snapshot.bin (the previous one
        becomes snapshot.prev.bin), then compact the fragment logs."""
        self._need_restore()
        if sorted(r.fragment for r in records) != self.owned:
            raise ValueError(f"a snapshot needs every owned fragment {self.owned}")
        self._init_dir()
        self._seq += 1
        self._snap_no += 1
        tensors: Tensors = {}
        frags = []
        for rec in records:
            ts, meta = _encode(rec)
            tensors.update({f"{rec.fragment}/{k}": v for k, v in ts.items()})
            frags.append(meta)
        header = {
            "snapshot": self._snap_no,
            "seq": self._seq,
            "signature": self.signature,
            "owned": self.owned,
            "fragments": frags,
            "syncer": syncer_meta,
        }
        tmp, final, prev = self.dir / "snapshot.tmp", self.dir / "snapshot.bin", self.dir / "snapshot.prev.bin"
        with open(tmp, "wb") as f:
            for b in _frame(_SNAPSHOT, header, tensors):
                f.write(b)
            self._sync(f)
        # A crash between the two renames leaves prev + tmp: restore then uses prev + the logs,
        # which are only compacted after both renames are durable.
        if final.exists() and not self._final_bad:
            os.replace(final, prev)
        os.replace(tmp, final)
        self._final_bad = False
        if self.fsync:
            _fsync_dir(self.dir)
        for meta in frags:
            self._durable[meta["fragment"]] = max(self._durable.get(meta["fragment"], 0), meta["version"])
        self._compact()
        return final

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
            with open(tmp, "wb") as f:
                f.write(data)
                self._sync(f)
            os.replace(tmp, path)
            self._last[p] = (0, end - start)
        if self.fsync:
            _fsync_dir(self.dir)

    # -- reading -------------------------------------------------------------------------------

    def durable_versions(self) -> dict[int, int]:
        """Last durable version per owned fragment (known after ``restore``)."""
        return dict(self._durable)

    def _check_dirs(self) -> None:
        """A run dir written with another number of syncer shards must not look empty."""
        flat = self.root.exists() and any(self.root.glob("frag-*.log")) or (self.root / "snapshot.bin").exists()
        sharded = self.root.exists() and any(self.root.glob("shard-*"))
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
        """Create the state folder with its FORMAT file on the first write."""
        if self._dir_ready:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "FORMAT"
        if not path.exists():
            tmp = self.dir / "FORMAT.tmp"
            tmp.write_text(json.dumps({"format": FORMAT}))
            os.replace(tmp, path)
            if self.fsync:
                _fsync_dir(self.dir)
        self._dir_ready = True

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

    def _scan_log(self, p: int) -> tuple[bytearray, dict[str, Any]] | None:
        """Verify every record of frag-p.log, cut a torn tail; the newest record (buffer, header)."""
        path = self.dir / f"frag-{p}.log"
        buf = bytearray(path.read_bytes())
        pos, newest = 0, None
        while pos < len(buf):
            got = _parse(buf, pos, _RECORD)
            if isinstance(got, str):
                # A crash mid-append leaves a prefix of the last record (or zeros after it on some
                # file systems): anything else is corruption we must not paper over.
                whole = got == "checksum mismatch" and _FRAME.size + _FRAME.unpack_from(buf, pos)[1] + pos == len(buf)
                torn = got.startswith("truncated") or not any(buf[pos:]) or whole
                if not torn:
                    raise StateError(
                        f"{path} is corrupt at byte {pos} ({got}); restore the run dir from a backup or use a "
                        "fresh --run-dir"
                    )
                log.warning("cutting a torn record off %s at byte %d (%s)", path, pos, got)
                with open(path, "r+b") as f:
                    f.truncate(pos)
                    self._sync(f)
                break
            end, header = got
            self._check_layout([header["pieces"]], [p], f"log {path.name}")
            if newest is None or header["meta"]["version"] > newest[1]["meta"]["version"]:
                newest = (buf, header)
                self._last[p] = (pos, end)
            pos = end
        return newest

    def restore(self, layout: FragmentLayout, owned: list[int]) -> Restored | None:
        """Check the folder against ``layout`` and ``owned``, then find the newest valid snapshot
        and the newest record of each fragment log; None for a fresh folder. Call it once,
        before any write."""
        self.signature = _signature(layout)
        self.owned = sorted(owned)
        self._check_dirs()
        self._restored = True
        self._durable = {p: 0 for p in self.owned}
        if not self.dir.exists() or not any(self.dir.iterdir()):
            return None
        self._check_format()
        self._dir_ready = True
        found = Restored()
        seqs: list[tuple[int, dict[str, Any]]] = []
        snap_seq = self._load_snapshot(layout, found)
        if snap_seq is not None and found.syncer_meta is not None:
            seqs.append((snap_seq, found.syncer_meta))
        for path in sorted(self.dir.glob("frag-*.log")):
            p = int(path.stem.removeprefix("frag-"))
            if p not in self.owned:
                raise StateError(
                    f"{path} belongs to fragment {p}, which this syncer shard does not own {self.owned}; use the "
                    "same shards or a fresh --run-dir"
                )
            newest = self._scan_log(p)
            if newest is None:
                continue
            buf, header = newest
            seqs.append((header["seq"], header["syncer"]))
            have = found.fragments.get(p)
            if have is None or header["meta"]["version"] > have.version:
                found.fragments[p] = _decode(_tensors(buf, header), header["meta"], len(layout.fragments[p]))
        if not seqs and not found.fragments:
            return None
        if seqs:
            self._seq, found.syncer_meta = max(seqs, key=lambda x: x[0])
        self._durable.update({p: rec.version for p, rec in found.fragments.items()})
        return found
