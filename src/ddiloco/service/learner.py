"""``ddiloco learner``: one learner process (or one torchrun group with DDP inside).

The training loop runs on the main thread and never waits on the network (``late_fragment =
continue``). A background thread owns the ZeroMQ sockets (one DEALER per syncer shard): it
answers requests from a host-side copy of the parameters and counters taken at step
boundaries, queues received fragments for the training loop to apply between inner steps,
heartbeats, and re-joins with backoff when a syncer goes silent or restarts.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq

from ddiloco.config import Config
from ddiloco.core.fragments import FragmentLayout, make_layout, read_fragment, specs_of, write_fragment
from ddiloco.core.learner import LearnerCore
from ddiloco.core.messages import Ack, Contribution, FragmentRequest, FragmentUpdate, Heartbeat
from ddiloco.errors import DDiLoCoError
from ddiloco.training.inner import inner_step, lr_at, make_optimizer
from ddiloco.service.protocol import Join, JoinReply, Leave, PeerState, PeerStateRequest, SyncerHeartbeat, learner_identity, param_spec
from ddiloco.service.status import write_status
from ddiloco.service.wire import WireError, decode, encode
from ddiloco.workloads.config import load_workload


@dataclass
class HostCopy:
    """Parameters and counters as of the last step boundary (read by the comm thread)."""

    params: dict[str, torch.Tensor]
    base_version: list[int]
    steps: list[int]
    tokens: list[int]
    step: int = 0
    data_position: int = 0


@dataclass
class ShardLink:
    """One connection to a syncer shard and what we know of it."""

    address: str
    sock: Any
    epoch: float | None = None
    last_heard: float = 0.0
    joined: bool = False
    warned: bool = False
    next_join: float = 0.0
    backoff: float = 0.1
    owned: list[int] = field(default_factory=list)


class Learner:
    """A learner process: model, optimizer, data, protocol state, and its comm thread."""

    def __init__(self, cfg: Config, syncers: list[str], learner_id: int, run_dir: str | Path, device: str = "cpu", threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.cfg, self.id, self.run_dir = cfg, learner_id, Path(run_dir)
        # A torchrun group is one learner: ranks run DDP inside it; rank 0 talks to the syncer.
        self.rank, self.world = 0, 1
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch.distributed as dist

            if device.startswith("cuda"):
                device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
                torch.cuda.set_device(torch.device(device))
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            if cfg.algo.late_fragment == "wait":
                raise DDiLoCoError("a multi-rank learner supports algo.late_fragment = 'continue' only; run lock-step baselines with one process per learner")
        self.device = torch.device(device)
        (self.run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        self.wl = load_workload(cfg.workload)
        self.model = self.wl.build_model(cfg.run.seed).to(self.device)
        self.spec = param_spec(self.model)
        self.layout: FragmentLayout = make_layout(specs_of(self.model.named_parameters()), cfg.algo.fixed_fragments, cfg.algo.fragment_strategy, cfg.algo.sync_every)
        self.params = dict(self.model.named_parameters())
        self.opt = make_optimizer(self.model, cfg.inner)
        self.trained = self.model
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.trained = DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.core = LearnerCore(cfg.algo, learner_id, self.layout.num_fragments)
        M = cfg.run.num_learners
        # Each rank reads its own slice of the learner's shard.
        self.stream = self.wl.train_stream((learner_id % M) * self.world + self.rank, M * self.world, cfg.run.seed)
        P = self.layout.num_fragments
        self.host = HostCopy({n: p.detach().to("cpu", copy=True) for n, p in self.params.items()}, [0] * P, [0] * P, [0] * P)
        self.lock = threading.Lock()
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        # The training thread wakes the comm thread through an inproc pair when it queues a
        # message, so the comm thread can sleep in poll instead of spinning on a short timeout.
        ctx = zmq.Context.instance()
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(f"inproc://ddiloco-wake-{id(self)}")
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.connect(f"inproc://ddiloco-wake-{id(self)}")
        self.stop = threading.Event()
        self.syncers = syncers
        self.joined = threading.Event()
        self.data_position: int | None = None
        self.fatal: str | None = None
        self.peer_requests: queue.Queue = queue.Queue()
        self.stats = {"steps": 0, "tokens": 0, "compute_s": 0.0, "blocked_s": 0.0, "loss": None, "applied": 0, "answered": 0, "started": time.time(), "first_step_at": None}
        self._step_ema: float = 0.0

    # -- comm thread -------------------------------------------------------------------------

    def _links(self) -> list[ShardLink]:
        ctx = zmq.Context.instance()
        links = []
        rt = self.cfg.runtime
        for addr in self.syncers:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, learner_identity(self.id))
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)  # do not queue for a syncer that is not connected
            s.setsockopt(zmq.SNDHWM, 64)
            s.setsockopt(zmq.RECONNECT_IVL, int(rt.backoff_initial_s * 1000))
            s.setsockopt(zmq.RECONNECT_IVL_MAX, int(rt.backoff_max_s * 1000))
            s.connect(addr)
            links.append(ShardLink(addr, s, backoff=rt.backoff_initial_s))
        return links

    def _send(self, link: ShardLink, msg: Any) -> bool:
        try:
            link.sock.send_multipart(encode(msg), copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False  # not connected or queue full: the protocol retries, training goes on

    def _join_message(self) -> Join:
        with self.lock:
            bases = list(self.host.base_version) if self.joined.is_set() else []
        return Join(self.id, self.spec, bases, os.getpid(), str(self.device))

    def comm_loop(self) -> None:
        rt = self.cfg.runtime
        links = self._links()
        by_sock = {l.sock: l for l in links}
        poller = zmq.Poller()
        for l in links:
            poller.register(l.sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        last_hb = 0.0
        started = time.monotonic()
        while not self.stop.is_set():
            for sock, _ in poller.poll(int(rt.heartbeat_interval_s * 1000 / 2)):
                if sock is self._wake_rx:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                    continue
                link = by_sock[sock]
                while True:
                    try:
                        frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        self._on_message(link, decode(frames))
                    except WireError as e:
                        print(f"learner {self.id}: dropped a malformed message from {link.address}: {e}", file=sys.stderr, flush=True)
            now = time.monotonic()
            while True:
                try:
                    msg = self.outbox.get_nowait()
                except queue.Empty:
                    break
                for link in self._route(links, msg):
                    self._send(link, msg)
            if now - last_hb >= rt.heartbeat_interval_s:
                last_hb = now
                hb = Heartbeat(self.id, self.core.step, self._step_ema)
                for link in links:
                    if link.joined:
                        self._send(link, hb)
            for link in links:
                silent = now - (link.last_heard or started)
                if link.joined and silent > rt.syncer_liveness_s:
                    link.joined = False
                    link.next_join = now
                    if not link.warned:
                        link.warned = True
                        print(f"learner {self.id}: syncer {link.address} unreachable for {silent:.1f} s; training on and retrying with backoff", file=sys.stderr, flush=True)
                if not link.joined and now >= link.next_join:
                    self._send(link, self._join_message())
                    link.next_join = now + link.backoff
                    link.backoff = min(link.backoff * 2, rt.backoff_max_s)
        for link in links:
            if link.joined:
                try:
                    link.sock.send_multipart(encode(Leave(self.id)), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
            link.sock.close(linger=200)
        self._wake_rx.close(linger=0)

    def _post(self, msg: Any) -> None:
        """Queue a message for the comm thread and wake it (training thread only)."""
        self.outbox.put(msg)
        try:
            self._wake_tx.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is already pending

    def _route(self, links: list[ShardLink], msg: Any) -> list[ShardLink]:
        frag = getattr(msg, "fragment", None)
        if frag is None:
            return [links[0]] if isinstance(msg, (PeerStateRequest, PeerState)) else links
        return [links[frag % len(links)]]

    def _on_message(self, link: ShardLink, msg: Any) -> None:
        link.last_heard = time.monotonic()
        if link.warned and link.joined:
            link.warned = False
        if isinstance(msg, SyncerHeartbeat):
            if link.epoch is not None and msg.epoch != link.epoch and link.joined:
                link.joined = False  # the syncer restarted: register again (keeping our progress)
                link.next_join = 0.0
            elif link.epoch is None and not link.joined:
                link.next_join = 0.0
        elif isinstance(msg, JoinReply):
            if not msg.accepted:
                self.fatal = msg.reason
                self.stop.set()
                return
            link.epoch, link.joined, link.owned = msg.epoch, True, msg.owned
            link.backoff = self.cfg.runtime.backoff_initial_s
            if self.data_position is None:
                self.data_position = msg.data_position
        elif isinstance(msg, FragmentRequest):
            self._answer(link, msg.fragment)
        elif isinstance(msg, FragmentUpdate):
            self.inbox.put(msg)
        elif isinstance(msg, PeerStateRequest):
            self.peer_requests.put(msg.learner)
        elif isinstance(msg, PeerState):
            self.inbox.put(msg)

    def _answer(self, link: ShardLink, p: int) -> None:
        """Answer a request from the host copy: training is never paused for it."""
        self._send(link, self._contribution(p))
        self.stats["answered"] += 1

    def _contribution(self, p: int) -> Contribution:
        """Fragment p's values and counters as of the last step boundary."""
        with self.lock:
            values = read_fragment(self.host.params, self.layout.fragments[p])
            return Contribution(self.id, p, self.host.base_version[p], values, self.host.steps[p], self.host.tokens[p], self.host.data_position, self.host.step)

    # -- training thread ---------------------------------------------------------------------

    def _snapshot(self) -> None:
        with self.lock:
            for n, p in self.params.items():
                self.host.params[n].copy_(p.detach(), non_blocking=False)
            self.host.base_version[:] = self.core.base_version
            self.host.steps[:] = self.core.steps
            self.host.tokens[:] = self.core.tokens
            self.host.step = self.core.step
            self.host.data_position = self.stream.position

    def _drain(self) -> list:
        msgs = []
        while True:
            try:
                msgs.append(self.inbox.get_nowait())
            except queue.Empty:
                return msgs

    def _apply_inbox(self, msgs: list | None = None) -> None:
        for msg in self._drain() if msgs is None else msgs:
            if isinstance(msg, PeerState):
                if msg.source >= 0 and msg.tensors:
                    self._load_peer_state(msg)
                continue
            alpha = self.core.on_update(msg)
            if alpha is None:
                continue
            write_fragment(self.params, self.layout.fragments[msg.fragment], [v.to(self.device) for v in msg.values], alpha)
            self.stats["applied"] += 1
            if self.rank == 0:
                self._post(Ack(self.id, msg.fragment, msg.version))

    def _load_peer_state(self, msg: PeerState) -> None:
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in msg.tensors.items():
            idx, name = key.split(".", 1)
            state.setdefault(int(idx), {})[name] = t.to(self.device) if name != "step" else t
        try:
            self.opt.load_state_dict({"state": state, "param_groups": msg.param_groups})
        except (ValueError, KeyError, RuntimeError) as e:
            print(f"learner {self.id}: ignored peer optimizer state from learner {msg.source}: {e}", file=sys.stderr, flush=True)

    def _serve_peer_requests(self) -> None:
        while True:
            try:
                who = self.peer_requests.get_nowait()
            except queue.Empty:
                return
            sd = self.opt.state_dict()
            tensors = {f"{i}.{k}": v.detach().cpu().clone() for i, st in sd["state"].items() for k, v in st.items() if isinstance(v, torch.Tensor)}
            self._post(PeerState(who, self.id, sd["param_groups"], tensors))

    def _wait_for_join(self) -> None:
        """Take the global state before training (bounded: a dead syncer must not stall us)."""
        deadline = time.monotonic() + self.cfg.runtime.join_timeout_s
        P = self.layout.num_fragments
        got: set[int] = set()
        later: list = []  # peer state is applied once training starts
        while time.monotonic() < deadline and not self.stop.is_set() and len(got) < P:
            try:
                msgs = [self.inbox.get(timeout=0.05), *self._drain()]
            except queue.Empty:
                continue
            updates = [m for m in msgs if isinstance(m, FragmentUpdate)]
            later += [m for m in msgs if not isinstance(m, FragmentUpdate)]
            got.update(m.fragment for m in updates)
            self._apply_inbox(updates)
        for m in later:
            self.inbox.put(m)
        if self.data_position:
            self.stream.seek(self.data_position)
        if len(got) < P:
            print(f"learner {self.id}: got {len(got)}/{P} global fragments within {self.cfg.runtime.join_timeout_s:.0f} s; training on from what it has", file=sys.stderr, flush=True)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.stop.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop.set())
        comm = threading.Thread(target=self.comm_loop, name="ddiloco-comm", daemon=True)
        if self.syncers and self.rank == 0:  # no syncer: a standalone learner (the 'syncing off' reference)
            comm.start()
            self._wait_for_join()
            self._post(PeerStateRequest(self.id))
        self._apply_inbox(self._share_inbox(initial=True) or [])
        self.joined.set()
        self._snapshot()
        rt = self.cfg.runtime
        last_status = 0.0
        step_log = open(self.run_dir / "metrics" / f"steps-{self.id}-{os.getpid()}.csv", "w") if rt.step_log and self.rank == 0 else None
        while not self._should_stop():
            t0 = time.perf_counter()
            batch = self.stream.next_batch()
            batch = type(batch)(batch.inputs.to(self.device), batch.targets.to(self.device), batch.tokens * self.world)
            self.trained.train()
            loss = self.wl.loss(self.trained, batch)
            inner_step(self.model, self.opt, loss, lr_at(self.core.lr_tokens(), self.cfg.run.tokens, self.cfg.inner), self.cfg.inner.grad_clip)
            if rt.step_sleep_s:
                time.sleep(rt.step_sleep_s)
            sends = self.core.on_step(batch.tokens)
            self._apply_inbox(self._share_inbox())
            self._snapshot()
            for p in sends:  # lock-step baselines push on their own schedule
                self.core.answer(p)
                self._post(self._contribution(p))
            dt = time.perf_counter() - t0
            self._block_if_lock_step()
            self._serve_peer_requests()
            self._step_ema = dt if self._step_ema == 0 else 0.9 * self._step_ema + 0.1 * dt
            s = self.stats
            s["steps"] += 1
            s["tokens"] += batch.tokens
            s["compute_s"] += dt
            s["loss"] = float(loss.detach())
            if s["first_step_at"] is None:
                s["first_step_at"] = time.time()
            if step_log is not None:
                step_log.write(f"{time.time():.6f},{dt:.6f}\n")
            if time.monotonic() - last_status >= rt.status_interval_s and self.rank == 0:
                last_status = time.monotonic()
                self.write_status()
                if step_log is not None:
                    step_log.flush()
        self.write_status()
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
        if step_log is not None:
            step_log.close()
        if comm.is_alive():
            comm.join(timeout=2.0)
        self._wake_tx.close(linger=0)
        if self.fatal:
            print(f"error: learner {self.id} refused by the syncer: {self.fatal}", file=sys.stderr, flush=True)
            return 3
        return 0

    def _should_stop(self) -> bool:
        """Ranks of one learner stop at the same step: rank 0's decision is shared."""
        if self.world == 1:
            return self.stop.is_set()
        import torch.distributed as dist

        flag = torch.tensor([1 if self.stop.is_set() else 0], device=self.device if self.device.type == "cuda" else "cpu")
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _share_inbox(self, initial: bool = False) -> list | None:
        """Rank 0 broadcasts the fragments (and peer state) it received, so every rank applies
        the same ones at the same step. Inside a learner a collective is fine: it is one
        failure domain."""
        if self.world == 1:
            return None  # a single process applies straight from its inbox
        import torch.distributed as dist

        msgs: list = self._drain() if self.rank == 0 else []
        box = [msgs, (self.data_position, dict(vars(self.core))) if initial else None]
        dist.broadcast_object_list(box, src=0)
        if initial:
            # rank 0 applied the global state it fetched on join: every rank starts from it
            with torch.no_grad():
                for prm in self.model.parameters():
                    dist.broadcast(prm.data, src=0)
            if self.rank != 0:
                position, core_state = box[1]
                vars(self.core).update(core_state)  # counters, base versions, LR position
                if position:
                    self.stream.seek(position)
        return box[0]

    def _block_if_lock_step(self) -> None:
        t0 = time.perf_counter()
        while not self.stop.is_set() and self.core.blocking_fragments(time.time()):
            try:
                msg = self.inbox.get(timeout=0.01)
            except queue.Empty:
                continue
            self.inbox.put(msg)
            self._apply_inbox()
            self._snapshot()
        self.stats["blocked_s"] += time.perf_counter() - t0 if self.cfg.algo.late_fragment == "wait" else 0.0

    def write_status(self) -> None:
        name = f"learner-{self.id}" if self.rank == 0 else f"learner-{self.id}.rank{self.rank}"
        checksum = float(sum(p.detach().double().sum() for p in self.model.parameters()))
        write_status(self.run_dir / "status" / f"{name}.json", {"rank": self.rank, "world": self.world, "param_checksum": checksum, "learner": self.id, "pid": os.getpid(), "time": time.time(), "step_time_ema": self._step_ema, "base_versions": list(self.core.base_version), "pending_steps": sum(self.core.steps) / len(self.core.steps), **self.stats})


def run_learner(cfg: Config, syncers: list[str], learner_id: int, run_dir: str, device: str, threads: int) -> int:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DDiLoCoError(f"--device {device} requested but CUDA is not available here; use --device cpu")
    return Learner(cfg, syncers, learner_id, run_dir, device, threads).run()
