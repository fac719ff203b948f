"""The syncer's figures for a cluster's Prometheus (``runtime.metrics_bind``): the status it
writes for ``ddiloco status``, read as metrics at each scrape, so both say the same numbers.

``metric_families`` is the rule (a status dict in, metric families out: no I/O); ``MetricsServer``
serves them over HTTP with ``prometheus_client`` on a registry of its own, reading the status the
loop last wrote (a dict replaced whole, never changed in place: a scrape on the server's thread
never sees half an update). It also answers ``/healthz`` (``health``): 200 while the syncer's loop
keeps writing its status, 503 once that status is older than ``stale_after_s`` (a wedged merge
or a stuck disk: the server's own thread would go on answering ``/metrics``), for a liveness probe.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ddiloco.errors import DDiLoCoError

log = logging.getLogger(__name__)

PREFIX = "ddiloco_"
COUNTS = (
    "malformed", "unknown_sender", "impostor", "rate_limited", "refused_relay", "superseded", "foreign_state",
    "implausible", "other_schema",
)  # fmt: skip
"""The status counters of refused messages, by reason (``ddiloco_refused_messages_total{reason}``)."""


def _table(d: dict[str, Any], key: str) -> dict[str, Any]:
    """``d[key]`` when it is a table, else an empty one (a status from elsewhere may lack it)."""
    value = d.get(key)
    return value if isinstance(value, dict) else {}


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def metric_families(status: dict[str, Any]) -> list[tuple[str, str, str, list[tuple[dict[str, str], float]]]]:
    """``(name, type, help, [(labels, value)])`` for every figure ``status`` holds (``gauge`` or
    ``counter``; a figure the status lacks is left out, never reported as 0)."""
    shard = {"shard": str(status.get("shard", 0))}
    out: list[tuple[str, str, str, list[tuple[dict[str, str], float]]]] = []

    def one(name: str, kind: str, help_: str, value: Any, **labels: str) -> None:
        v = _num(value)
        if v is not None:
            out.append((PREFIX + name, kind, help_, [({**shard, **labels}, v)]))

    learners = [lv for lv in status.get("learners", []) if isinstance(lv, dict)]
    states: dict[str, float] = {}
    for lv in learners:
        states[str(lv.get("state", "?"))] = states.get(str(lv.get("state", "?")), 0.0) + 1
    one("learners_up", "gauge", "Learners up (heard from within the liveness timeout), as ddiloco status counts",
        states.get("up", 0.0))  # fmt: skip
    one("learners_known", "gauge", "Learners this syncer knows of (any state)", status.get("learners_total"))
    if states:
        out.append((PREFIX + "learners", "gauge", "Learners by state",
                    [({**shard, "state": k}, v) for k, v in sorted(states.items())]))  # fmt: skip
    one("goodput", "gauge", "Learner time in inner steps over allocated learner time so far (ddiloco status)",
        status.get("goodput"))  # fmt: skip
    one("run_time_seconds", "gauge", "Seconds since the run started", status.get("run_time_s"))
    one("tokens_processed", "counter", "Tokens the fleet processed (its heartbeats; the count that ended the run)",
        status.get("processed_tokens"))  # fmt: skip
    one("tokens_merged", "counter", "Tokens merged into the global model", status.get("merged_tokens"))
    one("merges", "counter", "Fragment versions merged and made durable", status.get("merges"))
    frags = [f for f in status.get("fragments", []) if isinstance(f, dict)]
    if frags:
        out.append(
            (
                PREFIX + "fragment_version",
                "gauge",
                "Global version of each fragment",
                [({**shard, "fragment": str(f.get("fragment"))}, float(f.get("version") or 0)) for f in frags],
            )
        )
        grace = [_num(f.get("grace_s")) for f in frags]
        one("grace_seconds_max", "gauge", "The longest grace window of the fragments' last merges",
            max((g for g in grace if g is not None), default=None))  # fmt: skip
    behind = [_num(lv.get("behind")) for lv in learners]
    one("learner_versions_behind_max", "gauge", "The most versions a learner's fragments trail the global ones",
        max((b for b in behind if b is not None), default=None))  # fmt: skip
    given = status.get("traffic")
    traffic: dict[str, Any] = given if isinstance(given, dict) else {}
    for d in ("up", "down"):
        one(f"bytes_per_step_{d}", "gauge", f"Steady bytes per learner per inner step, {d}",
            traffic.get(f"{d}_bytes_per_step"))  # fmt: skip
        one(f"one_off_bytes_{d}", "counter", f"One-off bytes (joins, hand-offs, final sync), {d}",
            traffic.get(f"one_off_{d}_bytes"))  # fmt: skip
    one("bytes_received", "counter", "Bytes of every message received (learners, observers, refused ones too)",
        status.get("bytes_in"))  # fmt: skip
    one("bytes_sent", "counter", "Bytes of every message sent", status.get("bytes_out"))
    one("learner_busy_seconds", "counter", "Learner seconds in inner steps, every incarnation (goodput's numerator)",
        status.get("learner_busy_s"))  # fmt: skip
    one("learner_allocated_seconds", "gauge", "Learner seconds allocated so far: M x the run's age (goodput's "
        "denominator; less the busy seconds, its loss)", status.get("learner_allocated_s"))  # fmt: skip
    rounds = _table(status, "rounds")
    for key, name, help_, label in (
        ("closed", "rounds_closed", "Rounds closed, by why (quorum, grace_over, all_answered, final, ...)", "reason"),
        ("admitted", "answers_admitted", "Answers merged, by whether the quorum or the grace window took them", "by"),
        ("refused", "contributions_refused", "Contributions refused by the merge's admission, by reason", "reason"),
    ):
        table = _table(rounds, key)
        samples = [({**shard, label: str(k)}, v) for k, c in sorted(table.items()) if (v := _num(c)) is not None]
        if samples:
            out.append((PREFIX + name, "counter", help_, samples))
    load = _table(status, "load")
    for key, name, help_ in (
        ("merge_s_mean", "merge_seconds_mean", "Mean syncer work per merged round, over the last rounds"),
        ("merge_s_p95", "merge_seconds_p95", "95th percentile of the syncer's work per merged round"),
        ("merge_s_max", "merge_seconds_max", "Longest syncer work per merged round, over the last rounds"),
        ("write_s_mean", "write_seconds_mean", "Mean time to make a merged version durable"),
        ("merge_share_of_interval", "merge_share_of_interval", "Merge work over the time between rounds of a fragment"),
    ):
        one(name, "gauge", help_, load.get(key))
    one("merge_work_seconds", "counter", "The syncer's work on messages and merges so far", load.get("work_total_s"))
    refused = [({**shard, "reason": k}, v) for k in COUNTS if (v := _num(status.get(k))) is not None]
    if refused:
        out.append((PREFIX + "refused_messages", "counter", "Messages refused, by reason", refused))
    one("rss_bytes", "gauge", "The syncer process's resident size",
        (status.get("memory") or {}).get("rss") if isinstance(status.get("memory"), dict) else None)  # fmt: skip
    one("run_ended", "gauge", "1 once the run has ended", 1.0 if status.get("run_end") == "done" else 0.0)
    return out


def health(status: dict[str, Any], now: float, stale_after_s: float, since: float | None = None) -> tuple[bool, str]:
    """Whether the loop that wrote ``status`` (at its wall ``time``; none yet: counted from
    ``since``, when the server started) still turns, and one line."""
    written = _num(status.get("time"))
    age = now - (written if written is not None else since if since is not None else now)
    if age > stale_after_s:
        return False, f"stale: the syncer's loop last wrote its status {age:.0f} s ago (limit {stale_after_s:.0f} s)"
    return True, f"ok: status written {max(age, 0.0):.1f} s ago"


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds the process up at exit


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    timeout = 10  # an idle client does not hold a thread for good

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass  # a scrape every few seconds is not worth a log line


class MetricsServer:
    """``/metrics`` over HTTP on ``bind`` (``HOST:PORT``), from ``status()`` at each scrape, and
    ``/healthz`` (``health``)."""

    def __init__(self, bind: str, status: Callable[[], dict[str, Any]], stale_after_s: float = 60.0) -> None:
        try:
            from prometheus_client import make_wsgi_app
            from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
            from prometheus_client.registry import Collector, CollectorRegistry
        except ImportError:
            raise DDiLoCoError(
                "runtime.metrics_bind needs prometheus-client: pip install 'ddiloco[prometheus]'"
            ) from None

        class StatusCollector(Collector):
            def collect(self) -> Iterator[Any]:
                for name, kind, help_, samples in metric_families(status()):
                    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                    labels = sorted(samples[0][0])
                    family = cls(name, help_, labels=labels)
                    for lab, value in samples:
                        family.add_metric([lab[k] for k in labels], value)
                    yield family

        started = time.time()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StatusCollector())
        metrics_app = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if environ.get("PATH_INFO") == "/healthz":
                ok, line = health(status(), time.time(), stale_after_s, since=started)
                start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
                return [line.encode() + b"\n"]
            return metrics_app(environ, start_response)  # type: ignore[no-any-return]

        host, _, port = bind.rpartition(":")
        try:
            server_class = _Server6 if ":" in host else _Server
            self._server = make_server(host.strip("[]"), int(port), app, server_class, handler_class=_Quiet)
        except OSError as e:
            raise DDiLoCoError(f"cannot serve metrics on {bind} (runtime.metrics_bind): {e}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()
        self.port: int = int(self._server.server_port)
        log.info("Prometheus metrics on http://%s:%d/metrics, liveness on /healthz (runtime.metrics_bind)", host,
                 self.port)  # fmt: skip

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
