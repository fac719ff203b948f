"""The learners' inner optimizer and its learning-rate schedule over global tokens: the
``[inner]`` section's config beside what it builds."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ddiloco.training.schedule import lr_multiplier


@dataclass(frozen=True)
class InnerConfig:
    """The learners' inner optimizer (AdamW) and its schedule over global tokens."""

    lr: float = 2e-3
    """Peak learning rate."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    warmup_frac: float = 0.05
    """Share of the token budget spent warming the LR up linearly."""
    min_lr_frac: float = 0.1
    """Cosine decay floor as a share of the peak LR."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""


def make_optimizer(model: nn.Module, cfg: InnerConfig) -> torch.optim.AdamW:
    """AdamW; biases, norms and other 1-d tensors get no weight decay."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=False)


def lr_at(tokens: float, total_tokens: float, cfg: InnerConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_frac, as a function of global tokens
    (``schedule.lr_multiplier``'s cosine shape; the warm-up's first step is above 0)."""
    total = max(1.0, total_tokens)
    multiplier = lr_multiplier(
        tokens / total, "cosine", warmup=cfg.warmup_frac, final=cfg.min_lr_frac, ramp_floor=1 / total
    )
    return cfg.lr * multiplier


def inner_step(model: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, lr: float, grad_clip: float) -> None:
    """One optimizer step on ``loss`` at learning rate ``lr``."""
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=False)
    opt.step()
