"""Single rules of the learner session that the state-machine test (test_protocol_fuzz.py)
reaches only by chance."""

from __future__ import annotations

import torch

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.messages import Contribution, FragmentUpdate
from ddiloco.protocol.config import RuntimeConfig
from ddiloco.protocol.learner_session import BoundaryPlan, LearnerSession, Registration
from ddiloco.protocol.messages import JoinReply

SPECS = [TensorSpec("w", (3, 2)), TensorSpec("b", (2,))]
LAYOUT = balanced_layout(SPECS, 2)
REGISTRATION = Registration([[s.name, list(s.shape)] for s in SPECS], LAYOUT.digest())
CFG = DiLoCoConfig(num_fragments=2, sync_every=4)
RT = RuntimeConfig(heartbeat_interval_s=0.5, join_timeout_s=3.0)


def session() -> LearnerSession:
    return LearnerSession(CFG, RT, 0, 1, LAYOUT, REGISTRATION, 0.0)


def values(p: int) -> list[torch.Tensor]:
    return [torch.zeros(pc.row_end - pc.row_start, *pc.shape[1:]) for pc in LAYOUT.fragments[p]]


def test_a_fragment_both_asked_for_and_due_is_sent_once():
    s = session()
    out = s.complete(BoundaryPlan(answer=[0], push=[0, 1]), {0: values(0), 1: values(1)})
    sent = [x.msg.fragment for x in out.send if isinstance(x.msg, Contribution)]
    assert sorted(sent) == [0, 1]


def test_an_accepted_learner_past_its_join_timeout_trains_and_its_next_deadline_is_ahead():
    s = session()
    s.tick(0.0)
    s.receive(0, JoinReply(True, "", 1, 0, [0, 1]), 0.1)  # accepted, but no fragment ever arrives
    assert not s.ready(3.0)  # the acceptance was progress: the silence counts from 0.1
    assert s.next_deadline(3.0) <= 3.1  # it wakes when the wait for the fragments ends
    assert s.ready(3.1)
    for now in (3.1, 7.3, 60.0):
        s.tick(now)
        assert s.next_deadline(now) > now  # never a deadline in the past: the comm thread would spin


def test_the_join_waits_from_when_the_driver_starts_talking_not_from_the_sessions_creation():
    """A restarted learner reads its saved state (seconds for a large model) between making its
    session and starting its comm thread, and then holds every fragment already: its join's
    silence counts from ``join_begins``, or it would give up before its first registration."""
    s = session()  # made at 0.0
    s.received = {0, 1}  # (as a saved state taken back leaves it)
    s.join_begins(12.0)  # the driver starts talking 12 s later (join_timeout_s = 3)
    assert s.join_deadline == 15.0 and not s.ready(12.5)
    s.receive(0, JoinReply(True, "", 1, 0, [0, 1]), 12.6)
    assert s.ready(12.6)  # accepted holding every fragment: it trains at once
    s.join_begins(20.0)  # (a later call changes nothing once it has joined)
    assert s.join_deadline == 15.0


def test_fragments_without_the_accepting_reply_are_not_a_join():
    s = session()
    s.tick(0.0)
    for p in (0, 1):  # the join's fragments arrive; the reply that accepted the learner was lost
        s.receive(0, FragmentUpdate(0, p, 1, values(p), 0.0, 1, 0, "join"), 0.1)
    plan = s.boundary(0.2)
    assert len(plan.apply) == 2 and s.received == {0, 1}
    assert not s.ready(100.0)  # it registers again (and learns where its data resumes) instead of training


def test_a_wait_for_a_fragment_is_not_busy_time():
    s = session()
    s.step(16, 0.5, 0.5)
    s.step(16, 2.0, 2.5, waited_s=1.25)  # a lock-step learner waited 1.25 s of its 2 s for a fragment
    assert s.busy_s == 0.5 + 0.75
    hb = s._heartbeat()
    assert hb.busy_s == 1.25 and hb.step_time_s == 0.625  # the mean busy step, what the step clock takes


def test_the_boundary_executor_writes_in_order_and_serves_a_state_a_piece_per_boundary():
    from ddiloco.core.learner import Receipt
    from ddiloco.protocol.boundary import BoundaryExecutor
    from ddiloco.protocol.messages import PeerState

    calls: list[tuple] = []

    class Source:
        copy_s = 0.0

        def __init__(self, to: int) -> None:
            self.left = 2

        @property
        def done(self) -> bool:
            return self.left == 0

        def piece(self, budget_bytes: int) -> PeerState | None:
            calls.append(("piece", budget_bytes))
            self.left -= 1
            return PeerState(1, 0, [{"ddiloco_piece": 0}] if self.left else [], {"0.step": torch.ones(1)})

    class Host:
        def write(self, p, values, alpha, add):
            calls.append(("write", p, alpha, add))

        def read(self, p):
            calls.append(("read", p))
            return values(p)

        def load_peer_state(self, state):
            calls.append(("load", state.source))

        def serve(self, learner):
            return Source(learner)

    ex = BoundaryExecutor(Host())
    update = FragmentUpdate(0, 1, 1, values(1), 0.0, 1, 0, "merged")
    plan = BoundaryPlan(
        move=[(0, values(0))], apply=[(update, Receipt("blend", 0.25))], serve=[1], prepare=[0],
        peer_state=PeerState(0, 2, [], {"0.step": torch.ones(1)}),
    )  # fmt: skip
    out = ex.run(plan, session())
    floor = 4 << 20  # the session's budget before its driver measured anything (``protocol/handoff.py``)
    assert calls == [("write", 0, 0.0, True), ("write", 1, 0.25, False), ("load", 2), ("read", 0), ("piece", floor)]
    assert [type(x.msg).__name__ for x in out.send] == ["Ack", "PeerState"]  # the first of two pieces
    assert len(ex.serving) == 1
    out = ex.run(BoundaryPlan(), session())
    assert [x.msg.param_groups for x in out.send] == [[]] and ex.serving == []  # the last piece: done
    assert ex.run(BoundaryPlan(), None) is None  # a rank without a session sends nothing


def test_a_join_whose_fragment_was_lost_ends_although_other_fragments_keep_coming():
    """Fragment 1 of the join was lost (a dropped message); fragment 0 keeps coming (later
    merges). Only a fragment it did not have is progress: the wait ends join_timeout_s after
    the last one, and the learner trains on from what it has (a lost fragment's answer is
    rebased by the syncer). Counting every arrival kept a learner joining for ever."""
    s = session()
    s.tick(0.0)
    s.receive(0, JoinReply(True, "", 1, 0, [0, 1]), 0.1)
    s.receive(0, FragmentUpdate(0, 0, 1, values(0), 0.0, 1, 0, "join"), 0.2)
    s.boundary(0.2)
    for k in range(1, 20):  # fragment 0's merges, every half second
        now = 0.2 + 0.5 * k
        s.receive(0, FragmentUpdate(0, 0, 1 + k, values(0), 0.0, 1, 0, "merged"), now)
        s.boundary(now)
    assert s.received == {0} and s.ready(3.2 + 1e-9)  # 3 s after fragment 0 first came
