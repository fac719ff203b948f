"""Asking a syncer as an observer: one request, one reply, a bounded wait.

The evaluator (``FetchGlobal`` -> ``GlobalState``), ``ddiloco status`` (``StatusRequest`` ->
``StatusReply``) and ``ddiloco export`` from a live syncer all read the syncer through ``ask``:
a short-lived ZeroMQ DEALER with a fresh identity (CURVE with the observer's keys when given,
else with those of a ``SyncerServer`` serving that address in this process, which makes keys by
default), one request, and a wait of at most ``timeout_s`` for a reply of the expected type.
Anything else that arrives meanwhile is skipped: a message of another type, or one
``wire.decode`` refuses. When no reply came in time, ``NoReply`` says so in one line, and says
too if what came could not be read (another ddiloco version), since that is a different fix from
a syncer that is not there.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, TypeVar

import torch
import zmq

from ddiloco.core.fragments import FragmentLayout, write_fragment
from ddiloco.errors import DDiLoCoError
from ddiloco.protocol.messages import FetchGlobal, GlobalState, StatusReply, StatusRequest
from ddiloco.service.base.keys import ClientKeys, client_keys, local_keys
from ddiloco.service.base.wire import WireError, decode, encode
from ddiloco.training.layout import synced_tensors

R = TypeVar("R")

KEYS_HINT = "a syncer with keys needs --keys DIR holding observer.key_secret"


class NoReply(DDiLoCoError):
    """A syncer did not answer an observer's request in time (the message says what to check)."""


def observer_keys(addresses: list[str], keys: str | Path | ClientKeys | None, insecure: bool) -> ClientKeys | None:
    """The observer's keys for ``addresses`` (the learners' rule, under the name ``observer``:
    a keys folder or ``observer.key_secret``; none on this machine or with ``insecure``)."""
    return client_keys(addresses, keys, "observer", insecure)


def ask(address: str, request: Any, reply_type: type[R], timeout_s: float, keys: ClientKeys | None = None) -> R:
    """Send ``request`` to the syncer at ``address`` and return its reply of ``reply_type``;
    ``NoReply`` when none arrives within ``timeout_s``. Without ``keys``: the observer's keys of
    a ``SyncerServer`` serving ``address`` in this process, if there is one (else none)."""
    if keys is None and (folder := local_keys([address])) is not None:
        keys = ClientKeys.load(folder, "observer")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    unreadable = ""
    try:
        if keys is not None:
            keys.apply(sock)
        sock.setsockopt(zmq.LINGER, 0)
        # A DEALER without a peer blocks in send forever; a refused CURVE handshake (a wrong
        # key) can leave it so: the send is bounded like the answer.
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        # No routing id of our own: the syncer's ROUTER names this connection, and replies to it
        sock.connect(address)
        deadline = time.monotonic() + timeout_s
        try:
            sock.send_multipart(encode(request))
        except zmq.Again:
            deadline = time.monotonic()  # could not even be sent: no answer will come
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(max(1, int(left * 1000))):
                break
            try:
                msg = decode(sock.recv_multipart(copy=False))
            except WireError as e:
                unreadable = str(e)  # not the reply; keep waiting, but say so if nothing else comes
                continue
            if isinstance(msg, reply_type):
                return msg
    finally:
        sock.close(0)
    if unreadable:
        raise NoReply(
            f"no readable answer from {address} within {timeout_s:g} s: it sent a message this ddiloco cannot "
            f"read ({unreadable}); do the syncer and this command run the same ddiloco version?"
        )
    raise NoReply(
        f"no answer from {address} within {timeout_s:g} s: is the syncer running? (check the address and port; "
        f"{KEYS_HINT})"
    )


def fetch_global(
    addresses: list[str], timeout_s: float, keys: ClientKeys | None = None, requester: str = "observer"
) -> list[GlobalState]:
    """Every syncer shard's fragments of the global model, in shard order (``NoReply`` if any
    shard does not answer). ``requester`` names the asker in the syncer's log."""
    return [ask(addr, FetchGlobal(requester), GlobalState, timeout_s, keys) for addr in addresses]


def fetch_status(
    address: str, timeout_s: float, keys: ClientKeys | None = None, requester: str = "ddiloco status"
) -> dict[str, Any]:
    """One syncer shard's fleet view (``NoReply`` if it does not answer)."""
    return ask(address, StatusRequest(requester), StatusReply, timeout_s, keys).status


def write_global_states(model: torch.nn.Module, layout: FragmentLayout, states: list[GlobalState]) -> dict[str, int]:
    """Write the fetched fragments into ``model``; returns the version of every fragment."""
    params = synced_tensors(model)  # the parameters and the persistent buffers
    versions: dict[str, int] = {}
    for st in states:
        versions.update(st.versions)
        for p_text in st.versions:
            p = int(p_text)
            pieces = layout.fragments[p]
            write_fragment(params, pieces, [st.tensors[f"{p}.{i}"] for i in range(len(pieces))])
    return {k: versions[k] for k in sorted(versions, key=int)}
