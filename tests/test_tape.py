"""Tape records read back as types (core/tape.py, report/tape.py): what the core writes reads
back equal, anything else is skipped without raising, and one rule says who was merged."""

from __future__ import annotations

import json
import math

import pytest

from ddiloco.core.tape import (
    Late,
    MergedEntry,
    Rejection,
    RoundRecord,
    parse_tape_record,
    was_merged,
)
from ddiloco.report.result import summarise_tape
from ddiloco.report.tape import read_rounds, read_tape_records


def entry(learner: int, weight: float, **kw) -> MergedEntry:
    fields = dict(incarnation=3, seq=7, base_version=1, staleness=0, tokens=400, steps=4, in_grace=False)
    return MergedEntry(learner, weight=weight, **{**fields, **kw})


def round_record(**kw) -> RoundRecord:
    fields = dict(fragment=1, round_id=9, opened_at=10.0, closed_at=11.5, version=2, quorum=2, grace_s=0.25,
                  close_reason="grace_over", merged=[entry(0, 2.0), entry(1, 0.0, in_grace=True)])  # fmt: skip
    return RoundRecord(**{**fields, **kw})


REJECTION = Rejection(4, 1, "bad_norm", "norm 1e9 above the bound", 11.0)


def test_every_record_reads_back_equal_through_json():
    rd = round_record(rejected=[REJECTION], rejected_total=40, merged=[entry(0, 2.0, clipped=True, norm=0.5)])
    for record in (rd, REJECTION, Late(2, 0, 12.0)):
        assert parse_tape_record(json.loads(json.dumps(record.to_json()))) == record


def test_one_rule_for_who_took_part_in_the_merge():
    rd = round_record()
    assert [m.was_merged for m in rd.merged] == [True, False] == [was_merged(m) for m in rd.merged]
    assert [m.learner for m in rd.took_part] == [0] and rd.is_merge
    assert not round_record(merged=[entry(0, 0.0)]).is_merge  # answered, moved nothing
    assert not round_record(version=0).is_merge  # no version made


def test_older_records_without_the_later_fields_read_with_their_defaults():
    d = round_record(merged=[entry(0, 1.0)]).to_json()
    for key in ("clipped", "norm"):
        del d["merged"][0][key]
    del d["rejected_total"]
    d["rejected"] = [REJECTION.to_json()]
    rd = parse_tape_record(d)
    assert isinstance(rd, RoundRecord) and rd.rejected_total == 1
    assert not rd.merged[0].clipped and rd.merged[0].norm == 0.0


HOSTILE = [math.nan, math.inf, -math.inf, 10**400, True, "2.0", None, [1], {"a": 1}]


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
@pytest.mark.parametrize("key", ["fragment", "version", "closed_at", "grace_s", "merged", "close_reason"])
def test_a_hostile_round_field_skips_the_round(key, value):
    d = round_record().to_json()
    d[key] = value
    assert parse_tape_record(d) is None


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
@pytest.mark.parametrize("key", ["learner", "weight", "tokens"])
def test_one_hostile_entry_skips_its_whole_round(key, value):
    d = round_record().to_json()
    d["merged"][1][key] = value
    assert parse_tape_record(d) is None


@pytest.mark.parametrize("value", [1, 0.0, "yes", None, math.nan])
def test_a_flag_must_be_a_boolean(value):
    d = round_record().to_json()
    d["merged"][0]["in_grace"] = value
    assert parse_tape_record(d) is None


@pytest.mark.parametrize(
    "line",
    [
        None,
        [],
        "round",
        {},
        {"event": ["round"]},  # unhashable: must not raise
        {"event": "party"},
        {"event": "round"},
        {"event": "late", "learner": 1, "fragment": 0},
        {"event": "late", "learner": 1.5, "fragment": 0, "time": 1.0},
        {**REJECTION.to_json(), "reason": "because"},  # not a known reason
        {**round_record().to_json(), "close_reason": "tired"},
        {**round_record().to_json(), "merged": [1, 2]},
    ],
    ids=repr,
)
def test_malformed_lines_are_none_never_an_exception(line):
    assert parse_tape_record(line) is None


def test_unknown_keys_are_ignored():
    d = {**round_record().to_json(), "wall_offset": 1e9, "future_field": [1, 2]}
    assert parse_tape_record(d) == round_record()


def test_files_read_as_types_and_damage_is_skipped(tmp_path):
    good = [round_record(), REJECTION, Late(1, 0, 3.0)]
    bad = round_record().to_json()
    bad["merged"][0]["weight"] = "heavy"
    lines = [json.dumps(r.to_json()) for r in good] + [json.dumps(bad), "{torn", "[]"]
    path = tmp_path / "tape.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert read_tape_records(path) == good
    assert read_rounds(path) == [round_record()]
    assert read_rounds(tmp_path / "missing.jsonl") == []


def test_tape_figures_count_only_well_formed_rounds_and_entries_that_took_part():
    bad = round_record(fragment=0).to_json()
    bad["merged"][0]["weight"] = math.nan
    tape = [round_record().to_json(), bad, REJECTION.to_json(), Late(1, 0, 3.0).to_json()]
    stats = summarise_tape(tape, num_fragments=2)
    assert stats["rounds_per_fragment"] == 0.5 and stats["learners_per_merge"] == 1.0
    assert stats["grace_admissions"] == 0  # the entry in grace had weight 0: it took no part
    assert stats["rejected"] == 1 and stats["late"] == 1
    assert summarise_tape([round_record(), REJECTION, Late(1, 0, 3.0)], 2) == stats  # typed records alike
