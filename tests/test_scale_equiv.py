"""Scale equivalence and the target's goodput (``ddiloco.goodput.target``, ``ddiloco goodput
target``), link strings split into the kernel's rate and the relay's rest, and the launcher's
emulated hosts as configured (refusals, where each role runs, what the relays get).

The run itself across emulated hosts is the slow test in tests/test_emulated_hosts.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddiloco.config import load_config
from ddiloco.errors import ConfigError, DDiLoCoError
from ddiloco.goodput.target import (
    LossCosts,
    Target,
    equivalent,
    long_run_goodput,
    predict,
    scheduled_losses,
)
from ddiloco.link.config import split_rates
from ddiloco.link.hosts import unavailable
from ddiloco.service.ops import launcher as launcher_mod
from ddiloco.service.ops.launcher import Launcher

SYNTHETIC = ["workload.factory=ddiloco.workloads.synthetic:make_workload", "workload.options={hidden = 8}"]


def test_the_local_run_keeps_the_targets_two_ratios():
    target = Target(params=7e9, step_s=4.0, learners=4, loss_every_s=1800.0, link_bps=1e9)
    eq = equivalent(target, 2e6, 0.25)
    assert eq.k == 16.0
    # transfer time over step time
    local_ratio = eq.local_model_bytes * 8 / eq.link_bps / eq.local_step_s
    assert local_ratio == pytest.approx(target.transfer_steps()) == pytest.approx(56.0)
    # time between losses over step time
    assert eq.loss_every_s / eq.local_step_s == pytest.approx(target.loss_every_s / target.step_s) == 450.0
    assert eq.link_bps == pytest.approx(1e9 * (8e6 / 28e9) * 16)
    assert eq.to_target_s(eq.to_local_s(123.0)) == pytest.approx(123.0)
    assert equivalent(Target(link_bps=10e9), 2e6, 0.25).link_bps == pytest.approx(10 * eq.link_bps)


def test_the_prediction_is_the_launchers_time_accounting():
    target = Target(params=7e9, step_s=4.0, learners=4, loss_every_s=1800.0, link_bps=1e9)
    costs = LossCosts(restart_delay_s=30.0, startup_s=60.0, restart_moves_n=0.5, replace_moves_n=1.0)
    n_over_link = 28e9 * 8 / 1e9  # 224 s
    assert costs.of("restart", target) == pytest.approx(90 + 0.5 * n_over_link)
    assert costs.of("replace", target) == pytest.approx(90 + n_over_link)
    assert predict(target, costs, 3600.0, losses=[]).goodput == 1.0
    one = predict(target, costs, 3600.0, losses=[(100.0, "replace")])
    assert one.goodput == pytest.approx(1 - (90 + n_over_link) / (4 * 3600))
    assert one.lost_learner_s == pytest.approx(90 + n_over_link)
    late = predict(target, costs, 3600.0, losses=[(3550.0, "replace")])  # only what is left of the run
    assert late.lost_learner_s == pytest.approx(50.0)
    # the first join: every learner's start-up and a whole model over its link, before its first step
    join = 60.0 + n_over_link
    assert one.first_join_s == pytest.approx(join)
    assert one.goodput_with_first_join == pytest.approx((4 * 3600 - one.lost_learner_s) / (4 * (3600 + join)))
    assert scheduled_losses(target, 4000.0) == [(900.0, "restart"), (2700.0, "replace")]
    assert predict(target, costs, 4000.0).lost_learner_s == pytest.approx(
        costs.of("restart", target) + costs.of("replace", target)
    )
    mean = (costs.of("restart", target) + costs.of("replace", target)) / 2
    assert long_run_goodput(target, costs) == pytest.approx(1 - mean / (4 * 1800))
    assert long_run_goodput(target, costs, replace_share=0.0) > long_run_goodput(target, costs, replace_share=1.0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Target(params=0),
        lambda: Target(step_s=float("inf")),
        lambda: Target(learners=0),
        lambda: LossCosts(startup_s=-1.0),
        lambda: equivalent(Target(), 0, 0.25),
        lambda: predict(Target(), LossCosts(), 0.0),
        lambda: long_run_goodput(Target(), LossCosts(), replace_share=2.0),
    ],
)
def test_bad_targets_are_refused_in_one_line(make):
    with pytest.raises(ConfigError) as e:
        make()
    assert "\n" not in str(e.value)


def test_ddiloco_goodput_target_prints_the_prediction_and_the_local_equivalent():
    run = lambda *a: subprocess.run([sys.executable, "-m", "ddiloco", "goodput", "target", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)  # fmt: skip
    done = run("--link", "10gbit", "--horizon", "4000s", "--local-params", "2e6", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["transfer_steps"] == pytest.approx(5.6)
    assert out["local"]["k"] == 16.0 and out["local"]["link_bps"] == pytest.approx(1e10 * 8e6 / 28e9 * 16)
    assert 0.9 < out["prediction"]["goodput"] <= 1.0 and out["long_run_goodput"] > 0.9
    table = run("--horizon", "1h")
    assert table.returncode == 0 and "goodput over 3,600 s from the first step" in table.stdout
    bad = run("--link", "fast")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "link" in bad.stderr


def test_a_link_string_splits_into_the_kernels_rate_and_the_relays_rest():
    assert split_rates("10mbit,50ms") == ((1e7, 1e7), "50ms")
    assert split_rates("10mbit,20ms,up.rate=1mbit") == ((1e6, 1e7), "20ms")
    assert split_rates("rate=5mbit,jitter=2ms,latency=10ms,buffer=256KiB") == (
        (5e6, 5e6),
        "jitter=2ms,latency=10ms,buffer=256KiB",
    )
    assert split_rates("4.5714mbit") == ((4.5714e6, 4.5714e6), "")
    assert split_rates("inf,30ms") == ((0.0, 0.0), "30ms")
    with pytest.raises(ConfigError):
        split_rates("10mbit,fast")


def hosted(tmp_path, *extra: str, insecure: bool = False) -> Launcher:
    cfg = load_config(None, [*SYNTHETIC, "run.num_learners=2", "chaos.enabled=true", "chaos.hosts=true",
                             "chaos.failures_per_learner=0", "runtime.duration_s=60", *extra])  # fmt: skip
    return Launcher(cfg, tmp_path / "run", insecure=insecure)


def test_emulated_hosts_where_they_cannot_be_made_are_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher_mod, "hosts_unavailable", lambda: "emulated hosts need root (network namespaces)")
    with pytest.raises(DDiLoCoError) as e:
        hosted(tmp_path)
    assert "chaos.hosts: emulated hosts need root" in str(e.value) and "chaos.hosts = false" in str(e.value)
    assert "\n" not in str(e.value)


def test_emulated_hosts_put_every_role_on_its_own_and_the_rate_in_the_kernel(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher_mod, "hosts_unavailable", lambda: None)  # nothing is made until run()
    with pytest.raises(DDiLoCoError, match="keys are required; drop --insecure"):
        hosted(tmp_path, insecure=True)
    la = hosted(tmp_path, 'chaos.links=["0:20mbit,10ms", "1:5mbit"]', 'chaos.link_faults=["1:cut:5s@20s"]')
    hosts = la.hosts
    assert hosts is not None and not hosts.is_up
    syncer = hosts.address("syncer")
    assert la.addr == f"tcp://{syncer}:5600"
    for proc, where in [(la.syncer, "syncer"), (la.evaluator, "evaluator"), (la.learners[0], "learner-0"),
                        (la.learners[1], "learner-1"), (la.links, "syncer")]:  # fmt: skip
        assert proc is not None and proc.argv[:4] == ["ip", "netns", "exec", hosts.namespaces[where]]
    assert hosts.rates["learner-0"] == (2e7, 2e7) and hosts.rates["learner-1"] == (5e6, 5e6)
    assert hosts.rates["syncer"] == (0.0, 0.0)
    routes = {r["name"]: r for r in la.link_plan()["routes"]}
    assert routes["link-0"]["link"] == "10ms" and routes["link-0"]["listen"] == f"{syncer}:5601"
    assert routes["link-1"]["link"] == "" and routes["link-1"]["faults"] == ["cut:5s@20s"]  # its rate is its host's
    # a learner whose link is only a rate needs no relay: it dials the syncer's host
    plain = hosted(tmp_path, 'chaos.links=["0:20mbit", "1:5mbit"]')
    assert plain.links is None and f"tcp://{syncer}:5600" in plain.learners[0].argv


@pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")
def test_a_hosted_launcher_that_fails_at_start_leaves_no_namespace(tmp_path, monkeypatch):
    la = hosted(tmp_path)

    def broken() -> None:
        raise DDiLoCoError("the syncer exited at start")

    monkeypatch.setattr(la, "_supervise", broken)
    with pytest.raises(DDiLoCoError):
        la.run()
    assert la.hosts is not None and not la.hosts.is_up
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in la.hosts.namespaces.values() if n in listed]
