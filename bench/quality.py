"""Quality benchmark: Decoupled DiLoCo vs synchronous DiLoCo vs data-parallel, in a regime that
can answer the paper's claim (past the loss plateau, enough outer steps, a batch split that is
not itself a handicap), with both arms tuned alike and three seeds at the final settings.

    python bench/quality.py              # the benchmark (~1.5-2.5 h on 2 cores; resumes)
    python bench/quality.py --quick      # a few-minute smoke version (not a result)

Every run is cached in bench/cache/quality/ (one JSON per configuration, keyed by its settings,
CACHE_VERSION and the digest of the code that computed it), so an interrupted benchmark resumes
where it stopped, and a later session or machine that has the folder recomputes the report
without training again; a change to the simulator's code (see ``code_digest``) trains afresh
instead of mixing runs of two versions. Writes docs/results/quality.md and .json.

Protocol (see docs/quality.md for why):
1. The regime: a d = 64 byte-level GPT (~0.24M parameters), M = 4 learners at batch 8 x 64
   bytes, N = 4.1M tokens: ~17 tokens per parameter, 2,000 data-parallel steps, >= 80 outer
   steps per fragment at the largest H. The benchmark refuses a configuration that breaks
   these bounds.
2. Batch sanity check, printed first: one learner at batch 8 with M x the steps against DP at
   batch M x 8 (same tokens). Within ~3% means splitting the batch is not itself a handicap.
3. Sweeps on seed 0, coordinate-wise and bracketed (a best value at the edge of what was tried
   extends the search that way): DP's LR (steps of 2, then sqrt(2) either side of the best);
   for Decoupled DiLoCo and DiLoCo: H in {6, 12, 24}, then the inner LR (steps of 2, starting
   from DP's best), then the outer LR and then the outer momentum.
4. Three seeds at the final settings; each ratio to DP is paired by seed, with a 95% t-interval.
   Arms: the two methods, their merge ablations (RDA vs mean), chaos, heterogeneous learners
   with K = 1 (plain, staleness-scaled, with grace) and K = all, and M = 2, 8 (RDA and mean).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.cells import digest, files_digest  # noqa: E402  (bench/harness, beside this script)
from harness.paths import RESULTS, ROOT  # noqa: E402
from harness.tables import machine, utc_now  # noqa: E402
from harness.tables import publish as _publish  # noqa: E402

SRC = ROOT / "src" / "ddiloco"

CACHE_VERSION = 1
"""Bump when a change outside src/ddiloco makes cached runs stale (what run_one records); a
change to the code a simulated run executes is caught by ``code_digest``."""
CODE_ENTRIES = ("sim", "config", "methods")
"""Where a simulated run's code starts (``run_one`` imports ddiloco.sim.run, config, methods)."""

M = 4
BATCH, SEQ = 8, 64
MODEL = ["workload.d_model=64", "workload.n_layer=4", "workload.n_head=4"]
TOKENS = 2000 * M * BATCH * SEQ  # 2,000 DP steps of M x B sequences
COMMON = [*MODEL, f"workload.seq_len={SEQ}", f"workload.batch_size={BATCH}", "run.eval_points=16"]
H_GRID = (6, 12, 24)
LR_GRID = tuple(1e-3 * 2**k for k in range(-1, 6))  # 0.5e-3 .. 32e-3
OUTER_LR_GRID = (0.25, 0.35, 0.5, 0.7, 1.0, 1.4)
MOMENTUM_GRID = (0.0, 0.3, 0.6, 0.8, 0.9, 0.95)
START_LR = 8e-3
SEEDS = (0, 1, 2)
CHAOS = [
    "chaos.enabled=true",
    "chaos.downtime_fraction=0.1",
    "chaos.failures_per_learner=2",
    "chaos.restart_s=2.0",
    "run.budget=time",  # faults cost time, not tokens: the run gets the healthy fleet's time
]
HETERO = ["sim.speeds=[1.0, 1.0, 0.8, 0.8]", "sim.speed_noise=0.1"]
K1 = ["algo.quorum=1", "algo.grace=false"]  # rounds close on the first answer
T_975 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776}  # two-sided 95% t quantiles by sample size

MIN_TOKENS_PER_PARAM = 10.0
MIN_DP_STEPS = 2000
MIN_OUTER_STEPS = 80

Job = tuple[str, str, tuple[str, ...]]
"""(label, method, overrides)."""


# ----------------------------------------------------------------------------- the code


def _layer_files(src: Path, name: str) -> list[Path]:
    """The source files of one layer of ddiloco: a package (all of it), a top-level module, or
    ``""`` for the package's own __init__.py."""
    if not name:
        return [src / "__init__.py"]
    if (src / name).is_dir():
        return sorted(p for p in (src / name).rglob("*.py"))
    return [src / f"{name}.py"] if (src / f"{name}.py").is_file() else []


