"""A ``Learner``'s check that the model is still the one it was made with.

Fragments are slices of the model's synced tensors (parameters and persistent buffers) as they
were when the ``Learner`` was made: a tensor replaced, reshaped, cast (``model.to(torch.bfloat16)``)
or moved to another device since would be synced wrongly, or not at all. ``ModelWatch.check``
runs at every ``step()``: for every synced tensor, that each module on its path is still its
parent's child and the tensor still its module's (dict lookups and identity tests), and that its
dtype, device and shape are unchanged. A tensor or module *added* since is only seen by walking
the whole module tree, which costs about 2 us per tensor: ``check(walk=True)``, every 16 steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddiloco.training.layout import synced_tensors

ADVICE = "make every model change (dtype, device, shapes, modules) before creating the Learner"


@dataclass(frozen=True)
class _Edge:
    """A module on some synced tensor's path: ``modules[key]`` must still be ``child``."""

    modules: dict[str, Any]
    key: str
    child: nn.Module
    path: str
    first: str
    """The first synced tensor under it (named in the message)."""


@dataclass(frozen=True)
class _Watched:
    name: str
    kind: str
    """"parameter" or "buffer"."""
    container: dict[str, Any]
    """Its module's ``_parameters`` or ``_buffers``."""
    attr: str
    tensor: torch.Tensor
    dtype: torch.dtype
    shape: torch.Size
    device: torch.device
    device_index: int
    """``tensor.get_device()`` (-1 on the CPU): a fifth of what reading ``tensor.device`` costs."""


def _show(shape: torch.Size) -> str:
    return str(tuple(shape))


class ModelWatch:
    """The synced tensors of ``model`` as they are now, and a cheap check that they still are."""

    def __init__(self, model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        self.model = model
        self.names = list(tensors)
        params = {id(p) for p in model.parameters()}
        edges: dict[tuple[int, str], _Edge] = {}
        self._tensors: list[_Watched] = []
        for name, t in tensors.items():
            path, _, attr = name.rpartition(".")
            module, prefix = model, ""
            for part in path.split(".") if path else []:
                child = module._modules[part]
                assert child is not None
                prefix = f"{prefix}.{part}" if prefix else part
                edges.setdefault((id(module), part), _Edge(module._modules, part, child, prefix, name))
                module = child
            kind = "parameter" if id(t) in params else "buffer"
            container = module._parameters if kind == "parameter" else module._buffers
            self._tensors.append(_Watched(name, kind, container, attr, t, t.dtype, t.shape, t.device, t.get_device()))
        self._edges = list(edges.values())
        self._kinds = {w.name: w.kind for w in self._tensors}
        # The per-step loop reads plain tuples (about 0.7 us per tensor in all, on a busy CPU).
        self._fast = [(w.container, w.attr, w.tensor, w.dtype, w.shape, w.device_index) for w in self._tensors]

    def check(self, walk: bool = False) -> str | None:
        """What changed since the watch was made, as one line, or None. ``walk``: also look for
        tensors added to the model (a walk of the whole module tree)."""
        for e in self._edges:
            if e.modules.get(e.key) is not e.child:
                return self._line(
                    f"module {e.path} is a new module ({self._kinds[e.first]} {e.first} and the rest of it are no "
                    "longer the model's)"
                )
        for container, attr, t, dtype, shape, device in self._fast:
            if container.get(attr) is not t or t.dtype is not dtype or t.get_device() != device or t.shape != shape:
                return self._tensor_changed(next(w for w in self._tensors if w.tensor is t))
        if walk:
            now_named = synced_tensors(self.model)
            added = next((n for n in now_named if n not in self._kinds), None)
            if added is not None:
                kind = "parameter" if added in dict(self.model.named_parameters()) else "buffer"
                return self._line(f"{kind} {added} is new")
        return None

    def _tensor_changed(self, w: _Watched) -> str:
        now = w.container.get(w.attr)
        if now is None:
            return self._line(f"{w.kind} {w.name} is gone")
        if now is not w.tensor:
            what = self._difference(w, now) or (
                f"is a new tensor (the same shape {_show(w.shape)} and dtype {w.dtype}: the Learner would sync the "
                "old one)"
            )
            return self._line(f"{w.kind} {w.name} {what}")
        return self._line(f"{w.kind} {w.name} {self._difference(w, w.tensor)}")

    @staticmethod
    def _difference(w: _Watched, t: torch.Tensor) -> str | None:
        if t.dtype is not w.dtype:
            return f"is {t.dtype}, was {w.dtype}"
        if t.device != w.device:
            return f"is on {t.device}, was on {w.device}"
        if t.shape != w.shape:
            return f"has shape {_show(t.shape)}, was {_show(w.shape)}"
        return None

    @staticmethod
    def _line(what: str) -> str:
        return f"the model changed after the Learner was made: {what}; {ADVICE}"
