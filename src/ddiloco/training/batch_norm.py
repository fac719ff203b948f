"""BatchNorm statistics re-estimated for a model's current weights.

The global model's BatchNorm statistics are the token-weighted mean of the learners' own
running statistics, each measured on that learner's weights before the merge; the outer step
then moves the global weights past every learner's, so the merged statistics lag the weights
they are used with (docs/algorithm.md, "Buffers"). Running a few hundred training examples
through the final weights measures them afresh: ``recalibrate_batch_norm``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddiloco.errors import UsageError

log = logging.getLogger(__name__)
_NONE = object()


def batch_norms(model: nn.Module) -> list[_BatchNorm]:
    """The model's BatchNorm layers that keep running statistics (any dimension, SyncBatchNorm too)."""
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


def default_forward(model: nn.Module, batch: Any) -> None:
    """``model(x)`` for a tensor, the first element of a tuple or list (``(images, labels)``),
    or a mapping passed whole (``model(batch)``), each moved to the model's device."""
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    if isinstance(batch, torch.Tensor):
        model(batch.to(device))
    elif isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        model(batch[0].to(device))
    elif isinstance(batch, Mapping):
        model({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
    else:
        raise UsageError(
            f"recalibrate_batch_norm cannot feed a batch of type {type(batch).__name__} to the model: "
            "pass forward=lambda model, batch: model(...) to say how"
        )


def recalibrate_batch_norm(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    max_batches: int = 100,
    forward: Callable[[nn.Module, Any], Any] | None = None,
) -> int:
    """Re-estimate every BatchNorm's running mean and variance for the model's current weights:
    reset them, then run up to ``max_batches`` of ``batches`` (training data, as the model sees
    it in training) through the model without gradients, averaging over all of them
    (``momentum=None``), with every other module in eval mode (no dropout). The modules'
    momentum and modes are restored afterwards. Returns the number of batches used (0 for a
    model without BatchNorm: nothing to do).

    Call it on the final model before you export or evaluate it (after ``Learner.finish()``
    the learner's model holds the final global weights), or on a loaded export.
    """
    if max_batches < 1:
        raise UsageError(f"max_batches is {max_batches!r}: give the number of batches to measure with, >= 1")
    norms = batch_norms(model)
    if not norms:
        return 0
    feed = forward or default_forward
    stream = iter(batches)
    first = next(stream, _NONE)
    if first is _NONE:  # before anything is reset: the statistics stay as they were
        raise UsageError("recalibrate_batch_norm was given no batches: give it some of the training data")
    modes = {m: m.training for m in model.modules()}
    momenta = [m.momentum for m in norms]
    used = 0
    try:
        model.eval()
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over every batch, not an EMA of the last ones
            m.train()
        with torch.no_grad():
            for batch in itertools.chain([first], stream):
                feed(model, batch)
                used += 1
                if used >= max_batches:
                    break
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        for m, training in modes.items():
            m.train(training)
    log.info("BatchNorm statistics of %d layers re-estimated on %d batches", len(norms), used)
    return used
