"""Fragment merge throughput against an in-place add (issue 21, "a syncer that keeps up").

One fragment's whole round as the syncer does it, with the core's own functions: each of M
contributions is turned into its outer gradient (``make_delta`` against the anchor, or only
measured for a 'delta' payload) and added to the round's ``Accumulator``; then ``result`` and
the outer Nesterov step. Beside it, ``acc.add_(x)`` over the same M payloads: the bytes a merge
must at least read once. Throughput is the payload bytes (M x fragment) over the time.

    .venv/bin/python bench/scale_merge.py            # the table: 100M and 300M fragments at P = 24
    .venv/bin/python bench/scale_merge.py --quick    # the 100M fragment only
    .venv/bin/python bench/scale_merge.py --cpu-time # 1-thread cells by CPU time, on a busy machine
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from ddiloco.core.merge import Accumulator, make_delta
from ddiloco.core.outer import OuterNesterov

SIZES = {"100M/24": 100_000_000 // 24, "300M/24": 300_000_000 // 24}
"""One fragment of a 100M and of a 300M model cut into P = 24 fragments (elements)."""

KEEP = 4
"""Versions of a fragment the syncer keeps (``algo.keep_versions``' default)."""
MERGES = ("mean", "rda")
PAYLOADS = ("values", "delta")


def merge_throughput(
    numel: int,
    learners: int,
    threads: int,
    merge: str,
    payload: str = "values",
    repeats: int = 3,
    clock: str = "wall",
) -> dict:
    """Time one fragment's round (``learners`` contributions of ``numel`` fp32 elements, merged
    by ``merge`` = "mean" or "rda", then the outer step) against an in-place add of the same
    payloads, with ``threads`` intra-op threads; the best of ``repeats`` rounds after a warm-up.
    ``payload`` "values" measures each against an anchor, "delta" takes it as the outer gradient.

    Two merges are timed: as the syncer does it (each outer step allocates the new version; the
    syncer keeps 4), and "recycled", writing the new version into the one that left the history
    (``OuterNesterov.step(out=)``): the difference is the allocation's page faults.

    ``clock``: "wall" (perf_counter), or "cpu", this thread's CPU time (thread_time): on a busy
    machine it leaves out the time other processes took the core; with threads > 1 it misses
    the other threads' work, so it is refused there."""
    if merge not in MERGES or payload not in PAYLOADS:
        raise ValueError(f"merge must be one of {MERGES} and payload one of {PAYLOADS}, got {merge!r}, {payload!r}")
    if numel < 1 or learners < 1 or threads < 1 or repeats < 1:
        raise ValueError("numel, learners, threads and repeats must be positive")
    if clock not in ("wall", "cpu") or (clock == "cpu" and threads > 1):
        raise ValueError(f"clock must be 'wall', or 'cpu' with one thread; got {clock!r} with {threads} threads")
    now = time.perf_counter if clock == "wall" else time.thread_time
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        anchor = torch.randn(numel, generator=g)
        sent = [anchor + 0.01 * torch.randn(numel, generator=g) for _ in range(learners)]
        if payload == "delta":
            sent = [anchor - s for s in sent]
        work = [torch.empty_like(anchor) for _ in sent]  # the syncer merges what it is handed, in place
        scratch = torch.empty_like(anchor)
        outer = OuterNesterov(lr=0.7, momentum=0.9)
        outer.step([anchor], [anchor.clone()])  # the momentum buffer exists in a running syncer
        history: list[torch.Tensor] = []
        acc = torch.zeros(numel)

        def round_s(recycle: bool) -> float:
            for w, s in zip(work, sent):
                w.copy_(s)
            out = [history.pop(0)] if recycle and len(history) >= KEEP else None
            t0 = now()
            accumulator = Accumulator(scratch, rda=merge == "rda")
            for m, w in enumerate(work):
                norm = make_delta(anchor if payload == "values" else None, w)
                accumulator.add(w, norm, weight=1.0 + m)
            (new,) = (
                outer.step([anchor], [accumulator.result()], out=out)
                if out
                else outer.step([anchor], [accumulator.result()])
            )
            dt = now() - t0
            history.append(new)
            del history[:-KEEP]
            return dt

        def add_s() -> float:
            t0 = now()
            for s in sent:
                acc.add_(s)
            return now() - t0

        for _ in range(KEEP):  # fill the history, warm the allocator and the caches: not timed
            round_s(False)
        times: dict[str, list[float]] = {"merge": [], "recycled": [], "add": []}
        for _ in range(repeats):
            times["merge"].append(round_s(False))
            times["recycled"].append(round_s(True))
            times["add"].append(add_s())
        best = {k: min(v) for k, v in times.items()}
        gbs = {k: learners * numel * 4 / t / 1e9 for k, t in best.items()}
        return {
            "numel": numel,
            "learners": learners,
            "threads": threads,
            "merge": merge,
            "payload": payload,
            "clock": clock,
            "merge_s": best["merge"],
            "merge_recycled_s": best["recycled"],
            "add_s": best["add"],
            "merge_gb_per_s": gbs["merge"],
            "merge_recycled_gb_per_s": gbs["recycled"],
            "add_gb_per_s": gbs["add"],
            "merge_over_add": gbs["merge"] / gbs["add"],
            "recycled_over_add": gbs["recycled"] / gbs["add"],
        }
    finally:
        torch.set_num_threads(before)


def table(
    sizes: dict[str, int], learners: int, merges: tuple[str, ...], payloads: tuple[str, ...], cpu_time: bool = False
) -> list[dict]:
    """Every cell at 1 thread and at all cores, printed as it is measured (``cpu_time``: the
    1-thread cells on the CPU-time clock)."""
    rows = []
    all_cores = os.cpu_count() or 1
    head = ("fragment", "M", "merge", "payload", "thr", "clock", "merge GB/s", "add GB/s", "ratio", "recycled")
    print("{:>9} {:>3} {:>5} {:>7} {:>3} {:>5} {:>10} {:>8} {:>6} {:>8}".format(*head))
    for name, numel in sizes.items():
        for merge in merges:
            for payload in payloads:
                for threads in sorted({1, all_cores}):
                    clock = "cpu" if cpu_time and threads == 1 else "wall"
                    row = merge_throughput(numel, learners, threads, merge, payload, clock=clock)
                    row["fragment"] = name
                    rows.append(row)
                    print(
                        f"{name:>9} {learners:>3} {merge:>5} {payload:>7} {threads:>3} {clock:>5} "
                        f"{row['merge_gb_per_s']:>10.2f} {row['add_gb_per_s']:>8.2f} {row['merge_over_add']:>6.2f} "
                        f"{row['recycled_over_add']:>8.2f}",
                        flush=True,
                    )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=4, help="contributions per round (default 4)")
    ap.add_argument("--quick", action="store_true", help="the 100M fragment only")
    ap.add_argument("--merge", choices=MERGES, help="one merge only (default both)")
    ap.add_argument("--payload", choices=(*PAYLOADS, "both"), default="values", help="payload kind (default values)")
    ap.add_argument("--cpu-time", action="store_true", help="time 1-thread cells by CPU time (a busy machine)")
    args = ap.parse_args(argv)
    if args.learners < 1:
        ap.error("--learners must be at least 1")
    sizes = {"100M/24": SIZES["100M/24"]} if args.quick else SIZES
    merges = (args.merge,) if args.merge else MERGES
    payloads = PAYLOADS if args.payload == "both" else (args.payload,)
    table(sizes, args.learners, merges, payloads, args.cpu_time)
    return 0


if __name__ == "__main__":
    sys.exit(main())
