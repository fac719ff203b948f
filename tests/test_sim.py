"""The virtual-time runtime end to end on the synthetic task."""

import math

import pytest
import torch

from ddiloco.chaos.schedule import ChaosConfig, make_schedule
from ddiloco.config import load_config
from ddiloco.methods import PRESETS
from ddiloco.sim.run import simulate
from ddiloco.training.evaluate import evaluate
from ddiloco.training.inner import inner_step, lr_at, make_optimizer
from ddiloco.workloads.config import load_workload

SYNTH = ["workload.factory=ddiloco.workloads.synthetic:make_workload", "workload.batch_size=16", "run.eval_points=2"]


def cfg_for(method="decoupled", *extra):
    return load_config(None, SYNTH + [f"run.method={method}", *extra], base=PRESETS[method])


def test_one_learner_h1_mean_lr1_equals_plain_training():
    cfg = cfg_for(
        "diloco",
        "run.num_learners=1",
        "run.processed_tokens=1600",
        "algo.sync_every=1",
        "algo.merge=mean",
        "algo.outer_lr=1.0",
        "algo.outer_momentum=0.0",
        "sim.latency_s=0.0",
        "sim.jitter_s=0.0",
        "sim.bandwidth_gbps=1e9",
    )
    result = simulate(cfg)
    merged_steps = result.tape[-1]["version"]
    assert merged_steps >= 95  # 100 steps fit in the budget, minus the last in flight
    wl = load_workload(cfg.workload)
    model = wl.build_model(cfg.run.seed)
    opt = make_optimizer(model, cfg.inner)
    stream = wl.train_stream(0, 1, cfg.run.seed)
    tokens = 0
    for _ in range(merged_steps):
        b = stream.next_batch()
        inner_step(
            model, opt, wl.loss(model, b), lr_at(tokens, cfg.run.processed_tokens, cfg.inner), cfg.inner.grad_clip
        )
        tokens += b.tokens
    for name, p in model.named_parameters():
        torch.testing.assert_close(result.state[name], p.detach(), rtol=1e-6, atol=1e-7)


def test_same_seed_same_result_bit_for_bit():
    extra = (
        "run.processed_tokens=6000",
        "chaos.enabled=true",
        "chaos.restart_s=0.1",
        'chaos.stragglers=["1:2.0"]',
        "sim.speed_noise=0.1",
    )
    a, b = simulate(cfg_for("decoupled", *extra)), simulate(cfg_for("decoupled", *extra))
    assert a.failures > 0
    assert a.summary() == b.summary()
    assert a.tape == b.tape
    for k in a.state:
        assert torch.equal(a.state[k], b.state[k])
    c = simulate(cfg_for("decoupled", *extra, "run.seed=1"))
    assert c.summary() != a.summary()


@pytest.mark.parametrize("method", ["dp", "diloco", "streaming", "decoupled"])
def test_every_method_trains(method):
    cfg = cfg_for(method, "run.processed_tokens=8000")
    result = simulate(cfg)
    wl = load_workload(cfg.workload)
    untrained = evaluate(wl, wl.build_model(cfg.run.seed), wl.eval_batches())
    assert result.final_loss < 0.5 * untrained
    assert math.isfinite(result.final_loss)
    assert 8000 <= result.tokens_processed < 8000 + 4 * 16 * 16  # the budget, plus at most one step


def test_chaos_schedule_fixes_downtime_and_failure_count():
    cfg = ChaosConfig(enabled=True, downtime_fraction=0.1, failures_per_learner=3, restart_s=1.0)
    sched = make_schedule(cfg, 4, 1000.0, seed=7)
    assert len(sched.outages) == 12
    for m in range(4):
        mine = sorted((o for o in sched.outages if o.learner == m), key=lambda o: o.start_s)
        assert sum(o.end_s - o.start_s for o in mine) == pytest.approx(100.0)
        assert all(a.end_s <= b.start_s for a, b in zip(mine, mine[1:]))
        assert all(o.end_s - o.start_s >= 1.0 - 1e-9 and o.start_s >= 0 and o.end_s <= 1000.0 for o in mine)
    assert make_schedule(cfg, 4, 1000.0, seed=7) == sched
    assert make_schedule(cfg, 4, 1000.0, seed=8) != sched


