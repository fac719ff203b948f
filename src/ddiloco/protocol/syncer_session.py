"""A syncer shard's side of the protocol as one pure state machine: ``SyncerSession``.

It owns the algorithm's ``Syncer`` core and every protocol rule around it:

- registration: a learner's parameters and layout are checked against the shard's, its id is
  bound to the peer that registered it (and, with keys, to its key), and the core's ``Join``
  follows; a refusal is answered with its reason;
- who may say what: messages for learner m are taken only from the peer bound to m (with keys,
  only from m's key; an observer key may only read);
- the optimizer hand-off: a rejoining learner's request is relayed to one live peer, whose
  state is relayed back;
- the learners' reported progress (``fleet.FleetBook``) and the run's budget: tokens processed
  by the fleet, tokens merged, the run's age;
- the run's end, in stages: "stop" (the learners stop training; open rounds close), "final"
  (the final sync merges every live learner's remaining progress), "done" (the final model is
  written; learners that register later are told), then a linger before the driver leaves.

Every call is handed the time and returns a ``SyncerOutput``: what to make durable (first),
what to keep on the tape, what to send to whom, what to count and log. Peers are opaque
hashable handles chosen by the driver (a transport identity, or a learner id in the simulator).
Nothing here reads a clock, sleeps, logs, or touches a socket or a file.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ddiloco.core.messages import Ack, Contribution, Heartbeat, Join, Leave
from ddiloco.core.syncer import FragmentRecord, Output, Syncer, SyncerView
from ddiloco.core.tape import TapeRecord
from ddiloco.protocol.config import RuntimeConfig
from ddiloco.protocol.fleet import FleetBook
from ddiloco.protocol.learner_session import Registration
from ddiloco.protocol.messages import (
    FetchGlobal,
    GlobalState,
    JoinReply,
    PeerState,
    PeerStateRequest,
    Register,
    RunEnd,
    StatusRequest,
    SyncerHeartbeat,
    first_mismatch,
)

Peer = Hashable
"""Whom a message came from and goes to: the driver's handle (transport identity, learner id)."""
EndStage = Literal["stop", "final", "done"]
CORE_MESSAGES = (Heartbeat, Contribution, Ack, Leave)
RELAYED = (PeerStateRequest, PeerState)
NOTE_KINDS = ("malformed", "unknown_sender", "impostor")
"""What a ``Note`` counts (the driver counts decoding failures as "malformed" too)."""


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
    ) -> None:
        """``core``: the shard's core, restored from its store if there was one (see
        ``restore``); ``registration``: its model's parameters and layout digest, which every
        learner must match; ``epoch``: this start's incarnation (learners register again when
        it changes); ``age_s``: how old the run already was at ``now``; ``ended``: the reason,
        when the run had already ended before this start; ``keyed``: messages come with a
        ``Principal`` (CURVE keys), which must match what they claim."""
        self.core, self.rt, self.budget = core, rt, budget
        self.registration = registration
        self.shard, self.epoch, self.keyed = shard, epoch, keyed
        self.fleet = FleetBook()
        self.identities: dict[int, Peer] = {}
        """Learner id -> the peer that registered it (messages for the id come only from there)."""
        self._started, self._age_at_start = now, age_s
        self._hb_at: float | None = None
        self.end_stage: EndStage | None = None
        self.end_reason = ""
        self._end_next = math.inf
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
        return {**self.core.meta_state(), "fleet": self.fleet.state()}

    def restore(self, records: dict[int, FragmentRecord], meta: dict[str, Any] | None) -> None:
        """Take back what a store made durable (call before any message): the core's fragments
        and meta state (``Syncer.restore``), and the fleet's processed tokens."""
        self.core.restore(records, meta)
        if meta is not None:
            self.fleet.load_state(meta.get("fleet"))

    def global_state(self) -> GlobalState:
        """This shard's fragments of the global model, for an observer."""
        tensors: dict[str, torch.Tensor] = {}
        for p in self.core.owned:
            for i, v in enumerate(self.core.values(p)):
                tensors[f"{p}.{i}"] = v
        versions = {str(p): v for p, v in enumerate(self.core.versions()) if p in self.core.owned}
        return GlobalState(versions, self.core.merged_tokens, tensors, run_ended=self.end_stage == "done")

    # -- events ------------------------------------------------------------------------------

    def receive(self, peer: Peer, msg: Any, now: float, principal: Principal | None = None) -> SyncerOutput:
        """One decoded message from ``peer`` (``principal``: what its key says, when keyed)."""
        out = SyncerOutput()
        problem = self._not_allowed(msg, principal)
        if problem is not None:
            out.notes.append(Note("impostor", f"{type(msg).__name__} from {peer!r}: {problem}"))
            if isinstance(msg, Register):
                out.send.append((peer, JoinReply(False, problem, self.epoch, 0, self.core.owned)))
            return out
        if isinstance(msg, Register):
            self._on_register(peer, msg, now, out)
        elif isinstance(msg, FetchGlobal):
            out.send.append((peer, self.global_state()))
        elif isinstance(msg, StatusRequest):
            out.status_requests.append(peer)
        elif isinstance(msg, CORE_MESSAGES + RELAYED):
            claimed = msg.source if isinstance(msg, PeerState) else msg.learner
            if self.identities.get(claimed) != peer:
                # Unknown here (e.g. this shard restarted): a heartbeat with our epoch makes it register.
                out.notes.append(Note("unknown_sender", f"message from {peer!r} claiming learner {claimed}"))
                out.send.append((peer, SyncerHeartbeat(self.epoch, self.shard)))
                return out
            if isinstance(msg, RELAYED):
                self._relay(msg, now, out)
            else:
                if isinstance(msg, Heartbeat) and self.core.registered(msg.learner) == msg.incarnation:
                    self.fleet.heartbeat(msg, now)
                out.core(self.core.handle(msg, now), self.identities)
        else:
            out.notes.append(Note("malformed", f"unexpected {type(msg).__name__} from {peer!r}"))
        self._advance_end(now, out)
        return out

    def tick(self, now: float) -> SyncerOutput:
        """Time passed: rounds open and close, heartbeats go out, the run's end moves on."""
        out = SyncerOutput().core(self.core.poll(now), self.identities)
        if self._hb_at is None or now >= self._hb_at + self.rt.heartbeat_interval_s:  # the sum next_deadline wakes at
            self._hb_at = now
            hb = SyncerHeartbeat(self.epoch, self.shard)
            out.send += [(peer, hb) for peer in self.identities.values()]
        self._advance_end(now, out)
        return out

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

    def _on_register(self, peer: Peer, msg: Register, now: float, out: SyncerOutput) -> None:
        if self.end_stage == "done":  # too late to take part: the learner hears the run is over
            out.send.append((peer, RunEnd("done", self.end_reason)))
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
        core_out = self.core.handle(Join(msg.learner, msg.incarnation, msg.base_versions), now)
        if core_out.refused:  # only a Join is refused, and only the joiner: the id stays with its holder
            r = core_out.refused[0]
            out.send.append((peer, JoinReply(False, r.reason, self.epoch, 0, self.core.owned, r.retry_after_s)))
        else:
            self.identities[msg.learner] = peer
            self.fleet.restarted(msg.learner, msg.incarnation)
            reply = JoinReply(True, "", self.epoch, self.core.data_position(msg.learner), self.core.owned)
            out.send.append((peer, reply))  # before the fragments it announces
            if self.end_stage is not None:  # ending: it stops training and hands in what it has
                out.send.append((peer, RunEnd("stop", self.end_reason)))
        out.core(core_out, self.identities)

    def _relay(self, msg: PeerStateRequest | PeerState, now: float, out: SyncerOutput) -> None:
        """Optimizer state for a rejoining learner goes from one live peer through the syncer."""
        if isinstance(msg, PeerStateRequest):
            peers = [m for m in self.core.live(now) if m != msg.learner and m in self.identities]
            if peers:
                out.send.append((self.identities[peers[0]], msg))
            else:
                out.send.append((self.identities[msg.learner], PeerState(msg.learner, -1, [], {})))
        else:
            target = self.identities.get(msg.learner)
            if target is not None:
                out.send.append((target, msg))

    def _broadcast(self, msg: Any, out: SyncerOutput) -> None:
        out.send += [(peer, msg) for peer in self.identities.values()]

    def _advance_end(self, now: float, out: SyncerOutput) -> None:
        """Move the run's end along: stop -> final sync -> done -> (linger) -> leave."""
        if self.end_stage is None:
            reason = self.budget.spent(self.fleet.processed_tokens(), self.core.merged_tokens, self.run_age(now))
            if reason is None:
                return
            self.end_stage, self.end_reason = "stop", reason
            self._broadcast(RunEnd("stop", reason), out)
            out.core(self.core.flush(now, final=True), self.identities)
            # The learners apply the versions this flush made before the final sync asks them
            # (an answer anchored at an older base would count that progress twice).
            self._end_next = now + max(0.5, 2 * self.rt.heartbeat_interval_s)
        elif self.end_stage == "stop" and now >= self._end_next:
            self.end_stage = "final"
            out.core(self.core.final_sync(now), self.identities)
            # every live learner answers at once; a silent one stops being waited for at its liveness timeout
            self._end_next = now + self.core.cfg.liveness_timeout_s + 2 * self.rt.heartbeat_interval_s
        elif self.end_stage == "final" and (not self.core.open_rounds or now >= self._end_next):
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
