"""Compressed payloads both ways: deltas, error feedback and the down-link chain.

A pure syncer core and a learner's codec and counters, driven by hand: messages can be lost,
reordered or delivered as they are, and the test checks the one property everything rests on:
what a learner holds of a fragment is, bit for bit, what the syncer believes it serves.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_syncer import BASE

from ddiloco.core.codec import LearnerCodec
from ddiloco.core.compress import decode
from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.learner import LearnerCore
from ddiloco.core.messages import Ack, Contribution, FragmentUpdate, Join
from ddiloco.core.syncer import Syncer
from ddiloco.protocol.inbox import Inbox
from ddiloco.service.base import wire

torch.set_num_threads(1)

# The scripted syncer's toy settings (no influence bounds, no robust merge), compressed both ways.
CFG = dataclasses.replace(
    BASE,
    overlap=1,
    grace=False,
    late_fragment="wait",  # a push opens its round at once: rounds without a step clock
    outer_lr=0.7,
    outer_momentum=0.9,
    up_encoding="int4",
    down_encoding="int4",
    error_feedback=True,
)
SPECS = [TensorSpec("w", (300,)), TensorSpec("running_mean", (7,), "buffer"), TensorSpec("n", (1,), "count")]
LAYOUT = balanced_layout(SPECS, 1)
PIECES = LAYOUT.fragments[0]


def _initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(300, generator=g), "running_mean": torch.zeros(7), "n": torch.zeros(1)}


class Learner:
    """A learner's codec and counters, and its model's values of the one fragment."""

    def __init__(self, cfg: DiLoCoConfig, m: int = 0, incarnation: int = 0) -> None:
        self.m, self.incarnation = m, incarnation
        self.core = LearnerCore(cfg, m, 1, incarnation)
        self.codec = LearnerCodec(cfg, LAYOUT.fragments)
        self.values: list[torch.Tensor] = []
        self.gen = torch.Generator().manual_seed(100 + m)

    def receive(self, u: FragmentUpdate) -> Ack | None:
        """Apply ``u`` as the learner session does; the ack it sends, if it applied it."""
        full = self.codec.expand(u)
        if isinstance(full, str):
            return None
        if self.core.on_update(full, PIECES).mode == "ignore":
            return None
        self.codec.received(full)
        self.values = [v.clone() for v in full.values]
        return Ack(self.m, self.incarnation, 0, full.version)

    def train(self, steps: int = 4) -> None:
        for _ in range(steps):
            self.core.on_step(10)
            self.values[0] -= 0.01 * torch.randn(300, generator=self.gen)
        self.values[1] += 0.1
        self.values[2] += steps

    def contribute(self) -> Contribution:
        c = self.core.contribution(0, [v.clone() for v in self.values], 0)
        c, residual = self.codec.encode(c)
        self.codec.sent(0, residual)
        self.core.sent(c)
        return c


def _syncer(cfg: DiLoCoConfig = CFG) -> Syncer:
    return Syncer(cfg, LAYOUT, _initial(), [False, False, False])


def _join(s: Syncer, ln: Learner, t: float) -> None:
    for u in s.handle(Join(ln.m, 0, []), t).messages:
        assert isinstance(u, FragmentUpdate) and u.kind == "values"
        ack = ln.receive(u)
        assert ack is not None
        s.handle(ack, t)


def _round(s: Syncer, ln: Learner, t: float) -> list[FragmentUpdate]:
    """One round with this learner alone: it trains, answers, the syncer merges."""
    ln.train()
    out = s.handle(ln.contribute(), t)
    out.extend(s.flush(t + 0.1))
    return [u for u in out.messages if isinstance(u, FragmentUpdate)]


def _held_equals_served(s: Syncer, ln: Learner) -> None:
    chain = s.fragments[0].chain
    assert chain is not None and ln.codec.base[0][0] == chain.version
    for a, b in zip(ln.codec.base[0][1], chain.served):
        assert torch.equal(a, b)


def test_a_contribution_is_an_encoded_delta_with_exact_statistics() -> None:
    s, ln = _syncer(), Learner(CFG)
    _join(s, ln, 0.0)
    ln.train()
    c = ln.contribute()
    assert c.kind == "delta" and [e.encoding for e in c.encoded] == ["int4", "fp32", "fp32"]
    assert torch.equal(c.values[1], ln.values[1]) and torch.equal(c.values[2], ln.values[2])  # levels, exact
    base = ln.codec.base[0][1]
    err = (c.values[0] - (base[0] - ln.values[0])).abs().max()
    assert 0 < err <= (base[0] - ln.values[0]).abs().max() / 7  # quantised, within int4's bound


def test_the_residual_is_carried_across_a_send_and_an_overwrite() -> None:
    s, ln = _syncer(), Learner(CFG)
    _join(s, ln, 0.0)
    ln.train()
    first = ln.contribute()
    residual = ln.codec.residual[0][0].clone()
    base = ln.codec.base[0][1][0]
    assert torch.allclose(residual, (base - ln.values[0]) - first.values[0], atol=1e-6)
    assert residual.abs().max() > 0
    # The merge overwrites the fragment; the residual is the learner's and stays.
    for u in s.handle(first, 1.0).extend(s.flush(1.1)).messages:
        assert isinstance(u, FragmentUpdate)
        ln.receive(u)
    assert torch.equal(ln.codec.residual[0][0], residual)
    # The next contribution carries it: its payload is (base - theta) + residual, encoded.
    ln.train()
    snapshot = ln.codec.base[0][1][0] - ln.values[0]
    c = ln.core.contribution(0, [v.clone() for v in ln.values], 0)
    sent, kept = ln.codec.encode(c)
    assert kept is not None
    assert torch.allclose(sent.values[0] + kept[0], snapshot + residual, atol=1e-6)
    # A snapshot that is encoded but never sent leaves the residual alone.
    assert torch.equal(ln.codec.residual[0][0], residual)


def test_without_error_feedback_no_residual_is_kept() -> None:
    cfg = dataclasses.replace(CFG, error_feedback=False)
    s, ln = _syncer(cfg), Learner(cfg)
    _join(s, ln, 0.0)
    ln.train()
    ln.contribute()
    assert ln.codec.residual == {}


@pytest.mark.parametrize(
    "encoding,density", [("bf16", 1.0), ("int8", 1.0), ("int4", 1.0), ("int2", 1.0), ("int2", 0.03), ("fp32", 0.01)]
)
def test_a_compressed_contribution_merges_as_its_decoded_delta(encoding: str, density: float) -> None:
    """Through the wire (the receiver decodes it), the merge equals that of the decoded delta sent
    in full precision."""
    cfg = dataclasses.replace(CFG, up_encoding=encoding, up_density=density, down_encoding="fp32")
    a, b, ln = _syncer(cfg), _syncer(cfg), Learner(cfg)
    _join(a, ln, 0.0)
    _join(b, Learner(cfg), 0.0)
    ln.train()
    c = ln.contribute()
    frames = [bytes(memoryview(f)) for f in wire.encode(c)]
    assert sum(len(f) for f in frames[1:]) == sum(e.nbytes for e in c.encoded)
    received = wire.decode(frames)
    plain = dataclasses.replace(c, values=[decode(e) for e in c.encoded], encoded=[])
    a.handle(received, 1.0)
    b.handle(plain, 1.0)
    a.flush(1.1)
    b.flush(1.1)
    assert a.fragments[0].version == b.fragments[0].version == 1
    for x, y in zip(a.fragments[0].values, b.fragments[0].values):
        assert torch.equal(x, y)


def test_sparse_payloads_both_ways_keep_the_copies_together_and_carry_what_they_drop() -> None:
    """Top-k both ways: the learner's residual holds what its sparse contribution dropped, and
    the chain's next change carries what the last one did not send, so a learner on the chain
    holds the served copy bit for bit and that copy follows the global values."""
    cfg = dataclasses.replace(CFG, up_encoding="int2", up_density=0.03, down_encoding="int4", down_density=0.1)
    assert cfg.up_payload == "int2+top123" and cfg.down_payload == "int4+top410" and cfg.compressed
    s, ln = _syncer(cfg), Learner(cfg)
    _join(s, ln, 0.0)
    start = s.fragments[0].values[0].clone()
    ln.train()
    c = ln.contribute()
    assert [e.encoding for e in c.encoded] == ["int2+top123", "fp32", "fp32"]
    assert int((c.values[0] != 0).sum()) <= 9  # of 300 values: 3 % of them
    assert float(ln.codec.residual[0][0].norm()) > 0
    for k in range(1, 8):
        (u,) = _round(s, ln, float(k))
        assert u.kind == "delta" and u.encoded[0].encoding == "int4+top410"
        s.handle(ln.receive(u), k + 0.2)  # type: ignore[arg-type]
        _held_equals_served(s, ln)
    chain, frag = s.fragments[0].chain, s.fragments[0]
    assert chain is not None
    gap = (chain.served[0] - frag.values[0]).norm()
    assert gap < (frag.values[0] - start).norm()  # what the chain did not send yet, not what it lost


def test_versions_travel_as_a_chain_of_encoded_changes() -> None:
    s, ln = _syncer(), Learner(CFG)
    _join(s, ln, 0.0)
    start = s.fragments[0].values[0].clone()  # (the syncer keeps no past parameters)
    for k in range(1, 6):
        (u,) = _round(s, ln, float(k))
        assert u.kind == "delta" and u.base_version == k - 1 and u.version == k
        assert u.encoded[0].encoding == "int4" and u.encoded[1].encoding == "fp32"
        s.handle(ln.receive(u), k + 0.2)  # type: ignore[arg-type]
        _held_equals_served(s, ln)
    # The chain carries the encoding's error forward instead of piling it up: the served copy
    # stays within one step's quantisation of the global values.
    chain, frag = s.fragments[0].chain, s.fragments[0]
    assert chain is not None
    assert torch.equal(chain.served[1], frag.values[1]) and torch.equal(chain.served[2], frag.values[2])
    gap = (chain.served[0] - frag.values[0]).abs().max()
    assert gap <= 0.2 * (frag.values[0] - start).abs().max()


def test_a_lost_delta_is_followed_by_the_full_version() -> None:
    s, ln = _syncer(), Learner(CFG)
    _join(s, ln, 0.0)
    (u,) = _round(s, ln, 1.0)
    s.handle(ln.receive(u), 1.2)  # type: ignore[arg-type]
    (lost,) = _round(s, ln, 2.0)
    assert lost.kind == "delta"  # never delivered: the learner stays at version 1, without an ack
    (u,) = _round(s, ln, 3.0)
    assert u.kind == "values" and u.version == 3  # the syncer never heard it hold 2: in full
    s.handle(ln.receive(u), 3.2)  # type: ignore[arg-type]
    _held_equals_served(s, ln)
    (u,) = _round(s, ln, 4.0)
    assert u.kind == "delta"  # back on the chain
    s.handle(ln.receive(u), 4.2)  # type: ignore[arg-type]
    _held_equals_served(s, ln)


def test_reordered_deltas_never_leave_the_copies_apart() -> None:
    """Two learners; learner 1 gets a later delta before an earlier one (or one twice). What
    does not chain is ignored, and nothing it holds ever differs from what the syncer serves."""
    s, a, b = _syncer(), Learner(CFG, 0), Learner(CFG, 1)
    _join(s, a, 0.0)
    _join(s, b, 0.0)
    (u1,) = _round(s, b, 1.0)  # version 1, a delta from 0 for learner 1
    (u2,) = _round(s, a, 2.0)  # version 2, for learner 0: a full version (it never held 1)
    assert u1.kind == "delta" and u2.kind == "values"
    s.handle(a.receive(u2), 2.1)  # type: ignore[arg-type]
    # Learner 0 holds 2; a stale delta 0 -> 1 handed to it (reordered, or duplicated) is ignored.
    assert isinstance(a.codec.expand(dataclasses.replace(u1, learner=0)), str)
    assert a.receive(dataclasses.replace(u1, learner=0)) is None
    _held_equals_served(s, a)
    # Learner 1 gets version 1's delta twice: the second is older than what it holds.
    assert b.receive(u1) is not None and b.receive(u1) is None
    # Learner 1 holds 1 while the chain is at 2; its next answer is anchored at 1 and the
    # merge comes back to it in full, after which it is on the chain again.
    (u3,) = _round(s, b, 3.0)
    assert u3.kind == "values" and u3.version == 3
    s.handle(b.receive(u3), 3.1)  # type: ignore[arg-type]
    _held_equals_served(s, b)


def test_a_restarted_syncer_serves_in_full_before_chaining_again() -> None:
    s, ln = _syncer(), Learner(CFG)
    _join(s, ln, 0.0)
    (u,) = _round(s, ln, 1.0)
    s.handle(ln.receive(u), 1.1)  # type: ignore[arg-type]
    fresh = _syncer()
    fresh.restore({0: s.fragment_record(0)}, None)
    # The learner re-registers holding the current version: nothing is sent, it keeps training.
    assert fresh.handle(Join(0, 0, [1]), 2.0).messages == []
    (u,) = _round(fresh, ln, 3.0)
    assert u.kind == "values"  # the restarted syncer does not know the learner's copy: in full
    fresh.handle(ln.receive(u), 3.1)  # type: ignore[arg-type]
    _held_equals_served(fresh, ln)
    (u,) = _round(fresh, ln, 4.0)
    assert u.kind == "delta"


def _restarted(ln: Learner, m: int = 0) -> Learner:
    """A new process of learner ``ln`` that restored its saved state (``LocalState``): the model's
    values, the codec's base copies and residuals, the counters."""
    back = Learner(CFG, m, incarnation=1)
    back.values = [v.clone() for v in ln.values]
    back.codec.base = dict(ln.codec.base)
    back.codec.residual = dict(ln.codec.residual)
    back.core.base_version = list(ln.core.base_version)
    return back