def test_decoupled_under_chaos_keeps_goodput_and_failed_learners_rejoin():
    result = simulate(
        cfg_for(
            "decoupled", "run.processed_tokens=12000", "run.budget=time", "chaos.enabled=true", "chaos.restart_s=0.2"
        )
    )
    rejoins = [e for e in result.log if e["event"] == "rejoin"]
    assert len(rejoins) == result.failures == 8
    g = result.goodput
    assert g.blocked == 0.0  # decoupled learners never wait
    assert g.down + g.restarting == pytest.approx(0.1, abs=0.01)
    assert g.starting > 0  # the first join takes its transfer time
    assert g.goodput == pytest.approx(1 - g.down - g.restarting - g.starting, abs=1e-9)
    # a rejoined learner contributes again after its outage
    for e in rejoins:
        later = [r for r in result.tape if r.get("event") == "round" and r["opened_at"] > e["time"]]
        assert any(m["learner"] == e["learner"] for r in later for m in r["merged"])


def test_lock_step_waits_and_drops_a_dead_learner_after_the_liveness_timeout():
    result = simulate(
        cfg_for(
            "diloco",
            "run.processed_tokens=12000",
            "run.budget=time",
            "chaos.enabled=true",
            "chaos.restart_s=0.2",
            "algo.liveness_timeout_s=1.0",
        )
    )
    assert result.goodput.blocked > 0.0
    assert result.goodput.goodput < 1 - result.goodput.down - result.goodput.restarting
    quorums = {r["quorum"] for r in result.tape if r.get("event") == "round"}
    assert 4 in quorums and min(quorums) < 4


def test_final_sync_merges_the_remaining_progress():
    result = simulate(cfg_for("decoupled", "run.processed_tokens=16000"))
    final = [r for r in result.tape if r.get("event") == "round" and r["close_reason"] == "final"]
    assert len(final) == result.num_fragments  # one final round of every fragment
    assert all(len(r["merged"]) == 4 for r in final)  # with every learner's remaining progress
    # What is not merged is only what overwriting throws away (up to tau of every H steps).
    cfg = cfg_for("decoupled")
    assert result.tokens_merged >= (1 - cfg.algo.overlap / cfg.algo.sync_every) * result.tokens_processed


def test_the_decoupled_lr_position_keeps_up_with_the_fleet():
    """Mid-run (no final sync yet), each learner's schedule position is the tokens the fleet has
    processed: the merged count plus what is not merged yet plus what overwriting dropped."""
    from ddiloco.sim.simulation import Simulation

    cfg = cfg_for("decoupled", "run.processed_tokens=16000")
    sim = Simulation(cfg, load_workload(cfg.workload))
    sim.should_stop = lambda: sim.processed >= 16000  # stop where the budget is spent, mid-run for the protocol
    result = sim.run()
    fleet_step = 4 * sim.tokens_per_step
    for ln in sim.learners:
        core = ln.session.core
        assert core._merged_tokens < result.tokens_processed - 10 * fleet_step  # merged: far behind
        assert abs(core.fleet_tokens() - result.tokens_processed) <= fleet_step  # the position: not


def test_a_simulated_straggler_phase_is_in_the_faults_and_the_summary(tmp_path):
    from ddiloco.report.rundir import write_run_dir
    from ddiloco.report.summary import summarise
    from ddiloco.report.tape import read_jsonl

    cfg = cfg_for("decoupled", "run.processed_tokens=6000", "chaos.enabled=true", 'chaos.stragglers=["1:2.0:0.1:0.4"]')
    d = write_run_dir(tmp_path / "sim", cfg, simulate(cfg))
    phases = [f for f in read_jsonl(d / "metrics" / "faults.jsonl") if f["kind"].startswith("straggle")]
    assert [(f["kind"], f["target"]) for f in phases] == [("straggle", "learner-1"), ("straggle_end", "learner-1")]
    assert phases[0]["factor"] == 2.0 and phases[0]["time"] < phases[1]["time"]
    assert summarise(d)["straggler_phases"] == 1
