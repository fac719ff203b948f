"""``ddiloco syncer``: a syncer shard's session pumped by network messages and the monotonic clock.

The session (``ddiloco.protocol.syncer_session``) holds every rule. This driver adds what a real
process needs: the transport (decoding is total: malformed messages are counted and dropped;
rate limits apply per key, the authenticated principal, or per connection without keys, on
receipt, before any decoding), CURVE keys (each message's key becomes the session's
``Principal``; the peer is the connection the ROUTER named, never a name the sender chose), the
durable store (every merged version is appended to its fragment's log and fsynced *before* it is
sent to anyone; periodic snapshots make restarts fast), the run folder (status file, metrics,
run log, final model, summary), an optional flight recorder, and the clock. One CPU-only process
(or thread, in tests) per shard.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ddiloco.config import Config
from ddiloco.core import robust
from ddiloco.core.fragments import storage_bytes, tensor_pieces, write_fragment
from ddiloco.core.messages import Contribution, FragmentRequest, FragmentUpdate
from ddiloco.core.syncer import FragmentRecord, Syncer
from ddiloco.core.tape import Rejection, RoundRecord
from ddiloco.errors import DDiLoCoError
from ddiloco.lifecycle import ProgressLines
from ddiloco.protocol.config import RuntimeConfig
from ddiloco.protocol.messages import Register, SettingsRequest, SyncerHeartbeat
from ddiloco.protocol.syncer_session import Principal, SyncerOutput
from ddiloco.protocol.traffic import Direction, TrafficMeter, merge_traffic
from ddiloco.report.model_file import save_pieces
from ddiloco.report.rundir import prepare_run_dir
from ddiloco.report.summary import write_summary
from ddiloco.report.tape import append_run_event, read_json
from ddiloco.service.base.clock import SYSTEM_CLOCK, Clock
from ddiloco.service.base.heap import PeakWatch, release_free_memory, resident_bytes
from ddiloco.service.base.keys import ServerKeys, is_local
from ddiloco.service.base.ratelimit import RateLimits
from ddiloco.service.base.startup import StartupTimes
from ddiloco.service.base.status import write_status
from ddiloco.service.base.transport import Frames, SyncerSocket, ZmqSyncerSocket
from ddiloco.service.base.wire import (
    SchemaMismatch,
    WireError,
    decode_from,
    encode,
    largest_piece,
    max_frame_bytes,
    refusal,
)
from ddiloco.service.base.wire_schemas import SCHEMA, refusal_reason
from ddiloco.service.syncer.final_model import file_entries
from ddiloco.service.syncer.fleet_status import LearnerMetrics, fleet_status, learner_records, status_reply
from ddiloco.service.syncer.load import RoundLoad
from ddiloco.service.syncer.opening import (
    check_shard,
    meta_model,
    open_session,
    restore_global,
)
from ddiloco.service.syncer.prometheus import MetricsServer
from ddiloco.service.syncer.recorder import FlightRecorder
from ddiloco.service.syncer.run_end import EndWork, final_eval
from ddiloco.service.syncer.store import StoreFull
from ddiloco.training.layout import synced_tensors
from ddiloco.workloads.config import load_workload

log = logging.getLogger(__name__)


SEND_PUMP_S = 0.01
END_WORK_WAIT_S = 600.0
"""The longest a syncer that fails waits for its end work (calibration, final evaluations)."""
"""How often the loop hands queued messages on to a slow link while some wait (ZeroMQ's ROUTER
has no per-peer writable event to wait for)."""


HEALTH_STALE_MIN_S = 60.0
"""``/healthz`` fails once the loop's status is this old, at least (``health_stale_s``)."""
SLOWEST_DISK_BYTES_PER_S = 20e6
"""The slowest disk the loop's longest write (the final model's file) is allowed for."""


def health_stale_s(status_interval_s: float, model_bytes: int) -> float:
    """How old the loop's status may get before ``/healthz`` says the syncer is stuck: 60 s, 30
    status intervals, or the time to write the whole model at 20 MB/s (the final model's file, the
    loop's longest write: 200 s for a 1B-parameter fp32 model), whichever is longest."""
    return max(HEALTH_STALE_MIN_S, 30 * status_interval_s, model_bytes / SLOWEST_DISK_BYTES_PER_S)


MAX_DIALECTS = 4096
"""Most connections remembered as speaking an older wire schema."""
MAX_SCHEMA = 1 << 16
"""A schema number past this is not answered (it is no schema, only counted)."""


