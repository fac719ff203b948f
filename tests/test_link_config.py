"""Link and fault strings, the chaos section's link fields, and how ``ddiloco train --chaos``
wires a relay in front of each configured learner."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch

from ddiloco.chaos.schedule import ChaosConfig, link_plan
from ddiloco.config import load_config
from ddiloco.errors import ConfigError
from ddiloco.link.command import LinkPlan, parse_hostport
from ddiloco.link.config import DirectionConfig, LinkConfig, LinkFaults, Partition, parse_fault, parse_link
from ddiloco.service.ops.launcher import Launcher, check_chaos_horizon

torch.set_num_threads(1)

SYNTHETIC = ["workload.factory=ddiloco.workloads.synthetic:make_workload", "workload.options={hidden = 8}"]


def test_link_strings():
    assert parse_link("10mbit,50ms") == LinkConfig(DirectionConfig(1e7, 0.05), DirectionConfig(1e7, 0.05))
    cfg = parse_link("2mbit,100ms,jitter=10ms,stall=0.01:200ms")
    assert cfg.up == cfg.down == DirectionConfig(2e6, 0.1, 0.01, 0.01, 0.2)
    asym = parse_link("10mbit,20ms,up.rate=1mbit,down.jitter=5ms")
    assert asym.up == DirectionConfig(1e6, 0.02) and asym.down == DirectionConfig(1e7, 0.02, 0.005)
    sized = parse_link("buffer=256KiB,chunk=16KiB,rate=inf,delay=1.5s,stall=2%:1s")
    assert (sized.buffer_bytes, sized.chunk_bytes) == (256 * 1024, 16 * 1024)
    assert sized.up == DirectionConfig(0.0, 1.5, 0.0, 0.02, 1.0)
    assert parse_link("") == LinkConfig() and parse_link("1Gbit").up.rate_bps == 1e9
    assert parse_link("10mbit,50ms").describe() == "10 Mbit/s, 50 ms"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("10mbps", "'10mbps' is neither a rate nor a latency"),
        ("10mbit,fast", "'fast' is neither"),
        ("colour=red", "unknown key 'colour'"),
        ("sideways.rate=1mbit", "unknown key 'sideways.rate'"),
        ("rate=10ms", "'10ms' is not a rate"),
        ("latency=10mbit", "'10mbit' is not a duration"),
        ("50ms,jitter=60ms", "link.up.jitter_s = 0.06 is out of range; allowed: 0 .. latency_s"),
        ("stall=0.5", "stall='0.5' must be PROBABILITY:DURATION"),
        ("stall=2:1s", "probability = '2' is out of range"),
        ("buffer=1KiB,chunk=4KiB", "link.buffer_bytes = 1024 is out of range; allowed: >= chunk_bytes"),
        ("buffer=lots", "'lots' is not a size"),
    ],
)
def test_a_bad_link_string_is_one_clear_line(text, needle):
    with pytest.raises(ConfigError) as e:
        parse_link(text)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg and repr(text) in msg, msg


def test_fault_strings():
    assert parse_fault("hold:30s@40%", horizon_s=100.0) == LinkFaults(partitions=(Partition("hold", 40.0, 30.0),))
    assert parse_fault("cut:500ms@2min").partitions == (Partition("cut", 120.0, 0.5),)
    assert parse_fault("reset_every:10s") == LinkFaults(reset_every_s=10.0)
    assert parse_fault("reset_mean:1min") == LinkFaults(reset_mean_s=60.0)
    assert parse_fault("flap:10s/5s") == LinkFaults(flap_up_s=10.0, flap_down_s=5.0)
    both = LinkFaults.parse(["cut:1s@50s", "hold:2s@10s", "reset_every:3s"])
    assert [p.kind for p in both.partitions] == ["hold", "cut"] and both.reset_every_s == 3.0 and both
    assert not LinkFaults()
    for bad, needle in [
        ("hold:30s", "needs its start"),
        ("hold:30s@40%", "needs the run's length"),
        ("hold:0s@1s", "duration = '0s' is out of range"),
        ("cut:1s@100%", "start = '100%' is out of range"),
        ("flap:10s", "flap needs UP/DOWN"),
        ("drop:1s", "unknown kind 'drop'"),
        ("reset_every", "is malformed"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            parse_fault(bad, horizon_s=100.0 if "%" in bad and "40%" not in bad else None)


def test_addresses_and_plans():
    assert parse_hostport("tcp://127.0.0.1:5555", "--to") == ("127.0.0.1", 5555)
    assert parse_hostport("[::1]:0", "--listen") == ("::1", 0)
    for bad in ("127.0.0.1", ":5555", "host:99999", "host:x"):
        with pytest.raises(ConfigError, match="is not HOST:PORT"):
            parse_hostport(bad, "--to")
    plan = LinkPlan.from_json({"routes": [{"name": "link-1", "listen": "127.0.0.1:0", "to": "127.0.0.1:9",
                                           "link": "1mbit", "faults": ["hold:1s@50%"]}],
                               "site_link": "10mbit", "horizon_s": 10, "start_at": 5.0})  # fmt: skip
    assert plan.site_rate_bps == 1e7 and plan.start_at == 5.0
    assert plan.routes[0].faults.partitions == (Partition("hold", 5.0, 1.0),)
    with pytest.raises(ConfigError, match="no routes"):
        LinkPlan.from_json({})


def test_the_chaos_section_takes_links_and_says_what_is_wrong_in_one_line():
    cfg = load_config(None, [*SYNTHETIC, "run.num_learners=3", 'chaos.links=["1:10mbit,50ms"]',
                             'chaos.link_faults=["0:cut:30s@50%", "1:hold:5s@10%", "1:reset_mean:10s"]'])  # fmt: skip
    plan = link_plan(cfg.chaos, 3, horizon_s=100.0)
    assert plan == {0: ("", ("cut:30s@50%",)), 1: ("10mbit,50ms", ("hold:5s@10%", "reset_mean:10s"))}
    overlap = ChaosConfig(link_faults=("0:hold:30s@10%", "0:cut:5s@20s"))
    assert link_plan(overlap, 3) == {0: ("", ("hold:30s@10%", "cut:5s@20s"))}  # the run's length unknown: fine
    with pytest.raises(ConfigError, match="learner 0's hold and cut overlap"):
        link_plan(overlap, 3, horizon_s=100.0)  # 10 .. 40 s and 20 .. 25 s
    assert link_plan(overlap, 3, horizon_s=300.0)  # 30 .. 60 s and 20 .. 25 s
    site = ChaosConfig(links=("1:10mbit",), site_link="100mbit")
    assert sorted(link_plan(site, 3, 1.0)) == [0, 1, 2]  # a site link: every learner goes through it
    assert link_plan(ChaosConfig(), 3, 1.0) == {}  # the default: no relays, nothing changes
    for entry, needle in [
        ('chaos.links=["5:10mbit"]', "chaos.links entry '5:10mbit': learner 5 is out of range; allowed: 0 .. 2"),
        ('chaos.links=["10mbit"]', "chaos.links entry '10mbit' is malformed"),
        ('chaos.links=["1:10mbyte"]', "'10mbyte' is neither a rate nor a latency"),
        ('chaos.links=["1:1mbit", "1:2mbit"]', "two entries for learner 1"),
        ('chaos.link_faults=["1:hold:30s"]', "needs its start"),
        ('chaos.site_link="fast"', "site link 'fast': 'fast' is not a rate"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [*SYNTHETIC, "run.num_learners=3", entry])
        assert needle in str(e.value) and "\n" not in str(e.value), (entry, str(e.value))


def chaos_launcher(run_dir: Path, *extra: str) -> Launcher:
    cfg = load_config(None, [*SYNTHETIC, "run.num_learners=3", "chaos.enabled=true", "runtime.duration_s=60",
                             'chaos.links=["1:10mbit,50ms"]', 'chaos.link_faults=["2:reset_every:1s"]',
                             *extra])  # fmt: skip
    return Launcher(cfg, run_dir, insecure=True)


def test_train_chaos_puts_a_relay_in_front_of_each_configured_learner(tmp_path):
    la = chaos_launcher(tmp_path / "run")
    syncer = la.addr
    dial = {m: p.argv[p.argv.index("--syncer") + 1] for m, p in enumerate(la.learners)}
    assert dial[0] == syncer  # learner 0 has no link: straight to the syncer
    assert dial[1] != syncer and dial[2] != syncer and len({*dial.values()}) == 3
    plan = la.link_plan()
    assert [(r["name"], r["link"], r["faults"], r["to"]) for r in plan["routes"]] == [
        ("link-1", "10mbit,50ms", [], syncer.removeprefix("tcp://")),
        ("link-2", "", ["reset_every:1s"], syncer.removeprefix("tcp://")),
    ]
    assert [f"tcp://{r['listen']}" for r in plan["routes"]] == [dial[1], dial[2]]
    assert plan["horizon_s"] == 60 and plan["start_at"] == la._t0
    assert LinkPlan.from_json(plan).routes[1].faults.reset_every_s == 1.0  # the child reads it back
    assert la.links is not None and la.links in la._procs() and "--faults-log" in la.links.argv
    overlapping = load_config(None, [*SYNTHETIC, "chaos.enabled=true", "runtime.duration_s=100",
                                     'chaos.link_faults=["0:hold:30s@10%", "0:cut:5s@20s"]'])  # fmt: skip
    with pytest.raises(ConfigError, match="learner 0's hold and cut overlap"):
        check_chaos_horizon(overlapping)  # ddiloco train says so before it makes a run folder
    off = Launcher(load_config(None, [*SYNTHETIC, "run.num_learners=2", 'chaos.links=["1:10mbit"]']),
                   tmp_path / "off", insecure=True)  # fmt: skip
    assert off.links is None and all(p.argv[p.argv.index("--syncer") + 1] == off.addr for p in off.learners)


@pytest.mark.slow
def test_the_launchers_relays_forward_to_the_syncer_and_log_their_faults(tmp_path):
    la = chaos_launcher(tmp_path / "run")
    host, port = la.addr.removeprefix("tcp://").rsplit(":", 1)
    fake_syncer = socket.create_server((host, int(port)))  # stands in for the syncer: accepts, echoes
    fake_syncer.settimeout(10)
    la._t0 = time.time()
    try:
        la._start_links()
        relay = la.learners[1].argv[la.learners[1].argv.index("--syncer") + 1].removeprefix("tcp://")
        rhost, rport = relay.rsplit(":", 1)
        with socket.create_connection((rhost, int(rport)), timeout=10) as c:
            peer, _ = fake_syncer.accept()
            with peer:
                c.sendall(b"learner 1 says hi")
                got = b""
                while len(got) < 17:
                    got += peer.recv(100)
                assert got == b"learner 1 says hi"
        faults = tmp_path / "run" / "metrics" / "faults.jsonl"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "link reset" not in (faults.read_text() if faults.exists() else ""):
            time.sleep(0.1)
        recs = [json.loads(line) for line in faults.read_text().splitlines()]
        assert {"event": "fault", "kind": "link reset", "target": "link-2"}.items() <= recs[0].items()
    finally:
        for p in la._procs():
            p.kill_groups()
        fake_syncer.close()


@pytest.mark.slow
def test_train_chaos_runs_to_its_end_with_learners_behind_relays(tmp_path):
    """`ddiloco train --chaos` with both learners behind relays (one shaped and stalling, one cut
    for a while, a hold and resets): the run still ends on its token budget with merges, and the
    relays' faults are in faults.jsonl, whole lines among the launcher's own."""
    import subprocess
    import sys

    from test_runtime import ENV, SETTINGS

    links = ['chaos.links=["1:2mbit,20ms,jitter=5ms,stall=0.05:100ms"]', "chaos.site_link=50mbit",
             'chaos.link_faults=["1:hold:2s@12s", "1:reset_every:3s", "0:cut:2s@16s", "0:hold:13s@1s"]',
             "chaos.failures_per_learner=0",
             # Longer than the 13 s hold: a learner whose join is held must wait, not stop (on a
             # busy machine the learners start late, inside the holds, and 5 s ran out).
             "runtime.join_timeout_s=30"]  # fmt: skip
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", "train", "--chaos", "--run-dir", str(run_dir), *SETTINGS,
         "--set", "run.processed_tokens=6000", *[a for c in links for a in ("--set", c)]],
        capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    faults = [json.loads(line) for line in (run_dir / "metrics" / "faults.jsonl").read_text().splitlines()]
    link = [(f["kind"], f["target"]) for f in faults if f["target"].startswith("link-")]
    for kind, target in [("hold", 1), ("hold end", 1), ("reset", 1), ("cut", 0), ("cut end", 0), ("hold end", 0)]:
        assert (f"link {kind}", f"link-{target}") in link, (kind, target, link)
    first = next(f for f in faults if f["target"] == "link-0")  # a hold under way when the relays started
    assert first["kind"] == "link hold" and first["time"] > 1.0 and first["duration_s"] < 13.0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "(run.processed_tokens)" in summary["ended"] and summary["tokens_processed"] > 0
    assert summary["failures"] == 0  # link faults are not learner failures
    assert json.loads((run_dir / "links.json").read_text())["site_link"] == "50mbit"
