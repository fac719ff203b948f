"""Emulated hosts (``ddiloco.link.hosts``): a network namespace per host, joined through a bridge,
each host's rate from the kernel.

Fast: the hosts are made, reach each other, carry their rate's qdisc, are cut off and joined
again, and go without a trace (also what a crashed harness left). Slow: a run across them, each
process bound to its own host's address with keys on, the delay from the project's relay in
the syncer's host. Skipped, with the one line that says why, where namespaces cannot be made.
Every wait is bounded; nothing asserts a duration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import stop_processes, wait_for

from ddiloco.link.hosts import PREFIX, EmulatedHosts, remove_stale, unavailable
from ddiloco.report.tape import read_jsonl, rounds_of

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split(" ")[0] for line in out.splitlines() if line.strip()]


def connects(hosts: EmulatedHosts, src: str, dst: str, port: int, timeout: float = 2.0) -> bool:
    code = (
        "import socket, sys\n"
        f"try:\n    socket.create_connection(({hosts.address(dst)!r}, {port}), timeout={timeout}).close()\n"
        "except OSError:\n    sys.exit(1)\n"
    )
    return subprocess.run(hosts.command(src, [sys.executable, "-c", code]), timeout=30).returncode == 0


def test_hosts_reach_each_other_at_their_rate_are_cut_and_joined_and_leave_no_trace():
    with EmulatedHosts(["a", "b"], {"b": 5e6}) as hosts:
        assert hosts.address("a") != hosts.address("b")
        server = hosts.popen(
            "a",
            [sys.executable, "-c", "import socket, time\n"
             f"s = socket.socket(); s.bind(({hosts.address('a')!r}, 7400)); s.listen(8); time.sleep(120)"],
        )  # fmt: skip
        try:
            wait_for(lambda: connects(hosts, "b", "a", 7400), 20, "a's listener, from b")
            qdisc = subprocess.run(hosts.command("b", ["tc", "qdisc", "show", "dev", "eth0"]),
                                   capture_output=True, text=True).stdout  # fmt: skip
            assert "tbf" in qdisc and "5Mbit" in qdisc, qdisc
            plain = subprocess.run(hosts.command("a", ["tc", "qdisc", "show", "dev", "eth0"]),
                                   capture_output=True, text=True).stdout  # fmt: skip
            assert "tbf" not in plain  # no rate given: none
            # (the check itself: a port nobody listens on does not connect)
            assert not connects(hosts, "b", "a", 7401, timeout=1.0)
            hosts.set_link("b", False)
            assert not connects(hosts, "b", "a", 7400, timeout=1.0)
            hosts.set_link("b", True)
            wait_for(lambda: connects(hosts, "b", "a", 7400), 20, "b joined again")
        finally:
            server.kill()
            server.wait(10)
    assert not [n for n in namespaces() if n.startswith(f"{PREFIX}{os.getpid()}-")]


def test_what_a_crashed_harness_left_is_removed_and_a_live_ones_kept():
    dead = next(pid for pid in range(4_000_000, 4_100_000) if not os.path.exists(f"/proc/{pid}"))
    left, live = f"{PREFIX}{dead}-0", f"{PREFIX}{os.getppid()}-0"
    for name in (left, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert left in remove_stale()
        assert left not in namespaces() and live in namespaces()
    finally:
        for name in (left, live):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


@pytest.mark.slow
def test_a_run_across_emulated_hosts_with_keys_ends_with_every_learner_merged(tmp_path):
    """A syncer host, two learner hosts at 20 Mbit/s each way, 10 ms one way from the relay in
    the syncer's host; CURVE keys (off loopback they are required). The run ends on its token
    budget, every learner merged, and the processes bound their own hosts' addresses."""
    from ddiloco.service.base.keys import make_keys

    settings = [
        "workload.factory=ddiloco.workloads.synthetic:make_workload", "run.num_learners=2", "algo.sync_every=8",
        "runtime.step_sleep_s=0.02", "runtime.heartbeat_interval_s=0.1", "algo.liveness_timeout_s=2.0",
        "runtime.syncer_liveness_s=2.0", "runtime.status_interval_s=0.2", "runtime.join_timeout_s=20.0",
        "run.processed_tokens=3000", "runtime.duration_s=600", "runtime.end_linger_s=0.5",
    ]  # fmt: skip
    flags = [x for s in settings for x in ("--set", s)]
    keys = tmp_path / "keys"
    make_keys(keys, learners=2)
    cli = [sys.executable, "-m", "ddiloco.cli"]
    procs: list[subprocess.Popen] = []
    with EmulatedHosts(["syncer", "l0", "l1"], {"l0": 20e6, "l1": 20e6}) as hosts:
        at = hosts.address("syncer")
        try:
            log = lambda name: open(tmp_path / f"{name}.log", "ab")  # noqa: E731
            syncer = [*cli, "syncer", "--bind", f"tcp://{at}:5600", "--run-dir", str(tmp_path), "--keys", str(keys)]
            procs.append(hosts.popen("syncer", [*syncer, *flags], stdout=log("syncer"), stderr=subprocess.STDOUT,
                                     env=ENV))  # fmt: skip
            plan = {"routes": [{"name": f"link-{m}", "listen": f"{at}:{5601 + m}", "to": f"{at}:5600",
                                "link": "10ms"} for m in (0, 1)]}  # fmt: skip
            (tmp_path / "links.json").write_text(json.dumps(plan))
            relay = [*cli, "link", "--plan", str(tmp_path / "links.json")]
            procs.append(hosts.popen("syncer", relay, stdout=log("link"), stderr=subprocess.STDOUT, env=ENV))
            wait_for(lambda: read(tmp_path / "status" / "syncer-0.json"), 60, "the syncer on its host")
            learners = []
            for m in (0, 1):
                argv = [*cli, "learner", "--syncer", f"tcp://{at}:{5601 + m}", "--id", str(m), "--run-dir",
                        str(tmp_path), "--device", "cpu", "--keys", str(keys), *flags]  # fmt: skip
                learners.append(hosts.popen(f"l{m}", argv, stdout=log(f"learner-{m}"), stderr=subprocess.STDOUT,
                                            env=ENV))  # fmt: skip
            procs += learners
            for p in learners:
                p.wait(timeout=240)  # they stop once the run has ended
            assert [p.returncode for p in learners] == [0, 0], [(tmp_path / f"learner-{m}.log").read_text()[-2000:]
                                                                 for m in (0, 1)]  # fmt: skip
            wait_for(lambda: (tmp_path / "final" / "model.safetensors").exists(), 60, "the final model")
            rounds = rounds_of(read_jsonl(tmp_path / "state" / "tape.jsonl"))
            assert {m.learner for r in rounds for m in r.took_part} == {0, 1}
            assert "the budget is 3,000 (run.processed_tokens)" in (tmp_path / "syncer.log").read_text()
            # (a learner's host has no other route: what reached the syncer crossed the bridge to its address)
        finally:
            stop_processes(procs)