def test_a_learner_restarted_from_its_saved_state_catches_up_by_the_chains_changes() -> None:
    """It holds version 2 as served; the fleet went on to 5. The join sends the three encoded
    changes 2 -> 3 -> 4 -> 5 (each a tenth of the fragment), which rebuild exactly what the
    chain serves, and the learner is on the chain again for the next merge."""
    s, ln, other = _syncer(), Learner(CFG, 0), Learner(CFG, 1)
    _join(s, ln, 0.0)
    _join(s, other, 0.0)
    for k in (1, 2):
        (u, *_) = _round(s, ln, float(k))
        s.handle(ln.receive(u), k + 0.1)  # type: ignore[arg-type]
    saved = _restarted(ln)  # what its local state held when it died at version 2
    for k in (3, 4, 5):  # the fleet trains on without it
        for u in _round(s, other, float(k)):
            if u.learner == 1:
                s.handle(other.receive(u), k + 0.1)  # type: ignore[arg-type]
    updates = s.handle(Join(0, 1, [2]), 6.0).messages
    assert [(u.kind, u.base_version, u.version) for u in updates] == [("delta", 2, 3), ("delta", 3, 4), ("delta", 4, 5)]
    sent = sum(e.nbytes for u in updates for e in u.encoded)
    assert sent < 0.5 * 4 * 300  # three int4 changes of w (plus the exact buffers): not the fragment in fp32
    for u in updates:
        s.handle(saved.receive(u), 6.1)  # type: ignore[arg-type]
    _held_equals_served(s, saved)
    (u,) = [u for u in _round(s, saved, 7.0) if u.learner == 0]
    assert u.kind == "delta"  # on the chain


