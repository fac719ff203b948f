"""Runtime benchmark: the real processes over ZeroMQ on this machine (loopback).

    python bench/runtime.py                     # everything (~17 min; run nothing else meanwhile)
    python bench/runtime.py --quick             # shortened phases (a smoke test, not a result)
    python bench/runtime.py --pairs 3           # steps/s with syncing off and on: 3 paired runs (~10 min)
    python bench/runtime.py --pairs 2 --quick   # the paired mode's smoke test (~1.5 min; not a result)

Model and data of the quality benchmark (byte-level GPT, Shakespeare), 2 learners at one
thread each unless a row says otherwise. Writes docs/results/runtime.md and .json.

The paired mode (issue 31: one on/off ratio is noise on a shared machine; two runs of the same
code gave 1.20 and 0.898). Each pair is a phase with syncing off (2 standalone learners) and
then a phase with syncing on (a syncer + 2 learners), so the phases alternate off, on, off,
on ... and drift in the machine's load falls on both arms alike. Every phase is the same: fresh
processes in a fresh run folder, a wait until each learner has made 5 steps (start-up, at most
120 s), a warm-up of ``PAIR_WARMUP_S`` = 10 s, then ``PAIR_PHASE_S`` = 60 s measured, then the
processes stopped. Per pair: each learner's steps/s off and on and the on/off ratio (the mean of
the learners' ratios, as the main benchmark's row); over the pairs: the ratio's mean, min, max and
standard deviation. A phase takes about 90 s of wall time (start-up ~15 s on 2 cores, 10 s warm-up,
60 s measured, the stop), so 3 pairs take about 9-10 minutes, of which 6 minutes are measured.
``--quick`` shortens every phase to a 2 s warm-up and 6 s measured (2 pairs: about 1.5 minutes).
Writes docs/results/runtime_pairs.md and .json (``--quick``: runtime_pairs-quick).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.cluster import Cluster, wait_until  # noqa: E402  (bench/harness, beside this script)
from harness.files import step_logs  # noqa: E402
from harness.paths import ENV, RESULTS, sets  # noqa: E402
from harness.sampling import quantile_rank, rate, spread  # noqa: E402
from harness.tables import facts, met, publish, table  # noqa: E402

log = logging.getLogger("bench.runtime")

GPT = sets(
    [
        "runtime.step_log=true",
        "runtime.status_interval_s=0.5",
        "run.num_learners=2",
        "run.processed_tokens=100000000",
        "runtime.duration_s=86400",  # the benchmark decides each phase's length (the chaos run sets its own)
    ]
)
PAIR_PHASE_S = 60.0
"""Seconds measured in each phase of a pair."""
PAIR_WARMUP_S = 10.0
"""Seconds every phase runs, after each learner's 5th step, before its measured window."""
QUICK_PHASE_S, QUICK_WARMUP_S = 6.0, 2.0
"""The same for ``--pairs N --quick`` (a smoke test of the code, not a result)."""
LEARNERS = (0, 1)


def steps_per_s(c: Cluster, m: int, t0: float, t1: float) -> float:
    return rate([t for t, _ in c.steps(m)], t0, t1)


def p99(xs: list[float]) -> float:
    return quantile_rank(xs, 0.99)


def phase(run_dir: Path, sync: bool, phase_s: float, warmup_s: float = 0.0) -> tuple[Cluster, list[float]]:
    """One measured phase: 2 learners (standalone, or with a syncer started first), the wait for
    5 steps each, ``warmup_s``, then each learner's steps/s over ``phase_s``. The cluster is left
    running (the caller goes on with it, or stops it)."""
    c = Cluster(run_dir, GPT)
    c.run_dir.mkdir(parents=True)
    if sync:
        c.syncer()
        wait_until(lambda: c.status("syncer-0"), 120)
    for m in LEARNERS:
        c.learner(m, standalone=not sync)
    wait_until(lambda: all(c.status(f"learner-{m}").get("steps", 0) > 5 for m in LEARNERS), 120)
    time.sleep(warmup_s)
    t0 = time.time()
    time.sleep(phase_s)
    return c, [steps_per_s(c, m, t0, time.time()) for m in LEARNERS]