@pytest.mark.slow
def test_a_scale_equivalent_run_on_emulated_hosts_end_to_end(tmp_path):
    """bench/scale_equiv.py's quick plan through ``ddiloco train`` with ``chaos.hosts``: two
    learners of a tiny model on hosts of their own at the rate that stands for 7B over 1 Gbit/s,
    learner 1 SIGKILLed and restarted half a loss interval after the first step. Every role ran in
    its own namespace, bound only its host's address and had keys; the restart merged again; no
    invariant broke. Nothing here asserts a duration or a goodput (a busy machine moves them)."""
    bench = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))
    try:
        import scale_equiv
    finally:
        sys.path.remove(str(bench))
    plan = scale_equiv.PLANS["quick"]()
    raw = scale_equiv.run_cell(plan, tmp_path)
    f = scale_equiv.figures(plan, raw)
    assert raw["launcher_rc"] == 0, (tmp_path / "train.log").read_text()[-3000:]
    assert set(raw["roles"]) >= {"syncer", "evaluator", "learner-0", "learner-1"}
    assert f["roles_on_own_hosts"] and f["keys_on"], raw["roles"]
    assert f["bound_to_own_address"], (raw["sockets"], raw["host_addresses"])
    assert len({ns for r in raw["roles"].values() for ns in set(r["namespaces"])}) == 4  # one host each
    assert f["invariant_violations"] == 0
    assert [what for _, what in raw["losses"]] == ["restart"]
    assert f["events"]["restart"]["happened"] and f["events"]["restart"]["first_merged_s"] is not None
    assert 0 < f["goodput_from_first_step"] <= 1 and f["predicted"] is not None
    used = {ns for r in raw["roles"].values() for ns in r["namespaces"]}
    assert not used & set(namespaces())  # the launcher deleted its hosts
