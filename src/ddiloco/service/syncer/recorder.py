"""The syncer's flight recorder: what its session is handed, to replay an incident exactly.

With ``runtime.record_mb > 0`` each syncer shard writes, per start, one file
``RUN_DIR/recordings/syncer-SHARD-EPOCH.rec``: first the session's state as it starts (the
config, the layout, every owned fragment's values and outer momentum, the meta state, the
epoch and the run's age), then every input in order: each message the session receives (its
frames exactly as they arrived, the sender's transport identity and its key's role) and each
tick, with the time the session was given. A session is a pure function of these, so
``replay`` feeds them, at their recorded times, to a fresh ``SyncerSession`` built from that
state, and it decides exactly what the live one decided (rounds, merges, versions, refusals).

The file is bounded: once it would pass ``record_mb`` MiB a last "cut" record says so and the
recording stops (the replay then covers the run up to there). A file read back is not trusted:
every length is bounded and every header checked; a damaged file is one clear error.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import tomli_w
import tomllib
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ddiloco.config import load_config, to_dict
from ddiloco.core.fragments import TensorSpec, make_layout
from ddiloco.core.syncer import FragmentRecord, Syncer
from ddiloco.errors import DDiLoCoError
from ddiloco.protocol.learner_session import Registration
from ddiloco.protocol.syncer_session import Budget, Principal, SyncerOutput, SyncerSession

log = logging.getLogger(__name__)

MAGIC = b"DDFR"
VERSION = 1
"""Version of the recording format; another is refused."""
_LEN = struct.Struct("<I")
_FRAME = struct.Struct("<Q")
MAX_HEADER = 16 << 20
"""Largest record header a reader takes (the start record's holds the config and layout)."""
MAX_FRAMES = 4096
MAX_FRAME = 1 << 34


class RecordingError(DDiLoCoError):
    """A recording that cannot be read back (damaged, truncated, another format)."""


class _Off:
    """The recorder when recording is off: every call does nothing."""

    def receive(self, t: float, identity: bytes, principal: Principal | None, frames: list[Any]) -> None:
        pass

    def tick(self, t: float) -> None:
        pass

    def close(self) -> None:
        pass


class FlightRecorder:
    """Appends a session's inputs to its recording until the size bound."""

    def __init__(self, path: Path, limit_bytes: int) -> None:
        self.path = path
        self.limit = limit_bytes
        self.written = 0
        self._f: IO[bytes] | None = open(path, "wb")  # noqa: SIM115 (closed by close())
        self._f.write(MAGIC + _LEN.pack(VERSION))

    @staticmethod
    def open(run_dir: Path, shard: int, record_mb: float, session: SyncerSession, now: float) -> FlightRecorder | _Off:
        """Start recording ``session`` as it is at ``now`` (off when ``record_mb`` is 0)."""
        if record_mb <= 0:
            return _Off()
        folder = run_dir / "recordings"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            rec = FlightRecorder(folder / f"syncer-{shard}-{session.epoch}.rec", int(record_mb * (1 << 20)))
            rec._start(session, now)
        except OSError as e:
            log.warning("cannot record the syncer's inputs in %s (%s); going on without the flight recorder", folder, e)
            return _Off()
        log.info("flight recorder: %s (up to %g MiB)", rec.path, record_mb)
        return rec

    def _start(self, session: SyncerSession, now: float) -> None:
        core = session.core
        tensors: dict[str, torch.Tensor] = {}
        versions = {}
        for rec in session.records(core.owned):
            versions[str(rec.fragment)] = [rec.version, rec.tokens_merged, rec.momentum is not None]
            for i, v in enumerate(rec.values):
                tensors[f"v{rec.fragment}.{i}"] = v.contiguous()
            for i, m in enumerate(rec.momentum or []):
                tensors[f"m{rec.fragment}.{i}"] = m.contiguous()
        header = {
            "kind": "start",
            "t": now,
            "config": tomli_w.dumps(_config_of(session)),
            "params": session.registration.params,
            "layout": session.registration.layout,
            "embedding_like": core.embedding_like(),
            "owned": core.owned,
            "sketch_seed": core.sketch_seed,
            "shard": session.shard,
            "epoch": session.epoch,
            "run": session.run,
            "age_s": session.run_age(now),
            "ended": session.end_reason if session.end_stage == "done" else None,
            "keyed": session.keyed,
            "budget": [
                session.budget.processed_tokens,
                session.budget.merged_tokens,
                session.budget.time_s,
                session.budget.time_key,
            ],
            "versions": versions,
            "meta": session.meta(),
        }
        self._write(header, [st_save(tensors)])

    def receive(self, t: float, identity: bytes, principal: Principal | None, frames: list[Any]) -> None:
        role = None if principal is None else [principal.role, principal.learner]
        self._write({"kind": "recv", "t": t, "peer": identity.hex(), "principal": role}, frames)

    def tick(self, t: float) -> None:
        self._write({"kind": "tick", "t": t}, [])

    def _write(self, header: dict[str, Any], frames: list[Any]) -> None:
        f = self._f
        if f is None:
            return
        raw = [bytes(fr.buffer if hasattr(fr, "buffer") else fr) for fr in frames]
        head = json.dumps(header, allow_nan=True).encode()
        size = _LEN.size * 2 + len(head) + sum(_FRAME.size + len(b) for b in raw)
        try:
            if self.written + size > self.limit:
                cut = json.dumps({"kind": "cut", "t": header.get("t"), "reason": "runtime.record_mb reached"}).encode()
                f.write(_LEN.pack(len(cut)) + cut + _LEN.pack(0))
                log.warning("flight recorder: %s reached runtime.record_mb; recording stops here", self.path)
                self.close()
                return
            f.write(_LEN.pack(len(head)) + head + _LEN.pack(len(raw)))
            for b in raw:
                f.write(_FRAME.pack(len(b)) + b)
            self.written += size
        except OSError as e:
            log.warning("flight recorder: cannot write %s (%s); recording stops", self.path, e)
            self.close()

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None


def _config_of(session: SyncerSession) -> dict[str, Any]:
    from ddiloco.config import Config

    return to_dict(Config(algo=session.core.cfg, runtime=session.rt))


# -- reading back -----------------------------------------------------------------------------


@dataclass
class Record:
    """One record of a recording."""

    header: dict[str, Any]
    frames: list[bytes] = field(default_factory=list)


def read_recording(path: str | Path) -> list[Record]:
    """Every record of a recording, checked (a damaged or truncated one raises RecordingError)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise RecordingError(f"cannot read the recording {p}: {e}") from None
    if data[:4] != MAGIC or len(data) < 8:
        raise RecordingError(f"{p} is not a ddiloco flight recording")
    (version,) = _LEN.unpack_from(data, 4)
    if version != VERSION:
        raise RecordingError(f"{p} is a recording of format {version}; this ddiloco reads format {VERSION}")
    pos, out = 8, []

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise RecordingError(f"{p} is truncated or damaged at byte {pos} ({what})")
        pos += n
        return data[pos - n : pos]

    while pos < len(data):
        (hlen,) = _LEN.unpack(take(_LEN.size, "header length"))
        if hlen > MAX_HEADER:
            raise RecordingError(f"{p}: a record header of {hlen} bytes at byte {pos} (at most {MAX_HEADER})")
        try:
            header = json.loads(take(hlen, "header"))
        except ValueError:
            raise RecordingError(f"{p}: a record header at byte {pos} is not JSON") from None
        if not isinstance(header, dict) or header.get("kind") not in ("start", "recv", "tick", "cut"):
            raise RecordingError(f"{p}: an unknown record at byte {pos}")
        (count,) = _LEN.unpack(take(_LEN.size, "frame count"))
        if count > MAX_FRAMES:
            raise RecordingError(f"{p}: {count} frames in one record at byte {pos} (at most {MAX_FRAMES})")
        frames = []
        for _ in range(count):
            (n,) = _FRAME.unpack(take(_FRAME.size, "frame length"))
            if n > MAX_FRAME:
                raise RecordingError(f"{p}: a frame of {n} bytes at byte {pos}")
            frames.append(take(n, "frame"))
        out.append(Record(header, frames))
    if not out or out[0].header["kind"] != "start" or len(out[0].frames) != 1:
        raise RecordingError(f"{p} does not begin with the session's start state")
    return out


@dataclass
class Replay:
    """A recorded session run again: the session as it ended, and each call's output."""

    session: SyncerSession
    outputs: list[SyncerOutput]
    cut: bool
    """The recording stopped at its size bound (the replay covers the run up to there)."""

    @property
    def tape(self) -> list[dict[str, Any]]:
        """Every tape record the replayed session produced, as ``tape.jsonl`` holds them."""
        return [r.to_json() for out in self.outputs for r in out.tape]


def replay(path: str | Path) -> Replay:
    """Build the session as the recording's start state says, then hand it every recorded input
    at its recorded time (virtual time: no clock is read)."""
    from ddiloco.service.base.wire import WireError, decode

    records = read_recording(path)
    start = records[0].header
    try:
        cfg = load_config(None, None, base=tomllib.loads(start["config"]))
        specs = [TensorSpec(str(n), tuple(int(d) for d in shape)) for n, shape in start["params"]]
        layout = make_layout(specs, cfg.algo.fixed_fragments, cfg.algo.fragment_strategy, cfg.algo.sync_every)
        owned = [int(p) for p in start["owned"]]
        initial = {s.name: torch.zeros(s.shape) for s in specs}
        seed = int(start.get("sketch_seed", 0))  # (a recording made before the drift history has none)
        core = Syncer(cfg.algo, layout, initial, [bool(x) for x in start["embedding_like"]], owned, sketch_seed=seed)
        tensors = st_load(records[0].frames[0])
        found = {}
        for key, (version, tokens, has_momentum) in start["versions"].items():
            p = int(key)
            n = len(layout.fragments[p])
            values = [tensors[f"v{p}.{i}"] for i in range(n)]
            momentum = [tensors[f"m{p}.{i}"] for i in range(n)] if has_momentum else None
            found[p] = FragmentRecord(p, int(version), int(tokens), values, momentum)
        processed, merged, time_s, time_key = start["budget"]
        budget = Budget(float(processed), float(merged), float(time_s), str(time_key))
        session = SyncerSession(
            core, cfg.runtime, budget, Registration(start["params"], str(start["layout"])), float(start["t"]),
            shard=int(start["shard"]), epoch=int(start["epoch"]), age_s=float(start["age_s"]),
            ended=start["ended"], keyed=bool(start["keyed"]), run=str(start.get("run", "")),
        )  # fmt: skip
        session.restore(found, start["meta"])
    except (KeyError, TypeError, ValueError, IndexError, SafetensorError) as e:
        raise RecordingError(f"{path}: its start state is damaged ({type(e).__name__}: {e})") from None
    outputs: list[SyncerOutput] = []
    cut = False
    for rec in records[1:]:
        h = rec.header
        if h["kind"] == "cut":
            cut = True
            break
        try:
            t = float(h["t"])
            if h["kind"] == "tick":
                outputs.append(session.tick(t))
                continue
            msg = decode(rec.frames)
            role = h.get("principal")
            principal = None if role is None else Principal(role[0], role[1])
            peer = bytes.fromhex(h["peer"])
        except WireError as e:
            raise RecordingError(f"{path}: a recorded message does not decode: {e}") from None
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise RecordingError(f"{path}: a record's header is damaged ({type(e).__name__}: {e})") from None
        outputs.append(session.receive(peer, msg, t, principal))
    return Replay(session, outputs, cut)
