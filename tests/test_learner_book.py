"""The launcher's books of one learner (service/ops/learner_book.py), driven by the events the
launcher sees: every second of its allocation is in exactly one state, work is banked once."""

from __future__ import annotations

import math

import pytest

from ddiloco.report.accounting import STATES
from ddiloco.service.ops.learner_book import LearnerBook


def status(pid: int, steps: int, tokens: int, pending: float = 0.0) -> dict:
    return {"pid": pid, "steps": steps, "tokens": tokens, "pending_steps": pending}


def test_start_compute_kill_restart_and_the_runs_end():
    b = LearnerBook.starting_at(100.0)
    b.first_step(104.0)  # start-up: 4 s
    b.died(110.0, status(11, steps=60, tokens=600, pending=3))  # 6 s of compute
    b.respawned(112.0)  # 2 s down
    b.first_step(115.0)  # 3 s restarting
    b.close(120.0)  # 5 s of compute
    assert b.account.totals == {"compute": 11.0, "blocked": 0.0, "down": 2.0, "restarting": 3.0, "starting": 4.0}
    assert sum(b.account.totals.values()) == 20.0  # the whole allocation, in one state at a time
    assert b.restart_latencies == [3.0] and b.failures == 1 and b.lost_steps == 3
    assert b.outages == [(110.0, 115.0)]
    assert (b.steps, b.tokens) == (60, 600)


def test_an_incarnations_work_is_banked_once():
    b = LearnerBook.starting_at(0.0)
    b.first_step(1.0)
    b.died(5.0, status(11, steps=40, tokens=400))
    b.bank(status(11, steps=40, tokens=400))  # the same process seen again at the run's end
    b.respawned(6.0)
    b.bank(status(12, steps=10, tokens=100))
    assert (b.steps, b.tokens) == (50, 500)


def test_killed_before_its_first_step_the_start_up_is_lost_and_no_latency_is_made_up():
    b = LearnerBook.starting_at(0.0)
    b.died(8.0, None)  # killed while importing torch: it never wrote a status
    b.respawned(8.5)
    b.died(12.0, None)  # and its replacement too
    b.respawned(12.5)
    b.close(20.0)
    assert b.account.totals["compute"] == 0.0 and b.account.totals["starting"] == 8.0
    assert b.account.totals["restarting"] == pytest.approx(3.5 + 7.5) and b.account.totals["down"] == 1.0
    assert b.restart_latencies == [] and b.failures == 2
    assert b.outages == [(8.0, math.inf)]  # one outage until it is back: it never came back


def test_a_first_step_seen_late_counts_from_when_it_was_made_and_time_never_runs_back():
    b = LearnerBook.starting_at(0.0)
    b.first_step(3.0)
    b.first_step(9.0)  # a second look at the same status: no change
    b.died(10.0, None)
    b.first_step(9.5)  # a stale status after the death: not a step of a live incarnation
    b.close(12.0)
    assert b.account.totals["compute"] == 7.0 and b.account.totals["down"] == 2.0
    assert set(b.account.totals) == set(STATES)
