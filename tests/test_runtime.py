"""The real runtime on loopback: one shared cluster (syncer + 2 learners as processes) on
separate loopback addresses, a small synthetic model. Tests assert progress, never timing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq
from helpers import stop_processes, wait_for

from ddiloco.report.tape import read_jsonl, rounds_of
from ddiloco.service.ops.launcher import free_port

pytestmark = pytest.mark.slow  # every test runs the syncer and learners as processes

SYNCER_HOST = "127.0.0.2"
SETTINGS = [
    "--set",
    "workload.factory=ddiloco.workloads.synthetic:make_workload",
    "--set",
    "run.num_learners=2",
    "--set",
    "algo.sync_every=8",
    "--set",
    "runtime.step_sleep_s=0.02",
    "--set",
    "runtime.heartbeat_interval_s=0.1",
    "--set",
    "algo.liveness_timeout_s=1.0",
    "--set",
    "runtime.syncer_liveness_s=1.0",
    "--set",
    "runtime.status_interval_s=0.2",
    "--set",
    "runtime.snapshot_interval_s=2.0",
    "--set",
    "runtime.backoff_max_s=0.5",
    "--set",
    "runtime.join_timeout_s=5.0",
    "--set",
    "runtime.duration_s=900",  # a safety cap, past the module; a run meant to end sets run.processed_tokens (work)
]
# The shared cluster's fleet: learners 0 and 1, and room for id 2 (the torchrun group). Every
# process that talks to it claims these settings (a learner's must be the run's).
CLUSTER = [*SETTINGS, "--set", "run.num_learners=3"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


class Cluster:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.port = free_port(SYNCER_HOST)
        self.addr = f"tcp://{SYNCER_HOST}:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = self.run_dir / f"{name}.log"
        self.logs[name] = log
        p = subprocess.Popen(
            [sys.executable, "-m", "ddiloco.cli", *args, *CLUSTER],
            stdout=open(log, "ab"),
            stderr=subprocess.STDOUT,
            env=ENV,
        )
        self.procs[name] = p
        return p

    def start_syncer(self) -> subprocess.Popen:
        return self.start("syncer", "syncer", "--bind", self.addr, "--run-dir", str(self.run_dir))

    def start_learner(self, m: int) -> subprocess.Popen:
        # each learner connects from its own loopback address (source;destination)
        src = f"tcp://127.0.0.{3 + m}:0;{SYNCER_HOST}:{self.port}"
        return self.start(
            f"learner-{m}",
            "learner",
            "--syncer",
            src,
            "--id",
            str(m),
            "--run-dir",
            str(self.run_dir),
            "--device",
            "cpu",
        )

    def learner(self, m: int) -> dict:
        return read(self.run_dir / "status" / f"learner-{m}.json")

    def syncer(self) -> dict:
        return read(self.run_dir / "status" / "syncer-0.json")

    def tape(self) -> list[dict]:
        from ddiloco.report.tape import read_tape

        return read_tape(self.run_dir / "state" / "tape.jsonl")

    def versions(self) -> list[int]:
        return list(self.syncer().get("versions", {}).values())

    def kill(self, name: str) -> None:
        p = self.procs[name]
        p.send_signal(signal.SIGKILL)
        p.wait()

    def stop(self) -> None:
        stop_processes(self.procs.values(), timeout=15)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    c.start_syncer()
    wait_for(lambda: c.syncer(), 60, "the syncer to come up")
    for m in (0, 1):
        c.start_learner(m)
    wait_for(lambda: all(c.learner(m).get("steps", 0) > 5 for m in (0, 1)), 60, "both learners to train")
    wait_for(lambda: min(c.versions()) > 0, 60, "every fragment to be merged once")
    for m in (0, 1):  # the join fetch delivered every fragment (no timeout fallback)
        assert "global fragments within" not in c.logs[f"learner-{m}"].read_text()
    yield c
    c.stop()


def wall(record: dict, key: str) -> float:
    """A tape time (the syncer's monotonic clock) as wall-clock time."""
    return record[key] + record["wall_offset"]


def merged_learners(rounds: list[dict]) -> set[int]:
    """Learners that took part in a merge of these tape lines (``was_merged``)."""
    return {m.learner for r in rounds_of(rounds) for m in r.took_part}


def test_malformed_and_unknown_sender_are_rejected_while_training_goes_on(cluster):
    from ddiloco.core.messages import Contribution
    from ddiloco.service.base.wire import encode

    before = cluster.syncer()
    steps = [cluster.learner(m)["steps"] for m in (0, 1)]
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, b"intruder")
    s.connect(cluster.addr)
    s.send_multipart([b"not json at all", b"\x00\x01"])
    s.send_multipart([b'{"v": 1, "type": "Heartbeat", "fields": {"learner": "x"}, "tensors": []}'])
    s.send_multipart(
        encode(
            Contribution(
                learner=7,
                incarnation=1,
                fragment=0,
                base_version=0,
                seq=1,
                values=[torch.zeros(1)],
                steps=1,
                tokens=10,
                data_position=0,
                step=0,
            )
        )
    )
    # (the frames that are not JSON are malformed; the Heartbeat of wire schema 1 is of a schema not served)
    wait_for(lambda: cluster.syncer().get("malformed", 0) >= before.get("malformed", 0) + 1, 20, "malformed count")
    wait_for(
        lambda: cluster.syncer().get("other_schema", 0) >= before.get("other_schema", 0) + 1, 20, "other schema count"
    )
    wait_for(
        lambda: cluster.syncer().get("unknown_sender", 0) >= before.get("unknown_sender", 0) + 1,
        20,
        "unknown sender count",
    )
    s.close()
    assert cluster.procs["syncer"].poll() is None
    wait_for(lambda: all(cluster.learner(m)["steps"] > steps[m] + 5 for m in (0, 1)), 30, "training to go on")


