"""A small CNN with BatchNorm (or a small MLP-Mixer) on Fashion-MNIST: the built-in vision workload.

``workload.factory = "ddiloco.workloads.vision:make_workload"``. The data are the four IDX
files of the Debian package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``),
read with numpy and gzip; nothing is downloaded and nothing is cached on disk. If the files
are missing the workload is refused with one line saying how to install them.

- Model: conv(1->w)-BN-ReLU-maxpool, conv(w->2w)-BN-ReLU-maxpool, linear to 10 classes
  (``w`` = ``width``, about 20k parameters at the default 16). Its BatchNorm running
  statistics are module *buffers*, not parameters. With ``model = "mixer"``, a small
  MLP-Mixer instead (``vision_mixer``: 7x7 patches, 3 blocks of 64 channels, about 107k
  parameters, LayerNorm and no buffers).
- Loss: mean cross-entropy, nats per example; a "token" is one example (``Batch.tokens``).
- Training data: the 60,000 training images dealt round-robin into ``num_shards`` disjoint
  shards (example ``i`` to shard ``i % num_shards``). Epoch ``e`` of a shard visits each of
  its examples once, in a permutation drawn from ``(seed, num_shards, shard, e)``, so a
  stream is deterministic and seekable in O(1) by batch position.
- Evaluation: a fixed subset of ``workload.eval_windows`` of the 10,000 test images (the
  first of one fixed permutation, so a larger subset contains a smaller one), or all of them
  with ``full_test = true``, in batches of 32 whatever ``batch_size`` is. ``accuracy()``
  (outside the ``Workload`` protocol) gives the fraction classified correctly.
- Nothing is embedding-like: every parameter is merged by RDA.

Evaluation must run the model in eval mode, so that BatchNorm uses its running statistics
rather than the statistics of the evaluation batch: ``loss()`` uses the model in whatever
mode it is in (it serves training too), and ``ddiloco.training.evaluate.evaluate`` (which
every runtime uses) calls ``model.eval()`` first; ``accuracy()`` switches to eval mode
itself and restores the previous mode. In a run the evaluated model is the global one, so its
BatchNorm statistics are only meaningful once the runtime synchronizes buffers.

Options (``workload.options``): ``path`` (a folder with the four IDX files, gzipped or not;
default the Debian package's folder), ``model`` (``"cnn"`` or ``"mixer"``), for the CNN
``width`` (16) and ``norm`` (``"batch"`` or ``"none"``), for the mixer ``patch`` (7), ``dim``
(64) and ``depth`` (3), ``full_test`` (false). A size option of the other model is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ddiloco.errors import ConfigError, DataError
from ddiloco.workloads.base import Batch, structure_only
from ddiloco.workloads.config import WorkloadConfig, check_known_options, check_shard, require_ints
from ddiloco.workloads.vision_mixer import build_mixer

log = logging.getLogger(__name__)

DEFAULT_PATH = "/usr/share/datasets/fashion-mnist"
"""Where the Debian package ``dataset-fashion-mnist`` puts the IDX files."""

INSTALL = "sudo apt-get update && sudo apt-get install dataset-fashion-mnist"
"""The command that installs the data."""

FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
"""The four IDX files (each read as ``NAME.gz``, else ``NAME``)."""

NORMS = ("batch", "none")
"""Allowed values of ``workload.options.norm``."""

MODELS = ("cnn", "mixer")
"""Allowed values of ``workload.options.model``."""

MODEL_OPTIONS = {"cnn": ("width", "norm"), "mixer": ("patch", "dim", "depth")}
"""The size options each model reads; setting another model's is refused (it would do nothing)."""

NUM_CLASSES = 10
EVAL_CHUNK = 32  # examples per eval batch, whatever batch_size is (as the other workloads)
_EVAL_SEED = 0xFA5  # the fixed test-subset permutation; independent of the run's seed
_MEAN, _STD = 0.2860, 0.3530  # Fashion-MNIST training-set pixel mean and std (in [0, 1])
_MAX_WIDTH = 512  # also the mixer's largest dim
_MAX_DEPTH = 32
_MAX_PATCH = 28  # one patch per Fashion-MNIST image; the workload checks it divides the images


# ---------------------------------------------------------------------------- options


