"""``runtime.metrics_bind``: the syncer's figures on a Prometheus endpoint, the same numbers as
``ddiloco status`` (both read the status the syncer writes), scraped over HTTP on loopback."""

from __future__ import annotations

import io
import re
import threading
import time
import urllib.request

import pytest
import torch
from helpers import FAST_RUNTIME, wait_for
from rich.console import Console
from test_library import ADDRESS, DictNet, cfg, train

import ddiloco
from ddiloco.errors import ConfigError
from ddiloco.service.base.transport import InProcessNetwork
from ddiloco.service.ops.status_cmd import merge_views, render
from ddiloco.service.syncer.prometheus import metric_families

pytest.importorskip("prometheus_client")

SAMPLE = re.compile(r"^(ddiloco_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$")


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def test_a_scrape_says_what_ddiloco_status_says(tmp_path):
    torch.set_num_threads(1)
    net = InProcessNetwork()
    settings = ("runtime.metrics_bind=127.0.0.1:0", "runtime.status_interval_s=0.2")
    server = ddiloco.SyncerServer(
        DictNet(), ADDRESS, tmp_path, config=cfg(*settings), transport=net.syncer(ADDRESS), fsync=False
    ).start()
    try:
        wait_for(lambda: server.service.metrics is not None, 30, "the metrics server")
        metrics = server.service.metrics
        assert metrics is not None
        model = DictNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        learner = ddiloco.Learner(model, ADDRESS, learner_id=0, config=cfg(*settings), transport=net.learner)
        worker = threading.Thread(target=train, args=(learner, model, opt, 40, 0))
        worker.start()
        worker.join(timeout=120)
        wait_for(lambda: (server.service.last_status.get("goodput") or 0) > 0, 30, "a goodput")
        before = server.service.last_status
        got = scrape(metrics.port)
        after = server.service.last_status
        learner.close()
    finally:
        server.stop()
    shard = '{shard="0"}'
    said = [s for s in (before, after) if got[f"ddiloco_goodput{shard}"] == pytest.approx(s["goodput"])]
    assert said, (got[f"ddiloco_goodput{shard}"], before.get("goodput"), after.get("goodput"))
    status = said[0]
    up = sum(1 for lv in status["learners"] if lv["state"] == "up")
    assert got[f"ddiloco_learners_up{shard}"] == up == 1
    assert got[f"ddiloco_tokens_processed_total{shard}"] == status["processed_tokens"] > 0
    assert got[f"ddiloco_tokens_merged_total{shard}"] == pytest.approx(status["merged_tokens"])
    assert got['ddiloco_refused_messages_total{reason="malformed",shard="0"}'] == 0
    # bytes each way, goodput's parts, rounds by why they closed, answers by quorum or grace, merge time
    assert got[f"ddiloco_bytes_received_total{shard}"] == status["bytes_in"] > 0
    assert got[f"ddiloco_bytes_sent_total{shard}"] == status["bytes_out"] > 0
    busy, allocated = (
        got[f"ddiloco_learner_busy_seconds_total{shard}"],
        got[f"ddiloco_learner_allocated_seconds{shard}"],
    )
    assert busy / allocated == pytest.approx(status["goodput"])
    closed = {k: v for k, v in got.items() if k.startswith("ddiloco_rounds_closed_total")}
    assert closed and sum(closed.values()) == sum(status["rounds"]["closed"].values()) > 0
    admitted = {k: v for k, v in got.items() if k.startswith("ddiloco_answers_admitted_total")}
    assert sum(admitted.values()) == sum(status["rounds"]["admitted"].values()) > 0
    assert got[f"ddiloco_merge_seconds_max{shard}"] >= got[f"ddiloco_merge_seconds_mean{shard}"] >= 0
    assert got[f"ddiloco_merge_work_seconds_total{shard}"] == pytest.approx(status["load"]["work_total_s"])
    # ddiloco status renders the same status: the same learner count and goodput
    out = io.StringIO()
    Console(file=out, width=300).print(render(merge_views([status]), "test"))
    header = out.getvalue()
    assert f"learners: {up} up of 1" in header and f"goodput {status['goodput']:.1%}" in header


def test_a_figure_the_status_lacks_is_left_out_not_zero():
    names = {name for name, _, _, _ in metric_families({"shard": 0, "learners": [], "live": []})}
    assert "ddiloco_goodput" not in names and "ddiloco_tokens_processed" not in names
    assert "ddiloco_learners_up" in names and "ddiloco_run_ended" in names


@pytest.mark.parametrize("bind", ["9400", "host:", ":80", "h:99999"])
def test_a_bad_metrics_bind_is_one_line(bind):
    with pytest.raises(ConfigError, match=r"runtime.metrics_bind = .* allowed: HOST:PORT"):
        ddiloco.load_config(None, [f"runtime.metrics_bind={bind}", *FAST_RUNTIME])


def test_healthz_says_whether_the_syncers_loop_still_writes_its_status():
    """A liveness probe that means something: /metrics is served by its own thread, so only the
    age of the status the loop wrote tells a wedged syncer from a live one."""
    import urllib.error
    import urllib.request

    from ddiloco.service.syncer.prometheus import MetricsServer, health

    assert health({"time": 100.0}, 130.0, 60.0) == (True, "ok: status written 30.0 s ago")
    assert health({"time": 100.0}, 190.0, 60.0) == (False, "stale: the syncer's loop last wrote its status 90 s "
                                                           "ago (limit 60 s)")  # fmt: skip
    assert health({}, 130.0, 60.0, since=100.0)[0] and not health({}, 190.0, 60.0, since=100.0)[0]  # never written
    from ddiloco.service.syncer.service import health_stale_s

    assert health_stale_s(1.0, 3_000_000) == 60.0 and health_stale_s(5.0, 0) == 150.0
    assert health_stale_s(1.0, 4 * 10**9) == 200.0  # a 1B-parameter fp32 model's final file at 20 MB/s
    status = {"shard": 0, "time": time.time(), "learners": [], "live": []}
    server = MetricsServer("127.0.0.1:0", lambda: status, stale_after_s=60.0)
    try:
        url = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(f"{url}/healthz", timeout=30) as r:
            assert r.status == 200 and r.read().startswith(b"ok: status written")
        status = {**status, "time": time.time() - 600}  # the loop stopped writing ten minutes ago
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{url}/healthz", timeout=30)
        assert e.value.code == 503 and e.value.read().startswith(b"stale: the syncer's loop last wrote")
        assert any(name.startswith("ddiloco_learners") for name in scrape(server.port))  # /metrics answers on
    finally:
        server.close()