def _imported_layers(path: Path, src: Path) -> set[str]:
    """The layers of ddiloco that one file imports, lazy imports inside functions included."""
    parts = ["ddiloco", *path.relative_to(src).with_suffix("").parts]
    package = parts[:-1]  # for __init__.py the last part is "__init__": its package is the rest
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            mod = [*base, *(node.module.split(".") if node.module else [])]
            # ``from ddiloco import config`` names a layer in the imported name
            mods = [[*mod, a.name] for a in node.names] if mod == ["ddiloco"] else [mod]
        else:
            continue
        found.update(m[1] if len(m) > 1 else "" for m in mods if m[0] == "ddiloco")
    return found


def code_layers(src: Path = SRC) -> list[str]:
    """Every layer of ddiloco (package or top-level module) a simulated run can execute: those
    reachable from CODE_ENTRIES through any import, read from the source. Whole packages count,
    so a module loaded by name (the workload factory) is covered with its package."""
    seen, todo = {""}, list(CODE_ENTRIES)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for path in _layer_files(src, name):
            todo.extend(_imported_layers(path, src) - seen)
    return sorted(seen)


def code_digest(src: Path = SRC) -> str:
    """A hash of the source of every layer in ``code_layers`` (paths and contents, in sorted
    order): equal digests, equal code behind a simulated run's numbers."""
    return files_digest({p for name in code_layers(src) for p in _layer_files(src, name)}, src, 16)


# ----------------------------------------------------------------------------- running


def job_key(method: str, overrides: tuple[str, ...], code: str) -> str:
    return digest({"v": CACHE_VERSION, "method": method, "over": sorted(overrides), "code": code}, 16)


def run_one(job: Job) -> dict[str, Any]:
    """Run one configuration in this worker process and return its figures."""
    return simulate_job(job)[0]


def simulate_job(job: Job) -> tuple[dict[str, Any], Any]:
    """Run one configuration in this worker process: its figures, and the run's result (for a
    bench that reads more of it: the frontier's bytes)."""
    import torch

    torch.set_num_threads(1)
    from ddiloco.config import load_config
    from ddiloco.methods import PRESETS
    from ddiloco.sim.run import simulate

    label, method, overrides = job
    cfg = load_config(None, [*overrides, f"run.method={method}", "run.threads=1"], base=PRESETS[method])
    t0, c0 = time.perf_counter(), time.process_time()
    result = simulate(cfg)
    figures = {
        "label": label,
        "method": method,
        "overrides": list(overrides),
        "wall_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - c0,
        "evals": result.evals,
        **result.summary(),
    }
    return figures, result


class Runner:
    """Runs jobs on a process pool, each at most once: results are cached on disk by key, the
    key and the file both naming the code digest ``code`` they were computed with."""

    def __init__(self, cache: Path, workers: int, code: str) -> None:
        self.cache = cache
        self.code = code
        self.cache.mkdir(parents=True, exist_ok=True)
        self.pool = ProcessPoolExecutor(max_workers=workers)
        self.futures: dict[str, Future[dict[str, Any]]] = {}
        self.trained = 0
        self.used: dict[str, dict[str, Any]] = {}  # key -> result of every run this report uses

    def key(self, method: str, overrides: tuple[str, ...]) -> str:
        return job_key(method, overrides, self.code)

    def path(self, method: str, overrides: tuple[str, ...]) -> Path:
        return self.cache / f"{method}-{self.key(method, overrides)}.json"

    def cached(self, method: str, overrides: tuple[str, ...]) -> dict[str, Any] | None:
        p = self.path(method, overrides)
        if not p.exists():
            return None
        try:
            hit = json.loads(p.read_text())
        except (OSError, ValueError):
            return None  # a torn write: run it again
        # The key names the digest already; the file's own record is checked too, so a file
        # copied or renamed from another code version is never taken for this one.
        return hit if isinstance(hit, dict) and hit.get("code") == self.code else None

    def submit(self, job: Job) -> str:
        label, method, over = job
        key = self.key(method, over)
        if key not in self.futures and self.cached(method, over) is None:
            future = self.pool.submit(run_one, job)
            # Cached the moment it ends, whoever waits for it and when: a run submitted ahead of
            # the phase that reads it is not lost if the benchmark stops first.
            future.add_done_callback(lambda f, job=job: self._store(job, f))
            self.futures[key] = future
        return key

    def _store(self, job: Job, future: Future[dict[str, Any]]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        _, method, over = job
        p = self.path(method, over)
        # (per thread: the done-callback and the waiting main thread may store the same run at once)
        tmp = p.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({**future.result(), "code": self.code}, indent=1))
        os.replace(tmp, p)

    def ready(self, job: Job) -> bool:
        future = self.futures.get(self.key(job[1], job[2]))
        return future is None or future.done()

    def result(self, job: Job) -> dict[str, Any]:
        """Wait for a job's result (from the cache, or from its run, which is then cached)."""
        label, method, over = job
        key = self.key(method, over)
        future = self.futures.pop(key, None)
        if future is None:
            hit = self.cached(method, over)
            if hit is None:
                raise KeyError(f"{label}: neither cached nor submitted")
            self.used[key] = hit
            return hit
        res = {**future.result(), "code": self.code}
        self._store(job, future)  # (again: the callback may not have run yet)
        self.used[key] = res
        self.trained += 1
        print(
            f"  {label:<44} loss {res['eval_loss']:.4f}  goodput {res['goodput']:.1%}  "
            f"merged {res['merged_share']:.1%}  ({res['wall_s']:.0f} s)",
            flush=True,
        )
        return res

    def run(self, jobs: list[Job]) -> list[dict[str, Any]]:
        for j in jobs:
            self.submit(j)
        return [self.result(j) for j in jobs]


