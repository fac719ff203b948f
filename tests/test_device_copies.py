"""A fragment's host<->device copies (service/learner/device_copies.py): the CPU path is the plain copies,
unchanged; the CUDA path's logic (pinned buffers from a pool, the side stream, the events the
training stream waits for) runs here on a fake GPU made of CPU tensors and recorded calls.
bench/gpu_copies_check.py checks the real thing on a GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ddiloco.service.learner import device_copies
from ddiloco.service.learner.device_copies import ALIGN, MAX_FREE, DeviceCopies


def test_the_cpu_path_is_the_plain_copies():
    copies = DeviceCopies("cpu")
    w, b = torch.randn(6, 4), torch.arange(3, dtype=torch.int64)
    got = copies.read(0, [w[2:5], b])
    assert [g.dtype for g in got] == [torch.float32, torch.float32]
    assert torch.equal(got[0], w[2:5]) and torch.equal(got[1], b.float())
    assert got[0].untyped_storage().data_ptr() != w.untyped_storage().data_ptr()  # a copy of its own
    half = torch.randn(5, dtype=torch.bfloat16)
    assert torch.equal(copies.read(1, [half])[0], half.float())
    values = [torch.randn(3)]
    assert copies.upload(0, values)[0] is values[0]  # v.to("cpu"): no copy
    assert copies.pool == [] and copies.ready(0)
    copies.wait([0, 1])  # nothing to wait for


class _Event:
    def __init__(self, log):
        self.log, self.complete = log, False

    def record(self, stream):
        self.log.append(("record", stream.name, self))

    def query(self):
        return self.complete

    def synchronize(self):
        self.log.append(("synchronize", self))
        self.complete = True


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event))


class _FakeGpu(DeviceCopies):
    """DeviceCopies on a fake CUDA device: pinned memory and device tensors are CPU tensors."""

    def _pinned(self, nbytes):
        self.allocated = getattr(self, "allocated", 0) + 1
        return torch.empty(-(-nbytes // ALIGN) * ALIGN, dtype=torch.uint8)

    def _device_empty(self, like):
        return torch.empty(like.shape, dtype=like.dtype)


@pytest.fixture
def gpu(monkeypatch):
    log: list = []
    current = _Stream("current", log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream("side", log))
    monkeypatch.setattr(torch.cuda, "Event", lambda: _Event(log))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: log.append(("record_stream", s.name)))
    copies = _FakeGpu("cuda")
    assert copies.cuda
    return copies, log


def test_a_read_goes_to_pinned_memory_on_the_side_stream_after_the_training_stream(gpu):
    copies, log = gpu
    w, count = torch.randn(8, 3), torch.tensor(7, dtype=torch.int64)
    got = copies.read(2, [w[1:4], count], wait=False)
    assert torch.equal(got[0], w[1:4]) and got[1].item() == 7.0 and got[1].shape == ()
    assert ("wait_stream", "side", "current") in log  # the side stream starts where training is
    assert log.index(("wait_stream", "side", "current")) < [e[0] for e in log].index("record")
    assert ("record_stream", "side") in log  # the snapshot outlives its copy
    assert not copies.ready(2)
    copies.wait([2])
    assert copies.ready(2)
    then = w[1:4].clone()
    w.add_(1.0)  # training goes on: the host copy is a snapshot
    assert torch.equal(got[0], then)


def test_read_buffers_are_reused_only_when_nobody_holds_them(gpu):
    copies, _ = gpu
    t = torch.randn(1000)
    held = copies.read(0, [t])  # wait=True: complete on return
    assert copies.allocated == 1
    second = copies.read(1, [t])  # the first is still held (a snapshot the session keeps)
    assert copies.allocated == 2
    assert held[0].untyped_storage().data_ptr() != second[0].untyped_storage().data_ptr()
    ptr = held[0].untyped_storage().data_ptr()
    del held
    again = copies.read(0, [t[:500]])  # a smaller fragment fits the free buffer
    assert copies.allocated == 2 and again[0].untyped_storage().data_ptr() == ptr
    assert torch.equal(again[0], t[:500])


def test_a_buffer_whose_copy_is_in_flight_is_not_reused(gpu):
    copies, _ = gpu
    t = torch.randn(100)
    first = copies.read(0, [t], wait=False)
    del first  # dropped, but its copy has not been seen to finish
    copies.read(0, [t], wait=False)
    assert copies.allocated == 2


def test_the_pool_keeps_a_bounded_number_of_free_buffers(gpu):
    copies, _ = gpu
    for n in range(1, 3 * MAX_FREE):  # each larger than all before: no free buffer fits
        copies.read(0, [torch.randn(n * 64)])
    assert len(copies.pool) <= MAX_FREE


def test_an_upload_is_waited_for_on_the_gpu_not_on_the_host(gpu):
    copies, log = gpu
    values = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.tensor(2.5)]  # odd sizes, mixed dtypes
    got = copies.upload(4, values)
    assert all(torch.equal(g, v) and g.dtype == v.dtype for g, v in zip(got, values))
    assert all(g.untyped_storage().data_ptr() != v.untyped_storage().data_ptr() for g, v in zip(got, values))
    waits = [e for e in log if e[0] == "wait_event"]
    records = [e for e in log if e[0] == "record"]
    assert waits == [("wait_event", "current", records[-1][2])]  # training waits for the upload's event
    assert not any(e[0] == "synchronize" for e in log)  # the host never waited
    assert log.count(("record_stream", "current")) == 3
    # the staging buffer is reused once the upload is known complete, and only then
    copies.upload(4, values)
    assert copies.allocated == 2
    records[-1][2].complete = True
    before = copies.allocated
    copies.upload(5, values)
    assert copies.allocated == before


def test_without_torchs_use_count_every_copy_gets_new_pinned_memory(gpu, monkeypatch):
    copies, _ = gpu
    monkeypatch.setattr(device_copies, "_USE_COUNT", None)
    t = torch.randn(10)
    for _ in range(3):
        assert torch.equal(copies.read(0, [t])[0], t)
    assert copies.allocated == 3 and copies.pool == []
