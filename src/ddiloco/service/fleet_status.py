"""The fleet view of one syncer shard, built in one place from its core's state.

``fleet_status`` is what ``ddiloco status ADDR`` receives (``StatusReply``) and what the syncer's
status file RUN_DIR/status/syncer-K.json holds, so both show the same figures; ``learner_records``
are the lines of RUN_DIR/metrics/learners.jsonl (format: docs/operations.md). Everything here
reads the core and is handed the time: no clock is read except by ``run_t0``'s fallback.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from ddiloco.core.syncer import LearnerInfo, Syncer
from ddiloco.protocol.messages import StatusReply
from ddiloco.service.wire import encode

log = logging.getLogger(__name__)

MAX_LISTED = 4096
"""Most learners (and fragments) a status lists; ``learners_total``/``fragments_total`` count all."""


def run_t0(run_dir: str | Path, default: float | None = None) -> float:
    """When the run started (a Unix time): run.json's ``started_at`` if it has one, else
    ``default`` (the caller's own start), else now. Every ``time`` in metrics/ counts from it."""
    try:
        started = json.loads((Path(run_dir) / "run.json").read_text()).get("started_at")
    except (OSError, ValueError, AttributeError):
        started = None
    if isinstance(started, (int, float)) and not isinstance(started, bool) and math.isfinite(started):
        return float(started)
    return default if default is not None else time.time()


def _age(now: float, then: float) -> float | None:
    """Seconds since ``then`` (None when never: -inf)."""
    return max(0.0, now - then) if math.isfinite(then) else None


def learner_state(info: LearnerInfo, live: bool) -> str:
    """``up`` (heard within the liveness timeout), ``left`` (said goodbye) or ``down``."""
    return "up" if live else "left" if info.left else "down"


def _behind(core: Syncer, info: LearnerInfo) -> int | None:
    """Versions it lacks, summed over this shard's fragments it is known to hold (None: unknown)."""
    known = [(p, v) for p, v in info.held.items() if p in core.owned]
    if not known:
        return None
    return sum(max(0, core.fragments[p].version - v) for p, v in known)


def fleet_status(
    core: Syncer, now: float, *, shard: int, epoch: int, run_time_s: float, max_listed: int = MAX_LISTED
) -> dict[str, Any]:
    """The shard's fleet view at core time ``now`` (JSON values only, bounded by ``max_listed``).

    ``learners``: per learner id (lowest ids first) its state, the progress its heartbeats
    report, its pace (steps/s, from the step-time EMA), the age of its last accepted
    contribution and how many versions of this shard's fragments it lacks. ``fragments``: per
    owned fragment its version, the age of that version, how many learners its last merge
    took (with a positive weight) and that round's grace window."""
    live = set(core.live(now))
    learners = []
    for m in sorted(core.learners)[:max_listed]:
        info = core.learners[m]
        step_time = info.step_time.value
        learners.append(
            {
                "learner": m,
                "state": learner_state(info, m in live),
                "incarnation": info.incarnation,
                "step": info.step,
                "tokens": info.tokens,
                "steps_per_s": 1.0 / step_time if step_time else None,
                "loss": info.loss,
                "busy_s": info.busy_s,
                "bytes_sent": info.bytes_sent,
                "heard_age_s": _age(now, info.last_heard),
                "contribution_age_s": _age(now, info.last_contribution_at),
                "behind": _behind(core, info),
            }
        )
    fragments = []
    for p in core.owned[:max_listed]:
        frag = core.fragments[p]
        fragments.append(
            {
                "fragment": p,
                "version": frag.version,
                "merge_age_s": _age(now, frag.made_at(frag.version)) if frag.version > 0 else None,
                "merged": frag.last_merged,
                "grace_s": frag.last_grace_s,
                "tokens_merged": frag.tokens_merged,
                "open": p in core.rounds,
            }
        )
    return {
        "shard": shard,
        "epoch": epoch,
        "run_time_s": run_time_s,
        "global_tokens": core.global_tokens,
        "versions": {str(p): core.fragments[p].version for p in core.owned},
        "live": sorted(live),
        "learners_total": len(core.learners),
        "fragments_total": len(core.owned),
        "learners": learners,
        "fragments": fragments,
    }


def learner_records(core: Syncer, now: float, time_s: float) -> list[dict[str, Any]]:
    """One metrics/learners.jsonl record per known learner (``time_s``: seconds since the run
    started; the other figures are cumulative over the learner's current incarnation)."""
    live = set(core.live(now))
    return [
        {
            "event": "learner",
            "time": time_s,
            "learner": m,
            "incarnation": info.incarnation,
            "state": learner_state(info, m in live),
            "steps": info.step,
            "tokens": info.tokens,
            "busy_s": info.busy_s,
            "loss": info.loss,
            "bytes_sent": info.bytes_sent,
        }
        for m, info in sorted(core.learners.items())
        # Not heard since it (re)joined this syncer: zeros would read as a restart of its counters.
        if info.step or info.tokens or info.busy_s
    ]


class LearnerMetrics:
    """Appends records to metrics/learners.jsonl. A courtesy to readers like the status file:
    a failed write logs one warning and the syncer goes on."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._warned = False

    def append(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("cannot append to %s (%s); going on without the learner metrics", self.path, e)


def status_reply(status: dict[str, Any]) -> StatusReply:
    """``status`` as a StatusReply that fits the wire: while its header would be too large, the
    longer of the learner and fragment lists is halved (the ``*_total`` counts stay whole)."""
    status = dict(status)
    while True:
        reply = StatusReply(status)
        try:
            encode(reply)
            return reply
        except ValueError:
            learners, fragments = status.get("learners", []), status.get("fragments", [])
            if not learners and not fragments:
                raise
            key = "learners" if len(learners) >= len(fragments) else "fragments"
            status[key] = status[key][: len(status[key]) // 2]
