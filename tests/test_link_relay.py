"""The link emulator on real loopback sockets: bytes intact and in order, a cut that resets and
refuses and then lets a new connection through, CURVE through the relay, the command line.

The fault clock is a variable the test moves (no wall-clock asserts); every wait is bounded."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time

import pytest
import torch
import zmq

from ddiloco.cli import main
from ddiloco.link.config import LinkFaults, Partition, parse_link
from ddiloco.link.relay import Relay, RelayThread, Route

torch.set_num_threads(1)
LOOP = "127.0.0.1"


class VirtualClock:
    """The relay's fault clock, moved by the test."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def echo_server() -> asyncio.base_events.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()
        except OSError:
            writer.transport.abort()

    return await asyncio.start_server(echo, LOOP, 0)


def port_of(server: asyncio.base_events.Server) -> int:
    return server.sockets[0].getsockname()[1]


async def roundtrip(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(LOOP, port)

    async def send() -> None:
        for i in range(0, len(payload), 7919):  # odd-sized writes: the relay re-chunks them
            writer.write(payload[i : i + 7919])
            await writer.drain()
        writer.write_eof()

    sender = asyncio.create_task(send())
    got = await reader.read(-1)  # to EOF: the echo closes after our half-close came through
    await sender
    writer.close()
    return got


def test_bytes_arrive_intact_and_in_order_through_a_small_buffer():
    async def go() -> None:
        echo = await echo_server()
        # a tiny queue, tiny chunks and jitter: backpressure and re-chunking on every byte
        link = parse_link("latency=2ms,jitter=2ms,buffer=8KiB,chunk=1KiB,stall=0.01:5ms")
        relay = Relay(Route("link-t", (LOOP, 0), (LOOP, port_of(echo)), link), time.monotonic, seed=1)
        port = await relay.start()
        payload = random.Random(0).randbytes(300_000)
        try:
            got = await asyncio.wait_for(roundtrip(port, payload), 20)
            assert got == payload
            more = await asyncio.wait_for(roundtrip(port, b"second connection"), 10)
            assert more == b"second connection" and relay.accepted == 2
        finally:
            await relay.close()
            echo.close()

    asyncio.run(go())


def test_a_stalled_receiver_fills_the_relays_bounded_queue_and_no_more():
    async def go() -> None:
        release, received = asyncio.Event(), bytearray()

        async def slow_sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await release.wait()  # reads nothing until told: the relay's queue must stop filling
            while data := await reader.read(65536):
                received.extend(data)
            writer.close()

        # A small, fixed receive buffer on the sink (inherited by its connections): the kernel may
        # otherwise autotune it up to net.ipv4.tcp_rmem's maximum (32 MiB on some machines) and
        # swallow the whole payload before the relay's queue is ever needed.
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        lsock.bind((LOOP, 0))
        sink = await asyncio.start_server(slow_sink, sock=lsock)
        link = parse_link("buffer=64KiB,chunk=16KiB")
        relay = Relay(Route("link-b", (LOOP, 0), (LOOP, port_of(sink)), link), time.monotonic)
        port = await relay.start()
        payload = random.Random(1).randbytes(16 * 1024 * 1024)
        try:
            _, writer = await asyncio.open_connection(LOOP, port)
            writer.write(payload)  # far more than every buffer on the way holds
            sending = asyncio.create_task(writer.drain())
            # What the relay holds is its shaper's queue plus what its writer has handed to the
            # sink's transport and not yet sent (asyncio blocks the writer above its high-water
            # mark). Poll until it holds something and then watch a while: it never goes past
            # its bound, and the sender stays held back. (Whether the bytes sit in the queue or
            # in the transport at a given moment is timing, not behaviour.)
            high = 64 * 1024  # asyncio's default high-water mark for a transport's buffer
            peak, settled = 0, 0
            for _ in range(3000):
                await asyncio.sleep(0.01)
                for c in relay.connections:
                    held = c.up.queued_bytes + c.server[1].transport.get_write_buffer_size()
                    peak = max(peak, held)
                settled = settled + 1 if peak > 0 else 0
                if settled >= 50:
                    break
            assert 0 < peak <= link.buffer_bytes + high + link.buffer_bytes, (relay.accepted, peak)
            assert not sending.done()  # the sender is held back: backpressure reached it
            release.set()
            await asyncio.wait_for(sending, 30)
            writer.write_eof()
            for _ in range(3000):
                if len(received) == len(payload):
                    break
                await asyncio.sleep(0.01)
            assert bytes(received) == payload
            writer.close()
        finally:
            await relay.close()
            sink.close()

    asyncio.run(go())


async def _reset_or_closed(reader: asyncio.StreamReader) -> bool:
    """True when the connection was reset or closed (no bytes came)."""
    try:
        return await asyncio.wait_for(reader.read(100), 5) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def test_a_cut_resets_refuses_while_it_lasts_then_a_new_connection_works():
    async def go() -> None:
        echo = await echo_server()
        clock = VirtualClock()
        faults = LinkFaults(partitions=(Partition("cut", 10.0, 10.0),))
        events = []
        relay = Relay(Route("link-c", (LOOP, 0), (LOOP, port_of(echo)), parse_link(""), faults), clock,
                      on_event=lambda name, ev: events.append((name, ev.kind)))  # fmt: skip
        port = await relay.start()
        try:
            reader, writer = await asyncio.open_connection(LOOP, port)
            writer.write(b"before")
            assert await asyncio.wait_for(reader.readexactly(6), 5) == b"before"
            clock.t = 15.0  # into the cut: the relay's next look resets the connection
            assert await _reset_or_closed(reader)
            writer.transport.abort()
            r2, w2 = await asyncio.open_connection(LOOP, port)  # while cut: accepted, then reset at once
            w2.write(b"during")
            assert await _reset_or_closed(r2)
            w2.transport.abort()
            assert relay.refused == 1
            clock.t = 25.0
            for _ in range(500):  # the relay sees the cut end at its next tick (however busy the machine)
                if ("link-c", "cut end") in events:
                    break
                await asyncio.sleep(0.01)
            assert await asyncio.wait_for(roundtrip(port, b"after"), 10) == b"after"
            assert events == [("link-c", "cut"), ("link-c", "cut end")]
        finally:
            await relay.close()
            echo.close()

    asyncio.run(go())


def test_a_hold_delays_then_delivers_everything():
    async def go() -> None:
        echo = await echo_server()
        clock = VirtualClock()
        faults = LinkFaults(partitions=(Partition("hold", 10.0, 10.0),))
        relay = Relay(Route("link-h", (LOOP, 0), (LOOP, port_of(echo)), parse_link(""), faults), clock)
        port = await relay.start()
        try:
            reader, writer = await asyncio.open_connection(LOOP, port)
            clock.t = 12.0
            await asyncio.sleep(0.05)
            writer.write(b"held")
            with pytest.raises(asyncio.TimeoutError):  # nothing comes while it holds
                await asyncio.wait_for(reader.readexactly(4), 0.3)
            clock.t = 21.0  # the hold ends: what waited goes through, on the same connection
            assert await asyncio.wait_for(reader.readexactly(4), 5) == b"held"
            writer.close()
        finally:
            await relay.close()
            echo.close()

    asyncio.run(go())


def test_curve_through_the_relay_and_after_a_reset():
    ctx = zmq.Context()
    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    router = ctx.socket(zmq.ROUTER)
    router.curve_server = True
    router.curve_publickey, router.curve_secretkey = server_pub, server_sec
    router.linger = 0
    router_port = router.bind_to_random_port(f"tcp://{LOOP}")
    dealer = ctx.socket(zmq.DEALER)
    dealer.curve_serverkey = server_pub
    dealer.curve_publickey, dealer.curve_secretkey = client_pub, client_sec
    dealer.linger = 0
    relays = RelayThread([Route("link-z", (LOOP, 0), (LOOP, router_port), parse_link("5mbit,5ms"))], time.monotonic)
    try:
        dealer.connect(f"tcp://{LOOP}:{relays.ports[0]}")

        def exchange(body: bytes, tries: int = 1) -> None:
            for _ in range(tries):  # what was in flight when a connection was reset is lost, as on TCP
                dealer.send(body)
                if router.poll(2_000):
                    break
            assert router.poll(0), "the ROUTER heard nothing through the relay"
            peer, got = router.recv_multipart()
            assert got == body
            router.send_multipart([peer, b"re:" + body])
            assert dealer.poll(10_000), "the DEALER heard no reply through the relay"
            assert dealer.recv() == b"re:" + body

        exchange(b"hello over CURVE" * 100)
        relays.call(relays.relays[0].reset_all)  # a reset: ZeroMQ reconnects through the relay
        exchange(b"after the reset", tries=5)
        assert relays.relays[0].accepted >= 2
    finally:
        relays.close()
        dealer.close()
        router.close()
        ctx.term()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--link", "10mbyte,50ms"], "'10mbyte' is neither a rate nor a latency"),
        (["--link", "10mbit,latency=5ms,jitter=9ms"], "jitter_s"),
        (["--link", "stall=0.5"], "PROBABILITY:DURATION"),
        (["--faults", "hold:30s@40%"], "needs the run's length"),
        (["--faults", "boom:1s"], "unknown kind 'boom'"),
    ],
)
def test_a_bad_link_or_fault_is_one_clear_line(argv, needle, capsys):
    assert main(["link", "--listen", f"{LOOP}:0", "--to", f"{LOOP}:1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_the_link_command_needs_its_addresses(capsys):
    assert main(["link", "--link", "10mbit"]) == 2
    assert "--listen HOST:PORT and --to HOST:PORT" in capsys.readouterr().err
    assert main(["link", "--listen", "nowhere", "--to", f"{LOOP}:1"]) == 2
    assert "--listen 'nowhere' is not HOST:PORT" in capsys.readouterr().err


@pytest.mark.slow
def test_the_link_command_relays_and_stops_on_sigterm(tmp_path):
    import signal
    import subprocess
    import sys

    async def go() -> None:
        echo = await echo_server()
        ready = tmp_path / "ready.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, "-m", "ddiloco", "link", "--listen", f"{LOOP}:0", "--to", f"{LOOP}:{port_of(echo)}",
                "--link", "10mbit,5ms", "--faults", "reset_every:1h", "--ready-file", str(ready)]  # fmt: skip
        proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 60
            while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert ready.exists(), proc.stderr.read().decode() if proc.poll() is not None else "no ready file"
            import json

            port = json.loads(ready.read_text())["ports"][0]
            assert await asyncio.wait_for(roundtrip(port, b"through a process"), 10) == b"through a process"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            echo.close()

    asyncio.run(go())