def test_syncer_restart_resumes_from_the_durable_state_bit_for_bit(cluster):
    from ddiloco.config import load_config
    from ddiloco.core.syncer import Syncer
    from ddiloco.service.ops.evaluator import fetch_global
    from ddiloco.service.syncer.store import SyncerStore
    from ddiloco.training.layout import layout_for
    from ddiloco.workloads.config import load_workload

    cluster.kill("syncer")
    steps = [cluster.learner(m)["steps"] for m in (0, 1)]
    # learners train on while the syncer is away
    wait_for(
        lambda: all(cluster.learner(m)["steps"] > steps[m] + 10 for m in (0, 1)),
        30,
        "learners to train while the syncer is down",
    )
    overrides = [a for a in SETTINGS if a != "--set"]
    cfg = load_config(None, overrides)
    wl = load_workload(cfg.workload)
    model = wl.build_model(cfg.run.seed)
    layout = layout_for(model, wl, cfg.algo)
    persisted = Syncer(cfg.algo, layout.fragments, dict(model.named_parameters()), layout.embedding_like)
    with SyncerStore(cluster.run_dir, fsync=False) as store:  # holds the folder's lock until the block ends
        found = store.restore(persisted.layout, persisted.owned)
        assert found is not None
        persisted.restore(found.fragments, found.syncer_meta)
    durable = persisted.versions()
    cluster.start_syncer()
    state = wait_for(lambda: fetch_global([cluster.addr], timeout_s=2.0), 60, "the restarted syncer to answer")[0]
    same = 0
    for p_text, v in state.versions.items():
        p = int(p_text)
        assert v >= durable[p]  # versions never go backwards
        if v == durable[p]:
            same += 1
            for i, t in enumerate(persisted.fragments[p].values):
                assert torch.equal(state.tensors[f"{p}.{i}"], t)
    assert same > 0
    wait_for(lambda: sum(cluster.versions()) > sum(durable) + 4, 60, "merges to resume after the restart")
    assert all(cluster.procs[f"learner-{m}"].poll() is None for m in (0, 1))


def test_port_in_use_fails_at_start_naming_the_port(cluster):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddiloco.cli",
            "syncer",
            "--bind",
            cluster.addr,
            "--run-dir",
            str(cluster.run_dir / "other"),
            *SETTINGS,
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert out.returncode == 2
    assert f"cannot bind the syncer to {cluster.addr}" in out.stderr and "port" in out.stderr


