"""Schedules over the fleet's position (``ddiloco.lr_multiplier``, ``ddiloco.fleet_scheduler``,
``Learner.fleet_fraction``): the shapes are the ones users know, the built-in loop's schedule is
the cosine shape, and a scheduler follows the fleet's position whatever its own step count, so a
restarted learner resumes where the fleet is instead of warming up again."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import merges, wait_for
from test_library import ADDRESS, DictNet, cfg, train

import ddiloco
from ddiloco.errors import UsageError
from ddiloco.training.inner import InnerConfig, lr_at
from ddiloco.training.schedule import SHAPES, lr_multiplier


class At:
    """A stand-in learner at a given fleet position."""

    def __init__(self, fraction: float = 0.0) -> None:
        self.fleet_fraction = fraction


def test_every_shape_warms_up_then_ends_at_its_final_multiplier():
    for shape in SHAPES:
        assert lr_multiplier(0.0, shape, warmup=0.1, start=0.2) == pytest.approx(0.2)
        assert lr_multiplier(0.1, shape, warmup=0.1) == pytest.approx(1.0)
        end = 1.0 if shape == "constant" else 0.05
        assert lr_multiplier(1.0, shape, warmup=0.1, final=0.05) == pytest.approx(end)
        assert lr_multiplier(7.0, shape, final=0.05) == lr_multiplier(1.0, shape, final=0.05)  # clamped
        values = [lr_multiplier(i / 100, shape, warmup=0.1, final=0.05) for i in range(101)]
        rising, falling = values[:11], values[10:]
        assert rising == sorted(rising) and falling == sorted(falling, reverse=True)
    assert lr_multiplier(0.55, "cosine", warmup=0.1, final=0.0) == pytest.approx(0.5)
    assert lr_multiplier(0.55, "linear", warmup=0.1, final=0.0) == pytest.approx(0.5)


def test_one_cycle_is_torch_one_cycle_at_the_same_position():
    total, pct = 200, 0.3
    params = [torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD(params, lr=0.1)
    ref = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.4, total_steps=total, pct_start=pct)
    warmup = (pct * total - 1) / (total - 1)  # OneCycleLR's phase boundary, in steps 0..total-1
    for step in range(total):
        expected = opt.param_groups[0]["lr"]
        mult = lr_multiplier(step / (total - 1), "one_cycle", warmup=warmup, start=1 / 25, final=1 / 25e4)
        assert 0.4 * mult == pytest.approx(expected, rel=1e-9, abs=1e-12), step
        opt.step()
        ref.step()


def test_the_built_in_loop_schedule_is_the_cosine_shape():
    c = InnerConfig()
    total = 600_000.0
    for tokens in (0, 1, 100, 29_999, 30_000, 30_001, 300_000, 599_999, 600_000, 700_000):
        warm = c.warmup_frac * total
        if tokens < warm:
            old = c.lr * (tokens + 1) / (warm + 1)
        else:
            frac = min(1.0, (tokens - warm) / (total - warm))
            old = c.lr * (c.min_lr_frac + (1 - c.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))
        assert lr_at(tokens, total, c) == pytest.approx(old, rel=1e-12)


def test_a_fleet_scheduler_follows_the_fleet_not_its_own_step_count():
    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.AdamW(params, lr=1e-3)
    where = At(0.0)
    sched = ddiloco.fleet_scheduler(opt, where, "cosine", warmup=0.1, final=0.1)
    assert opt.param_groups[0]["lr"] == 0.0  # warm-up starts at 0
    where.fleet_fraction = 0.55
    opt.step()
    sched.step()  # one step of its own, half the run for the fleet
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_multiplier(0.55, warmup=0.1, final=0.1))
    for _ in range(50):  # many of its own steps, the fleet has not moved
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_multiplier(0.55, warmup=0.1, final=0.1))
    # A restarted process: a fresh optimizer and scheduler start where the fleet is.
    again = torch.optim.AdamW(params, lr=1e-3)
    ddiloco.fleet_scheduler(again, where, "cosine", warmup=0.1, final=0.1)
    assert again.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"shape": "cos"}, "unknown schedule shape 'cos': use one of cosine, linear, one_cycle, constant"),
        ({"warmup": 1.0}, "warmup is 1.0: give the share of the run spent warming up, in [0, 1)"),
        ({"final": -0.1}, "final is -0.1: give a multiplier of the peak LR, >= 0"),
        ({"start": math.nan}, "start is nan: give a multiplier of the peak LR, >= 0"),
    ],
)
def test_a_wrong_schedule_argument_is_one_line(kwargs, says):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(UsageError) as err:
        ddiloco.fleet_scheduler(opt, At(), **kwargs)
    assert str(err.value) == says


def test_a_standalone_learner_is_its_own_fleet():
    model = DictNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ddiloco.Learner(model, config=cfg("run.processed_tokens=480")) as learner:
        assert learner.fleet_fraction == 0.0
        train(learner, model, opt, 5, seed=0)  # 48 tokens a step
        assert learner.fleet_fraction == pytest.approx(0.5)
        train(learner, model, opt, 6, seed=1)
        assert learner.fleet_fraction == 1.0  # at most 1


def test_a_restarted_learner_resumes_its_schedule_at_the_fleets_position(fleet_of_budget):
    """Learner 1 trains, leaves and comes back as a fresh process: its new scheduler starts at
    the fleet's position (past the warm-up), the one a step-counting scheduler would restart."""
    net, run_dir = fleet_of_budget
    model = DictNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    learner = ddiloco.Learner(model, ADDRESS, learner_id=1, config=cfg(*BUDGET), optimizer=opt, transport=net.learner)
    sched = ddiloco.fleet_scheduler(opt, learner, "one_cycle", warmup=0.1)
    try:
        for seed in range(40):
            train(learner, model, opt, 5, seed=seed)
            sched.step()
            if any(e.learner == 1 for r in merges(run_dir) for e in r.took_part) and learner.fleet_fraction > 0.2:
                break
        wait_for(lambda: any(e.learner == 1 for r in merges(run_dir) for e in r.took_part), 30, "a merge of 1")
    finally:
        learner.close()
    fresh = DictNet()
    opt2 = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with ddiloco.Learner(
        fresh, ADDRESS, learner_id=1, config=cfg(*BUDGET), optimizer=opt2, transport=net.learner
    ) as again:
        where = again.fleet_fraction
        ddiloco.fleet_scheduler(opt2, again, "one_cycle", warmup=0.1)
        assert where > 0.1  # the syncer's merged count: past the warm-up
        lr = opt2.param_groups[0]["lr"]
        assert lr == pytest.approx(0.1 * lr_multiplier(again.fleet_fraction, "one_cycle", warmup=0.1))
        assert lr > 0.1 * lr_multiplier(0.0, "one_cycle", warmup=0.1)  # not warming up again


BUDGET = ("run.processed_tokens=9600",)  # 200 steps of 48 tokens


@pytest.fixture
def fleet_of_budget(tmp_path):
    from ddiloco.service.base.transport import InProcessNetwork

    torch.set_num_threads(1)
    net = InProcessNetwork()
    torch.manual_seed(0)
    server = ddiloco.SyncerServer(
        DictNet(), ADDRESS, tmp_path, config=cfg(*BUDGET), transport=net.syncer(ADDRESS), fsync=False
    ).start()
    yield net, tmp_path
    server.stop()
