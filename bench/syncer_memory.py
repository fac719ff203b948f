"""SyncerServer's memory (issue 32 item 5): the peak resident size of a process that builds a
Hugging Face GPT-2 and serves it with ``ddiloco.SyncerServer`` until the run's end, above an idle
process with the same imports, over the model's fp32 bytes.

    python bench/syncer_memory.py                     # GPT-2 small-ish (16M), 2 learners, ~1 min
    python bench/syncer_memory.py --size 124M         # GPT-2 124M, 2 learners, a few minutes
    python bench/syncer_memory.py --learners 0        # no learners: build, serve, stop
    python bench/syncer_memory.py --evaluate          # with the evaluate= hook

Three processes: an idle one (torch, transformers and ddiloco imported: the baseline), the
syncer (builds the model, ``SyncerServer(model, tcp://127.0.0.1:*, RUN, config)``, ``serve()``),
and one process with the learners as threads (``ddiloco.Learner``; a step nudges every parameter
and sleeps: no forward or backward, so the syncer's merges are real but the learners are cheap).
The syncer samples its own resident size every 20 ms, by stage (``build``: the user's model;
``open``: the SyncerServer's construction; ``serve``; ``final``: the final sync; ``stop``: the
final model written and loaded into the user's model), and keeps the largest of each status
``memory`` figure. Prints one JSON object; nothing is written to the repository.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.paths import ENV  # noqa: E402  (bench/harness, beside this script)

SIZES = {  # GPT2Config arguments
    "16M": {"vocab_size": 50257, "n_positions": 256, "n_embd": 256, "n_layer": 4, "n_head": 4},
    "124M": {},  # GPT2Config()'s defaults: the 124M GPT-2
}
TOKENS = 1024  # a learner's tokens per step (counted, not computed)


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def settings(args: argparse.Namespace) -> list[str]:
    learners = max(1, args.learners)
    return [
        f"run.num_learners={learners}",
        f"algo.sync_every={args.sync_every}",
        f"run.processed_tokens={learners * args.steps * TOKENS}",
        "runtime.duration_s=600",
        "runtime.status_interval_s=0.2",
        "runtime.end_linger_s=0.5",
    ]


def build(size: str) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**SIZES[size]))


def imports() -> None:
    import torch

    torch.set_num_threads(1)
    from transformers import GPT2LMHeadModel  # noqa: F401  (its modules load lazily)

    import ddiloco  # noqa: F401
    import ddiloco.service.syncer.service  # noqa: F401


def idle_role() -> dict[str, Any]:
    imports()
    time.sleep(0.3)
    return {"vmhwm": status_bytes("VmHWM")}


def syncer_role(args: argparse.Namespace) -> dict[str, Any]:
    imports()
    import ddiloco

    stage = ["build"]
    peaks: dict[str, int] = {}
    memory: dict[str, int] = {}
    memory_peak_in = [""]
    hwm: dict[str, int] = {}
    trace: list[tuple[float, str, int]] = []
    t0 = time.monotonic()
    status = Path(args.run_dir) / "status" / "syncer-0.json"
    done = threading.Event()

    def sample() -> None:
        last_status, last_stage = 0.0, stage[0]
        while not done.is_set():
            if stage[0] != last_stage:  # the peak so far, as the stage ends (a spike between samples too)
                hwm[last_stage], last_stage = status_bytes("VmHWM"), stage[0]
            rss = status_bytes("VmRSS")
            peaks[stage[0]] = max(peaks.get(stage[0], 0), rss)
            if args.trace:
                trace.append((round(time.monotonic() - t0, 2), stage[0], rss >> 20))
            if time.monotonic() - last_status > 0.1:
                last_status = time.monotonic()
                try:
                    mem = json.loads(status.read_text()).get("memory", {})
                except (OSError, ValueError):
                    mem = {}
                for k, v in mem.items():
                    if isinstance(v, int):
                        memory[k] = max(memory.get(k, 0), v)
                if isinstance(mem.get("rss_peak_in"), str):
                    memory_peak_in[0] = mem["rss_peak_in"]
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    model = build(args.size)
    model_bytes = sum(t.numel() * 4 for t in {id(p): p for p in model.parameters()}.values())
    stage[0] = "open"
    kwargs: dict[str, Any] = {}
    if args.evaluate:
        import torch

        ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
        kwargs = {"evaluate": lambda m: float(m(ids, labels=ids).loss), "eval_every_tokens": TOKENS * args.steps / 2}
    cfg = ddiloco.load_config(None, settings(args))
    server = ddiloco.SyncerServer(model, "tcp://127.0.0.1:*", args.run_dir, config=cfg, **kwargs)
    Path(args.address_file).write_text(server.address)
    stage[0] = "serve"

    def watch_end() -> None:
        while not done.is_set():
            if server.service.end_stage is not None and stage[0] == "serve":
                stage[0] = "final"
            time.sleep(0.01)

    threading.Thread(target=watch_end, daemon=True).start()
    if args.learners == 0:
        threading.Timer(2.0, server.stop).start()
    server.serve(handle_signals=False)
    stage[0] = "after"
    time.sleep(0.1)
    done.set()
    sampler.join()
    hwm["after"] = status_bytes("VmHWM")
    import torch

    final_ok = all(not t.is_meta for t in model.state_dict().values()) and all(
        torch.isfinite(t).all() for t in model.state_dict().values() if t.is_floating_point()
    )
    return {"vmhwm": hwm["after"], "hwm": hwm, "model_bytes": model_bytes, "peaks": peaks, "memory": memory,
            "final_model_filled": bool(final_ok), "rss_peak_in": memory_peak_in[0], "trace": trace[::10]}  # fmt: skip


def learners_role(args: argparse.Namespace) -> dict[str, Any]:
    imports()
    import torch

    import ddiloco

    address_file = Path(args.address_file)
    while not address_file.exists() or not address_file.read_text():
        time.sleep(0.1)
    address = address_file.read_text()
    cfg = ddiloco.load_config(None, settings(args))
    errors: list[str] = []
    steps = [0] * args.learners

    def learner(m: int) -> None:
        try:
            model = build(args.size)
            key = Path(args.run_dir) / "keys"
            with torch.no_grad(), ddiloco.Learner(model, address, learner_id=m, key=key, config=cfg) as ln:
                while not ln.run_ended and steps[m] < 10 * args.steps:
                    for p in model.parameters():
                        p.mul_(1.0 + 1e-4 * (m + 1))  # a stand-in for an inner step's change
                    ln.step(tokens=TOKENS)
                    steps[m] += 1
                    time.sleep(args.step_s)
                ln.finish()
        except BaseException as e:
            errors.append(f"learner {m}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=learner, args=(m,)) for m in range(args.learners)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"steps": steps, "errors": errors}


def run_role(args: argparse.Namespace, role: str, out: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, __file__, "--role", role, "--out", str(out), "--size", args.size,
            "--learners", str(args.learners), "--steps", str(args.steps), "--sync-every", str(args.sync_every),
            "--step-s", str(args.step_s), "--run-dir", args.run_dir, "--address-file", args.address_file]  # fmt: skip
    argv += ["--evaluate"] * args.evaluate + ["--trace"] * args.trace
    return subprocess.Popen(argv, env=ENV)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="16M")
    ap.add_argument("--learners", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24, help="each learner's steps in the run's token budget")
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=0.2, help="a learner's sleep per step")
    ap.add_argument("--evaluate", action="store_true", help="SyncerServer(evaluate=...): the hook's copy too")
    ap.add_argument("--trace", action="store_true", help="print the syncer's resident size every 0.2 s")
    ap.add_argument("--role", choices=["idle", "syncer", "learners"], default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--address-file", default=None)
    args = ap.parse_args()
    if args.role is not None:
        result = idle_role() if args.role == "idle" else (syncer_role if args.role == "syncer" else learners_role)(args)
        Path(args.out).write_text(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        args.run_dir, args.address_file = str(t / "run"), str(t / "address")
        idle = run_role(args, "idle", t / "idle.json")
        idle.wait()
        syncer = run_role(args, "syncer", t / "syncer.json")
        fleet = run_role(args, "learners", t / "learners.json") if args.learners else None
        if fleet is not None:
            fleet.wait()
        syncer.wait()
        base = json.loads((t / "idle.json").read_text())["vmhwm"]
        s = json.loads((t / "syncer.json").read_text())
        n = s["model_bytes"]
        out = {
            "size": args.size,
            "learners": args.learners,
            "evaluate": args.evaluate,
            "model_mib": round(n / 2**20, 1),
            "idle_mib": round(base / 2**20, 1),
            "peak_above_idle_x": round((s["vmhwm"] - base) / n, 2),
            "by_stage_above_idle_x": {k: round((v - base) / n, 2) for k, v in s["peaks"].items()},
            "peak_by_stage_end_above_idle_x": {k: round((v - base) / n, 2) for k, v in s["hwm"].items()},
            "status_memory_max_x": {k: round(v / n, 2) for k, v in s["memory"].items() if k != "rss"},
            "status_rss_peak_in": s["rss_peak_in"],
            "final_model_filled": s["final_model_filled"],
        }
        if args.trace:
            out["trace"] = s["trace"]
        if fleet is not None:
            out["learners_result"] = json.loads((t / "learners.json").read_text())
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