def on_off_ratio(on: list[float], off: list[float]) -> float:
    """The mean of the learners' on/off steps/s ratios (NaN when a learner made no step off)."""
    return statistics.fmean(a / b if b else math.nan for a, b in zip(on, off))


def throughput_and_faults(work: Path, phase_s: float, pre_kill_s: float) -> dict:
    """Rows 1-3 and 7: steps/s with syncing on vs off; survivor stall after a SIGKILL;
    restart to first merged contribution; syncer restart to resumed merges."""
    out: dict = {}
    off, off_rates = phase(work / "off", sync=False, phase_s=phase_s)  # two standalone learners
    off.stop()
    on, on_rates = phase(work / "on", sync=True, phase_s=phase_s)  # syncer + two learners, the same window
    out["steps_per_s_sync_off"] = off_rates
    out["steps_per_s_sync_on"] = on_rates
    out["throughput_ratio"] = on_off_ratio(on_rates, off_rates)
    syncer = on.status("syncer-0")
    out["syncer_cpu_share"] = syncer["cpu_s"] / syncer["wall_s"]
    out["sync_cost"] = sync_cost(on.run_dir)
    # survivor stall: previous minute's p99 vs the longest step in the 5 s after a SIGKILL
    time.sleep(max(0.0, pre_kill_s - phase_s))
    killed_at = time.time()
    on.kill("learner-1")
    before = [d for t, d in on.steps(0) if killed_at - 60 <= t < killed_at]
    time.sleep(5.0)  # the restart is delayed 5 s
    after = [d for t, d in on.steps(0) if killed_at <= t < killed_at + 5]
    out["survivor_p99_prev_min_s"] = p99(before)
    out["survivor_longest_after_kill_s"] = max(after) if after else float("nan")
    out["survivor_steps_in_5s_after_kill"] = len(after)
    # restarted learner: process start -> first merged contribution
    on.learner(1)
    spawn = on.spawned["learner-1"][-1]

    def first_merge() -> float | None:
        from ddiloco.core.tape import RoundRecord, parse_tape_record

        for r in on.tape():
            rd = parse_tape_record(r)
            if not isinstance(rd, RoundRecord):
                continue
            closed = rd.closed_at + r.get("wall_offset", 0.0)  # the tape's clock is monotonic
            if any(m.learner == 1 and m.was_merged for m in rd.merged) and closed > spawn:
                return closed
        return None

    wait_until(lambda: first_merge() is not None, 120)
    fm = first_merge()
    out["restart_to_first_merge_s"] = (fm - spawn) if fm else float("nan")
    first_step = on.status("learner-1").get("first_step_at")
    out["restart_to_first_step_s"] = (first_step - spawn) if first_step else float("nan")
    # syncer restart: SIGKILL, start again at once, time until merges resume
    time.sleep(5.0)
    on.kill("syncer")
    on.syncer()
    spawn = on.spawned["syncer"][-1]

    def resumed() -> float | None:
        for r in on.tape():
            closed = r.get("closed_at", 0.0) + r.get("wall_offset", 0.0)
            if r.get("event") == "round" and closed > spawn and r["merged"] and r["version"] > 0:
                return closed
        return None

    wait_until(lambda: resumed() is not None, 120)
    rs = resumed()
    out["syncer_restart_to_merges_s"] = (rs - spawn) if rs else float("nan")
    on.stop()
    return out