def test_catch_up_changes_fold_as_they_arrive_into_one_full_version_with_the_same_bits() -> None:
    """The learner session's inbox expands each chained change onto the one before while it
    waits for the boundary: one full version of the fragment is held, not three decoded
    changes and three full versions, and applying it leaves the learner on the chain. What
    does not chain, or is not in the layout, waits as it came (the boundary says why)."""
    s, ln, other = _syncer(), Learner(CFG, 0), Learner(CFG, 1)
    _join(s, ln, 0.0)
    _join(s, other, 0.0)
    (u, *_) = _round(s, ln, 1.0)
    s.handle(ln.receive(u), 1.1)  # type: ignore[arg-type]
    saved = _restarted(ln)
    for k in (2, 3, 4):
        for u in _round(s, other, float(k)):
            if u.learner == 1:
                s.handle(other.receive(u), k + 0.1)  # type: ignore[arg-type]
    updates = s.handle(Join(0, 1, [1]), 5.0).messages
    assert [(u.kind, u.version) for u in updates] == [("delta", 2), ("delta", 3), ("delta", 4)]
    base_before = [t.clone() for t in saved.codec.base[0][1]]
    inbox = Inbox(saved.codec)
    for u in updates:
        inbox.keep(u)  # type: ignore[arg-type]
    (folded,) = list(inbox)
    assert folded.kind == "values" and folded.version == 4 and not folded.encoded
    assert all(torch.equal(a, b) for a, b in zip(saved.codec.base[0][1], base_before))  # the base is untouched
    s.handle(saved.receive(folded), 5.1)  # type: ignore[arg-type]
    _held_equals_served(s, saved)
    (u,) = [u for u in _round(s, saved, 6.0) if u.learner == 0]
    assert u.kind == "delta"  # on the chain
    # Off the chain, outside the layout, or behind another update of the fragment: as it came.
    inbox.clear()
    late = dataclasses.replace(updates[-1], base_version=9, version=10)
    stray = dataclasses.replace(updates[0], fragment=7)
    merged = dataclasses.replace(updates[0], reason="merged")
    for u in (late, stray, merged, updates[1]):
        inbox.keep(u)  # type: ignore[arg-type]
    assert list(inbox) == [late, stray, merged, updates[1]]


