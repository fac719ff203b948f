"""Workload configuration and the factory loader that turns it into a ``Workload``.

A workload is named by a factory spec ``"package.module:callable"``; the callable takes the
``WorkloadConfig`` and returns an object implementing ``ddiloco.workloads.base.Workload``.
That is how a user's own model and dataset plug in without editing this package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from ddiloco.errors import ConfigError
from ddiloco.workloads.base import Workload


@dataclass(frozen=True)
class WorkloadConfig:
    """What to train and on which data; shared by every learner of a run.

    ``validate()`` checks only what every workload needs (the factory spec, ``batch_size``,
    field types, ``options`` being a table); each workload checks the other fields it uses
    when it is built, so a custom workload is never refused over a field it ignores.
    """

    factory: str = "ddiloco.workloads.shakespeare:make_workload"
    """Factory spec ``"package.module:callable"``; the callable takes this config and returns
    a Workload. Built in: ``ddiloco.workloads.shakespeare:make_workload`` (byte-level GPT on
    the Shakespeare plays), ``ddiloco.workloads.text:make_workload`` (byte-level GPT on any
    text named in ``options``), ``ddiloco.workloads.vision:make_workload`` (a small CNN with
    BatchNorm on Fashion-MNIST, from the Debian package ``dataset-fashion-mnist``) and
    ``ddiloco.workloads.synthetic:make_workload`` (fast tests)."""

    batch_size: int = 8
    """Sequences (or examples) per training batch, per learner step. Used by every workload;
    it does not change the evaluation set (see ``eval_windows``)."""

    seq_len: int = 128
    """Context length in bytes for the GPT (windows of ``seq_len + 1`` bytes are sampled).
    Used by the text and Shakespeare workloads."""

    d_model: int = 128
    """GPT width (embedding and residual stream size); must be divisible by ``n_head``.
    Used by the text and Shakespeare workloads."""

    n_layer: int = 4
    """Number of GPT transformer blocks. Used by the text and Shakespeare workloads."""

    n_head: int = 4
    """Attention heads per block. Used by the text and Shakespeare workloads."""

    block_bytes: int = 4096
    """Bytes per interleaved corpus block: the unit dealt round-robin to the held-out set and
    the learner shards. Small blocks spread every document over every shard and the held-out
    set; windows never cross a block, so it must exceed ``seq_len``. A corpus too small for
    ``eval_every`` x 4 blocks gets smaller blocks automatically (down to 2 x (seq_len + 1)).
    Used by the text and Shakespeare workloads."""

    eval_every: int = 20
    """Every ``eval_every``-th block goes to the held-out set (5% with 20). Used by the text
    and Shakespeare workloads."""

    eval_windows: int = 256
    """Size of the fixed evaluation set returned by ``Workload.eval_batches()``: held-out
    windows for the text and Shakespeare workloads, examples for the synthetic one, test images
    for the vision one. Evaluated in chunks of 32 whatever ``batch_size`` is, so the eval set
    does not change with it."""

    options: dict[str, Any] = field(default_factory=dict)
    """Free-form keyword options for the factory (each built-in factory documents its keys
    and rejects unknown ones)."""

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first field every workload relies on that is wrong."""
        _split_factory(self.factory)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (not isinstance(value, int) or isinstance(value, bool)):
                raise ConfigError(f"workload.{f.name} must be an integer, got {value!r}")
        require_ints(self, ("batch_size",))
        if not isinstance(self.options, dict):
            kind = type(self.options).__name__
            raise ConfigError(f"workload.options must be a table/dict, got a {kind}")


def require_ints(cfg: WorkloadConfig, names: tuple[str, ...], minimum: int = 1) -> None:
    """Raise ``ConfigError`` for the first of ``names`` that is not an integer >= ``minimum``
    (for workloads checking the fields they use)."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"workload.{name} must be an integer >= {minimum}, got {value!r}")


def check_known_options(options: dict[str, object], known: list[str], workload: str) -> None:
    """Raise ``ConfigError`` when ``options`` has a key outside ``known`` (a built-in workload's
    options), naming the unknown keys and the allowed ones."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(f"workload.options {unknown} unknown to the {workload} workload; allowed: {sorted(known)}")


def check_shard(shard: int, num_shards: int, seed: int) -> None:
    """Raise ``ConfigError`` for a shard index outside ``0 .. num_shards - 1`` or a negative data seed."""
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ConfigError(f"shard {shard} is out of range for {num_shards} shards; use 0 <= shard < num_shards")
    if seed < 0:
        raise ConfigError(f"data seed must be >= 0, got {seed}")


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