Stage = Generator[list[Job], list[dict[str, Any]], Any]
"""A sweep as a generator: it yields the jobs of its next stage and is sent their results."""


def run_concurrently(runner: Runner, chains: dict[str, Stage]) -> dict[str, Any]:
    """Drive several sweeps at once, so the pool always has every ready job of all of them."""
    pending: dict[str, list[Job]] = {}
    done: dict[str, Any] = {}
    for name, gen in chains.items():
        pending[name] = next(gen)
        for j in pending[name]:
            runner.submit(j)
    while pending:
        ready = [n for n, jobs in pending.items() if all(runner.ready(j) for j in jobs)]
        if not ready:  # wait for a run still going (a done one may belong to a chain still waiting)
            wait([f for f in runner.futures.values() if not f.done()], return_when=FIRST_COMPLETED)
            continue
        name = ready[0]
        jobs = pending.pop(name)
        results = [runner.result(j) for j in jobs]
        try:
            nxt = chains[name].send(results)
        except StopIteration as stop:
            done[name] = stop.value
            continue
        pending[name] = nxt
        for j in nxt:
            runner.submit(j)
    return done


# ----------------------------------------------------------------------------- sweeps


@dataclass
class Sweep:
    """What one coordinate-wise sweep tried and chose."""

    name: str
    best: dict[str, Any]
    """The chosen setting per coordinate (config values)."""
    tried: list[dict[str, Any]] = field(default_factory=list)
    """Every run: its coordinate, value, loss."""
    best_run: dict[str, Any] | None = None


def bracket(
    grid: tuple[float, ...], start: int, make: Callable[[float], Job], tried: list[dict[str, Any]], coord: str
) -> Stage:
    """Try grid[start] and its neighbours; while the best is at an edge of what was tried,
    try the next value that way. Returns (best value, its run)."""
    seen: dict[int, dict[str, Any]] = {}
    todo = [i for i in (start - 1, start, start + 1) if 0 <= i < len(grid)]
    while todo:
        results = yield [make(grid[i]) for i in todo]
        for i, r in zip(todo, results):
            seen[i] = r
            tried.append({"coord": coord, "value": grid[i], "loss": r["eval_loss"], "label": r["label"]})
        best = min(seen, key=lambda i: seen[i]["eval_loss"])
        lo, hi = min(seen), max(seen)
        todo = []
        if best == lo and lo > 0:
            todo = [lo - 1]
        elif best == hi and hi < len(grid) - 1:
            todo = [hi + 1]
    best = min(seen, key=lambda i: seen[i]["eval_loss"])
    return grid[best], seen[best]


def refine(values: tuple[float, ...], make: Callable[[float], Job], tried: list[dict[str, Any]], coord: str) -> Stage:
    """Try extra values once (e.g. sqrt(2) either side of a bracketed best)."""
    results = yield [make(v) for v in values]
    for v, r in zip(values, results):
        tried.append({"coord": coord, "value": v, "loss": r["eval_loss"], "label": r["label"]})
    return results


def lr_sweep(name: str, method: str, base: list[str], grid: tuple[float, ...], fine: bool) -> Stage:
    """The LR of a method without outer settings (data-parallel, or one learner)."""
    sweep = Sweep(name, {})
    make = lambda lr: (f"{name} lr {lr:.3g}", method, (*base, f"inner.lr={lr:.6g}", "run.seed=0"))
    best, run = yield from bracket(grid, grid.index(START_LR), make, sweep.tried, "inner.lr")
    if fine:
        extra = (best / math.sqrt(2), best * math.sqrt(2))
        runs = yield from refine(extra, make, sweep.tried, "inner.lr")
        for v, r in zip(extra, runs):
            if r["eval_loss"] < run["eval_loss"]:
                best, run = v, r
    sweep.best, sweep.best_run = {"inner.lr": best}, run
    return sweep


