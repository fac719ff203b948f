"""The one summary function (report/summary.py), on run folders written by hand: what each
figure counts, and what it must not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddiloco.core.tape import MergedEntry, RoundRecord
from ddiloco.report.summary import summarise, write_summary


def jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def merged(learner: int, weight: float, tokens: int = 100, in_grace: bool = False, seq: int = 0) -> MergedEntry:
    return MergedEntry(learner, incarnation=1, seq=seq, base_version=0, staleness=0, weight=weight, tokens=tokens,
                       steps=4, in_grace=in_grace)  # fmt: skip


def folder(tmp_path: Path, *, runlog: list[str], rounds_per_fragment: int = 4) -> Path:
    d = tmp_path / "run"
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"format": 2, "started_at": 1000.0, "by": "ddiloco syncer (shard 0)"}))
    (d / "config.toml").write_text('[run]\nmethod = "decoupled"\nnum_learners = 2\n')
    rounds = []
    for k in range(rounds_per_fragment):
        for p in (0, 1):
            seq = len(rounds)  # each learner's contributions are numbered: none is merged twice
            entries = [merged(0, 1.0, seq=seq), merged(1, 0.0 if k == 0 else 1.0, in_grace=k == 1, seq=seq)]
            # The syncer's own tape: monotonic times and the wall offset (top-level tape: relative).
            rd = RoundRecord(p, len(rounds), opened_at=50.0 + k, closed_at=50.5 + k, version=k + 1, quorum=1,
                             grace_s=0.0, close_reason="all_answered", merged=entries)  # fmt: skip
            rounds.append({**rd.to_json(), "wall_offset": 960.0})
    jsonl(d / "state" / "tape.jsonl", rounds)
    jsonl(d / "metrics" / "learners.jsonl", [
        {"time": 5.0, "learner": 0, "incarnation": 1, "tokens": 500, "busy_s": 4.0},
        {"time": 10.0, "learner": 0, "incarnation": 1, "tokens": 900, "busy_s": 8.0},
        {"time": 12.0, "learner": 0, "incarnation": 1, "tokens": 0, "busy_s": 0.0},  # a restarted syncer's zeros
        {"time": 15.0, "learner": 0, "incarnation": 2, "tokens": 300, "busy_s": 2.5},  # a new process
        {"time": 15.0, "learner": 1, "incarnation": 7, "tokens": 1000, "busy_s": 9.0},
    ])  # fmt: skip
    jsonl(d / "metrics" / "faults.jsonl", [
        {"time": 11.0, "kind": "sigkill", "target": "learner-0"},
        {"time": 11.0, "kind": "restart", "target": "learner-0"},
        {"time": 13.0, "kind": "sigkill", "target": "syncer"},
        {"time": 14.0, "kind": "exit 0", "target": "learner-1"},
    ])  # fmt: skip
    jsonl(d / "metrics" / "eval.jsonl", [{"time": 19.0, "loss": 2.5, "final": True, "unit": "nats/byte"}])
    jsonl(d / "metrics" / "run.jsonl", [{"time": float(i) * 10, "what": w, "reason": w} for i, w in enumerate(runlog)])
    return d


def test_figures_of_a_hand_started_run(tmp_path):
    d = folder(tmp_path, runlog=["start", "end"])
    s = summarise(d)
    assert s["tokens_processed"] == 900 + 300 + 1000  # per incarnation, the syncer's zeros ignored
    assert s["run_time_s"] == 10.0 and s["num_learners"] == 2  # the end record's time, M from config.toml
    assert s["goodput"] == (8.0 + 2.5 + 9.0) / (2 * 10.0) and s["down"] is None  # no accounting: no split
    assert s["learners_per_merge"] == (2 * 1 + 6 * 2) / 8  # the weight-0 entries of round 0 are not merged
    assert s["grace_admissions"] == 2 and s["rounds_per_fragment"] == 4.0
    assert s["tokens_merged"] == (2 * 100 + 6 * 200) / 2  # every fragment merges the same tokens once
    assert s["failures"] == 1  # a learner SIGKILL; not its restart, not the syncer's kill, not a clean exit
    assert s["eval_loss"] == 2.5 and s["loss_unit"] == "nats/byte" and s["clock"] == "wall"
    assert s["partial"] is False and s["warnings"] == []


def test_a_short_run_warns_and_an_interrupted_one_is_partial_until_it_ends(tmp_path):
    s = summarise(folder(tmp_path / "a", runlog=["start", "interrupted"], rounds_per_fragment=1))
    assert s["partial"] is True
    assert any("too short a run" in w for w in s["warnings"]) and any("interrupted" in w for w in s["warnings"])
    s = summarise(folder(tmp_path / "b", runlog=["start", "interrupted", "resume", "end"]))
    assert s["partial"] is False  # resumed, then ended: whole


def test_write_summary_puts_the_tape_and_metrics_at_the_top_in_seconds_since_the_start(tmp_path):
    d = folder(tmp_path, runlog=["start", "end"])
    (d / "metrics" / "eval.jsonl").write_text("{torn line\n" + (d / "metrics" / "eval.jsonl").read_text())
    summary = write_summary(d)
    assert json.loads((d / "summary.json").read_text()) == summary
    tape = [json.loads(line) for line in (d / "tape.jsonl").read_text().splitlines()]
    assert tape[0]["closed_at"] == 50.5 + 960.0 - 1000.0 and "wall_offset" not in tape[0]
    records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "summary" and [r["time"] for r in records[:-1]] == sorted(
        r["time"] for r in records[:-1]
    )
    assert (d / "eval_loss.png").stat().st_size > 1000
    assert write_summary(d) == summary  # every writer of the folder may call it again: same result


def test_damaged_or_hostile_accounting_and_records_are_not_trusted(tmp_path):
    d = folder(tmp_path, runlog=["start", "end"])
    (d / "metrics" / "accounting.json").write_text('["not", "an", "object"]')
    with open(d / "metrics" / "learners.jsonl", "a") as f:
        f.write('{"time": "soon", "learner": 1, "incarnation": 7, "tokens": "many", "busy_s": null}\n[1, 2]\n')
    s = summarise(d)
    assert s["tokens_processed"] == 2200 and s["down"] is None  # as without the bad lines, accounting ignored
    (d / "metrics" / "accounting.json").write_text('{"horizon_s": "x", "learners": -3, "compute_s": "y"}')
    s = summarise(d)
    assert s["goodput"] == 0.0 and s["num_learners"] == 2  # nonsense is read as nothing, M from config.toml


def test_the_report_pages_goodput_is_the_summarys_for_a_run_without_accounting(tmp_path):
    """Both add the learners' busy seconds up by one rule (core.counters) over one run length."""
    from ddiloco.report.run_view import goodput_series, load_run

    d = folder(tmp_path, runlog=["start", "end"])
    summary = write_summary(d)
    series = goodput_series(load_run(d))
    assert series is not None and series[2] == pytest.approx(summary["goodput"])
    assert series[0][-1] == summary["run_time_s"]