@dataclass(frozen=True)
class VisionOptions:
    """The data folder and the model's shape, from ``workload.options``."""

    path: str = DEFAULT_PATH
    """Folder holding the four IDX files (gzipped or not)."""
    model: str = "cnn"
    """``"cnn"``: the BatchNorm CNN (``width``, ``norm``); ``"mixer"``: the MLP-Mixer (``patch``,
    ``dim``, ``depth``)."""
    width: int = 16
    """CNN: channels of the first convolution; the second has twice as many."""
    norm: str = "batch"
    """CNN: ``"batch"``: BatchNorm2d after each convolution; ``"none"``: no normalization (the
    convolutions then have biases)."""
    patch: int = 7
    """Mixer: side of the square patches, in pixels; it must divide the image's sides (28)."""
    dim: int = 64
    """Mixer: channels per patch (the token MLP's hidden width is half, the channel MLP's four times)."""
    depth: int = 3
    """Mixer: number of mixer blocks."""
    full_test: bool = False
    """Evaluate on all 10,000 test images instead of ``workload.eval_windows`` of them."""

    @classmethod
    def from_dict(cls, options: dict[str, object]) -> VisionOptions:
        """Parse ``workload.options``, rejecting unknown keys and bad values."""
        check_known_options(options, list(cls.__dataclass_fields__), "vision")
        opts = cls(**options)  # type: ignore[arg-type]
        if not isinstance(opts.path, str) or not opts.path.strip():
            raise ConfigError(f"workload.options.path must be a non-empty string, got {opts.path!r}")
        if opts.model not in MODELS:
            raise ConfigError(f"workload.options.model = {opts.model!r} is unknown; allowed: {list(MODELS)}")
        for other, names in MODEL_OPTIONS.items():
            stray = sorted(set(options) & set(names)) if other != opts.model else []
            if stray:
                raise ConfigError(
                    f"workload.options {stray} apply to model = {other!r} only, not {opts.model!r}; remove them"
                )
        for name, top in (("width", _MAX_WIDTH), ("patch", _MAX_PATCH), ("dim", _MAX_WIDTH), ("depth", _MAX_DEPTH)):
            value = getattr(opts, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
                raise ConfigError(f"workload.options.{name} must be an integer in 1..{top}, got {value!r}")
        if opts.norm not in NORMS:
            raise ConfigError(f"workload.options.norm = {opts.norm!r} is unknown; allowed: {list(NORMS)}")
        if not isinstance(opts.full_test, bool):
            raise ConfigError(f"workload.options.full_test must be true or false, got {opts.full_test!r}")
        # Absolute, so the data cache key does not depend on the working directory.
        return dataclasses.replace(opts, path=str(Path(opts.path).expanduser().resolve()))


# ---------------------------------------------------------------------------- the data


@dataclass(frozen=True)
class FashionMNIST:
    """The four IDX arrays, read-only uint8."""

    train_images: np.ndarray
    """[60000, 28, 28] pixels 0..255."""
    train_labels: np.ndarray
    """[60000] classes 0..9."""
    test_images: np.ndarray
    """[10000, 28, 28] pixels 0..255."""
    test_labels: np.ndarray
    """[10000] classes 0..9."""


def missing_message(folder: str | Path, name: str) -> str:
    """The one line that says the data are missing and how to install them."""
    return (
        f"Fashion-MNIST not found: {folder} has no {name}.gz; install it with `{INSTALL}`, "
        "or set workload.options.path to a folder with the four IDX files"
    )


def read_idx(path: Path) -> np.ndarray:
    """An IDX file of unsigned bytes (gzipped when its name ends in ``.gz``) as a read-only
    uint8 array of the shape its header gives."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                raw = f.read()
        else:
            raw = path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:  # unreadable, truncated or corrupt gzip
        raise DataError(f"cannot read {path} ({exc}); reinstall it: {INSTALL}") from None
    # Header: two zero bytes, type 0x08 (unsigned byte), the number of dimensions, then each
    # dimension as a big-endian uint32.
    ndim = raw[3] if len(raw) >= 4 else 0
    if len(raw) < 4 or raw[:3] != b"\x00\x00\x08" or ndim == 0 or len(raw) < 4 + 4 * ndim:
        raise DataError(f"{path} is not an IDX file of unsigned bytes; reinstall it: {INSTALL}")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    offset = 4 + 4 * ndim
    if len(raw) - offset != int(np.prod(shape)):
        raise DataError(f"{path} holds {len(raw) - offset} bytes of data, its header says {shape}; reinstall it")
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(shape)


def _find(folder: Path, name: str) -> Path:
    """``folder/name.gz``, else ``folder/name``; DataError with the install line if neither."""
    for candidate in (folder / f"{name}.gz", folder / name):
        if candidate.is_file():
            return candidate
    raise DataError(missing_message(folder, name))


@functools.lru_cache(maxsize=2)
def load_fashion_mnist(path: str = DEFAULT_PATH) -> FashionMNIST:
    """The data in folder ``path`` (absolute), read once per process: in-process learners
    share it. Raises DataError naming the first missing or malformed file."""
    folder = Path(path)
    found = [_find(folder, name) for name in FILES]  # every file present before any is read
    arrays = [read_idx(p) for p in found]
    for (images, labels), split in ((arrays[0:2], "train"), (arrays[2:4], "t10k")):
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels) or len(images) == 0:
            raise DataError(
                f"{folder}: {split} images {images.shape} and labels {labels.shape} do not match; "
                "expected [N, H, W] images and N labels"
            )
        if int(labels.max()) >= NUM_CLASSES:
            raise DataError(f"{folder}: {split} labels go up to {int(labels.max())}; expected 0..{NUM_CLASSES - 1}")
    if arrays[0].shape[1:] != arrays[2].shape[1:]:
        raise DataError(f"{folder}: train images are {arrays[0].shape[1:]}, test images {arrays[2].shape[1:]}")
    return FashionMNIST(*arrays)


def make_batch(images: np.ndarray, labels: np.ndarray, index: np.ndarray) -> Batch:
    """Examples ``index`` as a batch: normalized float32 [B, 1, H, W] inputs, int64 targets."""
    x = torch.from_numpy(images[index].astype(np.float32))
    x = (x / 255.0 - _MEAN) / _STD
    y = torch.from_numpy(labels[index].astype(np.int64))
    return Batch(inputs=x.unsqueeze(1), targets=y, tokens=len(index))


class ExampleStream:
    """A learner's deterministic, seekable stream over its shard's examples.

    Batch ``k`` takes examples ``k*B .. k*B+B-1`` of the shard's epochs laid end to end,
    epoch ``e`` in the permutation drawn from ``key + (e,)``: ``seek`` is O(1) plus one
    permutation per new epoch.
    """

    def __init__(self, data: FashionMNIST, examples: np.ndarray, batch_size: int, key: tuple[int, ...]) -> None:
        self.position = 0
        self.examples = examples
        """Training-set indices of this shard, ascending."""
        self._data, self._examples = data, examples
        self._batch, self._key = batch_size, key
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order; the two most recently used are kept (one boundary)."""
        perm = self._perms.pop(epoch, None)
        if perm is None:
            perm = np.random.default_rng((*self._key, epoch)).permutation(len(self._examples))
        self._perms[epoch] = perm  # (re)insert as most recent
        while len(self._perms) > 2:
            self._perms.pop(next(iter(self._perms)))
        return perm

    def indices(self, position: int) -> np.ndarray:
        """Training-set indices of the examples in batch ``position``."""
        flat = position * self._batch + np.arange(self._batch, dtype=np.int64)
        epochs, ranks = np.divmod(flat, len(self._examples))
        picked = np.empty_like(flat)
        for epoch in np.unique(epochs):  # one epoch, or two across a boundary
            sel = epochs == epoch
            picked[sel] = self._perm(int(epoch))[ranks[sel]]
        return self._examples[picked]

    def next_batch(self) -> Batch:
        """The batch at ``position``; advances ``position`` by one."""
        index = self.indices(self.position)
        self.position += 1
        return make_batch(self._data.train_images, self._data.train_labels, index)

    def seek(self, position: int) -> None:
        """Resume at ``position`` batches into the stream."""
        if position < 0:
            raise DataError(f"cannot seek a data stream to position {position}; positions are >= 0")
        self.position = int(position)


# ---------------------------------------------------------------------------- the model


class SmallCNN(nn.Module):
    """conv-BN-ReLU-pool twice, then a linear classifier (see the module docstring)."""

    def __init__(self, width: int = 16, norm: str = "batch", image_hw: tuple[int, int] = (28, 28)) -> None:
        super().__init__()
        bn = norm == "batch"
        self.conv1 = nn.Conv2d(1, width, 3, padding=1, bias=not bn)  # BN's shift makes a bias redundant
        self.bn1: nn.Module = nn.BatchNorm2d(width) if bn else nn.Identity()
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=not bn)
        self.bn2: nn.Module = nn.BatchNorm2d(2 * width) if bn else nn.Identity()
        h, w = image_hw
        self.head = nn.Linear(2 * width * (h // 4) * (w // 4), NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        logits: torch.Tensor = self.head(x.flatten(1))
        return logits

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """He-uniform convolutions (ReLU follows them), PyTorch's default scale for the head,
        zero biases, BatchNorm at identity with fresh running statistics."""
        for conv in (self.conv1, self.conv2):
            nn.init.kaiming_uniform_(conv.weight, nonlinearity="relu", generator=generator)
            if conv.bias is not None:
                conv.bias.zero_()
        bound = self.head.in_features**-0.5
        self.head.weight.uniform_(-bound, bound, generator=generator)
        self.head.bias.zero_()
        for bn in (self.bn1, self.bn2):
            if isinstance(bn, nn.BatchNorm2d):
                bn.reset_parameters()  # weight 1, bias 0, running mean 0 / var 1, count 0


def build_cnn(seed: int, width: int = 16, norm: str = "batch", image_hw: tuple[int, int] = (28, 28)) -> SmallCNN:
    """A SmallCNN initialised from ``seed`` on CPU, without touching the global RNG (built on
    the meta device, then every value, buffers included, written from a private generator)."""
    with torch.device("meta"):
        model = SmallCNN(width, norm, image_hw)
    if structure_only():  # the caller writes every value (``workloads.base.structure_only``)
        return model
    model = model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


# ---------------------------------------------------------------------------- the workload


class VisionWorkload:
    """A small CNN or MLP-Mixer on Fashion-MNIST (see the module docstring)."""

    loss_unit = "nats/example"

    def __init__(self, cfg: WorkloadConfig, opts: VisionOptions) -> None:
        cfg.validate()
        require_ints(cfg, ("eval_windows",))
        self.cfg, self.opts = cfg, opts
        self.name = f"fashion-mnist-{opts.model}"
        self.data = load_fashion_mnist(opts.path)  # at once: a missing dataset fails before any work
        h, w = self.data.train_images.shape[1:]
        if opts.model == "mixer" and (h % opts.patch or w % opts.patch):
            raise ConfigError(
                f"workload.options.patch = {opts.patch} does not divide the {h}x{w} images; "
                "use a divisor of both sides (4 or 7 for Fashion-MNIST)"
            )
        n_test = len(self.data.test_labels)
        if not opts.full_test and cfg.eval_windows > n_test:
            raise ConfigError(
                f"workload.eval_windows = {cfg.eval_windows} is more than the {n_test} test images; "
                "lower it, or set workload.options.full_test = true"
            )
        self._eval: list[Batch] | None = None

    def build_model(self, seed: int) -> nn.Module:
        """A fresh CNN or mixer (``options.model``) initialised from ``seed``."""
        h, w = self.data.train_images.shape[1:]
        o = self.opts
        if o.model == "mixer":
            return build_mixer(seed, o.patch, o.dim, o.depth, (int(h), int(w)))
        return build_cnn(seed, o.width, o.norm, (int(h), int(w)))

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean cross-entropy in nats per example, in the model's current mode (the caller
        puts it in eval mode for evaluation, as ``training.evaluate.evaluate`` does)."""
        return F.cross_entropy(model(batch.inputs), batch.targets)

    def train_stream(self, shard: int, num_shards: int, seed: int) -> ExampleStream:
        """Learner ``shard``'s stream over its examples, ordered by ``seed``."""
        check_shard(shard, num_shards, seed)
        n = len(self.data.train_labels)
        if num_shards > n:
            raise ConfigError(f"{num_shards} shards leave shard {shard} no training images (there are {n})")
        examples = np.arange(shard, n, num_shards, dtype=np.int64)
        return ExampleStream(self.data, examples, self.cfg.batch_size, (seed, num_shards, shard))

    def eval_indices(self) -> np.ndarray:
        """Test-set indices of the eval set: all of them with ``full_test``, else the first
        ``eval_windows`` of a fixed permutation (sorted)."""
        n = len(self.data.test_labels)
        if self.opts.full_test:
            return np.arange(n, dtype=np.int64)
        return np.sort(np.random.default_rng(_EVAL_SEED).permutation(n)[: self.cfg.eval_windows])

    def eval_batches(self) -> list[Batch]:
        """The fixed eval set (see ``eval_indices``) in batches of 32 examples."""
        if self._eval is None:
            idx, d = self.eval_indices(), self.data
            chunks = [idx[i : i + EVAL_CHUNK] for i in range(0, len(idx), EVAL_CHUNK)]
            self._eval = [make_batch(d.test_images, d.test_labels, c) for c in chunks]
        return list(self._eval)

    @torch.no_grad()
    def accuracy(self, model: nn.Module, batches: list[Batch]) -> float:
        """Fraction of the examples in ``batches`` that ``model`` classifies correctly, in eval
        mode (BatchNorm's running statistics); the model's previous mode is restored."""
        was_training = model.training
        model.eval()
        try:
            device = next(model.parameters()).device
            correct = total = 0
            for b in batches:
                pred = model(b.inputs.to(device)).argmax(dim=1)
                correct += int((pred == b.targets.to(device)).sum())
                total += len(b.targets)
        finally:
            model.train(was_training)
        return correct / max(total, 1)

    def is_embedding_like(self, name: str) -> bool:
        """Nothing is: every parameter is merged by RDA."""
        return False


def make_workload(cfg: WorkloadConfig) -> VisionWorkload:
    """Factory for ``workload.factory = "ddiloco.workloads.vision:make_workload"``."""
    cfg.validate()  # first, so a non-table options value is named in one line
    return VisionWorkload(cfg, VisionOptions.from_dict(cfg.options))
