"""Deterministic virtual-time runtime: M real torch learners and the syncer in one process.

Every duration comes from the cost model in ``VirtualTimeConfig`` (step time / speed x straggler
factor x noise, transfer = latency + bytes / bandwidth), never from the wall clock. Events run
in (time, actor, sequence) order on one thread, so the same config and seed give bit-identical
results. Chaos, data and speed noise each draw from their own seeded stream.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ddiloco.chaos.schedule import ChaosSchedule, make_schedule
from ddiloco.config import Config
from ddiloco.core.fragments import read_fragment, write_fragment
from ddiloco.core.learner import LearnerCore
from ddiloco.core.messages import Ack, FragmentRequest, FragmentUpdate, Heartbeat, Join, LearnerMessage
from ddiloco.core.syncer import Output, Syncer
from ddiloco.core.tape import TapeRecord
from ddiloco.report.accounting import TimeAccount, fleet_goodput, uptime
from ddiloco.report.result import RunResult, summarise_tape
from ddiloco.training.evaluate import evaluate
from ddiloco.training.inner import inner_step, lr_at, make_optimizer
from ddiloco.training.layout import ModelLayout, layout_for
from ddiloco.workloads.base import DataStream, Workload, loss_unit

SYNCER = 1 << 30  # actor id of the syncer in the event order (after every learner)
MAX_TIME_FACTOR = 4.0
"""A token-budget run that has not processed its tokens by this multiple of T ends there."""


@dataclass
class SimLearner:
    """One learner's model, optimizer, data and protocol state inside the simulation."""

    id: int
    model: nn.Module
    params: dict[str, torch.Tensor]
    opt: torch.optim.Optimizer
    stream: DataStream
    core: LearnerCore
    speed: float
    noise: np.random.Generator
    account: TimeAccount = field(default_factory=TimeAccount)
    gen: int = 0  # incarnation: events of a failed incarnation are dropped
    inbox: list[FragmentUpdate] = field(default_factory=list)
    lost_steps: float = 0.0
    failures: int = 0
    loss: float | None = None  # the last inner step's training loss
    bytes_sent: int = 0  # contribution bytes of this incarnation
    incarnation_start: tuple[float, int, int] = (0.0, 0, 0)  # (busy_s, tokens, steps) at its start

    def busy_s(self, now: float) -> float:
        """Seconds in inner steps so far, all incarnations."""
        busy = self.account.totals["compute"]
        return busy + (now - self.account.since if self.account.state == "compute" else 0.0)

    @property
    def up(self) -> bool:
        return self.account.state in ("compute", "blocked")


