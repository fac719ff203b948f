"""A Mixture-of-Experts byte-level GPT on the Shakespeare plays.

``workload.factory = "ddiloco.workloads.moe:make_workload"``. Data, learner streams and the
evaluation set are the Shakespeare workload's, byte for byte (this workload *is* a
``TextWorkload`` on ``shakespeare.SOURCE``); only the model differs: the dense GPT's (see
``ddiloco.workloads.gpt``) with every block's 4x MLP replaced by a routed mixture of experts.

``workload.options`` (unknown keys are refused; the Shakespeare workload has no options of its
own to pass through):

- ``experts`` (4, 1..64): experts per block;
- ``top_k`` (2, 1..experts): experts each token is routed to;
- ``aux_loss_coef`` (0.01, finite, >= 0): weight of the load-balancing loss in training;
- ``expert_hidden`` (2 * d_model, >= 1): hidden width of one expert. With the defaults a token
  passes through top_k x 2d = 4d hidden units, the dense GPT's compute per token, while the
  expert weights hold experts/2 = 2x the dense MLP's parameters.

Routing: a bias-free linear router d_model -> experts, a softmax, and the top_k experts by
probability (a stable descending sort, so ties go to the lowest expert index on every device:
``torch.topk`` breaks ties differently, e.g. [2, 3] for four equal probabilities on CPU). The
chosen probabilities are renormalised to sum to one when top_k > 1; with top_k = 1 the gate is
the raw probability (as in the Switch Transformer), since a renormalised single gate is the
constant 1 and the router would then learn from the auxiliary loss alone. Each expert computes
only its routed tokens (gathered with ``index_select``), a GELU MLP without biases.

Load balancing (Switch Transformer): per block ``experts * sum_i f_i * P_i`` with ``f_i`` the
fraction of the top_k token assignments routed to expert i and ``P_i`` the mean router
probability of expert i; it is 1 when either is uniform (e.g. a zero router). The workload's
``loss()`` adds ``aux_loss_coef`` x the sum over blocks in training mode only, so the
evaluation loss (``training/evaluate.py`` puts the model in eval mode) is the pure next-byte
cross-entropy, comparable with the dense GPT's. ``MoEGPT.last_lm_loss`` and
``last_aux_loss`` keep the two parts of the last ``loss()`` (detached).

Parameter names: the GPT's, with ``blocks.{i}.mlp.*`` replaced by ``blocks.{i}.moe.router.weight``
[experts, d_model], ``blocks.{i}.moe.w_in`` [experts, d_model, hidden] and
``blocks.{i}.moe.w_out`` [experts, hidden, d_model]. Experts are stored stacked, the expert
index on dim 0, and without biases: a stacked bias would be 2-d, and the inner optimizer
(``training/inner.py``) weight-decays every tensor of 2 or more dims.

Fragments (``core/fragments.py``, read for this module): ``training/layout.py`` hands the layout
builder the model's parameters in registration order plus its persistent buffers; this model
has none (the routed-token counts are plain attributes, never synced). The "balanced" strategy
packs whole tensors and, while the largest fragment exceeds 1.25x the mean, halves the largest
multi-row parameter piece by rows along dim 0 (at ``row_start + rows // 2``) and packs again; a
one-row piece is never split. A row of ``w_in``/``w_out`` is one whole expert (and a row of the
router weight is one expert's router vector), so every piece holds a contiguous range of whole
experts; with ``experts = 1`` those tensors cannot be split at all. "per_layer" keeps a block's
experts in one fragment and "strided" moves whole tensors.

``MoEGPT.routed_tokens()`` returns the [n_layer, experts] int64 counts of token assignments of
the last forward; the workload's ``routed_tokens(model)`` hands them to the runtimes keyed by
the expert tensors' names, for ``algo.expert_weights = "routed"`` (each expert's rows merged
by the tokens it saw on each learner; ``core/merge.py: RowAccumulator``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddiloco.errors import ConfigError
from ddiloco.workloads import shakespeare
from ddiloco.workloads.base import Batch, structure_only
from ddiloco.workloads.config import WorkloadConfig, check_known_options
from ddiloco.workloads.gpt import GPT, CausalSelfAttention, GPTConfig
from ddiloco.workloads.text import TextWorkload

MAX_EXPERTS = 64
"""Most experts per block ``workload.options.experts`` allows."""


# ---------------------------------------------------------------------------- options


@dataclass(frozen=True)
class MoEOptions:
    """The MoE settings from ``workload.options``."""

    experts: int = 4
    """Experts per block, 1..64."""
    top_k: int = 2
    """Experts each token is routed to, 1..experts."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss added to the training loss (finite, >= 0)."""
    expert_hidden: int | None = None
    """Hidden width of one expert; None means 2 * d_model."""

    @classmethod
    def from_dict(cls, options: dict[str, object]) -> MoEOptions:
        """Parse and check ``workload.options``: unknown keys and out-of-range values are refused."""
        check_known_options(options, list(cls.__dataclass_fields__), "moe")
        opts = cls(**options)  # type: ignore[arg-type]
        _check_int("experts", opts.experts, 1, MAX_EXPERTS)
        _check_int("top_k", opts.top_k, 1, opts.experts, f"in 1..experts ({opts.experts})")
        if opts.expert_hidden is not None:
            _check_int("expert_hidden", opts.expert_hidden, 1, None)
        coef = opts.aux_loss_coef
        if not isinstance(coef, (int, float)) or isinstance(coef, bool) or not math.isfinite(coef) or coef < 0:
            raise ConfigError(f"workload.options.aux_loss_coef must be a finite number >= 0, got {coef!r}")
        return cls(opts.experts, opts.top_k, float(coef), opts.expert_hidden)


