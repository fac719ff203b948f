"""A fragment's copies between the accelerator and host memory, off the training stream.

At a step boundary the learner copies the fragments the schedule needs to host memory (to
send them) and writes merged versions back into the model. A plain ``t.to("cpu")`` or
``v.to("cuda")`` from pageable memory makes the host wait until the GPU has finished every
kernel queued before it: the step loop stalls at each boundary. On CUDA this module instead:

- reads: takes a device snapshot of the fragment on the current (training) stream, which costs
  a device-to-device copy, then copies it to a pinned host buffer on a side stream; an event
  says when the host copy is complete. The training stream never waits for the host copy, and
  the caller waits (``wait``) only when it reads the host values;
- writes: copies the host values into a pinned staging buffer (a host memcpy), uploads them on
  the side stream, and makes the training stream wait for the upload on the GPU (an event), so
  the kernels that write the values into the model run after it without a host sync.

Pinned buffers come from a small pool and are reused, for any fragment: a buffer is free once
its last copy has finished and nothing outside this module holds a view of it (the session may
keep a read snapshot until the syncer asks for it). So the pinned memory held is about the
fragments in flight at once (one or two with the usual schedule), not the model. Any other
device (the CPU, and accelerators this module does not know) takes the plain copies, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64
"""Bytes: where each piece starts in an upload's staging buffer (any dtype can view it)."""

MAX_FREE = 4
"""Free pinned buffers kept for reuse; more are released."""


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
"""How many tensors share a storage (a private torch function): without it no buffer is known to
be free, and each copy gets new pinned memory (torch's pinned-memory cache still reuses it)."""


def _storage_users(t: torch.Tensor) -> int:
    """How many references ``t``'s storage has, ``t``'s own and the count's included."""
    return int(_USE_COUNT(t.untyped_storage()._cdata)) if _USE_COUNT is not None else 1 << 30


_ALONE = _storage_users(torch.empty(1))
"""The count of a tensor's storage that nothing else shares."""


@dataclass
class _Buffer:
    """Pinned host memory (flat bytes) and the event of the last copy that used it."""

    data: torch.Tensor
    done: Any = None

    def free(self) -> bool:
        return (self.done is None or bool(self.done.query())) and _storage_users(self.data) == _ALONE


class DeviceCopies:
    """Host copies of fragments read from, and device copies of values written to, ``device``."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pool: list[_Buffer] = []
        self._reads: dict[int, Any] = {}  # fragment -> the event of its last read's host copy
        self._side: Any = None  # the side stream, made on first use (this device's)

    # -- reads ---------------------------------------------------------------------------------

    def read(self, p: int, tensors: Sequence[torch.Tensor], wait: bool = True) -> list[torch.Tensor]:
        """Fragment ``p``'s pieces as fp32 host tensors of their own. ``tensors`` are the pieces
        on the device, as the model holds them now (the current stream's view of them).

        ``wait``: return only once the copy is complete. Without it the values may still be
        arriving: call ``wait(p)`` before reading them. On the CPU the copies are made at once."""
        if not self.cuda:
            return [t.to("cpu", torch.float32, copy=True) for t in tensors]
        numel = sum(t.numel() for t in tensors)
        held = self._take(numel * 4)
        buf = held.data[: numel * 4].view(torch.float32)
        current, side = torch.cuda.current_stream(self.device), self._side_stream()
        # A snapshot on the training stream (a device copy, in order with the step's kernels):
        # the training stream may go on and change the parameters while it goes to the host.
        snapshot = [t.detach().to(torch.float32, copy=True) for t in tensors]
        side.wait_stream(current)
        views, at = [], 0
        with torch.cuda.stream(side):
            for s in snapshot:
                view = buf[at : at + s.numel()].view(s.shape)
                view.copy_(s, non_blocking=True)
                s.record_stream(side)  # not reused by the allocator before the copy is done
                views.append(view)
                at += s.numel()
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        held.done = self._reads[p] = done
        if wait:
            self.wait([p])
        return views

    def wait(self, fragments: Iterable[int]) -> None:
        """Wait until the host copies of the last reads of ``fragments`` are complete."""
        for p in fragments:
            done = self._reads.pop(p, None)
            if done is not None:
                done.synchronize()

    def ready(self, p: int) -> bool:
        """Whether the last read of ``p`` is complete (without waiting)."""
        done = self._reads.get(p)
        return done is None or bool(done.query())

    # -- writes --------------------------------------------------------------------------------

    def upload(self, p: int, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host ``values`` of fragment ``p`` as tensors on the device, usable on the current stream
        at once: the stream waits for their upload on the GPU, the host does not. On the CPU the
        values themselves (no copy), as ``v.to(device)`` gives them."""
        if not self.cuda:
            return [v.to(self.device) for v in values]
        spans, nbytes = [], 0
        for v in values:  # each piece at a 64-byte boundary: any dtype can view its bytes
            spans.append((nbytes, v.numel() * v.element_size()))
            nbytes += -(-spans[-1][1] // ALIGN) * ALIGN
        held = self._take(nbytes)
        buf = held.data
        current, side = torch.cuda.current_stream(self.device), self._side_stream()
        out = []
        with torch.cuda.stream(side):
            for v, (at, n) in zip(values, spans):
                staged = buf[at : at + n].view(v.dtype).view(v.shape)
                staged.copy_(v)  # a host memcpy: the values may sit in pageable memory
                dev = self._device_empty(v)
                dev.copy_(staged, non_blocking=True)
                dev.record_stream(current)  # allocated on the side stream, used on the training one
                out.append(dev)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        held.done = done
        current.wait_event(done)  # on the GPU: the writes into the model follow the upload
        return out

    def _take(self, nbytes: int) -> _Buffer:
        """A free pinned buffer of at least ``nbytes`` (the smallest), or a new one. At most
        ``MAX_FREE`` free buffers stay in the pool."""
        if _USE_COUNT is None:
            return _Buffer(self._pinned(nbytes))
        free = [b for b in self.pool if b.free()]
        fits = [b for b in free if b.data.numel() >= nbytes]
        if fits:
            return min(fits, key=lambda b: b.data.numel())
        for b in sorted(free, key=lambda b: b.data.numel())[: max(0, len(free) + 1 - MAX_FREE)]:
            self.pool.remove(b)  # too small for this copy, and the pool is full: let it go
        held = _Buffer(self._pinned(nbytes))
        self.pool.append(held)
        return held

    # -- what touches the GPU itself (a test fakes these on the CPU) ------------------------------

    def _pinned(self, nbytes: int) -> torch.Tensor:
        """Flat page-locked host memory: the GPU copies it without staging, asynchronously."""
        return torch.empty(-(-nbytes // ALIGN) * ALIGN, dtype=torch.uint8, pin_memory=True)

    def _device_empty(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device=self.device)

    def _side_stream(self) -> Any:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        return self._side
