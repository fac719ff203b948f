"""The syncer's front door: CURVE keys, ids bound to keys, the default off loopback, learner-side
checks of what it applies, and clocks. The syncer and learners run as threads over real ZeroMQ
sockets on loopback."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from helpers import keyed_syncer, wait_for

from ddiloco.config import load_config
from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.learner import LearnerCore
from ddiloco.core.messages import FragmentUpdate
from ddiloco.errors import DDiLoCoError
from ddiloco.protocol.messages import FetchGlobal, GlobalState, JoinReply, Register
from ddiloco.service.base.clock import SkewedClock
from ddiloco.service.base.keys import ClientKeys, client_keys, is_local, make_keys
from ddiloco.service.base.transport import ZmqLearnerSocket, learner_identity
from ddiloco.service.base.wire import decode, encode
from ddiloco.service.learner.process import LearnerProcess
from ddiloco.service.syncer.service import SyncerService, open_syncer

SETTINGS = [
    "workload.factory=ddiloco.workloads.synthetic:make_workload",
    "workload.options={hidden = 16}",
    "run.num_learners=2",
    "algo.sync_every=8",
    "algo.liveness_timeout_s=1.0",
    "runtime.heartbeat_interval_s=0.1",
    "runtime.syncer_liveness_s=1.0",
    "runtime.status_interval_s=0.5",
    "runtime.backoff_max_s=0.3",
    "runtime.join_timeout_s=3.0",
    "runtime.step_sleep_s=0.01",
]
HOST = "127.0.0.7"


def ask(addr: str, msg, keys: ClientKeys | None = None, timeout_s: float = 2.0, identity: bytes | None = None):
    """Send one message from a fresh DEALER; the first answer, or None."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    # A DEALER without a peer blocks in send forever; a refused CURVE handshake can leave it so.
    s.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    if identity is not None:
        s.setsockopt(zmq.IDENTITY, identity)
    if keys is not None:
        keys.apply(s)
    s.connect(addr)
    try:
        s.send_multipart(encode(msg))
        return decode(s.recv_multipart()) if s.poll(int(timeout_s * 1000)) else None
    except zmq.Again:
        return None  # not even sent: nothing can be answered
    finally:
        s.close(0)


@pytest.fixture()
def keyed(tmp_path):
    """A syncer with CURVE keys on loopback, serving in a thread; two learner key pairs."""
    keys = tmp_path / "keys"
    with keyed_syncer(tmp_path / "run", keys, SETTINGS, HOST) as (cfg, addr, service):
        yield cfg, addr, keys, service


def register(cfg, m: int) -> Register:
    from ddiloco.training.layout import layout_for
    from ddiloco.workloads.config import load_workload

    wl = load_workload(cfg.workload)
    model = wl.build_model(cfg.run.seed)
    from ddiloco.training.layout import param_spec

    return Register(m, 1, param_spec(model), layout_for(model, wl, cfg.algo).digest)


def test_only_allowed_keys_get_anything_and_an_id_is_bound_to_its_key(keyed):
    cfg, addr, keys, service = keyed
    # no key at all: the handshake fails, nothing is read or answered
    assert ask(addr, FetchGlobal("intruder"), timeout_s=1.0) is None
    assert ask(addr, register(cfg, 0), timeout_s=1.0) is None
    # a key the syncer does not know: the same
    stranger = tmp_keys = keys.parent / "stranger"
    make_keys(tmp_keys, learners=1)
    (stranger / "syncer.key").unlink()
    (stranger / "syncer.key").write_bytes((keys / "syncer.key").read_bytes())
    assert ask(addr, FetchGlobal("x"), ClientKeys.load(stranger, "learner-0"), timeout_s=1.0) is None
    # an observer may read the model, not join
    observer = ClientKeys.load(keys, "observer")
    assert isinstance(ask(addr, FetchGlobal("evaluator"), observer), GlobalState)
    reply = ask(addr, register(cfg, 0), observer)
    assert isinstance(reply, JoinReply) and not reply.accepted and "observer" in reply.reason
    # learner 1's key cannot register (or take over) learner 0, even with learner 0's transport identity
    reply = ask(addr, register(cfg, 0), ClientKeys.load(keys, "learner-1"), identity=learner_identity(0))
    assert isinstance(reply, JoinReply) and not reply.accepted and "learner 1's, not learner 0's" in reply.reason
    reply = ask(addr, register(cfg, 0), ClientKeys.load(keys, "learner-0"))
    assert isinstance(reply, JoinReply) and reply.accepted
    assert service.counts["impostor"] == 2