def method_sweep(name: str, method: str, base: list[str], start_lr: float, quick: bool) -> Stage:
    """H, then the inner LR, then the outer LR, then the outer momentum, each bracketed."""
    sweep = Sweep(name, {})
    s = {"algo.sync_every": 24, "inner.lr": start_lr, "algo.outer_lr": 0.7, "algo.outer_momentum": 0.9}

    def make(**change: float) -> Job:
        cur = {**s, **change}
        over = tuple(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in cur.items())
        what = ", ".join(f"{k.split('.')[-1]} {v:g}" for k, v in change.items())
        return (f"{name} {what or 'start'}", method, (*base, *over, "run.seed=0"))

    if quick:
        run = (yield [make()])[0]
        sweep.best, sweep.best_run = dict(s), run
        return sweep
    # H: every value of the grid (three points, each a different protocol).
    runs = yield [make(**{"algo.sync_every": h}) for h in H_GRID]
    for h, r in zip(H_GRID, runs):
        sweep.tried.append({"coord": "algo.sync_every", "value": h, "loss": r["eval_loss"], "label": r["label"]})
    h_best = min(zip(H_GRID, runs), key=lambda x: x[1]["eval_loss"])[0]
    s["algo.sync_every"] = h_best
    lrs = tuple(sorted(set(LR_GRID) | {start_lr}))
    s["inner.lr"], run = yield from bracket(
        lrs, lrs.index(start_lr), lambda v: make(**{"inner.lr": v}), sweep.tried, "inner.lr"
    )
    s["algo.outer_lr"], run = yield from bracket(
        OUTER_LR_GRID, OUTER_LR_GRID.index(0.7), lambda v: make(**{"algo.outer_lr": v}), sweep.tried, "algo.outer_lr"
    )
    s["algo.outer_momentum"], run = yield from bracket(
        MOMENTUM_GRID,
        MOMENTUM_GRID.index(0.9),
        lambda v: make(**{"algo.outer_momentum": v}),
        sweep.tried,
        "algo.outer_momentum",
    )
    sweep.best, sweep.best_run = dict(s), run
    return sweep


def overrides_of(best: dict[str, Any]) -> list[str]:
    return [f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in best.items()]


# ----------------------------------------------------------------------------- the regime


def regime(tokens: int, quick: bool) -> dict[str, Any]:
    """The regime's figures, and a refusal when it breaks the bounds that make it fair."""
    from ddiloco.config import load_config
    from ddiloco.workloads.config import load_workload

    cfg = load_config(None, COMMON)
    params = sum(p.numel() for p in load_workload(cfg.workload).build_model(0).parameters())
    dp_steps = tokens // (M * BATCH * SEQ)
    outer = dp_steps / max(H_GRID)
    fig = {
        "params": params,
        "tokens": tokens,
        "tokens_per_param": tokens / params,
        "dp_steps": dp_steps,
        "outer_steps_per_fragment_at_max_H": outer,
        "learners": M,
        "batch": f"{BATCH} x {SEQ} bytes per learner ({M * BATCH} x {SEQ} for DP)",
    }
    problems = []
    if fig["tokens_per_param"] < MIN_TOKENS_PER_PARAM:
        problems.append(f"{fig['tokens_per_param']:.1f} tokens per parameter (needs >= {MIN_TOKENS_PER_PARAM:g})")
    if dp_steps < MIN_DP_STEPS:
        problems.append(f"{dp_steps} DP steps (needs >= {MIN_DP_STEPS})")
    if outer < MIN_OUTER_STEPS:
        problems.append(f"{outer:.0f} outer steps per fragment at H = {max(H_GRID)} (needs >= {MIN_OUTER_STEPS})")
    fig["problems"] = problems
    if problems and not quick:
        raise SystemExit("quality.py: this regime cannot answer the question: " + "; ".join(problems))
    return fig


# ----------------------------------------------------------------------------- statistics


def ci95(xs: list[float]) -> tuple[float, float, float]:
    """Mean and a two-sided 95% t-interval (the mean twice for one value)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, m, m
    half = T_975.get(len(xs), 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - half, m + half


def loss_at(run: dict[str, Any], tokens: float) -> float:
    """A run's eval loss at a token count, linear between its evaluations."""
    pts = [(e["tokens"], e["loss"]) for e in run["evals"]]
    if tokens <= pts[0][0]:
        return pts[0][1]
    for (t0, l0), (t1, l1) in zip(pts, pts[1:]):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / max(t1 - t0, 1e-9)
    return pts[-1][1]


