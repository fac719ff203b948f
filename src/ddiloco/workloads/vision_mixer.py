"""A small MLP-Mixer for the vision workload (``workload.options.model = "mixer"``).

The image is cut into non-overlapping ``patch`` x ``patch`` patches, each projected to ``dim``
channels (one strided convolution: a linear map per patch). ``depth`` mixer blocks follow, each
two residual MLPs behind a LayerNorm: one across the patches (token mixing, hidden width
``dim // 2``) and one across the channels (channel mixing, hidden ``4 * dim``), the ratios of
the MLP-Mixer paper (Tolstikhin et al., 2021). A final LayerNorm, the mean over the patches
and a linear head give the logits. About 107k parameters at the defaults (patch 7, dim 64,
depth 3). No BatchNorm, so no buffers: the model is its parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddiloco.workloads.base import structure_only


class MixerMLP(nn.Module):
    """Linear-GELU-Linear over the last dimension."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(F.gelu(self.fc1(x)))
        return out


class MixerBlock(nn.Module):
    """Token mixing, then channel mixing, each pre-norm and residual, on [B, tokens, dim]."""

    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_mlp = MixerMLP(tokens, max(1, dim // 2))
        self.norm2 = nn.LayerNorm(dim)
        self.channel_mlp = MixerMLP(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The token MLP acts along the patches: put them last, mix, put them back.
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        out: torch.Tensor = x + self.channel_mlp(self.norm2(x))
        return out


class SmallMixer(nn.Module):
    """Patch embedding, ``depth`` mixer blocks, LayerNorm, mean over patches, linear head."""

    def __init__(
        self,
        patch: int = 7,
        dim: int = 64,
        depth: int = 3,
        image_hw: tuple[int, int] = (28, 28),
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        h, w = image_hw
        if h % patch or w % patch:
            raise ValueError(f"patch {patch} does not divide the {h}x{w} image")
        tokens = (h // patch) * (w // patch)
        self.embed = nn.Conv2d(1, dim, patch, stride=patch)  # one linear map per patch
        self.blocks = nn.ModuleList(MixerBlock(tokens, dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)  # [B, tokens, dim]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x).mean(dim=1))
        return logits

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Every weight uniform in +-1/sqrt(fan_in) (PyTorch's default scale for a linear layer),
        biases zero, LayerNorm at identity. The head is not zeroed (as the paper does) so that
        every parameter has a gradient from the first step."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                fan_in = module.weight[0].numel()
                module.weight.uniform_(-(fan_in**-0.5), fan_in**-0.5, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()


def build_mixer(
    seed: int, patch: int = 7, dim: int = 64, depth: int = 3, image_hw: tuple[int, int] = (28, 28)
) -> SmallMixer:
    """A SmallMixer initialised from ``seed`` on CPU, without touching the global RNG (built on
    the meta device, then every value written from a private generator)."""
    with torch.device("meta"):
        model = SmallMixer(patch, dim, depth, image_hw)
    if structure_only():  # the caller writes every value (``workloads.base.structure_only``)
        return model
    model = model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(seed))
    return model
