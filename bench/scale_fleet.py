"""Many lightweight learners against real syncer shards (issue 21, item 6: the fleet).

``python bench/scale_fleet.py --learners 32 64 --shards 1 2 4 --encodings fp32 int4``

Each cell starts real ``ddiloco syncer`` shard processes (``--shard i --num-shards n``) on
127.0.0.1 and a few fake-learner processes, each holding many learners. A fake learner is the
real protocol without the training: the real ``LearnerSession`` pumped by the real comm thread
(``LearnerComm``) over the real ZeroMQ transport and wire, so registrations, requests,
heartbeats, acks and versions are what ``ddiloco.Learner`` does; only the step is a sleep and
the payload is pre-built. Per process, the model's fragments are built once (a 100M-parameter
layout in P = 24 fragments) and every contribution sends them: fp32 values, or for int4 a delta
encoded once per fragment. What the fake learners skip, and why:

- the join's download: each registers as holding version 0 of every fragment (what a learner
  re-registering after a syncer restart does), so the syncer sends none (a real join would move
  400 MB per learner before the measurement starts);
- decoding int4 payloads of merged versions (sizes and codes are still checked on receipt): it
  costs about 15-40 ms per fragment here, which 64 learners could not afford on 2 cores;
- writing received versions into a model (there is none).

Measured per cell over a window that starts once every learner is live on every shard: merges
per second and contributions merged per second (from each shard's ``state/.../tape.jsonl``),
each syncer's CPU (``/proc/PID/stat``, a share of one core) and peak RSS, heartbeats and
messages handled per second (the shard's status and traffic files), and rounds that closed late
because of the syncer: a round whose close came more than ``LATE_S`` after its condition was
met. The condition is computed from outside (``round_condition``): the fake learners record the
monotonic time each request arrived and each contribution was handed to ZeroMQ (the monotonic
clock is system-wide on Linux, the syncer's too), the tape gives the round's close time, grace
window, quorum and merged (learner, seq) entries. Cells are cached as JSON under
``bench/cache/scale/fleet/`` (a rerun skips done cells; ``--force`` redoes them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Only the harness's modules that leave sys.path alone: --src runs other sources.
from harness.files import read_json  # noqa: E402  (bench/harness, beside this script)
from harness.sampling import cpu_seconds, status_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "bench" / "cache" / "scale" / "fleet"
FORMAT = 1
"""Version of a cell's JSON (a cached cell of another version is measured again)."""
LATE_S = 0.1
"""A round closed more than this after its quorum-and-grace condition was met is late."""
NUM_FRAGMENTS = 24
HIDDEN = 10_000
"""The synthetic MLP's width: d_in 16, d_out 8 and hidden 10,000 give 100.26M parameters."""
STEP_S = 1.0
TOKENS_PER_STEP = 1024
PER_PROCESS = 32
"""Fake learners per OS process."""
WARMUP_S = 8.0
"""Seconds after every learner is live before the window opens (the step clock settles)."""
JOIN_TIMEOUT_S = 90.0
ENCODINGS = ("fp32", "bf16", "int8", "int4", "int2")

log = logging.getLogger("scale_fleet")


# -- the fake learners (one worker process holds many) ----------------------------------------


def meta_model(cfg: Any) -> Any:
    """The run's model on the meta device: names and shapes, no memory (the layout and the
    registration need nothing else). The synthetic task is built without its teacher."""
    import torch

    from ddiloco.workloads.config import load_workload

    if cfg.workload.factory.endswith("synthetic:make_workload"):
        from ddiloco.workloads.synthetic import Student, SyntheticOptions

        with torch.device("meta"):
            return Student(SyntheticOptions.from_dict(dict(cfg.workload.options)))
    with torch.device("meta"):
        return load_workload(cfg.workload).build_model(cfg.run.seed)


