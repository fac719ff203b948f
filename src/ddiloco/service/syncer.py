"""``ddiloco syncer``: the core syncer driven by network messages and the monotonic clock.

One CPU-only process (or thread, in tests) per shard. Every merged version is appended to its
fragment's log and fsynced *before* it is sent to anyone; periodic snapshots make restarts
fast. Malformed or unknown messages are counted and dropped; nothing a peer sends can crash
the service. The transport and the clock are injected (``service.transport``, ``service.clock``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddiloco.config import Config, RuntimeConfig
from ddiloco.core.messages import Ack, Contribution, Heartbeat, Join, Leave
from ddiloco.core.syncer import Output, Syncer
from ddiloco.core.tape import Rejection
from ddiloco.errors import DDiLoCoError
from ddiloco.lifecycle import ProgressLines
from ddiloco.report.model_file import save_state_dict
from ddiloco.report.rundir import prepare_run_dir
from ddiloco.report.summary import run_started_at, write_summary
from ddiloco.report.tape import append_run_event, read_jsonl
from ddiloco.service.clock import SYSTEM_CLOCK, Clock
from ddiloco.service.fleet_status import LearnerMetrics, fleet_status, learner_records, status_reply
from ddiloco.service.keys import ServerKeys, is_local
from ddiloco.service.protocol import (
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
    param_spec,
)
from ddiloco.service.ratelimit import RateLimits
from ddiloco.service.status import write_status
from ddiloco.service.store import StoreFull, SyncerStore
from ddiloco.service.transport import Frames, SyncerSocket, ZmqSyncerSocket
from ddiloco.service.wire import WireError, decode, encode, max_frame_bytes
from ddiloco.training.layout import layout_of
from ddiloco.workloads.base import embedding_parameters
from ddiloco.workloads.config import load_workload

log = logging.getLogger(__name__)

CORE_MESSAGES = (Heartbeat, Contribution, Ack, Leave)
RELAYED = (PeerStateRequest, PeerState)


def restore_into(store: SyncerStore, core: Syncer) -> bool:
    """Load what ``store`` holds into a freshly built ``core``; True when anything was found.
    A fragment's version never goes backwards: an older record than the core's is not loaded."""
    found = store.restore(core.layout, core.owned)
    if found is None:
        return False
    for p, rec in found.fragments.items():
        if rec.version >= core.fragments[p].version:
            core.load_fragment_record(rec)
    if found.syncer_meta is not None:
        core.load_meta_state(found.syncer_meta)
    return True


def snapshot(store: SyncerStore, core: Syncer) -> Path:
    """Write every owned fragment and the meta state as one snapshot."""
    return store.snapshot([core.fragment_record(p) for p in core.owned], core.meta_state())


def persist(store: SyncerStore, core: Syncer, out: Output, clock: Clock = SYSTEM_CLOCK) -> None:
    """Make what ``out`` produced durable: new versions first, then the tape records. Times in
    the core are monotonic; each tape line also gets ``wall_offset`` (wall minus monotonic
    time when written), so readers can turn any of its times into a wall-clock time."""
    for p in out.durable:
        store.append(core.fragment_record(p), core.meta_state())
    if out.tape:
        offset = clock.wall() - clock.monotonic()
        store.append_tape([{**r.to_json(), "wall_offset": offset} for r in out.tape])


class SyncerService:
    """Owns the transport, the core syncer, the durable store and the periodic chores."""

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
    ) -> None:
        """``model``: the initial global model (default: the config's workload builds it);
        ``embedding_like(name)``: which of its tensors are merged by weighted mean (default: the
        workload's choice, or for a given model its ``nn.Embedding`` parameters)."""
        if not 0 <= shard < num_shards:
            raise DDiLoCoError(
                f"--shard {shard} is out of range for --num-shards {num_shards}; use 0 .. {num_shards - 1}"
            )
        self.cfg, self.shard, self.num_shards = cfg, shard, num_shards
        self.run_dir = prepare_run_dir(run_dir, f"ddiloco syncer (shard {shard})")
        self.clock = clock
        self.evaluates = model is None  # a model given in code has no workload here to evaluate on
        if model is None:
            wl = load_workload(cfg.workload)
            model = wl.build_model(cfg.run.seed)
            embedding_like = embedding_like or wl.is_embedding_like
        self.spec = param_spec(model)
        self.layout = layout_of(model, cfg.algo, embedding_like or embedding_parameters(model))
        owned = [p for p in range(self.layout.num_fragments) if p % num_shards == shard]
        if not owned:
            raise DDiLoCoError(
                f"shard {shard} of {num_shards} owns no fragment (the model has {self.layout.num_fragments}); "
                "use fewer shards"
            )
        params = dict(model.named_parameters())
        self.core = Syncer(cfg.algo, self.layout.fragments, params, self.layout.embedding_like, owned)
        self.model = model
        self.store = SyncerStore(self.run_dir, shard, num_shards, fsync=fsync)
        self.restored = restore_into(self.store, self.core)
        self.epoch = secrets.randbits(62)  # a new value per start: learners see the syncer restarted
        self.identities: dict[int, bytes] = {}
        self.counts = {
            "malformed": 0, "unknown_sender": 0, "impostor": 0, "rate_limited": 0, "rejections_unlogged": 0,
            "merges": 0, "messages": 0, "bytes_in": 0,
        }  # fmt: skip
        rt = cfg.runtime
        self._join_rate: RateLimits[bytes] = RateLimits(rt.max_joins_per_s, 10.0)
        self._message_rate: RateLimits[bytes] = RateLimits(rt.max_messages_per_s, 2 * rt.max_messages_per_s)
        self._rejection_rate: RateLimits[tuple[int, str]] = RateLimits(rt.max_rejections_logged_per_s, 20.0)
        self.sock = sock
        self.keys = keys
        self.stopping = False
        start = clock.monotonic()
        self._last_snapshot = start
        self._last_status = -float("inf")
        self._last_heartbeat = -float("inf")
        self._started = start
        self._warned: set[str] = set()
        # The run's end (see _advance_end): None while training, then "stop" (learners stop and
        # the open rounds close), "final" (the final sync), "done" (final model written).
        self.started_at = run_started_at(self.run_dir) or clock.wall()
        # The run's age: the wall clock is read once here (a restart resumes the count), then only
        # the monotonic clock advances it, so a wall-clock jump moves no decision.
        self._age_at_start = max(0.0, clock.wall() - self.started_at)
        self.end_stage: str | None = None
        self.end_reason = ""
        self._end_next = 0.0
        self._progress = ProgressLines(rt.progress_interval_s, enabled=not sys.stderr.isatty())
        runlog = [r for r in read_jsonl(self.run_dir / "metrics" / "run.jsonl") if r.get("what") != "start"]
        if runlog and runlog[-1].get("what") == "end":  # restarted on a finished run: say so, then leave
            self.end_stage, self.end_reason = "done", str(runlog[-1].get("reason", "the run ended"))
            self._end_next = start + rt.end_linger_s
            log.warning("this run already ended (%s): nothing to do; start a new run folder to train more",
                        self.end_reason)  # fmt: skip
        else:
            self._run_event("resume" if self.restored else "start", "")
        self._learner_metrics = LearnerMetrics(self.run_dir / "metrics" / "learners.jsonl")
        self._last_metrics = start

    # -- sending ---------------------------------------------------------------------------

    def _send(self, identity: bytes, msg: Any) -> None:
        try:
            frames = encode(msg)
        except (ValueError, TypeError) as e:  # a message out of its bounds is our bug: say it, drop it
            log.error("not sending %s to %r: %s", type(msg).__name__, identity, e)
            return
        self.sock.send(identity, frames)

    def _emit(self, out: Output) -> None:
        """Make new versions durable, then send (the order matters: never send what could be lost).
        A full disk raises StoreFull here, before anything is sent."""
        now = self.clock.monotonic()
        kept = [
            r
            for r in out.tape
            if not isinstance(r, Rejection) or self._rejection_rate.allow((r.learner, r.reason), now)
        ]
        self.counts["rejections_unlogged"] += len(out.tape) - len(kept)
        out.tape = kept
        persist(self.store, self.core, out, self.clock)
        self.counts["merges"] += len(out.durable)
        for msg in out.messages:
            identity = self.identities.get(msg.learner)
            if identity is not None:
                self._send(identity, msg)

    # -- receiving -------------------------------------------------------------------------

    def handle(self, identity: bytes, frames: Frames, key: bytes | None = None) -> None:
        """One message from ``identity``, authenticated as ``key`` when CURVE is on."""
        if not self._message_rate.allow(identity, self.clock.monotonic()):
            self.counts["rate_limited"] += 1
            return
        self.counts["messages"] += 1
        self.counts["bytes_in"] += sum(memoryview(f.buffer if hasattr(f, "buffer") else f).nbytes for f in frames)
        try:
            msg = decode(frames)
        except WireError as e:
            self._count_bad("malformed", f"malformed message from {identity!r}: {e}")
            return
        now = self.clock.monotonic()
        problem = self._not_allowed(msg, key)
        if problem is not None:
            self._count_bad("impostor", f"{type(msg).__name__} from {identity!r}: {problem}")
            if isinstance(msg, Register):
                self._send(identity, JoinReply(False, problem, self.epoch, 0, self.core.owned))
            return
        if isinstance(msg, Register):
            if not self._join_rate.allow(identity, now):
                self.counts["rate_limited"] += 1
                return
            self._on_register(identity, msg, now)
        elif isinstance(msg, FetchGlobal):
            self._send(identity, self._global_state())
        elif isinstance(msg, StatusRequest):
            self._send(identity, status_reply(self.status()))
        elif isinstance(msg, CORE_MESSAGES + RELAYED):
            claimed = msg.source if isinstance(msg, PeerState) else msg.learner
            if self.identities.get(claimed) != identity:
                # Unknown here (e.g. this syncer restarted): a heartbeat with our epoch makes it re-join.
                self._count_bad(
                    "unknown_sender", f"message from unregistered sender {identity!r} claiming learner {claimed}"
                )
                self._send(identity, SyncerHeartbeat(self.epoch, self.shard))
                return
            if isinstance(msg, RELAYED):
                self._relay(msg, now)
            else:
                self._emit(self.core.handle(msg, now))
        else:
            self._count_bad("malformed", f"unexpected {type(msg).__name__} from {identity!r}")

    def _not_allowed(self, msg: Any, key: bytes | None) -> str | None:
        """With keys, a learner id is bound to its key: a message for learner m must come from
        learner-m's key, and an observer key may only fetch the global model and the status."""
        if self.keys is None:
            return None
        peer = self.keys.allowed.get(key or b"")
        if peer is None:
            return "no allowed key"  # (the handshake already refuses unknown keys)
        if isinstance(msg, (FetchGlobal, StatusRequest)):
            return None
        claimed = msg.source if isinstance(msg, PeerState) else getattr(msg, "learner", None)
        if peer.role != "learner" or peer.learner != claimed:
            who = f"learner {peer.learner}" if peer.role == "learner" else "an observer"
            return f"the key is {who}'s, not learner {claimed}'s"
        return None

    def _count_bad(self, kind: str, text: str) -> None:
        self.counts[kind] += 1
        if kind not in self._warned:  # say it once per kind; the status file keeps counting
            self._warned.add(kind)
            log.warning("%s (dropped; further ones are counted silently)", text)

    def _on_register(self, identity: bytes, msg: Register, now: float) -> None:
        if self.end_stage is not None:  # too late to take part: the learner hears the run is over
            self._send(identity, RunEnd("done", self.end_reason))
            return
        mismatch = first_mismatch(self.spec, msg.params)
        if mismatch is None and msg.layout != self.layout.digest:
            mismatch = (
                f"layout {msg.layout} != {self.layout.digest}: use the same algo.num_fragments, "
                "algo.fragment_strategy and algo.sync_every on learners and syncer"
            )
        if mismatch is not None:
            reason = f"model does not match the syncer's fragment layout: {mismatch}"
            self._send(identity, JoinReply(False, reason, self.epoch, 0, self.core.owned))
            return
        out = self.core.handle(Join(msg.learner, msg.incarnation, msg.base_versions), now)
        if out.refused:  # only a Join is refused, and only the joiner: the id stays with its holder
            r = out.refused[0]
            self._send(identity, JoinReply(False, r.reason, self.epoch, 0, self.core.owned, r.retry_after_s))
        else:
            self.identities[msg.learner] = identity
            reply = JoinReply(True, "", self.epoch, self.core.data_position(msg.learner), self.core.owned)
            self._send(identity, reply)  # before the fragments it announces
        self._emit(out)

    def _relay(self, msg: PeerStateRequest | PeerState, now: float) -> None:
        """Optimizer state for a rejoining learner goes from a live peer through the syncer."""
        if isinstance(msg, PeerStateRequest):
            peers = [m for m in self.core.live(now) if m != msg.learner and m in self.identities]
            if peers:
                self._send(self.identities[peers[0]], msg)
            else:
                self._send(self.identities[msg.learner], PeerState(msg.learner, -1, [], {}))
        else:
            target = self.identities.get(msg.learner)
            if target is not None:
                self._send(target, msg)

    def _global_state(self) -> GlobalState:
        tensors = {}
        for p in self.core.owned:
            for i, v in enumerate(self.core.fragments[p].values):
                tensors[f"{p}.{i}"] = v
        versions = {str(p): self.core.fragments[p].version for p in self.core.owned}
        return GlobalState(versions, self.core.global_tokens, tensors, run_ended=self.end_stage == "done")

    # -- the loop --------------------------------------------------------------------------

    def serve(self, max_seconds: float | None = None) -> None:
        """Run until ``stop()`` (or ``max_seconds``), then flush, persist and close."""
        rt = self.cfg.runtime
        end = None if max_seconds is None else self.clock.monotonic() + max_seconds
        log.info(
            "syncer shard %d/%d: %d fragments, versions %s",
            self.shard,
            self.num_shards,
            len(self.core.owned),
            "restored" if self.restored else "fresh",
        )
        try:
            self._loop(rt, end)
        except StoreFull as e:
            # Nothing unpersisted was sent; on a full disk nothing more can be made durable.
            log.error("%s", e)
            self.sock.close()
            self.store.close()
            raise DDiLoCoError(str(e)) from None
        self.shutdown()

    def _loop(self, rt: RuntimeConfig, end: float | None) -> None:
        while not self.stopping and (end is None or self.clock.monotonic() < end):
            now = self.clock.monotonic()
            # Sleep until a message, the core's next deadline or the next chore: no idle spinning.
            wake_at = min(t for t in (self.core.next_deadline(now), self._next_chore(rt)) if t is not None)
            wait = min(max(0.0, wake_at - now), 0.25)  # 0.25 s: stop() is seen soon enough
            for identity, frames, key in self.sock.recv(wait, limit=1000):  # bounded so chores still run
                self.handle(identity, frames, key)
            self._emit(self.core.poll(self.clock.monotonic()))
            self._advance_end(self.clock.monotonic())
            self._chores(rt)

    def stop(self) -> None:
        """Ask ``serve`` to finish (from a signal handler or another thread)."""
        self.stopping = True

    # -- the run's end -----------------------------------------------------------------------

    def budget_spent(self) -> str | None:
        """Why the run is over (its token or time budget is spent), or None."""
        tokens, limit = self.core.global_tokens, self.cfg.run.tokens
        if tokens >= limit:
            return f"{tokens:,.0f} global tokens merged, the budget is {limit:,} (run.tokens)"
        elapsed, duration = self.run_age(), self.cfg.runtime.duration_s
        if elapsed >= duration:
            return f"{elapsed:,.0f} s since the run started, the budget is {duration:,.0f} s (runtime.duration_s)"
        return None

    def run_age(self) -> float:
        """Seconds since the run started (``run.json``'s started_at), on the monotonic clock."""
        return self._age_at_start + self.clock.monotonic() - self._started

    def end_run(self, reason: str) -> None:
        """End the run now (as if its budget were spent): learners stop, the final sync merges
        their remaining progress, the final model and summary are written, then serve returns."""
        if self.end_stage is None:
            self._begin_end(reason, self.clock.monotonic())

    def _begin_end(self, reason: str, now: float) -> None:
        log.info("the run is over: %s; stopping the learners for the final sync", reason)
        self.end_stage, self.end_reason = "stop", reason
        self._broadcast(RunEnd("stop", reason))
        self._emit(self.core.flush(now, final=True))
        # The learners apply the versions this flush made before the final sync asks them
        # (an answer anchored at an older base would count that progress twice).
        self._end_next = now + max(0.5, 2 * self.cfg.runtime.heartbeat_interval_s)

    def _advance_end(self, now: float) -> None:
        """Move the run's end along: stop -> final sync -> done -> (linger) -> leave serve."""
        rt = self.cfg.runtime
        if self.end_stage is None:
            reason = self.budget_spent()
            if reason is not None:
                self._begin_end(reason, now)
        elif self.end_stage == "stop" and now >= self._end_next:
            self.end_stage = "final"
            self._emit(self.core.final_sync(now))
            # every live learner answers at once; a silent one stops being waited for at its liveness timeout
            self._end_next = now + self.cfg.algo.liveness_timeout_s + 2 * rt.heartbeat_interval_s
        elif self.end_stage == "final" and (not self.core.rounds or now >= self._end_next):
            if self.core.rounds:
                self._emit(self.core.flush(now, final=True))
            self.end_stage = "done"
            self._broadcast(RunEnd("done", self.end_reason))
            self.write_final_model()
            self._run_event("end", self.end_reason)
            log.info("final sync done; final model written to %s", self.run_dir / "final")
            self._end_next = now + rt.end_linger_s
        elif self.end_stage == "done" and now >= self._end_next:
            self.stopping = True

    def _broadcast(self, msg: Any) -> None:
        for identity in self.identities.values():
            self._send(identity, msg)

    def _run_event(self, what: str, reason: str) -> None:
        """Append to metrics/run.jsonl (shard 0 speaks for the run). A failed write is said
        once and does not stop the syncer."""
        if self.shard != 0:
            return
        try:
            append_run_event(self.run_dir, self.run_age(), what, reason)
        except OSError as e:
            log.warning("cannot record %r in %s: %s", what, self.run_dir / "metrics" / "run.jsonl", e)

    def _progress_line(self) -> str:
        versions = [self.core.fragments[p].version for p in self.core.owned]
        elapsed = self.run_age()
        return (
            f"syncer shard {self.shard}: {self.core.global_tokens:,.0f} / {self.cfg.run.tokens:,} global tokens, "
            f"{elapsed:,.0f} / {self.cfg.runtime.duration_s:,.0f} s, {len(self.core.live(self.clock.monotonic()))} "
            f"live learners, versions {min(versions)}..{max(versions)}"
            + (f", ending ({self.end_stage})" if self.end_stage else "")
        )

    def _next_chore(self, rt: RuntimeConfig) -> float:
        return min(
            self._end_next if self.end_stage is not None else float("inf"),
            self._last_heartbeat + rt.heartbeat_interval_s,
            self._last_snapshot + rt.snapshot_interval_s,
            self._last_status + rt.status_interval_s,
            self._last_metrics + rt.metrics_interval_s,
        )

    def _chores(self, rt: RuntimeConfig) -> None:
        mono = self.clock.monotonic()
        if mono - self._last_heartbeat >= rt.heartbeat_interval_s:
            self._last_heartbeat = mono
            for identity in self.identities.values():
                self._send(identity, SyncerHeartbeat(self.epoch, self.shard))
        if mono - self._last_snapshot >= rt.snapshot_interval_s:
            self._last_snapshot = mono
            snapshot(self.store, self.core)
        if mono - self._last_status >= rt.status_interval_s:
            self._last_status = mono
            self.write_status()
        if mono - self._last_metrics >= rt.metrics_interval_s:
            self._last_metrics = mono
            self.write_learner_metrics()
        self._progress.maybe(self._progress_line)

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
            "run_end": self.end_stage,
            "end_reason": self.end_reason,
            **fleet_status(self.core, now, shard=self.shard, epoch=self.epoch, run_time_s=self.run_age()),
        }

    def write_status(self) -> None:
        write_status(self.run_dir / "status" / f"syncer-{self.shard}.json", self.status())

    def write_learner_metrics(self) -> None:
        """Append one record per learner to metrics/learners.jsonl (shard 0 only: every shard
        hears every learner's heartbeats, one copy is enough)."""
        if self.shard == 0:
            records = learner_records(self.core, self.clock.monotonic(), self.run_age())
            self._learner_metrics.append(records)

    def shutdown(self) -> None:
        """Close open rounds, make everything durable, write the final model, close the socket
        and release the run folder; then (shard 0) the final evaluation and the summary.

        Stopped before the run's end (a signal, a requeue), the run is marked interrupted and
        its summary partial; a later start on the folder resumes it."""
        ended = self.end_stage == "done"
        try:
            self._emit(self.core.flush(self.clock.monotonic()))
            snapshot(self.store, self.core)
            self.write_status()
            self.write_learner_metrics()  # the learners' last figures, for the summary
            self.write_final_model()
        finally:
            self.sock.close()
            self.store.close()
        if not ended:
            self._run_event("interrupted", "the syncer was stopped before the run's end")
        if self.shard == 0:
            if ended and self.cfg.runtime.final_eval and self.num_shards == 1 and self.evaluates:
                self._final_eval()
            try:
                write_summary(self.run_dir)
            except OSError as e:
                log.warning("cannot write the summary in %s: %s", self.run_dir, e)

    def _final_eval(self) -> None:
        """Evaluate the final global model once (summary.json's eval loss)."""
        from ddiloco.training.evaluate import evaluate
        from ddiloco.workloads.base import loss_unit

        evals = read_jsonl(self.run_dir / "metrics" / "eval.jsonl")
        if any(e.get("final") for e in evals[-1:]):
            return  # already evaluated (a restarted syncer on a finished run)
        wl = load_workload(self.cfg.workload)
        loss = evaluate(wl, self.model, wl.eval_batches())
        rec = {
            "event": "eval",
            "time": self.run_age(),
            "tokens": 0,
            "merged_tokens": self.core.global_tokens,
            "loss": loss,
            "final": True,
            "unit": loss_unit(wl),
        }
        with open(self.run_dir / "metrics" / "eval.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        log.info("final eval loss %.4f %s", loss, loss_unit(wl))

    def write_final_model(self) -> Path:
        state = self.core.global_state()
        owned_names = {pc.name for p in self.core.owned for pc in self.core.layout.fragments[p]}
        # Through the model, so tied tensors (an LM head sharing the embedding) get the merged values too.
        self.model.load_state_dict({k: v for k, v in state.items() if k in owned_names}, strict=False)
        full = self.model.state_dict()
        name = "model.safetensors" if self.num_shards == 1 else f"model.shard-{self.shard}.safetensors"
        path = self.run_dir / "final" / name
        return save_state_dict({k: v for k, v in full.items() if self.num_shards == 1 or k in owned_names}, path)


def bind_syncer(
    cfg: Config,
    bind: str,
    run_dir: str | Path,
    shard: int = 0,
    num_shards: int = 1,
    keys_dir: str | Path | None = None,
    insecure: bool = False,
    model: nn.Module | None = None,
    embedding_like: Callable[[str], bool] | None = None,
) -> SyncerService:
    """A syncer service on a ZeroMQ socket bound to ``bind`` (what ``ddiloco syncer`` runs).

    Off this machine CURVE is on by default: without ``keys_dir`` the syncer refuses to bind
    anything but loopback unless ``insecure`` is given, and then says so."""
    torch.set_num_threads(1)
    keys = ServerKeys.load(keys_dir) if keys_dir is not None else None
    if keys is None and not is_local(bind):
        if not insecure:
            raise DDiLoCoError(
                f"binding {bind} without keys lets anyone who can reach it join, read and steer the model: make "
                "keys with `ddiloco keys DIR --learners M` and pass --keys DIR, or pass --insecure on a trusted network"
            )
        log.warning("INSECURE: %s accepts any peer without authentication or encryption (--insecure)", bind)
    from_workload = model is None
    if model is None:
        wl = load_workload(cfg.workload)
        model = wl.build_model(cfg.run.seed)
        embedding_like = embedding_like or wl.is_embedding_like
    largest = max(p.numel() for p in model.parameters())
    try:
        sock = ZmqSyncerSocket(bind, max_frame_bytes(largest), keys)
    except Exception as e:  # zmq.ZMQError: one line, not a trace
        raise DDiLoCoError(f"cannot bind the syncer to {bind}: {e} (is the port in use? pass another --bind)") from None
    try:
        service = SyncerService(
            cfg, sock, run_dir, shard, num_shards, keys=keys, model=model, embedding_like=embedding_like
        )
        service.evaluates = from_workload
        return service
    except BaseException:
        sock.close()
        raise
