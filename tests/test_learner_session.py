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


def test_fragments_without_the_accepting_reply_are_not_a_join():
    s = session()
    s.tick(0.0)
    for p in (0, 1):  # the join's fragments arrive; the reply that accepted the learner was lost
        s.receive(0, FragmentUpdate(0, p, 1, values(p), 0.0, 1, 0, "join"), 0.1)
    plan = s.boundary(0.2)
    assert len(plan.apply) == 2 and s.received == {0, 1}
    assert not s.ready(100.0)  # it registers again (and learns where its data resumes) instead of training
