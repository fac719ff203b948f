"""The frontier report's arithmetic (bench/frontier.py) on made-up runs: which cells meet the
targets, the pairing by seed, the headline and the defaults beside it; and the thin-link
report's (bench/frontier_links.py): its ratios, its simulated cell's settings, the meter's
split. Nothing here trains."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
RING = 1_000_000.0


def bench_module(name: str) -> Iterator[ModuleType]:
    """bench/NAME.py as a module (its imports of bench's harness resolve), unloaded after."""
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]
        sys.path.remove(str(ROOT / "bench"))


@pytest.fixture(scope="module")
def frontier():
    yield from bench_module("frontier")


def run(loss: float, seed: int, per_step: float = 1000.0) -> dict:
    b = {"payload_up": per_step, "payload_down": per_step, "wire_up": 1.1 * per_step, "wire_down": 1.1 * per_step}
    return {"eval_loss": loss, "merged_share": 0.9, "rejected": 0, "overrides": ["x=1", f"run.seed={seed}"],
            "bytes": {**b, "dp_ring": RING}}  # fmt: skip


def cell(losses: dict[int, float], per_step: float, best=(0.5, 0.8)) -> dict:
    seeds = [run(x, s, per_step) for s, x in losses.items()]
    return {"search": [seeds[0]] * 6, "best": best, "seeds": seeds}


def rows_of(frontier, cells: dict, dp_losses: dict[int, float]) -> list[dict]:
    dp = {s: run(x, s) for s, x in dp_losses.items()}
    return frontier.summarise(cells, dp, list(frontier.SEARCH))


def test_targets_name_the_point_that_meets_them_and_the_near_misses(frontier):
    cells = {
        ("decoupled", 24, "fp32"): cell({0: 2.0, 1: 2.0, 2: 2.0}, RING / 20),
        ("decoupled", 24, "int4+EF"): cell({0: 2.01, 1: 2.01, 2: 2.01}, RING / 200),  # 150x at 1.005: met
        ("decoupled", 24, "top3%+int2+EF"): cell({0: 2.2, 1: 2.2, 2: 2.2}, RING / 1500),  # bytes, not loss
    }
    got = {t["target"].split("x")[0]: t for t in frontier.targets(rows_of(frontier, cells, {0: 2, 1: 2, 2: 2}))}
    thousand, hundred50 = got[">= 1,000"], got[">= 150"]
    assert not thousand["met"] and thousand["met_by"] is None
    assert thousand["enough_bytes_closest_loss"]["payload"] == "top3%+int2+EF"
    assert thousand["within_loss_most_bytes"]["payload"] == "int4+EF"  # 1.005 <= 1.03, 200x
    assert hundred50["met"] and hundred50["met_by"]["payload"] == "int4+EF"
    assert hundred50["met_by"]["x_fewer"] == pytest.approx(200.0)
    assert hundred50["met_by"]["over_fp32"] == pytest.approx(1.005)


def test_an_h_without_cells_is_left_out_of_the_targets_not_called_missed(frontier):
    cells = {("decoupled", 12, "fp32"): {"search": [None] * 6, "best": None, "seeds": []}}
    assert frontier.targets(rows_of(frontier, cells, {0: 2.0})) == []


def test_decoupled_against_diloco_is_paired_on_the_seeds_both_ran(frontier):
    cells = {
        ("decoupled", 24, "fp32"): cell({0: 2.0, 1: 2.1, 2: 2.2, 3: 9.0, 4: 9.0}, RING / 20),
        ("diloco", 24, "fp32"): cell({0: 1.9, 1: 2.0, 2: 2.0}, RING / 20),
    }
    (v,) = frontier.versus(rows_of(frontier, cells, {s: 2.0 for s in range(5)}))
    assert v["seeds"] == 3  # seeds 3 and 4 have no DiLoCo run to pair with
    assert v["difference"] == pytest.approx((0.1 + 0.1 + 0.2) / 3)
    assert v["difference_ci95"][0] < v["difference"] < v["difference_ci95"][1]
    assert v["ratio"] == pytest.approx((2.0 / 1.9 + 2.1 / 2.0 + 2.2 / 2.0) / 3)
    assert v["decoupled"] == pytest.approx(2.1) and v["diloco"] == pytest.approx(5.9 / 3)  # the paired seeds' means