class Payload:
    """Pre-built fragments, shared by every learner of a process: fp32 values per piece (what
    an fp32 contribution sends) and, for a lossy up-link, one encoded delta per fragment."""

    def __init__(self, fragments: Sequence[Sequence[Any]], encoding: str, seed: int) -> None:
        import torch

        from ddiloco.core.codec import encode_pieces

        g = torch.Generator().manual_seed(seed)
        self.values: list[list[torch.Tensor]] = []
        self.encoded: list[list[Any]] = []
        for pieces in fragments:
            # A fixed target of the model's own scale (uniform +-1/sqrt(fan_in)): honest-sized deltas.
            vals = []
            for pc in pieces:
                bound = 1.0 / math.sqrt(pc.shape[-1]) if len(pc.shape) > 1 else 0.01
                vals.append(torch.empty(pc.shape).uniform_(-bound, bound, generator=g))
            self.values.append(vals)
            if encoding != "fp32":
                delta = [torch.randn(pc.shape, generator=g) * 1e-3 for pc in pieces]
                self.encoded.append(encode_pieces(delta, pieces, encoding)[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 4 for vals in self.values for t in vals)


def fake_codec_class() -> type:
    from ddiloco.core.codec import LearnerCodec
    from ddiloco.core.messages import Contribution, FragmentUpdate

    class FakeCodec(LearnerCodec):
        """``LearnerCodec``'s rules on versions without its copies: it remembers which version of
        each fragment it holds (not the values), expands a delta that chains from it (into the
        delta's own tensors: nobody reads them) and sends the pre-encoded delta when the real
        codec would send one (a base held at the contribution's base version)."""

        def __init__(self, cfg: Any, fragments: Any, payload: Payload) -> None:
            super().__init__(cfg, fragments)
            self.payload = payload
            self.held: dict[int, int] = {}

        def expand(self, u: FragmentUpdate) -> FragmentUpdate | str:
            if u.kind != "delta":
                return u
            if self.held.get(u.fragment) != u.base_version:
                return f"a delta from version {u.base_version}: waiting for the full version"
            return dataclasses.replace(u, kind="values", encoded=[])

        def received(self, u: FragmentUpdate) -> None:
            if self.active:
                self.held[u.fragment] = u.version

        def encode(self, c: Contribution) -> tuple[Contribution, Any]:
            if not self.active or self.held.get(c.fragment) != c.base_version:
                return c, None
            p = c.fragment
            return dataclasses.replace(c, kind="delta", encoded=self.payload.encoded[p]), None

    return FakeCodec


class Records:
    """What the fake learners of one process saw, with monotonic times (appends are atomic)."""

    def __init__(self) -> None:
        self.sends: list[tuple[int, int, int, int, float]] = []
        """(learner, incarnation, fragment, seq, time handed to ZeroMQ) per contribution."""
        self.requests: list[tuple[int, int, int, float]] = []
        """(learner, fragment, round id, time it arrived) per request."""
        self.unsent = 0
        """Contributions ZeroMQ would not take (not connected, or its queue full)."""


def learner_classes(rec: Records) -> tuple[type, type]:
    """The real session and comm thread with a recorder on requests and contributions."""
    from ddiloco.core.messages import Contribution, FragmentRequest
    from ddiloco.protocol.learner_session import LearnerOutput, LearnerSession, Send
    from ddiloco.service.base.wire import encode
    from ddiloco.service.learner.comm import LearnerComm

    class RecordingSession(LearnerSession):
        def receive(self, shard: int, msg: Any, now: float) -> LearnerOutput:
            if isinstance(msg, FragmentRequest):
                rec.requests.append((self.learner, msg.fragment, msg.round_id, now))
            return super().receive(shard, msg, now)

    class RecordingComm(LearnerComm):
        def _send_one(self, send: Send) -> None:
            frames = encode(send.msg)
            ok = self.sock.send(send.shard, frames)
            if isinstance(send.msg, Contribution):
                c = send.msg
                if ok:
                    rec.sends.append((c.learner, c.incarnation, c.fragment, c.seq, time.monotonic()))
                else:
                    rec.unsent += 1

    return RecordingSession, RecordingComm


def light_decode_patch() -> None:
    """In a fake-learner process only: merged versions' int4/int8/... payloads are checked on
    receipt (``compress.check``, in the wire) but not expanded to fp32; a shared zero tensor of
    the right shape stands for them (nothing reads it)."""
    import torch

    from ddiloco.core import compress

    zeros: dict[tuple[int, ...], torch.Tensor] = {}

    def decode(e: Any) -> torch.Tensor:
        t = zeros.get(tuple(e.shape))
        if t is None:
            t = zeros[tuple(e.shape)] = torch.zeros(e.shape)
        return t

    compress.decode = decode  # type: ignore[assignment]


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of ``pid`` in seconds (None when it is gone)."""
    return cpu_seconds(pid)


def proc_hwm_mb(pid: int) -> float | None:
    """Peak resident memory (VmHWM) of ``pid`` in MB."""
    got = status_bytes(pid).get("VmHWM")
    return None if got is None else got / 2**20


def worker_main(spec_path: Path) -> int:
    """One fake-learner process: the learners in the spec, until SIGTERM or its deadline."""
    import torch

    torch.set_num_threads(1)
    from ddiloco.config import load_config
    from ddiloco.protocol.learner_session import Registration
    from ddiloco.service.base.clock import SYSTEM_CLOCK
    from ddiloco.service.base.keys import ClientKeys
    from ddiloco.service.base.transport import ZmqLearnerSocket, learner_identity
    from ddiloco.settings import EVERY_LEARNER, run_settings
    from ddiloco.training.layout import layout_of, param_spec

    spec = json.loads(spec_path.read_text())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    cfg = load_config(spec["config"])
    model = meta_model(cfg)
    layout = layout_of(model, cfg.algo, lambda name: False)  # the digest does not depend on it
    fragments = layout.fragments.fragments
    t0 = time.perf_counter()
    payload = Payload(fragments, cfg.algo.up_encoding, seed=1 + spec["index"])
    built_s = time.perf_counter() - t0
    if cfg.algo.down_encoding != "fp32":
        light_decode_patch()
    registration = Registration(
        param_spec(model), layout.digest, os.getpid(), "cpu", settings=run_settings(cfg, EVERY_LEARNER)
    )
    rec = Records()
    session_cls, comm_cls = learner_classes(rec)
    codec_cls = fake_codec_class()
    rt, addresses, step_s = cfg.runtime, spec["addresses"], float(spec["step_s"])
    rng = random.Random(spec["index"])
    comms: list[Any] = []
    started = time.monotonic()
    deadline = started + float(spec["max_s"])
    # Each learner steps on its own phase, as independent trainers would.
    next_step: list[float] = []
    for k, learner in enumerate(spec["ids"]):
        if stop.is_set():
            break
        now = time.monotonic()
        session = session_cls(
            cfg.algo, rt, learner, int(time.time() * 1e6) + k, layout.fragments, registration, now,
            num_shards=len(addresses),
        )  # fmt: skip
        session.codec = codec_cls(cfg.algo, fragments, payload)
        # Holds version 0 of every fragment: its registration says so and the syncer sends none.
        session.joined_once = True
        session.codec.held = dict.fromkeys(range(len(fragments)), 0)
        keys = ClientKeys.load(spec["keys"], f"learner-{learner}") if spec.get("keys") else None
        sock = ZmqLearnerSocket(addresses, learner_identity(learner), rt.backoff_initial_s, rt.backoff_max_s, keys)
        comm = comm_cls(session, addresses, sock, SYSTEM_CLOCK)
        comm.start()
        comms.append(comm)
        next_step.append(now + rng.uniform(0.0, step_s))
        stop.wait(float(spec["stagger_s"]))
    last = [0.0] * len(comms)
    steps = [0] * len(comms)
    while not stop.is_set() and time.monotonic() < deadline:
        now = time.monotonic()
        for i, comm in enumerate(comms):
            s = comm.session
            if s.done or not comm.alive:
                continue
            if not s.joined:  # not accepted by every shard yet: boundaries without a step (the join wait)
                with comm.lock:
                    plan = s.boundary(now)
                    out = s.complete(plan, {p: payload.values[p] for p in plan.read})
                comm.post(out)
                next_step[i] = max(next_step[i], now + 0.1)
                continue
            if now < next_step[i]:
                continue
            duration = now - last[i] if last[i] else step_s
            with comm.lock:
                plan = s.step(TOKENS_PER_STEP, duration, now, loss=1.0)
                out = s.complete(plan, {p: payload.values[p] for p in plan.read})
            comm.post(out)
            last[i], steps[i] = now, steps[i] + 1
            next_step[i] += step_s
            if next_step[i] < now:  # fell behind (a busy machine): no catch-up burst
                next_step[i] = now + step_s
        wake = min(next_step, default=now + 0.1)
        stop.wait(min(max(wake - time.monotonic(), 0.001), 0.1))
    for comm in comms:  # leave together, then wait for each comm thread
        comm.stop.set()
        comm.sock.wake()
    for comm in comms:
        comm.close(timeout_s=3.0)
    out_doc = {
        "pid": os.getpid(),
        "ids": spec["ids"],
        "payload_mb": payload.nbytes / 1e6,
        "payload_build_s": built_s,
        "cpu_s": time.process_time(),
        "hwm_mb": proc_hwm_mb(os.getpid()),
        "sends": rec.sends,
        "requests": rec.requests,
        "unsent": rec.unsent,
        "learners": [
            {
                "learner": c.session.learner,
                "steps": steps[i],
                "answered_at_once": c.session.answered,
                "refused": c.session.refused,
                "gave_up": c.session.gave_up,
                "comm_died": c.died,
                "reconnects": c.reconnects,
            }
            for i, c in enumerate(comms)
        ],
    }
    tmp = Path(spec["out"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(out_doc))
    tmp.rename(spec["out"])
    return 0


# -- one cell ---------------------------------------------------------------------------------


def config_toml(learners: int, encoding: str, hidden: int, down_encoding: str | None = None) -> str:
    """The run's config: the synthetic MLP at ``hidden`` (100M at 10,000), P = 24 = H (one round
    a step), the up-link in ``encoding`` and the down-link in ``down_encoding`` (None: the same),
    a budget the cell never reaches."""
    return f"""\
