"""A small nanoGPT-style byte-level GPT.

Vocabulary of 256 bytes, learned token and position embeddings, pre-LayerNorm blocks with
causal self-attention and a 4x GELU MLP, a final LayerNorm and an untied ``lm_head`` (so
every tensor has exactly one name, which keeps fragmenting and merging simple). No dropout.

Parameter names: ``tok_emb.weight``, ``pos_emb.weight``, ``blocks.{i}.ln1.{weight,bias}``,
``blocks.{i}.attn.qkv.{weight,bias}``, ``blocks.{i}.attn.proj.{weight,bias}``,
``blocks.{i}.ln2.{weight,bias}``, ``blocks.{i}.mlp.fc.{weight,bias}``,
``blocks.{i}.mlp.proj.{weight,bias}``, ``ln_f.{weight,bias}``, ``lm_head.weight``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddiloco.errors import ConfigError, DataError
from ddiloco.workloads.base import structure_only
from ddiloco.workloads.config import WorkloadConfig, require_ints

VOCAB_SIZE = 256
"""Byte-level vocabulary."""


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the GPT."""

    seq_len: int = 128
    """Longest sequence the position embedding covers."""
    d_model: int = 128
    """Residual stream width."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block (must divide ``d_model``)."""
    vocab_size: int = VOCAB_SIZE
    """Token vocabulary (256 for bytes)."""


def gpt_config(cfg: WorkloadConfig) -> GPTConfig:
    """The GPT shape named by ``cfg``, after checking the fields the GPT uses (the generic
    ``WorkloadConfig.validate()`` leaves them to the workloads that use them)."""
    require_ints(cfg, ("seq_len", "d_model", "n_layer", "n_head"))
    if cfg.d_model % cfg.n_head != 0:
        raise ConfigError(
            f"workload.d_model ({cfg.d_model}) must be divisible by workload.n_head "
            f"({cfg.n_head}); pick a head count that divides the width"
        )
    return GPTConfig(cfg.seq_len, cfg.d_model, cfg.n_layer, cfg.n_head)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused qkv projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # [b, t, c] -> [b, heads, t, head_dim]
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide, GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT. ``forward(idx)`` maps int64 ids [batch, seq] to logits [batch, seq, vocab].

    ``block`` makes each transformer block (default ``Block``): the MoE GPT
    (``workloads/moe.py``) passes its own and extends ``init_module``."""

    def __init__(self, cfg: GPTConfig, block: Callable[[], nn.Module] | None = None) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head != 0:
            raise ValueError(f"d_model ({cfg.d_model}) must be divisible by n_head ({cfg.n_head})")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList((block or (lambda: Block(cfg)))() for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """nanoGPT init from ``generator``: N(0, 0.02) weights, zero biases, unit LayerNorms,
        residual output projections scaled by 1/sqrt(2 * n_layer) (GPT-2)."""
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():  # fixed registration order -> deterministic
            self.init_module(name, module, generator, resid_std)

    def init_module(self, name: str, module: nn.Module, generator: torch.Generator, resid_std: float) -> None:
        """Initialise one module (called in registration order, so the draws are deterministic)."""
        if isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            std = resid_std if name.endswith(".proj") else 0.02
            module.weight.normal_(0.0, std, generator=generator)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        if t > self.cfg.seq_len:
            raise DataError(
                f"sequence of {t} tokens is longer than the model's seq_len {self.cfg.seq_len}; "
                "shorten the batch or raise workload.seq_len"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_gpt(cfg: GPTConfig, seed: int) -> GPT:
    """A GPT initialised deterministically from ``seed`` on CPU.

    The modules are created on the meta device, so construction neither allocates twice nor
    draws from (and disturbs) the global RNG; all values come from a private generator.
    """
    with torch.device("meta"):
        model = GPT(cfg)
    if structure_only():  # the caller writes every value (``workloads.base.structure_only``)
        return model
    model = model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy in nats per byte."""
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