def test_the_headline_quotes_its_settings_quality_and_bytes_from_the_same_runs(frontier):
    method, h, payload = frontier.HEADLINE
    losses = {s: 2.0 + 0.01 * s for s in frontier.HEADLINE_SEEDS}
    cells = {
        (method, h, "fp32"): cell(losses, RING / 20, best=(0.5, 0.8)),
        (method, h, payload): cell({s: 1.01 * x for s, x in losses.items()}, RING / 200, best=(1.0, 0.9)),
    }
    dp = {s: 1.9 for s in frontier.HEADLINE_SEEDS}
    rows = rows_of(frontier, cells, dp)
    defaults = [run(2.2, s, RING / 20) for s in (0, 1, 2)]
    head = frontier.headline(rows, defaults, {s: run(x, s) for s, x in dp.items()})
    assert head["measured"]
    assert f"algo.sync_every={h}" in head["settings"]
    assert {"algo.outer_lr=1.0", "algo.outer_momentum=0.9", *frontier.PAYLOADS[payload]} <= set(head["settings"])
    assert head["seeds"] == list(frontier.HEADLINE_SEEDS)
    assert head["over_fp32_same_h"] == pytest.approx(1.01)
    assert head["payload_up_x_fewer"] == pytest.approx(200.0)
    d = head["defaults"]
    assert d["seeds"] == [0, 1, 2]
    assert d["over_headline"][0] == pytest.approx(sum(2.2 / (1.01 * (2.0 + 0.01 * s)) for s in (0, 1, 2)) / 3)
    assert d["payload_x_fewer"] == pytest.approx(20.0)


def test_the_headline_is_not_claimed_before_it_is_measured(frontier):
    assert frontier.headline([], [], {}) == {"cell": list(frontier.HEADLINE), "measured": False}


def test_the_headline_and_its_reference_run_on_more_seeds_and_a_smoke_run_on_one(frontier):
    method, h, payload = frontier.HEADLINE
    seeds = frontier.SEEDS
    assert frontier.seeds_for(method, h, payload, seeds) == frontier.HEADLINE_SEEDS
    assert frontier.seeds_for(method, h, "fp32", seeds) == frontier.HEADLINE_SEEDS
    assert frontier.seeds_for(method, h + 1, payload, seeds) == seeds
    assert frontier.seeds_for("diloco", h, payload, seeds) == seeds
    assert frontier.seeds_for(method, h, payload, (0,)) == (0,)
    assert len(frontier.HEADLINE_SEEDS) >= 5 > len(seeds)


@pytest.fixture(scope="module")
def links():
    yield from bench_module("frontier_links")


def link_cell(name: str, share: float, loss: float, payload: float) -> dict:
    b = {"payload_up": payload, "payload_down": payload, "wire_up": 1.2 * payload, "wire_down": 1.3 * payload,
         "dp_ring": RING, "contribution_bytes": payload / 0.9, "contributions_per_step": 0.9}  # fmt: skip
    return {"name": name, "summary": {"merged_share": share, "eval_loss": loss, "tokens_processed": 800_000,
                                      "rejected": 0}, "round_latency_s": {"median": 1.5}, "staleness_max": 2,
            "step_s_mean": 0.1, "invariants": {"violations": []}, "bytes": b, "seen": {"wall_s": 90.0}}  # fmt: skip