[run]
num_learners = {learners}
processed_tokens = 1_000_000_000_000_000
seed = 0

[runtime]
duration_s = 3600
status_interval_s = 1.0
metrics_interval_s = 5.0
progress_interval_s = 3600
final_eval = false

[algo]
num_fragments = {NUM_FRAGMENTS}
sync_every = {NUM_FRAGMENTS}
up_encoding = "{encoding}"
down_encoding = "{down_encoding or encoding}"

[workload]
factory = "ddiloco.workloads.synthetic:make_workload"
options = {{ d_in = 16, hidden = {hidden}, d_out = 8 }}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(src: Path) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _tail(path: Path, n: int = 6) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])
    except OSError:
        return "(no log)"


def _read_json(path: Path) -> dict[str, Any] | None:
    doc = read_json(path)
    return doc if isinstance(doc, dict) else None


def _quantile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def round_condition(
    rnd: dict[str, Any],
    sends: dict[tuple[int, int, int], float],
    asked: set[int] | None,
    robust: bool,
    min_answers: int,
) -> float | None:
    """When ``rnd`` (a tape round record) could have closed, from the learners' send times:
    its quorum-th answer's send plus the round's grace window (and, with robust merging, the
    ``min_answers``-th answer: a robust round waits for that many when as many were asked), or
    the last asked learner's answer if every asked learner answered first (a refused answer
    counts as answered, as in ``core.round.Round.close_reason``). None: the round merged nothing,
    or an answer's send time is unknown."""
    merged = rnd.get("merged") or []
    if not merged:
        return None
    times = []
    for m in merged:
        t = sends.get((m["learner"], m["incarnation"], m["seq"]))
        if t is None:
            return None
        times.append(t)
    times.sort()
    k = max(1, min(int(rnd.get("quorum") or 1), len(times)))
    condition = times[k - 1] + float(rnd.get("grace_s") or 0.0)
    n_asked = len(asked) if asked else len(times)
    if robust:
        r = min(min_answers, n_asked)
        if len(times) >= r:
            condition = max(condition, times[r - 1])
    answered = {m["learner"] for m in merged} | {r["learner"] for r in rnd.get("rejected") or []}
    if asked is not None and asked <= answered:
        condition = min(condition, times[-1])
    return condition