def test_mismatched_model_is_refused_naming_the_first_tensor(cluster):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddiloco.cli",
            "learner",
            "--syncer",
            cluster.addr,
            "--id",
            "1",  # an id of the run's (0..2): another is refused before its model is looked at
            "--run-dir",
            str(cluster.run_dir / "mismatched"),  # the run's own folder refuses a different config at once
            "--device",
            "cpu",
            *CLUSTER,
            "--set",
            "workload.options={hidden = 32}",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert out.returncode == 3
    assert "does not match the syncer's fragment layout" in out.stderr and "embed.weight (32, 16)" in out.stderr


def test_a_learner_that_never_reaches_its_syncer_exits_with_one_line(tmp_path):
    """A wrong host or port: the first join gets no answer within runtime.join_timeout_s, so
    the learner exits non-zero saying what to check (it does not train on alone)."""
    port = free_port("127.0.0.5")
    out = subprocess.run(
        [
            sys.executable, "-m", "ddiloco.cli", "learner", "--syncer", f"tcp://127.0.0.5:{port}", "--id", "0",
            "--run-dir", str(tmp_path), "--device", "cpu", *SETTINGS, "--set", "runtime.join_timeout_s=1.0",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 5, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if "no answer from the syncer" in line]
    assert len(lines) == 1 and f"127.0.0.5:{port}" in lines[0] and "runtime.join_timeout_s" in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    assert read(tmp_path / "status" / "learner-0.json").get("steps", 0) == 0  # it never trained alone


def test_torchrun_learner_group_applies_the_same_fragments_on_every_rank(cluster):
    """One learner = a 2-rank torchrun group with DDP inside; rank 0 talks to the syncer."""
    log = cluster.run_dir / "torchrun.log"
    joined_at = time.time()
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",
            "-m",
            "ddiloco",
            "learner",
            "--syncer",
            cluster.addr,
            "--id",
            "2",
            "--run-dir",
            str(cluster.run_dir),
            "--device",
            "cpu",
            *CLUSTER,
        ],
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        env=ENV,
        start_new_session=True,
    )
    try:
        wait_for(
            lambda: 2
            in merged_learners(
                [r for r in cluster.tape() if r.get("event") == "round" and wall(r, "opened_at") > joined_at]
            ),
            120,
            "the torchrun learner to contribute",
        )
        wait_for(lambda: cluster.learner(2).get("applied", 0) > 5, 60, "merged fragments to come back to the group")
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=60)
    r0, r1 = cluster.learner(2), read(cluster.run_dir / "status" / "learner-2.rank1.json")
    assert r0["world"] == r1["world"] == 2
    assert r0["steps"] == r1["steps"] and r0["steps"] > 0
    assert r0["param_checksum"] == r1["param_checksum"], log.read_text()[-2000:]


def test_syncer_sharded_by_fragment(tmp_path):
    """Two syncer shards own disjoint fragments; one learner talks to both."""
    from ddiloco.service.ops.evaluator import fetch_global

    host = "127.0.0.6"
    addrs = [f"tcp://{host}:{free_port(host)}" for _ in range(2)]
    procs = []
    try:
        for i, a in enumerate(addrs):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "ddiloco.cli",
                        "syncer",
                        "--bind",
                        a,
                        "--run-dir",
                        str(tmp_path),
                        "--shard",
                        str(i),
                        "--num-shards",
                        "2",
                        *SETTINGS,
                    ],
                    stdout=open(tmp_path / f"s{i}.log", "ab"),
                    stderr=subprocess.STDOUT,
                    env=ENV,
                )
            )
        wait_for(lambda: all((tmp_path / "status" / f"syncer-{i}.json").exists() for i in (0, 1)), 60, "both shards up")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ddiloco.cli",
                    "learner",
                    *[x for a in addrs for x in ("--syncer", a)],
                    "--id",
                    "0",
                    "--run-dir",
                    str(tmp_path),
                    "--device",
                    "cpu",
                    *SETTINGS,
                ],
                stdout=open(tmp_path / "l.log", "ab"),
                stderr=subprocess.STDOUT,
                env=ENV,
            )
        )
        shard_versions = lambda i: read(tmp_path / "status" / f"syncer-{i}.json").get("versions", {})
        wait_for(
            lambda: all(shard_versions(i) and min(shard_versions(i).values()) > 1 for i in (0, 1)),
            60,
            "every fragment of both shards to be merged",
        )
        states = fetch_global(addrs)
        owned = [set(map(int, s.versions)) for s in states]
        assert owned[0] == {p for p in range(8) if p % 2 == 0} and owned[1] == {p for p in range(8) if p % 2 == 1}
        assert (tmp_path / "state" / "shard-0").is_dir() and (tmp_path / "state" / "shard-1").is_dir()
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)


