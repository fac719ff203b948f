"""Scripted timelines for the syncer: quorum, grace, liveness, anchoring, validation."""

import dataclasses
import math

import pytest
import torch

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.messages import Contribution, FragmentRequest, FragmentUpdate, Heartbeat
from ddiloco.core.syncer import Syncer

BASE = DiLoCoConfig(num_fragments=1, sync_every=4, overlap=2, quorum=1, grace=True, grace_gamma=0.8,
                    max_grace_steps=1.0, liveness_timeout_s=5.0, merge="mean", outer_lr=1.0, outer_momentum=0.0)


def make(cfg=BASE, learners=(0, 1, 2), init=0.0):
    layout = balanced_layout([TensorSpec("w", (4,))], cfg.fixed_fragments or 1)
    s = Syncer(cfg, layout, {"w": torch.full((4,), init)})
    for m in learners:
        s.on_join(m, 0.0)
        s.on_heartbeat(Heartbeat(m, 0, 1.0), 0.0)
    return s


def beat(s, t, learners=(0, 1, 2)):
    for m in learners:
        s.on_heartbeat(Heartbeat(m, 0, 1.0), t)


def contrib(m, value, tokens=10, steps=1, base=0, p=0, **kw):
    return Contribution(m, p, base, [torch.full((4,), float(value))], steps, tokens, **kw)


def requests(outs):
    return sorted(o.learner for o in outs if isinstance(o, FragmentRequest))


def updates(outs):
    return sorted(o.learner for o in outs if isinstance(o, FragmentUpdate))


def test_round_opens_on_the_step_clock_and_asks_live_learners():
    s = make()
    assert s.t_step(0.0) == 1.0
    assert s.next_deadline(0.0) == 1.0
    for t in (1.0, 2.0, 3.0):
        assert requests(s.poll(t)) == []
    assert requests(s.poll(4.0)) == [0, 1, 2]  # t mod H == floor(0*H/P) == 0
    assert 0 in s.rounds


def test_quorum_then_grace_admits_within_the_window_and_closes_after():
    s = make()
    beat(s, 3.5)
    s.poll(4.0)
    out = s.on_contribution(contrib(0, 1.0, tokens=10, steps=1), 4.1)
    assert updates(out) == []  # K = 1 reached, but grace keeps the round open
    rnd = s.rounds[0]
    # grace = clamp(0.8 * (2*1.0 - 0.1 - 0), 0, 1*1.0) = 1.0
    assert rnd.grace_s == pytest.approx(1.0)
    assert rnd.grace_until == pytest.approx(5.1)
    assert updates(s.on_contribution(contrib(1, 3.0, tokens=10, steps=2), 4.6)) == []
    assert updates(s.poll(5.0)) == []  # still inside the window
    out = s.poll(5.1)
    assert updates(out) == [0, 1]
    # mean merge, lr 1, momentum 0: the new global is the token-weighted mean (w = 100, 50)
    assert torch.allclose(s.fragments[0].values[0], torch.full((4,), 250.0 / 150.0))
    rec = s.tape[-1]
    assert rec["close_reason"] == "grace_over" and rec["version"] == 1
    assert [(m["learner"], m["weight"], m["in_grace"]) for m in rec["merged"]] == [(0, 100.0, False), (1, 50.0, True)]
    # learner 2 answers after the close: it is late, keeps its progress, and gets nothing
    out = s.on_contribution(contrib(2, 9.0), 5.3)
    assert updates(out) == [] and s.tape[-1]["event"] == "late"


def test_grace_shrinks_with_slow_quorum_and_is_zero_past_tau_steps():
    s = make(dataclasses.replace(BASE, max_grace_steps=5.0))
    assert s.grace_window(0.5, 0.0) == pytest.approx(0.8 * (2.0 - 0.5))
    assert s.grace_window(2.5, 0.0) == 0.0
    assert make().grace_window(0.5, 0.0) == 1.0  # clamped at max_grace_steps * t_step
    s2 = make(dataclasses.replace(BASE, grace=False))
    s2.poll(4.0)
    assert updates(s2.on_contribution(contrib(0, 1.0), 4.1)) == [0]  # K = 1, no grace
    assert s2.tape[-1]["close_reason"] == "quorum"


