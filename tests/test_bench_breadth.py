"""bench/breadth.py reads its cached runs back into the report it publishes: the committed cache
gives the committed figures, and the overlap choice follows its noise rule. Nothing is trained."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def breadth():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import breadth as module  # noqa: PLC0415 (a script beside its sibling quality.py)

        yield module
    finally:
        sys.path.remove(str(ROOT / "bench"))
        sys.modules.pop("breadth", None)
        sys.modules.pop("quality", None)


def _bench(breadth, cache: Path, code: str | None = None):
    runner = breadth.Runner(cache, 1, code or breadth.q.code_digest())
    b = breadth.Bench(runner, train=False)
    try:
        for phase in breadth.PHASES:
            getattr(b, f"phase_{phase.lower()}")()
    finally:
        runner.pool.shutdown()
    return b


def test_the_report_reads_the_committed_cache_back(breadth):
    published = json.loads((ROOT / "docs" / "results" / "breadth.json").read_text())
    # The runs are keyed on the digest of the code that made them (the published one), whatever
    # the simulator's code is now.
    b = _bench(breadth, ROOT / "bench" / "cache" / "breadth", published["code_digest"])
    rep = json.loads(json.dumps(breadth.summarise(b)))  # tuples as the published JSON has them
    assert rep["best"] == published["best"]
    assert [r.get("ratio") for r in rep["overlap"]] == [r.get("ratio") for r in published["overlap"]]
    assert rep["dense"][0]["ratio"] == published["dense"][0]["ratio"]
    assert len(rep["dense"][0]["seeds"]) == 5
    assert rep["m_scaling"] == published["m_scaling"] and rep["moe_weighting"] == published["moe_weighting"]
    # The runs of the earlier digest are read only because the current code gives the same loss
    # on the run made again at it: the report shows both.
    rerun = rep["rerun"]
    assert rerun["current"]["eval_loss"] is not None
    assert all(e["eval_loss"] == rerun["current"]["eval_loss"] for e in rerun["earlier"])


def test_overwrite_stays_unless_a_rule_wins_by_more_than_the_noise(breadth, tmp_path):
    b = _bench(breadth, tmp_path)  # an empty cache: nothing run
    assert b.best_rule() == ("overwrite", 24)
    losses = {("overwrite", 12): 1.700, ("shift", 12): 1.699, ("eager", 6): 1.650}
    b.loss = lambda label: next(  # type: ignore[method-assign]
        (v for (r, h), v in losses.items() if label == f"decoupled {r} H={h} seed 0"), float("inf")
    )
    assert b.best_rule() == ("eager", 6)  # 3% better: it replaces overwrite
    losses[("eager", 6)] = 1.697  # within 0.5% of overwrite's best: overwrite stays
    assert b.best_rule() == ("overwrite", 12)


def test_an_empty_cache_reports_every_arm_as_cut(breadth, tmp_path):
    rep = breadth.summarise(_bench(breadth, tmp_path))
    assert "dp" in rep["arms_without_runs"] and all("ratio" not in r for r in rep["overlap"])