def test_thin_links_are_set_against_unlimited_and_the_simulated_bytes_against_the_real(links):
    cells = {
        "unlimited": link_cell("unlimited", 0.9, 2.0, 4000.0),
        "10mbit,50ms": link_cell("10mbit,50ms", 0.81, 2.02, 4000.0),
        "2mbit,100ms + 20 s partition": None,
    }
    sim = {"rc": 0, "merged_share": 0.92, "eval_loss": 2.01, "settings": [],
           "bytes": {"payload_up": 4200.0, "payload_down": 3800.0, "wire_up": 5000.0, "wire_down": 5000.0,
                     "dp_ring": RING, "contribution_bytes": 4200.0 / 0.99, "contributions_per_step": 0.99}}  # fmt: skip
    rep = links.build(cells, sim, ["algo.sync_every=24"])
    rows = {r["cell"]: r for r in rep["rows"]}
    assert rows["unlimited"]["merged_share_vs_unlimited"] == pytest.approx(1.0)
    assert rows["10mbit,50ms"]["merged_share_vs_unlimited"] == pytest.approx(0.9)
    assert rows["10mbit,50ms"]["final_loss_vs_unlimited"] == pytest.approx(1.01)
    assert rows["2mbit,100ms + 20 s partition"] == {"cell": "2mbit,100ms + 20 s partition", "measured": False}
    check = {c["what"]: c for c in rep["bytes_check"]}
    assert check["payload_up"]["sim_over_real"] == pytest.approx(1.05)
    assert check["payload_down"]["x_fewer_real"] == pytest.approx(RING / 4000.0)
    assert check["wire_up"]["x_fewer_simulated"] == pytest.approx(RING / 5000.0)
    assert check["contributions_per_step"]["sim_over_real"] == pytest.approx(0.99 / 0.9)
    assert check["contribution_bytes"]["x_fewer_real"] is None
    md = links.markdown({**rep, "command": "python bench/frontier_links.py", "date": "today",
                         "machine": {"cpus": 2, "platform": "linux"}})  # fmt: skip
    assert "| 2mbit,100ms + 20 s partition | not run |" in md
    assert "0.810 (0.900)" in md and "| 1.050 |" in md


def test_thin_links_check_no_bytes_without_the_simulation(links):
    rep = links.build({"unlimited": link_cell("unlimited", 0.9, 2.0, 4000.0)}, None, [])
    assert rep["bytes_check"] == [] and rep["sim"] is None


def test_the_simulated_cell_keeps_the_real_cells_chaos_and_drops_its_runtime(links):
    real = {"settings": [*links.COMMON, "runtime.duration_s=420", "algo.sync_every=24"], "step_s_mean": 0.2,
            "learners": {"0": {"step_s_mean": 0.2}, "1": {"step_s_mean": 0.25}}}  # fmt: skip
    got = links.sim_settings(real)
    assert "chaos.failures_per_learner=0" in got and "chaos.downtime_fraction=0" in got and "chaos.enabled=true" in got
    assert not [s for s in got if s.startswith("runtime.")]
    assert "sim.speeds=[1.0, 0.8]" in got and "algo.sync_every=24" in got and "chaos.stragglers=[]" in got
    assert links.sim_settings({**real, "learners": {"0": {"step_s_mean": 0.2}}}) is None


def test_the_meter_splits_payload_up_into_bytes_per_contribution_and_contributions_per_step(links, tmp_path):
    import json

    def part(contrib: tuple[int, int], steps: int) -> dict:
        up = {"contribution": {"bytes": contrib[0], "messages": contrib[1]}, "heartbeat": {"bytes": 50, "messages": 5}}
        down = {"version": {"bytes": contrib[0], "messages": contrib[1]}, "rejoin": {"bytes": 9999, "messages": 1}}
        return {"format": 1, "params": 1000, "learners": 2,
                "by_learner": {"0": {"steps": steps, "up": up, "down": down},
                               "1": {"steps": steps, "up": up, "down": down}}}  # fmt: skip

    (tmp_path / "metrics").mkdir()
    # two syncer shards: bytes and messages add up, a learner's steps are the most either saw
    (tmp_path / "metrics" / "traffic.json").write_text(json.dumps(part((9000, 90), 100)))
    (tmp_path / "metrics" / "traffic-1.json").write_text(json.dumps(part((900, 9), 100)))
    b = links.metered_bytes(tmp_path)
    assert b["contribution_bytes"] == pytest.approx(9900 / 99)
    assert b["contributions_per_step"] == pytest.approx(99 / 100)
    assert b["contribution_bytes"] * b["contributions_per_step"] == pytest.approx(b["payload_up"])
    assert links.metered_bytes(tmp_path / "nothing") is None
