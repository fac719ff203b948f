"""A fast synthetic workload for tests: an MLP student regresses a fixed random teacher.

Inputs are Gaussian vectors, targets the outputs of a fixed random teacher MLP plus a little
noise. Data is infinite: batch ``k`` of shard ``s`` is drawn from a generator seeded by
``(seed, num_shards, s, k)``, so streams are seekable in O(1) and shards never share a batch.
The student's first layer is called ``embed`` and is reported as embedding-like, so both
merge paths (weighted mean and RDA) see traffic. A "token" is one example.

Options (``workload.options``): ``d_in`` (16), ``hidden`` (64), ``depth`` (1: hidden
``hidden x hidden`` layers), ``d_out`` (8), ``teacher_hidden`` (the teacher's width; default
``hidden``), ``noise`` (0.01, target noise std), ``teacher_seed`` (1234), ``batchnorm`` (false: a
BatchNorm1d after the last hidden layer, so the model has buffers to sync).

**The scale workload** is this task with ``teacher_hidden = 64``: the teacher (one hidden layer of
64 units) and the data stay small and fixed whatever the student's size, so every byte that grows
with ``hidden`` and ``depth`` is the model's own. The student then holds about
``depth * hidden^2 + (depth + 25) * hidden`` parameters (``bench/scale.py`` names its sizes so).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ddiloco.errors import ConfigError, DataError
from ddiloco.workloads.base import Batch, structure_only
from ddiloco.workloads.config import WorkloadConfig, check_known_options, check_shard, require_ints

_EVAL_KEY = (0, 0, 0)  # num_shards = 0: a key prefix that no training stream uses
_EVAL_CHUNK = 32  # examples per eval batch, whatever batch_size is


@dataclass(frozen=True)
class SyntheticOptions:
    """Shape of the synthetic task, from ``workload.options``."""

    d_in: int = 16
    """Input features."""
    hidden: int = 64
    """Student hidden width (the teacher's too unless ``teacher_hidden`` is set)."""
    depth: int = 1
    """Student hidden layers of ``hidden x hidden`` (the first is ``hidden``, more are ``layers.i``)."""
    d_out: int = 8
    """Regression targets."""
    teacher_hidden: int | None = None
    """The teacher's hidden width (it always has one hidden layer); None: ``hidden``, as before
    this option. Set it (64: the scale workload) to keep the task fixed while the student grows."""
    noise: float = 0.01
    """Standard deviation of Gaussian noise added to the teacher's outputs."""
    teacher_seed: int = 1234
    """Seed of the fixed teacher network."""
    batchnorm: bool = False
    """A BatchNorm1d after the student's hidden layer: running statistics and a batch count,
    the buffers a model brings (the soak's hostile-buffer attacks need them)."""

    @classmethod
    def from_dict(cls, options: dict[str, object]) -> SyntheticOptions:
        """Parse ``workload.options``, rejecting unknown keys and bad values."""
        check_known_options(options, list(cls.__dataclass_fields__), "synthetic")
        opts = cls(**options)  # type: ignore[arg-type]
        for name in ("d_in", "hidden", "depth", "d_out", "teacher_hidden"):
            value = getattr(opts, name)
            if name == "teacher_hidden" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"workload.options.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(opts.batchnorm, bool):
            raise ConfigError(f"workload.options.batchnorm must be true or false, got {opts.batchnorm!r}")
        if not isinstance(opts.noise, (int, float)) or opts.noise < 0:
            raise ConfigError(f"workload.options.noise must be a number >= 0, got {opts.noise!r}")
        return opts


class Student(nn.Module):
    """embed -> tanh -> hidden [-> tanh -> layers.i]* (-> BatchNorm) -> tanh -> head."""

    def __init__(self, opts: SyntheticOptions) -> None:
        super().__init__()
        self.embed = nn.Linear(opts.d_in, opts.hidden)
        self.hidden = nn.Linear(opts.hidden, opts.hidden)
        # depth = 1 adds no tensor, so names and state dicts are those from before the option
        self.layers = nn.ModuleList(nn.Linear(opts.hidden, opts.hidden) for _ in range(opts.depth - 1))
        self.norm = nn.BatchNorm1d(opts.hidden) if opts.batchnorm else nn.Identity()
        self.head = nn.Linear(opts.hidden, opts.d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(torch.tanh(self.embed(x)))
        for layer in self.layers:
            h = layer(torch.tanh(h))
        return self.head(torch.tanh(self.norm(h)))

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Uniform(+-1/sqrt(fan_in)) weights (PyTorch's default scale), zero biases."""
        for layer in (self.embed, self.hidden, *self.layers, self.head):
            bound = layer.in_features**-0.5
            layer.weight.uniform_(-bound, bound, generator=generator)
            layer.bias.zero_()


def _generator(*key: int) -> torch.Generator:
    """A torch generator seeded by mixing the integers in ``key``."""
    seed = int(np.random.SeedSequence(key).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))
    return torch.Generator().manual_seed(seed)


class SyntheticStream:
    """Seekable stream: batch ``k`` comes from a generator seeded by ``key + (k,)``."""

    def __init__(self, task: SyntheticWorkload, key: tuple[int, ...]) -> None:
        self.position = 0
        self._task, self._key = task, key

    def next_batch(self) -> Batch:
        """The batch at ``position``; advances ``position`` by one."""
        batch = self._task.make_batch(_generator(*self._key, self.position))
        self.position += 1
        return batch

    def seek(self, position: int) -> None:
        """Resume at ``position`` batches into the stream."""
        if position < 0:
            raise DataError(f"cannot seek a data stream to position {position}; positions are >= 0")
        self.position = int(position)


class SyntheticWorkload:
    """Teacher-student regression (mean squared error); see the module docstring."""

    name = "synthetic"
    loss_unit = "MSE"

    def __init__(self, cfg: WorkloadConfig) -> None:
        cfg.validate()
        require_ints(cfg, ("eval_windows",))
        self.cfg = cfg
        self.opts = SyntheticOptions.from_dict(cfg.options)
        # The teacher is a wider-scaled one-layer student, so its outputs vary by O(1) over the
        # inputs; built at its own (small) width, never the student's when teacher_hidden is set.
        width = self.opts.hidden if self.opts.teacher_hidden is None else self.opts.teacher_hidden
        self.teacher = Student(replace(self.opts, hidden=width, depth=1))
        self.teacher.init_weights(_generator(self.opts.teacher_seed))
        with torch.no_grad():
            for p in self.teacher.parameters():
                p.mul_(2.0)
        self.teacher.requires_grad_(False)
        self.teacher.eval()  # (a BatchNorm in it is then a fixed affine map)
        self._eval: list[Batch] | None = None

    def make_batch(self, generator: torch.Generator, size: int | None = None) -> Batch:
        """One batch of ``size`` (default ``batch_size``) examples drawn from ``generator``."""
        n, o = size or self.cfg.batch_size, self.opts
        x = torch.randn(n, o.d_in, generator=generator)
        with torch.no_grad():
            y = self.teacher(x) + o.noise * torch.randn(n, o.d_out, generator=generator)
        return Batch(inputs=x, targets=y, tokens=n)

    def build_model(self, seed: int) -> nn.Module:
        """A fresh student initialised from ``seed`` (without touching the global RNG)."""
        with torch.device("meta"):
            model = Student(self.opts)
        if structure_only():  # the caller writes every value (``workloads.base.structure_only``)
            return model
        model = model.to_empty(device="cpu")
        model.init_weights(torch.Generator().manual_seed(seed))
        if isinstance(model.norm, nn.BatchNorm1d):
            model.norm.reset_parameters()  # (to_empty left its buffers and affine uninitialised)
        return model

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean squared error."""
        return F.mse_loss(model(batch.inputs), batch.targets)

    def train_stream(self, shard: int, num_shards: int, seed: int) -> SyntheticStream:
        """Shard ``shard``'s infinite stream, distinct for every (seed, num_shards, shard)."""
        check_shard(shard, num_shards, seed)
        return SyntheticStream(self, (seed, num_shards, shard))

    def eval_batches(self) -> list[Batch]:
        """``eval_windows`` fixed examples from a key no training stream uses, in batches of 32
        whatever ``batch_size`` is."""
        if self._eval is None:
            n = self.cfg.eval_windows
            sizes = [min(_EVAL_CHUNK, n - i) for i in range(0, n, _EVAL_CHUNK)]
            self._eval = [self.make_batch(_generator(*_EVAL_KEY, k), size) for k, size in enumerate(sizes)]
        return list(self._eval)

    def is_embedding_like(self, name: str) -> bool:
        """The ``embed`` layer's weight is merged by weighted mean, the rest by RDA."""
        parts = name.split(".")
        return len(parts) >= 2 and parts[-2] == "embed" and parts[-1] == "weight"


def make_workload(cfg: WorkloadConfig) -> SyntheticWorkload:
    """Factory for ``workload.factory = "ddiloco.workloads.synthetic:make_workload"``."""
    return SyntheticWorkload(cfg)
