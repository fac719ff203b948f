"""Scripted timelines for the syncer: quorum, grace, liveness, anchoring, validation."""

import dataclasses
import itertools
import math

import pytest
import torch

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.messages import Ack, Contribution, FragmentRequest, FragmentUpdate, Heartbeat, Join, Leave
from ddiloco.core.syncer import Output, Syncer

# The scripted timelines below test quorum, grace, anchoring and validation on toy values far
# from any model's scale: the merge-influence bounds (tested on their own at the end) and the
# robust merge (tests/test_robust_merge.py; it waits for 3 answers) are off.
BASE = DiLoCoConfig(
    robust=False,
    max_delta_floor=1e6,
    weight_cap=0.0,
    norm_screen_factor=0.0,
    quarantine_after=0,
    num_fragments=1,
    sync_every=4,
    overlap=2,
    quorum=1,
    grace=True,
    grace_gamma=0.8,
    max_grace_steps=1.0,
    liveness_timeout_s=5.0,
    merge="mean",
    outer_lr=1.0,
    outer_momentum=0.0,
)
SEQ = itertools.count(1)


class Driver:
    """The smallest driver: hands events to the core and keeps the tape it returns, as the
    simulator and the service do."""

    def __init__(self, core: Syncer) -> None:
        self.core = core
        self.tape: list[dict] = []
        self.durable: list[int] = []
        # Every version each fragment had, as the learners hold them (their base copies).
        self.seen: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._remember()

    def __getattr__(self, name):
        return getattr(self.core, name)

    def _remember(self) -> None:
        for p in self.core.owned:
            f = self.core.fragments[p]
            self.seen.setdefault((p, f.version), [v.clone() for v in f.values])

    def _keep(self, out: Output) -> list:
        self.tape += [r.to_json() for r in out.tape]
        self.durable += out.durable
        self._remember()
        return out.messages

    def as_learners_send(self, c: Contribution) -> Contribution:
        """A values payload as a learner sends it: the exact delta against its base copy (the
        syncer keeps no past parameters). Payloads it cannot anchor go as they are."""
        base = self.seen.get((c.fragment, c.base_version))
        if c.kind != "values" or base is None or len(base) != len(c.values):
            return c
        pairs = zip(c.values, base)
        if not all(isinstance(v, torch.Tensor) and v.shape == b.shape and v.dtype == b.dtype for v, b in pairs):
            return c
        pieces = self.core.layout.fragments[c.fragment]
        values = [b - v if pc.kind == "param" else v for b, v, pc in zip(base, c.values, pieces)]
        return dataclasses.replace(c, values=values, kind="delta")

    def on_join(self, m, t, incarnation=0, bases=()):
        return self._keep(self.core.handle(Join(m, incarnation, list(bases)), t))

    def on_heartbeat(self, hb, t):
        return self._keep(self.core.handle(hb, t))

    def on_contribution(self, c, t):
        return self._keep(self.core.handle(self.as_learners_send(c), t))

    def on_leave(self, m, t, incarnation=0):
        return self._keep(self.core.handle(Leave(m, incarnation), t))

    def on_ack(self, ack, t):
        return self._keep(self.core.handle(ack, t))

    def poll(self, t):
        return self._keep(self.core.poll(t))

    def flush(self, t):
        return self._keep(self.core.flush(t))

    def last_rejection(self) -> dict:
        """The newest rejection: in an open round's list, or on the tape."""
        for rnd in self.core.rounds.values():
            if rnd.rejected:
                return rnd.rejected[-1].to_json()
        return [e for e in self.tape if e["event"] == "rejected"][-1]


def make(cfg=BASE, learners=(0, 1, 2), init=0.0):
    layout = balanced_layout([TensorSpec("w", (4,))], cfg.fixed_fragments or 1)
    s = Driver(Syncer(cfg, layout, {"w": torch.full((4,), init)}, [False]))
    for m in learners:
        s.on_join(m, 0.0)
        s.on_heartbeat(Heartbeat(m, 0, 0, 1.0), 0.0)
    return s