def test_a_tape_that_breaks_an_invariant_is_said_in_the_summary(tmp_path):
    d = folder(tmp_path, runlog=["start", "end"])
    tape = d / "state" / "tape.jsonl"
    lines = tape.read_text().splitlines()
    tape.write_text("\n".join([*lines, lines[-1]]) + "\n")  # the last round again: its answers merged twice
    s = summarise(d)
    assert s["invariant_violations"] and s["invariant_violations"][0].startswith("merged_twice")
    assert any("invariant violations" in w for w in s["warnings"])


def test_tokens_processed_is_the_count_that_ended_the_run_and_stragglers_are_counted(tmp_path):
    d = folder(tmp_path, runlog=["start"])
    with open(d / "metrics" / "run.jsonl", "a") as f:  # the syncer's end record says its count
        f.write(json.dumps({"time": 20.0, "what": "end", "reason": "x", "processed_tokens": 2_250}) + "\n")
    with open(d / "metrics" / "faults.jsonl", "a") as f:
        f.write(json.dumps({"time": 15.0, "kind": "straggle", "target": "learner-1", "factor": 1.5}) + "\n")
        f.write(json.dumps({"time": 17.0, "kind": "straggle_end", "target": "learner-1"}) + "\n")
    s = summarise(d)
    assert s["tokens_processed"] == 2_250  # not the learners' reports (2,200)
    assert s["straggler_phases"] == 1 and s["failures"] == 1  # a straggler phase is no failure
