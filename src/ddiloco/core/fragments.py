"""Partition a model's named tensors into P fragments, and the staggered schedule.

A fragment is a list of *pieces*; a piece is a row range of one named tensor (usually the
whole tensor). Rows of large tensors are split only when P is large relative to the tensors,
so that bins stay balanced.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ddiloco.errors import ConfigError

TensorKind = Literal["param", "buffer", "count"]
"""What a synced tensor is: a parameter (merged by the outer optimizer), a floating buffer
(BatchNorm's running statistics) or an integer buffer (``num_batches_tracked``). Buffers are
merged by the token-weighted mean of the answers' values, with no outer step (``Round.close`` in ``core/round.py``)."""


@dataclass(frozen=True)
class TensorSpec:
    """Name and shape of one model tensor."""

    name: str
    """Parameter name as in ``model.named_parameters()``."""
    shape: tuple[int, ...]
    """Tensor shape."""
    kind: TensorKind = "param"
    """Parameter, floating buffer or integer buffer."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """Rows [row_start, row_end) of tensor ``name`` (the whole tensor for 0-d/1-row cases)."""

    name: str
    """Parameter name."""
    row_start: int
    """First row (along dim 0) in this piece."""
    row_end: int
    """One past the last row."""
    shape: tuple[int, ...]
    """Shape of the piece itself."""
    kind: TensorKind = "param"
    """Parameter, floating buffer or integer buffer (a buffer is always a whole tensor)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _described(pc: Piece) -> list[object]:
    # A parameter's entry is as it always was, so layouts without buffers keep their digests.
    entry: list[object] = [pc.name, pc.row_start, pc.row_end, list(pc.shape)]
    return entry if pc.kind == "param" else [*entry, pc.kind]


@dataclass(frozen=True)
class FragmentLayout:
    """The P fragments of a model: ``fragments[p]`` lists fragment p's pieces in order."""

    fragments: tuple[tuple[Piece, ...], ...]
    """Pieces of each fragment."""

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def sizes(self) -> list[int]:
        """Elements per fragment."""
        return [sum(pc.numel for pc in frag) for frag in self.fragments]

    def signature(self) -> list[tuple[str, int, int, tuple[int, ...], TensorKind]]:
        """A plain description to compare layouts (e.g. learner vs syncer)."""
        return [(pc.name, pc.row_start, pc.row_end, pc.shape, pc.kind) for frag in self.fragments for pc in frag]

    def digest(self) -> str:
        """A short hash of the signature and the fragment boundaries: equal digests, equal layouts."""
        text = json.dumps([[_described(pc) for pc in f] for f in self.fragments])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def kind_of(t: torch.Tensor, buffer: bool) -> TensorKind:
    """A parameter, or a buffer by its dtype: floating, or integer (and bool) counted."""
    if not buffer:
        return "param"
    return "buffer" if t.is_floating_point() else "count"


def specs_of(named: Iterable[tuple[str, torch.Tensor]], buffers: Iterable[str] = ()) -> list[TensorSpec]:
    """TensorSpecs of ``model.named_parameters()`` (or any name/tensor pairs); the names in
    ``buffers`` are the model's buffers."""
    kept = set(buffers)
    return [TensorSpec(name, tuple(t.shape), kind_of(t, name in kept)) for name, t in named]


def pack_sizes(sizes: Sequence[int], num_bins: int) -> list[list[int]]:
    """Greedy longest-processing-time bin packing: item indices per bin.

    Items are placed largest first into the currently lightest bin (ties: lowest bin index,
    then lowest item index), which bounds the heaviest bin by sum/P + (1-1/P)*largest and by
    (4/3 - 1/(3P)) times the optimum.
    """
    if num_bins < 1:
        raise ConfigError(f"num_fragments = {num_bins} is out of range; allowed: >= 1")
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    heap = [(0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in order:
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + sizes[i], b))
    return bins


def _whole(spec: TensorSpec) -> Piece:
    rows = spec.shape[0] if spec.shape else 1
    return Piece(spec.name, 0, rows, spec.shape, spec.kind)


def _halve(pc: Piece) -> list[Piece]:
    mid = pc.row_start + (pc.row_end - pc.row_start) // 2
    rest = pc.shape[1:]
    return [
        Piece(pc.name, pc.row_start, mid, (mid - pc.row_start, *rest)),
        Piece(pc.name, mid, pc.row_end, (pc.row_end - mid, *rest)),
    ]


def _pack(pieces: list[Piece], num_fragments: int) -> FragmentLayout:
    bins = pack_sizes([p.numel for p in pieces], num_fragments)
    # Keep model order inside a fragment so payloads are laid out predictably.
    return FragmentLayout(tuple(tuple(pieces[i] for i in sorted(b)) for b in bins))


def balanced_layout(specs: Sequence[TensorSpec], num_fragments: int, max_ratio: float = 1.25) -> FragmentLayout:
    """Balanced-tensor greedy packing of whole tensors; while the largest fragment exceeds
    ``max_ratio`` x the mean, the largest multi-row piece is halved by rows and the pieces are
    packed again, so tensors are split only as much as balance needs."""
    pieces = [_whole(s) for s in specs]
    layout = _pack(pieces, num_fragments)
    while imbalance(layout) > max_ratio:
        splittable = [
            i
            for i, pc in enumerate(pieces)
            if pc.row_end - pc.row_start > 1 and len(pc.shape) >= 1 and pc.kind == "param"
        ]
        if not splittable:
            break
        i = max(splittable, key=lambda j: (pieces[j].numel, -j))
        pieces[i : i + 1] = _halve(pieces[i])
        layout = _pack(pieces, num_fragments)
    return layout


_LAYER = re.compile(r"^(.*?\.\d+)\.")


def per_layer_layout(specs: Sequence[TensorSpec]) -> FragmentLayout:
    """One fragment per layer (names like ``blocks.3.*``); other tensors form their own groups."""
    groups: dict[str, list[Piece]] = {}
    for s in specs:
        m = _LAYER.match(s.name)
        key = m.group(1) if m else s.name.split(".")[0]
        groups.setdefault(key, []).append(_whole(s))
    return FragmentLayout(tuple(tuple(g) for g in groups.values()))


def strided_layout(specs: Sequence[TensorSpec], num_fragments: int) -> FragmentLayout:
    """Tensor i goes to fragment i mod P (the strided split of Streaming DiLoCo)."""
    bins: list[list[Piece]] = [[] for _ in range(num_fragments)]
    for i, s in enumerate(specs):
        bins[i % num_fragments].append(_whole(s))
    if any(not b for b in bins):
        raise ConfigError(
            f"num_fragments = {num_fragments} exceeds the model's {len(specs)} tensors for strided fragments; use "
            "fewer fragments or fragment_strategy = 'balanced'"
        )
    return FragmentLayout(tuple(tuple(b) for b in bins))


def imbalance(layout: FragmentLayout) -> float:
    """Largest fragment over the mean fragment size."""
    sizes = layout.sizes()
    return max(sizes) / (sum(sizes) / len(sizes))


def default_num_fragments(specs: Sequence[TensorSpec], sync_every: int, max_ratio: float = 1.25) -> int:
    """The largest P <= H (one fragment leaves per step at P = H) keeping the largest
    balanced fragment within ``max_ratio`` of the mean."""
    for p in range(min(sync_every, sum(s.numel for s in specs)), 0, -1):
        if imbalance(balanced_layout(specs, p)) <= max_ratio:
            return p
    return 1


def make_layout(
    specs: Sequence[TensorSpec], num_fragments: int | None, strategy: str, sync_every: int
) -> FragmentLayout:
    """Build the layout a config asks for (num_fragments = None picks the default P)."""
    if not specs:
        raise ConfigError("the model has no parameters to fragment; check the workload's build_model()")
    if strategy == "per_layer":
        return per_layer_layout(specs)
    p = num_fragments or default_num_fragments(specs, sync_every)
    if strategy == "strided":
        return strided_layout(specs, p)
    return balanced_layout(specs, p)


# -- extracting and writing fragment values --------------------------------------------------


def read_fragment(params: dict[str, torch.Tensor], pieces: Sequence[Piece]) -> list[torch.Tensor]:
    """Detached fp32 copies of a fragment's pieces from a name->tensor map (the wire's and the
    syncer's dtype: exact for fp32, bf16 and fp16 values and for integers below 2^24)."""
    out = []
    for pc in pieces:
        t = params[pc.name].detach()
        out.append((t[pc.row_start : pc.row_end] if t.dim() else t).to(torch.float32, copy=True))
    return out


def storage_bytes(tensors: Sequence[torch.Tensor] | None) -> int:
    """The memory ``tensors`` hold: each distinct storage once, whole (a view holds all of it)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors or ()}
    return sum(st.nbytes() for st in storages.values())


def take_fragment(params: dict[str, torch.Tensor], pieces: Sequence[Piece]) -> list[torch.Tensor]:
    """A fragment's pieces as fp32 views of the tensors (copies only where the dtype is not fp32):
    for a caller that owns the tensors and lets them go (``read_fragment`` copies)."""
    out = []
    for pc in pieces:
        t = params[pc.name].detach()
        out.append((t[pc.row_start : pc.row_end] if t.dim() else t).to(torch.float32))
    return out


def write_fragment(
    params: dict[str, torch.Tensor],
    pieces: Sequence[Piece],
    values: Sequence[torch.Tensor],
    alpha: float = 0.0,
    add: bool = False,
) -> None:
    """Write values into the tensors in place: overwrite (alpha = 0) or blend alpha*local + (1-alpha)*value.
    An integer buffer (a count) is never blended: it takes the value, rounded.

    ``add``: the parameters' values are changes to add (``core/overlap.py``); buffers and counts
    take theirs, and an empty value leaves its piece as it is."""
    with torch.no_grad():
        for pc, v in zip(pieces, values):
            t = params[pc.name]
            dst = t[pc.row_start : pc.row_end] if t.dim() else t
            if add and v.numel() == 0:
                continue
            if add and pc.kind == "param" and dst.is_floating_point():
                dst.add_(v.to(dst.dtype))
            elif not dst.is_floating_point():
                dst.copy_(v.round() if v.is_floating_point() else v)
            elif alpha == 0.0:
                dst.copy_(v)
            else:
                dst.mul_(alpha).add_(v.to(dst.dtype), alpha=1.0 - alpha)


def tensor_pieces(
    layout: FragmentLayout, values: Mapping[int, Sequence[torch.Tensor]]
) -> dict[str, list[tuple[Piece, torch.Tensor]]]:
    """Each tensor's pieces with their values (``values[p]``: one tensor per piece of fragment
    p), in row order: joined, they are the tensor."""
    parts: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
    for p, vals in sorted(values.items()):
        for pc, v in zip(layout.fragments[p], vals):
            parts.setdefault(pc.name, []).append((pc, v))
    for chunks in parts.values():
        chunks.sort(key=lambda x: x[0].row_start)
    return parts


def assemble(layout: FragmentLayout, values: Mapping[int, Sequence[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Named tensors from fragment values (``values[p]``: one tensor per piece of fragment p),
    row-split pieces joined back in row order; a tensor of one piece is a copy."""
    out = {}
    for name, chunks in tensor_pieces(layout, values).items():
        out[name] = chunks[0][1].clone() if len(chunks) == 1 else torch.cat([v for _, v in chunks])
    return out


