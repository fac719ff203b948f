"""The link emulator's scheduler in virtual time: no sockets, no wall clock, a seeded RNG."""

from __future__ import annotations

import random

import pytest

from ddiloco.link.config import DirectionConfig, LinkFaults, Partition
from ddiloco.link.shaper import DirectionShaper, FaultTimeline, SiteRate

KIB = 1024
NO_FAULTS = LinkFaults()


def shaper(cfg: DirectionConfig, faults: LinkFaults = NO_FAULTS, seed: int = 0, buffer: int = 1 << 30,
           chunk: int = 16 * KIB, site: SiteRate | None = None, timeline: FaultTimeline | None = None):  # fmt: skip
    tl = timeline or FaultTimeline(faults, random.Random(seed))
    return DirectionShaper(cfg, buffer, chunk, random.Random(seed), tl, site)


def drain(sh: DirectionShaper, until: float, step: float = 0.001) -> list[tuple[float, int]]:
    """(time, bytes) of every chunk that leaves, polling the shaper every ``step`` of virtual time."""
    out, t = [], 0.0
    while t <= until:
        out += [(t, len(c)) for c in sh.due(t)]
        t = round(t + step, 9)
    return out


def test_the_rate_caps_bytes_over_virtual_time():
    sh = shaper(DirectionConfig(rate_bps=8e6))  # 1 MB/s
    leaves = [sh.offer(0.0, b"x" * 10_000) for _ in range(100)]  # 1 MB offered at once
    assert leaves == sorted(leaves)
    assert leaves[-1] == pytest.approx(1.0)  # 1 MB at 1 MB/s
    assert leaves[49] == pytest.approx(0.5)
    assert sum(n for _, n in drain(sh, 0.5)) == pytest.approx(500_000, abs=10_000)


def test_no_rate_cap_means_only_latency():
    sh = shaper(DirectionConfig(latency_s=0.05))
    assert [sh.offer(0.0, b"x" * 1000) for _ in range(3)] == pytest.approx([0.05] * 3)
    assert sh.due(0.049) == [] and len(sh.due(0.05)) == 3


def test_latency_and_jitter_stay_in_their_bounds_and_in_order():
    sh = shaper(DirectionConfig(latency_s=0.1, jitter_s=0.02), seed=3)
    delays = []
    for i in range(500):
        t = i * 1.0  # far apart: no chunk waits for the one ahead
        delays.append(sh.offer(t, b"x") - t)
        assert sh.due(t + 0.2) == [b"x"]
    assert min(delays) >= 0.08 and max(delays) <= 0.12
    assert max(delays) - min(delays) > 0.03  # it does jitter
    close = shaper(DirectionConfig(latency_s=0.1, jitter_s=0.05), seed=4)
    leaves = [close.offer(i * 0.001, b"x") for i in range(200)]
    assert leaves == sorted(leaves)  # close together, the stream still leaves in order


def test_stalls_hold_chunks_at_the_chosen_rate_seeded():
    cfg = DirectionConfig(latency_s=0.01, stall_prob=0.1, stall_s=0.2)

    def run(seed: int) -> tuple[int, list[float]]:
        sh = shaper(cfg, seed=seed, chunk=1000)
        delays = []
        for i in range(2000):
            t = i * 1.0
            delays.append(sh.offer(t, b"x" * 1000) - t)
        return sh.stalls, delays

    stalls, delays = run(7)
    assert 150 <= stalls <= 250  # 10 % of 2000 chunks of chunk_bytes
    assert sorted({round(d, 6) for d in delays}) == [0.01, 0.21]
    assert run(7) == (stalls, delays)  # the same seed, the same stalls
    assert run(8)[0] != stalls or run(8)[1] != delays
    # a quarter-size read stalls a quarter as often: the chance is per chunk_bytes forwarded
    sh = shaper(cfg, seed=1, chunk=1000)
    for i in range(8000):
        sh.offer(float(i), b"x" * 250)
    assert 120 <= sh.stalls <= 290


def test_a_stall_holds_everything_behind_it():
    sh = shaper(DirectionConfig(latency_s=0.01, stall_prob=1.0, stall_s=0.5), chunk=10)
    first = sh.offer(0.0, b"x" * 10)
    sh.cfg = DirectionConfig(latency_s=0.01)  # no more stalls
    second = sh.offer(0.001, b"y")
    assert first == pytest.approx(0.51) and second == first


def test_resets_at_a_fixed_period_and_at_a_poisson_rate():
    every = FaultTimeline(LinkFaults(reset_every_s=10.0), random.Random(0))
    times = [e.time for t in range(100) for e in every.events(t * 1.0, (t + 1) * 1.0)]
    assert times == [10.0 * k for k in range(1, 11)]
    mean = FaultTimeline(LinkFaults(reset_mean_s=10.0), random.Random(5))
    resets = [e for t in range(10_000) for e in mean.events(t * 1.0, (t + 1) * 1.0)]
    assert all(e.kind == "reset" for e in resets)
    assert 850 <= len(resets) <= 1150  # 100 000 s at one per 10 s
    # the polling does not move the draws: the seed alone fixes them
    coarse = FaultTimeline(LinkFaults(reset_mean_s=10.0), random.Random(5)).events(0.0, 1000.0)
    assert [e.time for e in coarse] == [e.time for e in resets if e.time <= 1000.0]


