"""Thin links must not break the protocol (issue 20, item 4), as pure sessions in virtual time:
a join waits as long as its fragments keep coming and gives up only after a silence; any
message counts as liveness, on both sides, so heartbeats queued behind a large transfer do not
make a live peer look dead. No wall clock anywhere: every time is handed in."""

from __future__ import annotations

import torch
from helpers import SESSION_CFG, SESSION_LAYOUT, SESSION_REGISTRATION, SESSION_RT

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.messages import Ack, FragmentRequest, FragmentUpdate
from ddiloco.core.syncer import Syncer
from ddiloco.protocol.config import RuntimeConfig
from ddiloco.protocol.learner_session import LearnerSession, Registration, is_piece, peer_state_chunks
from ddiloco.protocol.messages import JoinReply, PeerState, PeerStateRequest, Register, SyncerHeartbeat
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


# -- the optimizer hand-off goes in pieces ------------------------------------------------------


def adamw_state() -> tuple[torch.optim.AdamW, PeerState]:
    from ddiloco.training.peer_state import state_message

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 16)).square().sum().backward()
        opt.step()
    return opt, state_message(opt, to=0, source=1)


def test_a_state_is_cut_into_pieces_of_whole_tensors_and_the_last_carries_the_param_groups() -> None:
    _, ps = adamw_state()
    pieces = peer_state_chunks(ps, 1100)  # one 16x16 fp32 moment is 1024 bytes
    assert len(pieces) > 2
    assert all(is_piece(p) for p in pieces[:-1]) and not is_piece(pieces[-1])
    assert pieces[-1].param_groups == ps.param_groups
    assert all(sum(t.numel() * t.element_size() for t in p.tensors.values()) <= 1100 for p in pieces)
    merged = {k: v for p in pieces for k, v in p.tensors.items()}
    assert list(merged) == list(ps.tensors) and all(merged[k] is ps.tensors[k] for k in merged)
    assert peer_state_chunks(ps, 1 << 20) == [ps]  # small enough: one message, as before
    empty = PeerState(0, -1, [], {})
    assert peer_state_chunks(empty, 100) == [empty] and not is_piece(empty)
    big = peer_state_chunks(ps, 10)  # a tensor larger than the limit goes alone
    assert all(len(p.tensors) == 1 for p in big)


def test_a_learner_takes_a_state_in_pieces_from_its_peer_only_and_loads_it() -> None:
    from ddiloco.training.peer_state import load_state

    opt, ps = adamw_state()
    s = joined()
    s._awaiting_peer_state = True  # as after its request (complete() asks once the join is whole)
    pieces = peer_state_chunks(ps, 1100)
    now = 1.0
    for piece in pieces[:-1]:
        now += 1.0
        assert not s.receive(0, piece, now).notes
        intruder = PeerState(0, 2, [{"ddiloco_piece": 0}], {"0.exp_avg": torch.ones(16, 16)})
        assert s.receive(0, intruder, now).notes  # another peer's piece is not taken
        assert s.boundary(now).peer_state is None  # not whole yet
    s.receive(0, pieces[-1], now + 1.0)
    got = s.boundary(now + 1.0).peer_state
    assert got is not None and got.source == 1 and got.param_groups == ps.param_groups
    assert set(got.tensors) == set(ps.tensors)
    _, fresh = adamw_state()
    assert load_state(opt, got, torch.device("cpu")) is None
    assert fresh.tensors.keys() == got.tensors.keys()


def test_a_learner_drops_a_state_larger_than_any_optimizer_of_its_model_keeps() -> None:
    s = joined()
    s._awaiting_peer_state = True
    huge = torch.zeros(4 * 16 * P + (1 << 20) + 1)
    out = s.receive(0, PeerState(0, 1, [{"ddiloco_piece": 0}], {"0.exp_avg": huge}), 1.0)
    assert out.notes and not s._awaiting_peer_state


def relay_syncer() -> SyncerSession:
    initial = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
    core = Syncer(SESSION_CFG, SESSION_LAYOUT, initial, [False] * sum(len(f) for f in SESSION_LAYOUT.fragments))
    syncer = SyncerSession(core, SESSION_RT, Budget(), SESSION_REGISTRATION, 0.0)
    r = SESSION_REGISTRATION
    for m, peer in ((0, "a"), (1, "b")):
        syncer.receive(peer, Register(m, 1, r.params, r.layout, []), 0.0)
    return syncer


def test_the_relay_waits_as_long_as_pieces_keep_coming_and_forgets_a_silent_one() -> None:
    syncer = relay_syncer()
    syncer.receive("b", PeerStateRequest(1, 1), 0.5)  # relayed to learner 0 ("a")
    gap = 0.9 * SESSION_RT.peer_state_timeout_s
    now = 0.5
    for i in range(5):  # 5 gaps of 0.9 x the timeout: far past it in all, never silent that long
        now += gap
        piece = PeerState(1, 0, [{"ddiloco_piece": i}], {f"{i}.exp_avg": torch.zeros(3)})
        out = syncer.receive("a", piece, now)
        assert out.send == [("b", piece)] and not out.notes
    final = PeerState(1, 0, [{"lr": 0.1}], {"5.exp_avg": torch.zeros(3)})
    assert syncer.receive("a", final, now + gap).send == [("b", final)]
    assert 1 not in syncer.handoffs  # done: a further copy is refused
    assert not syncer.receive("a", final, now + gap).send

    syncer = relay_syncer()
    syncer.receive("b", PeerStateRequest(1, 1), 0.5)
    piece = PeerState(1, 0, [{"ddiloco_piece": 0}], {"0.exp_avg": torch.zeros(3)})
    assert syncer.receive("a", piece, 1.0).send
    late = 1.0 + SESSION_RT.peer_state_timeout_s
    out = syncer.receive("a", PeerState(1, 0, [{"ddiloco_piece": 1}], {"1.exp_avg": torch.zeros(3)}), late)
    assert not out.send and out.notes[0].kind == "refused_relay"  # silent for the timeout: forgotten
