"""The protocol's settings: the real runtime's timeouts and intervals (``[runtime]``), which the
sessions also follow in virtual time, and the run's budget.

They live here, beside the sessions that read them, so that ``protocol`` imports only ``core``;
``ddiloco.config`` loads them from the ``[runtime]`` section of a config file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddiloco.core.compress import frame_nbytes

EVAL_TRAFFIC_SHARE = 0.1
"""The share of the learners' steady traffic the evaluator's automatic cadence keeps to
(``RuntimeConfig.eval_every_tokens`` = 0)."""
FP32_BYTES = 4.0
"""Bytes per value an observer fetches (the exact global model)."""


@dataclass(frozen=True)
class RuntimeConfig:
    """The real distributed runtime's timeouts and intervals (see docs/runtime.md)."""

    heartbeat_interval_s: float = 0.5
    """How often learners and the syncer send heartbeats to each other."""
    syncer_liveness_s: float = 5.0
    """A learner that has not heard the syncer for this long says so once and retries."""
    backoff_initial_s: float = 0.1
    """First reconnect / re-join delay after the syncer went silent (doubles each try)."""
    backoff_max_s: float = 5.0
    """Upper bound of that delay."""
    join_timeout_s: float = 10.0
    """How long a starting learner waits for the global state without progress: the wait ends
    this long after the last sign of it (its start, the syncer accepting it, a fragment of the
    state arriving), so a join over a thin link takes as long as its fragments keep coming. Then
    it trains from what it has (the fleet keeps going; answers built on what it lacks are
    rebased). A learner never accepted within it stops with one line."""
    give_up_after_s: float = 600.0
    """A joined learner that has heard nothing from a syncer shard for this long gives up: it
    stops with one line (``Learner.step()`` raises ``CommError``; ``ddiloco learner`` exits with
    code 7) instead of training on alone, unmerged, after the syncer is gone or the run has
    ended unheard (a partition). Shorter outages (a syncer restart) it rides out; 0: never."""
    give_up_spent_s: float = 60.0
    """The same, sooner, once the run's token budget is spent as far as the learner knows (its
    fleet-token estimate has reached run.processed_tokens): a learner that then hears nothing
    from a syncer shard for this long stops with one line, as for ``give_up_after_s``; the run
    most likely ended while it was cut off. 0: only ``give_up_after_s`` applies."""
    snapshot_interval_s: float = 30.0
    """Seconds between snapshots of the syncer's meta state (versions are durable at once in
    the per-fragment logs regardless); after each, every fragment's next record starts a new log."""
    store_log_bound: float = 2.0
    """How many records of a fragment its log in the syncer's state folder may hold (a multiple
    of one record: the fragment's values, outer momentum and counters): the record that would pass
    it starts a new log and the old one is deleted, no byte copied. The folder then stays within
    about store_log_bound x the state + one fragment (4x the fp32 model + 2x/P with momentum at 2);
    1 is the least disk and an extra fsync per merge. >= 1."""
    syncer_threads: int = 1
    """Intra-op threads each syncer shard merges with: 1 = one core (right when learners share
    the machine: a multi-threaded merge stalls when a core is busy); 0 = every core the process
    may run on (its CPU affinity), for a syncer with cores of its own. Results are bit-identical
    for a given count. >= 0."""
    restart_limit: int = 20
    """Restarts of one learner the local launcher makes before it gives up on it."""
    restart_delay_s: float = 0.0
    """Delay before the launcher restarts a learner that exited abnormally."""
    eval_interval_s: float = 20.0
    """Seconds between the evaluator's polls of the syncer (``ddiloco evaluator``, and
    ``SyncerServer``'s ``evaluate=`` hook): a versions-only ``FetchGlobal`` of a few hundred
    bytes that says whether the merged tokens passed the next mark of
    ``runtime.eval_every_tokens`` and whether the run ended. So it is also the least time
    between two evaluations. (Before wire schema 8 it was the period of the evaluations
    themselves, each of which fetched the whole model.)"""
    eval_every_tokens: float = 0.0
    """Merged tokens between two evaluations of the global model by the evaluator (``ddiloco
    evaluator``, and ``SyncerServer``'s ``evaluate=`` hook): it evaluates at the first poll
    (``runtime.eval_interval_s``) after the run's merged tokens pass the next multiple of this,
    and fetches then only the fragments whose version moved since its last fetch, exact (fp32).
    0 (the default): automatic, so that the evaluator moves at most a tenth of the learners'
    steady traffic: X = 40 x H x B / (u + d), with H = ``algo.sync_every``, B the tokens one
    learner processes per inner step (the learners report it; until they do, no evaluation is
    due), and u, d the bytes per value of ``algo.up_encoding`` and ``algo.down_encoding`` (fp32
    4, bf16 2, int8 1, int4 0.5, int2 0.25). The arithmetic: a fragment of n values merges once
    per H steps of each of the M learners, taking in M x H x B tokens and moving M x n x (u + d)
    bytes on their links, so the learners move N (u + d) / (H B) bytes per merged token (N: the
    model's values); the evaluator fetches each fragment that moved at most once per evaluation,
    at most 4 N bytes per X merged tokens. Its share is 4 H B / (X (u + d)) whatever M and the
    run's length are: 0.1 at the automatic X (less when learners send scales and headers too,
    or a fragment did not move). The default GPT (B = 8 x 128 = 1,024 bytes, H = 24) with int4
    both ways evaluates every 983,040 merged tokens, with fp32 every 122,880. >= 0, finite."""
    duration_s: float = math.inf
    """A real run's time budget: the syncer ends the run this many seconds after it started
    (run.json's started_at) unless its token budgets (run.processed_tokens, run.merged_tokens)
    end it first; inf (the default): none. A time budget that ends a run short of
    run.processed_tokens says so (a WARNING and summary.json's warnings)."""
    final_eval: bool = True
    """The syncer evaluates the final global model once when the run ends (for summary.json);
    turn it off when the model is too big for the syncer's CPU (the evaluator's last eval is
    then the final figure)."""
    metrics_bind: str = ""
    """``HOST:PORT`` where the syncer serves Prometheus metrics over HTTP (``/metrics``: goodput,
    live learners, tokens, merges, grace admissions, bytes each way, rejections; the figures of
    ``ddiloco status``); port 0 takes a free one (logged). Empty: none. Needs the
    ``prometheus`` extra (``pip install 'ddiloco[prometheus]'``). Shard K serves PORT + K."""
    end_linger_s: float = 60.0
    """How long a syncer whose run has ended (or that was started again on an ended run folder)
    keeps answering ``RunEnd`` to whoever registers, asks or speaks, before it exits: long
    enough for a supervisor (Kubernetes, Slurm ``--requeue``, a shell loop) to restart a
    learner that died near the end, and for one behind a held link to hear it. Its final
    evaluation runs inside this time, the answers going on; a stop (SIGTERM, ``stop()``) ends
    it early, and ``ddiloco train`` does so once every learner it runs has left."""
    progress_interval_s: float = 30.0
    """Long-running processes log a one-line progress report this often when their output is
    not a terminal (under nohup or Slurm); 0: never."""
    status_interval_s: float = 1.0
    """How often processes write their status for the progress view."""
    metrics_interval_s: float = 5.0
    """How often the syncer (shard 0) appends one record per learner to metrics/learners.jsonl
    (state, steps, tokens, busy_s, loss, bytes_sent; see docs/operations.md)."""
    step_sleep_s: float = 0.0
    """Extra sleep per inner step (a stand-in for a slower accelerator; 0 = none)."""
    step_log: bool = False
    """Learners write every inner step's end time and duration to metrics/steps-ID-PID.csv."""
    max_joins_per_s: float = 2.0
    """Registrations the syncer takes from one key per second (bursts of 10; per connection
    without keys); more are dropped unanswered (a join flood cannot stall the syncer's chores)."""
    max_messages_per_s: float = 2000.0
    """Messages the syncer takes from one key per second (bursts of 2x that; per connection
    without keys), charged on receipt: more are dropped before they are decoded."""
    max_busy_share: float = 0.25
    """The share of the syncer's time the messages of one key may take (decoding and handling
    them, merges excepted; bursts of 1 s of work): a key over it has its messages dropped on
    receipt, before they are decoded, until its share recovers. Bounds what a flood of costly
    messages (fetches, stale contributions) from one key can take from the others; 0: off."""
    max_fetches_per_s: float = 2.0
    """``FetchGlobal`` and ``StatusRequest`` the syncer answers per key per second (bursts of
    10; per connection without keys): each answer costs a copy of the model or of the fleet view."""
    max_pending_connections: int = 256
    """TCP connections to the syncer that have not started their handshake (sent ZeroMQ's
    greeting and first handshake command, as every peer does at once) that it keeps: beyond,
    the oldest are cut (an outsider's idle connections cost descriptors and the honest fleet's
    merges). 0: no bound but ZeroMQ's handshake timeout (30 s)."""
    pending_connection_s: float = 10.0
    """How long such a connection may wait before it is cut."""
    token_rate_spread: float = 4.0
    """A learner's heartbeats are believed to process tokens at most this many times as fast as
    the median training rate the other live learners claim (over a token bucket of one liveness
    window, ``algo.liveness_timeout_s``): one insider's claim cannot end the run, move the LR
    schedule or the goodput. A learner this much faster than that median is undercounted (its
    claims beyond are refused, counted as "implausible", and counted later only if the cap
    allows): raise it for a fleet that uneven."""
    lone_tokens_per_s: float = 1e6
    """The cap for a learner with no other live learner (a fleet of one): tokens a second it is
    believed to process. Beside live learners that have not claimed a rate yet (the run's first
    heartbeats) its claims wait for theirs (then count, cumulatively)."""
    peer_state_interval_s: float = 5.0
    """The optimizer hand-off's pace: a learner serves its optimizer state at most once per this
    many seconds (others are refused at once, cheaply), and the syncer relays at most one request
    per requester per this many seconds."""
    peer_state_timeout_s: float = 30.0
    """How long the syncer waits for the chosen peer's optimizer state without progress before
    it forgets the request (the requester then trains on with its own, cold state): counted from
    the request, then from each piece of the state it relays (``peer_state_chunk_mb``), so a
    hand-off over a thin link takes as long as its pieces keep coming."""
    peer_state_chunk_mb: float = 1.0
    """The size of each message of the optimizer hand-off, in MiB: a state goes in messages of
    about this many MiB (whole tensors where they fit; a tensor larger goes as ranges of its
    rows, put back together by the receiver, so only a single row larger than this makes a
    larger message), so that on a thin link each crosses within the liveness timeouts (any
    message is liveness, but ZeroMQ delivers whole messages only) and the relay's timeout
    follows the pieces: keep it below the slowest link's rate x ``syncer_liveness_s`` (1 MiB:
    4.2 s at 2 Mbit/s). It sizes messages only: how much a serving learner copies per step
    boundary is ``peer_state_buffer_mb`` and its link's rate."""
    peer_state_buffer_mb: float = 4096.0
    """The most optimizer state a learner serving the hand-off holds copied and not yet sent, in
    MiB: at each step boundary it copies what its link can carry until the next boundaries (the
    rate its comm thread measured x 2 of its steps; 4 MiB before it has measured anything), less
    what is still unsent, up to this bound (backpressure: while this much waits, it copies
    nothing). So the hand-off's extra host memory on the serving learner stays within this,
    plus one row of a tensor, and its pace follows the link: a link faster than this / the step
    time is paced by this (4 GiB at a 4 s step: about 1 GB/s). > 0."""
    peer_state_copy_share: float = 0.2
    """The most of its step time a serving learner's boundary spends copying optimizer state for
    the hand-off (its copy rate, measured at the earlier boundaries, x this x the step time, and
    never less than 4 MiB per boundary; a boundary also copies at most 8 x what the last one
    did, so the rate is measured at each size first), so that serving does not stall its steps.
    In (0, 1]."""
    local_state_s: float = 120.0
    """How often a learner saves its own state for a restart on the same machine: its model and
    optimizer, the versions it holds with what its deltas are measured against and its
    error-feedback residual, its counters, data position and RNG (seconds from the end of one
    save to the start of the next; 0: never). With a lossy ``algo.down_encoding`` a save also
    starts sooner, once a fragment has moved ``algo.chain_history`` - 1 versions past the last
    save (so a restart still catches up by the syncer's chain), but not sooner than a quarter of
    this after the last one ended. Restarted with it, a learner catches up by what changed since
    instead of taking the whole model and a peer's optimizer state. ``ddiloco learner`` saves in
    RUN_DIR/learners/learner-ID; a library learner where ``Learner(local_state=...)`` says
    (docs/runtime.md, "Restarts")."""
    local_state_chunk_mb: float = 64.0
    """The pieces a save is written in (MiB; a larger tensor alone): each is copied at a step
    boundary and written to disk by a thread of its own."""
    local_state_copy_share: float = 0.02
    """The share of the last step's time a step boundary may spend copying a save's pieces (at
    least one piece per boundary while a save is under way): a save of the model and AdamW's
    state (3 N) takes about 3 N / (this x the copy rate) of training time."""
    local_state_buffer_mb: float = 256.0
    """The most a save holds in memory, copied and not yet on disk (MiB; at least one piece):
    a boundary copies nothing more while the writer is this far behind."""
    local_state_max_age_s: float = 3600.0
    """A saved state older than this is not taken back (the restart joins afresh and says why):
    its versions would be further behind than the syncer keeps changes for."""
    record_mb: float = 0.0
    """Flight recorder: each syncer shard records what its session is handed (messages, with
    the sender and its key's role, and ticks, with their times) to RUN_DIR/recordings/, up to
    this many MiB per start, so an incident can be replayed through the same session
    (``ddiloco.service.syncer.recorder.replay``); 0: off."""
    send_queue_mb: float = 512.0
    """What the syncer keeps waiting for one learner's link, in MiB (ZeroMQ itself holds only a
    few messages per peer): a newer version of a fragment replaces a waiting older one, and
    past this bound the oldest merged versions are dropped (counted as ``send_dropped``; the
    learner re-syncs: an answer built on an old version gets the current one back). A join's
    fragments, requests and the run's end are never dropped. The default holds a few
    fragments of a 1B-parameter fp32 model (4 GB in 24 fragments: 167 MB each)."""
    max_rejections_logged_per_s: float = 5.0
    """Refusals per learner and reason written to the tape per second (bursts of 20); more are
    only counted (`rejections_unlogged` in the status)."""