def _tape(run_dir: Path, shards: int, shard: int) -> list[dict[str, Any]]:
    path = run_dir / "state" / ("tape.jsonl" if shards == 1 else f"shard-{shard}/tape.jsonl")
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line of a killed syncer
        if isinstance(rec, dict):
            out.append(rec)
    return out


@dataclasses.dataclass
class Snapshot:
    """What the cell reads at each end of its window."""

    mono: float
    load: float | None
    syncer_cpu: list[float | None]
    worker_cpu: list[float | None]
    status: list[dict[str, Any] | None]
    traffic: list[dict[str, Any] | None]


def _snapshot(
    run_dir: Path, syncers: list[subprocess.Popen[bytes]], workers: list[subprocess.Popen[bytes]]
) -> Snapshot:
    n = len(syncers)
    return Snapshot(
        time.monotonic(),
        _loadavg(),
        [proc_cpu_s(p.pid) for p in syncers],
        [proc_cpu_s(p.pid) for p in workers],
        [_read_json(run_dir / "status" / f"syncer-{k}.json") for k in range(n)],
        [_read_json(run_dir / "metrics" / ("traffic.json" if n == 1 else f"traffic-shard-{k}.json")) for k in range(n)],
    )


def _heartbeats(traffic: dict[str, Any] | None, category: str = "heartbeat") -> int:
    """Learner messages of ``category`` a shard has handled (its traffic file's up-link count)."""
    if not traffic:
        return 0
    by = traffic.get("by_learner") or {}
    return sum(int(((e.get("up") or {}).get(category) or {}).get("messages", 0)) for e in by.values())


