"""The memory budget of docs/runtime.md, checked on a small model.

Every tensor the syncer's core and a learner's codec hold is found by walking their objects,
and must be what ``held_bytes`` accounts for; the accounts must match the budget the docs state
per fragment: the syncer holds the current values, the outer momentum, a served copy only with
a lossy down-link, buffers of past versions, and per open round its answers and one merge
buffer; a learner holds one base copy, and a residual only with error feedback.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import pytest
import torch
from test_syncer import BASE

from ddiloco.core.codec import LearnerCodec
from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.learner import LearnerCore
from ddiloco.core.messages import Ack, FragmentUpdate, Join
from ddiloco.core.syncer import Output, Syncer

torch.set_num_threads(1)

CFG = dataclasses.replace(
    BASE, overlap=1, grace=False, late_fragment="wait", outer_lr=0.7, outer_momentum=0.9, quorum=4, num_fragments=4
)
SPECS = [TensorSpec(f"w{i}", (64 * (i + 1),)) for i in range(4)] + [TensorSpec("bn.running_mean", (8,), "buffer")]
LAYOUT = balanced_layout(SPECS, 4)
P = LAYOUT.num_fragments
M = 4
PARAM_BYTES = 4 * sum(64 * (i + 1) for i in range(4))
MODEL_BYTES = PARAM_BYTES + 4 * 8
BUFFER_BYTES = 4 * 8


def storages(obj: Any) -> dict[int, int]:
    """Every tensor storage reachable from ``obj`` (data pointer -> bytes)."""
    found: dict[int, int] = {}
    seen: set[int] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (str, bytes, int, float, bool, type(None), type)) or callable(o):
            if isinstance(o, torch.Tensor):  # (tensors are not callable; kept for clarity)
                pass
            else:
                continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.nbytes():
                found[st.data_ptr()] = st.nbytes()
        elif isinstance(o, dict):
            stack += list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset, deque)):
            stack += list(o)
        elif dataclasses.is_dataclass(o) or hasattr(o, "__dict__"):
            stack += list(vars(o).values())
    return found


class Learner:
    """A learner's counters and codec, and its values of every fragment (trained by noise)."""

    def __init__(self, cfg: DiLoCoConfig, m: int) -> None:
        self.m = m
        self.core = LearnerCore(cfg, m, P)
        self.codec = LearnerCodec(cfg, LAYOUT.fragments)
        self.values: dict[int, list[torch.Tensor]] = {}
        self.gen = torch.Generator().manual_seed(m)

    def receive(self, u: FragmentUpdate) -> Ack | None:
        full = self.codec.expand(u)
        if isinstance(full, str) or self.core.on_update(full, LAYOUT.fragments[u.fragment]).mode == "ignore":
            return None
        self.codec.received(full)
        self.values[u.fragment] = [v.clone() for v in full.values]
        return Ack(self.m, 0, u.fragment, full.version)

    def answer(self, p: int):  # noqa: ANN201
        self.core.on_step(10)
        for v, pc in zip(self.values[p], LAYOUT.fragments[p]):
            v += 0.01 * torch.randn(v.shape, generator=self.gen) if pc.kind == "param" else 0.1
        c = self.core.contribution(p, [v.clone() for v in self.values[p]], 0)
        c, residual = self.codec.encode(c)
        self.codec.sent(p, residual)
        self.core.sent(c)
        return c


def run(cfg: DiLoCoConfig, rounds: int, leave_open: int = 0) -> tuple[Syncer, list[Learner]]:
    """M learners join, then ``rounds`` rounds of every fragment; ``leave_open`` more rounds get
    all answers but one (they stay open)."""
    s = Syncer(
        cfg, LAYOUT, {sp.name: torch.randn(sp.shape) for sp in SPECS}, [False] * sum(len(f) for f in LAYOUT.fragments)
    )
    learners = [Learner(cfg, m) for m in range(M)]
    t = 0.0

    def deliver(msgs: list[Any]) -> None:
        for u in msgs:
            if isinstance(u, FragmentUpdate):
                ack = learners[u.learner].receive(u)
                if ack is not None:
                    s.handle(ack, t)

    for ln in learners:
        deliver(s.handle(Join(ln.m, 0, []), t).messages)
    for _ in range(rounds):
        for p in range(P):
            t += 1.0
            for ln in learners:
                deliver(s.handle(ln.answer(p), t).messages)
    for p in range(leave_open):
        t += 1.0
        for ln in learners[:-1]:
            deliver(s.handle(ln.answer(p), t).messages)
    return s, learners


def rounds_made(s: Syncer) -> int:
    """The versions every owned fragment has moved through (the fewest)."""
    return min(s.fragments[p].version for p in s.owned)