def test_round_closes_at_once_when_every_live_learner_answered():
    s = make()
    s.poll(4.0)
    for m in (0, 1):
        s.on_contribution(contrib(m, 1.0), 4.1)
    out = s.on_contribution(contrib(2, 1.0), 4.2)
    assert updates(out) == [0, 1, 2] and s.tape[-1]["close_reason"] == "all_answered"


def test_effective_quorum_counts_only_live_learners_and_liveness_expires():
    s = make(dataclasses.replace(BASE, quorum=3))
    s.on_heartbeat(Heartbeat(0, 3, 1.0), 3.0)
    s.on_heartbeat(Heartbeat(1, 3, 1.0), 3.0)  # learner 2 last heard at 0.0
    s.poll(4.0)
    s.on_contribution(contrib(0, 1.0), 4.1)
    assert updates(s.on_contribution(contrib(1, 1.0), 4.2)) == []
    assert s.effective_quorum(s.rounds[0], 4.2) == 3
    assert s.next_deadline(4.2) == 5.0  # the step clock's tick and learner 2's expiry
    assert updates(s.poll(5.0)) == []  # at 5.0 learner 2 is still (just) live
    deadline = math.nextafter(5.0, math.inf)
    out = s.poll(deadline)
    assert s.live(deadline) == [0, 1]
    assert updates(out) == [0, 1] and s.tape[-1]["quorum"] == 2


def test_a_learner_that_left_is_not_waited_for():
    s = make(dataclasses.replace(BASE, quorum="all"))
    s.poll(4.0)
    s.on_contribution(contrib(0, 1.0), 4.1)
    s.on_contribution(contrib(1, 1.0), 4.1)
    assert updates(s.on_leave(2, 4.2)) == [0, 1]


def test_no_round_opens_without_live_learners():
    s = make()
    assert requests(s.poll(40.0)) == []  # everybody expired long ago
    assert not s.rounds


def close_round(s, t, contributions):
    s.poll(t)
    out = []
    for c in contributions:
        out += s.on_contribution(c, t + 0.1)
    return out + s.poll(t + 5.0)


def test_stale_contribution_is_anchored_at_its_base_and_does_not_undo_the_latest_round():
    s = make(dataclasses.replace(BASE, grace=False))
    close_round(s, 4.0, [contrib(0, 2.0)])  # version 1 = 2.0
    assert s.versions() == [1]
    # learner 1 kept training from base 0 and made no change: its delta at base 0 is zero
    s.on_heartbeat(Heartbeat(1, 8, 1.0), 7.0)
    close_round(s, 8.0, [contrib(1, 0.0, base=0)])
    assert torch.allclose(s.fragments[0].values[0], torch.full((4,), 2.0))
    rec = s.tape[-1]
    assert rec["merged"][0]["staleness"] == 1


def test_anchor_current_would_undo_it():
    s = make(dataclasses.replace(BASE, grace=False, anchor="current"))
    close_round(s, 4.0, [contrib(0, 2.0)])
    s.on_heartbeat(Heartbeat(1, 8, 1.0), 7.0)
    close_round(s, 8.0, [contrib(1, 0.0, base=0)])
    assert torch.allclose(s.fragments[0].values[0], torch.zeros(4))


def test_newer_contribution_replaces_the_pending_one():
    s = make(dataclasses.replace(BASE, quorum=2, grace=False))
    s.poll(4.0)
    s.on_contribution(contrib(0, 5.0), 4.1)
    s.on_contribution(contrib(0, 1.0), 4.2)
    s.on_contribution(contrib(1, 3.0), 4.3)
    assert torch.allclose(s.fragments[0].values[0], torch.full((4,), 2.0))
    assert len(s.tape[-1]["merged"]) == 2


def test_too_stale_base_is_rejected_and_the_learner_gets_the_current_value():
    s = make(dataclasses.replace(BASE, grace=False, keep_versions=1))
    close_round(s, 4.0, [contrib(0, 1.0)])
    s.on_heartbeat(Heartbeat(0, 8, 1.0), 7.0)
    close_round(s, 8.0, [contrib(0, 2.0, base=1)])
    assert s.versions() == [2]
    s.on_heartbeat(Heartbeat(1, 8, 1.0), 11.0)
    s.poll(12.0)
    out = s.on_contribution(contrib(1, 7.0, base=0), 12.1)
    assert [(o.learner, o.reason, o.version) for o in out if isinstance(o, FragmentUpdate)] == [(1, "stale", 2)]
    assert "stale base version 0" in s.rejections[-1].reason


