"""The traffic meter (protocol/traffic.py): every message's category, sums, per-step figures and
the data-parallel baseline, by hand."""

from __future__ import annotations

import json

import pytest
import torch

from ddiloco.core.messages import Ack, Contribution, FragmentRequest, FragmentUpdate, Heartbeat, Join, Leave
from ddiloco.protocol.messages import (
    FetchGlobal,
    GlobalState,
    JoinReply,
    PeerState,
    PeerStateRequest,
    Register,
    RunEnd,
    RunSettings,
    SettingsRequest,
    StatusReply,
    StatusRequest,
    SyncerHeartbeat,
)
from ddiloco.protocol.traffic import (
    HEADER_BYTES,
    ONE_OFF,
    STEADY,
    TENSOR_SPEC_BYTES,
    UNATTRIBUTED,
    TrafficMeter,
    classify,
    dp_ring_bytes,
    merge_traffic,
    payload_nbytes,
    traffic_figures,
)

T = [torch.zeros(10), torch.zeros(3, 4)]  # 22 float32 values: 88 bytes
INC = 1764630000000000


def contribution(learner: int = 3) -> Contribution:
    return Contribution(learner, INC, 2, 17, 12345, T, 24, 49152, 1234, 12345)


def update(reason: str = "merged") -> FragmentUpdate:
    return FragmentUpdate(3, 2, 18, T, 123456789.0, 4, 12345, reason=reason)  # type: ignore[arg-type]


def heartbeat(step: int = 12345, incarnation: int = INC) -> Heartbeat:
    return Heartbeat(3, incarnation, step, 0.123456, 123456, 12.3456, 2.345678, 123456789)


STEADY_MESSAGES = {
    "contribution": contribution(),
    "version": update(),
    "request": FragmentRequest(3, 2, 1234),
    "ack": Ack(3, INC, 2, 18),
    "heartbeat": heartbeat(),
    "syncer_heartbeat": SyncerHeartbeat(2**61 + 12345, 0),
}
ONE_OFF_MESSAGES = [
    (Register(3, INC, [["w", [3, 2]]], "abc"), "registration"),
    (Join(3, INC, []), "registration"),
    (JoinReply(True, "", 7, 0, [0, 1]), "registration"),
    (SettingsRequest(3, INC), "registration"),
    (RunSettings({"run.num_learners": 2}), "registration"),
    (update("join"), "rejoin"),
    (update("stale"), "rejoin"),
    (PeerStateRequest(3, INC), "handoff"),
    (PeerState(3, 1, [], {"0.exp_avg": torch.zeros(5)}), "handoff"),
    (Leave(3, INC), "leave"),
    (RunEnd("stop", "budget"), "run_end"),
    (RunEnd("done", "budget"), "run_end"),
    (FetchGlobal("evaluator"), "observer"),
    (GlobalState({"0": 1}, 0.0, {}), "observer"),
    (StatusRequest("status"), "observer"),
    (StatusReply({}), "observer"),
    (None, "malformed"),
    (object(), "other"),
]


@pytest.mark.parametrize("name", sorted(STEADY_MESSAGES))
def test_steady_state_messages(name: str) -> None:
    kind = classify(STEADY_MESSAGES[name])
    assert kind.steady and kind.category == name.replace("syncer_", "")
    assert kind.category in STEADY


@pytest.mark.parametrize(("msg", "category"), ONE_OFF_MESSAGES)
def test_one_off_messages(msg: object, category: str) -> None:
    kind = classify(msg)
    assert (kind.category, kind.steady) == (category, False)
    assert category in ONE_OFF


def test_after_the_final_sync_is_announced_the_algorithms_messages_are_one_off() -> None:
    for name in ("contribution", "version", "request", "ack"):
        assert classify(STEADY_MESSAGES[name], final=True).category == "final_sync"
    assert classify(heartbeat(), final=True).steady  # liveness goes on as before
    assert classify(update("join"), final=True).category == "rejoin"


def test_payload_bytes_are_the_values_or_the_encoded_payloads() -> None:
    assert payload_nbytes(contribution()) == 88
    assert payload_nbytes(FragmentRequest(3, 2, 1)) == 0
    assert payload_nbytes(PeerState(3, 1, [], {"a": torch.zeros(5), "b": torch.zeros(2, dtype=torch.int64)})) == 36

    class Enc:
        nbytes = 7

    class Compressed:  # what a compressed contribution looks like: its encoded payloads go, not its values
        values = T
        encoded = [Enc(), Enc()]

    assert payload_nbytes(Compressed()) == 14
    Compressed.encoded = []  # an empty list: the values go
    assert payload_nbytes(Compressed()) == 88


def test_dp_baseline_by_hand() -> None:
    assert dp_ring_bytes(1000, 2) == 4000  # 2 * 1/2 * 1000 * 4
    assert dp_ring_bytes(1000, 4) == 6000  # 2 * 3/4 * 1000 * 4
    assert dp_ring_bytes(1000, 1) == 0
    assert dp_ring_bytes(1000, 4, bytes_per_value=2) == 3000
    with pytest.raises(ValueError):
        dp_ring_bytes(1000, 0)


