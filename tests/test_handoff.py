"""The optimizer hand-off to a learner without local state is paced by bytes and the link, not by
step boundaries (issue 32, item 2): ``protocol/handoff.py``, the executor's budget, the
``StateServer``'s row ranges, the receiver's ``Reassembly``, and the comm thread's
``HandoffSender``. In memory and in virtual time (``helpers.SessionPair`` with an uplink)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import SESSION_RT, SessionPair

from ddiloco.protocol.handoff import (
    FLOOR_BYTES,
    HandoffPace,
    Reassembly,
    handoff_nbytes,
    is_piece,
    parse_range,
    peer_state_chunks,
)
from ddiloco.protocol.messages import PeerState, PeerStateRequest

torch.set_num_threads(1)
KIB, MIB = 1 << 10, 1 << 20
RT = dataclasses.replace(SESSION_RT, peer_state_chunk_mb=1 / 16, peer_state_buffer_mb=1.0)
ROW = 256 * 4 * 2  # one row of the served parameter: 256 fp32 values in each of AdamW's two moments


def adamw(rows: int = 1024, cols: int = 256, seed: int = 0) -> torch.optim.AdamW:
    """An AdamW that took one step over one (rows, cols) parameter: 2 MiB of moments by default."""
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(rows, cols))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    return opt


def state_of(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v for i, st in opt.state_dict()["state"].items() for k, v in st.items()}


def serving_pair(rate: float, rt: object = RT) -> SessionPair:
    """Learner 0 (its optimizer state 2 MiB, its hand-off over ``rate`` bytes/s) and learner 1,
    joined; learner 1 has asked for a peer's state, as after a join into a run under way."""
    pair = SessionPair((0, 1), rt=rt, optimizers={0: adamw(), 1: adamw(4, 4, seed=1)}, uplink={0: rate})
    pair.advance(1.0)
    asker = pair.sessions[1]
    asker._awaiting_peer_state, asker._ps_heard = True, pair.now
    pair._to_syncer.append((1, PeerStateRequest(1, 1)))
    pair.deliver()
    pair.training.add(0)  # its boundaries come at its steps only
    return pair


def step(pair: SessionPair, step_s: float) -> None:
    """Learner 0 trains one step of ``step_s`` while time passes for all (ticks every 0.1 s:
    heartbeats, the uplink), then runs its boundary."""
    pair.advance(step_s)
    pair._run(0, pair.sessions[0].step(16, step_s, pair.now))
    pair.tick()


def serve_until_taken(pair: SessionPair, step_s: float, limit_s: float = 200.0) -> None:
    """Learner 0 steps (``step_s`` each) until learner 1 has taken a state."""
    end = pair.now + limit_s
    while not pair.hosts[1].taken:
        assert pair.now < end, "the hand-off never completed"
        step(pair, step_s)


# -- the pace ---------------------------------------------------------------------------------


def test_the_pace_tops_the_unsent_bytes_up_to_what_the_link_carries_in_two_steps_within_floor_and_ceiling():
    pace = HandoffPace(ceiling=64 * MIB, copy_share=0.2)
    assert pace.budget() == FLOOR_BYTES  # nothing measured yet: the floor
    pace.last_copy = 1 << 40  # (the growth of the copies is the next test's)
    pace.stepped(1.0)
    pace.sending(0, 10 * MIB)
    assert pace.budget() == 20 * MIB  # 10 MiB/s x 1 s x 2 steps
    pace.emitted = 15 * MIB
    assert pace.budget() == 5 * MIB  # topped up: 15 MiB are still unsent
    pace.emitted = 25 * MIB
    assert pace.budget() == 0  # more unsent than two steps of the link: backpressure
    pace.sending(20 * MIB, 10 * MIB)
    assert pace.budget() == 15 * MIB
    pace.sending(20 * MIB, 1000 * MIB)
    assert pace.budget() == 64 * MIB - 5 * MIB  # the ceiling bounds what is held unsent
    pace.sending(20 * MIB, 0.1 * MIB)  # a slow link: the floor (4 MiB), and 5 MiB are unsent
    assert pace.budget() == 0
    pace.sending(24 * MIB, 0.1 * MIB)
    assert pace.budget() == FLOOR_BYTES - MIB


