"""Splitting a byte corpus into learner shards and a held-out set, and streaming windows.

The corpus is cut into blocks of ``block_bytes`` that are dealt out round-robin: every
``eval_every``-th block to the held-out set, the others in turn to the learner shards, so
every shard and the held-out set see text from all over the corpus. Windows of
``seq_len + 1`` bytes never cross a block, which keeps the shards and the held-out set
disjoint.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ddiloco.errors import DataError
from ddiloco.workloads.base import Batch

log = logging.getLogger(__name__)

EVAL_CHUNK = 32
"""Windows per evaluation batch: fixed, so the eval set does not depend on ``batch_size``."""

MIN_BLOCKS_PER_EVAL_EVERY = 4
"""A corpus is cut into at least ``eval_every`` x this many blocks (when the floor allows),
so the held-out set gets at least this many blocks."""


def effective_block_bytes(n_bytes: int, block_bytes: int, eval_every: int, window: int) -> int:
    """``block_bytes``, or a smaller block for a small corpus.

    A corpus of fewer than ``eval_every * MIN_BLOCKS_PER_EVAL_EVERY`` blocks would leave the
    held-out set a block or two (or none) and some shards nothing, so the block shrinks until
    there are that many blocks, but never below ``2 * window`` (a block must hold windows;
    a ``block_bytes`` already below that is kept).
    Depends only on the corpus and the config, never on the number of shards, so the
    held-out set is the same for every fleet size.
    """
    want = eval_every * MIN_BLOCKS_PER_EVAL_EVERY
    if -(-n_bytes // block_bytes) >= want:
        return block_bytes
    return min(block_bytes, max(2 * window, n_bytes // want))  # shrink only, never grow


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


def blocks_needed(eval_every: int, num_shards: int) -> int:
    """Fewest blocks that give the held-out set one block and each of ``num_shards`` one."""
    n = eval_every
    while n - n // eval_every < num_shards:
        n += 1
    return n


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


def gather(data: np.ndarray, offsets: np.ndarray, window: int) -> Batch:
    """A batch of next-byte prediction pairs from windows of ``window`` bytes."""
    rows = torch.from_numpy(data[offsets[:, None] + np.arange(window)].astype(np.int64))
    inputs, targets = rows[:, :-1], rows[:, 1:]
    return Batch(inputs=inputs, targets=targets, tokens=targets.numel())


def tiled_windows(block_starts: list[int], block_bytes: int, n_bytes: int, window: int) -> np.ndarray:
    """Offsets of non-overlapping windows laid end to end inside each block."""
    offsets = [o for s in block_starts for o in range(s, min(s + block_bytes, n_bytes) - window + 1, window)]
    return np.array(offsets, dtype=np.int64)


def eval_offsets(block_starts: list[int], block_bytes: int, n_bytes: int, window: int, count: int) -> np.ndarray:
    """Offsets of ``count`` held-out windows spread evenly over the held-out blocks.

    Non-overlapping windows when there are at least ``count`` of them; otherwise windows
    at evenly strided start offsets (overlapping, still distinct); and when the blocks hold
    fewer than ``count`` distinct windows at all, every one of them (so a small corpus gets
    a smaller eval set rather than an error). Deterministic, and independent of batch size.
    """
    tiled = tiled_windows(block_starts, block_bytes, n_bytes, window)
    if len(tiled) >= count:
        return tiled[(np.arange(count) * len(tiled)) // count]
    index = WindowIndex(block_starts, block_bytes, n_bytes, window)
    if index.size == 0:
        return np.zeros(0, dtype=np.int64)
    if index.size < count:
        log.info("the held-out set holds only %d distinct windows; evaluating on all of them", index.size)
        count = index.size
    return index.offsets((np.arange(count) * index.size) // count)


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
        return gather(self._data, self._index.offsets(windows), self._window)

    def seek(self, position: int) -> None:
        """Resume at ``position`` batches into the stream."""
        if position < 0:
            raise DataError(f"cannot seek a data stream to position {position}; positions are >= 0")
        self.position = int(position)
