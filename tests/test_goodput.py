"""Goodput simulator: exact hand-computed timelines, closed-form cross-checks, reproducibility,
bad input, bandwidth model and CLI."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from ddiloco.chaos import Exponential, Fixed
from ddiloco.errors import ConfigError
from ddiloco.goodput import (
    CALIBRATED,
    CATEGORIES,
    BandwidthConfig,
    CostModel,
    FailureModel,
    FleetTimeline,
    SimConfig,
    Strategy,
    default_strategies,
    lookup,
    make_timeline,
    required_bandwidth,
    run_strategy,
    simulate_grid,
)
from ddiloco.goodput.calibrate import dp_residuals
from ddiloco.goodput.cli import main
from ddiloco.goodput.fit import nelder_mead

DP, ELASTIC = Strategy("dp"), Strategy("elastic")


def ddl(m: int, k: int = 1) -> Strategy:
    return Strategy("decoupled", learners=m, quorum=k)


def hand_timeline(
    events: list[tuple[float, int, bool, float, float]], slices: int = 4, chips: int = 100, horizon: float = 1000.0
) -> FleetTimeline:
    """(time, slice, is_failure, reconfig_s, restart_s) events on ``slices`` x ``chips``."""
    t, s, f, rc, rs = (np.array(x) for x in zip(*events))
    return FleetTimeline(
        slice_chips=np.full(slices, chips),
        slice_speed=np.ones(slices),
        t=t.astype(float),
        slice_id=s.astype(np.int64),
        is_failure=f.astype(bool),
        hits_spare=np.zeros(t.size, bool),
        reconfig_s=rc.astype(float),
        restart_s=rs.astype(float),
        warmup_s=0.0,
        horizon_s=horizon,
    )


COSTS = CostModel(step_s=7.0, checkpoint_s=30.0)
# Slice 0 fails at 100 s (downscale 10 s, restart 50 s) and returns at 300 s (upscale 20 s).
ONE_FAILURE = [(100.0, 0, True, 10.0, 50.0), (300.0, 0, False, 20.0, 0.0)]


# ---- analytic cases, exact ---------------------------------------------------------------


def test_no_failures_is_full_goodput() -> None:
    failure = FailureModel(mtbi_s=1e30)  # no failure within the horizon
    tl = make_timeline(150_000, 0, failure, CostModel(), SimConfig())
    assert tl.t.size == 0
    for s in (DP, ELASTIC, ddl(1), ddl(8), ddl(8, 8)):
        out = run_strategy(tl, s, CostModel())
        assert out.goodput == 1.0 and out.uptime == 1.0
        assert out.chip_time["useful"] == out.allocated


def test_single_learner_equals_elastic_dp() -> None:
    tl = make_timeline(150_000, 3, FailureModel(), CostModel(), SimConfig())
    a, b = run_strategy(tl, ELASTIC, CostModel()), run_strategy(tl, ddl(1), CostModel())
    assert a == b


def test_known_schedule_non_elastic() -> None:
    out = run_strategy(hand_timeline(ONE_FAILURE), DP, COSTS)
    # Runs [0, 100): 90 s kept (3 checkpoints of 30 s), 10 s lost; restart [100, 150);
    # runs [150, 1000). Returns don't matter (hot spares).
    assert out.chip_time["useful"] == pytest.approx(400 * (90 + 850))
    assert out.chip_time["lost_work"] == pytest.approx(400 * 10)
    assert out.chip_time["recovery"] == pytest.approx(400 * 50)
    assert out.goodput == pytest.approx(0.94) and out.uptime == pytest.approx(0.95)


def test_known_schedule_elastic() -> None:
    out = run_strategy(hand_timeline(ONE_FAILURE), ELASTIC, COSTS)
    # [0,100): 98 s kept (14 steps of 7 s) on 400 chips; pause [100,110) of the 300 healthy;
    # [110,300) on 300; upscale [300,320) of 400; [320,1000) on 400. Slice 0 in repair 200 s.
    assert out.chip_time["useful"] == pytest.approx(98 * 400 + 190 * 300 + 680 * 400)
    assert out.chip_time["lost_work"] == pytest.approx(2 * 400)
    assert out.chip_time["recovery"] == pytest.approx(10 * 300 + 20 * 400)
    assert out.chip_time["repair"] == pytest.approx(200 * 100)
    assert out.goodput == pytest.approx(0.9205) and out.uptime == pytest.approx(0.97)


def test_known_schedule_decoupled_and_quorum() -> None:
    tl = hand_timeline(ONE_FAILURE)
    # Learner 0 = slices {0, 1} behaves like the elastic job at half size; learner 1 never stops.
    useful0 = 98 * 200 + 190 * 100 + 680 * 200
    k1 = run_strategy(tl, ddl(2, 1), COSTS)
    assert k1.chip_time["useful"] == pytest.approx(useful0 + 1000 * 200)
    assert k1.uptime == 1.0
    # K = 2: learner 1 is blocked while learner 0 reconfigures (10 s + 20 s).
    k2 = run_strategy(tl, ddl(2, 2), COSTS)
    assert k2.chip_time["blocked"] == pytest.approx(30 * 200)
    assert k2.chip_time["useful"] == pytest.approx(useful0 + 970 * 200)
    assert k2.uptime == pytest.approx(0.97)


def test_failure_during_restart_restarts_it() -> None:
    # The second failure (at 120 s) hits the restart begun at 100 s: a fresh 50 s from 120 s.
    tl = hand_timeline([(100.0, 0, True, 10.0, 50.0), (120.0, 1, True, 10.0, 50.0)])
    out = run_strategy(tl, DP, COSTS)
    assert out.chip_time["recovery"] == pytest.approx(400 * (20 + 50))
    assert out.chip_time["useful"] == pytest.approx(400 * (90 + 830))


def test_hot_spare_failures_hit_only_the_non_elastic_job() -> None:
    # Slice 0 fails at 100 s; at 200 s its position fails again, i.e. the hot spare fails.
    tl = hand_timeline(ONE_FAILURE + [(200.0, 0, True, 5.0, 50.0)])
    tl = replace(tl, hits_spare=np.array([False, False, True]))
    dp = run_strategy(tl, DP, COSTS)
    assert dp.failures == 2 and dp.chip_time["recovery"] == pytest.approx(400 * (50 + 50))
    assert run_strategy(tl, ELASTIC, COSTS) == run_strategy(hand_timeline(ONE_FAILURE), ELASTIC, COSTS)


def test_warmup_window_is_excluded() -> None:
    tl = replace(hand_timeline(ONE_FAILURE), warmup_s=500.0)
    out = run_strategy(tl, ELASTIC, COSTS)
    assert out.allocated == 400 * 500 and out.goodput == 1.0 and out.failures == 0


# ---- closed forms as cross-checks of the simulated timelines -------------------------------


def test_non_elastic_matches_laplace_transform_of_restart() -> None:
    # Preempted restarts: goodput = E[exp(-lambda R)]; 1/(1 + lambda r) for exponential R.
    chips, r = 600_000, 60.0
    failure = FailureModel(repair=Exponential(3600.0))
    sim = SimConfig(seeds=6, measure_repairs=40)
    lam = chips / failure.mtbi_s
    for dist, expect in ((Exponential(r), 1 / (1 + lam * r)), (Fixed(r), math.exp(-lam * r))):
        costs = CostModel(restart=dist, checkpoint_s=1e-6)
        cell = simulate_grid([chips], [DP], failure, costs, sim)[0]
        assert cell.goodput.mean == pytest.approx(expect, abs=3 * cell.goodput.ci95 + 1e-3)


def test_elastic_without_pauses_loses_only_chips_in_repair() -> None:
    failure = FailureModel(repair=Exponential(7200.0))
    costs = CostModel(downscale=Fixed(0.0), upscale=Fixed(0.0), step_s=1e-6)
    cell = simulate_grid([300_000], [ELASTIC], failure, costs, SimConfig(seeds=4))[0]
    rate = failure.slice_chips / failure.mtbi_s
    down = 7200.0 / (1 / rate + 7200.0)  # alternating renewal: share of time a slice is down
    assert cell.goodput.mean == pytest.approx(1 - down, abs=0.003)


# ---- accounting, reproducibility, speed ------------------------------------------------------


def test_chip_time_categories_sum_to_allocated() -> None:
    failure = FailureModel(speed_cv=0.02)
    tl = make_timeline(300_000, 1, failure, CostModel(), SimConfig())
    for s in (DP, ELASTIC, ddl(4, 1), ddl(4, 3)):
        out = run_strategy(tl, s, CostModel())
        assert set(out.chip_time) == set(CATEGORIES)
        assert sum(out.chip_time.values()) == pytest.approx(out.allocated, rel=1e-9)
        assert all(v >= -1e-6 * out.allocated for v in out.chip_time.values())


def test_seeds_reproducible_and_distinct() -> None:
    sim = SimConfig(seeds=3)
    a = simulate_grid([150_000], default_strategies([2]), sim=sim)
    b = simulate_grid([150_000], default_strategies([2]), sim=sim)
    assert a == b
    c = simulate_grid([150_000], default_strategies([2]), sim=replace(sim, seed=7))
    assert a[0].goodput.mean != c[0].goodput.mean


def test_speed_variance_hurts_one_big_group_more() -> None:
    sim = SimConfig(seeds=2)
    base = simulate_grid([150_000], [DP, ddl(8)], sim=sim)
    slow = simulate_grid([150_000], [DP, ddl(8)], FailureModel(speed_cv=0.02), sim=sim)
    assert slow[0].goodput.mean < base[0].goodput.mean
    # Relative loss: a synchronous group waits for its slowest chip, and the slowest of the
    # whole fleet is slower than the slowest of one learner.
    loss_dp = 1 - slow[0].goodput.mean / base[0].goodput.mean
    loss_dd = 1 - slow[1].goodput.mean / base[1].goodput.mean
    assert 0 < loss_dd < loss_dp


def test_more_learners_more_goodput_and_quorum_costs() -> None:
    cells = simulate_grid([1_200_000], default_strategies([2, 8]) + [ddl(8, 8)], sim=SimConfig(seeds=3))
    g = {c.strategy.name: c.goodput.mean for c in cells}
    assert g["DP"] < g["elastic DP"] < g["DDiLoCo M=2"] < g["DDiLoCo M=8"]
    assert g["DDiLoCo M=8 K=8"] < g["DDiLoCo M=8"]
    assert lookup(cells, 1_200_000, "DDiLoCo M=8").uptime.mean > 0.999


def test_documented_calibration_still_fits() -> None:
    res = dp_residuals(CALIBRATED, SimConfig(seeds=2))
    assert len(res) == 10 and max(abs(r.residual) for r in res) < 5.0


def test_nelder_mead_finds_quadratic_minimum() -> None:
    r = nelder_mead(
        lambda x: float(np.sum((x - [1.0, -2.0, 3.0]) ** 2)),
        np.zeros(3),
        step=0.5,
        max_evals=2000,
        xtol=1e-6,
        ftol=1e-12,
    )
    assert np.allclose(r.x, [1.0, -2.0, 3.0], atol=1e-4)


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: simulate_grid([0], [DP]), "chips"),
        (lambda: simulate_grid([-5], [DP]), "chips"),
        (lambda: FailureModel(mtbi_s=0.0), "mtbi"),
        (lambda: FailureModel(mtbi_s=-1.0), "mtbi"),
        (lambda: FailureModel(slice_chips=0), "slice_chips"),
        (lambda: simulate_grid([1000], [ddl(8)], FailureModel(slice_chips=256)), "learners"),
        (lambda: ddl(4, 0), "quorum"),
        (lambda: ddl(4, 5), "quorum"),
        (lambda: Strategy("decoupled", learners=0), "learners"),
        (lambda: SimConfig(seeds=0), "seeds"),
        (lambda: BandwidthConfig(params=-1), "params"),
        (lambda: BandwidthConfig(fragments=48, sync_every=24), "fragments"),
        (lambda: BandwidthConfig(encoding="fp64"), "encoding"),
    ],
)
def test_bad_input_names_the_field(make, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        make()


@pytest.mark.parametrize(
    "argv,field",
    [
        (["--chips", "-5"], "chips"),
        (["--chips", "0"], "chips"),
        (["--mtbi", "0"], "mtbi"),
        (["--slice-chips", "0"], "slice_chips"),
        (["--chips", "1000", "--learners", "8"], "learners"),
        (["--quorum", "0"], "quorum"),
        (["--learners", "2", "--quorum", "3"], "quorum"),
        (["--repair", "weibull:2h"], "repair"),
        (["bandwidth", "--params", "x"], "params"),
    ],
)
def test_cli_bad_input_is_one_line(argv: list[str], field: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and field in err and "\n" not in err


# ---- bandwidth ------------------------------------------------------------------------------


def test_bandwidth_defaults_reproduce_the_blog_order_of_magnitude() -> None:
    r = {x.method: x for x in required_bandwidth(BandwidthConfig())}
    assert r["data-parallel"].gbps == pytest.approx(198.0, rel=0.01)
    assert 0.3 < r["Decoupled DiLoCo"].gbps < 3.0  # blog: 0.84 Gbps
    assert r["Decoupled DiLoCo"].hub_gbps == pytest.approx(8 * r["Decoupled DiLoCo"].gbps)
    assert r["data-parallel"].gbps > r["DiLoCo"].gbps > r["Streaming DiLoCo"].gbps > r["Decoupled DiLoCo"].gbps


def test_bandwidth_formula_by_hand() -> None:
    cfg = BandwidthConfig(
        params=1e9, step_s=1.0, sites=4, fragments=4, sync_every=8, overlap=1, encoding="bf16", dp_encoding="fp32"
    )
    r = {x.method: x.gbps for x in required_bandwidth(cfg)}
    assert r["data-parallel"] == pytest.approx(2 * 3 / 4 * 1e9 * 32 / 1e9)
    assert r["DiLoCo"] == pytest.approx(2 * 3 / 4 * 16)  # whole model within 1 step
    assert r["Streaming DiLoCo"] == pytest.approx(2 * 3 / 4 * 16 / 4)
    assert r["Decoupled DiLoCo"] == pytest.approx(16 / 4)  # a fragment every 2 steps,
    # but it must arrive within tau = 1 step: the window, not the interval, sets the rate


def test_bits_per_value_match_the_wire_encoder() -> None:
    compress = pytest.importorskip("ddiloco.core.compress")
    from ddiloco.goodput.bandwidth import BITS_PER_VALUE

    n = 128 * 1000
    for enc, bits in BITS_PER_VALUE.items():
        assert compress.encoded_nbytes(n, enc) * 8 == pytest.approx(bits * n)


def test_bits_per_value_cover_every_encoding_of_the_wire() -> None:
    from ddiloco.core.compress import ENCODINGS
    from ddiloco.goodput.bandwidth import BITS_PER_VALUE

    assert tuple(BITS_PER_VALUE) == ENCODINGS  # read from the wire's table, not a copy of it
    assert BITS_PER_VALUE["fp32"] == 32 and BITS_PER_VALUE["int8"] == 8 + 32 / 128


def test_traffic_per_step_by_hand() -> None:
    from ddiloco.goodput import traffic_per_step
    from ddiloco.protocol.traffic import HEADER_BYTES, TENSOR_SPEC_BYTES

    # N = 1000 fp32 values, P = 2, H = 4, M = 2, no heartbeats: 1000 * 4 / 4 bytes of payload a step
    t = traffic_per_step(1000, 2, 4, 2)
    assert t.up_payload == t.down_payload == 1000
    assert t.up_overhead == pytest.approx(2 * (HEADER_BYTES["contribution"] + HEADER_BYTES["ack"]) / 4)
    assert t.down_overhead == pytest.approx(2 * (HEADER_BYTES["request"] + HEADER_BYTES["version"]) / 4)
    assert t.dp_bytes == 4000  # 2 (M - 1) / M * N * 4
    j = t.to_json()
    assert j["up_bytes_per_step"] == pytest.approx(t.up_payload + t.up_overhead)
    assert j["dp_ratio_up"] == pytest.approx(4000 / j["up_bytes_per_step"])
    assert traffic_per_step(1000, 2, 4, 4).dp_bytes == 6000
    # int8 up (one float32 scale per 128 values), bf16 down; tensor specs; heartbeats: 2 shards, 2 a second, 0.5 s steps
    t = traffic_per_step(1280, 2, 4, 2, "int8", "bf16", tensors=3, step_s=0.5, heartbeat_interval_s=0.5, shards=2)
    assert t.up_payload == (1280 + 4 * 10) / 4 and t.down_payload == 1280 * 2 / 4
    beats_up = 2 * HEADER_BYTES["heartbeat"]
    assert t.up_overhead == pytest.approx(
        (2 * (HEADER_BYTES["contribution"] + HEADER_BYTES["ack"]) + 3 * TENSOR_SPEC_BYTES) / 4 + beats_up
    )
    with pytest.raises(ConfigError, match="encoding"):
        traffic_per_step(1000, 2, 4, 2, "fp64")
    with pytest.raises(ConfigError, match="learners"):
        traffic_per_step(1000, 2, 4, 0)


# ---- CLI ------------------------------------------------------------------------------------


def test_cli_grid_json_and_plot(tmp_path, capsys) -> None:
    png = tmp_path / "g.png"
    assert main(["--chips", "150k,300k", "--learners", "2,4", "--seeds", "2", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["cells"]) == 2 * 4 and out["config"]["failure"]["slice_chips"] == 256
    assert png.stat().st_size > 10_000


def test_cli_tables(capsys) -> None:
    assert main(["grid", "--chips", "150k", "--learners", "8", "--seeds", "2"]) == 0
    assert "DDiLoCo M=8" in capsys.readouterr().out
    assert main(["bandwidth", "--params", "12e9", "--sites", "4"]) == 0
    assert "Decoupled DiLoCo" in capsys.readouterr().out
    assert main(["bandwidth", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["methods"]) == 4
    args = ["bandwidth", "--params", "1000", "--sites", "2", "-P", "2", "-H", "4", "--encoding", "fp32", "--json"]
    assert main(args) == 0
    per_step = json.loads(capsys.readouterr().out)["per_step"]
    assert per_step["up_payload"] == 1000 and per_step["dp_bytes_per_step"] == 4000
    assert main(["bandwidth"]) == 0
    assert "bytes per learner per inner step" in capsys.readouterr().out