def _loadavg() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _kill(procs: Sequence[subprocess.Popen[bytes]], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def _wait(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def cell_key(
    learners: int, shards: int, encoding: str, seconds: float, hidden: int,
    step_s: float = STEP_S, down_encoding: str | None = None, hosts: bool = False,
) -> str:  # fmt: skip
    """The cell's file name; what is not at its default is named (older cells keep their names)."""
    extra = (f"-step{step_s:g}s" if step_s != STEP_S else "") + (f"-down{down_encoding}" if down_encoding else "")
    return f"L{learners}-S{shards}-{encoding}-h{hidden}-{seconds:g}s{extra}" + ("-hosts" if hosts else "")


def run_fleet_cell(
    learners: int,
    shards: int,
    encoding: str,
    seconds: float,
    cache_dir: Path,
    *,
    hidden: int = HIDDEN,
    per_process: int = PER_PROCESS,
    warmup_s: float = WARMUP_S,
    step_s: float = STEP_S,
    force: bool = False,
    keep_dir: bool = False,
    src: Path = ROOT / "src",
    down_encoding: str | None = None,
    hosts: bool = False,
) -> dict[str, Any]:
    """One cell: ``learners`` fake learners against ``shards`` syncer shard processes for a
    window of ``seconds`` after all are live (plus start-up and ``warmup_s``), both links in
    ``encoding``. Cached in ``cache_dir`` by its settings (``force``: measure again). Every
    process is killed (its process group) when the cell ends, whatever happened. ``src``: the
    ddiloco sources the syncers and the fake learners run (a checkout of a commit, so that a
    working tree under edit does not move the measurement). ``hosts``: every shard and every
    fake-learner process on an emulated host of its own (ddiloco.link.hosts; root)."""
    if not (isinstance(learners, int) and learners >= 1):
        raise ValueError(f"learners = {learners!r}: must be an integer >= 1")
    if not (isinstance(shards, int) and 1 <= shards <= NUM_FRAGMENTS):
        raise ValueError(f"shards = {shards!r}: must be an integer in 1..{NUM_FRAGMENTS}")
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding = {encoding!r}: must be one of {', '.join(ENCODINGS)}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"seconds = {seconds!r}: must be > 0")
    if not (isinstance(hidden, int) and hidden >= 1) or per_process < 1 or step_s <= 0:
        raise ValueError(f"hidden = {hidden!r}, per_process = {per_process!r}, step_s = {step_s!r}: out of range")
    cache_dir = Path(cache_dir)
    path = cache_dir / f"{cell_key(learners, shards, encoding, seconds, hidden, step_s, down_encoding, hosts)}.json"
    cached = _read_json(path)
    if cached is not None and cached.get("format") == FORMAT and not force:
        return cached
    import torch  # noqa: F401  (imported before the clock starts: the measurement needs it)

    cell_t0 = time.monotonic()
    run_dir = Path(tempfile.mkdtemp(prefix="ddiloco-fleet-"))
    (run_dir / "logs").mkdir()
    config = run_dir / "fleet.toml"
    config.write_text(config_toml(learners, encoding, hidden, down_encoding))
    n_proc = math.ceil(learners / per_process)
    emulated = None
    if hosts:
        from ddiloco.link.hosts import EmulatedHosts
        from ddiloco.service.base.keys import make_keys

        make_keys(run_dir / "keys", learners)  # off loopback, keys are required
        emulated = EmulatedHosts([*(f"shard-{k}" for k in range(shards)), *(f"worker-{i}" for i in range(n_proc))])
        emulated.up()
        addresses = [f"tcp://{emulated.address(f'shard-{k}')}:5600" for k in range(shards)]
    else:
        addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(shards)]
    on = lambda host, argv: emulated.command(host, argv) if emulated is not None else argv  # noqa: E731
    syncers: list[subprocess.Popen[bytes]] = []
    workers: list[subprocess.Popen[bytes]] = []
    logs: list[Any] = []
    try:
        for k in range(shards):
            lf = open(run_dir / "logs" / f"syncer-{k}.log", "wb")
            logs.append(lf)
            cmd = [sys.executable, "-m", "ddiloco", "syncer", str(config), "--bind", addresses[k],
                   "--run-dir", str(run_dir / "run"), "--shard", str(k), "--num-shards", str(shards),
                   *(["--keys", str(run_dir / "keys")] if emulated is not None else [])]  # fmt: skip
            syncers.append(subprocess.Popen(on(f"shard-{k}", cmd), stdout=lf, stderr=subprocess.STDOUT, env=_env(src),
                                            start_new_session=True))  # fmt: skip
            # Shard 0 first: it makes the run folder the others then find.
            _await(lambda k=k: (run_dir / "run" / "status" / f"syncer-{k}.json").is_file(), syncers, run_dir, 180.0,
                   f"syncer shard {k} to start")  # fmt: skip
        started_s = time.monotonic() - cell_t0
        ids = list(range(learners))
        for i in range(n_proc):
            spec = {
                "index": i, "config": str(config), "addresses": addresses, "ids": ids[i::n_proc],
                "step_s": step_s, "stagger_s": 0.02, "max_s": 600.0,
                "out": str(run_dir / f"worker-{i}.json"),
                "keys": str(run_dir / "keys") if emulated is not None else None,
            }  # fmt: skip
            sp = run_dir / f"worker-{i}.spec.json"
            sp.write_text(json.dumps(spec))
            lf = open(run_dir / "logs" / f"worker-{i}.log", "wb")
            logs.append(lf)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(sp)]
            workers.append(subprocess.Popen(on(f"worker-{i}", cmd), stdout=lf, stderr=subprocess.STDOUT, env=_env(src),
                                            start_new_session=True))  # fmt: skip

        def all_live() -> bool:
            for k in range(shards):
                st = _read_json(run_dir / "run" / "status" / f"syncer-{k}.json")
                if st is None or len(st.get("live") or []) < learners:
                    return False
            return True

        _await(all_live, [*syncers, *workers], run_dir, JOIN_TIMEOUT_S, f"all {learners} learners to be live")
        live_s = time.monotonic() - cell_t0
        time.sleep(warmup_s)
        a = _snapshot(run_dir / "run", syncers, workers)
        end = a.mono + seconds
        while time.monotonic() < end:
            dead = [p for p in [*syncers, *workers] if p.poll() is not None]
            if dead:
                raise RuntimeError(f"a process of the cell exited early: {_tail(Path(logs[0].name))}")
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        time.sleep(1.2)  # the status files of the window's end (written every second)
        b = _snapshot(run_dir / "run", syncers, workers)
        hwm = [proc_hwm_mb(p.pid) for p in syncers]
        # every process bound its host's address (its sockets, read while they still run)
        foreign = {n: sorted(emulated.local_addresses(n) - {emulated.address(n)})
                   for n in emulated.names} if emulated is not None else {}  # fmt: skip
        _kill(workers, signal.SIGTERM)
        _wait(workers, 20.0)
        _kill(syncers, signal.SIGKILL)  # their tapes are on disk (written through at once)
        docs = [_read_json(run_dir / f"worker-{i}.json") for i in range(n_proc)]
        if any(d is None for d in docs):
            raise RuntimeError(f"a fake-learner process wrote no records: {_tail(run_dir / 'logs' / 'worker-0.log')}")
        tapes = [_tape(run_dir / "run", shards, k) for k in range(shards)]
        result = _measure(learners, shards, encoding, seconds, hidden, a, b, hwm, docs, tapes, step_s)  # type: ignore[arg-type]
        result.update(down_encoding=down_encoding or encoding, hosts=hosts)
        if emulated is not None:
            result["foreign_addresses"] = foreign
        result.update(start_s=round(started_s, 1), live_s=round(live_s, 1), wall_s=round(time.monotonic() - cell_t0, 1))
    finally:
        _kill([*workers, *syncers], signal.SIGKILL)
        _wait([*workers, *syncers], 10.0)
        if emulated is not None:
            emulated.down()
        for lf in logs:
            lf.close()
        if keep_dir:
            log.info("kept %s", run_dir)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.rename(path)
    return result


