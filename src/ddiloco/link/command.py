"""``ddiloco link``: relays in one process, from flags (one route) or a plan file (several, as
``ddiloco train --chaos`` starts them, sharing one site cap).

A plan file is JSON::

    {"routes": [{"name": "link-1", "listen": "127.0.0.1:7001", "to": "127.0.0.1:7000",
                 "link": "10mbit,50ms", "faults": ["hold:30s@40%"]}],
     "site_link": "100mbit", "horizon_s": 300, "seed": 0, "start_at": 1764630000.0}

``start_at`` (a Unix time) puts the faults' times on the run's clock (0 when the run started);
without it they count from the relay's start. ``horizon_s`` is what a ``%`` is a fraction of.
SIGINT/SIGTERM stop it cleanly; SIGUSR1 ends every fault (a hold or cut under way ends, no new
ones), which the launcher sends when the run is ending so the final sync gets through.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.errors import ConfigError
from ddiloco.link.config import LinkConfig, LinkFaults, parse_link, parse_site_rate
from ddiloco.link.relay import FaultLog, Relay, Route, serve

log = logging.getLogger(__name__)


def parse_hostport(text: str, where: str) -> tuple[str, int]:
    """'HOST:PORT', 'tcp://HOST:PORT' or '[V6]:PORT' -> (host, port); one line when malformed."""
    t = text.strip().removeprefix("tcp://")
    host, sep, port = t.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{where} {text!r} is not HOST:PORT (e.g. 127.0.0.1:5555; port 0: any free one)")
    return host, int(port)


@dataclass(frozen=True)
class LinkPlan:
    """Every relay one ``ddiloco link`` process runs."""

    routes: tuple[Route, ...]
    """One per relayed learner (and syncer shard)."""
    site_rate_bps: float = 0.0
    """The aggregate cap per direction all routes share (0: none)."""
    seed: int = 0
    """Seeds jitter, stalls and Poisson resets (with each route's name)."""
    start_at: float | None = None
    """Unix time the faults' clock counts from (None: the relay's start)."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LinkPlan:
        """A plan file's content -> a validated plan (one line per bad value)."""
        horizon = data.get("horizon_s")
        routes = []
        for i, r in enumerate(data.get("routes") or []):
            name = str(r.get("name") or f"link-{i}")
            routes.append(
                Route(
                    name,
                    parse_hostport(str(r.get("listen", "")), f"plan route {name}: listen"),
                    parse_hostport(str(r.get("to", "")), f"plan route {name}: to"),
                    parse_link(str(r.get("link", ""))),
                    LinkFaults.parse([str(f) for f in r.get("faults") or []], horizon),
                )
            )
        if not routes:
            raise ConfigError("the link plan has no routes")
        site = str(data.get("site_link") or "")
        start = data.get("start_at")
        return cls(tuple(routes), parse_site_rate(site) if site else 0.0, int(data.get("seed", 0)),
                   float(start) if start is not None else None)  # fmt: skip


def run_relays(
    plan: LinkPlan,
    faults_log: str | Path | None = None,
    ready_file: str | Path | None = None,
    on_ready: Callable[[list[Relay]], None] | None = None,
) -> None:
    """Serve ``plan`` in the foreground until SIGINT/SIGTERM (main thread only)."""
    offset = (time.time() - plan.start_at) if plan.start_at is not None else 0.0
    mono0 = time.monotonic()
    clock = lambda: time.monotonic() - mono0 + offset
    sink = FaultLog(faults_log) if faults_log else None

    def ready(relays: list[Relay]) -> None:
        if ready_file is not None:  # written whole (rename), so a reader never sees half of it
            tmp = Path(f"{ready_file}.tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "ports": [r.port for r in relays]}))
            tmp.replace(ready_file)
        if on_ready is not None:
            on_ready(relays)

    async def main() -> None:
        stop, stop_faults = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, _once(stop, sig))
        with contextlib.suppress(AttributeError, ValueError):  # SIGUSR1 is POSIX only
            loop.add_signal_handler(signal.SIGUSR1, _once(stop_faults, signal.SIGUSR1))
        await serve(plan.routes, clock, stop, plan.seed, plan.site_rate_bps, sink, ready, stop_faults)

    asyncio.run(main())


def _once(event: asyncio.Event, sig: int) -> Callable[[], None]:
    def handle() -> None:
        if not event.is_set():
            what = "no more faults" if sig == getattr(signal, "SIGUSR1", None) else "stopping"
            log.warning("ddiloco link: %s received: %s", signal.Signals(sig).name, what)
        event.set()

    return handle


def plan_from_flags(
    listen: str, to: str, link: str, faults: list[str], site: str = "", seed: int = 0, horizon_s: float | None = None
) -> LinkPlan:
    """``ddiloco link --listen --to --link [--faults]``: a plan of one route."""
    route = Route(
        "link",
        parse_hostport(listen, "--listen"),
        parse_hostport(to, "--to"),
        parse_link(link) if link else LinkConfig(),
        LinkFaults.parse(faults, horizon_s),
    )
    return LinkPlan((route,), parse_site_rate(site) if site else 0.0, seed)


def read_plan(path: str | Path) -> LinkPlan:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the link plan {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"the link plan {path} is not a JSON object")
    return LinkPlan.from_json(data)