def chaos_goodput(work: Path, duration_s: float, mtbf_s: float) -> dict:
    """Row 4: goodput under Poisson SIGKILLs of every learner (restarted at once)."""
    from ddiloco.config import load_config
    from ddiloco.service.ops.launcher import Launcher

    overrides = [a for a in GPT if a != "--set"] + [
        "chaos.enabled=true",
        f"chaos.kill_mtbf_s={mtbf_s}",
        f"runtime.duration_s={duration_s}",
        "runtime.eval_interval_s=60",
        "run.method=decoupled",
    ]
    cfg = load_config(None, overrides)
    launcher = Launcher(cfg, work / "chaos")
    summary = launcher.run()
    kills = [f for f in launcher.faults if f["kind"] == "sigkill"]
    restart = statistics.fmean(summary["restart_latencies_s"]) if summary["restart_latencies_s"] else float("nan")
    steps = step_logs(work / "chaos")
    step_s = statistics.fmean([d for m in range(2) for _, d, _ in steps.get(m, [])] or [float("nan")])
    H = cfg.algo.sync_every
    T = summary["run_time_s"] * cfg.run.num_learners
    target = 1 - len(kills) * (restart + H / 2 * step_s) / T - 0.02
    return {
        "duration_s": summary["run_time_s"],
        "kills": len(kills),
        "mean_restart_s": restart,
        "mean_step_s": step_s,
        "goodput": summary["goodput"],
        "down": summary["down"],
        "restarting": summary["restarting"],
        "target": target,
        "eval_loss": summary["eval_loss"],
        "tokens_processed": summary["tokens_processed"],
        "tokens_merged": summary["tokens_merged"],
        "learners_per_merge": summary["learners_per_merge"],
        "faults": [{"t": f["time"], "kind": f["kind"], "target": f["target"]} for f in launcher.faults],
    }


def sleep_fleet(work: Path, duration_s: float) -> dict:
    """Row 5: 4 learners with a sleep-based synthetic step: merges/s and syncer CPU share."""
    from ddiloco.config import load_config
    from ddiloco.service.ops.launcher import Launcher

    cfg = load_config(
        None,
        [
            "workload.factory=ddiloco.workloads.synthetic:make_workload",
            "run.num_learners=4",
            "runtime.step_sleep_s=0.1",
            f"runtime.duration_s={duration_s}",
            "runtime.eval_interval_s=30",
            "algo.sync_every=24",
        ],
    )
    launcher = Launcher(cfg, work / "sleep")
    summary = launcher.run()
    st = json.loads((work / "sleep" / "status" / "syncer-0.json").read_text())
    return {
        "learners": 4,
        "duration_s": summary["run_time_s"],
        "merges": st["merges"],
        "merges_per_s": st["merges"] / st["wall_s"],
        "syncer_cpu_share": st["cpu_s"] / st["wall_s"],
        "learners_per_merge": summary["learners_per_merge"],
    }


def merge_throughput(numel: int = 4_000_000, contributions: int = 4, repeats: int = 5) -> dict:
    """Syncer merge throughput on one core, next to a plain in-place add and a memcpy over the
    same contributions in the same run; and the memory an open round holds per learner."""
    import torch

    torch.set_num_threads(1)
    from ddiloco.core.config import DiLoCoConfig
    from ddiloco.core.fragments import TensorSpec, balanced_layout
    from ddiloco.core.messages import Contribution, Heartbeat, Join
    from ddiloco.core.syncer import Syncer

    rows = numel // 1000
    cfg = DiLoCoConfig(num_fragments=1, quorum="all", grace=False, late_fragment="wait", overlap=0)
    layout = balanced_layout([TensorSpec("w", (rows, 1000))], 1)
    g = torch.Generator().manual_seed(0)
    init = torch.randn(rows, 1000, generator=g)
    values = [init + 0.01 * torch.randn(init.shape, generator=g) for _ in range(contributions)]

    def contribution(m: int, seq: int, v: torch.Tensor, base: int) -> Contribution:
        return Contribution(
            learner=m,
            incarnation=0,
            fragment=0,
            base_version=base,
            seq=seq,
            values=[v],
            steps=10,
            tokens=1000,
            data_position=0,
            step=0,
        )

    def fresh() -> Syncer:
        s = Syncer(cfg, layout, {"w": init}, [False])
        for m in range(contributions):
            s.handle(Join(m, 0, [0]), 0.0)
            s.handle(Heartbeat(m, 0, 0, 1.0), 0.0)
        return s

    merge_t, add_t, copy_t = [], [], []
    acc = torch.zeros(numel)
    s = fresh()
    for r in range(repeats + 1):  # the first round allocates the merge buffers: not timed
        # The syncer takes ownership of what it is handed (decoded messages): fresh copies each round.
        batch = [contribution(m, r + 1, v.clone(), r) for m, v in enumerate(values)]
        t0 = time.perf_counter()
        for c in batch:  # arrival (checks, delta, norm, accumulate), then the close
            s.handle(c, 1.0 + r)
        if r:
            merge_t.append(time.perf_counter() - t0)
        assert s.versions() == [r + 1]
        values = [s.fragments[0].values[0] + 0.01 * torch.randn(init.shape, generator=g) for _ in values]
        t0 = time.perf_counter()
        for v in values:
            acc.add_(v.view(-1))
        add_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for v in values:
            acc.copy_(v.view(-1))
        copy_t.append(time.perf_counter() - t0)
    held = open_round_memory(numel, contributions + 2)
    nbytes = contributions * numel * 4
    merge_gbs, add_gbs = nbytes / min(merge_t) / 1e9, nbytes / min(add_t) / 1e9
    return {
        "fragment_mb": numel * 4 / 1e6,
        "contributions": contributions,
        "merge_gb_per_s": merge_gbs,
        "add_gb_per_s": add_gbs,
        "memcpy_gb_per_s": nbytes / min(copy_t) / 1e9,
        "merge_over_add": merge_gbs / add_gbs,
        "open_round_bytes_per_learner": held,
        "open_round_per_learner_over_fragment": held / (numel * 4),
        "note": "merge = arrival checks and norm of every contribution, token-weighted RDA and the outer step",
    }