def test_a_hold_forwards_nothing_during_it_and_everything_after():
    faults = LinkFaults(partitions=(Partition("hold", 1.0, 2.0),))
    sh = shaper(DirectionConfig(rate_bps=8e5, latency_s=0.01), faults)  # 100 kB/s
    sent = 0
    t = 0.0
    left = []
    while t < 7.0:
        if sh.space() and sent < 300:  # 300 kB over the first 3 s
            sh.offer(t, b"x" * 1000)
            sent += 1
        left += [(t, len(c)) for c in sh.due(t)]
        t = round(t + 0.01, 9)
    assert not [x for x in left if 1.0 <= x[0] < 3.0]
    assert sum(n for _, n in left) == 300_000  # nothing lost
    after = [x for x in left if x[0] >= 3.0]
    assert after[0][0] == pytest.approx(3.0)
    assert after[-1][0] == pytest.approx(5.01, abs=0.02)  # what queued up went out at the link's rate
    assert sum(n for _, n in after) == 300_000 - sum(n for x, n in left if x < 1.0)
    tl = FaultTimeline(faults, random.Random(0))
    assert tl.hold_end(0.5) is None and tl.hold_end(1.5) == 3.0 and tl.cut_end(1.5) is None
    assert [(e.time, e.kind) for e in tl.events(0.0, 10.0)] == [(1.0, "hold"), (3.0, "hold end")]


def test_a_cut_resets_and_refuses_while_it_lasts():
    tl = FaultTimeline(LinkFaults(partitions=(Partition("cut", 5.0, 3.0),)), random.Random(0))
    evs = tl.events(0.0, 20.0)
    assert [(e.time, e.kind, e.duration_s) for e in evs] == [(5.0, "cut", 3.0), (8.0, "cut end", 0.0)]
    assert tl.cut_end(4.99) is None and tl.cut_end(5.0) == 8.0 and tl.cut_end(7.9) == 8.0 and tl.cut_end(8.0) is None
    assert tl.hold_end(6.0) is None  # a cut is not a hold: what is connected is gone, nothing waits


def test_flapping_cuts_repeat_and_stop_ends_every_fault():
    tl = FaultTimeline(LinkFaults(flap_up_s=10.0, flap_down_s=5.0), random.Random(0))
    evs = [(e.time, e.kind) for t in range(45) for e in tl.events(float(t), t + 1.0)]
    assert evs == [(10.0, "cut"), (15.0, "cut end"), (25.0, "cut"), (30.0, "cut end"), (40.0, "cut"),
                   (45.0, "cut end")]  # fmt: skip
    assert tl.cut_end(26.0) == 30.0 and tl.cut_end(31.0) is None
    tl.stop(42.0)
    assert tl.cut_end(41.0) == 42.0 and tl.cut_end(43.0) is None
    assert [(e.time, e.kind) for e in tl.events(45.0, 100.0)] == []
    held = FaultTimeline(LinkFaults(partitions=(Partition("hold", 1.0, 10.0),), reset_every_s=2.0), random.Random(0))
    held.stop(3.0)
    assert held.hold_end(2.0) == 3.0
    assert [(e.time, e.kind) for e in held.events(0.0, 20.0)] == [(1.0, "hold"), (2.0, "reset"), (3.0, "hold end")]


def test_two_links_share_the_site_cap():
    site = SiteRate(8e6)  # 1 MB/s for both together
    a = shaper(DirectionConfig(rate_bps=8e6), site=site, seed=1)
    b = shaper(DirectionConfig(rate_bps=8e6), site=site, seed=2)
    t, delivered = 0.0, {"a": 0, "b": 0}
    while t < 2.0:
        for name, sh in (("a", a), ("b", b)):
            while sh.space() >= 10_000 and sh.queued_bytes < 50_000:  # each keeps its queue busy
                sh.offer(t, b"x" * 10_000)
            delivered[name] += sum(len(c) for c in sh.due(t))
        t = round(t + 0.005, 9)
    total = delivered["a"] + delivered["b"]
    assert total == pytest.approx(2_000_000, rel=0.05)  # the site's 1 MB/s, not 2 x 1 MB/s
    assert delivered["a"] == pytest.approx(delivered["b"], rel=0.1)  # shared fairly
    alone = shaper(DirectionConfig(rate_bps=8e6))
    assert alone.offer(0.0, b"x" * 1_000_000) == pytest.approx(1.0)


def test_the_buffer_is_bounded_backpressure():
    sh = shaper(DirectionConfig(rate_bps=8e4), buffer=64 * KIB)  # 10 kB/s: a slow link
    offered = 0
    for _ in range(100):  # a sender that pushes as hard as it may
        n = min(sh.space(), 16 * KIB)
        if n:
            sh.offer(0.0, b"x" * n)
            offered += n
    assert offered == 64 * KIB and sh.space() == 0 and sh.queued_bytes == 64 * KIB
    with pytest.raises(ValueError):
        sh.offer(0.0, b"x")
    got = sum(len(c) for c in sh.due(1.7))  # 16 kB out after ~1.6 s: room for 16 kB more
    assert got == 16 * KIB and sh.space() == 16 * KIB
    assert sh.next_due(1.7) == pytest.approx(3.2768, rel=1e-3)
