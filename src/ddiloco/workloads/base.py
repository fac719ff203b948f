"""The contract between a training workload and the runtimes.

A workload owns a model family, its loss and its data. The runtimes only ever call the
methods below, so a user's own ``nn.Module`` and dataset plug in through a factory named in
the config (``workload.factory = "package.module:factory"``) without editing this package.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@dataclass(frozen=True)
class Batch:
    """One training or evaluation batch."""

    inputs: torch.Tensor
    """Model inputs (for the GPT: int64 byte ids, shape [batch, seq_len])."""
    targets: torch.Tensor
    """Targets aligned with ``inputs``."""
    tokens: int
    """Tokens (or examples) in this batch: the unit of the token-weighted merge."""


@runtime_checkable
class DataStream(Protocol):
    """A deterministic, seekable stream of training batches for one learner's shard."""

    position: int
    """Number of batches consumed so far; ``seek(position)`` resumes exactly there."""

    def next_batch(self) -> Batch:
        """Return the batch at ``position`` and advance by one."""
        ...

    def seek(self, position: int) -> None:
        """Resume at ``position`` (a value previously read from ``position``)."""
        ...


@runtime_checkable
class Workload(Protocol):
    """A model family, its loss, and its data split into learner shards plus a held-out set."""

    name: str
    """Short name used in reports."""

    def build_model(self, seed: int) -> nn.Module:
        """A freshly initialised model; the same seed gives the same parameters. Called under
        ``with torch.device("meta")`` it may give the structure alone, on the meta device (as
        any module built there is): a role that receives every value builds it so
        (``training/empty_model.py``; see ``structure_only``)."""
        ...

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean loss of ``model`` on ``batch`` (a scalar with grad; nats per byte for text)."""
        ...

    def train_stream(self, shard: int, num_shards: int, seed: int) -> DataStream:
        """Learner ``shard``'s stream, one of ``num_shards`` disjoint shards."""
        ...

    def eval_batches(self) -> list[Batch]:
        """The fixed held-out evaluation batches (disjoint from every training shard)."""
        ...

    def is_embedding_like(self, name: str) -> bool:
        """Whether parameter ``name`` is merged by weighted mean instead of RDA."""
        ...

    # Optional: ``routed_tokens(model) -> Mapping[str, torch.Tensor]``, the tokens the last
    # training ``loss()`` routed to each expert row (see ``routed_tokens`` below).


def structure_only() -> bool:
    """Whether a ``build_model`` is running under ``with torch.device("meta")``: its caller
    wants the model's structure alone (it will write every value itself). A builder that makes
    its modules on the meta device and then initialises them on CPU returns them as they are,
    uninitialised, when this is true."""
    return torch.get_default_device().type == "meta"


def routed_tokens(workload: object, model: nn.Module) -> Mapping[str, torch.Tensor] | None:
    """The tokens the last training ``loss()`` routed to each row of each expert-stacked
    parameter (a mixture of experts, the expert index on dim 0), keyed by parameter name: the
    workload's optional ``routed_tokens(model)``, or None for a workload without one (plain
    token weighting; ``algo.expert_weights``)."""
    method = getattr(workload, "routed_tokens", None)
    if not callable(method):
        return None
    counts = method(model)
    return counts if isinstance(counts, Mapping) else None


def loss_unit(workload: object) -> str:
    """The unit of ``workload``'s loss for tables and plots: its ``loss_unit`` attribute (say
    "nats/byte"), or "" when it does not say (the loss is then shown without a unit)."""
    unit = getattr(workload, "loss_unit", "")
    return unit if isinstance(unit, str) else ""


def embedding_parameters(model: nn.Module) -> Callable[[str], bool]:
    """The default for a model we know nothing else about: the parameters of its
    ``nn.Embedding`` modules (token and position tables) are embedding-like."""
    names = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if isinstance(module, nn.Embedding)
        for name, _ in module.named_parameters(recurse=False)
    }
    return names.__contains__
