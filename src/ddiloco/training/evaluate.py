"""Held-out evaluation of a model (always the syncer's global model in the runtimes)."""

from __future__ import annotations

import torch
from torch import nn

from ddiloco.workloads.base import Batch, Workload


@torch.no_grad()
def evaluate(workload: Workload, model: nn.Module, batches: list[Batch]) -> float:
    """Token-weighted mean loss over the fixed evaluation batches, in eval mode (BatchNorm on
    its running statistics, no dropout); the model's mode is restored afterwards."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    try:
        for b in batches:
            total += float(workload.loss(model, b)) * b.tokens
            tokens += b.tokens
    finally:
        model.train(was_training)
    return total / max(tokens, 1)


def eval_figures(workload: Workload, model: nn.Module, batches: list[Batch]) -> dict[str, float]:
    """The loss, and the accuracy too when the workload measures one (``accuracy(model,
    batches)``: a classifier's share of correct answers on the same batches)."""
    out = {"loss": evaluate(workload, model, batches)}
    accuracy = getattr(workload, "accuracy", None)
    if callable(accuracy):
        out["accuracy"] = float(accuracy(model, batches))
    return out
