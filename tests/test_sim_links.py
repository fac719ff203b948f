"""The simulator's emulated links: the same chaos.links / chaos.site_link the relays take."""

from __future__ import annotations

import numpy as np
import pytest

from ddiloco.chaos.schedule import ChaosConfig
from ddiloco.config import load_config
from ddiloco.sim.links import SimLinks
from ddiloco.sim.run import simulate


def _links(**kw: object) -> SimLinks:
    return SimLinks(ChaosConfig(enabled=True, **kw), 2, np.random.default_rng(0))  # type: ignore[arg-type]


def test_a_message_waits_for_its_link_then_crosses_it() -> None:
    links = _links(links=("1:10mbit,50ms",))
    assert links.covers(1) and not links.covers(0)
    assert links.transfer_end(0.0, 1, "up", 1_250_000) == pytest.approx(1.0 + 0.05)  # 10 Mbit in 1 s
    # The next one sent at once waits for the first to leave the link.
    assert links.transfer_end(0.0, 1, "up", 1_250_000) == pytest.approx(2.0 + 0.05)
    # The other direction is its own link.
    assert links.transfer_end(0.0, 1, "down", 125_000) == pytest.approx(0.1 + 0.05)


def test_a_site_link_is_shared_by_every_learner() -> None:
    links = _links(site_link="8mbit")
    assert links.covers(0) and links.covers(1)
    assert links.transfer_end(0.0, 0, "up", 1_000_000) == pytest.approx(1.0)
    assert links.transfer_end(0.0, 1, "up", 1_000_000) == pytest.approx(2.0)  # behind learner 0's
    assert links.transfer_end(0.0, 1, "down", 1_000_000) == pytest.approx(1.0)


def test_stalls_hold_a_message_for_some_of_its_chunks() -> None:
    links = _links(links=("0:1gbit,stall=0.5:200ms,chunk=1KiB",))
    ends = [links.transfer_end(10.0 * k, 0, "up", 100 * 1024) - 10.0 * k for k in range(20)]
    held = [round((e - 100 * 1024 * 8 / 1e9) / 0.2) for e in ends]
    assert all(0 <= h <= 100 for h in held) and 30 < np.mean(held) < 70  # about half of 100 chunks


def test_without_chaos_there_are_no_links() -> None:
    assert not SimLinks(ChaosConfig(enabled=False, links=("1:1mbit",)), 2, np.random.default_rng(0)).covers(1)


@pytest.mark.slow  # two simulated runs
def test_a_thin_link_in_the_simulator_delays_that_learners_rounds() -> None:
    common = [
        "workload.factory=ddiloco.workloads.synthetic:make_workload",
        "workload.options={hidden = 16}",
        "run.num_learners=2",
        "run.processed_tokens=20000",
        "algo.sync_every=8",
        "chaos.enabled=true",
        "chaos.downtime_fraction=0",
        "chaos.failures_per_learner=0",
    ]
    fast = simulate(load_config(None, common))
    slow = simulate(load_config(None, [*common, 'chaos.links=["1:20kbit,500ms"]']))
    assert fast.traffic and slow.traffic
    # The same bytes cross; what a thin link changes is when.
    assert slow.summary()["run_time_s"] >= fast.summary()["run_time_s"]

    def latency(tape: list[dict]) -> float:
        return float(np.mean([r["closed_at"] - r["opened_at"] for r in tape if "opened_at" in r]))

    assert latency(slow.tape) > latency(fast.tape)
