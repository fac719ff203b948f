"""``ddiloco learner``: one learner process (or one torchrun group with DDP inside).

The training loop runs on the main thread and never waits on the network (``late_fragment =
continue``). At each step boundary it applies the fragments that arrived, answers requests the
comm thread could not answer itself, and prepares the contributions the schedule says will be
asked for next: only those fragments are copied to the host, never the whole model. The comm
thread (``learner_comm``) does all the talking.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

from ddiloco.config import Config
from ddiloco.core.fragments import write_fragment
from ddiloco.core.learner import LearnerCore
from ddiloco.core.messages import Ack, Contribution, FragmentUpdate
from ddiloco.errors import DDiLoCoError
from ddiloco.report.rundir import prepare_run_dir
from ddiloco.service.clock import SYSTEM_CLOCK, Clock
from ddiloco.service.keys import ClientKeys, is_local
from ddiloco.service.learner_comm import LearnerComm, Progress
from ddiloco.service.peer_state import load_state, state_message
from ddiloco.service.protocol import PeerState, PeerStateRequest, learner_identity, param_spec
from ddiloco.service.status import write_status
from ddiloco.service.transport import LearnerSocket, ZmqLearnerSocket
from ddiloco.training.inner import inner_step, lr_at, make_optimizer
from ddiloco.training.layout import layout_for
from ddiloco.workloads.config import load_workload

log = logging.getLogger(__name__)

SocketFactory = Callable[[list[str], bytes], LearnerSocket]
EXIT_REFUSED = 3
EXIT_COMM_DIED = 4


class LearnerProcess:
    """A learner: model, optimizer, data and protocol state, driven by its training loop."""

    def __init__(
        self,
        cfg: Config,
        syncers: list[str],
        learner_id: int,
        run_dir: str | Path,
        device: str = "cpu",
        threads: int = 1,
        connect: SocketFactory | None = None,
        clock: Clock = SYSTEM_CLOCK,
        incarnation: int | None = None,
        keys: ClientKeys | None = None,
    ) -> None:
        torch.set_num_threads(threads)
        self.cfg, self.id, self.run_dir, self.clock = cfg, learner_id, Path(run_dir), clock
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
                raise DDiLoCoError(
                    "a multi-rank learner supports algo.late_fragment = 'continue' only; run lock-step "
                    "baselines with one process per learner"
                )
        self.device = torch.device(device)
        prepare_run_dir(self.run_dir, f"ddiloco learner {learner_id}")
        (self.run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        self.wl = load_workload(cfg.workload)
        self.model = self.wl.build_model(cfg.run.seed).to(self.device)
        self.layout = layout_for(self.model, self.wl, cfg.algo)
        self.pieces = self.layout.fragments.fragments
        self.params = dict(self.model.named_parameters())
        self.opt = make_optimizer(self.model, cfg.inner)
        self.trained: torch.nn.Module = self.model
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.trained = DistributedDataParallel(self.model, device_ids=ids)
        # One incarnation per process start: the syncer drops whatever its predecessor still sends.
        self.incarnation = incarnation if incarnation is not None else int(clock.wall() * 1e6)
        # A global token count 1000x the budget is not a schedule position but a broken or hostile syncer.
        self.max_global_tokens = 1000.0 * cfg.run.tokens
        self.core = LearnerCore(
            cfg.algo, learner_id, self.layout.num_fragments, self.incarnation, self.max_global_tokens
        )
        m = cfg.run.num_learners
        # Each rank reads its own slice of the learner's shard.
        self.stream = self.wl.train_stream((learner_id % m) * self.world + self.rank, m * self.world, cfg.run.seed)
        self.stop = False
        self.comm: LearnerComm | None = None
        if syncers and self.rank == 0:  # no syncer: a standalone learner (the 'syncing off' reference)
            rt = cfg.runtime
            factory = connect or (
                lambda addrs, ident: ZmqLearnerSocket(addrs, ident, rt.backoff_initial_s, rt.backoff_max_s, keys)
            )
            sock = factory(syncers, learner_identity(learner_id))
            self.comm = LearnerComm(
                rt,
                learner_id,
                self.incarnation,
                param_spec(self.model),
                self.layout.digest,
                syncers,
                sock,
                clock,
                str(self.device),
            )
        self.stats: dict[str, Any] = {
            "steps": 0,
            "tokens": 0,
            "compute_s": 0.0,
            "sync_s": 0.0,
            "blocked_s": 0.0,
            "loss": None,
            "applied": 0,
            "started": clock.wall(),
            "first_step_at": None,
        }
        self._step_ema = 0.0

    # -- the step boundary -------------------------------------------------------------------

    def _host_values(self, p: int) -> list[torch.Tensor]:
        """Fragment p's current values, copied to host memory."""
        out = []
        for pc in self.pieces[p]:
            t = self.params[pc.name].detach()
            out.append((t[pc.row_start : pc.row_end] if t.dim() else t).to("cpu", copy=True))
        return out

    def _contribution(self, p: int) -> Contribution:
        return self.core.contribution(p, self._host_values(p), self.stream.position)

    def _apply(self, msgs: list[Any]) -> None:
        acks = []
        for msg in msgs:
            if isinstance(msg, PeerState):
                if msg.source >= 0 and msg.tensors:
                    problem = load_state(self.opt, msg, self.device)
                    if problem is not None:
                        log.warning(
                            "learner %d: ignored optimizer state from learner %d: %s", self.id, msg.source, problem
                        )
                continue
            receipt = self.core.on_update(
                msg, self.pieces[msg.fragment] if 0 <= msg.fragment < len(self.pieces) else None
            )
            if receipt.mode == "ignore":
                if receipt.problem:
                    log.warning("learner %d: ignored fragment %d version %d: %s", self.id, msg.fragment, msg.version,
                                receipt.problem)  # fmt: skip
                continue
            write_fragment(
                self.params, self.pieces[msg.fragment], [v.to(self.device) for v in msg.values], receipt.alpha
            )
            self.stats["applied"] += 1
            acks.append(Ack(self.id, self.incarnation, msg.fragment, msg.version))
        if self.comm is not None:
            self.comm.post(*acks)

    def _boundary(self, sends: list[int]) -> None:
        """Everything the training thread does for the protocol between two inner steps."""
        self._apply(self._share_inbox())
        comm = self.comm
        if comm is None:
            return
        late = []
        for p, answered in _drain(comm.requests):
            self.core.on_request(p)
            if not answered:  # the comm thread had nothing ready for p: answer now
                late.append(self._contribution(p))
        late += [self._contribution(p) for p in sends]  # lock-step baselines push on their own schedule
        comm.post(*late)
        comm.prepare({p: self._contribution(p) for p in self.core.expected})
        comm.progress = Progress(self.core.step, self._step_ema, tuple(self.core.base_version))

    def _share_inbox(self, initial: bool = False) -> list[Any]:
        """Rank 0 broadcasts the fragments (and peer state) it received, so every rank applies
        the same ones at the same step. Inside a learner a collective is fine: it is one
        failure domain."""
        msgs: list[Any] = _drain(self.comm.inbox) if self.comm is not None else []
        if self.world == 1:
            return msgs
        import torch.distributed as dist

        position = self.comm.data_position if self.comm is not None else None
        box: list[Any] = [msgs, (position, dict(vars(self.core))) if initial else None, dict(self.core.sent_tokens)]
        dist.broadcast_object_list(box, src=0)
        # Only rank 0 contributes: the others need its record to count the same overwritten
        # steps, or their LR positions (and so their parameters) would drift apart.
        self.core.sent_tokens = dict(box[2])
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
        return list(box[0])

    # -- joining -----------------------------------------------------------------------------

    def _wait_for_join(self, comm: LearnerComm) -> None:
        """Take the global state before training (bounded: a dead syncer must not stall us)."""
        deadline = self.clock.monotonic() + self.cfg.runtime.join_timeout_s
        total = self.layout.num_fragments
        got: set[int] = set()
        later: list[Any] = []  # peer state is applied once training starts
        while self.clock.monotonic() < deadline and not comm.stop.is_set() and len(got) < total:
            try:
                msgs = [comm.inbox.get(timeout=0.05), *_drain(comm.inbox)]
            except queue.Empty:
                continue
            updates = [m for m in msgs if isinstance(m, FragmentUpdate)]
            later += [m for m in msgs if not isinstance(m, FragmentUpdate)]
            got.update(m.fragment for m in updates)
            self._apply(updates)
        for m in later:
            comm.inbox.put(m)
        if comm.data_position:
            self.stream.seek(self._plausible_position(comm.data_position))
        if len(got) < total and not comm.stop.is_set():
            log.warning(
                "learner %d: got %d/%d global fragments within %.0f s; training on from what it has",
                self.id,
                len(got),
                total,
                self.cfg.runtime.join_timeout_s,
            )

    def _plausible_position(self, position: int) -> int:
        """Where to resume the data shard: a position past what the whole run's token budget
        (with the same 1000x margin as the token count) could have read is not believed."""
        most = int(self.max_global_tokens / max(1, self.cfg.workload.batch_size))  # >= 1 token per example
        if position > most:
            log.warning("learner %d: ignored a data position of %d (at most %d is plausible)", self.id, position, most)
            return 0
        return position

    # -- the loop ----------------------------------------------------------------------------

    def _should_stop(self) -> bool:
        """Ranks of one learner stop at the same step: rank 0's decision is shared."""
        stop = self.stop or (self.comm is not None and self.comm.stop.is_set())
        if self.world == 1:
            return stop
        import torch.distributed as dist

        flag = torch.tensor([1 if stop else 0], device=self.device if self.device.type == "cuda" else "cpu")
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def run(self) -> int:
        """Train until stopped; the exit code says why it stopped."""
        comm = self.comm
        if comm is not None:
            comm.start()
            self._wait_for_join(comm)
            comm.post(PeerStateRequest(self.id, self.incarnation))
        self._apply(self._share_inbox(initial=True))
        self._boundary([])
        rt = self.cfg.runtime
        last_status = -float("inf")
        step_log = self._open_step_log()
        while not self._should_stop():
            t0 = time.perf_counter()
            batch = self.stream.next_batch()
            batch = type(batch)(batch.inputs.to(self.device), batch.targets.to(self.device), batch.tokens * self.world)
            self.trained.train()
            loss = self.wl.loss(self.trained, batch)
            lr = lr_at(self.core.lr_tokens(), self.cfg.run.tokens, self.cfg.inner)
            inner_step(self.model, self.opt, loss, lr, self.cfg.inner.grad_clip)
            if rt.step_sleep_s:
                time.sleep(rt.step_sleep_s)
            sends = self.core.on_step(batch.tokens)
            t_sync = time.perf_counter()
            self._boundary(sends)
            self.stats["sync_s"] += time.perf_counter() - t_sync
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
                s["first_step_at"] = self.clock.wall()
            if step_log is not None:
                step_log.write(f"{self.clock.wall():.6f},{dt:.6f}\n")
            if self.clock.monotonic() - last_status >= rt.status_interval_s and self.rank == 0:
                last_status = self.clock.monotonic()
                self.write_status()
                if step_log is not None:
                    step_log.flush()
        return self._finish(step_log)

    def _finish(self, step_log: TextIO | None) -> int:
        if self.comm is not None:
            self.comm.close()
        self.write_status()
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
        if step_log is not None:
            step_log.close()
        if self.comm is not None and self.comm.refused:
            log.error("learner %d refused by the syncer: %s", self.id, self.comm.refused)
            return EXIT_REFUSED
        if self.comm is not None and self.comm.died:
            log.error("learner %d stops: its comm thread died (%s)", self.id, self.comm.died)
            return EXIT_COMM_DIED
        return 0

    def _open_step_log(self) -> TextIO | None:
        if not (self.cfg.runtime.step_log and self.rank == 0):
            return None
        return open(self.run_dir / "metrics" / f"steps-{self.id}-{os.getpid()}.csv", "w")

    def _serve_peer_requests(self) -> None:
        if self.comm is None:
            return
        for who in _drain(self.comm.peer_requests):
            self.comm.post(state_message(self.opt, who, self.id))

    def _block_if_lock_step(self) -> None:
        if self.cfg.algo.late_fragment != "wait" or self.comm is None:
            return
        t0 = time.perf_counter()
        while not self._stopping() and self.core.blocking_fragments(self.clock.monotonic()):
            try:
                msg = self.comm.inbox.get(timeout=0.01)
            except queue.Empty:
                continue
            self.comm.inbox.put(msg)
            self._boundary([])
        self.stats["blocked_s"] += time.perf_counter() - t0

    def _stopping(self) -> bool:
        return self.stop or (self.comm is not None and self.comm.stop.is_set())

    def write_status(self) -> None:
        name = f"learner-{self.id}" if self.rank == 0 else f"learner-{self.id}.rank{self.rank}"
        checksum = float(sum(p.detach().double().sum() for p in self.model.parameters()))
        comm = self.comm
        write_status(
            self.run_dir / "status" / f"{name}.json",
            {
                "rank": self.rank,
                "world": self.world,
                "param_checksum": checksum,
                "learner": self.id,
                "incarnation": self.incarnation,
                "pid": os.getpid(),
                "time": self.clock.wall(),
                "step_time_ema": self._step_ema,
                "base_versions": list(self.core.base_version),
                "pending_steps": sum(self.core.steps) / len(self.core.steps),
                "answered": 0 if comm is None else comm.answered,
                "comm_cpu_s": 0.0 if comm is None else comm.cpu_s,
                **self.stats,
            },
        )