def test_the_copy_takes_at_most_its_share_of_a_step_and_grows_at_most_eightfold_a_boundary():
    pace = HandoffPace(ceiling=1 << 40, copy_share=0.2)
    pace.stepped(2.0)
    pace.sending(0, 1e12)  # a link far faster than the copy
    budgets = []
    for _ in range(8):  # each boundary copies its budget at 100 MiB/s, and it was all sent
        budgets.append(pace.budget())
        pace.copied(budgets[-1], budgets[-1] / (100 * MIB))
        pace.emitted = pace.done = pace.emitted + budgets[-1]
    share = int(0.2 * 2.0 * 100 * MIB)  # 40 MiB: a fifth of the 2 s step at 100 MiB/s
    assert budgets == [FLOOR_BYTES, 32 * MIB, share, share, share, share, share, share]
    pace.copied(16 * MIB, 1.0)  # a slow copy: the smoothed rate falls to 58 MiB/s
    assert pace.budget() == int(0.2 * 2.0 * (0.5 * 100 * MIB + 0.5 * 16 * MIB))
    pace.copied(MIB // 4, 1.0)  # a small one: 8 x it is below the floor
    assert pace.budget() == FLOOR_BYTES
    slow = HandoffPace(ceiling=1 << 40, copy_share=0.2, step_s=0.01, copy_rate=MIB, rate=1e12, reported=True)
    assert slow.budget() == FLOOR_BYTES  # never below the floor


def test_a_driver_that_never_says_what_it_sent_gets_the_floor_every_boundary():
    pace = HandoffPace(ceiling=1 << 30, copy_share=0.2)
    pace.stepped(1.0)
    pace.emitted = 1 << 40
    assert pace.unsent == 0 and pace.budget() == FLOOR_BYTES


# -- in virtual time: the link sets the pace ------------------------------------------------------


@pytest.mark.parametrize("step_s", [0.25, 2.0])
def test_a_handoff_larger_than_a_boundarys_budget_takes_its_bytes_over_the_link_whatever_the_step_time(step_s):
    rate = 128 * KIB  # bytes per second: 2 MiB of state take 16 s
    pair = serving_pair(rate)
    want = state_of(pair.hosts[0].opt)
    nbytes = sum(t.numel() * t.element_size() for t in want.values())
    serve_until_taken(pair, step_s)
    (taken_at, got), pieces = pair.hosts[1].taken[0], pair.hosts[0].pieces
    elapsed = taken_at - pieces[0][0]
    assert nbytes / rate <= elapsed <= nbytes / rate + 0.11  # the link's time (ticks are 0.1 s apart)
    assert len({at for at, _, _ in pieces}) > 1  # more than one boundary's budget (1 MiB)
    messages = nbytes / (RT.peer_state_chunk_mb * MIB)
    assert elapsed < messages * step_s / 2 or step_s < 1  # not one message (or piece) per step
    assert got.source == 0 and set(got.tensors) == set(want)  # put back together bit for bit
    assert all(torch.equal(got.tensors[k], want[k]) for k in want)


def test_a_serving_boundary_copies_within_its_budget_and_holds_at_most_the_ceiling_unsent():
    pair = serving_pair(64 * KIB)
    ceiling = int(RT.peer_state_buffer_mb * MIB)
    most = 0
    end = pair.now + 100
    while not pair.hosts[1].taken:
        assert pair.now < end
        step(pair, 0.5)
        most = max(most, sum(n for _, n in pair.queued[0]))
    pieces = pair.hosts[0].pieces
    assert all(copied <= budget + ROW for _, budget, copied in pieces)  # at least a row goes
    assert all(budget <= ceiling for _, budget, _ in pieces)
    assert 0 < most <= ceiling + ROW


def test_backpressure_stops_copying_while_the_link_holds_the_unsent_bytes_and_resumes_after():
    pair = serving_pair(256 * KIB)
    pair.stalled.add(0)
    for _ in range(20):
        step(pair, 0.5)
    pieces, queued = len(pair.hosts[0].pieces), sum(n for _, n in pair.queued[0])
    assert pieces >= 1 and queued >= FLOOR_BYTES // 4  # the first boundaries filled what the pace allows
    for _ in range(20):
        step(pair, 0.5)
    assert len(pair.hosts[0].pieces) == pieces and sum(n for _, n in pair.queued[0]) == queued  # nothing more
    pair.stalled.discard(0)
    serve_until_taken(pair, 0.5)
    want, got = state_of(pair.hosts[0].opt), pair.hosts[1].taken[0][1]
    assert all(torch.equal(got.tensors[k], want[k]) for k in want)


def test_a_parameter_larger_than_the_budget_goes_by_rows_and_each_message_is_bounded():
    from ddiloco.training.peer_state import StateServer

    opt = adamw(300, 100)  # 117 KiB per moment, rows of 800 bytes (both moments)
    server = StateServer(opt, to=1, source=0)
    limit = 10 * KIB
    messages = []
    while (piece := server.piece(50 * KIB)) is not None:
        assert handoff_nbytes(piece) <= 50 * KIB
        messages += peer_state_chunks(piece, limit)
    assert all(handoff_nbytes(m) <= limit for m in messages)
    assert all(is_piece(m) for m in messages[:-1]) and not is_piece(messages[-1])
    ranges = [parse_range(k) for m in messages for k in m.tensors if "@" in k]
    assert ranges and all(isinstance(r, tuple) and r[3] == 300 for r in ranges)
    whole = Reassembly(1 << 20)
    assert all(whole.add(m.tensors) is None for m in messages)
    got, problem = whole.finish()
    want = state_of(opt)
    assert problem is None and set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


# -- the receiver's checks --------------------------------------------------------------------

T = torch.ones


HOSTILE = {
    "a range past its rows": [{"0.exp_avg@2:5/4": T(3, 2)}],
    "an empty range": [{"0.exp_avg@3:3/4": T(0, 2)}],
    "not a range": [{"0.exp_avg@a:b/c": T(1, 2)}],
    "a range without its rows": [{"0.exp_avg@0:1": T(1, 2)}],
    "a piece of other rows than its range": [{"0.exp_avg@0:2/4": T(3, 2)}],
    "a range of a number": [{"0.step@0:1/1": torch.tensor(1.0)}],
    "overlapping rows": [{"0.exp_avg@0:2/4": T(2, 2)}, {"0.exp_avg@1:3/4": T(2, 2)}],
    "the same rows twice": [{"0.exp_avg@0:2/4": T(2, 2)}, {"0.exp_avg@0:2/4": T(2, 2)}],
    "another dtype": [{"0.exp_avg@0:2/4": T(2, 2)}, {"0.exp_avg@2:4/4": T(2, 2, dtype=torch.float64)}],
    "another row shape": [{"0.exp_avg@0:2/4": T(2, 2)}, {"0.exp_avg@2:4/4": T(2, 3)}],
    "whole and by rows": [{"0.exp_avg": T(4, 2)}, {"0.exp_avg@0:2/4": T(2, 2)}],
    "a name twice": [{"0.exp_avg": T(4, 2)}, {"0.exp_avg": T(4, 2)}],
    "rows over the bound": [{"0.exp_avg@0:1/1000000000": T(1, 2)}],
    "rows past the wire's largest dimension": [{"0.exp_avg@0:1/9999999999": torch.ones(1, 0)}],
    "digits that are not ASCII": [{"0.exp_avg@\u00b2:3/4": T(1, 2)}],
    "values over the bound": [{"0.exp_avg": torch.zeros(4 * 8 + (1 << 20) + 1)}],
    "rows missing at the end": [{"0.exp_avg@0:2/4": T(2, 2)}, {"0.exp_avg@3:4/4": T(1, 2)}],
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_piece_drops_the_whole_state_and_nothing_after_it_is_taken(case):
    pair = SessionPair((0,))
    s = pair.sessions[0]
    s._awaiting_peer_state = True
    *pieces, last = HOSTILE[case]
    notes = []
    for i, tensors in enumerate(pieces):
        notes += s.receive(0, PeerState(0, 1, [{"ddiloco_piece": i}], tensors), 1.0).notes
    notes += s.receive(0, PeerState(0, 1, [{"lr": 1.0}], last), 1.0).notes  # the last message
    assert not s._awaiting_peer_state and s._ps is None
    assert any("dropped learner 1's optimizer state" in n for n in notes), notes
    assert s.boundary(1.0).peer_state is None
    later = s.receive(0, PeerState(0, 1, [{"lr": 1.0}], {"0.exp_avg": T(4, 2)}), 2.0)
    assert later.notes and "did not ask for" in later.notes[0] and s.boundary(2.0).peer_state is None


def test_a_requester_gives_up_on_a_handoff_that_went_silent_and_lets_its_pieces_go():
    pair = SessionPair((0,))
    s = pair.sessions[0]
    s._awaiting_peer_state, s._ps_heard = True, 0.0
    s.receive(0, PeerState(0, 1, [{"ddiloco_piece": 0}], {"0.exp_avg@0:2/4": T(2, 2)}), 1.0)
    assert s._ps is not None
    assert not s.tick(1.0 + 2 * s.rt.peer_state_timeout_s - 0.1).notes and s._awaiting_peer_state
    out = s.tick(1.0 + 2 * s.rt.peer_state_timeout_s + 0.1)
    assert not s._awaiting_peer_state and s._ps is None and any("no optimizer state" in n for n in out.notes)


# -- the comm thread's queue ------------------------------------------------------------------


class FakeLink:
    """A transport that writes what it holds at ``rate`` bytes per second of a fake clock."""

    def __init__(self, rate: float) -> None:
        self.rate, self.now, self.held, self.most, self.free_at = rate, 0.0, 0, 0, 0.0
        self.refuse = False

    def send(self, link: int, frames: list[object]) -> object | None:
        if self.refuse:
            return None
        n = sum(memoryview(f).nbytes for f in frames[1:])  # the tensors (the header is small)
        self.free_at = max(self.free_at, self.now) + n / self.rate
        link_, at = self, self.free_at

        class Tracker:
            @property
            def done(self) -> bool:
                return link_.now >= at

        return Tracker()


def test_the_comm_threads_queue_keeps_little_in_the_transport_and_measures_the_links_rate():
    from ddiloco.protocol.learner_session import Send
    from ddiloco.service.learner.handoff_sender import MAX_IN_FLIGHT, HandoffSender

    link = FakeLink(rate=4 * MIB)
    sender = HandoffSender(link.send, lambda: link.now)
    state = PeerState(1, 0, [{}], {"0.exp_avg": torch.zeros(64, 1024)})  # 256 KiB
    pieces = peer_state_chunks(state, 16 * KIB)
    for piece in pieces:
        sender.put(Send(0, piece))
    total = sum(handoff_nbytes(p) for p in pieces)
    while sender.busy:
        sender.pump()
        assert len(sender.in_flight) <= MAX_IN_FLIGHT
        link.now += 0.002
    assert sender.done == total and sender.served and sender.served[0][:2] == (1, total)
    assert math.isclose(sender.rate, link.rate, rel_tol=0.1)
    link.refuse = True  # not connected: the pieces wait, nothing is lost
    sender.put(Send(0, pieces[0]))
    sender.pump()
    assert sender.busy and len(sender.waiting) == 1 and sender.done == total
    sender.drop()  # the link was reconnected: what waited is gone, and counted done
    assert not sender.busy and sender.done == total + handoff_nbytes(pieces[0])


def test_a_state_key_with_digits_that_are_not_ascii_is_refused_not_raised():
    from ddiloco.training.peer_state import load_state

    opt = adamw(4, 4)
    before = state_of(opt)
    problem = load_state(opt, PeerState(0, 1, [], {"\u00b2.exp_avg": torch.zeros(4, 4)}), torch.device("cpu"))
    assert problem is not None and "names no parameter" in problem
    assert all(torch.equal(v, before[k]) for k, v in state_of(opt).items())


@pytest.mark.parametrize(
    "setting",
    [
        "runtime.peer_state_buffer_mb=0",
        "runtime.peer_state_buffer_mb=inf",
        "runtime.peer_state_copy_share=0",
        "runtime.peer_state_copy_share=1.5",
        "runtime.peer_state_copy_share=nan",
        "runtime.peer_state_chunk_mb=-1",
    ],
)
def test_the_handoffs_settings_are_validated(setting):
    from ddiloco.config import load_config
    from ddiloco.errors import ConfigError

    with pytest.raises(ConfigError, match=setting.split("=")[0]):
        load_config(None, [setting])
    load_config(None, ["runtime.peer_state_buffer_mb=64", "runtime.peer_state_copy_share=1.0"])