def _ip(*args: str) -> bool:
    return subprocess.run(["ip", *args], capture_output=True).returncode == 0


def test_across_network_namespaces(tmp_path):
    """Syncer and learner on two hosts of our own: network namespaces joined by a veth pair
    (skipped where the machine does not allow namespaces)."""
    import shutil

    tag = f"{os.getpid() % 100000}"
    ns_s, ns_l = f"dds{tag}", f"ddl{tag}"
    if shutil.which("ip") is None or os.geteuid() != 0 or not _ip("netns", "add", ns_s):
        pytest.skip("network namespaces are not available here")
    procs = []
    try:
        assert _ip("netns", "add", ns_l)
        assert _ip("link", "add", f"vs{tag}", "type", "veth", "peer", "name", f"vl{tag}")
        assert _ip("link", "set", f"vs{tag}", "netns", ns_s) and _ip("link", "set", f"vl{tag}", "netns", ns_l)
        for ns, dev, addr in ((ns_s, f"vs{tag}", "10.231.7.1/30"), (ns_l, f"vl{tag}", "10.231.7.2/30")):
            assert _ip("-n", ns, "addr", "add", addr, "dev", dev)
            assert _ip("-n", ns, "link", "set", dev, "up") and _ip("-n", ns, "link", "set", "lo", "up")
        addr = "tcp://10.231.7.1:5601"
        from ddiloco.service.base.keys import make_keys

        keys = tmp_path / "keys"  # off loopback, CURVE is required: the test crosses the veth encrypted
        make_keys(keys, learners=1)
        run = lambda ns, *args, name: subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "ddiloco.cli", *args, *SETTINGS],
            stdout=open(tmp_path / f"{name}.log", "ab"),
            stderr=subprocess.STDOUT,
            env=ENV,
        )
        procs.append(
            run(ns_s, "syncer", "--bind", addr, "--run-dir", str(tmp_path), "--keys", str(keys), name="syncer")
        )
        wait_for(lambda: read(tmp_path / "status" / "syncer-0.json"), 60, "the syncer in its namespace")
        procs.append(
            run(
                ns_l,
                "learner",
                "--syncer",
                addr,
                "--id",
                "0",
                "--run-dir",
                str(tmp_path),
                "--device",
                "cpu",
                "--keys",
                str(keys),
                name="learner",
            )
        )
        versions = lambda: read(tmp_path / "status" / "syncer-0.json").get("versions", {}).values()
        wait_for(lambda: min(versions(), default=0) >= 2, 60, "merges of contributions that crossed the veth pair")
        wait_for(
            lambda: read(tmp_path / "status" / "learner-0.json").get("applied", 0) > 8 + 8,
            60,
            "merged versions to come back",
        )
    finally:
        stop_processes(procs)
        _ip("netns", "del", ns_s)
        _ip("netns", "del", ns_l)