def beat(s, t, learners=(0, 1, 2)):
    for m in learners:
        s.on_heartbeat(Heartbeat(m, 0, 0, 1.0), t)


def contrib(m, value, tokens=10, steps=1, base=0, p=0, **kw):
    return payload(m, [torch.full((4,), float(value))], tokens=tokens, steps=steps, base=base, p=p, **kw)


def payload(m, values, tokens=10, steps=1, base=0, p=0, incarnation=0, seq=None, kind="values"):
    return Contribution(
        learner=m,
        incarnation=incarnation,
        fragment=p,
        base_version=base,
        seq=next(SEQ) if seq is None else seq,
        values=values,
        steps=steps,
        tokens=tokens,
        data_position=0,
        step=0,
        kind=kind,
    )


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
    s.on_heartbeat(Heartbeat(0, 0, 3, 1.0), 3.0)
    s.on_heartbeat(Heartbeat(1, 0, 3, 1.0), 3.0)  # learner 2 last heard at 0.0
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
    s.on_heartbeat(Heartbeat(1, 0, 8, 1.0), 7.0)
    close_round(s, 8.0, [contrib(1, 0.0, base=0)])
    assert torch.allclose(s.fragments[0].values[0], torch.full((4,), 2.0))
    rec = s.tape[-1]
    assert rec["merged"][0]["staleness"] == 1


def test_anchor_current_would_undo_it():
    s = make(dataclasses.replace(BASE, grace=False, anchor="current"))
    close_round(s, 4.0, [contrib(0, 2.0)])
    s.on_heartbeat(Heartbeat(1, 0, 8, 1.0), 7.0)
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
    s.on_heartbeat(Heartbeat(0, 0, 8, 1.0), 7.0)
    close_round(s, 8.0, [contrib(0, 2.0, base=1)])
    assert s.versions() == [2]
    s.on_heartbeat(Heartbeat(1, 0, 8, 1.0), 11.0)
    s.poll(12.0)
    out = s.on_contribution(contrib(1, 7.0, base=0), 12.1)
    assert [(o.learner, o.reason, o.version) for o in out if isinstance(o, FragmentUpdate)] == [(1, "stale", 2)]
    assert "stale base version 0" in s.last_rejection()["detail"]


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
    s.on_ack(Ack(0, 0, 0, 1), 5.5)
    assert s._t_sync.value == pytest.approx(0.1 + 0.4)
    assert s.grace_window(0.1, 6.0) == pytest.approx(0.8 * (2.0 - 0.1 - 0.5))


BAD = [
    ("unknown learner", lambda: contrib(9, 1.0)),
    ("unknown fragment", lambda: contrib(0, 1.0, p=3)),
    ("shape", lambda: payload(0, [torch.zeros(5)])),
    ("tensors", lambda: payload(0, [torch.zeros(4), torch.zeros(4)])),
    ("dtype", lambda: payload(0, [torch.zeros(4, dtype=torch.float64)])),
    ("non-finite", lambda: payload(0, [torch.tensor([0.0, math.nan, 0.0, 0.0])])),
    ("non-finite", lambda: payload(0, [torch.tensor([0.0, math.inf, 0.0, 0.0])])),
    ("negative counters", lambda: contrib(0, 1.0, tokens=-1)),
    ("need at least one step", lambda: contrib(0, 1.0, tokens=10, steps=0)),
    ("max_tokens_per_step", lambda: contrib(0, 1.0, tokens=10**9, steps=1)),
    ("never issued", lambda: contrib(0, 1.0, base=5)),
    ("max_delta_norm", lambda: contrib(0, 1e7)),
    ("payload kind", lambda: payload(0, [torch.zeros(4)], kind="pickle")),
    ("integers", lambda: payload(0, [torch.zeros(4)], steps=1.5)),
    ("not the registered", lambda: contrib(0, 1.0, incarnation=7)),
]


