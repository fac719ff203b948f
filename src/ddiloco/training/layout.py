"""The one place a model's fragment layout is derived, for the simulator, the syncer service,
the learner and the evaluator alike: equal configs and models give equal layouts.

What is synced is the model's parameters and its persistent buffers (BatchNorm's running
statistics and ``num_batches_tracked``): everything ``state_dict()`` holds. Non-persistent
buffers (a causal mask, rotary tables) stay local, as they are not part of a model's state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import FragmentLayout, make_layout, specs_of
from ddiloco.errors import UsageError
from ddiloco.workloads.base import Workload


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``model.state_dict()`` holds, by name (shared ones once)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module.named_buffers(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if buf is not None and name not in skip and all(b is not buf for b in out.values()):
                out[full] = buf
    return out


def synced_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the fleet keeps in step, by name: the parameters (tied ones once), then the
    persistent buffers. Fragments are slices of these."""
    named = dict(model.named_parameters())
    named.update(persistent_buffers(model))
    return named


def load_global(model: nn.Module, state: dict[str, torch.Tensor], owned: set[str] | None = None) -> None:
    """Write a global state (named synced tensors) into ``model`` strictly: a missing or unknown
    key is an error, never a silent default. Keys ``state_dict()`` lists twice (tied weights)
    are filled from the tensor they share. ``owned``: only these names are expected (a syncer
    shard's part of the model)."""
    want = synced_tensors(model)
    expected = set(want) if owned is None else set(want) & owned
    missing = sorted(expected - set(state))
    unknown = sorted(set(state) - set(want))
    if missing or unknown:
        what = f"missing {missing[:3]}" if missing else f"unknown {unknown[:3]}"
        raise UsageError(
            f"the global state does not fit this model ({what}{' ...' if len(missing or unknown) > 3 else ''}): "
            "build the model exactly as the run's learners do"
        )
    with torch.no_grad():
        for name, value in state.items():
            dst = want[name]
            if tuple(dst.shape) != tuple(value.shape):
                raise UsageError(
                    f"the global state's {name} has shape {tuple(value.shape)}, this model's {tuple(dst.shape)}: "
                    "build the model exactly as the run's learners do"
                )
            dst.copy_(value.round() if not dst.is_floating_point() and value.is_floating_point() else value)


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
    buffers = persistent_buffers(model)
    named = synced_tensors(model)
    fragments = make_layout(
        specs_of(named.items(), buffers), algo.fixed_fragments, algo.fragment_strategy, algo.sync_every
    )
    flags = tuple(pc.kind == "param" and is_embedding_like(pc.name) for frag in fragments.fragments for pc in frag)
    return ModelLayout(fragments, flags)


def param_spec(model: nn.Module) -> list[list[Any]]:
    """[name, shape] of every synced tensor (parameters, then persistent buffers), as a learner
    registers it and the syncer checks it."""
    return [[n, list(p.shape)] for n, p in synced_tensors(model).items()]
