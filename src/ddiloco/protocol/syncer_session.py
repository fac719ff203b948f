"""A syncer shard's side of the protocol as one pure state machine: ``SyncerSession``.

It owns the algorithm's ``Syncer`` core and every protocol rule around it:

- registration: a learner's id against the run's cap (``num_learners``), the settings it
  claims against the run's (``protocol.settings``), its parameters and layout against the
  shard's; its id is bound to the peer that registered it (and, with keys, to its key), and
  the core's ``Join`` follows; a refusal is answered with its reason. A learner given no config
  asks for the run's settings first (``SettingsRequest``, answered with ``RunSettings``);
- who may say what: messages for learner m are taken only from the peer bound to m (with keys,
  only from m's key; an observer key may only read). A peer is a connection the driver names
  (never a name the sender chose), so the route of learner m is bound to the connection with
  m's key that registered it, and no other key can displace it; a peer that is not bound is
  told so (``SyncerHeartbeat(bound=False)``) and registers again, on a fresh connection;
- the optimizer hand-off: a rejoining learner's request is relayed to one live peer that is
  not serving another, at most one outstanding per requester and one per
  ``peer_state_interval_s``; only the chosen peer's answer is relayed back, once (in pieces,
  each moving the request's expiry on: it follows progress);
- reads (``FetchGlobal``, ``StatusRequest``) at most ``max_fetches_per_s`` per key; a
  ``FetchGlobal`` gets every version, and the values only of the fragments whose version
  differs from what the observer says it holds (none for a poll, ``versions_only``);
- the learners' reported progress (``fleet.FleetBook``) and the run's budget: tokens processed
  by the fleet, tokens merged, the run's age;
- the run's end, in stages: "stop" (the learners stop training; open rounds close), "final"
  (the final sync merges every live learner's remaining progress), "done" (the final model is
  written; learners that register, ask or speak later are told), then a linger before the
  driver leaves.

Every call is handed the time and returns a ``SyncerOutput``: what to make durable (first),
what to keep on the tape, what to send to whom, what to count and log. Peers are opaque
hashable handles chosen by the driver (a transport identity, or a learner id in the simulator).
Nothing here reads a clock, sleeps, logs, or touches a socket or a file.

Theory of operation
-------------------
Each learner id is *unknown* until an accepted ``Register`` binds it to the peer that sent it
(``identities``); it stays bound to that peer until a newer incarnation registers (the old peer
is told it was superseded). Messages claiming a learner from any other peer are refused and
answered ``SyncerHeartbeat(bound=False)``. The run is *running* (``end_stage`` None) until the
``Budget`` is spent, then *stop* (``RunEnd("stop")`` to every bound peer, open rounds flushed),
*final* (after about two heartbeats: the final sync asks every live learner), *done* (the final
rounds closed or timed out: ``RunEnd("done")``, ``final_model``) and, ``end_linger_s`` later,
``stop`` for the driver.

Events, each handed ``now`` (the driver's seconds, virtual or monotonic):

- ``receive(peer, msg, now, principal)``: one decoded message -> ``SyncerOutput``;
- ``tick(now)``: rounds open and close, heartbeats, the end moves on -> ``SyncerOutput``;
- ``shutdown(now)``: the driver stops; open rounds close with what they have -> ``SyncerOutput``;
- ``next_deadline(now)``: when to call ``tick`` next (never before ``now``);
- ``restore(records, meta)`` once before any message; ``records``/``meta`` what to make durable.

Invariants: ``persist`` is made durable before ``send`` goes out (no learner sees a version a
restart could lose); only the core changes fragment values; a relayed optimizer state goes
only to the requester that asked, from the peer chosen for it, once; each call returns what to
do and never does it; after ``done`` a registering, asking or heartbeating learner is told so.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ddiloco.core.messages import Ack, Contribution, Heartbeat, Join, Leave
from ddiloco.core.syncer import FragmentRecord, Output, Syncer, SyncerView
from ddiloco.core.tape import TapeRecord
from ddiloco.protocol.config import RuntimeConfig
from ddiloco.protocol.fleet import FleetBook
from ddiloco.protocol.handoff import is_piece
from ddiloco.protocol.learner_session import Registration
from ddiloco.protocol.limits import RateLimits
from ddiloco.protocol.messages import (
    RUN_ID_LEN,
    FetchGlobal,
    GlobalState,
    JoinReply,
    PeerState,
    PeerStateRequest,
    Register,
    RunEnd,
    RunSettings,
    SettingsRequest,
    StatusRequest,
    SyncerHeartbeat,
    first_mismatch,
)
from ddiloco.protocol.settings import first_difference, settings_refusal

Peer = Hashable
"""Whom a message came from and goes to: the driver's handle (transport identity, learner id)."""
EndStage = Literal["stop", "final", "done"]
CORE_MESSAGES = (Heartbeat, Contribution, Ack, Leave)
RELAYED = (PeerStateRequest, PeerState)
NOTE_KINDS = (
    "malformed", "unknown_sender", "impostor", "rate_limited", "refused_relay", "superseded", "foreign_state",
    "implausible",
)  # fmt: skip
"""What a ``Note`` counts (the driver counts decoding failures as "malformed" too, and its own
receipt-time limits as "rate_limited"): a message from a key that may not say it; one for a
learner from a peer not bound to it; reads over ``max_fetches_per_s``; an optimizer hand-off
message outside the rules (a repeated or too early request, a state nobody asked that peer
for); a registration of a process that a newer one has replaced; a registration that claims
versions saved in another run; a heartbeat that claims more tokens than its rate cap allows
(``fleet.FleetBook``)."""


