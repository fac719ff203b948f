"""The optimizer hand-off to a learner without local state, measured on real processes (issue 32,
item 2): is it paced by the link, and does serving it stall the serving learner's steps?

    python bench/handoff.py                        # a ~40 MB model, its uplink shaped to 200 Mbit/s
    python bench/handoff.py --mb 40 --rate 400mbit --step-s 0.25 --json out.json

Four processes of this script on loopback, no keys: a syncer (``SyncerServer``), learner 0 (the
server: a ``ddiloco.Learner`` training an MLP of about ``--mb`` MB with AdamW, its connection
through a link relay, ``ddiloco.link``, that shapes its uplink to ``--rate``), learner 1 (trains
until a merge, then dies: ``os._exit``), and learner 1 again (a fresh process, model and AdamW:
it joins, asks for a live peer's optimizer state, and trains on). Each step sleeps to make it
``--step-s`` long (a slower accelerator; the sleep leaves the cores to the others).

Reported: the state's bytes (AdamW: 2 N), the link rate learner 0's comm thread measured, the
hand-off's wall time at the server (its first piece handed to the comm thread -> the transport
done with its last) and at the new learner (its join complete -> the state loaded), against
state bytes / measured rate and / the configured rate; the new learner's start -> first step
and -> state loaded against 3 N / rate + 10 s; and learner 0's longest step gap while serving
(its boundaries from the first piece to one step past the last) over its median step outside.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
LOOP = "127.0.0.1"
WIDTH, D_IN, D_OUT, BATCH = 1024, 64, 8, 16


def make_model(mb: float, seed: int) -> nn.Module:
    """An MLP of about ``mb`` MB of fp32 parameters (WIDTH x WIDTH layers)."""
    torch.manual_seed(seed)
    layers = max(1, round(mb * 1e6 / 4 / (WIDTH * WIDTH)))
    body: list[nn.Module] = [nn.Linear(D_IN, WIDTH), nn.Tanh()]
    for _ in range(layers):
        body += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*body, nn.Linear(WIDTH, D_OUT))


def config(args: argparse.Namespace) -> Any:
    from ddiloco.config import load_config

    return load_config(
        None,
        [
            "run.num_learners=2",
            f"algo.sync_every={args.sync_every}",
            "algo.num_fragments=4",
            "algo.liveness_timeout_s=2.0",
            "algo.takeover_after_s=1.0",
            "runtime.heartbeat_interval_s=0.2",
            "runtime.syncer_liveness_s=3.0",
            "runtime.join_timeout_s=30.0",
            "runtime.final_eval=false",
            f"runtime.peer_state_chunk_mb={args.chunk_mb}",
        ],
    )


def train_step(model: nn.Module, opt: torch.optim.Optimizer, g: torch.Generator) -> float:
    x = torch.randn(BATCH, D_IN, generator=g)
    loss = (model(x) - x[:, :D_OUT]).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def paced(args: argparse.Namespace, started: float) -> None:
    """Sleep what is left of a ``--step-s`` step that started at ``started``."""
    left = args.step_s - (time.monotonic() - started)
    if left > 0:
        time.sleep(left)


# -- the roles ---------------------------------------------------------------------------------


def role_syncer(args: argparse.Namespace) -> None:
    import ddiloco

    server = ddiloco.SyncerServer(
        make_model(args.mb, 0), f"tcp://{LOOP}:{args.port}", args.run_dir, config=config(args), insecure=True,
        fsync=False,
    )  # fmt: skip
    server.serve(max_seconds=args.seconds + 60)
    out = {"counts": dict(server.service.counts)}
    Path(args.out).write_text(json.dumps(out))


def join(args: argparse.Namespace, m: int) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    """Learner m of the bench: its model (seed 0, as the syncer's), AdamW, joined to the syncer."""
    import ddiloco

    model = make_model(args.mb, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    learner = ddiloco.Learner(model, args.address, learner_id=m, config=config(args), optimizer=opt, insecure=True)
    return learner, model, opt


def role_serve(args: argparse.Namespace) -> None:
    learner, model, opt = join(args, 0)
    g = torch.Generator().manual_seed(10)
    ends: list[float] = []
    pieces: list[tuple[float, int, int, float]] = []  # (when, budget, bytes copied, copy seconds)
    serve = learner._host.serve

    def recorded(to: int) -> Any:  # each piece the executor takes, as it takes it
        src = serve(to)
        if src is None:
            return None
        piece = src.piece

        def take(budget: int) -> Any:
            ps = piece(budget)
            if ps is not None:
                n = sum(t.numel() * t.element_size() for t in ps.tensors.values())
                pieces.append((time.monotonic(), budget, n, src.copy_s))
            return ps

        src.piece = take  # type: ignore[method-assign]
        return src

    learner._host.serve = recorded  # type: ignore[method-assign]
    deadline = time.monotonic() + args.seconds
    stop = Path(args.run_dir) / "stop"
    steps: list[tuple[float, float, float]] = []  # (end, compute s, inside step() s)
    assert learner.comm is not None
    sent: list[int] = []  # contribution bytes on its link, at each step's end
    while time.monotonic() < deadline and not stop.exists():
        t0 = time.monotonic()
        loss = train_step(model, opt, g)
        t1 = time.monotonic()
        paced(args, t0)
        t2 = time.monotonic()
        learner.step(tokens=BATCH, loss=loss)
        ends.append(time.monotonic())
        steps.append((ends[-1], t1 - t0, ends[-1] - t2))
        sent.append(learner.comm.wire_bytes_sent)
    sender = learner.comm.handoff
    state_bytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values())
    out = {
        "ends": ends, "steps": steps, "sent": sent, "served": sender.served, "rate": sender.rate,
        "state_bytes": state_bytes, "pieces": pieces, "comm_cpu_s": learner.comm.cpu_s,
    }  # fmt: skip
    learner.close()
    Path(args.out).write_text(json.dumps(out))


def role_leave(args: argparse.Namespace) -> None:
    learner, model, opt = join(args, 1)
    g = torch.Generator().manual_seed(11)
    deadline = time.monotonic() + args.seconds
    while max(learner.versions) == 0 and time.monotonic() < deadline:  # until a merge: a run under way
        t0 = time.monotonic()
        loss = train_step(model, opt, g)
        paced(args, t0)
        learner.step(tokens=BATCH, loss=loss)
    os._exit(9)  # killed: no goodbye


def role_rejoin(args: argparse.Namespace) -> None:
    import ddiloco

    born = time.monotonic()
    model = make_model(args.mb, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    learner = ddiloco.Learner(model, args.address, learner_id=1, config=config(args), optimizer=opt, insecure=True)
    g = torch.Generator().manual_seed(12)
    deadline = time.monotonic() + args.seconds
    while "handoff" not in learner.startup.phases and time.monotonic() < deadline:
        t0 = time.monotonic()
        loss = train_step(model, opt, g)
        paced(args, t0)
        learner.step(tokens=BATCH, loss=loss)
    for _ in range(8):  # a few more steps: the server's steps after its last piece are measured too
        t0 = time.monotonic()
        loss = train_step(model, opt, g)
        paced(args, t0)
        learner.step(tokens=BATCH, loss=loss)
    at = {k: learner.startup.started + v for k, v in learner.startup.phases.items()}
    learner.close()
    Path(args.out).write_text(json.dumps({"process": learner.startup.started, "born": born, "phases": at}))


ROLES = {"syncer": role_syncer, "serve": role_serve, "leave": role_leave, "rejoin": role_rejoin}


# -- the orchestration -------------------------------------------------------------------------


def spawn(args: argparse.Namespace, role: str, run_dir: Path, address: str = "") -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, __file__, "--role", role, "--run-dir", str(run_dir), "--out", str(run_dir / f"{role}.json"),
        "--address", address, "--port", str(args.port), "--mb", str(args.mb), "--step-s", str(args.step_s),
        "--seconds", str(args.seconds), "--sync-every", str(args.sync_every), "--chunk-mb", str(args.chunk_mb),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    log = open(run_dir / f"{role}.log", "ab")  # noqa: SIM115 (the child's log, closed with the process)
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_file(path: Path, procs: list[subprocess.Popen[bytes]], timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path.name} after {timeout_s:.0f} s (logs in {path.parent})")
        time.sleep(0.2)
    time.sleep(0.2)
    return dict(json.loads(path.read_text()))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from ddiloco.link.config import parse_link, parse_rate
    from ddiloco.link.relay import RelayThread, Route
    from ddiloco.service.ops.launcher import free_port

    run_dir = Path(tempfile.mkdtemp(prefix="ddiloco-handoff-"))
    args.port = free_port(LOOP)
    syncer = f"tcp://{LOOP}:{args.port}"
    relay = RelayThread(
        [Route("link-0", (LOOP, 0), (LOOP, args.port), parse_link(f"up.rate={args.rate}"))], time.monotonic
    )
    procs = [spawn(args, "syncer", run_dir)]
    try:
        time.sleep(2.0)
        procs.append(spawn(args, "serve", run_dir, f"tcp://{LOOP}:{relay.ports[0]}"))
        leave = spawn(args, "leave", run_dir, syncer)
        leave.wait(timeout=args.seconds)
        time.sleep(1.0)
        procs.append(spawn(args, "rejoin", run_dir, syncer))
        rejoin = wait_file(run_dir / "rejoin.json", procs, args.seconds)
        (run_dir / "stop").touch()
        serve = wait_file(run_dir / "serve.json", procs, 60)
        procs[0].terminate()
        counts = wait_file(run_dir / "syncer.json", procs, 60)["counts"]
    finally:
        (run_dir / "stop").touch()
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait(timeout=60)
        relay.close()
    out = report(args, serve, rejoin, counts, parse_rate(args.rate) / 8, run_dir)
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
        out.pop("run_dir")
    return out


def report(
    args: argparse.Namespace, serve: dict[str, Any], rejoin: dict[str, Any], counts: dict[str, Any], link: float,
    run_dir: Path,
) -> dict[str, Any]:  # fmt: skip
    if not serve["served"]:
        raise SystemExit(f"learner 0 served no optimizer state (logs in {run_dir})")
    _, nbytes, first, last = serve["served"][0]
    ends = serve["ends"]
    gaps = [(b, b - a) for a, b in zip(ends, ends[1:])]

    def during(at: float) -> bool:  # its boundaries that served, and the steps just after
        return first <= at <= last + args.step_s * 2

    serving = [g for at, g in gaps if during(at)]
    outside = [g for at, g in gaps if not during(at)]
    median = statistics.median(outside)
    copies = [(n, c) for _, _, n, c in serve["pieces"]]
    inside = [(during(at), step_call, compute) for at, compute, step_call in serve["steps"]]
    calls_out = statistics.median(c for d, c, _ in inside if not d)
    compute_out = statistics.median(c for d, _, c in inside if not d)
    contributions = [b for at, b in zip(ends, serve["sent"]) if during(at)]
    sent_during = contributions[-1] - contributions[0] if contributions else 0
    phases, rate = rejoin["phases"], serve["rate"]
    model_bytes = nbytes / 2
    out = {
        "model_mb": round(model_bytes / 1e6, 1),
        "state_mb": round(nbytes / 1e6, 1),
        "link_rate_mb_s": round(link / 1e6, 2),
        "measured_rate_mb_s": round(rate / 1e6, 2),
        "handoff_s_at_server": round(last - first, 2),
        "handoff_mb_s": round(nbytes / (last - first) / 1e6, 2),
        "state_over_measured_rate_s": round(nbytes / rate, 2) if rate else None,
        "state_over_link_rate_s": round(nbytes / link, 2),
        "handoff_s_at_receiver": round(phases["handoff"] - phases["download"], 2) if "handoff" in phases else None,
        "new_learner_first_step_s": round(phases["first_step"] - rejoin["born"], 2),
        "new_learner_state_loaded_s": round(phases["handoff"] - rejoin["born"], 2) if "handoff" in phases else None,
        "from_process_start_first_step_s": round(phases["first_step"] - rejoin["process"], 2),
        "from_process_start_state_loaded_s": round(phases["handoff"] - rejoin["process"], 2),
        "bound_3n_over_rate_plus_10_s": round(3 * model_bytes / link + 10, 2),
        "median_step_s": round(median, 3),
        "longest_gap_serving_s": round(max(serving), 3) if serving else None,
        "longest_gap_over_median": round(max(serving) / median, 2) if serving else None,
        "steps_while_serving": len(serving),
        "step_call_median_s": round(calls_out, 4),
        "step_call_longest_serving_s": round(max(c for d, c, _ in inside if d), 4),
        "compute_median_s": round(compute_out, 4),
        "compute_longest_serving_s": round(max(c for d, _, c in inside if d), 4),
        "contribution_mb_on_link_while_serving": round(sent_during / 1e6, 1),
        "link_used_while_serving": round((nbytes + sent_during) / (last - first) / link, 2),
        "comm_thread_cpu_s": round(serve["comm_cpu_s"], 2),
        "longest_gap_outside_over_median": round(max(outside) / median, 2),
        "boundaries_that_copied": len(copies),
        "largest_copy_mb": round(max(n for n, _ in copies) / 1e6, 1),
        "longest_copy_s": round(max(c for _, c in copies), 3),
        "syncer_rate_limited": counts.get("rate_limited", 0),
        "run_dir": str(run_dir),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=sorted(ROLES))
    ap.add_argument("--run-dir", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--address", default="")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--mb", type=float, default=40.0, help="model size in MB of fp32 (the state is twice that)")
    ap.add_argument("--rate", default="200mbit", help="learner 0's uplink (ddiloco.link rate syntax)")
    ap.add_argument("--step-s", type=float, default=0.25, help="each learner's step time (compute + sleep)")
    ap.add_argument("--seconds", type=float, default=120.0, help="bound on each phase")
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--chunk-mb", type=float, default=1.0, help="runtime.peer_state_chunk_mb")
    ap.add_argument("--json", default="", help="also write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the run folder (logs, tape); kept anyway on failure")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.role:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.role} %(levelname)s %(message)s")
        ROLES[args.role](args)
        return
    out = measure(args)
    for k, v in out.items():
        print(f"{k:32s} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
