"""Deterministic virtual-time runtime: M real torch learners and the syncer shards in one process.

It pumps the same protocol sessions as the real runtime (``ddiloco.protocol``): each learner
process is a ``LearnerSession`` around its own model, optimizer and data; each syncer shard a
``SyncerSession`` with an in-memory store that has the real store's semantics. What this driver
adds is virtual time: every duration comes from the cost model in ``VirtualTimeConfig`` (step
time / speed x straggler factor x noise, transfer = latency + jitter + bytes / bandwidth, in
order per link as on a TCP connection), never from the wall clock, and faults come from the
chaos schedule or are placed exactly (``sim/faults.py``). Events run in (time, actor, sequence)
order on one thread, so the same config, faults and seed give bit-identical results. Chaos,
data, speed noise and network jitter each draw from their own seeded stream.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ddiloco.chaos.schedule import ChaosSchedule, make_schedule
from ddiloco.config import Config
from ddiloco.core.fragments import assemble, read_fragment, tensor_rows, write_fragment
from ddiloco.core.learner import routed_counts
from ddiloco.core.messages import FragmentUpdate
from ddiloco.core.syncer import Syncer
from ddiloco.core.tape import RoundRecord, TapeRecord
from ddiloco.errors import DataError
from ddiloco.protocol.boundary import BoundaryExecutor, StateSource
from ddiloco.protocol.handoff import handoff_nbytes
from ddiloco.protocol.learner_session import BoundaryPlan, LearnerOutput, LearnerSession, Registration
from ddiloco.protocol.messages import PeerState
from ddiloco.protocol.syncer_session import Budget, SyncerOutput, SyncerSession
from ddiloco.protocol.traffic import TrafficMeter, payload_nbytes
from ddiloco.report.accounting import State, TimeAccount, fleet_goodput, uptime
from ddiloco.report.invariants import Incarnation, Restore, Violation, check_run
from ddiloco.report.result import Progress, RunResult, summarise_tape
from ddiloco.sim.faults import (
    Fault,
    HostilePeerState,
    Inject,
    KillLearner,
    Partition,
    PoisonedServer,
    RestartSyncer,
    Slow,
    SlowLink,
)
from ddiloco.sim.links import HandoffQueues, SimLinks
from ddiloco.sim.memory_store import MemoryStore
from ddiloco.training.evaluate import eval_figures
from ddiloco.training.inner import inner_step, lr_at, make_optimizer
from ddiloco.training.layout import ModelLayout, layout_for, load_global, param_spec, synced_tensors
from ddiloco.training.peer_state import StateServer, load_state
from ddiloco.workloads.base import DataStream, Workload, loss_unit, routed_tokens

SYNCER = 1 << 30  # actor ids of the syncer shards in the event order (after every learner)
MAX_TIME_FACTOR = 4.0
"""A token-budget run that has not processed its tokens by this multiple of T ends there (the
syncer's time budget: a fleet that cannot get there, every learner down, still ends)."""
HEADER_BYTES = 64
"""What a message costs on the wire besides its tensors (the real header is about 100-300 bytes,
``protocol.traffic.HEADER_BYTES``; this estimate stays so that transfer times, and with them the
golden fixtures, stay as they were)."""


@dataclass
class SimLearner:
    """One learner: its model, optimizer and data, and the process (session) running it now."""

    id: int
    model: nn.Module
    params: dict[str, torch.Tensor]
    opt: torch.optim.Optimizer
    stream: DataStream
    speed: float
    noise: np.random.Generator
    account: TimeAccount = field(default_factory=lambda: TimeAccount("starting"))
    gen: int = 0
    """Its process's incarnation: events of a dead process are dropped."""
    session: LearnerSession | None = None
    """The running process's protocol (None while it is down)."""
    training: bool = False
    """Its join is complete and it has started stepping (this incarnation)."""
    stepping: bool = False
    """A step is under way (its end is scheduled)."""
    lost_steps: float = 0.0
    failures: int = 0
    loss: float | None = None
    """The last inner step's training loss."""
    tokens_processed: int = 0
    """Tokens of every inner step it took, all incarnations."""
    steps_taken: int = 0
    """Inner steps it took, all incarnations."""
    incarnation_start: tuple[int, int] = (0, 0)
    """(tokens, steps) when its current incarnation started."""
    down_since: float | None = None
    record: int = 0
    """Index of its current process in ``Simulation.incarnations``."""
    executor: BoundaryExecutor | None = None
    """Its process's boundary executor (its optimizer hand-offs under way die with it)."""

    @property
    def up(self) -> bool:
        return self.session is not None


class SimHost:
    """A simulated learner's model and optimizer as the boundary executor sees them: CPU
    tensors, written and read at once (a boundary takes no virtual time)."""

    def __init__(self, sim: Simulation, ln: SimLearner) -> None:
        self.sim, self.ln = sim, ln
        self.pieces = sim.layout.fragments
        self.hostile = next(
            (f.kind for f in sim.faults if isinstance(f, HostilePeerState) and f.learner == ln.id), None
        )

    def write(self, p: int, values: Sequence[torch.Tensor], alpha: float, add: bool) -> None:
        write_fragment(self.ln.params, self.pieces[p], values, alpha, add)

    def read(self, p: int) -> list[torch.Tensor]:
        return read_fragment(self.ln.params, self.pieces[p])

    def load_peer_state(self, state: PeerState) -> None:
        problem = load_state(self.ln.opt, state, torch.device("cpu"))
        self.sim.log.append(
            {
                "event": "peer_state",
                "learner": self.ln.id,
                "time": self.sim.now,
                "peer": state.source,
                "problem": problem,
            }
        )

    def serve(self, learner: int) -> StateSource:
        server = StateServer(self.ln.opt, learner, self.ln.id)  # a boundary takes no virtual time: no copy clock
        return server if self.hostile is None else PoisonedServer(server, self.hostile)


@dataclass
class SimShard:
    """One syncer shard: the fragments it owns, its store, and its session while it is up."""

    index: int
    owned: list[int]
    store: MemoryStore = field(default_factory=MemoryStore)
    session: SyncerSession | None = None
    epoch: int = 0
    rounds_closed: int = 0
    done: bool = False
    """Its final model is written (the run's end reached it)."""


class Simulation:
    """Runs one configured method in virtual time and returns a RunResult."""

    SAMPLES = 200
    """Per-learner records (metrics/learners.jsonl) over a run's virtual time budget."""

    def __init__(
        self,
        cfg: Config,
        workload: Workload,
        on_progress: Progress | None = None,
        should_stop: Callable[[], bool] | None = None,
        faults: Sequence[Fault] = (),
    ) -> None:
        """``should_stop``: polled between events; True ends the run early (a partial result).
        ``faults``: placed exactly, besides the config's chaos schedule (the fault harness)."""
        self.cfg, self.wl, self.on_progress = cfg, workload, on_progress
        self.should_stop = should_stop
        self.interrupted = False
        self.samples: list[dict[str, Any]] = []
        a, s, r = cfg.algo, cfg.sim, cfg.run
        torch.use_deterministic_algorithms(True)
        base = workload.build_model(r.seed)
        self.model_layout: ModelLayout = layout_for(base, workload, a)
        self.layout = self.model_layout.fragments
        self._expert_rows = tensor_rows(self.layout)
        self.initial = {k: v.detach().clone() for k, v in synced_tensors(base).items()}
        self.registration = Registration(param_spec(base), self.model_layout.digest)
        self.tape: list[TapeRecord] = []
        self.eval_model = copy.deepcopy(base)
        self.eval_batches = workload.eval_batches()
        m_count = r.num_learners
        speeds = s.speeds or (1.0,) * m_count
        self.learners = []
        for m in range(m_count):
            model = copy.deepcopy(base)
            stream = workload.train_stream(m, m_count, r.seed)
            self.learners.append(
                SimLearner(
                    m,
                    model,
                    synced_tensors(model),
                    make_optimizer(model, cfg.inner),
                    stream,
                    speeds[m],
                    np.random.default_rng([r.seed, 0x5EED, m]),
                )
            )
        first = self.learners[0].stream.next_batch()
        self.learners[0].stream.seek(0)
        self.tokens_per_step = first.tokens
        steps = math.ceil(r.processed_tokens / (m_count * self.tokens_per_step))
        self.horizon = steps * s.step_time_s  # T: a healthy fleet's time for the budget
        # The run's end is the syncer's decision, as in a real run: tokens processed (as the
        # learners report them), or the time budget, whichever comes first.
        if r.budget == "time":
            self.budget = Budget(math.inf, r.merged_tokens, self.horizon, 'run.budget = "time"')
        else:
            limit = MAX_TIME_FACTOR * self.horizon
            self.budget = Budget(
                r.processed_tokens, r.merged_tokens, limit, f"{MAX_TIME_FACTOR:g} x T, the safety bound"
            )
        self.hard_limit = MAX_TIME_FACTOR * self.horizon + 10 * (a.liveness_timeout_s + cfg.runtime.end_linger_s)
        self.processed = 0  # tokens of every applied inner step, all learners (what the evaluations follow)
        self.eval_tokens = [r.processed_tokens * k / (r.eval_points + 1) for k in range(1, r.eval_points + 1)]
        self.chaos: ChaosSchedule = make_schedule(cfg.chaos, m_count, self.horizon, r.seed)
        self.faults = list(faults)
        self._fired: set[int] = set()  # faults placed once that have happened
        self.net = np.random.default_rng([r.seed, 0x7E7])  # network jitter stream
        self.events: list[tuple[float, int, int, str, Any]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.end_time: float | None = None
        """When the syncer ended the run (the learners' allocated time stops there)."""
        self.evals: list[dict[str, float]] = []
        self.log: list[dict[str, Any]] = []
        self.outages: list[tuple[int, float, float]] = []
        self.served: dict[int, int] = {}
        """Per fragment, the newest version sent to anyone (no restart may lose it)."""
        self.restores: list[Restore] = []
        """Each shard restart: when, the versions it came back with, and what it had served."""
        self.incarnations: list[Incarnation] = []
        """Every learner process: when it started and died."""
        self._wakes: set[tuple[int, float]] = set()
        self.traffic = TrafficMeter()
        """Every message delivered, by learner, direction and kind (metrics/traffic.json)."""
        self._last_arrival: dict[tuple[int, int], float] = {}
        # The links of chaos.links / chaos.site_link, from their own seeded stream.
        self.links = SimLinks(cfg.chaos, m_count, np.random.default_rng([r.seed, 0x11A7]))
        self.handoffs = HandoffQueues()
        self._next_sample = 0.0
        num_shards = s.syncer_shards
        self.shards = [
            SimShard(k, [p for p in range(self.layout.num_fragments) if p % num_shards == k]) for k in range(num_shards)
        ]

    # -- event plumbing --------------------------------------------------------------------

    def _at(self, t: float, actor: int, kind: str, data: Any = None) -> None:
        heapq.heappush(self.events, (t, actor, next(self.seq), kind, data))

    def _transfer_s(self, nbytes: int) -> float:
        """Latency + jitter + bytes / bandwidth."""
        s = self.cfg.sim
        jitter = float(self.net.exponential(s.jitter_s)) if s.jitter_s > 0 else 0.0
        return s.latency_s + jitter + nbytes * 8 / (s.bandwidth_gbps * 1e9)

    def _partitioned(self, m: int) -> bool:
        return any(
            isinstance(f, Partition) and f.learner == m and f.start_s <= self.now < f.start_s + f.duration_s
            for f in self.faults
        )

    def _uplink_rate(self, m: int) -> float:
        """Bytes per second learner m's messages cross its link at (its comm thread's measure)."""
        return self.links.rate(m, "up") if self.links.covers(m) else self.cfg.sim.bandwidth_gbps * 1e9 / 8

    def _deliver(
        self, src: int, dst: int, kind: str, data: Any, nbytes: int, extra_s: float = 0.0, handoff: int = 0
    ) -> None:
        """Send one message over the link src -> dst: it arrives after its transfer time, never
        before an earlier message of the same link (a TCP connection keeps order). ``handoff``: the
        bytes of a piece of an optimizer state it serves, which waits for the pieces ahead of it."""
        learner = src if src < SYNCER else dst
        # As the syncer service counts: the learner's link, once the run's end is announced its final sync.
        self.traffic.count(data[-1], nbytes, "up" if src < SYNCER else "down", learner, final=self.end_time is not None)
        for f in self.faults:
            if isinstance(f, SlowLink) and f.learner == learner and f.start_s <= self.now < f.end_s:
                extra_s += f.extra_s
        if self.links.covers(learner):  # an emulated link (chaos.links, chaos.site_link)
            sent = self.links.transfer_end(self.now + extra_s, learner, "up" if src < SYNCER else "down", nbytes)
        else:
            sent = self.now + extra_s + self._transfer_s(nbytes)
            if handoff:  # one piece after another (an emulated link above is one queue already)
                sent += self.handoffs.wait_s(learner, self.now, nbytes, self._uplink_rate(learner))
        arrival = max(sent, self._last_arrival.get((src, dst), 0.0))
        self._last_arrival[(src, dst)] = arrival
        if handoff:
            self.handoffs.sent(learner, arrival, handoff)
        self._at(arrival, dst, kind, data)

    # -- learners: the process side ----------------------------------------------------------

    def _start_process(self, ln: SimLearner) -> None:
        """A learner process starts: a new incarnation registers and takes the global state."""
        cfg = self.cfg
        ln.session = LearnerSession(
            cfg.algo,
            cfg.runtime,
            ln.id,
            ln.gen,
            self.layout,
            self.registration,
            self.now,
            num_shards=len(self.shards),
            wants_peer_state=True,
        )
        ln.executor = BoundaryExecutor(SimHost(self, ln))
        self.handoffs.start(ln.id)
        ln.training = ln.stepping = False
        ln.incarnation_start = (ln.tokens_processed, ln.steps_taken)
        ln.record = len(self.incarnations)
        self.incarnations.append(Incarnation(ln.id, ln.gen, self.now))
        self._learner_tick(ln)

    def _learner_out(self, ln: SimLearner, out: LearnerOutput) -> None:
        """Send what the session asked to send (a partitioned learner's messages are lost)."""
        self.log += [{"event": "note", "learner": ln.id, "time": self.now, "text": n} for n in out.notes]
        lost = self._partitioned(ln.id)
        for send in out.send:
            piece = handoff_nbytes(send.msg) if isinstance(send.msg, PeerState) else 0  # (a refusal: none)
            if lost:
                self.handoffs.lost(ln.id, piece)
                continue
            data = (ln.id, send.shard, send.msg)
            self._deliver(ln.id, SYNCER + send.shard, "to_syncer", data, _nbytes(send.msg), handoff=piece)

    def _learner_tick(self, ln: SimLearner) -> None:
        """Run the session's deadlines due now, and wake it at its next one."""
        if ln.session is None:
            return
        self._learner_out(ln, ln.session.tick(self.now))
        if not ln.training and not ln.stepping:
            self._after_idle_boundary(ln)  # the join timeout may have passed
        deadline = ln.session.next_deadline(self.now)
        if deadline is not None and deadline > self.now and (ln.id, deadline) not in self._wakes:
            self._wakes.add((ln.id, deadline))
            self._at(deadline, ln.id, "learner_tick", (ln.gen, deadline))

    def _on_learner_message(self, ln: SimLearner, shard: int, msg: Any) -> None:
        if ln.session is None:
            return  # a dead process receives nothing
        self._learner_out(ln, ln.session.receive(shard, msg, self.now))
        if not ln.stepping:  # joining, blocked or finishing: the boundary runs as messages arrive
            self._boundary(ln, ln.session.boundary(self.now))
            self._after_idle_boundary(ln)
        self._learner_tick(ln)

    def _after_idle_boundary(self, ln: SimLearner) -> None:
        session = ln.session
        if session is None or session.stopped:
            return
        if not ln.training:
            if session.ready(self.now):  # the join is complete: train from the global state
                ln.training = True
                ln.stream.seek(session.data_position or 0)  # a new process starts where the syncer says, else at 0
                self._switch(ln, "compute")
                self._start_step(ln)
        elif ln.account.state == "blocked":
            self._continue_or_block(ln)

    def _boundary(self, ln: SimLearner, plan: BoundaryPlan) -> None:
        """What the learner's training thread does at a boundary (``protocol/boundary.py``):
        write, load, read, serve, send."""
        assert ln.session is not None and ln.executor is not None
        ln.session.sending(self.handoffs.done(ln.id, self.now), self._uplink_rate(ln.id))
        out = ln.executor.run(plan, ln.session)
        assert out is not None
        self._learner_out(ln, out)

    # -- learners: the training loop ----------------------------------------------------------

    def _step_duration(self, ln: SimLearner) -> float:
        d = self.cfg.sim.step_time_s / ln.speed * self.chaos.slowdown(ln.id, self.now)
        for f in self.faults:
            if isinstance(f, Slow) and f.learner == ln.id and f.start_s <= self.now < f.end_s:
                d *= f.factor
        if self.cfg.sim.speed_noise > 0:
            d *= max(0.2, 1.0 + self.cfg.sim.speed_noise * float(ln.noise.standard_normal()))
        return d

    def _start_step(self, ln: SimLearner) -> None:
        ln.stepping = True
        d = self._step_duration(ln)
        self._at(self.now + d, ln.id, "step_end", (ln.gen, d))

    def _on_step_end(self, ln: SimLearner, gen: int, duration: float) -> None:
        session = ln.session
        if gen != ln.gen or session is None:
            return  # a step of a dead incarnation
        ln.stepping = False
        batch = ln.stream.next_batch()
        lr = lr_at(session.core.fleet_tokens(), self.cfg.run.processed_tokens, self.cfg.inner)
        ln.model.train()
        loss = self.wl.loss(ln.model, batch)
        inner_step(ln.model, ln.opt, loss, lr, self.cfg.inner.grad_clip)
        ln.loss = float(loss.detach())
        ln.tokens_processed += batch.tokens
        ln.steps_taken += 1
        self.processed += batch.tokens
        if self.now >= self._next_sample:
            self._sample()
        counts = None
        if self.cfg.algo.expert_weights == "routed":
            routed = routed_tokens(self.wl, ln.model)
            try:
                counts = routed_counts(routed, self._expert_rows, batch.tokens) if routed else None
            except ValueError as e:
                raise DataError(f"workload {self.wl.name}: routed_tokens(): {e}") from None
        plan = session.step(batch.tokens, duration, self.now, ln.stream.position, ln.loss, counts)
        self._boundary(ln, plan)
        self._observe_tokens()
        kill = next((f for i, f in enumerate(self.faults) if isinstance(f, KillLearner) and f.learner == ln.id
                     and f.at_step == session.core.step and i not in self._fired), None)  # fmt: skip
        if kill is not None:
            self._fired.add(self.faults.index(kill))
            back = None if kill.restart_after_s is None else self.now + kill.restart_after_s
            self._fail(ln, back)
            return
        if not session.stopped:
            self._continue_or_block(ln)
        self._learner_tick(ln)

    def _continue_or_block(self, ln: SimLearner) -> None:
        session = ln.session
        assert session is not None
        if session.core.blocking_fragments(self.now):
            self._switch(ln, "blocked")
            deadline = session.core.block_deadline()
            if deadline is not None:
                self._at(deadline, ln.id, "unblock_check", ln.gen)
        else:
            self._switch(ln, "compute")
            self._start_step(ln)

    def _switch(self, ln: SimLearner, state: State) -> None:
        if ln.account.state != state and self.end_time is None:
            ln.account.switch(state, self.now)

    # -- chaos and faults --------------------------------------------------------------------

    def _fail(self, ln: SimLearner, back_at: float | None, restart_at: float | None = None) -> None:
        """The learner's process dies: what it had not contributed is lost."""
        session = ln.session
        if session is None:
            return
        ln.gen += 1
        ln.failures += 1
        ln.lost_steps += sum(session.core.steps) / len(session.core.steps)  # steps not yet contributed
        ln.session, ln.training, ln.stepping = None, False, False
        self.incarnations[ln.record] = dataclasses.replace(self.incarnations[ln.record], end=self.now)
        self._switch(ln, "down")
        ln.loss, ln.down_since = None, self.now
        self.log.append({"event": "fail", "learner": ln.id, "time": self.now})
        if back_at is not None:
            restart_at = max(self.now, back_at - self.chaos.restart_s) if restart_at is None else restart_at
            self._at(restart_at, ln.id, "restart_begin", ln.gen)
            self._at(back_at, ln.id, "rejoin", ln.gen)

    def _on_rejoin(self, ln: SimLearner) -> None:
        """A new process: it registers, takes the global state, asks for a peer's optimizer
        state and its data position, all through the protocol. It builds its model afresh: what
        its join does not overwrite is the initial model, not the dead process's weights."""
        with torch.no_grad():
            for name, tensor in synced_tensors(ln.model).items():
                tensor.copy_(self.initial[name])
        ln.opt = make_optimizer(ln.model, self.cfg.inner)
        if ln.down_since is not None:
            self.outages.append((ln.id, ln.down_since, self.now))
            ln.down_since = None
        self.log.append({"event": "rejoin", "learner": ln.id, "time": self.now})
        self._start_process(ln)

    def _kill_shard(self, sh: SimShard, down_s: float) -> None:
        if sh.session is None or sh.done:
            return
        sh.session = None
        self.log.append({"event": "syncer_kill", "shard": sh.index, "time": self.now})
        self._at(self.now + down_s, SYNCER + sh.index, "shard_up", sh.index)

    def _start_shard(self, sh: SimShard) -> None:
        """A shard (re)starts: a fresh core from the initial values, then what its store made
        durable (never the object that was running before)."""
        core = Syncer(self.cfg.algo, self.layout, self.initial, self.model_layout.embedding_like, sh.owned)
        sh.epoch += 1
        session = SyncerSession(
            core, self.cfg.runtime, self.budget, self.registration, self.now,
            shard=sh.index, epoch=sh.epoch, age_s=self.now,
        )  # fmt: skip
        records, meta = sh.store.restore()
        session.restore(records, meta)
        if sh.epoch > 1:  # a restart: it must come back with every version it had served
            served = {p: v for p, v in self.served.items() if p in sh.owned}
            self.restores.append(Restore(self.now, {p: r.version for p, r in records.items()}, served))
        sh.session = session
        self._syncer_tick(sh)

    # -- the syncer shards ---------------------------------------------------------------------

    def _syncer_out(self, sh: SimShard, out: SyncerOutput) -> None:
        """Make durable, keep the tape, then send (merged versions after the modelled merge time)."""
        session = sh.session
        assert session is not None
        if out.persist:
            meta = session.meta()
            for rec in session.records(out.persist):
                sh.store.append(rec, meta)
        self.tape += out.tape
        self.log += [{"event": "syncer_note", "time": self.now, "kind": n.kind, "text": n.text} for n in out.notes]
        if out.final_model:
            sh.done = True
        if session.end_stage is not None and self.end_time is None:
            self._end(session.end_reason)
        merged: dict[int, int] = {}
        for _, msg in out.send:
            if isinstance(msg, FragmentUpdate) and msg.reason == "merged":
                merged[msg.fragment] = merged.get(msg.fragment, 0) + 1
        for peer, msg in out.send:
            extra = 0.0
            if isinstance(msg, FragmentUpdate):
                self.served[msg.fragment] = max(self.served.get(msg.fragment, 0), msg.version)
                if msg.reason == "merged":
                    nbytes = _nbytes(msg)
                    extra = merged[msg.fragment] * nbytes / (self.cfg.sim.merge_gbps * 1e9)
            if not self._partitioned(int(peer)):
                self._deliver(SYNCER + sh.index, int(peer), "to_learner", (sh.index, msg), _nbytes(msg), extra)
        closed = sum(1 for r in out.tape if isinstance(r, RoundRecord))
        if closed:
            sh.rounds_closed += closed
            for f in self.faults:
                due = isinstance(f, RestartSyncer) and f.shard == sh.index and f.after_rounds is not None
                if due and sh.rounds_closed - closed < f.after_rounds <= sh.rounds_closed:
                    self._kill_shard(sh, f.down_s)
                    return

    def _syncer_tick(self, sh: SimShard) -> None:
        if sh.session is None:
            return
        self._syncer_out(sh, sh.session.tick(self.now))
        self._wake_shard(sh)

    def _wake_shard(self, sh: SimShard) -> None:
        if sh.session is None:
            return
        deadline = sh.session.next_deadline(self.now)
        key = (SYNCER + sh.index, deadline)
        if deadline > self.now and key not in self._wakes:
            self._wakes.add(key)
            self._at(deadline, SYNCER + sh.index, "syncer_tick", (sh.epoch, deadline))

    def _on_syncer_message(self, sh: SimShard, learner: int, msg: Any) -> None:
        if sh.session is None:
            return  # a dead shard receives nothing
        self._syncer_out(sh, sh.session.receive(learner, msg, self.now))
        self._wake_shard(sh)

    def _end(self, reason: str) -> None:
        """The syncer ended the run: the learners' allocated time stops here."""
        self.end_time = self.now
        for ln in self.learners:
            ln.account.close(self.now)
        self.log.append({"event": "end", "time": self.now, "reason": reason})

    # -- evaluation ------------------------------------------------------------------------

    def global_state(self) -> dict[str, torch.Tensor]:
        """The global model: each fragment's values from the shard that owns it (from its store
        while it is down)."""
        values = {}
        for sh in self.shards:
            core = sh.session.core if sh.session is not None else None
            for p in sh.owned:
                values[p] = core.values(p) if core is not None else self._durable_values(sh, p)
        return assemble(self.layout, values)

    def _durable_values(self, sh: SimShard, p: int) -> list[torch.Tensor]:
        rec = sh.store.records.get(p)
        if rec is not None:
            return rec.values
        return read_fragment(self.initial, self.layout.fragments[p])

    def merged_tokens(self) -> float:
        """Tokens merged into the global model: the mean over all fragments."""
        total = 0.0
        for sh in self.shards:
            if sh.session is not None:
                total += sh.session.core.merged_tokens * len(sh.owned)
            else:
                total += sum(r.tokens_merged for r in sh.store.records.values())
        return total / max(1, self.layout.num_fragments)

    def _evaluate(self) -> dict[str, float]:
        load_global(self.eval_model, self.global_state())
        return eval_figures(self.wl, self.eval_model, self.eval_batches)

    def _record_eval(self, final: bool = False) -> None:
        at = {"time": self.now, "tokens": self.processed, "merged_tokens": self.merged_tokens()}
        self.evals.append({**at, **self._evaluate(), "final": final})

    def _observe_tokens(self) -> None:
        """Evaluations at the configured fractions of the processed tokens (an observer's view:
        the protocol does not see them)."""
        if self.cfg.run.budget != "tokens":
            return
        while self.eval_tokens and self.processed >= self.eval_tokens[0]:
            self.eval_tokens.pop(0)
            self._record_eval()
            self._progress()

    # -- main loop -------------------------------------------------------------------------

    def run(self) -> RunResult:
        for sh in self.shards:
            self._start_shard(sh)
        for ln in self.learners:  # every learner process starts and joins
            self._start_process(ln)
        for o in self.chaos.outages:
            self._at(o.start_s, o.learner, "fail", (max(o.start_s, o.end_s - self.chaos.restart_s), o.end_s))
        for f in self.faults:
            if isinstance(f, RestartSyncer) and f.at_s is not None:
                self._at(f.at_s, SYNCER + f.shard, "shard_kill", f)
            elif isinstance(f, Inject):
                self._at(f.at_s, SYNCER + f.shard, "inject", f)
        if self.cfg.run.budget == "time":  # else evaluations follow the tokens (_observe_tokens)
            for k in range(1, self.cfg.run.eval_points + 1):
                self._at(self.horizon * k / (self.cfg.run.eval_points + 1), SYNCER + len(self.shards), "eval")
        self._loop()
        if self.end_time is None:  # interrupted (or a protocol that never ended: the hard limit)
            self._end("interrupted" if self.interrupted else "hard time limit")
            for sh in self.shards:
                if sh.session is not None:
                    self._syncer_out(sh, sh.session.shutdown(self.now))
        self._sample()
        self._record_eval(final=True)
        self._progress(done=True)
        return self._result()

    def _loop(self) -> None:
        """Process events in order until every shard has ended the run (or a stop or limit)."""
        handlers: dict[str, Callable[[int, Any], None]] = {
            "step_end": lambda a, d: self._on_step_end(self.learners[a], *d),
            "to_learner": lambda a, d: self._on_learner_message(self.learners[a], *d),
            "to_syncer": lambda a, d: self._on_syncer_message(self.shards[a - SYNCER], d[0], d[2]),
            "learner_tick": self._on_learner_tick,
            "syncer_tick": self._on_syncer_tick,
            "fail": lambda a, d: self._fail(self.learners[a], d[1], d[0]),
            "restart_begin": self._on_restart_begin,
            "rejoin": self._on_rejoin_event,
            "unblock_check": self._on_unblock_check,
            "shard_kill": lambda a, f: self._kill_shard(self.shards[a - SYNCER], f.down_s),
            "shard_up": lambda a, k: self._start_shard(self.shards[k]),
            "eval": lambda a, d: self._timed_eval(),
            "inject": self._on_inject,
        }
        while self.events and not all(sh.done for sh in self.shards):
            if self.should_stop is not None and self.should_stop():
                self.interrupted = True
                return
            t, actor, _, kind, data = heapq.heappop(self.events)
            if t > self.hard_limit:
                return
            self.now = t
            handlers[kind](actor, data)

    def _on_learner_tick(self, actor: int, data: tuple[int, float]) -> None:
        ln = self.learners[actor]
        self._wakes.discard((actor, data[1]))
        if data[0] == ln.gen:
            self._learner_tick(ln)

    def _on_syncer_tick(self, actor: int, data: tuple[int, float]) -> None:
        sh = self.shards[actor - SYNCER]
        self._wakes.discard((actor, data[1]))
        if data[0] == sh.epoch:
            self._syncer_tick(sh)

    def _on_inject(self, actor: int, f: Inject) -> None:
        for _ in range(f.count):  # an insider's messages, as its bound peer sends them
            self._on_syncer_message(self.shards[actor - SYNCER], f.learner, f.msg)

    def _on_restart_begin(self, actor: int, gen: int) -> None:
        if gen == self.learners[actor].gen:
            self._switch(self.learners[actor], "restarting")

    def _on_rejoin_event(self, actor: int, gen: int) -> None:
        if gen == self.learners[actor].gen:
            self._on_rejoin(self.learners[actor])

    def _on_unblock_check(self, actor: int, gen: int) -> None:
        ln = self.learners[actor]
        if gen == ln.gen and ln.account.state == "blocked" and ln.session is not None and not ln.stepping:
            self._continue_or_block(ln)

    def _timed_eval(self) -> None:
        if self.end_time is None:
            self._record_eval()
            self._progress()

    def _progress(self, done: bool = False) -> None:
        """Where the run is against the budget that ends it: its tokens processed (a token budget)
        or its virtual time (a time budget), never a horizon the run may overrun."""
        if self.on_progress is None:
            return
        if self.cfg.run.budget == "tokens":
            total = float(self.cfg.run.processed_tokens)
            self.on_progress(total if done else min(self.processed, total), total, "tokens processed")
        else:
            self.on_progress(self.horizon if done else min(self.now, self.horizon), self.horizon, "s of virtual time")

    def invariants(self) -> list[Violation]:
        """What must hold after the run (``report/invariants.py``), from its tape and what this
        driver saw: served versions and restores, learner processes. A process is expected to
        have merged once it ran three periods of H steps (at the nominal step time)."""
        ended = self.end_time is not None and all(sh.done for sh in self.shards)
        return check_run(
            [r.to_json() for r in self.tape],
            restores=self.restores,
            incarnations=self.incarnations,
            min_life_s=3 * self.cfg.algo.sync_every * self.cfg.sim.step_time_s,
            run_end=self.end_time if ended else None,
            fragments=range(self.layout.num_fragments),
        )

    def _sample(self) -> None:
        """One metrics/learners.jsonl record per learner (counters of its current incarnation)."""
        self._next_sample = self.now + self.horizon / self.SAMPLES
        for ln in self.learners:
            tokens0, steps0 = ln.incarnation_start
            up = ln.session is not None
            self.samples.append(
                {
                    "event": "learner",
                    "time": self.now,
                    "learner": ln.id,
                    "incarnation": ln.gen,
                    "state": "up" if up else "down",
                    "steps": ln.steps_taken - steps0 if up else 0,
                    "tokens": ln.tokens_processed - tokens0 if up else 0,
                    # The session's busy time, as its heartbeats report it (a wait is not busy).
                    "busy_s": ln.session.busy_s if ln.session is not None else 0.0,
                    "loss": ln.loss,
                    "bytes_sent": ln.session.bytes_sent if ln.session is not None else 0,
                }
            )

    def _result(self) -> RunResult:
        end = self.end_time if self.end_time is not None else self.now
        for ln in self.learners:  # the steps since each live process's last heartbeat
            if ln.session is not None:
                self.traffic.observe_steps(ln.id, ln.gen, ln.session.core.step)
        n_params = sum(t.numel() for t in self.initial.values())
        gp = fleet_goodput([ln.account for ln in self.learners], end)
        need = self.cfg.algo.quorum_size or 1
        outages = [*self.outages, *((ln.id, ln.down_since, end) for ln in self.learners if ln.down_since is not None)]
        tape = [r.to_json() for r in self.tape]
        return RunResult(
            method=self.cfg.run.method,
            final_loss=self.evals[-1]["loss"],
            evals=self.evals,
            horizon_s=end,
            tokens_processed=sum(ln.tokens_processed for ln in self.learners),
            tokens_merged=self.merged_tokens(),
            goodput=gp,
            uptime=uptime(outages, len(self.learners), min(need, len(self.learners)), end),
            lost_steps=sum(ln.lost_steps for ln in self.learners),
            failures=sum(ln.failures for ln in self.learners),
            num_fragments=self.layout.num_fragments,
            tape=tape,
            log=[*self.log, *self.chaos.straggler_events(end)],
            state={k: v.detach().clone() for k, v in self.eval_model.state_dict().items()},
            samples=self.samples,
            num_learners=len(self.learners),
            loss_unit=loss_unit(self.wl),
            partial=self.interrupted,
            traffic=self.traffic.to_dict(params=n_params, learners=len(self.learners)),
            **summarise_tape(tape, self.layout.num_fragments),
        )


def _nbytes(msg: Any) -> int:
    """What a message costs on the wire: its tensors' bytes (the encoded payloads of a compressed
    one, ``protocol.traffic.payload_nbytes``) plus a header."""
    return HEADER_BYTES + payload_nbytes(msg)
