"""The protocol as conversations: a ``LearnerSession`` and a ``SyncerSession`` wired in memory
(``helpers.SessionPair``), with a virtual clock the test moves. Each test reads as the
exchange it checks, and asserts the values the rules give."""

from __future__ import annotations

import pytest
import torch
from helpers import SessionPair

from ddiloco.protocol.syncer_session import Budget

torch.set_num_threads(1)


def test_a_learner_registers_and_joins_with_every_fragment_of_the_global_model():
    pair = SessionPair()
    pair.tick()  # the learner's first deadline is due at once: it registers
    learner = pair.sessions[0]
    assert pair.transcript == [
        ("->", 0, "Register"),
        ("<-", 0, "JoinReply"),  # accepted, before the fragments it announces
        ("<-", 0, "FragmentUpdate"),
        ("<-", 0, "FragmentUpdate"),
        ("->", 0, "Ack"),  # each written into the model at a boundary, then acked
        ("->", 0, "Ack"),
    ]
    assert learner.joined and learner.ready(pair.now)
    assert learner.received == {0, 1} and learner.core.base_version == [0, 0]
    assert learner.data_position == 0
    assert pair.syncer.identities == {0: 0}  # learner 0's route is bound to the peer that registered it
    assert all(bool((t == 0).all()) for t in pair.models[0].values())  # the initial global model


def test_a_round_is_asked_answered_merged_and_applied():
    pair = SessionPair()
    pair.tick()
    learner = pair.sessions[0]
    steps = 0
    while not pair.tape:  # until the syncer closes its first round
        pair.step(0, tokens=16, drift=0.01)
        steps += 1
    (record,) = [r.to_json() for r in pair.tape]
    assert steps == 3 and pair.now == pytest.approx(1.5)  # sync_every = 4, overlap = 1: asked at step 3
    assert record["fragment"] == 1 and record["version"] == 1 and record["close_reason"] == "all_answered"
    assert [(m["learner"], m["tokens"], m["steps"], m["base_version"]) for m in record["merged"]] == [(0, 48, 3, 0)]
    assert pair.said("->", 0)[-2:] == ["Contribution", "Ack"]
    assert pair.said("<-", 0)[-3:] == ["FragmentRequest", "SyncerHeartbeat", "FragmentUpdate"]
    # One learner moved 0.03 in 3 steps; the outer Nesterov step's first move is
    # outer_lr x (1 + outer_momentum) x delta = 0.7 x 1.9 x 0.03.
    merged = 0.7 * 1.9 * 0.03
    assert learner.core.base_version == [0, 1] and pair.syncer.core.versions() == [0, 1]
    w, b = pair.models[0]["w"], pair.models[0]["b"]
    assert w[0].tolist() == pytest.approx([merged] * 2) and b.tolist() == pytest.approx([merged] * 2)
    assert w[1:].flatten().tolist() == pytest.approx([0.03] * 4)  # fragment 0 is not merged yet
    assert [v.tolist() for v in pair.syncer.core.values(1)] == [w[0:1].tolist(), b.tolist()]


def test_a_learner_whose_heartbeats_are_lost_is_left_out_and_then_rejoins():
    pair = SessionPair(learners=(0, 1))
    pair.tick()
    assert pair.syncer.core.live(pair.now) == [0, 1]
    pair.cut(1)  # learner 1's link goes dark; its process trains on
    pair.advance(2.5)  # past algo.liveness_timeout_s = 2 s
    assert pair.syncer.core.live(pair.now) == [0]
    while not pair.tape:
        pair.step(0)
    record = pair.tape[0].to_json()
    assert [m["learner"] for m in record["merged"]] == [0]  # the round did not wait for learner 1
    assert not pair.sessions[1].joined  # it heard nothing for runtime.syncer_liveness_s = 2 s
    assert any("syncer shard 0 unreachable" in n for n in pair.notes)
    pair.heal(1)
    pair.advance(1.5)  # its backoff (at most 1 s) runs out: it registers again and is accepted
    assert pair.sessions[1].joined and pair.syncer.core.live(pair.now) == [0, 1]
    assert pair.said("->", 1).count("Register") == 2


def test_the_runs_end_reaches_the_learner_in_stages():
    pair = SessionPair(budget=Budget(processed_tokens=64))
    pair.tick()
    learner = pair.sessions[0]
    for _ in range(4):  # 4 x 16 tokens: the budget, once a heartbeat reports them
        pair.step(0, tokens=16)
    pair.advance(0.5)  # a heartbeat goes out (runtime.heartbeat_interval_s = 0.5 s)
    assert learner.run_end == "stop" and learner.stopped and not learner.done
    assert learner.end_reason == "64 tokens processed by the fleet, the budget is 64 (run.processed_tokens)"
    pair.advance(5.0)  # the final sync asks, the learner answers from its boundaries, the end is done
    assert learner.run_end == "done" and learner.done
    assert pair.syncer.end_stage == "done"
    assert pair.said("<-", 0).count("RunEnd") == 2  # "stop", then "done"
    assert learner.next_deadline(pair.now) is None  # nothing more will come