def test_learners_with_keys_train_and_merge_over_curve(keyed, tmp_path):
    cfg, addr, keys, service = keyed
    learners, threads = [], []
    for m in range(2):
        k = ClientKeys.load(keys, f"learner-{m}")
        ln = LearnerProcess(cfg, [addr], m, tmp_path / "run",
                            connect=lambda a, i, k=k: ZmqLearnerSocket(a, i, 0.1, 0.3, k))  # fmt: skip
        learners.append(ln)
        threads.append(threading.Thread(target=ln.run, daemon=True))
        threads[-1].start()
    try:
        wait_for(lambda: min(service.core.versions()) >= 2, 90, "merges over CURVE")
    finally:
        for ln in learners:
            ln.stop = True
        for t in threads:
            t.join(timeout=30)


def test_off_loopback_keys_are_required_unless_insecure_is_said(tmp_path, caplog):
    cfg = load_config(None, SETTINGS)
    with pytest.raises(DDiLoCoError, match=r"--keys DIR, or keys=DIR in Python\), or --insecure"):
        open_syncer(cfg, "tcp://0.0.0.0:5999", tmp_path)  # refused before anything binds
    with pytest.raises(DDiLoCoError, match="--keys DIR"):
        client_keys(["tcp://10.1.2.3:5555"], None, "learner-0", insecure=False)
    assert client_keys(["tcp://10.1.2.3:5555"], None, "learner-0", insecure=True) is None
    assert "INSECURE" in caplog.text
    assert client_keys([f"tcp://{HOST}:5555"], None, "learner-0", insecure=False) is None  # loopback: fine
    assert is_local("tcp://127.0.0.1:1") and is_local("tcp://[::1]:1") and is_local("ipc:///tmp/x")
    assert is_local("tcp://127.0.0.5:0;127.0.0.2:7") and not is_local("tcp://0.0.0.0:1")
    assert not is_local("tcp://node17:5555") and not is_local("tcp://*:5555")
    with pytest.raises(DDiLoCoError, match="is missing"):
        ClientKeys.load(tmp_path, "learner-0")


def update(values, version=1, tokens=100.0, live=2, reason="merged"):
    return FragmentUpdate(0, 0, version, values, tokens, live, 0, reason)


@pytest.mark.parametrize(
    "bad, why",
    [
        ([torch.tensor([math.nan, 0.0])], "non-finite"),
        ([torch.tensor([math.inf, 0.0])], "non-finite"),
        ([torch.zeros(3)], "shape"),
        ([torch.zeros(2, dtype=torch.float64)], "dtype"),
        ([torch.zeros(2), torch.zeros(2)], "tensors"),
    ],
)
def test_a_learner_refuses_to_apply_a_bad_fragment(bad, why):
    from ddiloco.core.fragments import TensorSpec, balanced_layout

    core = LearnerCore(DiLoCoConfig(num_fragments=1), 0, 1, max_merged_tokens=1e6)
    pieces = balanced_layout([TensorSpec("w", (2,))], 1).fragments[0]
    receipt = core.on_update(update(bad), pieces)
    assert receipt.mode == "ignore" and why in receipt.problem and core.base_version == [0]
    assert core.on_update(update([torch.zeros(2)]), pieces).mode == "overwrite"