def test_the_meter_sums_per_learner_direction_and_category() -> None:
    m = TrafficMeter()
    m.count(contribution(), 300, "up", 3)
    m.count(contribution(), 300, "up", 3)
    m.count(update(), 250, "down", 3)
    m.count(update("join"), 1000, "down", 3)
    m.count(Register(3, INC, [], "x"), 50, "up", None)  # before it is bound: unattributed
    m.count(heartbeat(step=10), 200, "up", 3)
    m.count(contribution(), 300, "up", 3, final=True)
    assert m.bytes(3, "up", steady=True) == 800
    assert m.bytes(3, "down", steady=True) == 250
    assert m.bytes(3, steady=False) == 1300
    assert m.bytes(None, "up") == 1150
    assert m.steps() == {3: 10}
    assert m.per_step(10, learner=3) == (80.0, 25.0)
    assert m.per_step(0) == (0.0, 0.0)
    d = m.to_dict(params=1000, learners=2)
    json.dumps(d)  # JSON as it is
    by = d["by_learner"]
    assert by["3"]["up"]["contribution"] == {"bytes": 600, "messages": 2}
    assert by["3"]["steps"] == 10
    assert by[UNATTRIBUTED]["up"]["registration"]["bytes"] == 50


def test_steps_follow_the_restart_rule_of_incarnations() -> None:
    m = TrafficMeter()
    m.count(heartbeat(step=10, incarnation=1), 200, "up", 3)
    m.count(heartbeat(step=30, incarnation=1), 200, "up", 3)
    m.count(heartbeat(step=5, incarnation=2), 200, "up", 3)  # restarted: counts again from 0
    m.count(heartbeat(step=20, incarnation=1), 200, "up", 3)  # late, older: no step lost or added
    assert m.steps() == {3: 35}


def test_figures_and_the_ratio_to_data_parallel() -> None:
    m = TrafficMeter()
    for who in (0, 1):
        m.add(who, "up", "contribution", 100 * (who + 1))
        m.add(who, "down", "version", 50)
        m.add(who, "down", "rejoin", 7)
        m.observe_steps(who, 1, 10)
    f = traffic_figures(m.to_dict(params=1000, learners=2))
    assert f["steps"] == 20
    assert f["up_bytes_per_step"] == pytest.approx(300 / 20)
    assert f["down_bytes_per_step"] == pytest.approx(100 / 20)
    assert f["one_off_down_bytes"] == 14
    m.add(0, "up", "handoff", 3_000_000)
    m.add(0, "down", "observer", 999)  # (no one-off of a learner's: apart)
    g = traffic_figures(m.to_dict(params=1000, learners=2))
    assert g["one_off_by_kind"] == {"rejoin": {"up": 0, "down": 14}, "handoff": {"up": 3_000_000, "down": 0}}
    from ddiloco.report.summary import by_kind_line

    assert by_kind_line(g["one_off_by_kind"]) == "handoff 3.0 MB, rejoin 14 B"
    assert f["dp_bytes_per_step"] == 4000
    assert f["dp_ratio_up"] == pytest.approx(4000 / 15)
    assert f["dp_ratio_down"] == pytest.approx(4000 / 5)
    assert f["by_learner"]["1"]["up_bytes_per_step"] == pytest.approx(20.0)
    bare = traffic_figures(m.to_dict())  # no model size: no baseline
    assert bare["dp_ratio_up"] is None and bare["up_bytes_per_step"] == pytest.approx(15)
    assert traffic_figures({})["up_bytes_per_step"] is None


def test_shards_merge_bytes_add_steps_do_not() -> None:
    a, b = TrafficMeter(), TrafficMeter()
    a.add(0, "up", "contribution", 100)
    b.add(0, "up", "contribution", 60)
    a.observe_steps(0, 1, 10)
    b.observe_steps(0, 1, 12)
    merged = merge_traffic([a.to_dict(params=10, learners=2), b.to_dict(), {"by_learner": {"0": "junk", "1": {}}}])
    assert merged["params"] == 10 and merged["learners"] == 2
    assert merged["by_learner"]["0"]["up"]["contribution"] == {"bytes": 160, "messages": 2}
    assert merged["by_learner"]["0"]["steps"] == 12


def test_header_estimates_are_close_to_the_wire() -> None:
    from ddiloco.service.base.wire import encode

    for name, msg in STEADY_MESSAGES.items():
        frames = encode(msg)
        tensors = len(frames) - 1
        header = len(frames[0]) - tensors * TENSOR_SPEC_BYTES
        assert abs(header - HEADER_BYTES[name]) <= 0.25 * HEADER_BYTES[name], (name, header)


SIMULATED = [
    "workload.factory=ddiloco.workloads.synthetic:make_workload",
    "workload.batch_size=16",
    "run.eval_points=1",
    "run.method=decoupled",
    "run.num_learners=2",
    "run.processed_tokens=6000",
    "run.threads=1",
]
"""A short simulated run of 2 learners on the synthetic task."""


