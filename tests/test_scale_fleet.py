"""bench/scale_fleet.py: the late-round rule (pure), and one small cell end to end (slow: it
starts a syncer shard and a fake-learner process)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fleet() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_scale_fleet", ROOT / "bench" / "scale_fleet.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _round(merged: list[tuple[int, int]], quorum: int = 1, grace: float = 0.5) -> dict:
    return {
        "merged": [{"learner": m, "incarnation": 7, "seq": s} for m, s in merged],
        "quorum": quorum,
        "grace_s": grace,
        "rejected": [],
    }


def test_round_condition_quorum_grace_robust_and_all_answered() -> None:
    f = _fleet()
    sends = {(0, 7, 1): 10.0, (1, 7, 1): 10.2, (2, 7, 1): 10.9, (3, 7, 1): 11.5}
    four = _round([(0, 1), (1, 1), (2, 1), (3, 1)])
    # Without robust merging: the first answer plus the grace window, unless all asked answered first.
    assert f.round_condition(four, sends, {0, 1, 2, 3, 4}, False, 3) == pytest.approx(10.5)
    # Robust: it also waits for the third answer.
    assert f.round_condition(four, sends, {0, 1, 2, 3, 4}, True, 3) == pytest.approx(10.9)
    # Every asked learner answered before the grace was over: the last answer.
    two = _round([(0, 1), (1, 1)], grace=1.0)
    assert f.round_condition(two, sends, {0, 1}, True, 3) == pytest.approx(10.2)
    # A send time the learners did not record, or nothing merged: no condition.
    assert f.round_condition(_round([(5, 1)]), sends, {5}, True, 3) is None
    assert f.round_condition(_round([]), sends, set(), True, 3) is None


def test_cell_arguments_are_checked(tmp_path: Path) -> None:
    f = _fleet()
    with pytest.raises(ValueError, match="encoding"):
        f.run_fleet_cell(2, 1, "fp16", 10.0, tmp_path)
    with pytest.raises(ValueError, match="shards"):
        f.run_fleet_cell(2, 0, "fp32", 10.0, tmp_path)


@pytest.mark.slow
def test_small_cell_merges_and_is_cached(tmp_path: Path) -> None:
    f = _fleet()
    r = f.run_fleet_cell(2, 1, "int4", 10.0, tmp_path, hidden=64, warmup_s=2.0)
    for key in ("merges_per_s", "rounds", "rounds_late", "syncer_cpu", "heartbeats_per_s", "learner_cpu", "params"):
        assert key in r, key
    assert r["learners"] == 2 and r["shards"] == 1 and r["encoding"] == "int4"
    assert r["rounds"] > 0 and r["merges_per_s"] > 0
    assert r["rounds_unmatched"] < r["rounds"]  # send times matched the tape's merged entries
    assert r["heartbeats_per_s"][0] > 0 and r["syncer_cpu"][0] is not None
    assert not r["learner_problems"]
    cached = list(tmp_path.glob("*.json"))
    assert len(cached) == 1
    # A second call is the cached cell: no processes.
    assert f.run_fleet_cell(2, 1, "int4", 10.0, tmp_path, hidden=64, warmup_s=2.0) == r
