"""The one restart rule for learner counters (core/counters.py): per incarnation its largest
reading, a drop as a restart for readings without one, hostile readings ignored."""

from __future__ import annotations

import math

import pytest

from ddiloco.core.counters import MAX_COUNTER, IncarnationCounters, Increment


def feed(readings: list[tuple]) -> tuple[IncarnationCounters, list[Increment | None]]:
    c = IncarnationCounters()
    return c, [c.add(*r) for r in readings]


def test_a_restart_is_a_new_incarnation_counted_from_zero():
    c, steps = feed([(0, 1, 4.0, 2.0), (0, 1, 9.0, 4.0), (0, 2, 3.0, 6.0), (0, 2, 5.0, 8.0), (1, 7, 2.0, 8.0)])
    assert c.per_learner() == {0: 9.0 + 5.0, 1: 2.0} and c.total() == 16.0
    assert c.incarnations(0) == 2 and c.incarnations(1) == 1
    assert [s.amount for s in steps if s] == [4.0, 5.0, 3.0, 2.0, 2.0]
    # the new incarnation's first reading: done since its counter was 0, at the latest in [t - v, t]
    assert steps[2] == Increment(0, 2, start=4.0, end=6.0, amount=3.0)
    assert steps[0] == Increment(0, 1, start=0.0, end=2.0, amount=4.0)  # never before the origin


def test_readings_of_known_incarnations_may_come_in_any_order():
    readings = [(0, 1, 4.0, 2.0), (0, 1, 9.0, 4.0), (0, 2, 3.0, 6.0), (0, 2, 5.0, 8.0), (0, 1, 0.0, 9.0)]
    c, _ = feed(readings)
    r, _ = feed(list(reversed(readings)))
    assert c.total() == r.total() == 14.0  # a late or zero reading of an old incarnation is no restart


def test_readings_without_an_incarnation_take_a_drop_as_a_restart():
    c, steps = feed([(0, None, 2.0, 2.0), (0, None, 4.0, 4.0), (0, None, 1.0, 6.0), (0, None, 3.0, 8.0)])
    assert c.total() == 4.0 + 3.0 and c.incarnations(0) == 2
    assert steps[2] == Increment(0, None, start=5.0, end=6.0, amount=1.0)


def test_an_unchanged_or_lower_reading_of_the_same_incarnation_adds_nothing():
    c, steps = feed([(0, 1, 5.0, 1.0), (0, 1, 5.0, 2.0), (0, 1, 2.0, 3.0)])
    assert c.total() == 5.0 and [s.amount for s in steps if s] == [5.0, 0.0, 0.0]


HOSTILE = [math.nan, math.inf, -1.0, -math.inf, MAX_COUNTER * 2, 10**400, True, False, "5", None, [1], {"v": 1}]


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
def test_hostile_values_are_ignored(value):
    c, steps = feed([(0, 1, 5.0, 1.0), (0, 1, value, 2.0), (0, 1, 6.0, 3.0)])
    assert steps[1] is None and c.total() == 6.0


@pytest.mark.parametrize(
    "reading",
    [
        ("0", 1, 5.0, 1.0),  # learner id as a string
        (True, 1, 5.0, 1.0),
        (-1, 1, 5.0, 1.0),
        (1.0, 1, 5.0, 1.0),
        (0, "1", 5.0, 1.0),  # incarnation as a string: not the same as none
        (0, False, 5.0, 1.0),
        (0, -3, 5.0, 1.0),
        (0, 1, 5.0, math.nan),  # no time
        (0, 1, 5.0, "soon"),
        (0, 1, 5.0, None),
    ],
    ids=repr,
)
def test_readings_without_a_valid_learner_incarnation_or_time_are_ignored(reading):
    c, steps = feed([reading])
    assert steps == [None] and c.total() == 0.0 and c.per_learner() == {}


def test_records_are_read_in_time_order_and_damage_is_skipped():
    records = [
        {"time": 8.0, "learner": 0, "busy_s": 3.0},  # after the restart at 6 s, written out of order
        {"time": 2.0, "learner": 0, "busy_s": 2.0},
        {"time": 4.0, "learner": 0, "busy_s": 4.0},
        {"time": 6.0, "learner": 0, "busy_s": 1.0},
        {"time": "soon", "learner": 0, "busy_s": 100.0},
        {"time": 7.0, "learner": 1, "incarnation": 2, "busy_s": "many"},
        {"time": 7.0, "learner": 1, "incarnation": 2, "busy_s": 1.5},
        {"time": 9.0, "learner": 1, "incarnation": 2, "tokens": 10},  # no busy_s: ignored
    ]
    c, steps = IncarnationCounters.of_records(records, "busy_s")
    assert c.per_learner() == {0: 4.0 + 3.0, 1: 1.5}
    assert [s.end for s in steps] == [2.0, 4.0, 6.0, 7.0, 8.0]
    assert sum(s.amount for s in steps) == c.total()


def test_a_restarted_syncers_zeros_are_no_restart_of_a_named_incarnation():
    records = [
        {"time": 5.0, "learner": 0, "incarnation": 1, "tokens": 500},
        {"time": 10.0, "learner": 0, "incarnation": 1, "tokens": 900},
        {"time": 12.0, "learner": 0, "incarnation": 1, "tokens": 0},
        {"time": 15.0, "learner": 0, "incarnation": 1, "tokens": 950},
    ]
    assert IncarnationCounters.of_records(records, "tokens")[0].total() == 950


def test_clip_lowers_a_learners_sum_from_its_largest_readings_and_keeps_the_others():
    c = IncarnationCounters()
    for inc, v in ((1, 300.0), (2, 2.0**53), (3, 50.0)):
        c.add(0, inc, v, 1.0)
    c.add(1, 1, 700.0, 1.0)
    assert c.clip(0, 1000.0) == pytest.approx(300.0 + 2.0**53 + 50.0 - 1000.0)
    assert c.per_learner() == {0: 1000.0, 1: 700.0}
    assert c.best(0, 1) == 300.0 and c.best(0, 3) == 50.0 and c.best(0, 2) == 650.0
    assert c.clip(1, 1e9) == 0.0 and c.clip(0, 1000.0) == 0.0
    restored = IncarnationCounters()
    restored.load_state(c.state())
    assert restored.total() == 1700.0
