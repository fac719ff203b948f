"""A hypothesis state machine drives both protocol sessions at once: any message, in any state,
in any order.

One syncer session and two learner sessions talk over a network that the machine controls:
messages are delivered in any order, dropped or duplicated; time advances by any amount; the
learners step; and a stranger injects arbitrary messages (within the wire's bounds, as a
decoded message would be) at both ends. After every step no exception has escaped, and the
run's invariants (``report/invariants.py``) hold on the tape so far, the syncer's versions never
go backwards and its global values stay finite.
"""

from __future__ import annotations

import math

import torch
from helpers import SESSION_CFG, SESSION_LAYOUT, SESSION_PARAMS, SESSION_REGISTRATION, SESSION_RT, SESSION_SPECS
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ddiloco.core.messages import Ack, Contribution, FragmentRequest, FragmentUpdate, Heartbeat, Leave
from ddiloco.core.syncer import Syncer
from ddiloco.protocol.learner_session import LearnerSession
from ddiloco.protocol.messages import (
    FetchGlobal,
    JoinReply,
    PeerState,
    PeerStateRequest,
    Register,
    RunEnd,
    StatusRequest,
    SyncerHeartbeat,
)
from ddiloco.protocol.syncer_session import Budget, SyncerSession
from ddiloco.report.invariants import check_run

SPECS, LAYOUT, PARAMS = SESSION_SPECS, SESSION_LAYOUT, SESSION_PARAMS
REGISTRATION, CFG, RT = SESSION_REGISTRATION, SESSION_CFG, SESSION_RT
LEARNERS = (0, 1)

ids = st.integers(0, 3)
small = st.integers(0, 50)
floats = st.floats(-1e6, 1e6) | st.sampled_from([math.nan, math.inf, -math.inf, 1e30])


def tensors(shape: tuple[int, ...]) -> st.SearchStrategy[torch.Tensor]:
    n = math.prod(shape)
    return st.lists(floats, min_size=n, max_size=n).map(lambda xs: torch.tensor(xs, dtype=torch.float32).reshape(shape))


def fragment_values(p: int) -> st.SearchStrategy[list[torch.Tensor]]:
    return st.tuples(*(tensors(pc.shape) for pc in LAYOUT.fragments[p])).map(list)


values_any = st.integers(0, 1).flatmap(fragment_values) | st.just([torch.zeros(5)])

# What a stranger (or a confused peer) may send the syncer: every kind, fields within their wire bounds.
to_syncer = st.one_of(
    st.builds(Register, ids, small, st.just(PARAMS) | st.just([["w", [9]]]), st.just(LAYOUT.digest()) | st.just("x"),
              st.lists(small, max_size=3)),
    st.builds(Heartbeat, ids, small, small, st.floats(0, 86400), small, st.floats(0, 1e4), st.floats(-1, 10), small),
    st.builds(Contribution, ids, small, ids, small, small, values_any, small, st.integers(0, 10**6), small, small),
    st.builds(Ack, ids, small, ids, small),
    st.builds(Leave, ids, small),
    st.builds(PeerStateRequest, ids, small),
    st.builds(PeerState, ids, st.integers(-1, 3), st.just([]), st.just({})),
    st.builds(FetchGlobal, st.just("fuzz"), st.dictionaries(st.sampled_from(["0", "1", "2", "01", "x"]), small,
                                                           max_size=5), st.booleans()),
    st.builds(StatusRequest, st.just("fuzz")),
)  # fmt: skip
# What a confused or hostile syncer may send a learner.
to_learner = st.one_of(
    st.builds(SyncerHeartbeat, small, st.just(0)),
    st.builds(JoinReply, st.booleans(), st.just("because"), small, small, st.just([0, 1]), st.floats(0, 5)),
    st.builds(RunEnd, st.sampled_from(["stop", "done"]), st.just("fuzz")),
    st.builds(FragmentRequest, ids, ids, small),
    st.integers(0, 1).flatmap(
        lambda p: st.builds(FragmentUpdate, ids, st.just(p), small, fragment_values(p), st.floats(0, 1e9),
                            st.integers(1, 4), small, st.sampled_from(["merged", "join", "stale"]))
    ),
    st.builds(PeerState, ids, st.integers(-1, 3), st.just([]), st.just({})),
    st.builds(PeerStateRequest, ids, small),
)  # fmt: skip