def open_round_memory(numel: int, learners: int) -> float:
    """Resident bytes an open round holds per answering learner, measured in a fresh process
    (so freed memory of earlier work cannot hide the growth)."""
    code = f"""
import gc, json, os, torch
torch.set_num_threads(1)
from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.messages import Contribution, Heartbeat, Join
from ddiloco.core.syncer import Syncer
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
cfg = DiLoCoConfig(num_fragments=1, quorum="all", grace=False, late_fragment="wait", overlap=0)
init = torch.randn({numel // 1000}, 1000)
s = Syncer(cfg, balanced_layout([TensorSpec("w", tuple(init.shape))], 1), {{"w": init}}, [False])
for m in range({learners}):
    s.handle(Join(m, 0, [0]), 0.0)
first = Contribution(learner=0, incarnation=0, fragment=0, base_version=0, seq=1, values=[init + 0.01],
                     steps=10, tokens=1000, data_position=0, step=0)
s.handle(first, 1.0)  # opens the round: its merge buffer is a fixed cost per fragment
gc.collect()
before = rss()
for m in range(1, {learners} - 1):  # one short of the quorum: the round stays open
    values = [init + 0.01]  # a fresh tensor per answer, as decoding a message makes
    s.handle(Contribution(learner=m, incarnation=0, fragment=0, base_version=0, seq=1, values=values, steps=10,
                          tokens=1000, data_position=0, step=0), 1.0)
    del values
gc.collect()
assert len(s.rounds[0].pending) == {learners} - 1 and s.versions() == [0]
print(json.dumps((rss() - before) / ({learners} - 2)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def sync_cost(run_dir: Path, learners: int = 2) -> dict:
    """Learner-side cost of syncing per step: time at the step boundary (apply, answer, prepare)
    and the comm thread's CPU, as shares of the learners' step time."""
    sync = comm = compute = 0.0
    for m in range(learners):
        st = json.loads((run_dir / "status" / f"learner-{m}.json").read_text())
        sync += st["sync_s"]
        comm += st["comm_cpu_s"]
        compute += st["compute_s"]
    return {"boundary_share": sync / compute, "comm_cpu_share": comm / compute, "total_share": (sync + comm) / compute}


def to_markdown(rep: dict) -> str:
    t, c, s, m = rep["throughput"], rep["chaos"], rep["sleep_fleet"], rep["merge"]
    ratio_ok = t["throughput_ratio"] >= 0.96
    stall_limit = t["survivor_p99_prev_min_s"] + 0.05
    on = ", ".join(f"{x:.2f}" for x in t["steps_per_s_sync_on"])
    off = ", ".join(f"{x:.2f}" for x in t["steps_per_s_sync_off"])
    sc = t["sync_cost"]
    rows = [
        (
            "learner-side sync cost per step: boundary (apply, answer, prepare) + comm-thread CPU, share of step time",
            f"{sc['total_share']:.2%} ({sc['boundary_share']:.2%} + {sc['comm_cpu_share']:.2%})",
            "<= 2%",
            sc["total_share"] <= 0.02,
        ),
        (
            "learner steps/s with syncing on / off (same run); syncer CPU share beside it",
            f"{t['throughput_ratio']:.3f} (on {on}; off {off}); syncer {t['syncer_cpu_share']:.1%} of a core",
            ">= 0.96",
            ratio_ok,
        ),
        (
            "survivor's longest step in the 5 s after a SIGKILL",
            f"{t['survivor_longest_after_kill_s'] * 1000:.0f} ms ({t['survivor_steps_in_5s_after_kill']} steps)",
            f"<= p99 {t['survivor_p99_prev_min_s'] * 1000:.0f} ms + 50 ms = {stall_limit * 1000:.0f} ms",
            t["survivor_longest_after_kill_s"] <= stall_limit,
        ),
        (
            "restarted learner: process start -> first merged contribution",
            f"{t['restart_to_first_merge_s']:.1f} s (first step at {t['restart_to_first_step_s']:.1f} s)",
            "<= 10 s",
            t["restart_to_first_merge_s"] <= 10,
        ),
        (
            f"goodput, {c['duration_s'] / 60:.0f}-min chaos run, {c['kills']} SIGKILLs (restart "
            f"{c['mean_restart_s']:.1f} s)",
            f"{c['goodput']:.1%}",
            f">= {c['target']:.1%}; vs 90%",
            c["goodput"] >= c["target"],
        ),
        (
            "4 sleep-step learners: merges/s, syncer CPU share",
            f"{s['merges_per_s']:.1f}/s, {s['syncer_cpu_share']:.1%}",
            "reported",
            None,
        ),
        (
            f"syncer merge throughput, one core ({m['contributions']} x {m['fragment_mb']:.0f} MB), vs acc.add_(v)",
            f"{m['merge_gb_per_s']:.2f} GB/s = {m['merge_over_add']:.2f} x add_ ({m['add_gb_per_s']:.2f} GB/s); "
            f"memcpy {m['memcpy_gb_per_s']:.2f} GB/s",
            ">= 0.5 x add_",
            m["merge_over_add"] >= 0.5,
        ),
        (
            "syncer resident memory per open round per learner",
            f"{m['open_round_bytes_per_learner'] / 1e6:.1f} MB = {m['open_round_per_learner_over_fragment']:.2f} x "
            f"the {m['fragment_mb']:.0f} MB fragment",
            "reported (one tensor per learner: 1.0 x)",
            None,
        ),
        ("syncer restart -> merges resume", f"{t['syncer_restart_to_merges_s']:.1f} s", "reported", None),
    ]
    lines = [
        "# Runtime benchmark: real processes over ZeroMQ (loopback)",
        "",
        f"Command: `{rep['command']}` ({rep['date']}, {rep['machine']['cpus']} CPUs). GPT on Shakespeare, 2 "
        "learners at one thread each unless a row says otherwise.",
        "",
        "| measure | measured | target | met |",
        "|---|---|---|---|",
    ]
    for name, val, target, ok in rows:
        lines.append(f"| {name} | {val} | {target} | {met(ok)} |")
    lines += ["", "## Fault timeline of the chaos run", "", "| t (s) | fault | target |", "|---|---|---|"]
    lines += [f"| {f['t']:.1f} | {f['kind']} | {f['target']} |" for f in c["faults"]]
    lines += [
        "",
        f"Chaos run: eval loss {c['eval_loss']:.4f}, tokens processed {c['tokens_processed']:,}, merged "
        f"{c['tokens_merged']:,.0f}, learners per merge (weight > 0) {c['learners_per_merge']:.2f}, "
        f"down {c['down']:.1%}, restarting {c['restarting']:.1%}.",
    ]
    return "\n".join(lines) + "\n"


def pairs(work: Path, n: int, phase_s: float, warmup_s: float) -> dict[str, Any]:
    """``n`` pairs of phases, off then on, interleaved; the on/off ratio of each and its spread."""
    rows = []
    for k in range(n):
        row: dict[str, Any] = {"pair": k}
        for arm, sync in (("off", False), ("on", True)):
            started = time.time()
            c, rates = phase(work / f"pair-{k}" / arm, sync=sync, phase_s=phase_s, warmup_s=warmup_s)
            if sync:
                st = c.status("syncer-0")
                row["syncer_cpu_share"] = st["cpu_s"] / st["wall_s"] if st.get("wall_s") else math.nan
                row["sync_cost"] = sync_cost(c.run_dir)
            c.stop()
            row[f"steps_per_s_{arm}"] = rates
            row[f"{arm}_phase_wall_s"] = time.time() - started
        row["ratio"] = on_off_ratio(row["steps_per_s_on"], row["steps_per_s_off"])
        log.info("pair %d: off %s, on %s, ratio %.3f", k, row["steps_per_s_off"], row["steps_per_s_on"], row["ratio"])
        rows.append(row)
    return {
        "pairs": rows,
        "ratio": spread([r["ratio"] for r in rows]),
        "phase_s": phase_s,
        "warmup_s": warmup_s,
        "order": "off, on per pair; pairs one after another",
    }


def pairs_markdown(rep: dict[str, Any]) -> str:
    def rates(xs: list[float]) -> str:
        return ", ".join(f"{x:.2f}" for x in xs)

    r = rep["ratio"]
    lines = [
        "# Runtime benchmark: learner steps/s with syncing off and on, paired runs",
        "",
        f"Command: `{rep['command']}` ({rep['date']}, {rep['machine']['cpus']} CPUs, {rep['wall_s'] / 60:.1f} min). "
        f"{len(rep['pairs'])} pairs, each a phase with syncing off (2 standalone learners) then one with syncing on "
        f"(a syncer + 2 learners), fresh processes each; every phase waits for 5 steps per learner, runs "
        f"{rep['warmup_s']:g} s of warm-up and measures {rep['phase_s']:g} s. GPT on Shakespeare, one thread per "
        "learner. Ratio: the mean over the learners of steps/s on / off.",
        "",
        *table(
            ["pair", "steps/s off (per learner)", "steps/s on (per learner)", "on / off", "syncer CPU share"],
            [
                [
                    p["pair"],
                    rates(p["steps_per_s_off"]),
                    rates(p["steps_per_s_on"]),
                    f"{p['ratio']:.3f}",
                    f"{p['syncer_cpu_share']:.1%}",
                ]
                for p in rep["pairs"]
            ],
        ),
        "",
        f"On/off ratio over {r['n']} pairs: mean {r['mean']:.3f}, min {r['min']:.3f}, max {r['max']:.3f}, "
        f"standard deviation {r['stdev']:.3f} (target: mean >= 0.96).",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pairs", type=int, default=0, help="only the paired on/off throughput runs: this many pairs")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.pairs < 0:
        ap.error("--pairs takes a count of pairs (1 or more)")
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="ddiloco-bench-"))
    suffix = " --quick" if args.quick else ""
    if args.pairs:
        phase_s, warmup_s = (QUICK_PHASE_S, QUICK_WARMUP_S) if args.quick else (PAIR_PHASE_S, PAIR_WARMUP_S)
        rep = pairs(work, args.pairs, phase_s, warmup_s)
        rep.update(facts(f"python bench/runtime.py --pairs {args.pairs}{suffix}"))
        rep.update({"wall_s": time.time() - started, "work_dir": str(work)})
        name = "runtime_pairs-quick" if args.quick else "runtime_pairs"
        publish(Path(args.out), name, rep, pairs_markdown(rep))
        return 0
    phase, pre_kill, chaos_s, mtbf, sleep_s = (20, 25, 90, 30, 20) if args.quick else (60, 70, 600, 120, 60)
    rep = {"merge": merge_throughput()}
    print(json.dumps(rep["merge"]), flush=True)
    rep["throughput"] = throughput_and_faults(work, phase, pre_kill)
    print(json.dumps(rep["throughput"]), flush=True)
    rep["sleep_fleet"] = sleep_fleet(work, sleep_s)
    print(json.dumps(rep["sleep_fleet"]), flush=True)
    rep["chaos"] = chaos_goodput(work, chaos_s, mtbf)
    print(json.dumps({k: v for k, v in rep["chaos"].items() if k != "faults"}), flush=True)
    rep.update(facts(f"python bench/runtime.py{suffix}"))
    rep.update({"wall_s": time.time() - started, "work_dir": str(work)})
    name = "runtime-quick" if args.quick else "runtime"
    publish(Path(args.out), name, rep, to_markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