def test_a_catch_up_beyond_the_kept_history_or_not_cheaper_is_the_full_version() -> None:
    s, ln = _syncer(), Learner(CFG)
    _join(s, ln, 0.0)
    for k in range(1, 6):
        (u,) = _round(s, ln, float(k))
        s.handle(ln.receive(u), k + 0.1)  # type: ignore[arg-type]
    chain = s.fragments[0].chain
    assert chain is not None and sorted(chain.history) == [3, 4, 5]  # algo.chain_history = 3
    assert chain.catch_up(1) is None and chain.catch_up(5) is None and chain.catch_up(9) is None
    # Four versions behind: the history does not reach; in full.
    (u,) = s.handle(Join(0, 1, [1]), 6.0).messages
    assert u.kind == "values" and u.version == 5
    # fp32 down: the changes cost as much as the fragment; no chain, in full.
    fp32 = dataclasses.replace(CFG, down_encoding="fp32", up_encoding="int4")
    s2, ln2 = _syncer(fp32), Learner(fp32)
    _join(s2, ln2, 0.0)
    (u,) = _round(s2, ln2, 1.0)
    (u,) = s2.handle(Join(0, 1, [0]), 2.0).messages
    assert u.kind == "values"
    # None kept: in full; and the syncer's accounting shows what the history holds.
    none = dataclasses.replace(CFG, chain_history=0)
    s3, ln3 = _syncer(none), Learner(none)
    _join(s3, ln3, 0.0)
    for k in (1, 2):
        (u,) = _round(s3, ln3, float(k))
        s3.handle(ln3.receive(u), k + 0.1)  # type: ignore[arg-type]
    (u,) = s3.handle(Join(0, 1, [1]), 3.0).messages
    assert u.kind == "values"
    assert s3.held_bytes()["chain_history"] == 0 < s.held_bytes()["chain_history"]