@dataclass(frozen=True)
class Budget:
    """When the run is over: the first of these to be spent ends it."""

    processed_tokens: float = math.inf
    """Tokens the fleet has processed, as its heartbeats report them (``run.processed_tokens``)."""
    merged_tokens: float = 0.0
    """Tokens merged into the global model (``run.merged_tokens``); 0: no such budget."""
    time_s: float = math.inf
    """The run's age in seconds (``runtime.duration_s``; the simulator's T for a time budget)."""
    time_key: str = "runtime.duration_s"
    """Where ``time_s`` comes from, for the reason the run ended."""

    def spent(self, processed: float, merged: float, age_s: float) -> str | None:
        """Why the run is over, or None."""
        if processed >= self.processed_tokens:
            return (
                f"{processed:,.0f} tokens processed by the fleet, the budget is {self.processed_tokens:,.0f} "
                "(run.processed_tokens)"
            )
        if self.merged_tokens > 0 and merged >= self.merged_tokens:
            return f"{merged:,.0f} tokens merged, the budget is {self.merged_tokens:,.0f} (run.merged_tokens)"
        if age_s >= self.time_s:
            return f"{age_s:,.0f} s since the run started, the budget is {self.time_s:,.0f} s ({self.time_key})"
        return None


@dataclass(frozen=True)
class Principal:
    """Who a message's key says its sender is (only when keys are in use)."""

    role: Literal["learner", "observer"]
    """A learner's key, or an observer's (read-only)."""
    learner: int | None = None
    """The learner id the key belongs to (None for an observer)."""


@dataclass
class Handoff:
    """One relayed optimizer-state request: who asked, whom the syncer chose, until when."""

    requester: int
    """The learner that asked."""
    incarnation: int
    """Its process."""
    source: int
    """The live peer chosen to answer (only its answer is relayed, once)."""
    until: float
    """When the request is forgotten (``peer_state_timeout_s`` after it was relayed, or after
    the last piece of the answer was)."""


@dataclass(frozen=True)
class Note:
    """Something the driver counts (``kind``, one of ``NOTE_KINDS``) and may log once per kind."""

    kind: str
    """What it counts."""
    text: str
    """A line for a human."""


@dataclass
class SyncerOutput:
    """What the driver must do after a call, in this order: make ``persist`` durable (the
    fragments' current versions, with ``meta``), keep ``tape``, write the final model when
    ``final_model``, append ``events`` to the run log, then send ``send``; count and log
    ``notes``; answer ``status_requests`` with its status; leave when ``stop``."""

    persist: list[int] = field(default_factory=list)
    """Fragments whose new version must be durable before anything is sent."""
    tape: list[TapeRecord] = field(default_factory=list)
    """Event-tape records."""
    send: list[tuple[Peer, Any]] = field(default_factory=list)
    """Messages, each to one peer, in order."""
    notes: list[Note] = field(default_factory=list)
    """Refused or unexpected messages, to count."""
    events: list[tuple[str, str]] = field(default_factory=list)
    """(what, reason) for the run log: "end" when the run has ended."""
    status_requests: list[Peer] = field(default_factory=list)
    """Observers that asked for the status (the driver adds its own process figures)."""
    final_model: bool = False
    """The final sync is done: write the final model now."""
    stop: bool = False
    """The run has ended and lingered: the driver may leave."""
    info: list[str] = field(default_factory=list)
    """What happened to the fleet, worth an INFO line: a learner lost, back, or gone."""

    def core(self, out: Output, identities: dict[int, Peer]) -> SyncerOutput:
        """Take the core's output: durable fragments, tape, and its messages to bound learners."""
        self.persist += [p for p in out.durable if p not in self.persist]
        self.tape += out.tape
        self.send += [(identities[m.learner], m) for m in out.messages if m.learner in identities]
        return self