# ----------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="runs at once (one thread each)")
    ap.add_argument("--quick", action="store_true", help="a smoke version: 150k tokens, no sweep, one seed")
    ap.add_argument("--cache", default=str(ROOT / "bench" / "cache" / "quality"), help="folder of cached runs")
    ap.add_argument("--out", default=str(RESULTS), help="folder for quality.md/.json")
    ap.add_argument(
        "--verify",
        default="",
        metavar="ARMS",
        help="rerun these arms (comma-separated, dp among them) at the published report's settings with this "
        "code and compare, without sweeping: writes quality-verify.md/.json",
    )
    args = ap.parse_args()
    if args.verify and args.quick:
        ap.error("--verify compares with the full report's runs: drop --quick")
    tokens = 150_000 if args.quick else TOKENS
    seeds = (0,) if args.quick else SEEDS
    base = [*COMMON, f"run.num_learners={M}", f"run.processed_tokens={tokens}"]
    started = time.time()
    fig = regime(tokens, args.quick)
    print(
        f"regime: {fig['params']:,} parameters, {fig['tokens']:,} tokens ({fig['tokens_per_param']:.1f} per "
        f"parameter), {fig['dp_steps']} DP steps, {fig['outer_steps_per_fragment_at_max_H']:.0f} outer steps per "
        f"fragment at H = {max(H_GRID)}",
        flush=True,
    )
    code = code_digest()
    print(f"code: digest {code} of src/ddiloco/{{{','.join(n or '__init__' for n in code_layers())}}}", flush=True)
    runner = Runner(Path(args.cache) / ("quick" if args.quick else ""), args.workers, code)  # quick: not kept in git
    if args.verify:
        return verify(args, base, runner, started, code)

    # 1. DP's LR and the batch sanity check (one learner, batch B, M x the steps), side by side.
    single = [*COMMON, "run.num_learners=1", f"run.processed_tokens={tokens}"]
    first = run_concurrently(
        runner,
        {
            "dp": lr_sweep("dp", "dp", base, LR_GRID if not args.quick else (START_LR,), fine=not args.quick),
            "single": lr_sweep("single", "dp", single, LR_GRID if not args.quick else (START_LR,), fine=False),
        },
    )
    dp_sweep, single_sweep = first["dp"], first["single"]
    sanity = single_sweep.best_run["eval_loss"] / dp_sweep.best_run["eval_loss"]
    print(
        f"batch sanity check: one learner at batch {BATCH} with {M}x the steps reaches "
        f"{single_sweep.best_run['eval_loss']:.4f}, DP at batch {M * BATCH} {dp_sweep.best_run['eval_loss']:.4f}: "
        f"ratio {sanity:.4f} ({'within' if abs(sanity - 1) <= 0.03 else 'NOT within'} 3%)",
        flush=True,
    )

    # 2. Both DiLoCo methods, swept alike from DP's best LR.
    lr0 = dp_sweep.best["inner.lr"]
    start = min(LR_GRID, key=lambda v: abs(math.log(v / lr0)))  # the grid point nearest DP's best
    second = run_concurrently(
        runner,
        {m: method_sweep(m, m, base, start, args.quick) for m in ("decoupled", "diloco")},
    )
    best = {"dp": overrides_of(dp_sweep.best), **{m: overrides_of(second[m].best) for m in second}}

    # 3. Three seeds of every arm at the final settings.
    arms = final_arms(base, best)
    jobs = [(f"{arm} seed {s}", meth, (*over, f"run.seed={s}")) for arm, (meth, over) in arms.items() for s in seeds]
    print(f"final: {len(jobs)} runs ({len(arms)} arms x {len(seeds)} seeds; cached ones are not run again)", flush=True)
    by_arm = run_by_arm(runner, jobs, arms)

    report = summarise(by_arm, fig, sanity, single_sweep, [dp_sweep, second["decoupled"], second["diloco"]], best)
    report.update(invocation_facts(args, started, runner, code))
    report["settings"] = {"common": base, "chaos": CHAOS, "hetero": HETERO, "seeds": list(seeds)}
    publish(Path(args.out), "quality-quick" if args.quick else "quality", report, to_markdown(report))
    runner.pool.shutdown()
    return 0