def _check_int(name: str, value: object, low: int, high: int | None, allowed: str = "") -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    if not ok:
        allowed = allowed or (f"in {low}..{high}" if high is not None else f">= {low}")
        raise ConfigError(f"workload.options.{name} must be an integer {allowed}, got {value!r}")


@dataclass(frozen=True)
class MoEConfig:
    """Shape of the MoE GPT."""

    gpt: GPTConfig
    """Everything but the feed-forward layers, as for the dense GPT."""
    experts: int = 4
    """Experts per block."""
    top_k: int = 2
    """Experts per token."""
    hidden: int = 256
    """Hidden width of one expert."""


# ---------------------------------------------------------------------------- the model


class MoEFeedForward(nn.Module):
    """Top-k routed experts, stacked on dim 0; keeps its last aux loss and routed-token counts."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        d, e, h = cfg.gpt.d_model, cfg.experts, cfg.hidden
        self.experts, self.top_k = e, cfg.top_k
        self.router = nn.Linear(d, e, bias=False)
        self.w_in = nn.Parameter(torch.empty(e, d, h))
        self.w_out = nn.Parameter(torch.empty(e, h, d))
        # Plain attributes, not buffers: per-forward statistics, never part of the synced state.
        self.aux_loss: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, k = x.shape, self.top_k
        flat = x.reshape(-1, shape[-1])
        n = flat.size(0)
        probs = F.softmax(self.router(flat), dim=-1)
        # Stable descending sort instead of topk: ties go to the lowest index on every device.
        top_p, top_i = torch.sort(probs, dim=-1, descending=True, stable=True)
        gates, idx = top_p[:, :k], top_i[:, :k]
        if k > 1:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        slots = idx.reshape(-1)  # assignment a = token * k + j
        counts = torch.bincount(slots, minlength=self.experts)
        order = torch.argsort(slots, stable=True)
        outs = flat.new_zeros(n * k, shape[-1])
        for e, assigned in enumerate(torch.split(order, counts.tolist())):
            if assigned.numel() == 0:
                continue
            tokens = flat.index_select(0, assigned // k)
            # Each assignment owns one row of ``outs``, so the writes never collide (deterministic).
            outs.index_copy_(0, assigned, F.gelu(tokens @ self.w_in[e]) @ self.w_out[e])
        y = (outs.view(n, k, -1) * gates.unsqueeze(-1)).sum(dim=1)
        frac = counts.to(probs.dtype) / (n * k)
        self.aux_loss = self.experts * (frac * probs.mean(dim=0)).sum()
        self.counts = counts.detach()
        return y.view(shape)


class MoEBlock(nn.Module):
    """Pre-LayerNorm block: x + attn(ln1(x)), then x + moe(ln2(x))."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.gpt.d_model)
        self.attn = CausalSelfAttention(cfg.gpt)
        self.ln2 = nn.LayerNorm(cfg.gpt.d_model)
        self.moe = MoEFeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.moe(self.ln2(x))
        return out


