"""Thin links must not break the protocol (issue 20, item 4), as pure sessions in virtual time:
a join waits as long as its fragments keep coming and gives up only after a silence; any
message counts as liveness, on both sides, so heartbeats queued behind a large transfer do not
make a live peer look dead. No wall clock anywhere: every time is handed in."""

from __future__ import annotations

import torch
from helpers import SESSION_CFG, SESSION_LAYOUT, SESSION_REGISTRATION

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.messages import Ack, FragmentRequest, FragmentUpdate
from ddiloco.core.syncer import Syncer
from ddiloco.protocol.config import RuntimeConfig
from ddiloco.protocol.learner_session import LearnerSession, Registration
from ddiloco.protocol.messages import JoinReply, Register, SyncerHeartbeat
from ddiloco.protocol.syncer_session import Budget, SyncerSession

torch.set_num_threads(1)

P = 8
SPECS = [TensorSpec(f"w{i}", (4, 4)) for i in range(P)]
LAYOUT = balanced_layout(SPECS, P)
REGISTRATION = Registration([[s.name, list(s.shape)] for s in SPECS], LAYOUT.digest())
CFG = DiLoCoConfig(num_fragments=P, sync_every=16)
RT = RuntimeConfig(heartbeat_interval_s=0.5, syncer_liveness_s=5.0, join_timeout_s=3.0)


def session(rt: RuntimeConfig = RT) -> LearnerSession:
    return LearnerSession(CFG, rt, 0, 1, LAYOUT, REGISTRATION, 0.0)


def update(p: int, version: int = 1, reason: str = "join") -> FragmentUpdate:
    values = [torch.zeros(pc.row_end - pc.row_start, *pc.shape[1:]) for pc in LAYOUT.fragments[p]]
    return FragmentUpdate(0, p, version, values, 0.0, 1, 0, reason)  # type: ignore[arg-type]


def accepted() -> JoinReply:
    return JoinReply(True, "", 7, 0, list(range(P)))


# -- the join follows progress ----------------------------------------------------------------


def test_a_slow_but_steady_join_never_times_out() -> None:
    """A fragment every 2.5 s, under the 3 s silence: the join takes 20 s, far past 3 s from
    the start, and the learner waits for all of it, saying how far it has come."""
    s = session()
    s.tick(0.0)
    s.receive(0, accepted(), 0.5)
    info: list[str] = []
    now = 0.5
    for p in range(P):
        now += 2.5
        assert not s.ready(now - 0.01)  # still waiting, just before the fragment comes
        info += s.receive(0, update(p), now).info
        s.boundary(now)
        s.tick(now)
    assert s.received == set(range(P)) and s.ready(now)
    assert info and "joining:" in info[0] and f"{P}/{P} fragments" in info[-1]
    assert " MB in " in info[-1]


def test_silence_ends_the_join_and_a_late_fragment_does_not_take_it_back() -> None:
    s = session()
    s.tick(0.0)
    s.receive(0, accepted(), 0.2)
    for p, t in ((0, 1.0), (1, 3.5)):
        s.receive(0, update(p), t)
        s.boundary(t)
    assert s.join_deadline == 3.5 + RT.join_timeout_s
    assert not s.ready(6.49)
    assert s.next_deadline(6.0) <= 6.5  # it wakes when the silence ends
    assert s.ready(6.5)  # 3 s without a fragment: it trains on from what it has
    s.receive(0, update(2), 7.0)  # a late one is applied, but the join is over
    s.boundary(7.0)
    assert s.ready(7.0) and s.join_deadline == 6.5
    s.tick(7.0)
    assert s.next_deadline(7.0) > 7.0  # no wake for a join that is over: it would spin


def test_a_learner_nobody_answers_gives_up_at_the_timeout_from_its_start() -> None:
    """Refusals to retry (the id is held) and heartbeats are not progress of a join."""
    s = session()
    s.tick(0.0)
    s.receive(0, JoinReply(False, "held", 7, 0, [], 0.5), 1.0)
    s.receive(0, SyncerHeartbeat(7, 0), 2.0)
    assert s.join_deadline == RT.join_timeout_s and not s.joined_once


def test_a_fast_join_says_nothing_until_it_is_slow() -> None:
    s = session()
    s.receive(0, accepted(), 0.1)
    info = [line for p in range(P) for line in s.receive(0, update(p), 0.2 + 0.01 * p).info]
    assert info == []


# -- liveness: any message counts ---------------------------------------------------------------


def joined() -> LearnerSession:
    s = session()
    s.tick(0.0)
    s.receive(0, accepted(), 0.1)
    for p in range(P):
        s.receive(0, update(p), 0.2)
    s.boundary(0.2)
    assert s.ready(0.2)
    return s


def test_a_link_busy_with_a_large_transfer_is_not_judged_dead() -> None:
    """No heartbeat for 40 s, only fragments and requests every 4 s (under syncer_liveness_s =
    5 s): the link stays joined; then 5 s of real silence, and it reconnects."""
    s = joined()
    now = 0.2
    for i in range(10):
        now += 4.0
        msg = update(i % P, 2 + i, "merged") if i % 2 else FragmentRequest(0, i % P, i)
        s.receive(0, msg, now)
        assert not s.tick(now).reconnect and s.links[0].joined
    assert s.tick(now + 5.0).reconnect == []  # exactly the timeout: not yet past it
    assert s.tick(now + 5.01).reconnect == [0]


def test_a_message_that_cannot_be_decoded_still_says_the_link_is_alive() -> None:
    s = joined()
    for t in (4.0, 8.0, 12.0):
        s.heard(0, t)
        assert not s.tick(t).reconnect
    assert s.tick(17.1).reconnect == [0]


def test_acks_keep_a_learner_live_at_the_syncer() -> None:
    """The syncer's core counts heartbeats and accepted answers; the session tells it about
    every other message from the learner's bound connection, here acks only: its heartbeats
    are stuck behind a large upload."""
    initial = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
    core = Syncer(SESSION_CFG, SESSION_LAYOUT, initial, [False] * sum(len(f) for f in SESSION_LAYOUT.fragments))
    syncer = SyncerSession(core, RuntimeConfig(), Budget(), SESSION_REGISTRATION, 0.0)
    r = SESSION_REGISTRATION
    syncer.receive(b"peer", Register(0, 1, r.params, r.layout, []), 0.0)
    timeout = SESSION_CFG.liveness_timeout_s
    now = 0.0
    for _ in range(10):
        now += 0.8 * timeout
        syncer.receive(b"peer", Ack(0, 1, 0, 0), now)
        assert syncer.core.live(now) == [0]
        syncer.tick(now)
    assert syncer.core.live(now + 1.01 * timeout) == []  # silence is still silence
    # a stranger's message for learner 0 is no sign of learner 0's life
    syncer.receive(b"other", Ack(0, 1, 0, 0), now + 1.01 * timeout)
    assert syncer.core.live(now + 1.01 * timeout) == []