def client_keys(syncers: list[str], keys_dir: str | None, name: str, insecure: bool) -> ClientKeys | None:
    """The keys to talk to ``syncers`` as ``name``; none on this machine, or with ``insecure``
    (which is said once)."""
    if keys_dir is not None:
        return ClientKeys.load(keys_dir, name)
    remote = [a for a in syncers if not is_local(a)]
    if remote and not insecure:
        raise DDiLoCoError(
            f"{remote[0]} is not on this machine: pass --keys DIR (with syncer.key and {name}.key_secret, from "
            "`ddiloco keys`), or --insecure on a trusted network"
        )
    if remote:
        log.warning("INSECURE: talking to %s without authentication or encryption (--insecure)", remote[0])
    return None


def _drain(q: queue.Queue[Any]) -> list[Any]:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def run_learner(
    cfg: Config,
    syncers: list[str],
    learner_id: int,
    run_dir: str,
    device: str,
    threads: int,
    keys_dir: str | None = None,
    insecure: bool = False,
) -> int:
    """The ``ddiloco learner`` process: SIGTERM/SIGINT stop it cleanly at a step boundary."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DDiLoCoError(f"--device {device} requested but CUDA is not available here; use --device cpu")
    keys = client_keys(syncers, keys_dir, f"learner-{learner_id}", insecure)
    learner = LearnerProcess(cfg, syncers, learner_id, run_dir, device, threads, keys=keys)

    def stop(*_: Any) -> None:
        learner.stop = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return learner.run()
