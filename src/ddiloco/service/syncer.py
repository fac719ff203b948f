"""``ddiloco syncer``: the core syncer driven by ZeroMQ messages and the wall clock.

One CPU-only process per shard. A ROUTER socket talks to every learner (DEALER) and observer.
Every merged version is appended to its fragment's log and fsynced *before* it is sent to
anyone; periodic snapshots make restarts fast. Malformed or unknown messages are counted and
dropped; nothing a peer sends can crash the service.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from ddiloco.config import Config
from ddiloco.core.fragments import make_layout, specs_of
from ddiloco.core.messages import Ack, Contribution, FragmentUpdate, Heartbeat
from ddiloco.core.syncer import Syncer
from ddiloco.errors import DDiLoCoError
from ddiloco.service.store import SyncerStore
from ddiloco.service.protocol import FetchGlobal, GlobalState, Join, JoinReply, Leave, PeerState, PeerStateRequest, SyncerHeartbeat, param_spec
from ddiloco.service.status import write_status
from ddiloco.service.wire import WireError, decode, encode
from ddiloco.workloads.config import load_workload

LEARNER_MESSAGES = (Heartbeat, Contribution, Ack, Leave, PeerStateRequest, PeerState)


def first_mismatch(ours: list[list[Any]], theirs: list[list[Any]]) -> str | None:
    """A one-line description of the first tensor where two models differ, or None."""
    for i in range(max(len(ours), len(theirs))):
        a = ours[i] if i < len(ours) else None
        b = theirs[i] if i < len(theirs) else None
        if a != b:
            if a is None:
                return f"learner has an extra tensor {b[0]} {tuple(b[1])}"
            if b is None:
                return f"learner lacks tensor {a[0]} {tuple(a[1])}"
            return f"tensor #{i}: learner has {b[0]} {tuple(b[1])}, syncer has {a[0]} {tuple(a[1])}"
    return None


class SyncerService:
    """Owns the socket, the core syncer, the durable store and the periodic chores."""

    def __init__(self, cfg: Config, bind: str, run_dir: str | Path, shard: int = 0, num_shards: int = 1) -> None:
        if not 0 <= shard < num_shards:
            raise DDiLoCoError(f"--shard {shard} is out of range for --num-shards {num_shards}; use 0 .. {num_shards - 1}")
        torch.set_num_threads(1)
        self.cfg, self.run_dir, self.shard, self.num_shards = cfg, Path(run_dir), shard, num_shards
        wl = load_workload(cfg.workload)
        model = wl.build_model(cfg.run.seed)
        self.spec = param_spec(model)
        layout = make_layout(specs_of(model.named_parameters()), cfg.algo.fixed_fragments, cfg.algo.fragment_strategy, cfg.algo.sync_every)
        emb = [wl.is_embedding_like(pc.name) for frag in layout.fragments for pc in frag]
        owned = [p for p in range(layout.num_fragments) if p % num_shards == shard]
        if not owned:
            raise DDiLoCoError(f"shard {shard} of {num_shards} owns no fragment (the model has {layout.num_fragments}); use fewer shards")
        self.core = Syncer(cfg.algo, layout, dict(model.named_parameters()), emb, owned)
        self.model = model
        self.store = SyncerStore(self.run_dir, shard, num_shards)
        self.restored = self.store.restore(self.core)
        self.tape_written = len(self.core.tape)
        self.epoch = time.time()
        self.identities: dict[int, bytes] = {}
        self.counts = {"malformed": 0, "unknown_sender": 0, "merges": 0, "messages": 0, "bytes_in": 0}
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted learner takes over its identity
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        try:
            self.sock.bind(bind)
        except zmq.ZMQError as e:
            self.sock.close()
            raise DDiLoCoError(f"cannot bind the syncer to {bind}: {e.strerror} (is the port in use? pass another --bind)") from None
        self.bind = bind
        self.stopping = False
        self._last_snapshot = time.monotonic()
        self._last_status = 0.0
        self._last_heartbeat = 0.0
        self.started = time.time()
        self._warned: set[str] = set()

    # -- sending ---------------------------------------------------------------------------

    def _send(self, identity: bytes, msg: Any) -> None:
        try:
            self.sock.send_multipart([identity, *encode(msg)], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # the peer's queue is full (it is gone or stuck): liveness will drop it

    def _emit(self, outs: list) -> None:
        """Make new versions durable, then send (the order matters: never send what could be lost)."""
        fresh = {p for p, _ in self.core.new_versions}
        self.core.new_versions.clear()
        for p in sorted(fresh):
            self.store.append(self.core, p)
        self.counts["merges"] += len(fresh)
        if len(self.core.tape) > self.tape_written:
            self.store.append_tape(self.core.tape[self.tape_written :])
            self.tape_written = len(self.core.tape)
        for o in outs:
            identity = self.identities.get(o.learner)
            if identity is not None:
                self._send(identity, o)

    # -- receiving -------------------------------------------------------------------------

    def _handle(self, frames: list) -> None:
        identity = frames[0].bytes
        self.counts["messages"] += 1
        self.counts["bytes_in"] += sum(len(f) for f in frames[1:])
        try:
            msg = decode(frames[1:])
        except WireError as e:
            self._count_bad("malformed", f"malformed message from {identity!r}: {e}")
            return
        now = time.time()
        if isinstance(msg, Join):
            self._on_join(identity, msg, now)
        elif isinstance(msg, FetchGlobal):
            self._send(identity, self._global_state())
        elif isinstance(msg, LEARNER_MESSAGES):
            claimed = getattr(msg, "learner", None) if not isinstance(msg, PeerState) else msg.source
            if self.identities.get(claimed) != identity:
                # Unknown here (e.g. this syncer restarted): a heartbeat with our epoch makes it re-join.
                self._count_bad("unknown_sender", f"message from unregistered sender {identity!r} claiming learner {claimed}")
                self._send(identity, SyncerHeartbeat(self.epoch, self.shard))
                return
            self._on_learner_message(msg, now)
        else:
            self._count_bad("malformed", f"unexpected {type(msg).__name__} from {identity!r}")

    def _count_bad(self, kind: str, text: str) -> None:
        self.counts[kind] += 1
        if kind not in self._warned:  # say it once per kind; the status file keeps counting
            self._warned.add(kind)
            print(f"syncer: {text} (dropped; further ones are counted silently)", file=sys.stderr, flush=True)

    def _on_join(self, identity: bytes, msg: Join, now: float) -> None:
        mismatch = first_mismatch(self.spec, msg.params)
        if mismatch is not None:
            self._send(identity, JoinReply(False, f"model does not match the syncer's fragment layout: {mismatch}", self.epoch, 0, self.core.owned))
            return
        self.identities[msg.learner] = identity
        outs = self.core.on_join(msg.learner, now)
        info = self.core.learners[msg.learner]
        self._send(identity, JoinReply(True, "", self.epoch, info.data_position, self.core.owned))
        have = dict(enumerate(msg.base_versions))
        # A learner that already holds the current version of a fragment (e.g. after a syncer
        # restart) keeps its local progress; only what it lacks is sent.
        outs = [o for o in outs if not (isinstance(o, FragmentUpdate) and o.reason == "join" and have.get(o.fragment) == o.version)]
        self._emit(outs)

    def _on_learner_message(self, msg: Any, now: float) -> None:
        if isinstance(msg, Heartbeat):
            self._emit(self.core.on_heartbeat(msg, now))
        elif isinstance(msg, Contribution):
            self._emit(self.core.on_contribution(msg, now))
        elif isinstance(msg, Ack):
            self.core.on_ack(msg, now)
        elif isinstance(msg, Leave):
            self._emit(self.core.on_leave(msg.learner, now))
        elif isinstance(msg, PeerStateRequest):
            peers = [m for m in self.core.live(now) if m != msg.learner and m in self.identities]
            if peers:
                self._send(self.identities[peers[0]], msg)
            else:
                self._send(self.identities[msg.learner], PeerState(msg.learner, -1, [], {}))
        elif isinstance(msg, PeerState):
            target = self.identities.get(msg.learner)
            if target is not None:
                self._send(target, msg)

    def _global_state(self) -> GlobalState:
        tensors = {}
        for p in self.core.owned:
            for i, v in enumerate(self.core.fragments[p].values):
                tensors[f"{p}.{i}"] = v
        versions = {str(p): self.core.fragments[p].version for p in self.core.owned}
        return GlobalState(versions, self.core.global_tokens, tensors)

    # -- the loop --------------------------------------------------------------------------

    def serve(self, max_seconds: float | None = None) -> None:
        """Run until SIGTERM/SIGINT (or ``max_seconds``), then flush, persist and exit."""
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        rt = self.cfg.runtime
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        end = None if max_seconds is None else time.monotonic() + max_seconds
        print(f"syncer shard {self.shard}/{self.num_shards} on {self.bind}: {len(self.core.owned)} fragments, versions {'restored' if self.restored else 'fresh'}", file=sys.stderr, flush=True)
        while not self.stopping and (end is None or time.monotonic() < end):
            now = time.time()
            deadline = self.core.next_deadline(now)
            wait = min(0.05, rt.heartbeat_interval_s, max(0.0, (deadline - now)) if deadline is not None else 0.05)
            if poller.poll(int(wait * 1000)):
                for _ in range(1000):  # drain what is queued, bounded so chores still run
                    try:
                        frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
            self._emit(self.core.poll(time.time()))
            self._chores(rt)
        self.shutdown()

    def _chores(self, rt: Any) -> None:
        mono = time.monotonic()
        if mono - self._last_heartbeat >= rt.heartbeat_interval_s:
            self._last_heartbeat = mono
            for identity in self.identities.values():
                self._send(identity, SyncerHeartbeat(self.epoch, self.shard))
        if mono - self._last_snapshot >= rt.snapshot_interval_s:
            self._last_snapshot = mono
            self.store.snapshot(self.core)
        if mono - self._last_status >= rt.status_interval_s:
            self._last_status = mono
            self.write_status()

    def write_status(self) -> None:
        now = time.time()
        status = {
            "shard": self.shard, "time": now, "epoch": self.epoch, "pid": os.getpid(),
            "versions": {p: self.core.fragments[p].version for p in self.core.owned},
            "live": self.core.live(now), "global_tokens": self.core.global_tokens,
            "cpu_s": time.process_time(), "wall_s": now - self.started, **self.counts,
        }
        write_status(self.run_dir / "status" / f"syncer-{self.shard}.json", status)

    def shutdown(self) -> None:
        """Close open rounds, make everything durable, write the final model, close the socket."""
        self._emit(self.core.flush(time.time()))
        self.store.snapshot(self.core)
        self.write_status()
        self.write_final_model()
        self.sock.close(0)

    def write_final_model(self) -> Path:
        from safetensors.torch import save_file

        state = self.core.global_state()
        owned_names = {pc.name for p in self.core.owned for pc in self.core.layout.fragments[p]}
        full = {k: v for k, v in self.model.state_dict().items()}
        full.update({k: v for k, v in state.items() if k in owned_names})
        name = "model.safetensors" if self.num_shards == 1 else f"model.shard-{self.shard}.safetensors"
        path = self.run_dir / "final" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in full.items() if self.num_shards == 1 or k in owned_names}, str(path))
        return path

