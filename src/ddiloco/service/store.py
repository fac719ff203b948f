"""Durable syncer state: per-fragment append-only logs, whole-state snapshots, the event tape.

Layout of ``RUN_DIR/state/`` (``RUN_DIR/state/shard-{i}/`` when there are several syncer shards):

- ``frag-{p}.log``: one record per durable version of fragment p. Each record is the fragment's
  *full* state (values, outer momentum, counters) plus the syncer's meta state, so the newest
  valid record alone restores the fragment; older records only matter until the next snapshot.
- ``snapshot.bin`` / ``snapshot.prev.bin``: every owned fragment, the meta state, the layout
  signature and the owned list, written to a temp file and renamed into place.
- ``tape.jsonl``: the event tape, one JSON object a line.

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
from pathlib import Path
from typing import Any

import torch

from ddiloco.core.syncer import Syncer
from ddiloco.errors import DDiLoCoError

log = logging.getLogger(__name__)

_FRAME = struct.Struct("<4sQI")  # magic, body length, crc32 of the body
_JLEN = struct.Struct("<I")
_RECORD, _SNAPSHOT = b"DDLR", b"DDLS"
_FORMAT = 1
# Only these dtypes may be named in a file; the name is never eval'd or used to import anything.
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


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
    js = json.dumps({**header, "format": _FORMAT, "tensors": entries}).encode()
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


def _tensors(buf: bytearray, header: dict[str, Any]) -> Tensors:
    out, off = {}, header["_data"]
    for name, dtype, shape, nbytes in header["tensors"]:
        dt = _DTYPES[dtype]
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=dt)
        else:  # clone first: frombuffer at an odd offset may be misaligned for the dtype
            out[name] = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=off).clone().view(dt).reshape(shape)
        off += nbytes
    return out


def _signature(syncer: Syncer) -> list[list[list[Any]]]:
    """The layout signature split per fragment, as JSON gives it back (lists, not tuples)."""
    flat = [[n, a, b, list(s)] for n, a, b, s in syncer.layout.signature()]
    out = []
    for pieces in syncer.layout.fragments:
        out.append(flat[: len(pieces)])
        flat = flat[len(pieces) :]
    return out


class SyncerStore:
    """Durable syncer state in RUN_DIR/state/ (per shard: RUN_DIR/state/shard-{i}/ when num_shards > 1).

    Call ``restore`` once at start-up (it returns False on a fresh dir), then ``append`` every new
    version before sending it anywhere, ``append_tape`` as the tape grows, ``snapshot`` now and then.
    """

    def __init__(self, run_dir: str | Path, shard: int = 0, num_shards: int = 1, fsync: bool = True) -> None:
        if not 0 <= shard < num_shards:
            raise StateError(f"syncer shard {shard} is out of range for {num_shards} shards; allowed: 0..{num_shards - 1}")
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

    # -- writing -------------------------------------------------------------------------------

    def _sync(self, f: Any) -> None:
        f.flush()
        if self.fsync:
            os.fsync(f.fileno())

    def _need_restore(self) -> None:
        if not self._restored:  # else we could append after a torn tail or reuse sequence numbers
            raise RuntimeError("SyncerStore.restore(syncer) must be called once before append or snapshot")

    def append(self, syncer: Syncer, p: int) -> None:
        """Make fragment p's current state durable (one record in frag-{p}.log, fsynced) before
        returning. A version that is already durable is not written again."""
        self._need_restore()
        if p not in syncer.owned:
            raise ValueError(f"fragment {p} is not owned by this syncer shard (owned: {syncer.owned})")
        tensors, meta = syncer.fragment_state(p)
        if meta["version"] <= self._durable.get(p, -1):
            return
        self._seq += 1
        pieces = _frame(_RECORD, {"seq": self._seq, "meta": meta, "syncer": syncer.meta_state(), "pieces": _signature(syncer)[p]}, tensors)
        path = self.dir / f"frag-{p}.log"
        new = not path.exists()
        self.dir.mkdir(parents=True, exist_ok=True)
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
        self._durable[p] = meta["version"]

    def append_tape(self, records: list[dict]) -> None:
        """Append JSON lines to tape.jsonl and fsync them."""
        if not records:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
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

    def read_tape(self) -> list[dict]:
        """The durable tape (a torn last line is skipped)."""
        path = self.dir / "tape.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_bytes().split(b"\n") if line.strip() and self._json_ok(line)]

    @staticmethod
    def _json_ok(line: bytes) -> bool:
        try:
            json.loads(line)
            return True
        except ValueError:
            return False

    def snapshot(self, syncer: Syncer) -> Path:
        """Write every owned fragment + meta state atomically to snapshot.bin (the previous one
        becomes snapshot.prev.bin), then compact the fragment logs."""
        self._need_restore()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        self._snap_no += 1
        tensors: Tensors = {}
        frags = []
        for p in syncer.owned:
            ts, meta = syncer.fragment_state(p)
            tensors.update({f"{p}/{k}": v for k, v in ts.items()})
            frags.append(meta)
        header = {"snapshot": self._snap_no, "seq": self._seq, "signature": _signature(syncer), "owned": list(syncer.owned), "fragments": frags, "syncer": syncer.meta_state()}
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
            raise StateError(f"{self.root} was written by {other}, not {self.num_shards}; use the same number of shards or a fresh --run-dir")

    def _check_layout(self, saved: list, syncer: Syncer, fragments: list[int], what: str) -> None:
        mine = _signature(syncer)
        for p, pieces in zip(fragments, saved):
            ours = mine[p] if p < len(mine) else []
            for i in range(max(len(pieces), len(ours))):
                a = pieces[i] if i < len(pieces) else None
                b = ours[i] if i < len(ours) else None
                if a != b:
                    desc = lambda x: "nothing" if x is None else f"{x[0]!r} rows {x[1]}:{x[2]} shape {tuple(x[3])}"  # noqa: E731
                    raise StateError(f"{what} in {self.dir} holds a different model layout: fragment {p} piece {i} is {desc(a)} there but {desc(b)} here; use a fresh --run-dir")

    def _load_snapshot(self, syncer: Syncer) -> tuple[int, dict[str, Any]] | None:
        """Load the newest snapshot that verifies into ``syncer``: (seq, its meta state)."""
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
            if len(sig) != syncer.layout.num_fragments:
                raise StateError(f"snapshot in {self.dir} has {len(sig)} fragments, this model {syncer.layout.num_fragments}; use a fresh --run-dir")
            self._check_layout(sig, syncer, list(range(len(sig))), "snapshot")
            if header["owned"] != list(syncer.owned):
                raise StateError(f"{self.dir} belongs to a syncer shard owning fragments {header['owned']}, this one owns {list(syncer.owned)}; use the same shards or a fresh --run-dir")
            tensors = _tensors(buf, header)
            for meta in header["fragments"]:
                p = meta["fragment"]
                if meta["version"] >= syncer.fragments[p].version:
                    prefix = f"{p}/"
                    syncer.load_fragment_state({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}, meta)
            self._snap_no = header["snapshot"]
            return header["seq"], header["syncer"]
        return None

    def _scan_log(self, p: int, syncer: Syncer) -> tuple[bytearray, dict[str, Any]] | None:
        """Verify every record of frag-p.log, cut a torn tail; the newest record (buffer, header)."""
        path = self.dir / f"frag-{p}.log"
        buf = bytearray(path.read_bytes())
        pos, newest = 0, None
        while pos < len(buf):
            got = _parse(buf, pos, _RECORD)
            if isinstance(got, str):
                # A crash mid-append leaves a prefix of the last record (or zeros after it on some
                # file systems): anything else is corruption we must not paper over.
                torn = got.startswith("truncated") or not any(buf[pos:]) or (got == "checksum mismatch" and _FRAME.size + _FRAME.unpack_from(buf, pos)[1] + pos == len(buf))
                if not torn:
                    raise StateError(f"{path} is corrupt at byte {pos} ({got}); restore the run dir from a backup or use a fresh --run-dir")
                log.warning("cutting a torn record off %s at byte %d (%s)", path, pos, got)
                with open(path, "r+b") as f:
                    f.truncate(pos)
                    self._sync(f)
                break
            end, header = got
            self._check_layout([header["pieces"]], syncer, [p], f"log {path.name}")
            if newest is None or header["meta"]["version"] > newest[1]["meta"]["version"]:
                newest = (buf, header)
                self._last[p] = (pos, end)
            pos = end
        return newest

    def restore(self, syncer: Syncer) -> bool:
        """Load the newest valid snapshot, then the newest record of each fragment log that is
        newer; returns True when any state was restored. Meant for a freshly built syncer (its
        meta state is overwritten); a fragment state older than the syncer's is never loaded."""
        self._check_dirs()
        self._restored = True
        self._durable = {p: syncer.fragments[p].version for p in syncer.owned}
        if not self.dir.exists():
            return False
        found = False
        metas: list[tuple[int, dict[str, Any]]] = []
        snap = self._load_snapshot(syncer)
        if snap is not None:
            found = True
            metas.append(snap)
        for path in sorted(self.dir.glob("frag-*.log")):
            p = int(path.stem.removeprefix("frag-"))
            if p not in syncer.owned:
                raise StateError(f"{path} belongs to fragment {p}, which this syncer shard does not own {list(syncer.owned)}; use the same shards or a fresh --run-dir")
            newest = self._scan_log(p, syncer)
            if newest is None:
                continue
            buf, header = newest
            found = True
            metas.append((header["seq"], header["syncer"]))
            if header["meta"]["version"] > syncer.fragments[p].version:
                syncer.load_fragment_state(_tensors(buf, header), header["meta"])
        if metas:
            seq, meta = max(metas, key=lambda x: x[0])
            syncer.load_meta_state(meta)
            self._seq = seq
        self._durable = {p: syncer.fragments[p].version for p in syncer.owned}
        return found