# -- the staggered schedule -----------------------------------------------------------------


def tensor_rows(layout: FragmentLayout) -> dict[str, int]:
    """Rows (along dim 0) of each parameter of ``layout``: the furthest row any piece of it
    reaches (pieces of a split tensor may lie in any order across fragments)."""
    rows: dict[str, int] = {}
    for frag in layout.fragments:
        for pc in frag:
            if pc.kind == "param":
                rows[pc.name] = max(rows.get(pc.name, 0), pc.row_end)
    return rows


def fragment_offset(p: int, num_fragments: int, sync_every: int) -> int:
    """Step offset of fragment p within each period of H steps: floor(p*H/P)."""
    return (p * sync_every) // num_fragments


def due_fragments(step: int, num_fragments: int, sync_every: int) -> list[int]:
    """Fragments whose round opens at syncer step ``step`` (t mod H = floor(p*H/P))."""
    phase = step % sync_every
    return [p for p in range(num_fragments) if fragment_offset(p, num_fragments, sync_every) == phase]


def next_due(p: int, num_fragments: int, sync_every: int, count: int) -> list[int]:
    """The ``count`` fragments whose rounds open next after fragment p's, in schedule order.

    A learner that was just asked for p expects these requests next, so it can have their
    values ready at a step boundary instead of copying the whole model every step.
    """
    order = sorted(range(num_fragments), key=lambda q: (fragment_offset(q, num_fragments, sync_every), q))
    i = order.index(p)
    return [order[(i + k) % num_fragments] for k in range(1, min(count, num_fragments - 1) + 1)]