def _await(cond: Any, procs: Sequence[subprocess.Popen[bytes]], run_dir: Path, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"waiting for {what}: {p.args[1:4]} exited ({p.returncode}); logs in {run_dir}/logs")
        if time.monotonic() > end:
            raise RuntimeError(f"waited {timeout_s:.0f} s for {what}; logs in {run_dir}/logs")
        time.sleep(0.2)


def _measure(
    learners: int,
    shards: int,
    encoding: str,
    seconds: float,
    hidden: int,
    a: Snapshot,
    b: Snapshot,
    hwm: list[float | None],
    docs: list[dict[str, Any]],
    tapes: list[list[dict[str, Any]]],
    step_s: float = STEP_S,
) -> dict[str, Any]:
    from ddiloco.core import robust as robust_mod
    from ddiloco.core.config import DiLoCoConfig

    window = b.mono - a.mono
    sends = {(s[0], s[1], s[3]): s[4] for d in docs for s in d["sends"]}
    asked: dict[tuple[int, int], set[int]] = {}
    request_delay_keys: dict[tuple[int, int], list[float]] = {}
    for d in docs:
        for learner, fragment, round_id, t in d["requests"]:
            asked.setdefault((fragment, round_id), set()).add(learner)
            request_delay_keys.setdefault((fragment, round_id), []).append(t)
    robust = DiLoCoConfig().robust  # the cell's config keeps the default
    rounds, late, lateness, reasons, merged_n = 0, 0, [], Counter(), 0
    unmatched, empty, round_s, grace, request_delay, late_answers = 0, 0, [], [], [], 0
    rejected: Counter[str] = Counter()
    for tape in tapes:
        for rec in tape:
            ev = rec.get("event")
            t = rec.get("closed_at") if ev == "round" else rec.get("time")
            if not isinstance(t, (int, float)) or not a.mono <= t < b.mono:
                continue
            if ev == "late":
                late_answers += 1
            elif ev == "rejected":
                rejected[str(rec.get("reason"))] += 1
            if ev != "round":
                continue
            for r in rec.get("rejected") or []:
                rejected[str(r.get("reason"))] += 1
            reasons[str(rec.get("close_reason"))] += 1
            if not rec.get("merged"):
                empty += 1
                continue
            rounds += 1
            merged_n += len(rec["merged"])
            round_s.append(rec["closed_at"] - rec["opened_at"])
            grace.append(float(rec.get("grace_s") or 0.0))
            key = (rec["fragment"], rec["round"])
            request_delay += [t - rec["opened_at"] for t in request_delay_keys.get(key, [])]
            cond = round_condition(rec, sends, asked.get(key), robust, robust_mod.MIN_ANSWERS)
            if cond is None:
                unmatched += 1
                continue
            lateness.append(rec["closed_at"] - cond)
            late += rec["closed_at"] - cond > LATE_S

    def share(x0: float | None, x1: float | None) -> float | None:
        return None if x0 is None or x1 is None else (x1 - x0) / window

    def rate(k: int, key: str) -> float | None:
        s0, s1 = a.status[k], b.status[k]
        if not s0 or not s1 or s1["time"] <= s0["time"]:
            return None
        return (float(s1.get(key, 0)) - float(s0.get(key, 0))) / (s1["time"] - s0["time"])

    def hb_rate(k: int) -> float | None:
        s0, s1 = a.status[k], b.status[k]
        if not s0 or not s1 or s1["time"] <= s0["time"]:
            return None
        return (_heartbeats(b.traffic[k]) - _heartbeats(a.traffic[k])) / (s1["time"] - s0["time"])

    syncer_cpu = [share(x, y) for x, y in zip(a.syncer_cpu, b.syncer_cpu)]
    worker_cpu = [share(x, y) for x, y in zip(a.worker_cpu, b.worker_cpu)]
    received = sum(
        _heartbeats(b.traffic[k], "contribution") - _heartbeats(a.traffic[k], "contribution") for k in range(shards)
    )
    cpu_s = sum(x for x in syncer_cpu if x is not None) * window
    sent_in_window = sum(1 for d in docs for s in d["sends"] if a.mono <= s[4] < b.mono)
    per_learner = [x for d in docs for x in d["learners"]]
    r3 = lambda x: None if x is None else round(x, 3)  # noqa: E731
    import torch

    from ddiloco.workloads.synthetic import Student, SyntheticOptions

    with torch.device("meta"):
        params = sum(p.numel() for p in Student(SyntheticOptions(hidden=hidden)).parameters())
    fragment_mb = params * 4 / NUM_FRAGMENTS / 1e6
    return {
        "format": FORMAT,
        "learners": learners,
        "shards": shards,
        "encoding": encoding,
        "hidden": hidden,
        "params": params,
        "fragments": NUM_FRAGMENTS,
        "fragment_mb": r3(fragment_mb),
        "step_s": step_s,
        "window_s": round(window, 2),
        "merges_per_s": r3(rounds / window),
        "contributions_merged_per_s": r3(merged_n / window),
        "contributions_sent_per_s": r3(sent_in_window / window),
        "rounds": rounds,
        "rounds_empty": empty,
        "rounds_late": late,
        "rounds_unmatched": unmatched,
        "late_share": r3(late / (rounds - unmatched)) if rounds - unmatched > 0 else None,
        "late_s_p50": r3(_quantile(lateness, 0.5)),
        "late_s_p99": r3(_quantile(lateness, 0.99)),
        "late_s_max": r3(max(lateness, default=None) if lateness else None),
        "round_s_p50": r3(_quantile(round_s, 0.5)),
        "round_s_p99": r3(_quantile(round_s, 0.99)),
        "grace_s_mean": r3(sum(grace) / len(grace) if grace else None),
        "request_delay_s_p50": r3(_quantile(request_delay, 0.5)),
        "request_delay_s_p99": r3(_quantile(request_delay, 0.99)),
        "close_reasons": dict(reasons),
        "late_answers": late_answers,
        "rejected": dict(rejected),
        "syncer_cpu": [r3(x) for x in syncer_cpu],
        "syncer_cpu_max": r3(max((x for x in syncer_cpu if x is not None), default=None)),
        "syncer_cpu_ms_per_contribution": r3(1e3 * cpu_s / received) if received else None,
        "contributions_received": received,
        "loadavg": [a.load, b.load],
        "syncer_hwm_mb": [None if x is None else round(x) for x in hwm],
        "heartbeats_per_s": [r3(hb_rate(k)) for k in range(shards)],
        "messages_per_s": [r3(rate(k, "messages")) for k in range(shards)],
        "rate_limited": [int((b.status[k] or {}).get("rate_limited", 0)) for k in range(shards)],
        "learner_processes": len(docs),
        "learner_cpu": r3(sum(x for x in worker_cpu if x is not None)),
        "learner_hwm_mb": [None if d.get("hwm_mb") is None else round(d["hwm_mb"]) for d in docs],
        "learner_unsent": sum(int(d.get("unsent", 0)) for d in docs),
        "learner_problems": [x for x in per_learner if x.get("refused") or x.get("gave_up") or x.get("comm_died")][:5],
        "reconnects": sum(int(x.get("reconnects", 0)) for x in per_learner),
    }


