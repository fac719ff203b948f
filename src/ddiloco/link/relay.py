"""The link emulator on real sockets: a TCP relay that listens where a learner connects and
forwards to its syncer, moving bytes only (ZeroMQ and its CURVE handshake pass unchanged),
each direction paced by the pure scheduler of ``shaper.py``.

Per connection and direction, one task reads (at most ``chunk_bytes``, and only while the
shaper's bounded queue has room: backpressure) and one writes what is due. Per relay, one task
walks the fault timeline: a reset or a cut aborts every connection with an RST, and while a cut
lasts a new connection is reset as soon as it is accepted. Built on asyncio streams only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.link.config import LinkConfig, LinkFaults
from ddiloco.link.shaper import DirectionShaper, FaultTimeline, LinkEvent, SiteRate

log = logging.getLogger(__name__)

FAULT_TICK_S = 0.02
"""How often a relay looks at its fault timeline (the resolution of resets and cuts)."""
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Route:
    """One relay: where it listens, where it forwards, and the link between."""

    name: str
    """Who it is in logs and fault records (``link-1``: learner 1's link)."""
    listen: tuple[str, int]
    """Address to listen on (port 0: any free one)."""
    to: tuple[str, int]
    """Address every accepted connection is forwarded to."""
    link: LinkConfig = field(default_factory=LinkConfig)
    """The link's shape."""
    faults: LinkFaults = field(default_factory=LinkFaults)
    """Its partitions and resets."""


EventSink = Callable[[str, LinkEvent], None]


class FaultLog:
    """Appends one JSON object per line to a faults.jsonl (the launcher's format): each record
    one ``write`` of a whole line, so lines from several processes never interleave."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __call__(self, target: str, ev: LinkEvent) -> None:
        rec: dict[str, Any] = {"event": "fault", "time": ev.time, "kind": f"link {ev.kind}", "target": target}
        if ev.duration_s:
            rec["duration_s"] = ev.duration_s
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:  # a full disk must not take the link down with it
            log.warning("could not log %s to %s: %s", rec, self.path, e)


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0): what a peer sees when a connection is reset."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Connection:
    """One relayed connection: two directions, each a reader and a writer task."""

    def __init__(
        self,
        relay: Relay,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        server: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        number: int,
    ) -> None:
        self.relay = relay
        self.client, self.server = client, server
        cfg = relay.route.link

        def shaper(direction: str) -> DirectionShaper:
            rng = random.Random(f"{relay.seed}:{relay.route.name}:{number}:{direction}")
            d = cfg.up if direction == "up" else cfg.down
            site = relay.site[0] if direction == "up" else relay.site[1]
            return DirectionShaper(d, cfg.buffer_bytes, cfg.chunk_bytes, rng, relay.timeline, site)

        self.up, self.down = shaper("up"), shaper("down")
        self.task: asyncio.Task[None] | None = None
        self._wakes: list[asyncio.Event] = []

    def wake(self) -> None:
        """Look at the queues again now (a hold ended early or on another clock)."""
        for e in self._wakes:
            e.set()

    async def run(self) -> None:
        tasks = [
            asyncio.create_task(self._direction(self.client[0], self.server[1], self.up)),
            asyncio.create_task(self._direction(self.server[0], self.client[1], self.down)),
        ]
        try:
            await asyncio.gather(*tasks)
            for _, w in (self.client, self.server):
                w.close()
        except (OSError, asyncio.IncompleteReadError) as e:
            # One side reset or failed: the other side sees a reset too, as across a real path.
            log.debug("%s: connection ended: %s", self.relay.route.name, e)
            self.reset()
        finally:
            for t in tasks:  # the other direction, still waiting for bytes that will not come
                t.cancel()

    def reset(self) -> None:
        for _, w in (self.client, self.server):
            _rst(w)

    async def _direction(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sh: DirectionShaper) -> None:
        clock = self.relay.clock
        has_data, has_room = asyncio.Event(), asyncio.Event()
        self._wakes.append(has_data)
        eof = False

        async def read() -> None:
            nonlocal eof
            while True:
                while sh.space() == 0:  # full: stop reading, so the sender's TCP window closes
                    has_room.clear()
                    await has_room.wait()
                data = await reader.read(min(sh.chunk_bytes, sh.space()))
                if not data:
                    eof = True
                    has_data.set()
                    return
                sh.offer(clock(), data)
                has_data.set()

        async def write() -> None:
            while True:
                has_data.clear()
                now = clock()
                chunks = sh.due(now)
                if chunks:
                    writer.write(b"".join(chunks))
                    await writer.drain()
                    has_room.set()
                    continue
                nxt = sh.next_due(now)
                if nxt is None and eof:
                    if writer.can_write_eof():
                        writer.write_eof()  # half-close: the other direction may still be talking
                    return
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(has_data.wait(), None if nxt is None else max(0.0, nxt - now))

        await asyncio.gather(read(), write())


class Relay:
    """One route's listener, its connections and its fault timeline, on the running loop."""

    def __init__(
        self,
        route: Route,
        clock: Callable[[], float],
        seed: int = 0,
        site: tuple[SiteRate | None, SiteRate | None] = (None, None),
        on_event: EventSink | None = None,
    ) -> None:
        """``clock``: seconds on the faults' time axis (since the run started); ``site``: the
        aggregate caps (up, down) this relay shares with others; ``on_event``: each fault as it
        happens (e.g. a ``FaultLog``)."""
        self.route, self.clock, self.seed, self.site = route, clock, seed, site
        self.on_event = on_event
        self.timeline = FaultTimeline(route.faults, random.Random(f"{seed}:{route.name}:faults"))
        self.connections: set[_Connection] = set()
        self.accepted = 0
        self.refused = 0
        self._server: asyncio.base_events.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> int:
        """Listen; returns the port (the one asked for, or the free one found)."""
        host, port = self.route.listen
        self._server = await asyncio.start_server(self._accept, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._ticker = asyncio.create_task(self._tick())
        log.info("%s: %s:%d -> %s:%d, %s", self.route.name, host, self.port, *self.route.to, self.route.link.describe())
        return self.port

    def stop_faults(self) -> None:
        """No more faults from now on (a hold or cut under way ends now)."""
        self.timeline.stop(self.clock())
        for c in self.connections:
            c.wake()

    def reset_all(self) -> None:
        for c in list(self.connections):
            c.reset()
            if c.task is not None:
                c.task.cancel()
        self.connections.clear()

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        if self._server is not None:
            self._server.close()
        tasks = [c.task for c in self.connections if c.task is not None]
        self.reset_all()
        if tasks:  # let them finish cancelling, so that none is left pending when the loop ends
            await asyncio.wait(tasks, timeout=2.0)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _tick(self) -> None:
        last = self.clock()
        for kind, end in (("hold", self.timeline.hold_end(last)), ("cut", self.timeline.cut_end(last))):
            if end is not None and self.on_event is not None:  # under way before we started: say so
                self.on_event(self.route.name, LinkEvent(last, kind, end - last))  # type: ignore[arg-type]
        while True:
            await asyncio.sleep(FAULT_TICK_S)
            now = self.clock()
            for ev in self.timeline.events(last, now):
                log.info("%s: %s at %.2f s%s", self.route.name, ev.kind, ev.time,
                         f" for {ev.duration_s:g} s" if ev.duration_s else "")  # fmt: skip
                if ev.kind in ("reset", "cut"):
                    self.reset_all()
                elif ev.kind == "hold end":  # what waited for it leaves now, not at a sleep's end
                    for c in self.connections:
                        c.wake()
                if self.on_event is not None:
                    self.on_event(self.route.name, ev)
            last = now

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.timeline.cut_end(self.clock()) is not None:
            self.refused += 1
            _rst(writer)  # cut: the learner's connect fails at once, as on a dead path
            return
        try:
            server = await asyncio.wait_for(asyncio.open_connection(*self.route.to), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            log.debug("%s: cannot reach %s:%d: %s", self.route.name, *self.route.to, e)
            _rst(writer)
            return
        if self.timeline.cut_end(self.clock()) is not None:  # a cut began while connecting
            _rst(writer)
            _rst(server[1])
            return
        self.accepted += 1
        conn = _Connection(self, (reader, writer), server, self.accepted)
        self.connections.add(conn)
        conn.task = asyncio.current_task()
        try:
            await conn.run()
        except asyncio.CancelledError:
            conn.reset()
        finally:
            self.connections.discard(conn)


async def serve(
    routes: Iterable[Route],
    clock: Callable[[], float],
    stop: asyncio.Event,
    seed: int = 0,
    site_rate_bps: float = 0.0,
    on_event: EventSink | None = None,
    on_ready: Callable[[list[Relay]], None] | None = None,
    stop_faults: asyncio.Event | None = None,
) -> None:
    """Run one relay per route until ``stop`` is set; ``site_rate_bps`` (> 0): one aggregate cap
    per direction that all of them share; ``on_ready``: called once every relay listens;
    ``stop_faults``: when set, no more faults (the links keep their shape)."""
    site = (SiteRate(site_rate_bps), SiteRate(site_rate_bps)) if site_rate_bps > 0 else (None, None)
    relays = [Relay(r, clock, seed, site, on_event) for r in routes]
    try:
        for r in relays:
            await r.start()
        if on_ready is not None:
            on_ready(relays)
        if stop_faults is not None:
            waiter = asyncio.create_task(stop_faults.wait())
            await asyncio.wait([waiter, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
            if stop_faults.is_set():
                for r in relays:
                    r.stop_faults()
        await stop.wait()
    finally:
        for r in relays:
            await r.close()


class RelayThread:
    """Relays on an event loop of their own, for code that is not asyncio (a bench script, a
    test with blocking sockets): ``ports`` once started, ``close()`` to stop."""

    def __init__(
        self,
        routes: list[Route],
        clock: Callable[[], float],
        seed: int = 0,
        site_rate_bps: float = 0.0,
        on_event: EventSink | None = None,
    ) -> None:
        self.ports: list[int] = []
        self.relays: list[Relay] = []
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        ready = threading.Event()
        failed: list[BaseException] = []

        def on_ready(relays: list[Relay]) -> None:
            self.relays, self.ports = relays, [r.port for r in relays]
            ready.set()

        async def main() -> None:
            try:
                await serve(routes, clock, self._stop, seed, site_rate_bps, on_event, on_ready)
            except BaseException as e:  # a bind error: tell the caller, not the void
                failed.append(e)
                ready.set()

        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(main(),), daemon=True)
        self._thread.start()
        ready.wait(30)
        if failed:
            self._thread.join(5)
            raise failed[0]

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` on the relays' loop (e.g. ``relay.reset_all``) and return what it returns."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> RelayThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
