"""The one place a model's fragment layout is derived, for the simulator, the syncer service,
the learner and the evaluator alike: equal configs and models give equal layouts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import FragmentLayout, make_layout, specs_of
from ddiloco.workloads.base import Workload


@dataclass(frozen=True)
class ModelLayout:
    """A model's P fragments and how each piece is merged."""

    fragments: FragmentLayout
    """The fragments and their pieces."""
    embedding_like: tuple[bool, ...]
    """Per piece, in fragment order: merged by weighted mean (embedding-like) instead of RDA."""

    @property
    def num_fragments(self) -> int:
        return self.fragments.num_fragments

    @property
    def digest(self) -> str:
        """The layout signature's hash: a learner and its syncer must agree on it."""
        return self.fragments.digest()


def layout_for(model: nn.Module, workload: Workload, algo: DiLoCoConfig) -> ModelLayout:
    """The layout ``algo`` asks for on ``model``; the workload says which tensors are embedding-like."""
    return layout_of(model, algo, workload.is_embedding_like)


def layout_of(model: nn.Module, algo: DiLoCoConfig, is_embedding_like: Callable[[str], bool]) -> ModelLayout:
    """The layout ``algo`` asks for on any model; ``is_embedding_like(name)`` picks the tensors
    merged by weighted mean (the learner does not need it; the syncer does)."""
    fragments = make_layout(
        specs_of(model.named_parameters()), algo.fixed_fragments, algo.fragment_strategy, algo.sync_every
    )
    flags = tuple(is_embedding_like(pc.name) for frag in fragments.fragments for pc in frag)
    return ModelLayout(fragments, flags)


def param_spec(model: nn.Module) -> list[list[Any]]:
    """[name, shape] of every parameter, as a learner registers it and the syncer checks it."""
    return [[n, list(p.shape)] for n, p in model.named_parameters()]