class Simulation:
    """Runs one configured method in virtual time and returns a RunResult."""

    SAMPLES = 200
    """Per-learner records (metrics/learners.jsonl) over a run's virtual time budget."""

    def __init__(
        self,
        cfg: Config,
        workload: Workload,
        on_progress: Callable[[float, float], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        """``should_stop``: polled between events; True ends the run early (a partial result)."""
        self.cfg, self.wl, self.on_progress = cfg, workload, on_progress
        self.should_stop = should_stop
        self.interrupted = False
        self.samples: list[dict[str, Any]] = []
        a, s, r = cfg.algo, cfg.sim, cfg.run
        torch.use_deterministic_algorithms(True)
        base = workload.build_model(r.seed)
        self.model_layout: ModelLayout = layout_for(base, workload, a)
        self.layout = self.model_layout.fragments
        self.syncer = Syncer(a, self.layout, dict(base.named_parameters()), self.model_layout.embedding_like)
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
                    dict(model.named_parameters()),
                    make_optimizer(model, cfg.inner),
                    stream,
                    LearnerCore(a, m, self.layout.num_fragments),
                    speeds[m],
                    np.random.default_rng([r.seed, 0x5EED, m]),
                )
            )
        first = self.learners[0].stream.next_batch()
        self.learners[0].stream.seek(0)
        self.tokens_per_step = first.tokens
        steps = math.ceil(r.processed_tokens / (m_count * self.tokens_per_step))
        self.horizon = steps * s.step_time_s  # T: a healthy fleet's time for the budget
        # A token budget ends the run when the fleet has processed N tokens; this bound only
        # stops a run that cannot get there (every learner down, or waiting for ever).
        self.time_limit = self.horizon if r.budget == "time" else MAX_TIME_FACTOR * self.horizon
        self.end_time = self.horizon
        self.processed = 0  # tokens of every applied inner step, all learners
        self.ending = False  # the run is over: no more steps, messages are applied at once
        self.eval_tokens = [r.processed_tokens * k / (r.eval_points + 1) for k in range(1, r.eval_points + 1)]
        self.chaos: ChaosSchedule = make_schedule(cfg.chaos, m_count, self.horizon, r.seed)
        self.fragment_bytes = [4 * n for n in self.layout.sizes()]
        self.net = np.random.default_rng([r.seed, 0x7E7])  # network jitter stream
        self.events: list[tuple[float, int, int, str, Any]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.evals: list[dict[str, float]] = []
        self.log: list[dict[str, Any]] = []
        self._wakes: set[float] = set()
        self._next_sample = 0.0

    # -- event plumbing --------------------------------------------------------------------

    def _at(self, t: float, actor: int, kind: str, data: Any = None) -> None:
        heapq.heappush(self.events, (t, actor, next(self.seq), kind, data))

    def _transfer_s(self, nbytes: int) -> float:
        """Latency + jitter + bytes / bandwidth."""
        s = self.cfg.sim
        jitter = float(self.net.exponential(s.jitter_s)) if s.jitter_s > 0 else 0.0
        return s.latency_s + jitter + nbytes * 8 / (s.bandwidth_gbps * 1e9)

    def _to_syncer(self, msg: Any, nbytes: int = 64) -> None:
        self._at(self.now + self._transfer_s(nbytes), SYNCER, "syncer_msg", msg)

    def _dispatch(self, out: Output) -> None:
        """Keep the tape; deliver requests after a latency, updates after merge + transfer."""
        self.tape += out.tape
        outs = out.messages
        merged: dict[int, int] = {}
        for o in outs:
            if isinstance(o, FragmentUpdate) and o.reason == "merged":
                merged[o.fragment] = merged.get(o.fragment, 0) + 1
        for o in outs:
            if isinstance(o, FragmentRequest):
                self._at(self.now + self._transfer_s(64), o.learner, "learner_msg", o)
            else:
                nbytes = self.fragment_bytes[o.fragment]
                merge_s = merged.get(o.fragment, 0) * nbytes / (self.cfg.sim.merge_gbps * 1e9)
                self._at(self.now + merge_s + self._transfer_s(nbytes), o.learner, "learner_msg", o)
        deadline = self.syncer.next_deadline(self.now)
        if deadline is not None and deadline not in self._wakes:
            self._wakes.add(deadline)
            self._at(deadline, SYNCER, "syncer_wake")

    # -- learners --------------------------------------------------------------------------

    def _step_duration(self, ln: SimLearner) -> float:
        d = self.cfg.sim.step_time_s / ln.speed * self.chaos.slowdown(ln.id, self.now)
        if self.cfg.sim.speed_noise > 0:
            d *= max(0.2, 1.0 + self.cfg.sim.speed_noise * float(ln.noise.standard_normal()))
        return d

    def _start_step(self, ln: SimLearner) -> None:
        d = self._step_duration(ln)
        self._at(self.now + d, ln.id, "step_end", (ln.gen, d))

    def _on_step_end(self, ln: SimLearner, gen: int, duration: float) -> None:
        if gen != ln.gen or self.ending:
            return  # a step of a dead incarnation, or one that would end after the run
        batch = ln.stream.next_batch()
        lr = lr_at(ln.core.lr_tokens(), self.cfg.run.processed_tokens, self.cfg.inner)
        ln.model.train()
        loss = self.wl.loss(ln.model, batch)
        inner_step(ln.model, ln.opt, loss, lr, self.cfg.inner.grad_clip)
        ln.loss = float(loss.detach())
        if self.now >= self._next_sample:
            self._sample()
        sends = ln.core.on_step(batch.tokens)
        self.processed += batch.tokens
        if self.cfg.run.budget == "tokens":
            while self.eval_tokens and self.processed >= self.eval_tokens[0]:
                self.eval_tokens.pop(0)
                self._record_eval()
                if self.on_progress:
                    self.on_progress(self.horizon * self.processed / self.cfg.run.processed_tokens, self.horizon)
            if self.processed >= self.cfg.run.processed_tokens:
                self.ending = True  # the budget is spent: this was the run's last step
        self._to_syncer(Heartbeat(ln.id, ln.gen, ln.core.step, duration))
        for p in sends:
            self._send_fragment(ln, p)
        for u in ln.inbox:
            self._apply(ln, u)
        ln.inbox.clear()
        self._continue_or_block(ln)

    def _continue_or_block(self, ln: SimLearner) -> None:
        if ln.core.blocking_fragments(self.now):
            if ln.account.state != "blocked":
                ln.account.switch("blocked", self.now)
            deadline = ln.core.block_deadline()
            if deadline is not None:
                self._at(deadline, ln.id, "unblock_check", ln.gen)
            self._at(self.now + self.cfg.algo.liveness_timeout_s / 4, ln.id, "blocked_heartbeat", ln.gen)
        else:
            if ln.account.state != "compute":
                ln.account.switch("compute", self.now)
            self._start_step(ln)

    def _send_fragment(self, ln: SimLearner, p: int) -> None:
        values = read_fragment(ln.params, self.layout.fragments[p])
        ln.bytes_sent += self.fragment_bytes[p]
        self._to_syncer(ln.core.contribution(p, values, ln.stream.position), self.fragment_bytes[p])

    def _apply(self, ln: SimLearner, u: FragmentUpdate) -> None:
        receipt = ln.core.on_update(u)
        if receipt.mode == "ignore":
            return
        write_fragment(ln.params, self.layout.fragments[u.fragment], u.values, receipt.alpha)
        self._to_syncer(Ack(ln.id, ln.gen, u.fragment, u.version))

    def _on_learner_msg(self, ln: SimLearner, msg: Any) -> None:
        if not ln.up:
            return  # a dead process receives nothing
        if isinstance(msg, FragmentRequest):
            ln.core.on_request(msg.fragment)
            self._send_fragment(ln, msg.fragment)  # from the host copy: training never pauses
        elif self.ending:
            self._apply(ln, msg)  # training has stopped: nothing to wait for
        elif ln.account.state == "blocked":
            self._apply(ln, msg)
            self._continue_or_block(ln)
        else:
            ln.inbox.append(msg)  # applied between inner steps

    # -- chaos -----------------------------------------------------------------------------

    def _on_fail(self, ln: SimLearner, restart_at: float, back_at: float) -> None:
        ln.gen += 1
        ln.failures += 1
        ln.lost_steps += sum(ln.core.steps) / len(ln.core.steps)  # steps not yet contributed
        ln.inbox.clear()
        ln.account.switch("down", self.now)
        ln.bytes_sent, ln.loss = 0, None
        self.log.append({"event": "fail", "learner": ln.id, "time": self.now})
        self._at(restart_at, ln.id, "restart_begin", None)
        self._at(back_at, ln.id, "rejoin", None)

    def _on_rejoin(self, ln: SimLearner) -> None:
        """Fetch every global fragment, warm the inner optimizer from a live peer, resume data."""
        ln.core.incarnation = ln.gen  # a new process: the syncer drops its predecessor's messages
        out = self.syncer.handle(Join(ln.id, ln.gen, []), self.now)
        joins = [o for o in out.messages if isinstance(o, FragmentUpdate) and o.learner == ln.id and o.reason == "join"]
        out.messages = [o for o in out.messages if not any(o is j for j in joins)]
        ln.core.on_rejoin(self.syncer.max_step_seen)
        for u in joins:
            self._apply(ln, u)
        peer = next((p for p in self.learners if p.up and p.id != ln.id), None)
        ln.opt = make_optimizer(ln.model, self.cfg.inner)
        if peer is not None:
            ln.opt.load_state_dict(copy.deepcopy(peer.opt.state_dict()))
        ln.stream.seek(self.syncer.data_position(ln.id))
        self.log.append(
            {"event": "rejoin", "learner": ln.id, "time": self.now, "peer": None if peer is None else peer.id}
        )
        ln.account.switch("compute", self.now)
        ln.incarnation_start = (ln.busy_s(self.now), ln.core.tokens_processed, ln.core.step)
        self._dispatch(out)
        self._start_step(ln)

    # -- evaluation ------------------------------------------------------------------------

    def _evaluate(self) -> float:
        self.eval_model.load_state_dict(self.syncer.global_state(), strict=False)
        return evaluate(self.wl, self.eval_model, self.eval_batches)

    def _record_eval(self, final: bool = False) -> None:
        loss = self._evaluate()
        self.evals.append(
            {
                "time": self.now,
                "tokens": sum(ln.core.tokens_processed for ln in self.learners),
                "merged_tokens": self.syncer.global_tokens,
                "loss": loss,
                "final": final,
            }
        )

    # -- main loop -------------------------------------------------------------------------

    def run(self) -> RunResult:
        for ln in self.learners:  # every learner starts from the initial global values (version 0)
            self._dispatch(self.syncer.handle(Join(ln.id, ln.gen, [0] * self.layout.num_fragments), 0.0))
            self._start_step(ln)
        for o in self.chaos.outages:
            restart_at = max(o.start_s, o.end_s - self.chaos.restart_s)
            self._at(o.start_s, o.learner, "fail", (restart_at, o.end_s))
        if self.cfg.run.budget == "time":  # else evaluations follow the tokens (_on_step_end)
            for k in range(1, self.cfg.run.eval_points + 1):
                self._at(self.horizon * k / (self.cfg.run.eval_points + 1), SYNCER + 1, "eval")
        handlers = {
            "step_end": lambda ln, d: self._on_step_end(ln, *d),
            "learner_msg": self._on_learner_msg,
            "fail": lambda ln, d: self._on_fail(ln, *d),
            "restart_begin": lambda ln, d: ln.account.switch("restarting", self.now),
            "rejoin": lambda ln, d: self._on_rejoin(ln),
            "unblock_check": lambda ln, gen: gen == ln.gen
            and ln.account.state == "blocked"
            and self._continue_or_block(ln),
            "blocked_heartbeat": lambda ln, gen: gen == ln.gen
            and ln.account.state == "blocked"
            and self._blocked_heartbeat(ln),
        }
        self.handlers = handlers
        self._run_until(self.time_limit, stop_when_ending=True)
        if not self.ending and not self.interrupted:
            self.now = self.time_limit  # the time budget (or the safety bound) is what ended it
        self.end_time = self.now
        self.ending = True
        for ln in self.learners:
            ln.account.close(self.end_time)
        if self.interrupted:  # keep what was done: close the open rounds, no final sync
            self._dispatch(self.syncer.flush(self.now, final=True))
        else:
            self._final_sync()
        self._sample()
        self._record_eval(final=True)
        if self.on_progress:
            self.on_progress(self.end_time, self.end_time)
        return self._result()

    def _run_until(self, limit: float, stop_when_ending: bool = False, messages_only: bool = False) -> None:
        """Process events in order up to ``limit`` (each kind by its handler)."""
        while self.events and self.events[0][0] <= limit and not (stop_when_ending and self.ending):
            if stop_when_ending and self.should_stop is not None and self.should_stop():
                self.interrupted = True
                return
            t, actor, _, kind, data = heapq.heappop(self.events)
            if messages_only and kind not in ("syncer_msg", "syncer_wake", "learner_msg"):
                continue  # after the run: no steps, faults or scheduled evaluations
            self.now = t
            if kind == "syncer_msg":
                self._dispatch(self._syncer_receive(data))
            elif kind == "syncer_wake":
                self._wakes.discard(t)
                self._dispatch(self.syncer.poll(t))
            elif kind == "eval":
                self._record_eval()
                if self.on_progress:
                    self.on_progress(t, self.horizon)
            else:
                self.handlers[kind](self.learners[actor], data)

    def _final_sync(self) -> None:
        """Merge every live learner's remaining progress, as the real syncer does at a run's
        end: close the open rounds, let the learners apply those versions, then one final round
        of every fragment asks each live learner for what it has not contributed yet."""
        bound = self.cfg.algo.liveness_timeout_s + 1.0  # a silent learner stops being waited for
        self._dispatch(self.syncer.flush(self.now, final=True))
        self._run_until(self.now + bound, messages_only=True)
        self._dispatch(self.syncer.final_sync(self.now))
        self._run_until(self.now + bound, messages_only=True)
        self._dispatch(self.syncer.flush(self.now, final=True))  # whatever a silent learner left open

    def _sample(self) -> None:
        """One metrics/learners.jsonl record per learner (counters of its current incarnation)."""
        self._next_sample = self.now + self.horizon / self.SAMPLES
        for ln in self.learners:
            busy0, tokens0, steps0 = ln.incarnation_start
            state = "up" if ln.up else "down"
            self.samples.append(
                {
                    "event": "learner",
                    "time": self.now,
                    "learner": ln.id,
                    "incarnation": ln.gen,
                    "state": state,
                    "steps": ln.core.step - steps0 if state == "up" else 0,
                    "tokens": ln.core.tokens_processed - tokens0 if state == "up" else 0,
                    "busy_s": ln.busy_s(self.now) - busy0 if state == "up" else 0.0,
                    "loss": ln.loss,
                    "bytes_sent": ln.bytes_sent,
                }
            )

    def _blocked_heartbeat(self, ln: SimLearner) -> None:
        self._to_syncer(Heartbeat(ln.id, ln.gen, ln.core.step, 0.0))
        self._at(self.now + self.cfg.algo.liveness_timeout_s / 4, ln.id, "blocked_heartbeat", ln.gen)

    def _syncer_receive(self, msg: LearnerMessage) -> Output:
        return self.syncer.handle(msg, self.now)

    def _result(self) -> RunResult:
        gp = fleet_goodput([ln.account for ln in self.learners], self.end_time)
        need = self.cfg.algo.quorum_size or 1
        outages = [(o.learner, o.start_s, o.end_s) for o in self.chaos.outages]
        processed = sum(ln.core.tokens_processed for ln in self.learners)
        tape = [r.to_json() for r in self.tape]
        return RunResult(
            method=self.cfg.run.method,
            final_loss=self.evals[-1]["loss"],
            evals=self.evals,
            horizon_s=self.end_time,
            tokens_processed=processed,
            tokens_merged=self.syncer.global_tokens,
            goodput=gp,
            uptime=uptime(outages, len(self.learners), min(need, len(self.learners)), self.end_time),
            lost_steps=sum(ln.lost_steps for ln in self.learners),
            failures=sum(ln.failures for ln in self.learners),
            num_fragments=self.layout.num_fragments,
            tape=tape,
            log=self.log,
            state={k: v.detach().clone() for k, v in self.eval_model.state_dict().items()},
            samples=self.samples,
            num_learners=len(self.learners),
            loss_unit=loss_unit(self.wl),
            partial=self.interrupted,
            **summarise_tape(tape, self.layout.num_fragments),
        )