class TwoSessions(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        initial = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
        core = Syncer(CFG, LAYOUT, initial, [False] * sum(len(f) for f in LAYOUT.fragments))
        self.syncer = SyncerSession(core, RT, Budget(processed_tokens=800), REGISTRATION, 0.0)
        self.learners = {
            m: LearnerSession(CFG, RT, m, 1, LAYOUT, REGISTRATION, 0.0, wants_peer_state=True) for m in LEARNERS
        }
        self.values = {m: {"w": torch.zeros(3, 2), "b": torch.zeros(2)} for m in LEARNERS}
        self.to_syncer: list[tuple[int, object]] = []
        self.to_learners: list[tuple[int, object]] = []
        self.tape: list[dict] = []
        self.versions = core.versions()
        for m in LEARNERS:
            self._from_learner(m, self.learners[m].tick(0.0).send)

    def _from_learner(self, m: int, sends) -> None:
        self.to_syncer += [(m, s.msg) for s in sends]

    def _from_syncer(self, out) -> None:
        self.tape += [r.to_json() for r in out.tape]
        self.to_learners += [(peer, msg) for peer, msg in out.send if peer in LEARNERS]

    def _read(self, m: int, p: int) -> list[torch.Tensor]:
        return [self.values[m][pc.name][pc.row_start : pc.row_end].clone() for pc in LAYOUT.fragments[p]]

    def _boundary(self, m: int, plan) -> None:
        for u, _receipt in plan.apply:
            for pc, v in zip(LAYOUT.fragments[u.fragment], u.values):
                self.values[m][pc.name][pc.row_start : pc.row_end] = v
        out = self.learners[m].complete(plan, {p: self._read(m, p) for p in plan.read})
        self._from_learner(m, out.send)

    # -- the network ---------------------------------------------------------------------------

    @precondition(lambda self: self.to_syncer)
    @rule(i=st.integers(0, 1000), keep=st.booleans())
    def deliver_to_syncer(self, i: int, keep: bool) -> None:
        """Any message in flight arrives (out of order), and may arrive again later (duplicated)."""
        peer, msg = self.to_syncer[i % len(self.to_syncer)]
        if not keep:
            self.to_syncer.remove((peer, msg))
        self._from_syncer(self.syncer.receive(peer, msg, self.now))

    @precondition(lambda self: self.to_learners)
    @rule(i=st.integers(0, 1000), keep=st.booleans())
    def deliver_to_learner(self, i: int, keep: bool) -> None:
        peer, msg = self.to_learners[i % len(self.to_learners)]
        if not keep:
            self.to_learners.remove((peer, msg))
        self._from_learner(peer, self.learners[peer].receive(0, msg, self.now).send)

    @precondition(lambda self: self.to_syncer or self.to_learners)
    @rule(i=st.integers(0, 1000))
    def drop(self, i: int) -> None:
        queue = self.to_syncer if self.to_syncer else self.to_learners
        queue.pop(i % len(queue))

    @rule(steps=st.integers(1, 12))
    def converse(self, steps: int) -> None:
        """A healthy stretch: both learners step, and every message in flight arrives in order."""
        for _ in range(steps):
            for m in LEARNERS:
                self.step(m, 0.5, 16)
                self._from_learner(m, self.learners[m].tick(self.now).send)
            for _ in range(50):  # until the network is quiet (bounded: answers beget answers)
                if not (self.to_syncer or self.to_learners):
                    break
                while self.to_syncer:
                    peer, msg = self.to_syncer.pop(0)
                    self._from_syncer(self.syncer.receive(peer, msg, self.now))
                while self.to_learners:
                    peer, msg = self.to_learners.pop(0)
                    self._from_learner(peer, self.learners[peer].receive(0, msg, self.now).send)
            self._from_syncer(self.syncer.tick(self.now))

    # -- time and training -----------------------------------------------------------------------

    @rule(dt=st.floats(0.0, 3.0))
    def advance(self, dt: float) -> None:
        self.now += dt
        self._from_syncer(self.syncer.tick(self.now))
        for m in LEARNERS:
            self._from_learner(m, self.learners[m].tick(self.now).send)
        # Just ticked, nothing is due now: a driver that waits until the next deadline never
        # spins (a deadline in the past would wake it at once, forever).
        assert self.syncer.next_deadline(self.now) > self.now
        for m in LEARNERS:
            deadline = self.learners[m].next_deadline(self.now)
            assert deadline is None or deadline > self.now

    @rule(m=st.sampled_from(LEARNERS), duration=st.floats(0.0, 2.0), tokens=st.integers(0, 64))
    def step(self, m: int, duration: float, tokens: int) -> None:
        self.now += duration
        with torch.no_grad():
            for t in self.values[m].values():
                t.add_(0.01)
        self._boundary(m, self.learners[m].step(tokens, duration, self.now))

    @rule(m=st.sampled_from(LEARNERS))
    def idle_boundary(self, m: int) -> None:
        self._boundary(m, self.learners[m].boundary(self.now))

    # -- a stranger ----------------------------------------------------------------------------

    @rule(peer=st.integers(0, 5), msg=to_syncer)
    def inject_to_syncer(self, peer: int, msg: object) -> None:
        self._from_syncer(self.syncer.receive(peer, msg, self.now))

    @rule(m=st.sampled_from(LEARNERS), shard=st.integers(-1, 2), msg=to_learner)
    def inject_to_learner(self, m: int, shard: int, msg: object) -> None:
        self._from_learner(m, self.learners[m].receive(shard, msg, self.now).send)

    # -- what must hold --------------------------------------------------------------------------

    @invariant()
    def versions_never_go_back_and_values_stay_finite(self) -> None:
        versions = self.syncer.core.versions()
        assert all(v >= old for v, old in zip(versions, self.versions))
        self.versions = versions
        for frag in self.syncer.core.fragments:
            assert all(bool(torch.isfinite(v).all()) for v in frag.values)

    @invariant()
    def the_runs_invariants_hold(self) -> None:
        assert check_run(self.tape) == []


TwoSessions.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_both_sessions_take_any_message_in_any_state = TwoSessions.TestCase
