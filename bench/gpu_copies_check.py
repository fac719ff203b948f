"""GPU check of a fragment's host<->device copies (src/ddiloco/service/learner/device_copies.py).

Run on a machine with a CUDA GPU (about a minute; at most 5):

    python bench/gpu_copies_check.py            # prints a PASS/FAIL table; exit 1 on a FAIL

It needs only torch with CUDA (the module is loaded from its file, so neither the project's
pinned torch nor pyzmq is needed). The checks:

- no host wait: with a long kernel queued on the training stream, an upload (+ the write into
  the model) and a deferred read return long before the kernel ends;
- order: a deferred read sees the values as of the call (not later kernels), a write is seen by
  the next kernel on the training stream; values match a plain copy bit for bit;
- the step loop: an MLP trained with AdamW, one fragment (1/24 of the model) read and written at
  every step (a stress: the schedule reads one every H/P steps); the step time with the plain
  copies (``.to("cpu")`` / ``.to("cuda")``, the CPU path) and with this module, against none.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _module():  # the module alone, without the package (and its dependencies)
    spec = importlib.util.spec_from_file_location(
        "device_copies", ROOT / "src/ddiloco/service/learner/device_copies.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cycles_per_ms() -> float:
    """torch.cuda._sleep's cycles per millisecond on this GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def check_no_host_wait(dc, rows: list) -> None:
    copies = dc.DeviceCopies("cuda")
    per_ms = _cycles_per_ms()
    w = torch.randn(4096, 1024, device="cuda")
    host = [torch.randn(1024, 1024)]
    for _ in range(2):  # steady state: the pool holds the pinned buffers (their first allocation is slow)
        copies.upload(0, host)
        copies.read(1, [w[:2048], w[2048:]])
    # upload + write: the host returns while a 200 ms kernel runs
    torch.cuda.synchronize()
    torch.cuda._sleep(int(200 * per_ms))
    t0 = time.perf_counter()
    (dev,) = copies.upload(0, host)
    w[:1024].copy_(dev)
    dt = (time.perf_counter() - t0) * 1e3
    rows.append(("upload + write returns before a queued 200 ms kernel ends", dt < 100, f"{dt:.1f} ms on the host"))
    w[:1024].mul_(2.0)  # the next kernel sees the written values
    torch.cuda.synchronize()
    ok = torch.equal(w[:1024].cpu(), host[0] * 2.0)
    rows.append(("the next kernel sees the written values", ok, ""))
    # a deferred read: returns at once, sees the values as of the call
    torch.cuda._sleep(int(200 * per_ms))
    w.add_(1.0)  # queued before the read: seen
    t0 = time.perf_counter()
    got = copies.read(1, [w[:2048], w[2048:]], wait=False)
    dt = (time.perf_counter() - t0) * 1e3
    expect = w.clone()  # the values at the read's point of the stream
    w.add_(1.0)  # queued after the read: not seen
    rows.append(("a deferred read returns before a queued 200 ms kernel ends", dt < 100, f"{dt:.1f} ms on the host"))
    t0 = time.perf_counter()
    copies.wait([1])
    waited = (time.perf_counter() - t0) * 1e3
    ok = torch.equal(torch.cat(got), expect.cpu()) and got[0].is_pinned()
    rows.append(("the deferred read holds the values as of the call (pinned)", ok, f"waited {waited:.0f} ms for it"))
    # a waiting read of bf16 values equals the plain copy bit for bit
    b = torch.randn(333, 77, device="cuda", dtype=torch.bfloat16)
    (got_b,) = copies.read(2, [b])
    ok = torch.equal(got_b, b.to("cpu", torch.float32, copy=True))
    rows.append(("a read of bf16 values equals .to('cpu', float32)", ok, ""))
    held = copies.read(3, [w[:10]])
    before = len(copies.pool)
    for _ in range(5):
        copies.read(4, [w[:10]])
    rows.append(
        (
            "pinned buffers are reused (one held, one cycling)",
            len(copies.pool) <= before + 1,
            f"{len(copies.pool)} buffers",
        )
    )
    del held


def _step_loop(copies, mode: str, steps: int, model, opt, x, frag: list[torch.Tensor], stream_check: list) -> float:
    """Mean wall time per step of ``steps`` steps (after the queue drains), with the boundary of
    ``mode``: "none", "plain" (.to) or "module" (DeviceCopies)."""
    host_vals = [f.detach().cpu() for f in frag]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mode == "plain":
            sent = [f.detach().to("cpu", torch.float32, copy=True) for f in frag]
            with torch.no_grad():
                for f, v in zip(frag, host_vals):
                    f.copy_(v.to(f.device))
            stream_check.append(sent)
        elif mode == "module":
            sent = copies.read(0, frag, wait=False)
            with torch.no_grad():
                for f, v in zip(frag, copies.upload(0, host_vals)):
                    f.copy_(v)
            stream_check.append(sent)
            if i == steps - 1:
                copies.wait([0])
        del stream_check[:-2]
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def check_step_loop(dc, rows: list) -> None:
    torch.manual_seed(0)
    width, depth = 4096, 8
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(2048, width, device="cuda")
    frag = [model[0].weight[:1365], model[0].bias[:1365]]  # 5.6M of 134M parameters: one fragment at P = 24
    copies = dc.DeviceCopies("cuda")
    keep: list = []
    for mode in ("none", "plain", "module"):  # warm-up
        _step_loop(copies, mode, 3, model, opt, x, frag, keep)
    times = {}
    for _ in range(2):
        for mode in ("none", "plain", "module"):
            t = _step_loop(copies, mode, 20, model, opt, x, frag, keep)
            times[mode] = min(times.get(mode, t), t)
    base = times["none"]
    note = f"none {base:.1f} ms, plain {times['plain']:.1f} ms, module {times['module']:.1f} ms per step"
    rows.append(("step loop: the module's copies cost < 3% of a step", times["module"] < 1.03 * base, note))
    rows.append(
        ("step loop: the module is no slower than the plain copies", times["module"] <= times["plain"] * 1.01, "")
    )
    # the host copy of the last step matches the parameters at that step's boundary
    got = copies.read(0, frag)
    ok = all(torch.equal(g, f.detach().cpu()) for g, f in zip(got, frag))
    rows.append(("a read after the loop equals the parameters", ok, ""))


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    dc = _module()
    rows: list = []
    t0 = time.perf_counter()
    for check in (check_no_host_wait, check_step_loop):
        try:
            check(dc, rows)
        except Exception as e:  # a check that breaks is a FAIL, and the others still run
            rows.append((check.__name__, False, f"{type(e).__name__}: {e}"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.perf_counter() - t0:.0f} s")
    print(f"{'result':6}  {'check':62}  note")
    for name, ok, note in rows:
        print(f"{'PASS' if ok else 'FAIL':6}  {name:62}  {note}")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
