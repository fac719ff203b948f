"""A ``Workload`` from a user's own model, loss function and batches, so the deterministic
simulator (and ``ddiloco learner``) can train it: ``ddiloco.workload_from(...)``.

Batches may be anything the loss function takes (a tensor, a tuple, a Hugging Face dict); they
travel inside ``Batch.inputs``. A stream is deterministic and seekable: batch i of the iterable
goes to shard ``i mod num_shards``, and ``seek(k)`` replays the shard from its start.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ddiloco.errors import UsageError
from ddiloco.workloads.base import Batch, embedding_parameters

ModelSource = nn.Module | Callable[[int], nn.Module]
BatchSource = Iterable[Any] | Callable[[int, int, int], Iterable[Any]]


def move_to(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor in it (nested in dicts, lists, tuples) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return type(obj)({k: move_to(v, device) for k, v in obj.items()})  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple
        return type(obj)(*(move_to(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to(v, device) for v in obj)
    return obj


def count_tokens(batch: Any) -> int:
    """The default token count of a batch: the elements of its first integer tensor (token ids),
    else the size of the first tensor's first dimension (examples)."""
    tensors = list(_tensors(batch))
    if not tensors:
        raise UsageError("cannot count the tokens of a batch without tensors; pass tokens=lambda batch: ...")
    ints = [t for t in tensors if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]
    return int(ints[0].numel()) if ints else int(tensors[0].shape[0] if tensors[0].dim() else 1)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


class _Stream:
    """One shard of the batches: deterministic and seekable."""

    def __init__(self, make: Callable[[], Iterable[Any]], tokens: Callable[[Any], int]) -> None:
        self._make, self._tokens = make, tokens
        self.position = 0
        self._it: Iterator[Any] = iter(make())

    def next_batch(self) -> Batch:
        try:
            raw = next(self._it)
        except StopIteration:  # an epoch ended: start the shard again
            self._it = iter(self._make())
            try:
                raw = next(self._it)
            except StopIteration:
                raise UsageError("a learner's shard of the batches is empty; give more batches than learners") from None
        self.position += 1
        return Batch(inputs=raw, targets=torch.empty(0), tokens=self._tokens(raw))

    def seek(self, position: int) -> None:
        self._it = iter(self._make())
        self.position = 0
        for _ in range(position):
            self.next_batch()


class CustomWorkload:
    """The ``Workload`` ``workload_from`` builds."""

    def __init__(
        self,
        model: ModelSource,
        loss: Callable[[nn.Module, Any], torch.Tensor],
        batches: BatchSource,
        eval_batches: Sequence[Any] | Callable[[], Sequence[Any]] = (),
        tokens: Callable[[Any], int] = count_tokens,
        embedding_like: Callable[[str], bool] | None = None,
        name: str = "custom",
    ) -> None:
        self.name = name
        self._model, self._loss, self._batches = model, loss, batches
        self._eval, self._tokens, self._emb = eval_batches, tokens, embedding_like

    def build_model(self, seed: int) -> nn.Module:
        if isinstance(self._model, nn.Module):
            return copy.deepcopy(self._model)  # the given initialisation, whatever the seed
        torch.manual_seed(seed)
        return self._model(seed)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self._loss(model, batch.inputs)

    def train_stream(self, shard: int, num_shards: int, seed: int) -> _Stream:
        source = self._batches
        if callable(source):
            make: Callable[[], Iterable[Any]] = lambda: source(shard, num_shards, seed)  # noqa: E731
        elif isinstance(source, Iterator):
            raise UsageError(
                "batches is a one-shot iterator, which cannot be replayed deterministically: pass a list, a "
                "re-iterable (a DataLoader) or a function (shard, num_shards, seed) -> iterable"
            )
        else:
            make = lambda: itertools.islice(source, shard, None, num_shards)  # noqa: E731
        return _Stream(make, self._tokens)

    def eval_batches(self) -> list[Batch]:
        raw = self._eval() if callable(self._eval) else self._eval
        return [Batch(inputs=b, targets=torch.empty(0), tokens=self._tokens(b)) for b in raw]

    def is_embedding_like(self, name: str) -> bool:
        if self._emb is None:
            self._emb = embedding_parameters(self.build_model(0))
        return self._emb(name)


def workload_from(
    model: ModelSource,
    loss: Callable[[nn.Module, Any], torch.Tensor],
    batches: BatchSource,
    *,
    eval_batches: Sequence[Any] | Callable[[], Sequence[Any]] = (),
    tokens: Callable[[Any], int] = count_tokens,
    embedding_like: Callable[[str], bool] | None = None,
    name: str = "custom",
) -> CustomWorkload:
    """A Workload for the simulator from your own pieces.

    Args:
        model: an ``nn.Module`` (every learner starts from a copy of it), or ``seed -> nn.Module``.
        loss: ``loss(model, batch) -> scalar tensor`` (mean loss of the batch, with grad).
        batches: a list or re-iterable of batches (batch i goes to shard i mod M), or a
            function ``(shard, num_shards, seed) -> iterable`` of that shard's batches.
        eval_batches: held-out batches for the evaluation of the global model.
        tokens: ``tokens(batch) -> int``, the unit of the token-weighted merge (default:
            ``count_tokens``).
        embedding_like: which parameters are merged by weighted mean (default: those of
            ``nn.Embedding`` modules).
        name: shown in reports.
    """
    if not (isinstance(model, nn.Module) or callable(model)):
        raise UsageError(f"model must be an nn.Module or a function seed -> nn.Module, not a {type(model).__name__}")
    if not callable(loss):
        raise UsageError(f"loss must be a function (model, batch) -> tensor, not a {type(loss).__name__}")
    if not (callable(batches) or isinstance(batches, Iterable)):
        raise UsageError(f"batches must be an iterable or a function, not a {type(batches).__name__}")
    return CustomWorkload(model, loss, batches, eval_batches, tokens, embedding_like, name)