@pytest.mark.parametrize("what,make_bad", BAD, ids=[b[0] for b in BAD])
def test_bad_contributions_are_rejected_and_leave_the_global_model_unchanged(what, make_bad):
    s = make(dataclasses.replace(BASE, grace=False))
    s.poll(4.0)
    before = [v.clone() for v in s.fragments[0].values]
    out = s.on_contribution(make_bad(), 4.1)
    assert updates(out) == []
    rejection = s.last_rejection()
    assert what in rejection["detail"]
    assert s.versions() == [0] and torch.equal(s.fragments[0].values[0], before[0])
    recorded = (
        s.rounds[0].rejected if 0 <= rejection["fragment"] < 1 else [e for e in s.tape if e["event"] == "rejected"]
    )
    assert recorded[-1] == rejection or recorded[-1].to_json() == rejection
    # the round is still usable by a good contribution
    s.on_contribution(contrib(1, 2.0), 4.2)
    assert s.versions() == [1]


def test_a_replayed_or_duplicated_contribution_is_merged_once():
    s = make(dataclasses.replace(BASE, grace=False))
    c = contrib(0, 2.0)
    close_round(s, 4.0, [c, c])  # a duplicate right behind the original
    rounds = lambda: [e for e in s.tape if e["event"] == "round"]  # noqa: E731
    rejected = lambda: [
        r["reason"] for e in s.tape for r in (e["rejected"] if e["event"] == "round" else [e]) if e["event"] != "late"
    ]  # noqa: E731
    assert s.versions() == [1] and len(rounds()[-1]["merged"]) == 1 and rejected() == ["duplicate"]
    beat(s, 7.0)
    close_round(s, 8.0, [c])  # a byte-identical replay in a later round
    assert s.versions() == [1] and rejected() == ["duplicate", "duplicate"]
    # an older sequence number that arrives late (reordered) is refused too
    close_round(s, 12.0, [contrib(0, 3.0, seq=c.seq + 100, base=1), contrib(0, 9.0, seq=c.seq + 50, base=1)])
    assert s.versions() == [2] and torch.allclose(s.fragments[0].values[0], torch.full((4,), 3.0))
    assert rejected()[-1] == "duplicate"


def test_a_restarted_learner_replaces_its_predecessor_and_its_messages_are_dropped():
    s = make(dataclasses.replace(BASE, grace=False, quorum=2))
    old = contrib(0, 5.0, incarnation=0)
    s.on_join(0, 3.0, incarnation=1)  # the process restarted: a fresh join with a new incarnation
    s.on_join(0, 3.1, incarnation=0)  # a join of the dead process, delayed in the network: ignored
    assert s.learners[0].incarnation == 1
    s.poll(4.0)
    s.on_contribution(old, 4.1)
    assert s.last_rejection()["reason"] == "stale_incarnation"
    s.on_contribution(contrib(0, 1.0, incarnation=1), 4.2)
    s.on_contribution(contrib(1, 3.0), 4.3)
    assert s.versions() == [1] and torch.allclose(s.fragments[0].values[0], torch.full((4,), 2.0))


def test_join_sends_only_the_fragments_the_learner_lacks():
    layout = balanced_layout([TensorSpec("a", (4,)), TensorSpec("b", (4,))], 2)
    s = Driver(
        Syncer(
            dataclasses.replace(BASE, num_fragments=2),
            layout,
            {"a": torch.zeros(4), "b": torch.ones(4)},
            [False, False],
        )
    )
    assert sorted(o.fragment for o in s.on_join(0, 0.0)) == [0, 1]  # a fresh process needs all
    assert s.on_join(0, 0.1, bases=[0, 0]) == []  # already holds the current versions
    assert [o.fragment for o in s.on_join(0, 0.2, bases=[0, 3])] == [1]  # a version it cannot have


# -- the run's end: final sync -------------------------------------------------------------