def test_a_learner_ignores_implausible_versions_and_token_counts():
    from ddiloco.core.fragments import TensorSpec, balanced_layout

    core = LearnerCore(DiLoCoConfig(num_fragments=1), 0, 1, max_merged_tokens=1e6)
    pieces = balanced_layout([TensorSpec("w", (2,))], 1).fragments[0]
    r = core.on_update(update([torch.zeros(2)], tokens=1e30), pieces)
    assert r.mode == "ignore" and "merged_tokens" in r.problem
    r = core.on_update(update([torch.zeros(2)], version=2**52), pieces)
    assert r.mode == "ignore" and "version" in r.problem
    assert core.on_update(update([torch.zeros(2)], version=5), pieces).mode == "overwrite"


@pytest.mark.parametrize("jump_s", [-600.0, 600.0])
@pytest.mark.slow  # a real service run in threads, watched for 3 s of real time
def test_a_wall_clock_jump_changes_no_liveness_or_grace_decision(tmp_path, jump_s):
    """The core runs on the monotonic clock: stepping the wall clock by minutes mid-run leaves
    every learner live and every grace window the size it was."""
    from ddiloco.service.base.transport import InProcessNetwork

    cfg = load_config(None, SETTINGS)
    net = InProcessNetwork()
    clock = SkewedClock()
    service = SyncerService(cfg, net.syncer("inproc://s"), tmp_path, clock=clock, fsync=False)
    learners = [LearnerProcess(cfg, ["inproc://s"], m, tmp_path, connect=net.learner, clock=clock) for m in (0, 1)]
    threads = [threading.Thread(target=service.serve, daemon=True)]
    threads += [threading.Thread(target=ln.run, daemon=True) for ln in learners]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: min(service.core.versions()) >= 1, 90, "merges before the jump")
        rounds_before = service.core._round_ids
        clock.wall_offset += jump_s
        live_seen = []
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # 3 s >> the 1 s liveness timeout
            live_seen.append(len(service.core.live(clock.monotonic())))
            time.sleep(0.05)
        wait_for(lambda: service.core._round_ids > rounds_before + 8, 60, "rounds after the jump")
    finally:
        for ln in learners:
            ln.stop = True
        service.stop()
        for t in threads:
            t.join(timeout=30)
    assert min(live_seen) == 2
    from ddiloco.report.tape import read_tape

    rounds = [r for r in read_tape(Path(tmp_path) / "state" / "tape.jsonl") if r["event"] == "round"]
    assert rounds and not any(r["close_reason"] == "no_live_learners" for r in rounds)
    assert max(r["grace_s"] for r in rounds) <= cfg.algo.max_grace_steps * 1.0  # steps are ~0.01 s


def test_floods_are_rate_limited_per_sender(tmp_path):
    """5000 fake joins and a message flood from one identity: dropped before they cost work,
    and the registered-learner count stays bounded."""
    from ddiloco.service.base.ratelimit import RateLimits
    from ddiloco.service.base.transport import InProcessNetwork

    limits: RateLimits[str] = RateLimits(rate=2.0, burst=10.0, max_keys=3)
    assert sum(limits.allow("a", 0.0) for _ in range(100)) == 10  # the burst, then nothing
    assert limits.allow("a", 0.5)  # refilled at 2/s
    for k in "bcde":
        limits.allow(k, 1.0)
    assert len(limits._buckets) == 3  # a flood of new keys cannot grow memory

    class FrozenClock:  # the flood arrives within one instant, however busy the machine is
        def monotonic(self) -> float:
            return 100.0

        def wall(self) -> float:
            return 1e9

    cfg = load_config(None, SETTINGS)
    net = InProcessNetwork()
    service = SyncerService(cfg, net.syncer("inproc://s"), tmp_path, fsync=False, clock=FrozenClock())
    reg = register(cfg, 0)
    for m in range(5000):  # one sender claiming 5000 ids
        service.handle(b"flooder", encode(Register(m, 1, reg.params, reg.layout)))
    assert len(service.core.learners) <= 10 and service.counts["rate_limited"] >= 4990
    service.stop()
    service.shutdown()