class SyncerSession:
    """The protocol of one syncer shard."""

    def __init__(
        self,
        core: Syncer,
        rt: RuntimeConfig,
        budget: Budget,
        registration: Registration,
        now: float,
        *,
        shard: int = 0,
        epoch: int = 0,
        age_s: float = 0.0,
        ended: str | None = None,
        keyed: bool = False,
        num_learners: int | None = None,
        run: str = "",
    ) -> None:
        """``core``: the shard's core, restored from its store if there was one (see
        ``restore``); ``registration``: its model's parameters and layout digest, which every
        learner must match, and the run's settings (``Registration.settings``: what a learner
        given no config adopts, and what one given a config must agree with); ``epoch``: this
        start's incarnation (learners register again when it changes); ``age_s``: how old the
        run already was at ``now``; ``ended``: the reason, when the run had already ended before
        this start; ``keyed``: messages come with a ``Principal`` (CURVE keys), which must match
        what they claim; ``num_learners``: the run's cap on learner ids (``run.num_learners``:
        ids 0 .. num_learners - 1; None: no cap but ``algo.max_learners``); ``run``: the run's
        identity, told to every learner it accepts (``JoinReply.run``; a learner that claims
        versions of another run is taken as holding nothing): a new one for a fresh run, the
        store's (``meta``) once ``restore`` took it back."""
        self.core, self.rt, self.budget = core, rt, budget
        self.run = run
        self.registration = registration
        self.shard, self.epoch, self.keyed = shard, epoch, keyed
        self.num_learners = num_learners
        self.pids: dict[int, int] = {}
        """Learner id -> the process id its registered incarnation gave (for a superseded one's line)."""
        self.fleet = FleetBook(rt.token_rate_spread, rt.lone_tokens_per_s, core.cfg.liveness_timeout_s)
        self.identities: dict[int, Peer] = {}
        """Learner id -> the peer that registered it (messages for the id come only from there)."""
        self.handoffs: dict[int, Handoff] = {}
        """Requester -> its outstanding optimizer-state request (one at most)."""
        self._asked_at: dict[int, float] = {}
        """Requester -> when its last request was relayed (one per ``peer_state_interval_s``)."""
        self._fetches: RateLimits[Hashable] = RateLimits(rt.max_fetches_per_s, 10.0, max_keys=4096)
        self._started, self._age_at_start = now, age_s
        self._hb_at: float | None = None
        self.end_stage: EndStage | None = None
        self.end_reason = ""
        self._end_next = math.inf
        self._final_left = 0  # the final sync's fragments still to close, as last seen
        self._live_seen: set[int] = set()  # the live set at the last tick (its changes get a line)
        self._ever_live: set[int] = set()
        self._processed_at_end: float | None = None
        if ended is not None:  # a restart on a finished run: tell whoever registers, then leave
            self.end_stage, self.end_reason = "done", ended
            self._end_next = now + rt.end_linger_s

    # -- state -----------------------------------------------------------------------------

    def run_age(self, now: float) -> float:
        """Seconds since the run started (across restarts of this shard)."""
        return self._age_at_start + now - self._started

    def view(self, now: float, max_listed: int | None = None) -> SyncerView:
        """The core's read-only fleet view."""
        return self.core.view(now, max_listed)

    def records(self, fragments: list[int]) -> list[FragmentRecord]:
        """The durable state of each of ``fragments`` now."""
        return [self.core.fragment_record(p) for p in fragments]

    def meta(self) -> dict[str, Any]:
        """Everything else a restart needs (JSON-able): the core's meta state and the fleet's
        processed tokens (the budget keeps counting across restarts)."""
        return {**self.core.meta_state(), "fleet": self.fleet.state(), "run": self.run}

    def restore(self, records: dict[int, FragmentRecord], meta: dict[str, Any] | None, take: bool = False) -> None:
        """Take back what a store made durable (call before any message): the core's fragments
        and meta state (``Syncer.restore``), and the fleet's processed tokens. ``take``: the
        records' tensors are the core's to keep (a store read them for it)."""
        self.core.restore(records, meta, take)
        if meta is not None:
            self.fleet.load_state(meta.get("fleet"))
            run = meta.get("run")
            if isinstance(run, str) and 0 < len(run) <= RUN_ID_LEN and run.isascii() and run.isalnum():
                self.run = run  # the run's identity outlives its syncer processes (a bad one: a new one)

    def global_state(self, held: Mapping[str, int] | None = None, versions_only: bool = False) -> GlobalState:
        """This shard's fragments of the global model, for an observer: every version, and the
        values of each fragment whose version differs from ``held`` (fragment index as a string
        -> the version the observer holds; none: all of them); no values at all with
        ``versions_only``. Entries of ``held`` for fragments this shard does not own are ignored."""
        held = held or {}
        versions = {str(p): v for p, v in enumerate(self.core.versions()) if p in self.core.owned}
        tensors: dict[str, torch.Tensor] = {}
        for p in () if versions_only else self.core.owned:
            if held.get(str(p)) == versions[str(p)]:
                continue  # the observer holds this version already
            for i, v in enumerate(self.core.values(p)):
                tensors[f"{p}.{i}"] = v
        return GlobalState(
            versions, self.core.merged_tokens, tensors, run_ended=self.end_stage == "done",
            tokens_per_step=self.fleet.tokens_per_step(),
        )  # fmt: skip

    # -- events ------------------------------------------------------------------------------

    def receive(self, peer: Peer, msg: Any, now: float, principal: Principal | None = None) -> SyncerOutput:
        """One decoded message from ``peer`` (``principal``: what its key says, when keyed)."""
        out = SyncerOutput()
        problem = self._not_allowed(msg, principal)
        if problem is not None:
            out.notes.append(Note("impostor", f"{type(msg).__name__} from {peer!r}: {problem}"))
            if isinstance(msg, (Register, SettingsRequest)):
                out.send.append((peer, JoinReply(False, problem, self.epoch, 0, self.core.owned)))
            return out
        if isinstance(msg, Register):
            self._on_register(peer, msg, now, out)
        elif isinstance(msg, SettingsRequest):
            self._on_settings_request(peer, msg, out)
        elif isinstance(msg, (FetchGlobal, StatusRequest)):
            # Per key (per connection without keys): each answer copies the model or the fleet view.
            if not self._fetches.allow(principal if self.keyed else peer, now):
                out.notes.append(
                    Note(
                        "rate_limited",
                        f"{type(msg).__name__} from {peer!r} ({_who(principal)}): more than "
                        f"runtime.max_fetches_per_s = {self.rt.max_fetches_per_s:g}",
                    )
                )
                return out
            if isinstance(msg, FetchGlobal):
                state = self.global_state(msg.held, msg.versions_only)
                unknown = [k for k in msg.held if k not in state.versions]
                if unknown:  # a confused or hostile observer: those entries cost nothing and change nothing
                    out.notes.append(
                        Note(
                            "malformed",
                            f"FetchGlobal from {peer!r} ({_who(principal)}): its held versions name {len(unknown)} "
                            f"fragments this shard does not own (the first: {unknown[0][:32]!r}); ignored",
                        )
                    )
                out.send.append((peer, state))
            else:
                out.status_requests.append(peer)
        elif isinstance(msg, CORE_MESSAGES + RELAYED):
            self._on_learner_message(peer, msg, now, out)
        else:
            out.notes.append(Note("malformed", f"unexpected {type(msg).__name__} from {peer!r}"))
        self._advance_end(now, out)
        return out

    def _on_learner_message(self, peer: Peer, msg: Any, now: float, out: SyncerOutput) -> None:
        """A message that speaks for a learner (the core's, or a relayed optimizer state)."""
        claimed = msg.source if isinstance(msg, PeerState) else msg.learner
        if self.identities.get(claimed) != peer:
            # Not bound here: this shard restarted, the learner's connection changed, or a newer
            # registration took the id elsewhere. It is told, and registers again (on a fresh
            # connection); nothing it sent is taken from this peer.
            out.notes.append(Note("unknown_sender", f"message from {peer!r} claiming learner {claimed}"))
            out.send.append((peer, SyncerHeartbeat(self.epoch, self.shard, bound=False)))
            return
        done = self.end_stage == "done"
        if not done and not isinstance(msg, (Heartbeat, Leave)):
            self._heard(claimed, now, out)
        if done and not isinstance(msg, Leave):
            # Nothing reaches the core any more: its values are final, and the final evaluation
            # reads them while the driver goes on answering. A heartbeat says the learner did
            # not hear the end (a lost message, a partition that healed): it is told again
            # (once per heartbeat, not once per fragment it had in flight).
            if isinstance(msg, Heartbeat):
                out.send.append((peer, RunEnd("done", self.end_reason)))
        elif isinstance(msg, RELAYED):
            self._relay(msg, now, out)
        else:
            if isinstance(msg, Heartbeat) and self.core.registered(msg.learner) == msg.incarnation:
                self._progress(msg, now, out)
            out.core(self.core.handle(msg, now), self.identities)

    def tick(self, now: float) -> SyncerOutput:
        """Time passed: rounds open and close, heartbeats go out, the run's end moves on."""
        out = SyncerOutput().core(self.core.poll(now), self.identities)
        if self._hb_at is None or now >= self._hb_at + self.rt.heartbeat_interval_s:  # the sum next_deadline wakes at
            self._hb_at = now
            hb = SyncerHeartbeat(self.epoch, self.shard)
            out.send += [(peer, hb) for peer in self.identities.values()]
        self._say_live_changes(now, out)
        self._advance_end(now, out)
        return out

    def _say_live_changes(self, now: float, out: SyncerOutput) -> None:
        """A line when a learner leaves the live set (lost or left) or comes into it (joined or back)."""
        live = set(self.core.live(now))
        if live == self._live_seen:
            return
        for m in sorted(self._live_seen - live):
            info = self.core.learners.get(m)
            if info is not None and info.left:
                out.info.append(f"learner {m} left")
            else:
                out.info.append(
                    f"learner {m} lost: nothing heard for {self.core.cfg.liveness_timeout_s:g} s "
                    "(algo.liveness_timeout_s); the rounds go on without it"
                )
        for m in sorted(live - self._live_seen):
            info = self.core.learners.get(m)
            incarnation = f" (incarnation {info.incarnation})" if info is not None else ""
            out.info.append(f"learner {m} {'is back' if m in self._ever_live else 'joined'}{incarnation}")
        self._ever_live |= live
        self._live_seen = live

    def next_deadline(self, now: float) -> float:
        """The next time ``tick`` has something to do without a new message."""
        times = [self._hb_at + self.rt.heartbeat_interval_s if self._hb_at is not None else now, self._end_next]
        core = self.core.next_deadline(now)
        if core is not None:
            times.append(core)
        if self.end_stage is None and math.isfinite(self.budget.time_s):
            times.append(self._started + self.budget.time_s - self._age_at_start)
        return max(min(times), now)

    def shutdown(self, now: float) -> SyncerOutput:
        """The driver stops (a signal, a requeue): close the open rounds with what they have."""
        return SyncerOutput().core(self.core.flush(now), self.identities)

    # -- rules -------------------------------------------------------------------------------

    def _not_allowed(self, msg: Any, principal: Principal | None) -> str | None:
        """With keys, a learner id is bound to its key: a message for learner m must come from
        learner m's key, and an observer key may only fetch the global model and the status."""
        if not self.keyed:
            return None
        if principal is None:
            return "no allowed key"
        if isinstance(msg, (FetchGlobal, StatusRequest)):
            return None
        claimed = msg.source if isinstance(msg, PeerState) else getattr(msg, "learner", None)
        if principal.role != "learner" or principal.learner != claimed:
            who = f"learner {principal.learner}" if principal.role == "learner" else "an observer"
            return f"the key is {who}'s, not learner {claimed}'s"
        return None

    def _outside_cap(self, learner: int) -> str | None:
        """Why ``learner`` is not an id of this run (``run.num_learners`` caps ids and data shards)."""
        n = self.num_learners
        if n is None or 0 <= learner < n:
            return None
        return (
            f"learner id {learner} is outside this run's ids 0..{n - 1} (run.num_learners = {n}): use one of them, "
            "or grow the fleet: restart the syncer with a larger run.num_learners (and keys for the new ids: "
            "ddiloco keys DIR --learners M)"
        )

    def _on_settings_request(self, peer: Peer, msg: SettingsRequest, out: SyncerOutput) -> None:
        """A learner given no config asks for the run's settings before it registers."""
        if self.end_stage == "done":
            out.send.append((peer, RunEnd("done", self.end_reason)))
            return
        problem = self._outside_cap(msg.learner)
        if problem is not None:
            out.send.append((peer, JoinReply(False, problem, self.epoch, 0, self.core.owned)))
            return
        out.send.append((peer, RunSettings(dict(self.registration.settings))))

    def _on_register(self, peer: Peer, msg: Register, now: float, out: SyncerOutput) -> None:
        if self.end_stage == "done":  # too late to take part: the learner hears the run is over
            out.send.append((peer, RunEnd("done", self.end_reason)))
            return
        problem = self._outside_cap(msg.learner)
        if problem is None and msg.settings and self.registration.settings:
            difference = first_difference(self.registration.settings, msg.settings)
            problem = None if difference is None else settings_refusal(difference)
        if problem is not None:
            out.send.append((peer, JoinReply(False, problem, self.epoch, 0, self.core.owned)))
            return
        mismatch = first_mismatch(self.registration.params, msg.params)
        if mismatch is None and msg.layout != self.registration.layout:
            mismatch = (
                f"layout {msg.layout} != {self.registration.layout}: use the same algo.num_fragments, "
                "algo.fragment_strategy and algo.sync_every on learners and syncer"
            )
        if mismatch is not None:
            reason = f"model does not match the syncer's fragment layout: {mismatch}"
            out.send.append((peer, JoinReply(False, reason, self.epoch, 0, self.core.owned)))
            return
        before = self.core.registered(msg.learner)
        if before == msg.incarnation and self.identities.get(msg.learner) == peer:
            # The same process again on the same connection: a retry sent while the first answer
            # was on its way (a learner retries after 0.1 s; a loaded syncer, or one stalled on its
            # disk, answers later). What that answer sent is still in flight on this connection:
            # sending the join's fragments again would multiply the largest transfer of all. (A
            # learner that lost its connection registers on a new one, and gets them again.)
            self._accept(peer, msg.learner, out)
            return
        bases = msg.base_versions
        if bases and msg.run and self.run and msg.run != self.run:
            # Saved in another run (a folder reused): its versions are not this run's.
            out.notes.append(Note("foreign_state", f"learner {msg.learner} claims versions of run {msg.run!r}, "
                                  f"this is run {self.run!r}: it is sent every fragment"))  # fmt: skip
            bases = []
        core_out = self.core.handle(Join(msg.learner, msg.incarnation, bases), now)
        held = self.core.registered(msg.learner)
        if core_out.refused:  # only a Join is refused, and only the joiner: the id stays with its holder
            r = core_out.refused[0]
            out.send.append((peer, JoinReply(False, r.reason, self.epoch, 0, self.core.owned, r.retry_after_s)))
        elif held != msg.incarnation:
            # An older process than the id's holder (it was replaced while it was away): it must
            # not take the id's route back. Final: it stops.
            reason = self._superseded(msg.learner, held)
            out.notes.append(Note("superseded", f"Register from {peer!r} (incarnation {msg.incarnation}): {reason}"))
            out.send.append((peer, JoinReply(False, reason, self.epoch, 0, self.core.owned, superseded=True)))
        else:
            old = self.identities.get(msg.learner)
            self.pids[msg.learner] = msg.pid
            if old is not None and old != peer and before != msg.incarnation:
                # The replaced process may still be running (a stopped one resumed): it is told.
                reason = self._superseded(msg.learner, msg.incarnation)
                out.send.append((old, JoinReply(False, reason, self.epoch, 0, self.core.owned, superseded=True)))
            self.identities[msg.learner] = peer
            self.fleet.restarted(msg.learner, msg.incarnation, now)
            self._accept(peer, msg.learner, out)  # before the fragments it announces
        out.core(core_out, self.identities)

    def _accept(self, peer: Peer, learner: int, out: SyncerOutput) -> None:
        """Tell ``peer`` that ``learner`` is accepted (where its data resumes, the run's identity)
        and, while the run is ending, that it stops training and hands in what it has."""
        reply = JoinReply(True, "", self.epoch, self.core.data_position(learner), self.core.owned, run=self.run)
        out.send.append((peer, reply))
        if self.end_stage is not None:
            out.send.append((peer, RunEnd("stop", self.end_reason)))

    def _progress(self, hb: Heartbeat, now: float, out: SyncerOutput) -> None:
        """A registered learner's progress, its tokens believed within its rate cap."""
        cap = self.fleet.rate_cap(hb.learner, lambda: self.core.live(now), now)
        refused = self.fleet.heartbeat(hb, now, cap)
        if refused > 0:
            out.notes.append(
                Note(
                    "implausible",
                    f"learner {hb.learner} claims {refused:,.0f} tokens more than {cap:,.0f} a second "
                    f"(runtime.token_rate_spread x the other learners' median rate) allows: not counted",
                )
            )

    def _heard(self, learner: int, now: float, out: SyncerOutput) -> None:
        """A message from learner m's bound connection says m is alive, whatever it is (an ack, an
        answer the core refuses, an optimizer state being relayed): its heartbeats may be queued
        behind a large transfer on a thin link, and a live learner must not look dead. The core
        counts only heartbeats and accepted answers, so it is told with a heartbeat that carries
        no progress (step time 0 is "unknown": it moves no step clock; step 0 no maximum)."""
        incarnation = self.core.registered(learner)
        if incarnation is not None:
            out.core(self.core.handle(Heartbeat(learner, incarnation, 0, 0.0), now), self.identities)

    def _superseded(self, learner: int, holder: int | None) -> str:
        """The line a replaced process hears (it stops): who replaced it."""
        pid = self.pids.get(learner)
        who = f"pid {pid}" if pid else f"incarnation {holder}"
        return f"learner {learner} was superseded by a newer process with the same id ({who}): this process must stop"

    def _relay(self, msg: PeerStateRequest | PeerState, now: float, out: SyncerOutput) -> None:
        """Optimizer state for a rejoining learner goes from one live peer through the syncer,
        only as asked: one outstanding request per requester, at most one per
        ``peer_state_interval_s``, to a peer not serving another; only that peer's answer is
        relayed, once (in pieces, ``learner_session.peer_state_chunks``: each piece relayed moves
        the request's expiry on, so a thin link's hand-off is not cut off midway). Anything else
        is refused with a note (a flood of requests costs no peer a copy of its state, and no
        one can push a state nobody asked for)."""
        for m in [m for m, h in self.handoffs.items() if now >= h.until]:
            del self.handoffs[m]  # the chosen peer never answered: forget it
        if isinstance(msg, PeerStateRequest):
            m = msg.learner
            problem = None
            if self.core.registered(m) != msg.incarnation:
                problem = f"incarnation {msg.incarnation} is not the registered one"
            elif m in self.handoffs:
                problem = f"its request to learner {self.handoffs[m].source} is still outstanding"
            elif now < self._asked_at.get(m, -math.inf) + self.rt.peer_state_interval_s:
                problem = f"one request per runtime.peer_state_interval_s = {self.rt.peer_state_interval_s:g} s"
            if problem is not None:
                out.notes.append(Note("refused_relay", f"PeerStateRequest of learner {m} refused: {problem}"))
                return
            self._asked_at[m] = now
            serving = {h.source for h in self.handoffs.values()}
            peers = [p for p in self.core.live(now) if p != m and p in self.identities and p not in serving]
            if peers:
                self.handoffs[m] = Handoff(m, msg.incarnation, peers[0], now + self.rt.peer_state_timeout_s)
                out.send.append((self.identities[peers[0]], msg))
            else:
                out.send.append((self.identities[m], PeerState(m, -1, [], {})))
        else:
            h = self.handoffs.get(msg.learner)
            target = self.identities.get(msg.learner)
            if h is None or h.source != msg.source or target is None:
                why = "nobody asked" if h is None else f"learner {h.source} was asked"
                text = f"PeerState from learner {msg.source} for learner {msg.learner} refused: {why}"
                out.notes.append(Note("refused_relay", text))
                return
            if is_piece(msg):  # more pieces follow: the wait for them starts again (it follows progress)
                h.until = now + self.rt.peer_state_timeout_s
            else:
                del self.handoffs[msg.learner]
            out.send.append((target, msg))

    def _broadcast(self, msg: Any, out: SyncerOutput) -> None:
        out.send += [(peer, msg) for peer in self.identities.values()]

    def processed_tokens(self) -> float:
        """Tokens the fleet processed: as its heartbeats report them while the run goes on, and
        from its end the count that ended it (learners that have not heard the end yet train
        on for a moment: those tokens are not the run's, and one fact gets one number)."""
        return self._processed_at_end if self._processed_at_end is not None else self.fleet.processed_tokens()

    def ended_at(self, processed_tokens: float) -> None:
        """A restart on a finished run: the count that ended it (``metrics/run.jsonl``)."""
        if self.end_stage is not None:
            self._processed_at_end = processed_tokens

    def reopen(self, now: float) -> str | None:
        """A restart on a finished run (call after ``restore`` and ``ended_at``): audit the
        fleet's counts (``FleetBook.audit``); when the end came from a count the syncer cannot
        vouch for and the audited counts leave the budget unspent, the run goes on. Returns the
        one line that says why it had stopped and why it goes on (None: the end stands)."""
        if self.end_stage != "done":
            return None
        age = self.run_age(now)
        lowered = self.fleet.audit(age)
        processed = self.fleet.processed_tokens()
        if not lowered or self.budget.spent(processed, self.core.merged_tokens, age) is not None:
            return None
        said = "; ".join(f"learner {m} claimed {before:,.0f}, counted as {after:,.0f}" for m, before, after in lowered)
        line = (
            f"the run had ended ({self.end_reason}) on counts the syncer cannot vouch for ({said}: at most "
            "runtime.token_rate_spread x the other learners' median count, or runtime.lone_tokens_per_s x the "
            f"run's age); the fleet has processed {processed:,.0f} tokens: the run goes on"
        )
        self.end_stage, self.end_reason, self._end_next, self._processed_at_end = None, "", math.inf, None
        return line

    def _advance_end(self, now: float, out: SyncerOutput) -> None:
        """Move the run's end along: stop -> final sync -> done -> (linger) -> leave."""
        if self.end_stage is None:
            processed = self.fleet.processed_tokens()
            reason = self.budget.spent(processed, self.core.merged_tokens, self.run_age(now))
            if reason is None:
                return
            self.end_stage, self.end_reason, self._processed_at_end = "stop", reason, processed
            self._broadcast(RunEnd("stop", reason), out)
            out.core(self.core.flush(now, final=True), self.identities)
            # The learners apply the versions this flush made before the final sync asks them
            # (an answer anchored at an older base would count that progress twice).
            self._end_next = now + max(0.5, 2 * self.rt.heartbeat_interval_s)
        elif self.end_stage == "stop" and now >= self._end_next:
            self.end_stage = "final"
            out.core(self.core.final_sync(now), self.identities)
            # every live learner answers each final round at once; a silent one stops being
            # waited for at its liveness timeout, counted from the final sync's last progress
            self._final_left = self.core.final_left
            self._end_next = now + self.core.cfg.liveness_timeout_s + 2 * self.rt.heartbeat_interval_s
        elif self.end_stage == "final" and self.core.final_left < self._final_left and self.core.final_left:
            self._final_left = self.core.final_left  # a final round closed: the next ones get their time too
            self._end_next = now + self.core.cfg.liveness_timeout_s + 2 * self.rt.heartbeat_interval_s
        elif self.end_stage == "final" and (not self.core.final_left or now >= self._end_next):
            if self.core.open_rounds:
                out.core(self.core.flush(now, final=True), self.identities)
            self.end_stage = "done"
            self._broadcast(RunEnd("done", self.end_reason), out)
            out.final_model = True
            out.events.append(("end", self.end_reason))
            self._end_next = now + self.rt.end_linger_s
        elif self.end_stage == "done" and now >= self._end_next:
            out.stop = True
            self._end_next = math.inf  # said once: nothing is left to time


def _who(principal: Principal | None) -> str:
    if principal is None:
        return "no key"
    return f"learner {principal.learner}'s key" if principal.role == "learner" else "an observer's key"