def test_final_sync_merges_every_live_learners_remaining_progress_and_opens_no_more_rounds():
    s = make(dataclasses.replace(BASE, grace=False))  # K = 1: a normal round would close on one answer
    s.poll(4.0)
    s.on_contribution(contrib(0, 4.0), 4.1)  # closes version 1 = 4.0 (K = 1)
    assert s.versions() == [1]
    s.on_contribution(contrib(1, 8.0, steps=2), 4.2)  # late: kept by learner 1 for later
    assert any(e["event"] == "late" for e in s.tape)
    beat(s, 5.0)
    s.core.flush(5.0, final=True)
    out = s._keep(s.core.final_sync(5.0))
    assert requests(out) == [0, 1, 2]  # every live learner, for every fragment
    s.on_contribution(contrib(0, 6.0, base=1), 5.1)  # 2 more units since version 1
    s.on_contribution(contrib(1, 8.0, steps=2), 5.2)  # its progress since version 0
    assert s.versions() == [1]  # a final round waits for every live learner, whatever K is
    s.on_contribution(contrib(2, 0.0, steps=0, tokens=0), 5.3)  # nothing new: weight 0
    rec = s.tape[-1]
    assert rec["close_reason"] == "final" and s.versions() == [2] and not s.rounds
    assert sorted(m["learner"] for m in rec["merged"]) == [0, 1, 2]
    # mean of the outer gradients with weights tokens^2/steps (100 and 50): Theta = 4 - (100*-2 + 50*-8)/150
    assert torch.allclose(s.fragments[0].values[0], torch.full((4,), 4.0 + 600 / 150))
    beat(s, 40.0)
    assert requests(s.poll(40.0)) == [] and not s.rounds  # the clock opens nothing after the end


def test_final_sync_does_not_wait_for_a_silent_learner_past_the_liveness_timeout():
    s = make(dataclasses.replace(BASE, grace=False))
    s.core.flush(1.0, final=True)
    s._keep(s.core.final_sync(1.0))
    s.on_contribution(contrib(0, 1.0), 1.1)
    s.on_contribution(contrib(1, 1.0), 1.2)
    assert s.rounds  # learner 2 was live when asked
    deadline = s.next_deadline(1.2)
    assert deadline is not None and 5.0 < deadline < 5.1  # its heartbeat (t = 0) expires at 5 s
    s.poll(deadline)
    assert not s.rounds and s.tape[-1]["close_reason"] == "final"


# -- staleness -------------------------------------------------------------------------------


def test_scaled_staleness_discounts_a_stale_answer_by_one_over_one_plus_s():
    s = make(dataclasses.replace(BASE, grace=False, quorum=2, staleness="scaled"))
    close_round(s, 4.0, [contrib(0, 2.0), contrib(1, 2.0)])  # version 1 = 2.0
    beat(s, 7.0)
    # learner 0 answers from version 1 (s = 0, delta -2); learner 2 from version 0 (s = 1, delta -4 -> -2)
    close_round(s, 8.0, [contrib(0, 4.0, base=1), contrib(2, 4.0, base=0)])
    # equal weights: the merged outer gradient is (-2 + -4/2) / 2 = -2, so Theta = 2 + 2 = 4
    assert torch.allclose(s.fragments[0].values[0], torch.full((4,), 4.0))
    none = make(dataclasses.replace(BASE, grace=False, quorum=2))
    close_round(none, 4.0, [contrib(0, 2.0), contrib(1, 2.0)])
    beat(none, 7.0)
    close_round(none, 8.0, [contrib(0, 4.0, base=1), contrib(2, 4.0, base=0)])
    assert torch.allclose(none.fragments[0].values[0], torch.full((4,), 5.0))  # (-2 + -4) / 2 = -3


def test_delayed_staleness_merges_a_late_answer_at_once_as_its_share_of_the_fleet():
    s = make(dataclasses.replace(BASE, grace=False, staleness="delayed"), learners=(0, 1))
    s.poll(4.0)
    s.on_contribution(contrib(0, 2.0), 4.1)  # K = 1 closes on it: share 1/2 -> Theta = 0 + 1 * 0.5 * 2
    assert s.versions() == [1]
    assert torch.allclose(s.fragments[0].values[0], torch.full((4,), 1.0))
    out = s.on_contribution(contrib(1, 4.0), 4.2)  # late: its own version at once, share 1/2
    assert s.versions() == [2] and updates(out) == [1]
    assert torch.allclose(s.fragments[0].values[0], torch.full((4,), 3.0))  # 1 + 0.5 * 4
    assert s.tape[-1]["merged"][0]["staleness"] == 1
    assert not any(e["event"] == "late" for e in s.tape)