def test_a_simulated_run_counts_every_learners_link_and_writes_traffic_json(tmp_path) -> None:
    """The simulator counts what it delivers as the service counts frames: per learner, steady and
    one-off; the steady bytes per step follow from H, P and the model's size."""
    from ddiloco.config import load_config
    from ddiloco.methods import PRESETS
    from ddiloco.report.rundir import write_run_dir
    from ddiloco.sim.run import simulate

    torch.set_num_threads(1)
    cfg = load_config(None, SIMULATED, base=PRESETS["decoupled"])
    result = simulate(cfg)
    assert result.traffic is not None
    f = traffic_figures(result.traffic)
    n = f["params"]
    assert n == sum(t.numel() for t in result.state.values()) and f["learners"] == 2
    assert f["dp_bytes_per_step"] == 2 * (2 - 1) / 2 * n * 4
    for m in ("0", "1"):
        row = f["by_learner"][m]
        assert row["steps"] > 0 and row["up_bytes_per_step"] > 0 and row["down_bytes_per_step"] > 0
        assert row["one_off_down_bytes"] > 0  # the join's fetch
    # steady state sends each value about once per H steps each way (fp32), plus headers
    h = cfg.algo.sync_every
    assert 0.5 * 4 * n / h < f["up_bytes_per_step"] < 2 * 4 * n / h + 1000
    assert f["dp_ratio_up"] == pytest.approx(f["dp_bytes_per_step"] / f["up_bytes_per_step"])
    d = write_run_dir(tmp_path / "sim", cfg, result)
    assert json.loads((d / "metrics" / "traffic.json").read_text()) == result.traffic
    summary = json.loads((d / "summary.json").read_text())
    assert summary["traffic"]["up_bytes_per_step"] == pytest.approx(f["up_bytes_per_step"])


def test_the_final_sync_moves_each_learners_last_progress_encoded_not_the_model_in_fp32() -> None:
    """The final sync is contributions and merged versions like any round: each learner's
    remaining progress goes up as a delta in the run's up encoding (with its error feedback) and
    the merged versions come down on the chain (the acks beside them). At int4 that is about N/8
    each way per learner (N: the model's fp32 bytes), headers and scales included; not N in fp32."""
    from ddiloco.config import load_config
    from ddiloco.methods import PRESETS
    from ddiloco.sim.run import simulate

    torch.set_num_threads(1)
    settings = [
        *SIMULATED,
        "algo.up_encoding=int4",
        "algo.down_encoding=int4",
        "algo.error_feedback=true",
        "workload.options={hidden = 256}",  # large enough that headers do not hide the payloads
    ]
    result = simulate(load_config(None, settings, base=PRESETS["decoupled"]))
    assert result.traffic is not None
    final_rounds = [r for r in result.tape if r.get("event") == "round" and r["close_reason"] == "final"]
    assert len(final_rounds) == result.num_fragments and all(len(r["merged"]) == 2 for r in final_rounds)
    n_bytes = 4 * sum(t.numel() for t in result.state.values())
    bound = 0.2 * n_bytes  # int4: 1/8 of fp32, plus a scale per block and the headers
    for m in ("0", "1"):
        for direction in ("up", "down"):
            sent = result.traffic["by_learner"][m][direction]["final_sync"]["bytes"]
            assert 0 < sent <= bound, (m, direction, sent / n_bytes)


def test_a_restarted_syncer_goes_on_counting_from_its_traffic_file(tmp_path) -> None:
    import ddiloco
    from ddiloco.config import load_config
    from ddiloco.service.base.transport import InProcessNetwork

    torch.set_num_threads(1)
    cfg = load_config(None, ["run.num_learners=2", "algo.sync_every=4"])
    net = InProcessNetwork()
    d = tmp_path / "run"

    def server(address: str) -> ddiloco.SyncerServer:
        torch.manual_seed(0)
        return ddiloco.SyncerServer(torch.nn.Linear(4, 2), address, d, config=cfg, transport=net.syncer(address),
                                    fsync=False).start()  # fmt: skip

    first = server("inproc://a")
    first.service.traffic.add(0, "up", "contribution", 500)
    first.service.traffic.observe_steps(0, 1, 10)
    first.stop()  # its shutdown writes its status, and with it metrics/traffic.json
    saved = json.loads((d / "metrics" / "traffic.json").read_text())
    assert saved["params"] == 10 and saved["learners"] == 2
    assert saved["by_learner"]["0"]["up"]["contribution"]["bytes"] == 500
    second = server("inproc://b")
    second.service.traffic.add(0, "up", "contribution", 300)
    second.service.traffic.observe_steps(0, 1, 12)  # the same process, heard again: its steps are cumulative
    got = second.service.traffic_dict()["by_learner"]["0"]
    assert got["up"]["contribution"] == {"bytes": 800, "messages": 2} and got["steps"] == 12
    second.stop()
    assert json.loads((d / "summary.json").read_text())["traffic"]["by_learner"]["0"]["up_bytes"] == 800
