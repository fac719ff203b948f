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

An evaluator keeps its copy of the global model current by what changed (``GlobalCopy``): a
poll (``FetchGlobal(versions_only=True)``: versions, merged tokens, the run's end; no values)
tells it whether an evaluation is due, and a refresh sends the versions it holds, so each shard
answers with the values of the fragments whose version moved since, and no others. ``Moved``
counts the bytes it sent and received (the syncer's traffic meter counts the same frames as
``observer`` traffic, apart from every learner's).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import zmq

from ddiloco.config import Config
from ddiloco.core.fragments import FragmentLayout, write_fragment
from ddiloco.errors import DDiLoCoError
from ddiloco.protocol.config import EvalCadence
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


@dataclass
class Moved:
    """Bytes an observer moved on its connections to the syncer, frames as they are on the wire
    (headers included): ``up`` what it sent, ``down`` what it received."""

    up: int = 0
    down: int = 0

    def total(self) -> int:
        return self.up + self.down


def frames_nbytes(frames: Iterable[Any]) -> int:
    """Bytes of a message's frames (bytes, buffers or ``zmq.Frame``)."""
    return sum(memoryview(f.buffer if hasattr(f, "buffer") else f).nbytes for f in frames)


def ask(
    address: str,
    request: Any,
    reply_type: type[R],
    timeout_s: float,
    keys: ClientKeys | None = None,
    moved: Moved | None = None,
) -> R:
    """Send ``request`` to the syncer at ``address`` and return its reply of ``reply_type``;
    ``NoReply`` when none arrives within ``timeout_s``. Without ``keys``: the observer's keys of
    a ``SyncerServer`` serving ``address`` in this process, if there is one (else none).
    ``moved`` adds up the bytes sent and received."""
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
        frames = encode(request)
        try:
            sock.send_multipart(frames)
            if moved is not None:
                moved.up += frames_nbytes(frames)
        except zmq.Again:
            deadline = time.monotonic()  # could not even be sent: no answer will come
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(max(1, int(left * 1000))):
                break
            got = sock.recv_multipart(copy=False)
            if moved is not None:
                moved.down += frames_nbytes(got)
            try:
                msg = decode(got)
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
    """Write the fetched fragments into ``model`` (those a state carries values for: all of them
    in the answer to a plain ``FetchGlobal``); returns the version of every fragment listed."""
    params = synced_tensors(model)  # the parameters and the persistent buffers
    versions: dict[str, int] = {}
    for st in states:
        versions.update(st.versions)
        for p_text in st.versions:
            _write(params, layout, int(p_text), st)
    return {k: versions[k] for k in sorted(versions, key=int)}


def _write(params: dict[str, torch.Tensor], layout: FragmentLayout, p: int, st: GlobalState) -> bool:
    """Write fragment ``p``'s values from ``st`` into ``params``; False (nothing written) when
    ``st`` does not carry every piece of it, or ``p`` is not a fragment of ``layout``."""
    if not 0 <= p < layout.num_fragments:
        return False
    names = [f"{p}.{i}" for i in range(len(layout.fragments[p]))]
    if not all(n in st.tensors for n in names):
        return False
    write_fragment(params, layout.fragments[p], [st.tensors[n] for n in names])
    return True


def _numeric(key: str) -> tuple[int, str]:
    """Fragment indices as strings in numeric order (whatever else a key holds sorts after)."""
    return (len(key), key) if key.isascii() and key.isdigit() else (1 << 30, key)


AskShard = Callable[[int, FetchGlobal, Moved], GlobalState | None]
"""One request to shard ``k`` of the syncer: its answer, or None when none came in time (the
bytes go to the ``Moved`` given)."""


@dataclass(frozen=True)
class Seen:
    """What one request to every shard saw."""

    versions: dict[str, int]
    """Every fragment's version (the copy holds these after a refresh)."""
    merged_tokens: float
    """Tokens merged into the global model (the mean over the shards)."""
    tokens_per_step: float
    """One learner's tokens per inner step, as reported (0: not yet)."""
    run_ended: bool
    """Every shard says the run has ended: this is the final model."""
    fetched: int
    """Fragments whose values came (0 for a poll)."""


class GlobalCopy:
    """An observer's copy of the global model (the evaluator's model, the evaluate hook's copy),
    kept current by what changed: ``refresh`` sends each shard the versions the copy holds and
    writes what comes back; ``poll`` asks for the versions only. ``moved`` counts the bytes."""

    def __init__(self, model: torch.nn.Module, layout: FragmentLayout, shards: int, ask: AskShard, requester: str):
        self.model, self.layout, self.ask, self.requester = model, layout, ask, requester
        self.held: list[dict[str, int]] = [{} for _ in range(shards)]
        """Per shard, the version of each of its fragments that the model holds."""
        self.moved = Moved()
        """Bytes sent and received, polls included, since the start."""
        self.fetched = 0
        """Fragments fetched since the start."""

    @property
    def complete(self) -> bool:
        """Whether the model holds every fragment of the layout (each at the version ``held``
        lists). Until then part of it is what it was built with, unwritten memory for a model
        built to receive (``training.empty_model``): nothing may evaluate it."""
        held = {k for h in self.held for k in h}
        return all(str(p) in held for p in range(self.layout.num_fragments))

    def versions(self) -> dict[str, int]:
        """The version of every fragment the model holds."""
        held = {k: v for h in self.held for k, v in h.items()}
        return {k: held[k] for k in sorted(held, key=_numeric)}

    def poll(self) -> Seen | None:
        """Every shard's versions, merged tokens and end, no values (None: a shard did not answer)."""
        return self._ask_all(versions_only=True)

    def refresh(self) -> Seen | None:
        """Fetch the fragments whose version moved since the copy's last fetch and write them into
        the model (None: a shard did not answer; what the others sent is kept)."""
        return self._ask_all(versions_only=False)

    def _ask_all(self, versions_only: bool) -> Seen | None:
        versions: dict[str, int] = {}
        merged: list[float] = []
        per_step, ended, fetched = 0.0, True, 0
        for k in range(len(self.held)):
            st = self.ask(k, FetchGlobal(self.requester, dict(self.held[k]), versions_only), self.moved)
            if st is None:
                return None
            if not versions_only:
                fetched += self._take(k, st)  # written into the model: the answer's values are let go
            versions.update(st.versions)
            merged.append(st.merged_tokens)
            per_step, ended = max(per_step, st.tokens_per_step), ended and st.run_ended
        self.fetched += fetched
        ordered = {k: versions[k] for k in sorted(versions, key=_numeric)}
        return Seen(ordered, sum(merged) / max(1, len(merged)), per_step, ended, fetched)

    def _take(self, shard: int, st: GlobalState) -> int:
        """Write what ``st`` carries into the model; the shard's held versions become those of
        what the model now holds. Returns the fragments written."""
        params = synced_tensors(self.model)
        before, held = self.held[shard], {}
        written = 0
        for p_text, version in st.versions.items():
            if p_text.isascii() and p_text.isdigit() and _write(params, self.layout, int(p_text), st):
                held[p_text] = version
                written += 1
            elif before.get(p_text) == version:
                held[p_text] = version  # unchanged: not sent, and the model has it
        self.held[shard] = held  # a fragment neither sent nor held at that version is asked for again
        return written


def cadence_of(cfg: Config, every_tokens: float | None = None) -> EvalCadence:
    """A run's evaluation cadence (``runtime.eval_every_tokens``, unless ``every_tokens``)."""
    every = cfg.runtime.eval_every_tokens if every_tokens is None else every_tokens
    return EvalCadence(every, cfg.algo.sync_every, cfg.algo.up_payload, cfg.algo.down_payload)


def here() -> str:
    """This machine and process, for an evaluator's records."""
    return f"{socket.gethostname()} (pid {os.getpid()})"


class Evaluations:
    """An observer's evaluations of its ``GlobalCopy`` at an ``EvalCadence``: whether one is due,
    and what each record says of the observer: where it runs, the fragments it fetched and the
    bytes it moved since the previous one (polls included)."""

    def __init__(self, copy: GlobalCopy, cadence: EvalCadence, where: str) -> None:
        self.copy, self.cadence, self.where = copy, cadence, where
        self._moved = Moved()
        self._fetched = 0

    def due(self, seen: Seen) -> bool:
        """Whether ``seen`` (a poll) has passed the next mark."""
        return self.cadence.due(seen.merged_tokens, seen.tokens_per_step)

    def made(self, seen: Seen) -> dict[str, Any]:
        """An evaluation of the copy as ``seen`` (a refresh) left it was made: its record's fields
        about the observer (``where``, ``fragments_fetched``, ``bytes_down``, ``bytes_up``:
        since the previous one), and the cadence moves on to the next mark."""
        c = self.copy
        fields = {
            "where": self.where,
            "fragments_fetched": c.fetched - self._fetched,
            "bytes_down": c.moved.down - self._moved.down,
            "bytes_up": c.moved.up - self._moved.up,
        }
        self._moved, self._fetched = Moved(c.moved.up, c.moved.down), c.fetched
        self.cadence.evaluated(seen.merged_tokens)
        return fields

    def describe(self, tokens_per_step: float = 0.0) -> str:
        """The cadence in words."""
        if self.cadence.every_tokens > 0:
            return f"every {self.cadence.every_tokens:,.0f} merged tokens (runtime.eval_every_tokens)"
        every = self.cadence.every(tokens_per_step)
        auto = "automatic: 40 x H x a learner's tokens per step / (up + down bytes per value)"
        return f"every {every:,.0f} merged tokens ({auto})" if every else f"{auto}, once the learners report them"

    def line(self, fields: dict[str, Any], seen: Seen) -> str:
        """The observer's part of an evaluation's log line: fragments and bytes, the next mark."""
        mark = self.cadence.next_mark(seen.tokens_per_step)
        nxt = "once the learners report their tokens per step" if mark is None else f"at {mark:,.0f} merged tokens"
        return (
            f"fetched {fields['fragments_fetched']} of {len(seen.versions)} fragments, {fields['bytes_down']:,} bytes "
            f"down and {fields['bytes_up']:,} up since the last evaluation (polls included; "
            f"{self.copy.moved.total():,} in all); the next {nxt}"
        )