def value_bytes(encoding: str) -> float:
    """Bytes per value of a payload in ``encoding`` (its data and a sparse one's positions,
    scales left out)."""
    n = 1 << 16
    _, data, positions = frame_nbytes(n, encoding)
    return (data + positions) / n


def auto_eval_tokens(sync_every: int, up_encoding: str, down_encoding: str, tokens_per_step: float) -> float:
    """``runtime.eval_every_tokens`` = 0's cadence: the merged tokens X at which an evaluator that
    fetches every moved fragment in fp32 once per X moves ``EVAL_TRAFFIC_SHARE`` of what the
    learners move on their links: 4 H B / (X (u + d)) = 0.1 (the arithmetic is the setting's)."""
    per_value = value_bytes(up_encoding) + value_bytes(down_encoding)
    return FP32_BYTES * sync_every * tokens_per_step / (EVAL_TRAFFIC_SHARE * per_value)


@dataclass
class EvalCadence:
    """When an observer evaluates the global model: at a poll that sees the run's merged tokens
    past the next multiple of ``every`` (marks at X, 2X, 3X ...: an evaluator that starts late or
    again evaluates at its first poll past a mark, then at the next mark)."""

    every_tokens: float = 0.0
    """``runtime.eval_every_tokens`` (0: automatic, ``auto_eval_tokens``)."""
    sync_every: int = 24
    """``algo.sync_every`` (H)."""
    up_encoding: str = "fp32"
    """``algo.up_encoding``."""
    down_encoding: str = "fp32"
    """``algo.down_encoding``."""
    last: float = 0.0
    """The merged tokens at the last evaluation (0: none yet)."""

    def every(self, tokens_per_step: float) -> float | None:
        """The merged tokens between two evaluations, given the learners' tokens per inner step
        (None: automatic, and they have not reported any yet)."""
        if self.every_tokens > 0:
            return self.every_tokens
        if not tokens_per_step > 0:
            return None
        return auto_eval_tokens(self.sync_every, self.up_encoding, self.down_encoding, tokens_per_step)

    def next_mark(self, tokens_per_step: float) -> float | None:
        """The merged tokens at which the next evaluation is due (None: not known yet)."""
        every = self.every(tokens_per_step)
        return None if every is None else (math.floor(self.last / every) + 1) * every

    def due(self, merged_tokens: float, tokens_per_step: float) -> bool:
        """Whether an evaluation is due at ``merged_tokens``."""
        mark = self.next_mark(tokens_per_step)
        return mark is not None and merged_tokens >= mark

    def evaluated(self, merged_tokens: float) -> None:
        """An evaluation of the model at ``merged_tokens`` was made."""
        self.last = max(self.last, merged_tokens)