# -- the command ------------------------------------------------------------------------------

COLUMNS = [
    ("enc", "encoding", "{}"),
    ("L", "learners", "{}"),
    ("shards", "shards", "{}"),
    ("merges/s", "merges_per_s", "{:.2f}"),
    ("merged/s", "contributions_merged_per_s", "{:.1f}"),
    ("sent/s", "contributions_sent_per_s", "{:.1f}"),
    ("late", "rounds_late", "{}"),
    ("rounds", "rounds", "{}"),
    ("late p50 s", "late_s_p50", "{:+.2f}"),
    ("round p50 s", "round_s_p50", "{:.2f}"),
    ("req p99 s", "request_delay_s_p99", "{:.3f}"),
    ("syncer CPU", "syncer_cpu", "{}"),
    ("hb/s", "heartbeats_per_s", "{}"),
    ("syncer ms/contrib", "syncer_cpu_ms_per_contribution", "{:.1f}"),
    ("rejoins", "reconnects", "{}"),
    ("learner CPU", "learner_cpu", "{:.2f}"),
    ("load", "loadavg", "{}"),
    ("syncer MB", "syncer_hwm_mb", "{}"),
]


def _cell_text(fmt: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return "/".join("-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v)) for v in value)
    return fmt.format(value)


def table(results: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of cells (a markdown table: the report can take it as it is)."""
    head = "| " + " | ".join(c[0] for c in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    rows = ["| " + " | ".join(_cell_text(f, r.get(k)) for _, k, f in COLUMNS) + " |" for r in results]
    return "\n".join([head, rule, *rows])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learners", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--encodings", nargs="+", default=["fp32", "int4"], choices=ENCODINGS)
    parser.add_argument("--seconds", type=float, default=40.0, help="the measured window of each cell (default 40)")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="the synthetic MLP's width (10,000: 100M)")
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--force", action="store_true", help="measure cached cells again")
    parser.add_argument("--keep", action="store_true", help="keep each cell's run folder (in /tmp)")
    parser.add_argument(
        "--src", type=Path, default=ROOT / "src", help="ddiloco sources to run (e.g. `git archive HEAD src` unpacked)"
    )
    parser.add_argument("--step-s", type=float, default=STEP_S, help="each fake learner's step (default 1 s)")
    parser.add_argument("--down-encoding", default=None, choices=ENCODINGS, help="the down-link's (default: the up's)")
    parser.add_argument("--hosts", action="store_true", help="every shard and fake-learner process on its own "
                        "emulated host (network namespaces; root)")  # fmt: skip
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.worker is not None:
        logging.getLogger().setLevel(logging.ERROR)
        return worker_main(args.worker)
    for name, values in (("--learners", args.learners), ("--shards", args.shards)):
        if any(v < 1 for v in values):
            parser.error(f"{name}: every value must be >= 1")
    if args.seconds <= 0 or args.hidden < 1:
        parser.error("--seconds must be > 0 and --hidden >= 1")
    if not (args.src / "ddiloco" / "__init__.py").is_file():
        parser.error(f"--src {args.src}: no ddiloco package there")
    results = []
    for enc in args.encodings:
        for n in args.learners:
            for s in args.shards:
                t0 = time.monotonic()
                try:
                    r = run_fleet_cell(
                        n,
                        s,
                        enc,
                        args.seconds,
                        args.cache,
                        hidden=args.hidden,
                        force=args.force,
                        keep_dir=args.keep,
                        src=args.src,
                        step_s=args.step_s,
                        down_encoding=args.down_encoding,
                        hosts=args.hosts,
                    )
                except (RuntimeError, ValueError) as e:
                    log.error("cell %s: %s", cell_key(n, s, enc, args.seconds, args.hidden, args.step_s,
                                                      args.down_encoding, args.hosts), e)  # fmt: skip
                    continue
                log.info("cell %s: %.0f s", cell_key(n, s, enc, args.seconds, args.hidden), time.monotonic() - t0)
                results.append(r)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