def test_lock_step_round_opens_on_the_first_push_and_waits_for_all_live():
    cfg = dataclasses.replace(BASE, late_fragment="wait", quorum="all", grace=False, overlap=0)
    s = make(cfg, learners=(0, 1))
    assert requests(s.poll(10.0)) == []  # no clock-driven requests in lock-step mode
    assert updates(s.on_contribution(contrib(0, 1.0), 1.0)) == []
    assert updates(s.on_contribution(contrib(1, 3.0), 1.5)) == [0, 1]


def test_flush_closes_open_rounds():
    s = make(dataclasses.replace(BASE, quorum=3, grace=False))
    s.poll(4.0)
    s.on_contribution(contrib(0, 4.0), 4.1)
    assert s.versions() == [0]
    s.flush(4.2)
    assert s.versions() == [1] and s.tape[-1]["close_reason"] == "flush"


def test_ack_times_the_sync_path_and_shrinks_grace():
    s = make(dataclasses.replace(BASE, max_grace_steps=5.0))
    s.poll(4.0)
    s.on_contribution(contrib(0, 1.0), 4.1)
    s.flush(5.1)
    from ddiloco.core.messages import Ack
    s.on_ack(Ack(0, 0, 1), 5.5)
    assert s._t_sync.value == pytest.approx(0.1 + 0.4)
    assert s.grace_window(0.1, 6.0) == pytest.approx(0.8 * (2.0 - 0.1 - 0.5))


BAD = [
    ("unknown learner", lambda: contrib(9, 1.0)),
    ("unknown fragment", lambda: contrib(0, 1.0, p=3)),
    ("shape", lambda: Contribution(0, 0, 0, [torch.zeros(5)], 1, 10)),
    ("tensors", lambda: Contribution(0, 0, 0, [torch.zeros(4), torch.zeros(4)], 1, 10)),
    ("dtype", lambda: Contribution(0, 0, 0, [torch.zeros(4, dtype=torch.float64)], 1, 10)),
    ("non-finite", lambda: Contribution(0, 0, 0, [torch.tensor([0.0, math.nan, 0.0, 0.0])], 1, 10)),
    ("non-finite", lambda: Contribution(0, 0, 0, [torch.tensor([0.0, math.inf, 0.0, 0.0])], 1, 10)),
    ("negative counters", lambda: contrib(0, 1.0, tokens=-1)),
    ("need at least one step", lambda: contrib(0, 1.0, tokens=10, steps=0)),
    ("max_tokens_per_step", lambda: contrib(0, 1.0, tokens=10**9, steps=1)),
    ("never issued", lambda: contrib(0, 1.0, base=5)),
    ("max_delta_norm", lambda: contrib(0, 1e7)),
    ("payload kind", lambda: Contribution(0, 0, 0, [torch.zeros(4)], 1, 10, kind="pickle")),
    ("integers", lambda: Contribution(0, 0, 0, [torch.zeros(4)], 1.5, 10)),
]


@pytest.mark.parametrize("what,make_bad", BAD, ids=[b[0] for b in BAD])
def test_bad_contributions_are_rejected_and_leave_the_global_model_unchanged(what, make_bad):
    s = make(dataclasses.replace(BASE, grace=False))
    s.poll(4.0)
    before = [v.clone() for v in s.fragments[0].values]
    out = s.on_contribution(make_bad(), 4.1)
    assert updates(out) == []
    assert what in s.rejections[-1].reason
    assert s.versions() == [0] and torch.equal(s.fragments[0].values[0], before[0])
    recorded = s.rounds[0].rejected if 0 <= s.rejections[-1].fragment < 1 else [e for e in s.tape if e["event"] == "rejected"]
    assert recorded[-1]["reason"] == s.rejections[-1].reason
    # the round is still usable by a good contribution
    s.on_contribution(contrib(1, 2.0), 4.2)
    assert s.versions() == [1]