def queue_rule(msg: Any) -> tuple[Hashable | None, bool]:
    """How ``msg`` waits in its peer's send queue (``transport.SendQueue``): the key a newer
    message replaces it by, and whether it may be dropped when the link falls behind.

    A merged version of fragment p is droppable: the learner re-syncs (it answers from the
    version it holds; an answer built on a version the syncer no longer keeps gets the current
    one back, a rebase). Its full values are replaced by a newer version's (a delta is not: it
    chains on the version before it). A join's or a rebase's version is the re-sync itself:
    replaceable by a newer one, never dropped. A newer request for p supersedes the older one
    (one round per fragment at a time), and only the newest heartbeat matters."""
    if isinstance(msg, FragmentUpdate):
        # (``kind`` comes with compressed down-links: without it every update is values)
        key = ("update", msg.fragment) if getattr(msg, "kind", "values") == "values" else None
        return key, msg.reason == "merged"
    if isinstance(msg, FragmentRequest):
        return ("request", msg.fragment), False
    if isinstance(msg, SyncerHeartbeat):
        return ("heartbeat",), False
    return None, False


class SyncerService:
    """Owns the transport, the session (and its core), the durable store and the periodic chores."""

    def __init__(
        self,
        cfg: Config,
        sock: SyncerSocket,
        run_dir: str | Path,
        shard: int = 0,
        num_shards: int = 1,
        clock: Clock = SYSTEM_CLOCK,
        fsync: bool = True,
        keys: ServerKeys | None = None,
        model: nn.Module | None = None,
        embedding_like: Callable[[str], bool] | None = None,
        take: bool = False,
    ) -> None:
        """``model``: the initial global model (default: the config's workload builds it);
        ``embedding_like(name)``: which of its tensors are merged by weighted mean (default: the
        workload's choice, or for a given model its ``nn.Embedding`` parameters); ``take``: the
        core keeps ``model``'s values as they are (views), since the caller lets them go."""
        check_shard(shard, num_shards)
        self.cfg, self.shard, self.num_shards = cfg, shard, num_shards
        self.run_dir = prepare_run_dir(run_dir, f"ddiloco syncer (shard {shard})")
        self.clock, self.sock, self.keys = clock, sock, keys
        self.startup = StartupTimes("syncer", ("first_merge",), shard=shard)
        self.startup.run_dir = self.run_dir
        self.startup.mark("imports")
        self.evaluates = model is None  # a model given in code has no workload here to evaluate on
        g = restore_global(cfg, self.run_dir, shard, num_shards, fsync, model, embedding_like, take)
        self.layout, self.store, self.restored, self._state_keys = g.layout, g.store, g.found is not None, g.state_keys
        self._max_numel = largest_piece(g.layout.fragments)
        """The most values an encoded piece from a peer may decode to (the layout's largest piece)."""
        self.startup.mark("restore")
        start = clock.monotonic()
        self.session, ended = open_session(cfg, g, self.run_dir, clock, start, shard, keys is not None)
        self._init_state(cfg.runtime, start, g.numel)
        self._start(ended)
        self.peak.note("start")  # the process so far: imports, the model's build, the store's restore

    def _init_state(self, rt: RuntimeConfig, start: float, numel: int) -> None:
        """The counters, receipt-time limits and chore clocks, before any message."""
        self.counts = {
            "malformed": 0, "unknown_sender": 0, "impostor": 0, "rate_limited": 0, "refused_relay": 0,
            "superseded": 0, "foreign_state": 0, "implausible": 0, "other_schema": 0, "rejections_unlogged": 0,
            "merges": 0, "messages": 0, "bytes_in": 0, "bytes_out": 0,
        }  # fmt: skip
        self.rounds: dict[str, dict[str, int]] = {"closed": {}, "admitted": {}, "refused": {}}
        # Connections that speak an older, served wire schema, answered in it (bounded: the oldest
        # entry goes first; a connection forgotten is answered in ours and sees one malformed reply).
        self._dialects: dict[bytes, int] = {}
        # Receipt-time limits, per key (per connection without keys): counted before decoding.
        self._join_rate: RateLimits[bytes] = RateLimits(rt.max_joins_per_s, 10.0)
        self._message_rate: RateLimits[bytes] = RateLimits(rt.max_messages_per_s, 2 * rt.max_messages_per_s)
        self._busy: RateLimits[bytes] | None = RateLimits(rt.max_busy_share, 1.0) if rt.max_busy_share > 0 else None
        self.work_clock: Callable[[], float] = time.perf_counter
        """What the syncer's work per key is measured with (tests replace it)."""
        self._rejection_rate: RateLimits[tuple[int, str]] = RateLimits(rt.max_rejections_logged_per_s, 20.0)
        self.stopping = False
        self._last_snapshot = start
        self._model_written: tuple[int, ...] | None = None  # the versions in final/ (written once per change)
        self._last_status = -float("inf")
        self._started = start
        self._last_metrics = start
        self._warned: set[str] = set()
        self._progress = ProgressLines(rt.progress_interval_s, enabled=not sys.stderr.isatty())
        # Every frame byte of every learner's link, by kind (metrics/traffic*.json, ddiloco status).
        self.traffic = TrafficMeter()
        self._traffic_params = numel  # N, for the data-parallel baseline
        self._peers: dict[Any, int] = {}  # connection -> the learner bound to it (a cache of the session's)
        self.load = RoundLoad(shard=self.shard)
        self.peak = PeakWatch()
        """The process's peak resident size and the phase it was reached in (status ``memory``)."""
        self.phase = "serve"
        """What the shard is doing: serve, final sync (the run's end), final model (writing it), stop."""
        self.end_work = EndWork()
        """The run's end work (the final evaluations), on a thread while the loop goes on
        answering ``RunEnd``; ``SyncerServer`` adds its evaluate hook's to ``end_work.tasks``."""
        self.beside: dict[str, Callable[[], int]] = {}
        """Bytes this process holds beside the core, by name (``SyncerServer``: the model given,
        the evaluate hook's copy), shown in the status ``memory``."""
        self._end_age: float | None = None  # the run's age at its end (goodput's horizon from then on)
        self.last_status: dict[str, Any] = {}
        """The status last written (``runtime.metrics_bind``'s scrapes read it)."""
        self.metrics: MetricsServer | None = None
        self.processed_seen = 0.0
        self.kept_final = False
        """Started again on an ended run whose final model is written: it is kept as it is."""
        """The fleet's processed tokens at the last status write: what a thread beside the loop
        (the evaluate hook) may read."""
        self.final_statistics: dict[str, torch.Tensor] = {}
        """Floating buffers re-estimated on the final weights (``SyncerServer(calibrate=)``,
        ``final_statistics.py``): the final model file and whatever ``load_into`` writes take
        them instead of the merged ones."""

    def _start(self, ended: str | None) -> None:
        """The run folder's files: the flight recorder, the run log's start (or that the run
        already ended), the learners' metrics, and the traffic counted before a restart."""
        metrics, shard, rt = self.run_dir / "metrics", self.shard, self.cfg.runtime
        self.recorder = FlightRecorder.open(self.run_dir, shard, rt.record_mb, self.session, self._started)
        if ended is not None:  # restarted on a finished run: say so, then leave
            if (self.run_dir / "final" / self._final_name).exists():  # it is these versions' (calibrated, maybe)
                self._model_written = tuple(self.core.versions())
                self.kept_final = True
            log.warning(
                "this run already ended (%s): answering that to whoever asks for runtime.end_linger_s = %g s, then "
                "leaving; start a new run folder to train more",
                ended,
                self.cfg.runtime.end_linger_s,
            )
        else:
            self._run_event("resume" if self.restored else "start", "")
        self._learner_metrics = LearnerMetrics(metrics / "learners.jsonl", read_back=shard == 0)
        one = self.num_shards == 1
        self._traffic_path = metrics / ("traffic.json" if one else f"traffic-shard-{shard}.json")
        self._traffic_before = read_json(self._traffic_path)  # a restart goes on counting from there
        self._load_path = metrics / ("syncer-load.json" if one else f"syncer-load-shard-{shard}.json")

    @property
    def core(self) -> Syncer:
        """The session's algorithm core (read it through ``session.view`` where a view serves)."""
        return self.session.core

    @property
    def epoch(self) -> int:
        return self.session.epoch

    @property
    def end_stage(self) -> str | None:
        return self.session.end_stage

    # -- sending ---------------------------------------------------------------------------

    def _send(self, identity: bytes, msg: Any) -> None:
        try:
            frames = encode(msg, self._dialects.get(identity, SCHEMA))
        except (ValueError, TypeError) as e:  # a message out of its bounds is our bug: say it, drop it
            log.error("not sending %s to %r: %s", type(msg).__name__, identity, e)
            return
        self._count_traffic("down", identity, msg, frames)
        self.sock.send(identity, frames, *queue_rule(msg))

    def _emit(self, out: SyncerOutput) -> None:
        """Do what the session asked, in its order: durable first, then the tape, the final
        model and the run log, then the messages (never send what could be lost). A full disk
        raises StoreFull here, before anything is sent."""
        now = self.clock.monotonic()
        kept = [
            r
            for r in out.tape
            if not isinstance(r, Rejection) or self._rejection_rate.allow((r.learner, r.reason), now)
        ]
        self.counts["rejections_unlogged"] += len(out.tape) - len(kept)
        self._count_rounds(out.tape)
        if out.persist:
            meta = self.session.meta()
            started = self.work_clock()
            for rec in self.session.records(out.persist):
                self.store.append(rec, meta)
            self.load.persisted(out.persist, self.work_clock() - started, now)
            self.counts["merges"] += len(out.persist)
            self.startup.mark("first_merge")
        if kept:
            offset = self.clock.wall() - self.clock.monotonic()
            self.store.append_tape([{**r.to_json(), "wall_offset": offset} for r in kept])
        if out.final_model:
            self.write_final_model()
            log.info("final sync done; final model written to %s", self.run_dir / "final")
        for line in out.info if self.shard == 0 else ():  # (every shard hears every learner: one says it)
            log.info("%s", line)
        for what, reason in out.events:
            if what == "end":
                log.info("the run is over: %s", reason)
            self._run_event(what, reason)
        # The session hands back the peers this driver gave it: the ROUTER's connection identities.
        for peer, msg in out.send:
            self._send(cast(bytes, peer), msg)
        for note in out.notes:
            self._count_bad(note.kind, note.text)
        for peer in out.status_requests:
            self._send(cast(bytes, peer), status_reply(self.status()))
        if out.stop:
            self.stopping = True

    # -- receiving -------------------------------------------------------------------------

    def handle(self, identity: bytes, frames: Frames, key: bytes | None = None) -> None:
        """One message from ``identity`` (the connection), authenticated as ``key`` when CURVE is on.

        Limits are charged per key (per connection without keys) before anything is decoded:
        messages per second, and the share of the syncer's time its messages took (a flood of
        costly requests from one key cannot take the syncer from the others)."""
        who = key if self.keys is not None and key is not None else identity
        arrived = self.clock.monotonic()
        if not self._message_rate.allow(who, arrived) or (self._busy is not None and not self._busy.has(who, arrived)):
            self._count_bad("rate_limited", f"messages from {identity!r} over their key's rate or work share")
            return
        started = self.work_clock()
        merges = self.counts["merges"]
        charged = True
        try:
            charged = self._handle(identity, frames, key, who)
        finally:
            # A merge is the fleet's work, not the sender's: the call that closed a round is free.
            if self._busy is not None and charged and self.counts["merges"] == merges:
                self._busy.charge(who, self.clock.monotonic(), self.work_clock() - started)

    def _handle(self, identity: bytes, frames: Frames, key: bytes | None, who: bytes) -> bool:
        """Handle one message; whether its work counts toward its key's share of the syncer's time
        (a registration does not: ``max_joins_per_s`` bounds those, and a restarted learner's
        catch-up, sent as its registration is answered, must not cost it its next answers)."""
        self.counts["messages"] += 1
        self.counts["bytes_in"] += sum(memoryview(f.buffer if hasattr(f, "buffer") else f).nbytes for f in frames)
        try:
            msg, schema = decode_from(frames, self._max_numel)
        except SchemaMismatch as e:
            self._other_schema(identity, who, e)
            self._count_traffic("up", identity, None, frames)
            return True
        except WireError as e:
            self._count_bad("malformed", f"malformed message from {identity!r}: {e}")
            self._count_traffic("up", identity, None, frames)
            return True
        if schema != SCHEMA or identity in self._dialects:
            self._speaks(identity, schema)
        now = self.clock.monotonic()
        joining = isinstance(msg, (Register, SettingsRequest))
        if joining and not self._join_rate.allow(who, now):
            self.counts["rate_limited"] += 1
            return True
        principal = None
        if self.keys is not None:
            peer = self.keys.allowed.get(key or b"")
            principal = None if peer is None else Principal(peer.role, peer.learner)
        self.recorder.receive(now, identity, principal, frames)
        started = self.work_clock()
        out = self.session.receive(identity, msg, now, principal)
        fed = msg.fragment if isinstance(msg, Contribution) else None
        self.load.work(fed, out.persist, self.work_clock() - started)
        self._emit(out)
        self._count_traffic("up", identity, msg, frames)  # after: a Register binds its connection
        return not joining

    def _count_rounds(self, records: list[Any]) -> None:
        """Rounds closed by reason, answers admitted by the quorum or in grace, contributions
        refused by reason (the status's ``rounds``; ``/metrics`` reads them)."""
        for r in records:
            if isinstance(r, RoundRecord):
                closed = self.rounds["closed"]
                closed[r.close_reason] = closed.get(r.close_reason, 0) + 1
                for e in r.merged:
                    if e.weight > 0:
                        key = "grace" if e.in_grace else "quorum"
                        self.rounds["admitted"][key] = self.rounds["admitted"].get(key, 0) + 1
            elif isinstance(r, Rejection):
                refused = self.rounds["refused"]
                refused[r.reason] = refused.get(r.reason, 0) + 1

    def _speaks(self, identity: bytes, schema: int) -> None:
        """Answer ``identity`` in ``schema`` from now on (an older, served one; ours: forget it)."""
        self._dialects.pop(identity, None)
        if schema != SCHEMA:
            if len(self._dialects) >= MAX_DIALECTS:
                del self._dialects[next(iter(self._dialects))]
            self._dialects[identity] = schema

    def _other_schema(self, identity: bytes, who: bytes, e: SchemaMismatch) -> None:
        """A message of a wire schema this syncer does not serve: counted, never merged; a join
        is answered with a refusal in the sender's own schema, so it stops with one line."""
        role = "observer" if e.kind == "FetchGlobal" or e.kind == "StatusRequest" else "learner"
        reason = refusal_reason(e.theirs, role)
        self._count_bad("other_schema", f"refused {e.kind or 'a message'!r} from {identity!r}: {reason}")
        joining = e.kind in ("Register", "SettingsRequest")
        if joining and 2 <= e.theirs <= MAX_SCHEMA and self._join_rate.allow(who, self.clock.monotonic()):
            # (an older schema reads it as its own; a newer one reads ours if it serves it)
            self.sock.send(identity, refusal(reason, self.session.epoch, min(e.theirs, SCHEMA)), None, False)

    def _count_traffic(self, direction: Direction, identity: bytes, msg: Any, frames: Any) -> None:
        """Count one message's frames on ``identity``'s link, for the learner bound to it (none:
        unattributed). Once the run's end is announced, the algorithm's messages are its final sync."""
        learner = self._peers.get(identity)
        if learner is None or self.session.identities.get(learner) != identity:
            self._peers = {peer: m for m, peer in self.session.identities.items()}  # rebuilt on a miss only
            learner = self._peers.get(identity)
        nbytes = sum(memoryview(f.buffer if hasattr(f, "buffer") else f).nbytes for f in frames)
        if direction == "down":
            self.counts["bytes_out"] += nbytes
        self.traffic.count(msg, nbytes, direction, learner, final=self.session.end_stage is not None)

    def traffic_dict(self) -> dict[str, Any]:
        """This shard's traffic meter as JSON (metrics/traffic.json; ``protocol.traffic``)."""
        now = self.traffic.to_dict(params=self._traffic_params, learners=self.cfg.run.num_learners)
        # Bytes add up over this shard's processes; steps are the learners' own (cumulative) counts.
        return merge_traffic([now, self._traffic_before]) if self._traffic_before else now

    def _count_bad(self, kind: str, text: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if kind not in self._warned:  # say it once per kind; the status file keeps counting
            self._warned.add(kind)
            log.warning("%s (dropped; further ones are counted silently)", text)

    # -- the loop --------------------------------------------------------------------------

    def serve(self, max_seconds: float | None = None) -> None:
        """Run until ``stop()`` (or ``max_seconds``, or the run's end), then flush, persist and close."""
        rt = self.cfg.runtime
        end = None if max_seconds is None else self.clock.monotonic() + max_seconds
        log.info(
            "syncer shard %d/%d: %d fragments, versions %s",
            self.shard,
            self.num_shards,
            len(self.core.owned),
            "restored" if self.restored else "fresh",
        )
        if self.cfg.algo.robust:  # what a keyed attacker can and cannot do to this fleet's merges (a fact
            # of the configuration, not a fault: INFO, also for the 2-learner demos)
            log.info("%s", robust.tolerance(self.cfg.run.num_learners))
        try:
            if rt.metrics_bind:  # shard K on PORT + K (port 0: a free one each)
                host, _, port = rt.metrics_bind.rpartition(":")
                self.metrics = MetricsServer(
                    f"{host}:{int(port) + self.shard if int(port) else 0}",
                    lambda: self.last_status,
                    stale_after_s=health_stale_s(rt.status_interval_s, 4 * self._traffic_params),
                )
            self._loop(rt, end)
        except BaseException as e:
            # Nothing unpersisted was sent (on a full disk nothing more can be made durable); the
            # end work reads the core: it finishes (bounded) before anything is closed
            self.end_work.join(END_WORK_WAIT_S)
            self.sock.close()
            self.store.close()
            self.recorder.close()
            self.startup.write()  # (a no-op when the first merge wrote it)
            if self.metrics is not None:
                self.metrics.close()
            if isinstance(e, StoreFull):
                log.error("%s", e)
                raise DDiLoCoError(str(e)) from None
            raise
        self.shutdown()

    def _loop(self, rt: RuntimeConfig, end: float | None) -> None:
        while not self._may_leave(end):
            now = self.clock.monotonic()
            # Sleep until a message, the session's next deadline or the next chore: no idle spinning.
            wake_at = min(self.session.next_deadline(now), self._next_chore(rt))
            wait = min(max(0.0, wake_at - now), 0.25)  # 0.25 s: stop() is seen soon enough
            if self.sock.pump():
                wait = min(wait, SEND_PUMP_S)  # bytes wait for a slow link: hand them on as it drains
            for identity, frames, key in self.sock.recv(wait, limit=1000):  # bounded so chores still run
                self.handle(identity, frames, key)
            now = self.clock.monotonic()
            self.recorder.tick(now)
            started = self.work_clock()
            out = self.session.tick(now)
            self.load.work(None, out.persist, self.work_clock() - started)
            self._emit(out)
            if self.phase == "serve" and self.session.end_stage is not None:
                self._enter("final sync")
            if self.session.end_stage == "done" and not self.end_work.started:
                evaluates = self.shard == 0 and self.cfg.runtime.final_eval and self.num_shards == 1 and self.evaluates
                self.end_work.start([self._final_eval] if evaluates else [])
            self._chores(rt)

    def _may_leave(self, end: float | None) -> bool:
        """The loop may stop: asked to (or the run's end has lingered) or out of time, and the
        run's end work is over (meanwhile a learner that registers or speaks is told the run
        ended, never met with silence)."""
        asked = self.stopping or (end is not None and self.clock.monotonic() >= end)
        return asked and not self.end_work.busy

    def stop(self) -> None:
        """Ask ``serve`` to finish (from a signal handler or another thread)."""
        self.stopping = True

    # -- chores ----------------------------------------------------------------------------

    def run_age(self) -> float:
        """Seconds since the run started (``run.json``'s started_at), on the monotonic clock."""
        return self.session.run_age(self.clock.monotonic())

    def _run_event(self, what: str, reason: str) -> None:
        """Append to metrics/run.jsonl (shard 0 speaks for the run). A failed write is said
        once and does not stop the syncer."""
        if what == "end":  # the count that ended the run, for the final evaluations' records too
            self.processed_seen, self._end_age = self.session.processed_tokens(), self.run_age()
        if self.shard != 0:
            return
        try:
            # the end's count, as a number: the summary's and `ddiloco status`'s tokens processed
            extra = {"processed_tokens": self.session.processed_tokens()} if what == "end" else {}
            append_run_event(self.run_dir, self.run_age(), what, reason, **extra)
        except OSError as e:
            log.warning("cannot record %r in %s: %s", what, self.run_dir / "metrics" / "run.jsonl", e)

    def _progress_line(self) -> str:
        view = self.session.view(self.clock.monotonic())
        versions = [f.version for f in view.fragments]
        stage = self.session.end_stage
        limit = self.cfg.runtime.duration_s
        budget = f" of {limit:,.0f}" if math.isfinite(limit) else " (no time budget)"
        return (
            f"syncer shard {self.shard}: {self.session.processed_tokens():,.0f} / "
            f"{self.cfg.run.processed_tokens:,} tokens processed, {view.merged_tokens:,.0f} merged, "
            f"{self.run_age():,.0f} s{budget}, {len(view.live)} live learner{'' if len(view.live) == 1 else 's'}, "
            f"versions {min(versions)}..{max(versions)}" + (f", ending ({stage})" if stage else "")
        )

    def _next_chore(self, rt: RuntimeConfig) -> float:
        return min(
            self._last_snapshot + rt.snapshot_interval_s,
            self._last_status + rt.status_interval_s,
            self._last_metrics + rt.metrics_interval_s,
        )

    def _chores(self, rt: RuntimeConfig) -> None:
        mono = self.clock.monotonic()
        if mono - self._last_snapshot >= rt.snapshot_interval_s:
            self._last_snapshot = mono
            self.snapshot()
        if mono - self._last_status >= rt.status_interval_s:
            self._last_status = mono
            self.write_status()
        if mono - self._last_metrics >= rt.metrics_interval_s:
            self._last_metrics = mono
            self.write_learner_metrics()
        self._progress.maybe(self._progress_line)

    def snapshot(self) -> Path:
        """Write every owned fragment and the meta state as one snapshot (the records made one
        at a time: each copies its fragment's momentum, let go before the next is made)."""

        def records() -> Iterator[FragmentRecord]:
            for p in self.core.owned:
                [rec] = self.session.records([p])
                yield rec
                del rec

        return self.store.snapshot(records(), self.session.meta())

    def _enter(self, phase: str) -> None:
        """The shard's work moves on to ``phase``: the peak so far belongs to the one before."""
        self.peak.note(self.phase)
        self.phase = phase

    def memory(self) -> dict[str, Any]:
        """Bytes the core holds by purpose (``Syncer.held_bytes``), the fragments other shards
        own as this core keeps them (``unowned``), what the process holds beside the core
        (``beside``), what waits in the send queues, and the process's resident size now and at
        its peak, with the phase the peak was reached in (docs/runtime.md's budget, live)."""
        queues = getattr(self.sock, "queues", {})
        out: dict[str, Any] = {f"held_{k}": v for k, v in self.core.held_bytes().items()}
        out["unowned"] = self.unowned_bytes()
        out.update({name: held() for name, held in self.beside.items()})
        out["send_queued"] = sum(q.nbytes for q in queues.values())
        out["rss"] = resident_bytes()
        self.peak.note(self.phase)
        out["rss_peak"], out["rss_peak_in"] = self.peak.bytes, self.peak.phase
        return out

    def unowned_bytes(self) -> int:
        """Bytes of the fragments other shards own, as this shard's core keeps them (version 0:
        views of the model it was built from, where they do not share a storage with its own)."""
        core = self.core
        mine = {t.untyped_storage().data_ptr() for p in core.owned for t in core.values(p)}
        others = [
            t
            for p in range(core.layout.num_fragments)
            if p not in core.owned
            for t in core.values(p)
            if t.untyped_storage().data_ptr() not in mine and not t.is_meta
        ]
        return storage_bytes(others)

    def status(self) -> dict[str, Any]:
        """This shard's figures: the fleet view (``fleet_status``) and the process's counters.
        The status file holds it and a ``StatusRequest`` is answered with it."""
        now, wall = self.clock.monotonic(), self.clock.wall()
        return {
            "time": wall,
            "pid": os.getpid(),
            "cpu_s": time.process_time(),
            "wall_s": now - self._started,
            **self.counts,
            **getattr(self.sock, "counts", {}),  # the send queues' drops (ZeroMQ)
            "run_end": self.session.end_stage,
            "end_reason": self.session.end_reason,
            "memory": self.memory(),
            "rounds": {k: dict(v) for k, v in self.rounds.items()},  # a copy: a status is never changed after
            "load": self.load.to_dict(),
            **fleet_status(self.session, now, shard=self.shard, run_time_s=self.run_age(), traffic=self.traffic_dict()),
            # shard 0 keeps the learners' books: the share of learner time in steps so far, by the summary's rule
            # (after the end: over the run's length, as the summary counts it)
            **(
                self._learner_metrics.goodput_figures(self.cfg.run.num_learners, self._end_age or self.run_age())
                if self.shard == 0
                else {}
            ),  # fmt: skip
        }

    def write_status(self) -> None:
        self.processed_seen = self.session.processed_tokens()
        release_free_memory()  # merged fragments freed since the last write go back to the OS
        self.last_status = self.status()  # (replaced whole: the metrics server's thread reads it)
        write_status(self.run_dir / "status" / f"syncer-{self.shard}.json", self.last_status)
        write_status(self._traffic_path, self.traffic_dict())  # the summary adds the shards up
        write_status(self._load_path, self.load.to_dict())

    def write_learner_metrics(self) -> None:
        """Append one record per learner to metrics/learners.jsonl (shard 0 only: every shard
        hears every learner's heartbeats, one copy is enough)."""
        if self.shard == 0:
            self._learner_metrics.append(learner_records(self.session, self.clock.monotonic(), self.run_age()))

    def shutdown(self) -> None:
        """Close open rounds, make everything durable, write the final model, close the socket
        and release the run folder; then (shard 0) the final evaluation and the summary.

        Stopped before the run's end (a signal, a requeue), the run is marked interrupted and
        its summary partial; a later start on the folder resumes it."""
        ended = self.session.end_stage == "done"
        self._enter("stop")
        try:
            self._emit(self.session.shutdown(self.clock.monotonic()))
            self.snapshot()
            self.write_status()
            self.write_learner_metrics()  # the learners' last figures, for the summary
            if self._model_written != tuple(self.core.versions()):  # not already written at the run's end
                self.write_final_model()
                self.write_status()  # again: its memory figures with the final model's writing
        finally:
            self.sock.close()
            self.store.close()
            self.recorder.close()
            self.startup.write()  # (a no-op when the first merge wrote it)
            if self.metrics is not None:
                self.metrics.close()
        if not ended:
            self._run_event("interrupted", "the syncer was stopped before the run's end")
        if self.shard == 0:
            if ended and not self.end_work.started and self.cfg.runtime.final_eval and self.num_shards == 1:
                try:  # (the end work runs it while the loop answers: only a stop before that comes here)
                    if self.evaluates:
                        self._final_eval()
                except Exception:  # the final model is written: an evaluation that fails costs its figure only
                    log.exception("the final evaluation failed; the final model is written all the same")
            try:
                write_summary(self.run_dir)
            except OSError as e:
                log.warning("cannot write the summary in %s: %s", self.run_dir, e)

    def _final_eval(self) -> None:
        """Evaluate the final global model once (summary.json's eval loss)."""
        final_eval(  # (after the end the session's count is frozen: safe to read off the loop's thread)
            self.cfg,
            self.run_dir,
            self.load_into,
            self.core.merged_tokens,
            self.run_age(),
            self.session.processed_tokens(),
        )

    def load_into(self, model: nn.Module) -> None:
        """Write this shard's global values into ``model`` (tied tensors share them), fragment
        by fragment: no assembled copy of the model."""
        params = synced_tensors(model)
        for p in self.core.owned:
            write_fragment(params, self.core.layout.fragments[p], self.core.values(p))
        with torch.no_grad():
            for name, value in self.final_statistics.items():
                params[name].copy_(value)

    def use_final_statistics(self, statistics: dict[str, torch.Tensor]) -> None:
        """Take floating buffers re-estimated on the final weights (checked by the caller) and
        write the final model file again with them."""
        merged, self.final_statistics = self.final_statistics, statistics
        try:
            self.write_final_model()
        except OSError as e:  # (a full disk): the file keeps the merged statistics, and so does everything else
            self.final_statistics = merged
            log.warning("cannot write the final model with re-estimated statistics (%s); it keeps the merged ones", e)
            return
        log.info("final model written again with %d buffers re-estimated on its weights", len(statistics))

    @property
    def _final_name(self) -> str:
        return "model.safetensors" if self.num_shards == 1 else f"model.shard-{self.shard}.safetensors"

    def write_final_model(self) -> Path:
        """Write the final model file (``final/``) from the core's values, a piece at a time."""
        before = self.phase
        self._enter("final model")
        try:
            return self._write_final_model()
        finally:
            self._enter(before)

    def _write_final_model(self) -> Path:
        pieces = tensor_pieces(self.core.layout, {p: self.core.values(p) for p in self.core.owned})
        entries, aliases = file_entries(pieces, self._state_keys, self.final_statistics)
        saved = save_pieces(entries, self.run_dir / "final" / self._final_name, aliases)
        self._model_written = tuple(self.core.versions())
        return saved


def open_syncer(
    cfg: Config,
    bind: str,
    run_dir: str | Path,
    *,
    model: nn.Module | None = None,
    embedding_like: Callable[[str], bool] | None = None,
    shard: int = 0,
    num_shards: int = 1,
    keys_dir: str | Path | None = None,
    insecure: bool = False,
    transport: SyncerSocket | None = None,
    fsync: bool = True,
    take: bool = False,
) -> tuple[SyncerService, str]:
    """A syncer shard serving at ``bind`` and the address it bound (``PORT`` may be ``*``): the
    one construction path of ``ddiloco syncer`` and ``ddiloco.SyncerServer``.

    Off this machine CURVE is on by default: without keys the syncer refuses to bind anything
    but loopback unless ``insecure`` is given, and then says so. ``model``: the initial global
    model (default: the config's workload builds it, and the syncer evaluates the final model
    on it); ``transport``: an in-process socket instead of ZeroMQ (tests); ``take``: the core
    keeps ``model``'s values without copying them (the caller lets the model's tensors go)."""
    import zmq

    # One core by default (the learners need the rest); a syncer with cores of its own may merge on all.
    torch.set_num_threads(cfg.runtime.syncer_threads or max(1, len(os.sched_getaffinity(0))))
    keys = ServerKeys.load(keys_dir) if keys_dir is not None else None
    if keys is None and not is_local(bind) and transport is None:
        if not insecure:
            raise DDiLoCoError(
                f"binding {bind} without keys lets anyone who can reach it join, read and steer the model: make "
                "keys with `ddiloco keys DIR --learners M` and pass them (--keys DIR, or keys=DIR in Python), or "
                "--insecure (insecure=True) on a trusted network"
            )
        log.warning("INSECURE: %s accepts any peer without authentication or encryption", bind)
    from_workload = model is None
    # (the workload's model is built by the service, as its structure first: here its sizes only)
    shape = model if model is not None else meta_model(load_workload(cfg.workload), cfg.run.seed)
    address = bind
    if transport is None:
        largest = max(t.numel() for t in synced_tensors(shape).values())  # a buffer is a frame too
        try:
            rt = cfg.runtime
            zsock = ZmqSyncerSocket(
                bind, max_frame_bytes(largest), keys, int(rt.send_queue_mb * (1 << 20)),
                rt.max_pending_connections, rt.pending_connection_s,
            )  # fmt: skip
        except zmq.ZMQError as e:
            raise DDiLoCoError(f"cannot bind the syncer to {bind}: {e} (is the port in use? pass another)") from None
        address = bytes(zsock.sock.getsockopt(zmq.LAST_ENDPOINT)).decode()
        transport = zsock
    try:
        service = SyncerService(
            cfg, transport, run_dir, shard, num_shards, fsync=fsync, keys=keys, model=model,
            embedding_like=embedding_like, take=take,
        )  # fmt: skip
    except BaseException:
        transport.close()
        raise
    service.evaluates = from_workload
    return service, address
