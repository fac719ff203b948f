"""The fleet view: heartbeat progress on the wire and in the core, ``ddiloco status`` against a
live syncer on loopback and against its run folder, an unreachable address, and
metrics/learners.jsonl. Bounded in time; progress is asserted, never durations."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
import torch
from helpers import wait_for
from torch import nn

import ddiloco
from ddiloco.cli import main
from ddiloco.config import load_config
from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.messages import Ack, Heartbeat, Leave
from ddiloco.core.syncer import Syncer
from ddiloco.protocol.config import RuntimeConfig
from ddiloco.protocol.learner_session import Registration
from ddiloco.protocol.messages import Register
from ddiloco.protocol.syncer_session import Budget, SyncerSession
from ddiloco.service.base.observer import NoReply, fetch_status
from ddiloco.service.base.wire import MAX_HEADER, SCHEMA, WireError, decode, encode
from ddiloco.service.ops.launcher import free_port
from ddiloco.service.ops.status_cmd import merge_views
from ddiloco.service.syncer.fleet_status import fleet_status, learner_records, status_reply

SETTINGS = [
    "algo.sync_every=8",
    "algo.liveness_timeout_s=1.0",
    "runtime.heartbeat_interval_s=0.1",
    "runtime.syncer_liveness_s=1.0",
    "runtime.status_interval_s=0.2",
    "runtime.metrics_interval_s=0.2",
    "runtime.snapshot_interval_s=1.0",
    "runtime.backoff_max_s=0.3",
    "runtime.join_timeout_s=10.0",
]
RECORD_KEYS = {"event", "time", "learner", "incarnation", "state", "steps", "tokens", "busy_s", "loss", "bytes_sent"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def cfg():
    return load_config(None, SETTINGS)


# -- the heartbeat's progress fields ------------------------------------------------------------


def test_heartbeat_progress_round_trips_and_bad_values_are_refused():
    hb = Heartbeat(3, 7, 120, 0.05, tokens=61_440, busy_s=6.25, loss=2.5, bytes_sent=123_456)
    assert decode(encode(hb)) == hb
    assert Heartbeat(3, 7, 120, 0.05).loss == -1.0  # defaults: the simulator's heartbeats need none

    def raw(**fields):
        base = {"learner": 3, "incarnation": 7, "step": 120, "step_time_s": 0.05, **fields}
        return [json.dumps({"v": SCHEMA, "type": "Heartbeat", "fields": base, "tensors": []}).encode()]

    assert decode(raw(tokens=5, loss=-1.0)).tokens == 5
    for bad in ({"tokens": -1}, {"loss": math.nan}, {"loss": -2.0}, {"busy_s": -0.5}, {"bytes_sent": 2**60}):
        with pytest.raises(WireError):
            decode(raw(**bad))
    for bad in ({"tokens": -1}, {"loss": math.nan}):
        with pytest.raises(ValueError, match="refusing to encode"):
            encode(Heartbeat(3, 7, 120, 0.05, **bad))


def test_the_session_keeps_each_learners_progress_and_the_fleet_view_shows_it():
    layout = balanced_layout([TensorSpec("w", (4,)), TensorSpec("b", (4,))], 2)
    core = Syncer(DiLoCoConfig(), layout, {"w": torch.zeros(4), "b": torch.zeros(4)}, [False, False])
    params = [["w", [4]], ["b", [4]]]
    session = SyncerSession(core, RuntimeConfig(), Budget(), Registration(params, layout.digest()), 0.0)

    def join(m: int, incarnation: int, t: float) -> None:
        session.receive(m, Register(m, incarnation, params, layout.digest()), t)

    join(0, 1, 0.0)
    # (learner 0 alone when it reports: beside a live learner with no rate yet its tokens would wait)
    session.receive(0, Heartbeat(0, 1, 40, 0.5, tokens=320, busy_s=20.0, loss=1.5, bytes_sent=4096), 1.0)
    join(1, 1, 1.0)
    session.receive(1, Heartbeat(1, 1, 10, 0.0, loss=-1.0), 1.0)
    session.receive(0, Ack(0, 1, 0, 0), 1.0)
    session.receive(1, Leave(1, 1), 2.0)
    view = fleet_status(session, 2.0, shard=0, run_time_s=12.0)
    one, two = view["learners"]
    assert one["state"] == "up" and one["step"] == 40 and one["tokens"] == 320 and one["loss"] == 1.5
    assert one["steps_per_s"] == 2.0 and one["busy_s"] == 20.0 and one["bytes_sent"] == 4096
    assert one["behind"] == 0 and one["contribution_age_s"] is None and one["heard_age_s"] == 1.0
    assert two["state"] == "left" and two["loss"] is None and two["steps_per_s"] is None and two["behind"] is None
    assert [f["version"] for f in view["fragments"]] == [0, 0] and view["learners_total"] == 2
    assert view["processed_tokens"] == 320
    assert decode(encode(status_reply(view))).status == json.loads(json.dumps(view))
    records = learner_records(session, 2.0, 12.0)
    assert all(set(r) == RECORD_KEYS and r["event"] == "learner" and r["time"] == 12.0 for r in records)
    assert [r["learner"] for r in records] == [0, 1]
    join(2, 1, 3.0)  # not heard since it joined: no record of zeros (they would read as a restart)
    assert [r["learner"] for r in learner_records(session, 3.0, 13.0)] == [0, 1]
    # A new incarnation starts its counters again; the fleet's processed tokens keep its predecessor's.
    join(0, 2, 10.0)
    progress = session.fleet.progress[0]
    assert progress.tokens == 0 and progress.loss is None and session.fleet.processed_tokens() == 320
    assert [r["learner"] for r in learner_records(session, 10.0, 20.0)] == [1]


def test_a_reply_too_large_for_the_wire_is_trimmed_and_merged_views_add_up():
    entry = {"learner": 0, "state": "up", "step": 1, "tokens": 2, "steps_per_s": 3.0, "loss": 1.0, "busy_s": 4.0,
             "bytes_sent": 5, "heard_age_s": 0.1, "contribution_age_s": 6.0, "behind": 1}  # fmt: skip
    big = {"learners": [{**entry, "learner": m, "pad": "x" * 200} for m in range(8192)], "learners_total": 8192}
    reply = status_reply(big)
    assert 0 < len(reply.status["learners"]) < 8192 and reply.status["learners_total"] == 8192
    assert len(encode(reply)[0]) <= MAX_HEADER
    shard0 = {"shard": 0, "learners": [entry], "fragments": [{"fragment": 0}], "fragments_total": 1}
    shard1 = {"shard": 1, "learners": [{**entry, "step": 5, "behind": 2, "state": "down"}],
              "fragments": [{"fragment": 1}], "fragments_total": 1}  # fmt: skip
    both = merge_views([shard1, shard0])
    assert both["learners"] == [{**entry, "step": 5, "behind": 3}]
    assert [f["fragment"] for f in both["fragments"]] == [0, 1]


def test_the_status_shows_each_learners_traffic_per_step_and_the_shards_add_up():
    from rich.console import Console

    from ddiloco.protocol.traffic import TrafficMeter
    from ddiloco.service.ops.status_cmd import render

    layout = balanced_layout([TensorSpec("w", (4,)), TensorSpec("b", (4,))], 2)
    core = Syncer(DiLoCoConfig(), layout, {"w": torch.zeros(4), "b": torch.zeros(4)}, [False, False])
    params = [["w", [4]], ["b", [4]]]
    session = SyncerSession(core, RuntimeConfig(), Budget(), Registration(params, layout.digest()), 0.0)
    session.receive(0, Register(0, 1, params, layout.digest()), 0.0)
    meter = TrafficMeter()
    meter.add(0, "up", "contribution", 400)
    meter.add(0, "down", "version", 200)
    meter.add(0, "down", "rejoin", 32)
    meter.observe_steps(0, 1, 10)
    view = fleet_status(session, 1.0, shard=0, run_time_s=1.0, traffic=meter.to_dict(params=8, learners=2))
    assert view["learners"][0]["up_bytes_per_step"] == 40 and view["learners"][0]["down_bytes_per_step"] == 20
    t = view["traffic"]
    assert t["up_bytes_per_step"] == 40 and t["one_off_down_bytes"] == 32 and t["dp_bytes_per_step"] == 32
    assert t["dp_ratio_up"] == 32 / 40 and "by_learner" not in t
    both = merge_views([view, {**view, "shard": 1}])  # a second shard's link carries as much again
    assert both["learners"][0]["up_bytes_per_step"] == 80 and both["traffic"]["up_bytes_per_step"] == 80
    assert both["traffic"]["dp_ratio_up"] == 32 / 80 and both["traffic"]["one_off_down_bytes"] == 64
    out = Console(width=200, record=True)
    out.print(render(both, "(test)"))
    text = out.export_text()
    assert "traffic per learner per inner step (steady state): up 80 B, down 40 B" in text
    assert "data-parallel fp32 32 B/step: 0.4x fewer / 0.8x fewer" in text


def test_status_of_a_live_fleet_then_of_its_run_folder(tmp_path, capsys):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    server = ddiloco.SyncerServer(Net(), "tcp://127.0.0.1:*", tmp_path, config=cfg(), fsync=False).start()
    stop = threading.Event()
    errors: list[BaseException] = []

    def train(m: int) -> None:
        try:
            torch.manual_seed(10 + m)
            model = Net()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            with ddiloco.Learner(model, server.address, learner_id=m, config=cfg()) as learner:
                for _ in range(3000):  # bounded even if the test never says stop
                    if stop.is_set():
                        break
                    loss = model(torch.randn(8, 8)).pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    learner.step(tokens=8, loss=loss)
                    time.sleep(0.01)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=train, args=(m,)) for m in (0, 1)]
    try:
        for t in threads:
            t.start()

        def progressed():
            try:
                st = fetch_status(server.address, 5.0)
            except NoReply:
                return None  # slow to answer: ask again
            ok = len(st["learners"]) == 2
            ok = ok and all(ln["step"] > 0 and ln["tokens"] > 0 and ln["loss"] is not None for ln in st["learners"])
            ok = ok and all(ln["contribution_age_s"] is not None and ln["bytes_sent"] > 0 for ln in st["learners"])
            return st if ok and any(f["version"] > 0 for f in st["fragments"]) else None

        # polled at 1 s: status requests are limited per key (runtime.max_fetches_per_s = 2, bursts of 10)
        wait_for(progressed, 120, "both learners' progress and a merge in the status", poll=1.0)
        assert main(["status", server.address, "--json", "--timeout", "120"]) == 0
        view = json.loads(capsys.readouterr().out)
        assert [ln["state"] for ln in view["learners"]] == ["up", "up"]
        assert all(ln["bytes_sent"] > 0 and ln["busy_s"] > 0 for ln in view["learners"])
        assert view["fragments"] and all(f["version"] >= 0 for f in view["fragments"])
        assert main(["status", server.address, "--timeout", "120"]) == 0  # a busy machine answers late
        shown = capsys.readouterr().out
        assert "learners: 2 up of 2" in shown and "fragments:" in shown and "docs/operations.md#terms" in shown
        assert "memory (shard 0): values " in shown and "momentum " in shown and "(reached in: " in shown
        assert view["memory"]["model"] == 0 and view["memory"]["rss_peak"] >= view["memory"]["rss"] > 0
        wait_for(lambda: len(_records(tmp_path)) >= 4, 30, "learner records in metrics/learners.jsonl")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        server.stop()
    assert not errors, errors
    assert main(["status", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "from the run folder, last written" in shown and "learners:" in shown
    records = _records(tmp_path)
    assert all(set(r) == RECORD_KEYS and r["event"] == "learner" for r in records)
    assert {r["learner"] for r in records} == {0, 1} and all(r["state"] in ("up", "down", "left") for r in records)
    assert any(r["steps"] > 0 and r["tokens"] > 0 and r["loss"] is not None for r in records)
    assert all(r["time"] >= 0 for r in records) and [r["time"] for r in records] == sorted(r["time"] for r in records)


def _records(run_dir) -> list[dict]:
    path = run_dir / "metrics" / "learners.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_an_unreachable_address_says_so_in_one_line_and_fails_quickly(capsys):
    addr = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    t0 = time.monotonic()
    assert main(["status", addr, "--timeout", "0.3"]) != 0
    assert time.monotonic() - t0 < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"no answer from {addr} within 0.3 s: is the syncer running?" in err[0]


def test_a_client_whose_request_cannot_even_be_queued_gets_no_answer_instead_of_hanging(monkeypatch):
    """A DEALER with no peer blocks in send for ever (a refused CURVE handshake can leave it so):
    here every new socket is made peerless-blocking (IMMEDIATE) towards an address nobody serves."""
    import zmq

    from ddiloco.service.ops.evaluator import fetch_global

    ctx = zmq.Context.instance()
    plain = ctx.socket

    def immediate(kind):
        s = plain(kind)
        s.setsockopt(zmq.IMMEDIATE, 1)
        return s

    monkeypatch.setattr(ctx, "socket", immediate)
    addr = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(NoReply, match="no answer"):
        fetch_status(addr, 0.2)
    assert fetch_global([addr], 0.2) is None  # the evaluator's wrapper: None, and it asks again later


def test_a_folder_without_status_files_is_refused(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) != 0
    assert "no status/syncer-*.json" in capsys.readouterr().err


def test_with_keys_an_observer_key_may_ask_and_a_keyless_client_gets_nothing(tmp_path, capsys):
    from ddiloco.service.base.keys import ServerKeys, make_keys
    from ddiloco.service.base.transport import ZmqSyncerSocket
    from ddiloco.service.syncer.service import SyncerService

    keys = tmp_path / "keys"
    make_keys(keys, learners=1)
    synthetic = ["workload.factory=ddiloco.workloads.synthetic:make_workload", "workload.options={hidden = 8}"]
    settings = [*SETTINGS, *synthetic]
    host = "127.0.0.8"
    addr = f"tcp://{host}:{free_port(host)}"
    server_keys = ServerKeys.load(keys)
    service = SyncerService(load_config(None, settings), ZmqSyncerSocket(addr, keys=server_keys), tmp_path / "run",
                            fsync=False, keys=server_keys)  # fmt: skip
    t = threading.Thread(target=service.serve, daemon=True)
    t.start()
    try:
        assert main(["status", addr, "--keys", str(keys), "--json"]) == 0
        view = json.loads(capsys.readouterr().out)
        assert view["learners"] == [] and view["fragments"] and view["shard"] == 0
        assert main(["status", addr, "--timeout", "0.5"]) != 0  # no key: the handshake fails, nothing is answered
        assert "no answer from" in capsys.readouterr().err
    finally:
        service.stop()
        t.join(timeout=30)