class MoEGPT(GPT):
    """Byte-level MoE GPT: the dense GPT (``forward``, embeddings, head) with ``MoEBlock`` blocks;
    ``forward(idx)`` maps int64 ids [batch, seq] to logits [batch, seq, vocab]."""

    def __init__(self, cfg: MoEConfig) -> None:
        if not 1 <= cfg.top_k <= cfg.experts:
            raise ValueError(f"top_k ({cfg.top_k}) must be in 1..experts ({cfg.experts})")
        super().__init__(cfg.gpt, block=lambda: MoEBlock(cfg))
        self.moe_cfg = cfg
        self.last_lm_loss: torch.Tensor | None = None
        """Detached next-byte loss of the last workload ``loss()``."""
        self.last_aux_loss: torch.Tensor | None = None
        """Detached load-balancing loss (summed over blocks, before the coefficient) of the last ``loss()``."""

    def init_module(self, name: str, module: nn.Module, generator: torch.Generator, resid_std: float) -> None:
        """The GPT's init (the router is a Linear: N(0, 0.02)); expert input weights N(0, 0.02)
        and expert output weights at the residual scale, drawn in registration order."""
        if isinstance(module, MoEFeedForward):
            module.w_in.normal_(0.0, 0.02, generator=generator)
            module.w_out.normal_(0.0, resid_std, generator=generator)
        else:
            super().init_module(name, module, generator, resid_std)

    def _ffns(self) -> list[MoEFeedForward]:
        return [m for m in self.modules() if isinstance(m, MoEFeedForward)]

    def take_aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the last forward summed over blocks (with its graph), and
        forget it, so no autograd graph stays attached to the model (``copy.deepcopy`` refuses one)."""
        parts = []
        for ffn in self._ffns():
            if ffn.aux_loss is None:
                raise RuntimeError("take_aux_loss() needs a forward pass first")
            parts.append(ffn.aux_loss)
            ffn.aux_loss = None
        return torch.stack(parts).sum()

    def routed_tokens(self) -> torch.Tensor:
        """[n_layer, experts] int64: token assignments each block routed to each expert in the
        last forward (top_k per token; zeros before the first)."""
        rows = [
            ffn.counts.cpu() if ffn.counts is not None else torch.zeros(ffn.experts, dtype=torch.int64)
            for ffn in self._ffns()
        ]
        return torch.stack(rows)


def build_moe(cfg: MoEConfig, seed: int) -> MoEGPT:
    """A MoE GPT initialised deterministically from ``seed`` on CPU (built on the meta device,
    so the global RNG is never drawn from, as ``gpt.build_gpt``)."""
    with torch.device("meta"):
        model = MoEGPT(cfg)
    if structure_only():  # the caller writes every value (``workloads.base.structure_only``)
        return model
    model = model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def moe_model(model: nn.Module) -> MoEGPT:
    """The ``MoEGPT`` in ``model`` (itself, or inside a wrapper such as DDP)."""
    for m in model.modules():
        if isinstance(m, MoEGPT):
            return m
    raise TypeError(f"the MoE workload's loss needs a MoEGPT, got a {type(model).__name__}")


# ---------------------------------------------------------------------------- the workload


class MoEWorkload(TextWorkload):
    """The Shakespeare text workload (same data, streams and eval set) with a MoE GPT."""

    def __init__(self, cfg: WorkloadConfig, opts: MoEOptions) -> None:
        super().__init__(cfg, shakespeare.SOURCE, name="shakespeare-moe", install=shakespeare.INSTALL)
        hidden = opts.expert_hidden if opts.expert_hidden is not None else 2 * self.gpt.d_model
        self.moe = MoEConfig(self.gpt, opts.experts, opts.top_k, hidden)
        self.aux_loss_coef = opts.aux_loss_coef

    def build_model(self, seed: int) -> nn.Module:
        """A fresh MoE GPT initialised from ``seed``."""
        return build_moe(self.moe, seed)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats per byte), plus ``aux_loss_coef`` x the
        load-balancing loss when the model is training; in eval mode the pure LM loss."""
        logits = model(batch.inputs)
        lm = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch.targets.reshape(-1))
        core = moe_model(model)
        aux = core.take_aux_loss()
        core.last_lm_loss, core.last_aux_loss = lm.detach(), aux.detach()
        if model.training and self.aux_loss_coef > 0:
            return lm + self.aux_loss_coef * aux
        return lm

    def routed_tokens(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The tokens the last forward routed to each expert, for both expert-stacked
        parameters of every block (``w_in`` and ``w_out``; the router's rows see every token):
        the per-expert counts of ``algo.expert_weights = "routed"``."""
        names = {id(p): n for n, p in model.named_parameters()}
        out = {}
        for ffn in moe_model(model)._ffns():
            counts = ffn.counts if ffn.counts is not None else torch.zeros(ffn.experts, dtype=torch.int64)
            for param in (ffn.w_in, ffn.w_out):
                out[names[id(param)]] = counts
        return out


def make_workload(cfg: WorkloadConfig) -> MoEWorkload:
    """Factory for ``workload.factory = "ddiloco.workloads.moe:make_workload"``."""
    cfg.validate()  # first, so a non-table options value is named in one line
    return MoEWorkload(cfg, MoEOptions.from_dict(cfg.options))
