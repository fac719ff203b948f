"""The run's end reaches every process: a syncer that answers ``RunEnd`` after the end (its
final evaluation included), and a learner cut off across the end that stops by itself."""

from __future__ import annotations

import threading
from dataclasses import replace

import torch
from helpers import SESSION_RT, SessionPair, wait_for
from test_misuse import ADDRESS, Net, cfg, train_step

import ddiloco
from ddiloco.core.messages import Heartbeat
from ddiloco.protocol.messages import RunEnd
from ddiloco.protocol.syncer_session import Budget
from ddiloco.service.base.transport import InProcessNetwork

torch.set_num_threads(1)


def test_a_learner_cut_off_once_the_budget_is_spent_stops_after_give_up_spent_s():
    pair = SessionPair(budget=Budget(processed_tokens=64), rt=replace(SESSION_RT, give_up_spent_s=3.0))
    pair.tick()
    learner = pair.sessions[0]
    pair.step(0, tokens=16)
    pair.cut(0)  # the syncer never hears the rest: as far as the learner knows, the budget is spent
    for _ in range(3):
        pair.step(0, tokens=16)
    assert learner.core.fleet_tokens() >= 64 and learner.run_end is None
    pair.advance(1.0)  # 2.5 s after its last word from the syncer (each step takes 0.5 s)
    assert learner.gave_up is None  # still within runtime.give_up_spent_s
    pair.advance(1.0)
    assert learner.gave_up is not None and learner.done
    assert "the run's budget is 64 (run.processed_tokens)" in learner.gave_up
    assert learner.gave_up.endswith(
        "and syncer shard 0 has said nothing for 3 s (runtime.give_up_spent_s): the run ended while this learner "
        "was cut off; this learner stops"
    ), learner.gave_up


def test_a_learner_cut_off_short_of_the_budget_trains_on():
    pair = SessionPair(budget=Budget(processed_tokens=640), rt=replace(SESSION_RT, give_up_spent_s=3.0))
    pair.tick()
    learner = pair.sessions[0]
    pair.step(0, tokens=16)
    pair.cut(0)
    pair.step(0, tokens=16)
    pair.advance(6.0)
    assert learner.gave_up is None and not learner.done  # runtime.give_up_after_s (600 s) is its bound


def test_nothing_reaches_the_core_after_the_end_and_a_heartbeat_is_told_again():
    pair = SessionPair(budget=Budget(processed_tokens=64))
    pair.tick()
    for _ in range(4):
        pair.step(0, tokens=16)
    pair.advance(5.5)
    assert pair.syncer.end_stage == "done"
    processed = pair.syncer.fleet.processed_tokens()
    out = pair.syncer.receive(0, Heartbeat(0, 1, 10_000, 0.5, tokens=4096), pair.now)
    assert [type(m).__name__ for _, m in out.send] == ["RunEnd"]
    assert isinstance(out.send[0][1], RunEnd) and out.send[0][1].stage == "done"
    assert not out.persist and pair.syncer.fleet.processed_tokens() == processed


def test_a_learner_that_registers_during_the_final_evaluation_is_told_the_run_ended(tmp_path):
    """The syncer's final evaluation (here the hook's, held until the late learner was answered)
    runs while the syncer goes on answering: no silence after the end, even with no linger."""
    net = InProcessNetwork()
    late_answered = threading.Event()
    final_began = threading.Event()
    server: ddiloco.SyncerServer | None = None

    def evaluate(model: torch.nn.Module) -> float:
        if server is not None and server.service.end_stage == "done":
            final_began.set()
            late_answered.wait(30)
        return 1.0

    torch.manual_seed(0)
    run = ("run.processed_tokens=2000", "runtime.end_linger_s=0")
    server = ddiloco.SyncerServer(
        Net(), ADDRESS, tmp_path, config=cfg(*run), transport=net.syncer(ADDRESS), fsync=False,
        evaluate=evaluate, eval_interval_s=0.2,
    ).start()  # fmt: skip
    try:
        model = Net()
        opt = torch.optim.AdamW(model.parameters())
        g = torch.Generator().manual_seed(0)
        first = ddiloco.Learner(model, ADDRESS, learner_id=0, config=cfg(*run), transport=net.learner)
        wait_for(lambda: train_step(first, model, opt, g) or first.run_ended, 30, "the run's end")
        first.finish()
        assert final_began.wait(30), "the final evaluation never began"
        with ddiloco.Learner(Net(), ADDRESS, learner_id=1, config=cfg(*run), transport=net.learner) as late:
            assert late.run_ended and "2,000 (run.processed_tokens)" in late.end_reason
        late_answered.set()
        server.stop()
        evals = (tmp_path / "metrics" / "eval.jsonl").read_text().splitlines()
        assert '"final": true' in evals[-1]
    finally:
        late_answered.set()
        server.stop()


def test_the_syncer_says_when_a_learner_is_lost_and_when_it_is_back():
    pair = SessionPair(learners=(0, 1))
    pair.advance(0.5)
    assert pair.info == ["learner 0 joined (incarnation 1)", "learner 1 joined (incarnation 1)"]
    pair.cut(1)
    pair.advance(pair.syncer.core.cfg.liveness_timeout_s + 1.0)
    liveness = pair.syncer.core.cfg.liveness_timeout_s
    assert pair.info[2:] == [
        f"learner 1 lost: nothing heard for {liveness:g} s (algo.liveness_timeout_s); the rounds go on without it"
    ]
    pair.heal(1)
    pair.advance(3.0)  # its backoff runs out: it registers again
    assert pair.info[3:] == ["learner 1 is back (incarnation 1)"]


def test_the_fleets_count_is_the_one_that_ended_the_run_from_the_end_on():
    """One fact, one number (issue 35): the count in the end's reason is the syncer's processed
    tokens from then on (status, summary), though learners that had not heard train a moment on."""
    pair = SessionPair(budget=Budget(processed_tokens=64))
    pair.tick()
    for _ in range(4):
        pair.step(0, tokens=16)
    pair.advance(0.5)
    assert pair.syncer.end_stage is not None
    at_end = pair.syncer.processed_tokens()
    assert at_end >= 64 and f"{at_end:,.0f} tokens processed by the fleet" in pair.syncer.end_reason
    pair.syncer.receive(0, Heartbeat(0, 1, 100, 0.5, tokens=4096), pair.now)  # trained on before it heard
    assert pair.syncer.fleet.processed_tokens() > at_end and pair.syncer.processed_tokens() == at_end