def run_by_arm(runner: Runner, jobs: list[Job], arms: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
    """Run ``jobs`` (labelled "ARM seed S") and group their results by arm, in job order."""
    by_arm: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for (label, _, _), r in zip(jobs, runner.run(jobs)):
        by_arm[label.rsplit(" seed ", 1)[0]].append(r)
    return by_arm


def publish(out: Path, name: str, report: dict[str, Any], markdown: str) -> None:
    """Write ``name``.json and ``name``.md into ``out``, and print the markdown."""
    _publish(out, name, report, markdown, indent=1)


def final_arms(base: list[str], best: dict[str, list[str]]) -> dict[str, tuple[str, list[str]]]:
    """Every arm of the final stage: name -> (method, overrides), at the swept settings ``best``."""
    dec, dil = best["decoupled"], best["diloco"]
    arms: dict[str, tuple[str, list[str]]] = {
        "dp": ("dp", [*base, *best["dp"]]),
        "decoupled": ("decoupled", [*base, *dec]),
        "diloco": ("diloco", [*base, *dil]),
        "diloco (RDA)": ("diloco", [*base, *dil, "algo.merge=rda"]),
        "decoupled (mean)": ("decoupled", [*base, *dec, "algo.merge=mean"]),
        "decoupled chaos": ("decoupled", [*base, *dec, *CHAOS]),
        # The robust merge's cost to honest runs (issue 18): the same arms with it off.
        "decoupled (robust off)": ("decoupled", [*base, *dec, "algo.robust=false"]),
        "decoupled chaos (robust off)": ("decoupled", [*base, *dec, *CHAOS, "algo.robust=false"]),
        # The drift history's cost to honest runs (issue 34; off by default): with it on at the
        # limit the insider benchmark measured.
        "decoupled (drift 3)": ("decoupled", [*base, *dec, "algo.robust_drift_limit=3"]),
        "decoupled chaos (drift 3)": ("decoupled", [*base, *dec, *CHAOS, "algo.robust_drift_limit=3"]),
        "hetero K=1": ("decoupled", [*base, *dec, *HETERO, *K1]),
        "hetero K=1 scaled": ("decoupled", [*base, *dec, *HETERO, *K1, "algo.staleness=scaled"]),
        # Every answer becomes a version of its own: the kept versions must cover two ticks' worth.
        "hetero K=1 delayed": (
            "decoupled",
            [*base, *dec, *HETERO, *K1, "algo.staleness=delayed", "algo.keep_versions=8"],
        ),
        "hetero K=1+grace": ("decoupled", [*base, *dec, *HETERO, "algo.quorum=1", "algo.grace=true"]),
        "hetero K=all": ("decoupled", [*base, *dec, *HETERO, "algo.quorum=all", "algo.grace=false"]),
    }
    for m_count in (2, 8):
        other = [o for o in base if not o.startswith("run.num_learners")] + [f"run.num_learners={m_count}"]
        arms[f"M={m_count} decoupled"] = ("decoupled", [*other, *dec])
        arms[f"M={m_count} decoupled (mean)"] = ("decoupled", [*other, *dec, "algo.merge=mean"])
    return arms


def invocation_facts(args: argparse.Namespace, started: float, runner: Runner, code: str) -> dict[str, Any]:
    """What a report says about how it was made: command, date, machine, runs, code digest."""
    return {
        "command": "python bench/quality.py"
        + (" --quick" if args.quick else "")
        + (f" --verify '{args.verify}'" if args.verify else ""),
        "date": utc_now(),
        "machine": machine(python=True, workers=args.workers),
        "wall_s_this_invocation": time.time() - started,
        "runs_trained_this_invocation": runner.trained,
        "runs": len(runner.used),
        # every run of the report was computed by this code (the cache reuses no other)
        "code_digest": code,
        "code_layers": code_layers(),
        "cpu_s_all_runs": sum(r.get("cpu_s", 0.0) for r in runner.used.values()),
    }


def verify(args: argparse.Namespace, base: list[str], runner: Runner, started: float, code: str) -> int:
    """Rerun some arms of the published report at its final settings with this code, and compare.

    The full benchmark re-sweeps every setting; this asks the narrower question a code change
    raises first: at the settings the report chose, does the new code give the same figures?
    Writes quality-verify.md/.json beside the report; the report itself is left as it was."""
    out = Path(args.out)
    try:
        old = json.loads((out / "quality.json").read_text())
        best = {k: [str(o) for o in v] for k, v in old["best"].items()}
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        print(f"error: --verify needs the published report {out / 'quality.json'} with its 'best' settings ({e})")
        return 2
    arms = final_arms(base, best)
    wanted = [a.strip() for a in args.verify.split(",") if a.strip()]
    unknown = [a for a in wanted if a not in arms]
    if unknown or "dp" not in wanted:
        print(f"error: --verify takes arms of {sorted(arms)}, dp among them (ratios pair with DP); got {wanted}")
        return 2
    # Seed-major, so an interrupted verification has whole seeds of every arm first.
    jobs = [(f"{a} seed {s}", arms[a][0], (*arms[a][1], f"run.seed={s}")) for s in SEEDS for a in wanted]
    print(f"verify: {len(jobs)} runs ({len(wanted)} arms x {len(SEEDS)} seeds) at the report's settings", flush=True)
    by_arm = run_by_arm(runner, jobs, wanted)
    dp_by_seed = {seed_of(r): r for r in by_arm["dp"]}
    rows = []
    for a in wanted:
        new_runs, old_arm = by_arm[a], old["arms"].get(a, {})
        old_by_seed = {seed_of(r): r for r in old_arm.get("runs", [])}
        ratios = [r["eval_loss"] / dp_by_seed[seed_of(r)]["eval_loss"] for r in new_runs]
        mean, lo, hi = ci95(ratios)
        rows.append(
            {
                "arm": a,
                "old_eval_loss": old_arm.get("eval_loss"),
                "new_eval_loss": statistics.fmean(r["eval_loss"] for r in new_runs),
                "old_ratio": old_arm.get("ratio"),
                "old_ratio_ci95": old_arm.get("ratio_ci95"),
                "new_ratio": mean,
                "new_ratio_ci95": [lo, hi],
                "old_goodput": old_arm.get("goodput"),
                "new_goodput": statistics.fmean(r["goodput"] for r in new_runs),
                "old_tokens_processed": old_arm.get("tokens_processed"),
                "new_tokens_processed": statistics.fmean(r["tokens_processed"] for r in new_runs),
                "per_seed": [
                    {
                        "seed": seed_of(r),
                        "new": r["eval_loss"],
                        "old": old_by_seed.get(seed_of(r), {}).get("eval_loss"),
                    }
                    for r in new_runs
                ],
            }
        )
    rep = {
        **invocation_facts(args, started, runner, code),
        "old_report": {"date": old.get("date"), "code_digest": old.get("code_digest"), "best": best},
        "rows": rows,
    }
    publish(out, "quality-verify", rep, verify_markdown(rep))
    runner.pool.shutdown()
    return 0


def verify_markdown(rep: dict[str, Any]) -> str:
    def num(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    o = rep["old_report"]
    lines = [
        "# Quality benchmark, verified at the published settings",
        "",
        f"Command: `{rep['command']}` ({rep['date']}, {rep['machine']['cpus']} CPUs, {rep['machine']['workers']} runs "
        f"at once; {rep['runs_trained_this_invocation']} runs trained in {rep['wall_s_this_invocation'] / 60:.0f} "
        f"min). New code: digest `{rep['code_digest']}`. Old figures: [quality.md](quality.md) "
        f"({o['date']}, digest `{o['code_digest'] or 'unknown (before digests)'}`), at its final settings "
        f"{json.dumps(o['best'])}, which this rerun keeps (no new sweep).",
        "",
        "| arm | eval loss old | eval loss new | L / L_dp old [95% CI] | L / L_dp new [95% CI] | goodput old | "
        "goodput new | tokens processed old | new |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["rows"]:
        oc, nc = r["old_ratio_ci95"] or [None, None], r["new_ratio_ci95"]
        lines.append(
            f"| {r['arm']} | {num(r['old_eval_loss'], '.4f')} | {r['new_eval_loss']:.4f} | "
            f"{num(r['old_ratio'], '.4f')} [{num(oc[0], '.4f')}, {num(oc[1], '.4f')}] | "
            f"{r['new_ratio']:.4f} [{nc[0]:.4f}, {nc[1]:.4f}] | {num(r['old_goodput'], '.1%')} | "
            f"{r['new_goodput']:.1%} | {num(r['old_tokens_processed'], ',.0f')} | "
            f"{r['new_tokens_processed']:,.0f} |"
        )
    lines += ["", "Per seed (eval loss, old -> new):", ""]
    for r in rep["rows"]:
        seeds = ", ".join(f"{p['seed']}: {num(p['old'], '.4f')} -> {p['new']:.4f}" for p in r["per_seed"])
        lines.append(f"- {r['arm']}: {seeds}")
    return "\n".join(lines) + "\n"


def seed_of(run: dict[str, Any]) -> str:
    return next(o for o in reversed(run["overrides"]) if o.startswith("run.seed="))


def summarise(
    by_arm: dict[str, list[dict[str, Any]]],
    fig: dict[str, Any],
    sanity: float,
    single: Sweep,
    sweeps: list[Sweep],
    best: dict[str, list[str]],
) -> dict[str, Any]:
    dp_by_seed = {seed_of(r): r for r in by_arm["dp"]}
    arms: dict[str, Any] = {}
    for arm, runs in by_arm.items():
        ratios, at_tokens = [], []
        for r in runs:
            dp = dp_by_seed[seed_of(r)]
            ratios.append(r["eval_loss"] / dp["eval_loss"])
            at_tokens.append(r["eval_loss"] / loss_at(dp, r["tokens_processed"]))
        mean, lo, hi = ci95(ratios)
        mean_t, lo_t, hi_t = ci95(at_tokens)
        losses = [r["eval_loss"] for r in runs]
        arms[arm] = {
            "eval_loss": statistics.fmean(losses),
            "eval_loss_sd": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "ratio": mean,
            "ratio_ci95": [lo, hi],
            "ratio_at_tokens": mean_t,
            "ratio_at_tokens_ci95": [lo_t, hi_t],
            "seeds": len(runs),
            "goodput": statistics.fmean(r["goodput"] for r in runs),
            "tokens_processed": statistics.fmean(r["tokens_processed"] for r in runs),
            "tokens_merged": statistics.fmean(r["tokens_merged"] for r in runs),
            "learners_per_merge": statistics.fmean(r["learners_per_merge"] for r in runs),
            "grace_admissions": statistics.fmean(r["grace_admissions"] for r in runs),
            "runs": [{k: v for k, v in r.items() if k != "config"} for r in runs],
        }
    checks = []

    def check(what: str, value: float, limit: float, met: bool, note: str = "") -> None:
        checks.append({"what": what, "value": value, "limit": limit, "met": met, "note": note})

    for arm, aim in (("decoupled", "Decoupled DiLoCo (healthy)"), ("diloco", "synchronous DiLoCo")):
        a = arms[arm]
        check(
            f"{aim}: upper 95% bound of L / L_dp <= 1.05 (aim: mean <= 1.03)",
            a["ratio_ci95"][1],
            1.05,
            a["ratio_ci95"][1] <= 1.05,
            f"mean {a['ratio']:.4f} vs the 1.03 aim: {'met' if a['ratio'] <= 1.03 else 'missed'}",
        )
    ch = arms["decoupled chaos"]
    check(
        "Decoupled under chaos: L <= 1.05 x L_dp at its token count (upper 95% bound)",
        ch["ratio_at_tokens_ci95"][1],
        1.05,
        ch["ratio_at_tokens_ci95"][1] <= 1.05,
        f"mean {ch['ratio_at_tokens']:.4f}",
    )
    check("Decoupled under chaos: goodput >= 0.86", ch["goodput"], 0.86, ch["goodput"] >= 0.86)
    k_all = arms["hetero K=all"]
    for arm in ("hetero K=1 delayed", "hetero K=1 scaled"):
        rel = arms[arm]["eval_loss"] / k_all["eval_loss"]
        fix = "delayed Nesterov" if "delayed" in arm else "1/(1+s) scaling"
        check(f"hetero K=1, no grace, with {fix}: within 5% of K=all", rel, 1.05, rel <= 1.05)
    rel = arms["hetero K=1+grace"]["eval_loss"] / k_all["eval_loss"]
    check("hetero K=1 with the grace window (the paper's answer): within 5% of K=all", rel, 1.05, rel <= 1.05)
    return {
        "regime": fig,
        "batch_sanity": {
            "ratio": sanity,
            "single_loss": single.best_run["eval_loss"] if single.best_run else None,
            "single_lr": single.best.get("inner.lr"),
            "within_3pct": abs(sanity - 1) <= 0.03,
        },
        "L_dp": arms["dp"]["eval_loss"],
        "best": best,
        "sweeps": [{"name": s.name, "best": s.best, "tried": s.tried} for s in [single, *sweeps]],
        "arms": arms,
        "checks": checks,
    }


def _fmt_ci(a: dict[str, Any], key: str = "ratio") -> str:
    lo, hi = a[f"{key}_ci95"]
    return f"{a[key]:.4f} [{lo:.4f}, {hi:.4f}]"


def to_markdown(rep: dict[str, Any]) -> str:
    f, a, bs = rep["regime"], rep["arms"], rep["batch_sanity"]
    lines = [
        "# Quality benchmark: Decoupled DiLoCo vs DiLoCo vs data-parallel",
        "",
        f"Command: `{rep['command']}` ({rep['date']}, {rep['machine']['cpus']} CPUs, {rep['machine']['workers']} runs "
        f"at once). Every run is cached in `bench/cache/quality/`; this invocation trained "
        f"{rep['runs_trained_this_invocation']} runs in {rep['wall_s_this_invocation'] / 60:.0f} min; the report's "
        f"{rep['runs']} runs took {rep['cpu_s_all_runs'] / 3600:.2f} CPU-hours in all, every one by the code of "
        f"digest `{rep.get('code_digest', 'unknown (before digests)')}` (`bench/quality.py: code_digest`). "
        "Deterministic virtual time; why this regime and protocol: [docs/quality.md](../quality.md).",
        "",
        "## Regime",
        "",
        "| parameters | tokens | tokens / parameter | DP steps | outer steps per fragment (H = 24) | batch |",
        "|---|---|---|---|---|---|",
        f"| {f['params']:,} | {f['tokens']:,} | {f['tokens_per_param']:.1f} | {f['dp_steps']:,} | "
        f"{f['outer_steps_per_fragment_at_max_H']:.0f} | {f['batch']} |",
        "",
        f"**Batch sanity check:** one learner at batch 8 with {f['learners']}x the steps (its own best LR, "
        f"{bs['single_lr']:.3g}) reaches {bs['single_loss']:.4f}, **{bs['ratio']:.4f} x** DP's loss at batch "
        f"{f['learners'] * 8}: {'within' if bs['within_3pct'] else 'not within'} 3%.",
        "",
        f"Final settings (seed-0 sweeps below): {json.dumps(rep['best'])}. L_dp = **{rep['L_dp']:.4f}** nats/byte "
        "(3-seed mean).",
        "",
        "## Results (3 seeds; ratios paired by seed, 95% t-interval)",
        "",
        "| arm | eval loss (mean ± sd) | L / L_dp [95% CI] | L / L_dp at its tokens [95% CI] | goodput | tokens "
        "processed | tokens merged | learners / merge | grace admissions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, s in a.items():
        lines.append(
            f"| {arm} | {s['eval_loss']:.4f} ± {s['eval_loss_sd']:.4f} | {_fmt_ci(s)} | "
            f"{_fmt_ci(s, 'ratio_at_tokens')} | {s['goodput']:.1%} | {s['tokens_processed']:,.0f} | "
            f"{s['tokens_merged']:,.0f} | {s['learners_per_merge']:.2f} | {s['grace_admissions']:.0f} |"
        )
    lines += [
        "",
        "Learners / merge: runs cached before 2026-11-30 18:00 UTC counted every answer of a merge, weight-0 "
        "ones too; since then only entries with weight > 0 count (docs/operations.md#terms). The cache keeps "
        "no tapes, so those figures stay as they were measured.",
    ]
    lines += ["", "## Targets", "", "| target | measured | limit | met | note |", "|---|---|---|---|---|"]
    for c in rep["checks"]:
        lines.append(
            f"| {c['what']} | {c['value']:.4f} | {c['limit']:.4f} | {'yes' if c['met'] else '**no**'} | {c['note']} |"
        )
    lines += ["", "## Scaling with M (equal total tokens; ratio to the M = 4 DP reference)", ""]
    lines += ["| M | RDA: L / L_dp | mean: L / L_dp | RDA / mean |", "|---|---|---|---|"]
    for m_count, rda, mean in (
        (2, "M=2 decoupled", "M=2 decoupled (mean)"),
        (4, "decoupled", "decoupled (mean)"),
        (8, "M=8 decoupled", "M=8 decoupled (mean)"),
    ):
        if rda in a and mean in a:
            lines.append(
                f"| {m_count} | {_fmt_ci(a[rda])} | {_fmt_ci(a[mean])} | "
                f"{a[rda]['eval_loss'] / a[mean]['eval_loss']:.4f} |"
            )
    for s in rep["sweeps"]:
        lines += ["", f"## Sweep: {s['name']} (seed 0)", "", f"Chosen: `{json.dumps(s['best'])}`", ""]
        lines += ["| coordinate | value | eval loss |", "|---|---|---|"]
        for t in s["tried"]:
            lines.append(f"| {t['coord']} | {t['value']:g} | {t['loss']:.4f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
