"""A learner's side of the protocol as one pure state machine: ``LearnerSession``.

It owns the algorithm's ``LearnerCore`` and every protocol rule around it:

- the link to each syncer shard: registration (again, with backoff, when a shard goes silent or
  restarts), the shard's epoch, its liveness (any message from it counts, not only heartbeats),
  heartbeats; all timing is deadlines on the time it is handed (``tick`` and ``next_deadline``);
- the join: it waits for the global state as long as it keeps coming, and gives up after
  ``join_timeout_s`` without progress (a thin link's join is slow, not dead);
- the step boundary, in one order: apply what arrived (in arrival order), load a requested
  optimizer state, answer the requests that could not be answered at once, push what a
  lock-step learner sends on its own schedule, and snapshot the fragments the syncer will ask
  for next, so that their requests are answered at once, from that snapshot;
- the optimizer hand-off (``protocol/handoff.py``): a learner that joins a run under way (some
  fragment past version 0) asks once, when its join is complete, for a live peer's optimizer
  state, and takes only the answer to its own request (once, from another learner, through
  shard 0, which relays only the peer it chose), in pieces put together as they come
  (``Reassembly``), giving up after ``2 x peer_state_timeout_s`` without one; it serves its own
  state when asked, at most one at a time and once per ``peer_state_interval_s``, refusing
  others at once with an empty state (cheap), a budget per boundary sized by its link
  (``serve_budget``, ``HandoffPace``: the driver says what it sent, ``sending``);
- a link that goes silent, or a shard that says this connection is not bound to the learner
  (``SyncerHeartbeat(bound=False)``), makes the driver reconnect that link on a fresh
  connection (``LearnerOutput.reconnect``) and register again; a shard silent for
  ``give_up_after_s`` makes it give up (``gave_up``: it must stop);
- a final refusal (``refused``; ``superseded`` when a newer process took the id over);
- the run's end as the syncer announces it.

A boundary is two calls, because only the driver can touch the model: ``step`` (or ``boundary``
when no step was taken) returns a ``BoundaryPlan`` (what to write into the model, which
fragments to read to host memory); the driver acts on it and hands the values it read to
``complete``, which returns the messages to send. ``receive`` and ``tick`` return messages too.
Nothing here reads a clock, sleeps, logs, or touches a socket or a file: the simulator pumps a
session in virtual time, ``ddiloco.Learner`` with a comm thread and a lock.

Theory of operation
-------------------
Each shard link is in one of three states: *registering* (``joined`` false: a ``Register`` goes
out at ``next_join``, the delay doubling from ``backoff_initial_s`` to ``backoff_max_s``),
*joined* (its ``JoinReply`` accepted: heartbeats go to it every ``heartbeat_interval_s``) and
*lost* (silent past ``syncer_liveness_s``, ``SyncerHeartbeat(bound=False)``, or a new epoch:
back to registering, ``lost_at`` set so the next acceptance is a rejoin). The process as a
whole is *joining* until ``ready(now)`` (accepted once, and every fragment received or
``join_timeout_s`` without progress), then *training*, then *stopped* (``refused``,
``gave_up`` or ``run_end``: no more steps, boundaries go on) and *done* (refused, given up or
``run_end == "done"``: ``tick`` returns nothing, ``next_deadline`` None).

Events, each handed ``now`` (a driver's seconds: virtual or monotonic), except ``complete``, ``sending``:

- ``tick(now)``: deadlines due (heartbeats, liveness, give-up, registration) -> ``LearnerOutput``;
- ``receive(shard, msg, now)`` (``heard`` first: any message is liveness) -> ``LearnerOutput``;
- ``step(tokens, duration_s, now, ..., waited_s)`` or ``boundary(now)`` -> ``BoundaryPlan``;
- ``complete(plan, values, peer_states, copy_s)`` -> ``LearnerOutput`` (acks, answers, pushes,
  pieces); ``serve_budget()`` before it: the bytes of optimizer state to copy for it;
- ``sending(done, rate)``: the driver's word on the hand-off pieces it sent (no output);
- ``leave()`` -> ``LearnerOutput`` (a ``Leave`` to every joined shard);
- ``next_deadline(now)``: when to call ``tick`` next (never before ``now``).

Invariants: updates reach the model only through a plan, in arrival order, each acked once
written; a request is answered at once from the snapshot, else at the next boundary (a
snapshot is dropped when its fragment gets a new version); a peer's optimizer state is taken
only from shard 0, as the answer to this process's own pending request, once; ``busy_s`` sums
the steps' busy time, waits for a fragment excepted (``step``); every figure a heartbeat
carries is within its wire bounds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ddiloco.core.codec import LearnerCodec
from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import FragmentLayout
from ddiloco.core.learner import LearnerCore, Receipt
from ddiloco.core.messages import (
    LOSS_UNKNOWN,
    MAX_BUSY_S,
    MAX_COUNT,
    MAX_LOSS,
    MAX_STEP_TIME_S,
    Ack,
    Contribution,
    FragmentRequest,
    FragmentUpdate,
    Heartbeat,
    Leave,
)
from ddiloco.core.overlap import OverlapKeeper
from ddiloco.protocol.config import RuntimeConfig
from ddiloco.protocol.handoff import HandoffPace, Reassembly, handoff_nbytes, is_piece, peer_state_chunks
from ddiloco.protocol.inbox import Inbox
from ddiloco.protocol.limits import RateLimits
from ddiloco.protocol.messages import (
    JoinReply,
    PeerState,
    PeerStateRequest,
    Register,
    RunEnd,
    RunSettings,
    SyncerHeartbeat,
)
from ddiloco.protocol.shard_link import ShardLink
from ddiloco.protocol.traffic import payload_nbytes

EndStage = Literal["stop", "done"]
JOIN_PROGRESS_S = 2.0
"""A join over a thin link says how far it has come this often (a fast one says nothing)."""
PEER_STATE_BURST = 2.0
"""Optimizer states a learner serves back to back before ``peer_state_interval_s`` paces it."""


@dataclass(frozen=True)
class Registration:
    """What a learner tells the syncer about itself when it registers."""

    params: list[list[Any]]
    """[name, shape] of every model parameter, in order (the syncer checks them against its own)."""
    layout: str
    """Digest of its fragment layout (the syncer checks it against its own)."""
    pid: int = 0
    """Its process id (for the syncer's logs)."""
    device: str = "cpu"
    """Where it computes."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """The run settings it was given explicitly (the syncer refuses it when one differs from
    the run's; see ``ddiloco.settings``). Empty: none claimed."""


@dataclass(frozen=True)
class Send:
    """One message for the syncer shard ``shard``."""

    shard: int
    """Index of the shard's link (shard order)."""
    msg: Any
    """The message (``core.messages`` or ``protocol.messages``)."""


@dataclass
class LearnerOutput:
    """What the driver must do after a call: send ``send`` in order, log ``notes``."""

    send: list[Send] = field(default_factory=list)
    """Messages to send, in order."""
    notes: list[str] = field(default_factory=list)
    """Things worth a line in the log (the session does no logging itself)."""
    reconnect: list[int] = field(default_factory=list)
    """Shard links to drop and open again on a fresh connection, before sending ``send`` (the
    shard lost track of this learner's connection; a simulator without connections ignores it)."""
    info: list[str] = field(default_factory=list)
    """What happened, worth an INFO line (a rejoin, the run's end); ``notes`` are warnings."""

    def extend(self, other: LearnerOutput) -> LearnerOutput:
        self.send += other.send
        self.notes += other.notes
        self.info += other.info
        self.reconnect += [i for i in other.reconnect if i not in self.reconnect]
        return self


@dataclass
class BoundaryPlan:
    """What the driver does at a step boundary, in this order: add ``move`` and write ``apply``
    into the model, load ``peer_state`` into the optimizer, build its optimizer state for each
    learner in ``serve``, read the fragments in ``read`` to host memory; then call ``complete``."""

    move: list[tuple[int, list[torch.Tensor]]] = field(default_factory=list)
    """Eager moves (``algo.on_merged = "eager"``): add each to its fragment's parameters
    (``write_fragment(..., add=True)``; empty values leave a piece alone)."""
    apply: list[tuple[FragmentUpdate, Receipt]] = field(default_factory=list)
    """Global fragments to write (``Receipt.alpha``: 0 overwrites, > 0 blends; mode "shift":
    the values are a change to add, ``add=True``), in arrival order."""
    peer_state: PeerState | None = None
    """A live peer's optimizer state, sent in answer to this learner's own request."""
    serve: list[int] = field(default_factory=list)
    """Learners that asked (through the syncer) for this learner's optimizer state."""
    answer: list[int] = field(default_factory=list)
    """Fragments the syncer asked for that could not be answered at once: answer them now."""
    push: list[int] = field(default_factory=list)
    """Fragments a lock-step learner sends now, on its own schedule."""
    prepare: list[int] = field(default_factory=list)
    """Fragments the syncer will ask for next: snapshot them, so their requests are answered at once."""
    notes: list[str] = field(default_factory=list)
    """Things worth a line in the log (an update ignored, and why)."""

    @property
    def read(self) -> list[int]:
        """Every fragment whose current values ``complete`` needs, each once."""
        return sorted({*self.answer, *self.push, *self.prepare})


class LearnerSession:
    """The protocol of one learner process (one incarnation) against its syncer shards."""

    def __init__(
        self,
        cfg: DiLoCoConfig,
        rt: RuntimeConfig,
        learner: int,
        incarnation: int,
        layout: FragmentLayout,
        registration: Registration,
        now: float,
        *,
        num_shards: int = 1,
        max_merged_tokens: float = math.inf,
        processed_budget: float = math.inf,
        wants_peer_state: bool = False,
    ) -> None:
        """``wants_peer_state``: the driver has an optimizer whose state a live peer can hand
        over; the session asks for it once, when the join is complete and the run is under way.
        ``processed_budget``: the run's run.processed_tokens, past which a silent syncer is taken
        for a run that ended unheard (``runtime.give_up_spent_s``)."""
        if num_shards < 1:
            raise ValueError("a learner needs at least one syncer shard")
        self.cfg, self.rt = cfg, rt
        self.learner, self.incarnation = learner, incarnation
        self.layout, self.registration = layout, registration
        self.processed_budget = processed_budget
        self.core = LearnerCore(cfg, learner, layout.num_fragments, incarnation, max_merged_tokens)
        # Base copies and error-feedback residuals of a compressed run (idle otherwise).
        self.codec = LearnerCodec(cfg, layout.fragments)
        # What a merge adds instead of overwriting the overlap's steps (``algo.on_merged``).
        self.overlap = OverlapKeeper(cfg, layout.fragments)
        self.links = [ShardLink(rt.backoff_initial_s) for _ in range(num_shards)]
        self.started_at = now
        # Moved on by every sign of progress while the join is under way (``_join_progress``);
        # one sum, so ``ready`` and the wake agree.
        self._join_deadline = now + rt.join_timeout_s
        self._join_got: set[int] = set()  # fragments of the join arrived (applied or not)
        self._join_bytes = 0
        self._join_said = now  # the last progress line (none for a join faster than JOIN_PROGRESS_S)
        self.wants_peer_state = wants_peer_state
        self.refused: str | None = None
        """Why a shard refused this learner for good (it must stop)."""
        self.superseded = False
        """The refusal says a newer process took this learner id over."""
        self.held: str | None = None
        """Why the last registration was refused for now (the id's holder is live), until one is accepted."""
        self.gave_up: str | None = None
        """Why this learner gave up on its syncer (a shard silent for ``give_up_after_s``)."""
        self.run_end: EndStage | None = None
        """How far the run's end has come, as the syncer announced it."""
        self.end_reason = ""
        self.data_position: int | None = None
        """Where the learner's data resumes, as its first accepted registration said."""
        self.joined_once = False
        self.received: set[int] = set()
        """Fragments received since this process started (the join is complete with all)."""
        self.restored_runs: list[str] | None = None
        """Each shard's run, when this process took back its predecessor's saved state
        (``protocol/local_state.py``): it claims the versions it holds in that run."""
        self.answered = 0
        """Requests answered at once from a snapshot."""
        # progress, for heartbeats and the fleet view
        self.position = 0
        self.tokens = 0
        self.busy_s = 0.0
        """Seconds in inner steps this incarnation: the busy time of every step (``step``), a
        wait for a fragment excepted (it is not busy: goodput counts it a loss). The one
        definition: heartbeats report it, and with them the summary's compute share."""
        self.loss: float | None = None
        self.bytes_sent = 0
        self.step_time_s = 0.0
        """Mean inner-step time between the last two heartbeats (0: none yet): the syncer's step
        clock smooths it once, with its own EMA."""
        self._hb_at: float | None = None
        self._hb_mark = (0, 0.0)  # (steps, busy_s) at the last heartbeat
        # between boundaries
        self._inbox = Inbox(self.codec)
        self._peer_state: PeerState | None = None
        self._awaiting_peer_state = False
        # The optimizer hand-off arrives in pieces (``peer_state_chunks``), put together as they come.
        self._ps: Reassembly | None = None
        self._ps_source: int | None = None
        self._ps_said = now
        self._ps_heard = now  # the request, then each piece: silence past 2 x peer_state_timeout_s gives up
        self._boundary_at = now  # the last boundary's time (``complete`` is handed none)
        # More state than any optimizer keeps for this model (AdamW: 2 moments per parameter;
        # with amsgrad 3) is a peer's mistake or attack: the pieces are dropped past this.
        self._ps_max_numel = 4 * sum(math.prod(pc.shape) for f in layout.fragments for pc in f) + (1 << 20)
        self.pace = HandoffPace(int(rt.peer_state_buffer_mb * (1 << 20)), rt.peer_state_copy_share)
        """What serving this learner's optimizer state may copy at a boundary (``serve_budget``)."""
        self._asked_peer_state = False
        self._peer_requests: list[int] = []
        # Serving costs a copy of the optimizer state: one per peer_state_interval_s, bursts of 2
        # (two learners that rejoin together are both served warm).
        self._serves: RateLimits[int] = RateLimits(1.0 / max(rt.peer_state_interval_s, 1e-9), PEER_STATE_BURST)
        self._requests: list[int] = []
        self._unanswered: list[int] = []
        self._due: list[int] = []
        self._prepared: dict[int, Contribution] = {}

    # -- state -----------------------------------------------------------------------------

    @property
    def joined(self) -> bool:
        """Every shard has accepted this learner (and none has gone silent or restarted since)."""
        return all(link.joined for link in self.links)

    def ready(self, now: float) -> bool:
        """Training may start: a shard accepted this learner (its reply says where its data
        resumes), and every fragment of the global model has been received or the join went
        ``join_timeout_s`` without progress (it trains on from what it has; answers built on what
        it lacks are rebased by the syncer). Fragments alone are not enough: they can arrive
        while the reply that accepted the learner was lost, and it registers again."""
        if not self.joined_once:
            return False
        return len(self.received) == self.layout.num_fragments or now >= self._join_deadline

    @property
    def join_deadline(self) -> float:
        """When the join gives up waiting: ``join_timeout_s`` after its last progress (its start,
        an accepted registration, a fragment arriving). A driver waiting for the join waits until
        ``ready`` or this; never accepted by then, the learner was not answered at all."""
        return self._join_deadline

    def join_begins(self, now: float) -> None:
        """The driver starts talking to the syncer now: the join's silence is counted from here,
        not from the session's creation (what the driver did in between, such as reading back a
        saved state of several GB, is not the syncer's silence)."""
        if not self.joined_once:
            self._join_deadline = now + self.rt.join_timeout_s

    def _join_progress(self, now: float) -> None:
        """The join moved on: its silence is counted from now. Once past, the deadline stays
        past (``ready`` said yes; a late fragment must not take it back)."""
        if now < self._join_deadline and len(self.received) < self.layout.num_fragments:
            self._join_deadline = max(self._join_deadline, now + self.rt.join_timeout_s)

    def _join_fragment(self, msg: FragmentUpdate, now: float, out: LearnerOutput) -> None:
        """A fragment of the global state arrived while joining: progress, and now and then a line."""
        if now >= self._join_deadline or len(self.received) == self.layout.num_fragments:
            return
        if msg.fragment in self._join_got:
            return  # a fragment it has again (a later merge) is no progress: one lost for good would never end the wait
        self._join_progress(now)
        self._join_got.add(msg.fragment)
        self._join_bytes += sum(v.numel() * v.element_size() for v in msg.values)
        total, said = self.layout.num_fragments, self._join_said > self.started_at
        if now - self._join_said >= JOIN_PROGRESS_S or (said and len(self._join_got) == total):  # and its end
            self._join_said = now
            out.info.append(
                f"learner {self.learner}: joining: {len(self._join_got)}/{total} fragments of the global state, "
                f"{self._join_bytes / 1e6:.1f} MB in {now - self.started_at:.0f} s"
            )

    def refuse(self, reason: str) -> None:
        """Stop for good for ``reason`` (the driver's: e.g. a syncer whose wire schema it cannot
        read), as a final refusal does; a refusal already said stands."""
        if self.refused is None:
            self.refused = reason

    @property
    def stopped(self) -> bool:
        """Training must stop: refused, given up, or the run has ended (the boundaries go on
        without steps until ``done``, to apply the last versions and answer the final sync)."""
        return self.refused is not None or self.gave_up is not None or self.run_end is not None

    @property
    def done(self) -> bool:
        """Nothing more will come: refused, given up, or the final model is written."""
        return self.refused is not None or self.gave_up is not None or self.run_end == "done"

    def shard_of(self, p: int) -> int:
        """The shard that owns fragment p (fragments are dealt round-robin to shards)."""
        return p % len(self.links)

    # -- the link side -----------------------------------------------------------------------

    def tick(self, now: float) -> LearnerOutput:
        """Heartbeats, liveness of each shard, (re-)registration with backoff."""
        out = LearnerOutput()
        if self.done:
            return out
        if self._awaiting_peer_state and now - self._ps_heard > 2 * self.rt.peer_state_timeout_s:
            # The syncer forgot the request after peer_state_timeout_s without a piece: nothing more comes.
            wait = now - self._ps_heard
            self._drop_peer_state(f"no optimizer state from a peer for {wait:.0f} s; training on with its own", out)
        if self._hb_at is None or now >= self._hb_at + self.rt.heartbeat_interval_s:  # the sum next_deadline wakes at
            self._hb_at = now
            hb = self._heartbeat()
            out.send += [Send(i, hb) for i, link in enumerate(self.links) if link.joined]
        for i, link in enumerate(self.links):
            silent = now - (link.last_heard if link.last_heard is not None else self.started_at)
            if self.joined_once and self._spent_and_silent(silent):
                self.gave_up = (
                    f"learner {self.learner}: the fleet has processed {self.core.fleet_tokens():,.0f} tokens as this "
                    f"learner counts them, the run's budget is {self.processed_budget:,.0f} (run.processed_tokens), "
                    f"and syncer shard {i} has said nothing for {self.rt.give_up_spent_s:g} s "
                    "(runtime.give_up_spent_s): the run ended while this learner was cut off; this learner stops"
                )
                return out
            if self.joined_once and 0 < self.rt.give_up_after_s < silent:
                # Gone for longer than any restart takes, or the run ended while we were cut off:
                # training on alone would be work nobody merges.
                self.gave_up = (
                    f"learner {self.learner}: no word from syncer shard {i} for {self.rt.give_up_after_s:g} s "
                    "(runtime.give_up_after_s): it is gone, or the run ended while this learner was cut off "
                    "(ddiloco status RUN_DIR says which); this learner stops"
                )
                return out
            if link.joined and silent > self.rt.syncer_liveness_s:
                # Nothing addressed to us: the shard is down, or lost our connection. A fresh
                # connection either way, then registration with backoff.
                link.joined, link.next_join, link.lost_at = False, now, now
                out.reconnect.append(i)
                if not link.warned:
                    link.warned = True
                    out.notes.append(
                        f"learner {self.learner}: syncer shard {i} unreachable for {silent:.1f} s; training on, "
                        "reconnecting and registering again with backoff"
                    )
            if not link.joined and now >= link.next_join:
                out.send.append(Send(i, self._register(i)))
                link.next_join = now + link.backoff
                link.backoff = min(link.backoff * 2, self.rt.backoff_max_s)
        return out

    def next_deadline(self, now: float) -> float | None:
        """The next time ``tick`` has something to do without a new message."""
        if self.done:
            return None
        times = [self._hb_at + self.rt.heartbeat_interval_s if self._hb_at is not None else now]
        if len(self.received) < self.layout.num_fragments and now < self._join_deadline:
            times.append(self._join_deadline)  # when ``ready`` gives up waiting (once past, no wake: it would spin)
        for link in self.links:
            heard = link.last_heard if link.last_heard is not None else self.started_at
            if link.joined:
                times.append(math.nextafter(heard + self.rt.syncer_liveness_s, math.inf))
            else:
                times.append(link.next_join)
            if self.joined_once and self.rt.give_up_after_s > 0:
                times.append(math.nextafter(heard + self.rt.give_up_after_s, math.inf))
            if self.joined_once and self.rt.give_up_spent_s > 0 and self._spent():
                times.append(math.nextafter(heard + self.rt.give_up_spent_s, math.inf))
        return max(min(times), now)

    def _spent(self) -> bool:
        """The run's token budget is spent as far as this learner knows (its fleet-token estimate:
        the syncer's merged count as last heard plus the fleet's progress since)."""
        return self.core.fleet_tokens() >= self.processed_budget

    def _spent_and_silent(self, silent: float) -> bool:
        return 0 < self.rt.give_up_spent_s < silent and self._spent()

    def heard(self, shard: int, now: float) -> None:
        """Shard ``shard``'s link carried something (even a message that could not be decoded):
        it is alive. Every message counts, not only heartbeats, so a heartbeat queued behind a
        large transfer (a join's fragments, an optimizer state) does not make a live link look
        dead. ZeroMQ hands over whole messages only: one message that takes longer than
        ``syncer_liveness_s`` to cross the link is the limit (docs/runtime.md, Thin links)."""
        if 0 <= shard < len(self.links):
            link = self.links[shard]
            link.last_heard = now
            if link.warned and link.joined:
                link.warned = False

    def receive(self, shard: int, msg: Any, now: float) -> LearnerOutput:
        """One message from shard ``shard``; anything the rules do not expect is noted and dropped."""
        out = LearnerOutput()
        if not 0 <= shard < len(self.links):
            out.notes.append(f"learner {self.learner}: a message from shard {shard}, which is not one of ours")
            return out
        link = self.links[shard]
        self.heard(shard, now)
        if isinstance(msg, SyncerHeartbeat):
            self._on_syncer_heartbeat(shard, link, msg, now, out)
        elif isinstance(msg, JoinReply):
            self._on_join_reply(shard, link, msg, now, out)
        elif isinstance(msg, RunEnd):
            if self.run_end is None:
                out.info.append(f"learner {self.learner}: the syncer ended the run: {msg.reason}")
            if self.run_end != "done":
                self.run_end, self.end_reason = msg.stage, msg.reason
        elif isinstance(msg, FragmentRequest):
            self._on_request(msg, shard, out)
        elif isinstance(msg, FragmentUpdate):
            if msg.learner != self.learner or self.shard_of(msg.fragment) != shard:
                out.notes.append(
                    f"learner {self.learner}: dropped fragment {msg.fragment} addressed to learner {msg.learner} "
                    f"from shard {shard}"
                )
            else:
                self._inbox.keep(msg)
                self._join_fragment(msg, now, out)
        elif isinstance(msg, PeerState):
            self._on_peer_state(msg, shard, now, out)
        elif isinstance(msg, PeerStateRequest):
            self._on_peer_request(msg, shard, now, out)
        elif isinstance(msg, RunSettings):
            pass  # a late answer to the settings question asked before registering (``protocol.settings``)
        else:
            out.notes.append(f"learner {self.learner}: unexpected {type(msg).__name__} from shard {shard}")
        return out

    def _on_syncer_heartbeat(
        self, shard: int, link: ShardLink, msg: SyncerHeartbeat, now: float, out: LearnerOutput
    ) -> None:
        if link.joined and not msg.bound:
            # The shard does not know this connection as ours (it lost it, or a newer
            # registration took our id): a fresh connection, and register again.
            link.joined, link.next_join, link.lost_at = False, now, now
            out.reconnect.append(shard)
            out.notes.append(
                f"learner {self.learner}: syncer shard {shard} does not know this connection; reconnecting and "
                "registering again"
            )
        elif link.joined and link.epoch is not None and msg.epoch != link.epoch:
            # the shard restarted: register again, keeping our progress
            link.joined, link.next_join, link.lost_at = False, now, now
        elif not link.joined:
            link.next_join = min(link.next_join, now)

    def _on_peer_state(self, msg: PeerState, shard: int, now: float, out: LearnerOutput) -> None:
        """Only the answer to this process's own pending request, once, relayed by shard 0 (which
        relays only the peer it chose), and never from itself. It may come in pieces, all from
        one peer (``peer_state_chunks``), put together as they come (``Reassembly``: a piece out
        of its rules drops the whole state); the last one, with the param_groups, completes it.
        Its values are validated by the driver when it loads them (``training.peer_state.load_state``)."""
        ours = msg.learner == self.learner and shard == 0 and msg.source != self.learner
        if not (self._awaiting_peer_state and ours and self._ps_source in (None, msg.source)):
            out.notes.append(
                f"learner {self.learner}: ignored an optimizer state (from learner {msg.source}, shard {shard}) "
                "it did not ask for"
            )
            return
        got = self._ps if self._ps is not None else Reassembly(self._ps_max_numel)
        self._ps, self._ps_source, self._ps_heard = got, msg.source, now
        problem = got.add(msg.tensors)
        tensors: dict[str, torch.Tensor] = {}
        if problem is None and not is_piece(msg):
            tensors, problem = got.finish()
        if problem is not None:
            why = f"dropped learner {msg.source}'s optimizer state: {problem}; training on with its own"
            self._drop_peer_state(why, out)
        elif not is_piece(msg):
            self._peer_state = PeerState(msg.learner, msg.source, msg.param_groups, tensors)
            self._awaiting_peer_state, self._ps, self._ps_source = False, None, None
        elif now - self._ps_said >= JOIN_PROGRESS_S:
            self._ps_said = now
            out.info.append(
                f"learner {self.learner}: taking learner {msg.source}'s optimizer state: {len(got)} "
                f"tensors so far ({got.numel * 4 / 1e6:.1f} MB as fp32)"
            )

    def _drop_peer_state(self, why: str, out: LearnerOutput) -> None:
        """The hand-off under way ends without a state (what came of it is let go)."""
        self._awaiting_peer_state, self._ps, self._ps_source = False, None, None
        out.notes.append(f"learner {self.learner}: {why}")

    def _on_peer_request(self, msg: PeerStateRequest, shard: int, now: float, out: LearnerOutput) -> None:
        """Serve at most one request at a time and one per ``peer_state_interval_s`` (bursts of
        ``PEER_STATE_BURST``): each costs
        a copy of the optimizer state (twice the model). Others get an empty state at once, so the
        syncer's relay is freed and the asker trains on cold."""
        if msg.learner == self.learner or shard != 0:
            out.notes.append(f"learner {self.learner}: ignored a request for its optimizer state from shard {shard}")
            return
        if msg.learner in self._peer_requests:
            return  # already queued for the next boundary
        if self._peer_requests or not self._serves.allow(0, now):
            out.notes.append(
                f"learner {self.learner}: refused learner {msg.learner}'s request for its optimizer state (one per "
                f"runtime.peer_state_interval_s = {self.rt.peer_state_interval_s:g} s)"
            )
            out.send.append(Send(0, PeerState(msg.learner, self.learner, [], {})))
            return
        self._peer_requests.append(msg.learner)

    def _on_join_reply(self, shard: int, link: ShardLink, msg: JoinReply, now: float, out: LearnerOutput) -> None:
        if not msg.accepted and msg.retry_after_s > 0:
            # e.g. our own predecessor (SIGKILLed a moment ago) still holds the id: try again
            out.notes.append(
                f"learner {self.learner}: not registered yet ({msg.reason}); retrying in {msg.retry_after_s:.1f} s"
            )
            link.next_join = now + msg.retry_after_s
            self.held = msg.reason
            return
        if not msg.accepted:
            self.refused, self.superseded = msg.reason, msg.superseded
            return
        if link.lost_at is not None and not link.joined:
            why = "it restarted" if link.epoch is not None and msg.epoch != link.epoch else "its link was lost"
            out.info.append(
                f"learner {self.learner}: rejoined syncer shard {shard} after {now - link.lost_at:.1f} s ({why}); "
                "training went on meanwhile"
            )
            link.lost_at = None
        saved = self.restored_runs[shard] if self.restored_runs is not None and link.epoch is None else ""
        if saved and msg.run and msg.run != saved:  # the rule the shard applied to the claim (SyncerSession)
            self._forget_restored(msg.owned, msg.run, out)
        link.epoch, link.joined, link.owned, link.run = msg.epoch, True, list(msg.owned), msg.run
        self._join_progress(now)  # accepted: its fragments follow
        link.backoff, self.held = self.rt.backoff_initial_s, None
        if self.data_position is None:
            self.data_position = msg.data_position
        self.joined_once = True

    def _forget_restored(self, owned: list[int], run: str, out: LearnerOutput) -> None:
        """The saved state was of another run: its fragments of this shard are sent in full
        (the shard took this learner as holding nothing); until they arrive it holds none."""
        for p in owned:
            if 0 <= p < self.layout.num_fragments:
                self.core.base_version[p] = self.core.steps[p] = self.core.tokens[p] = 0
                self.codec.base.pop(p, None)
                self.codec.residual.pop(p, None)
                self.received.discard(p)
        out.notes.append(f"learner {self.learner}: its saved state is of another run than {run!r}: joining afresh")

    def _on_request(self, msg: FragmentRequest, shard: int, out: LearnerOutput) -> None:
        """Answer at once from the last boundary's snapshot, or at the next boundary: training is
        never paused for a request."""
        p = msg.fragment
        if msg.learner != self.learner or not 0 <= p < self.layout.num_fragments or self.shard_of(p) != shard:
            out.notes.append(f"learner {self.learner}: dropped a request for fragment {p} from shard {shard}")
            return
        self._requests.append(p)
        ready = self._prepared.pop(p, None)
        if ready is not None:
            out.send.append(self._sent(ready))
            self.answered += 1
        elif p not in self._unanswered:
            self._unanswered.append(p)

    def leave(self) -> LearnerOutput:
        """A clean departure: every shard that accepted this learner stops counting it as live."""
        msg = Leave(self.learner, self.incarnation)
        return LearnerOutput([Send(i, msg) for i, link in enumerate(self.links) if link.joined])

    # -- the training side -------------------------------------------------------------------

    def step(
        self,
        tokens: int,
        duration_s: float,
        now: float,
        data_position: int | None = None,
        loss: float | None = None,
        routed: Mapping[str, torch.Tensor] | None = None,
        waited_s: float = 0.0,
    ) -> BoundaryPlan:
        """Count one finished inner step (``duration_s``: its time since the previous boundary,
        this boundary included; ``waited_s``: how much of it a lock-step learner waited for a
        fragment; ``routed``: its routed-token counts, see ``LearnerCore.on_step``) and plan the
        boundary after it. The step's busy time is ``duration_s - waited_s`` (``busy_s``)."""
        self.busy_s += max(duration_s - waited_s, 0.0)
        self.pace.stepped(duration_s)
        self.tokens += tokens
        self.position = self.position + 1 if data_position is None else data_position
        if loss is not None:
            self.loss = loss
        self._due += [p for p in self.core.on_step(tokens, routed) if p not in self._due]
        return self.boundary(now)

    def boundary(self, now: float) -> BoundaryPlan:
        """Plan a step boundary (also without a step: while joining, blocked, or finishing)."""
        self._boundary_at = now
        plan = BoundaryPlan(move=self.overlap.moves())
        pieces = self.layout.fragments
        for arrived in self._inbox:
            u = self.codec.expand(arrived) if 0 <= arrived.fragment < len(pieces) else arrived
            if isinstance(u, str):  # a delta off this learner's chain: the syncer sends the next one in full
                what = f"fragment {arrived.fragment} version {arrived.version}"
                plan.notes.append(f"learner {self.learner}: ignored {what}: {u}")
                continue
            receipt = self.core.on_update(u, pieces[u.fragment] if 0 <= u.fragment < len(pieces) else None)
            if receipt.mode == "ignore":
                if receipt.problem:
                    plan.notes.append(
                        f"learner {self.learner}: ignored fragment {u.fragment} version {u.version}: {receipt.problem}"
                    )
                continue
            self.received.add(u.fragment)
            written = u
            held = self.codec.base.get(u.fragment)
            if receipt.mode == "shift" and held is not None:
                written = dataclasses.replace(u, values=self.overlap.change(u.fragment, u.values, held[1]))
            else:
                receipt = Receipt("overwrite", own=receipt.own) if receipt.mode == "shift" else receipt
                self.overlap.drop(u.fragment)
            self.codec.received(u)
            self._prepared.pop(u.fragment, None)  # built on the old version: it would count that progress twice
            plan.apply.append((written, receipt))
        self._inbox.clear()
        plan.peer_state, self._peer_state = self._peer_state, None
        plan.serve, self._peer_requests = self._peer_requests, []
        for p in self._requests:
            self.core.on_request(p)  # the schedule says which fragments are asked for next
        self._requests.clear()
        plan.answer, self._unanswered = self._unanswered, []
        plan.push, self._due = self._due, []
        busy = {*plan.answer, *plan.push}
        plan.prepare = [p for p in self.core.expected if p not in busy]
        return plan

    def sending(self, done: int, rate: float) -> None:
        """The driver's word on the optimizer hand-off it sends: ``done`` bytes of the hand-off
        messages this session gave it are on the link or dropped (a running total, this process:
        ``handoff.handoff_nbytes``), at ``rate`` bytes per second lately (0: not known)."""
        self.pace.sending(done, rate)

    def serve_budget(self) -> int:
        """Bytes of optimizer state to copy at this boundary for the hand-offs under way
        (``HandoffPace.budget``: by the link, the step time and what is still unsent; 0: none now)."""
        return self.pace.budget()

    def complete(
        self,
        plan: BoundaryPlan,
        values: Mapping[int, list[torch.Tensor]],
        peer_states: Sequence[PeerState] = (),
        copy_s: float = 0.0,
    ) -> LearnerOutput:
        """Finish the boundary ``plan``: ``values`` holds the host copy of each fragment in
        ``plan.read`` (taken after ``plan.apply`` was written); ``peer_states`` this boundary's
        pieces of the optimizer states it serves (copied in ``copy_s`` seconds, as the driver
        measured: 0, not measured). Returns the acks, answers, pushes and states to send, each
        state in messages of ``peer_state_chunk_mb``; the snapshots are kept for the next requests."""
        out = LearnerOutput()
        for u, _ in plan.apply:
            out.send.append(Send(self.shard_of(u.fragment), Ack(self.learner, self.incarnation, u.fragment, u.version)))
        # A contribution measures progress, never the eager displacement (``core/overlap.py``).
        values = {p: self.overlap.undisplaced(p, v) for p, v in values.items()}
        for p in dict.fromkeys([*plan.answer, *plan.push]):  # a fragment both asked for and due goes once
            out.send.append(self._sent(self._contribution(p, values[p])))
        self._prepared = {p: self._contribution(p, values[p]) for p in plan.prepare}
        limit = int(self.rt.peer_state_chunk_mb * (1 << 20))
        self.pace.copied(sum(handoff_nbytes(ps) for ps in peer_states), copy_s)
        for piece in (piece for ps in peer_states for piece in peer_state_chunks(ps, limit)):
            self.pace.emitted += handoff_nbytes(piece)
            out.send.append(Send(0, piece))
        if self.wants_peer_state and not self._asked_peer_state and len(self.received) == self.layout.num_fragments:
            # In a fresh run nobody has a state worth taking; in a run under way a warm one saves
            # the first steps from AdamW's cold start.
            self._asked_peer_state = True
            if max(self.core.base_version, default=0) > 0:
                self._awaiting_peer_state, self._ps_heard = True, self._boundary_at
                out.send.append(Send(0, PeerStateRequest(self.learner, self.incarnation)))
        return out

    def _contribution(self, p: int, values: list[torch.Tensor]) -> Contribution:
        return self.core.contribution(p, values, self.position, pieces=self.layout.fragments[p])

    def _sent(self, c: Contribution) -> Send:
        # Encoded only now, when it leaves: a snapshot prepared and then dropped must not move
        # the error-feedback residual.
        held = self.codec.base.get(c.fragment)
        if held is not None and held[0] == c.base_version:
            self.overlap.sent(c.fragment, held[1], c.values)
        c, residual = self.codec.encode(c)
        self.codec.sent(c.fragment, residual)
        self.core.sent(c)
        self.bytes_sent += payload_nbytes(c)  # what goes on the wire: the encoded payload when there is one
        return Send(self.shard_of(c.fragment), c)

    # -- messages ----------------------------------------------------------------------------

    def _register(self, shard: int) -> Register:
        r = self.registration
        # A fresh process needs every fragment; after a shard restarts, or from its predecessor's
        # saved state, it keeps its progress (in the run it has it from).
        restored = self.restored_runs is not None
        bases = list(self.core.base_version) if self.joined_once or restored else []
        run = self.links[shard].run or (self.restored_runs[shard] if self.restored_runs is not None else "")
        return Register(self.learner, self.incarnation, r.params, r.layout, bases, r.pid, r.device, dict(r.settings),
                        run)  # fmt: skip

    def _heartbeat(self) -> Heartbeat:
        """Progress since the start of this incarnation, every figure within its wire bounds: the
        step time is the mean over the steps since the last heartbeat (a step faster than the
        syncer believes, ``min_step_time_s``, is reported at that bound, so a tiny model still
        drives the step clock; one longer than a day, a learner stopped in a debugger, as a day);
        a loss that is negative, not finite or huge is reported unknown."""
        steps, busy = self.core.step, self.busy_s
        if steps > self._hb_mark[0]:
            self.step_time_s = (busy - self._hb_mark[1]) / (steps - self._hb_mark[0])
        self._hb_mark = (steps, busy)
        reported = min(max(self.step_time_s, self.cfg.min_step_time_s), MAX_STEP_TIME_S) if self.step_time_s else 0.0
        loss = self.loss if self.loss is not None and 0.0 <= self.loss <= MAX_LOSS else LOSS_UNKNOWN  # NaN fails both
        return Heartbeat(
            self.learner,
            self.incarnation,
            min(steps, MAX_COUNT),
            reported,
            min(self.tokens, MAX_COUNT),
            min(busy, MAX_BUSY_S),
            loss,
            min(self.bytes_sent, MAX_COUNT),
        )