@pytest.mark.parametrize("down", ["fp32", "int4"])
def test_the_syncer_holds_values_momentum_and_open_rounds_only(down: str) -> None:
    cfg = dataclasses.replace(CFG, down_encoding=down, up_encoding=down)
    s, _ = run(cfg, rounds=3, leave_open=2)
    held = s.held_bytes()
    assert held["values"] == MODEL_BYTES
    assert held["momentum"] == MODEL_BYTES  # (buffers carry a zero momentum: fed zeros, not progress)
    assert held["chain"] == (MODEL_BYTES if down == "int4" else 0)
    # the chain's last encoded changes (algo.chain_history of them): int4 is an eighth of fp32,
    # plus a scale per 128 values; buffers travel exactly, in each change
    kept = min(rounds_made(s), s.cfg.chain_history)
    if down == "int4":
        assert 0 < held["chain_history"] <= kept * (PARAM_BYTES / 8 * 1.1 + BUFFER_BYTES) * 1.0
    else:
        assert held["chain_history"] == 0
    # past versions keep their buffers only (at most keep_versions of them), never parameters
    assert 0 < held["past"] <= s.cfg.keep_versions * BUFFER_BYTES and held["past"] % BUFFER_BYTES == 0
    frag = [4 * sum(pc.numel for pc in LAYOUT.fragments[p]) for p in range(P)]
    assert s.open_rounds == 2
    answers = (M - 1) * (frag[0] + frag[1])  # the open rounds' answers, no more
    if down == "fp32":
        assert held["pending"] == answers
    else:  # (a decoded piece keeps its last block's padding: at most 127 values a piece)
        assert answers <= held["pending"] <= answers + (M - 1) * 2 * 2 * 127 * 4
    largest = max(frag)
    assert held["scratch"] <= 2 * largest  # one merge buffer per round open at once, from a pool
    # ... and nothing else: every tensor the core holds is accounted for.
    assert sum(storages(s).values()) == sum(held.values())


@pytest.mark.parametrize(("encoding", "feedback"), [("fp32", False), ("int4", False), ("int4", True)])
def test_a_learner_holds_one_base_copy_and_a_residual_with_error_feedback(encoding: str, feedback: bool) -> None:
    cfg = dataclasses.replace(CFG, up_encoding=encoding, down_encoding=encoding, error_feedback=feedback)
    _, learners = run(cfg, rounds=2)
    for ln in learners:
        held = ln.codec.held_bytes()
        assert held["base"] == MODEL_BYTES
        assert held["residual"] == (PARAM_BYTES if feedback else 0)
        assert sum(storages(ln.codec).values()) == sum(held.values())


def test_the_final_sync_holds_a_window_of_rounds_not_the_whole_model() -> None:
    """Every learner answers every final round at once: all P open together would hold
    (learners + 1) copies of the model. A window of them is open at a time, and all close."""
    s, learners = run(CFG, rounds=1)
    t = float(P) + 0.5  # (just after the last round: every learner is live)
    for u in s.flush(t, final=True).messages:
        if isinstance(u, FragmentUpdate):
            learners[u.learner].receive(u)  # the final sync asks learners that applied the flush's versions
    out = s.final_sync(t)
    seen_open = 0
    for _ in range(4 * P):
        seen_open = max(seen_open, s.open_rounds)
        assert s.open_rounds <= s.final_window < P
        asked = [m for m in out.messages if not isinstance(m, FragmentUpdate)]
        if not asked:
            break
        out = Output()
        t += 0.1
        for req in asked:
            ln = learners[req.learner]
            for u in s.handle(ln.answer(req.fragment), t).messages:
                if isinstance(u, FragmentUpdate):
                    learners[u.learner].receive(u)
                else:
                    out.messages.append(u)
        out.extend(s.poll(t))
    assert s.final_left == 0 and s.open_rounds == 0 and seen_open == s.final_window


def test_a_served_optimizer_state_is_copied_a_budget_per_boundary_not_whole() -> None:
    from ddiloco.protocol.handoff import Reassembly, is_piece
    from ddiloco.training.peer_state import StateServer

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 32)).sum().backward()
    opt.step()
    states = opt.state_dict()["state"].values()
    budget = 2 * max(sum(v.numel() * v.element_size() for v in st.values()) for st in states)
    server = StateServer(opt, to=1, source=0)
    pieces = []
    while (piece := server.piece(budget)) is not None:
        pieces.append(piece)
        assert sum(t.numel() * t.element_size() for t in piece.tensors.values()) <= budget
    assert len(pieces) > 1 and server.done
    assert all(is_piece(p) for p in pieces[:-1]) and not is_piece(pieces[-1])
    assert any("@" in k for p in pieces for k in p.tensors)  # a parameter that did not fit went by rows
    whole = Reassembly(1 << 20)
    assert all(whole.add(p.tensors) is None for p in pieces)
    got, problem = whole.finish()
    want = {f"{i}.{k}": v for i, st in opt.state_dict()["state"].items() for k, v in st.items()}
    assert problem is None and set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert all(got[k].data_ptr() != want[k].data_ptr() for k in want)  # copies, taken piece by piece


def test_the_robust_merges_drift_history_is_a_sketch_per_learner_and_fragment() -> None:
    """The drift history does not grow with the model: SKETCH_DIM floats per learner and
    fragment, and each fragment's bucket signs (SKETCH_DIM per piece)."""
    from ddiloco.core.robust import SKETCH_DIM

    s, _ = run(dataclasses.replace(CFG, robust=True, robust_drift_limit=3.0), rounds=6, leave_open=0)
    held = s.held_bytes()
    pieces = sum(len(s._sketches[p].held()) for p in s._sketches)
    assert held["drift"] == (M * P + pieces) * SKETCH_DIM * 4
    assert sum(storages(s).values()) == sum(held.values())
