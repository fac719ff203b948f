"""Workload configuration and the factory loader that turns it into a ``Workload``.

A workload is named by a factory spec ``"package.module:callable"``; the callable takes the
``WorkloadConfig`` and returns an object implementing ``ddiloco.workloads.base.Workload``.
That is how a user's own model and dataset plug in without editing this package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddiloco.errors import ConfigError
from ddiloco.workloads.base import Workload


@dataclass(frozen=True)
class WorkloadConfig:
    """What to train and on which data; shared by every learner of a run."""

    factory: str = "ddiloco.workloads.shakespeare:make_workload"
    """Factory spec ``"package.module:callable"``; the callable takes this config and returns
    a Workload. Built in: ``ddiloco.workloads.shakespeare:make_workload`` (byte-level GPT on
    the Shakespeare plays) and ``ddiloco.workloads.synthetic:make_workload`` (fast tests)."""

    batch_size: int = 8
    """Sequences (or examples) per training and evaluation batch, per learner step."""

    seq_len: int = 128
    """Context length in bytes for the GPT (windows of ``seq_len + 1`` bytes are sampled)."""

    d_model: int = 128
    """GPT width (embedding and residual stream size); must be divisible by ``n_head``."""

    n_layer: int = 4
    """Number of GPT transformer blocks."""

    n_head: int = 4
    """Attention heads per block."""

    block_bytes: int = 4096
    """Bytes per interleaved corpus block: the unit dealt round-robin to the held-out set and
    the learner shards. Small blocks spread every play over every shard and the held-out set;
    windows never cross a block, so it must exceed ``seq_len``."""

    eval_every: int = 20
    """Every ``eval_every``-th block goes to the held-out set (5% with 20)."""

    eval_batches: int = 32
    """Number of fixed held-out batches returned by ``Workload.eval_batches()``."""

    options: dict[str, Any] = field(default_factory=dict)
    """Free-form keyword options for the factory (each built-in factory documents its keys
    and rejects unknown ones)."""

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first field that is out of its allowed range."""
        _split_factory(self.factory)
        for name in ("batch_size", "seq_len", "d_model", "n_layer", "n_head", "eval_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"workload.{name} must be an integer >= 1, got {value!r}")
        if self.d_model % self.n_head != 0:
            raise ConfigError(
                f"workload.d_model ({self.d_model}) must be divisible by workload.n_head "
                f"({self.n_head}); pick a head count that divides the width"
            )
        if not isinstance(self.block_bytes, int) or self.block_bytes <= self.seq_len:
            raise ConfigError(
                f"workload.block_bytes must be an integer > workload.seq_len ({self.seq_len}), "
                f"got {self.block_bytes!r}"
            )
        if not isinstance(self.eval_every, int) or self.eval_every < 2:
            raise ConfigError(f"workload.eval_every must be an integer >= 2, got {self.eval_every!r}")
        if not isinstance(self.options, dict):
            kind = type(self.options).__name__
            raise ConfigError(f"workload.options must be a table/dict, got a {kind}")


def _split_factory(spec: str) -> tuple[str, str]:
    """Split ``"package.module:callable"`` into its module and attribute path."""
    module, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module.strip() or not attr.strip() or ":" in attr:
        raise ConfigError(f"workload.factory {spec!r} is malformed; write it as 'package.module:callable'")
    return module.strip(), attr.strip()


def resolve_factory(spec: str) -> Callable[[WorkloadConfig], Workload]:
    """Import and return the callable named by ``spec`` (``"package.module:callable"``)."""
    module_name, attr_path = _split_factory(spec)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:  # includes a missing dependency inside the user's module
        raise ConfigError(
            f"workload.factory {spec!r}: cannot import {module_name!r} ({exc}); "
            "check the spelling and that its package is installed"
        ) from None
    for part in attr_path.split("."):  # allows "module:Class.classmethod"
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(
                f"workload.factory {spec!r}: module {module_name!r} has no attribute "
                f"{attr_path!r}; check the name after the ':'"
            ) from None
    if not callable(obj):
        raise ConfigError(f"workload.factory {spec!r} names a {type(obj).__name__}, not a callable")
    return obj


def load_workload(cfg: WorkloadConfig) -> Workload:
    """Validate ``cfg``, import its factory and return the Workload it builds."""
    cfg.validate()
    workload = resolve_factory(cfg.factory)(cfg)
    if not isinstance(workload, Workload):
        missing = [
            m
            for m in ("name", "build_model", "loss", "train_stream", "eval_batches", "is_embedding_like")
            if not hasattr(workload, m)
        ]
        raise ConfigError(
            f"workload.factory {cfg.factory!r} returned a {type(workload).__name__}, which is not "
            f"a Workload (missing: {', '.join(missing)}); see ddiloco.workloads.base.Workload"
        )
    return workload