def test_train_launcher_with_chaos_writes_the_run_folder(tmp_path):
    """`ddiloco train --chaos`: learners are SIGKILLed and restarted, faults are logged, and the
    run ends with the simulator's summary table and run folder.

    The run ends on a token budget (work), never on time: on a busy machine the learners' start-up
    alone once ate a 16 s time budget, and the figures of a run that did no work were (rightly) 0.
    Every step sleeps runtime.step_sleep_s, so the budget takes some seconds of training however
    fast the machine; the seed's first kill comes before that, so a kill always lands."""
    from ddiloco.chaos.schedule import make_schedule
    from ddiloco.config import load_config
    from ddiloco.report.summary import is_learner_failure

    chaos = ["chaos.enabled=true", "chaos.kill_mtbf_s=20", 'chaos.stragglers=["1:2.0"]']
    settings = [*SETTINGS, "--set", "run.processed_tokens=6000", "--set", "runtime.eval_interval_s=4"]
    cfg = load_config(None, [*settings[1::2], *chaos])
    first_kill = make_schedule(cfg.chaos, 2, cfg.runtime.duration_s, cfg.run.seed).outages[0].start_s
    fastest = cfg.run.num_learners * cfg.workload.batch_size / cfg.runtime.step_sleep_s  # tokens/s at most
    assert first_kill < cfg.run.processed_tokens / fastest  # the run is still on at the first kill
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", "train", "--chaos", "--run-dir", str(run_dir), *settings,
         *[arg for c in chaos[1:] for arg in ("--set", c)]],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    for label in ("eval loss", "tokens processed", "goodput", "rounds per fragment", "grace admissions"):
        assert label in out.stdout
    for name in (
        "config.toml",
        "metrics.jsonl",
        "tape.jsonl",
        "eval_loss.png",
        "summary.json",
        "final/model.safetensors",
        "metrics/faults.jsonl",
    ):
        assert (run_dir / name).is_file(), name
    faults = [json.loads(line) for line in (run_dir / "metrics" / "faults.jsonl").read_text().splitlines()]
    kills = [f for f in faults if f["kind"] == "sigkill"]
    restarts = [f for f in faults if f["kind"] == "restart"]
    assert kills and len(restarts) >= len(kills) - 2  # a kill near the end may not be back yet
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "(run.processed_tokens)" in summary["ended"]
    assert summary["failures"] == sum(map(is_learner_failure, faults)) >= len(kills)
    # work was done (the budget is work), and some time went to start-up: 0 < goodput < 1; every
    # second of the learners' time is in one state, so the shares add up to 1
    assert 0 < summary["goodput"] < 1 and summary["tokens_processed"] > 0
    shares = [summary[k] for k in ("goodput", "blocked", "down", "restarting", "starting")]
    assert sum(shares) == pytest.approx(1.0)
    # a restart latency for each restart seen to step (each learner's first incarnation aside)
    stepped: dict[int, set[int]] = {}
    for r in read_jsonl(run_dir / "metrics" / "learners.jsonl"):
        if r.get("steps", 0) > 0:
            stepped.setdefault(r["learner"], set()).add(r["incarnation"])
    at_least = sum(len(incs) - 1 for incs in stepped.values())
    assert at_least <= len(summary["restart_latencies_s"]) <= len(restarts)
    # One number per fact, read top to bottom (issue 35): the count that ended the run is the
    # table's, summary.json's, ddiloco status's and the report's; the straggler phase is a fault.
    end = [r for r in read_jsonl(run_dir / "metrics" / "run.jsonl") if r.get("what") == "end"][-1]
    processed = f"{summary['tokens_processed']:,.0f}"
    assert summary["tokens_processed"] == end["processed_tokens"] >= 6000 and processed in end["reason"]
    assert re.search(rf"tokens processed\s+.\s+{processed}\s", out.stdout), out.stdout[-3000:]
    status = subprocess.run([sys.executable, "-m", "ddiloco.cli", "status", str(run_dir)], capture_output=True,
                            text=True, env=ENV, timeout=120)  # fmt: skip
    assert f"tokens processed {processed}," in status.stdout, status.stdout[-2000:]
    assert summary["straggler_phases"] == 1 and any(f["kind"] == "straggle" for f in faults)
    from ddiloco.report.html import render_report

    page = render_report([run_dir], tmp_path / "report.html").read_text()
    assert processed in page and f"{summary['goodput']:.1%}" in page
    evals = read_jsonl(run_dir / "metrics" / "eval.jsonl")
    assert evals and all(e["tokens"] is None or e["tokens"] > 0 for e in evals)
    assert [e["tokens"] for e in evals if e.get("final")] == [end["processed_tokens"]]
