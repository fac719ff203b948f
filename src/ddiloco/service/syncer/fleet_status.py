"""The fleet view of one syncer shard, built in one place from its core's state.

``fleet_status`` is what ``ddiloco status ADDR`` receives (``StatusReply``) and what the syncer's
status file RUN_DIR/status/syncer-K.json holds, so both show the same figures; ``learner_records``
are the lines of RUN_DIR/metrics/learners.jsonl (format: docs/operations.md). Everything here
reads the session's read-only view (``Syncer.view``, the fleet book) and is handed the time.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from ddiloco.core.counters import IncarnationCounters
from ddiloco.core.syncer import SyncerView
from ddiloco.protocol.fleet import Progress
from ddiloco.protocol.messages import StatusReply
from ddiloco.protocol.syncer_session import SyncerSession
from ddiloco.protocol.traffic import traffic_figures
from ddiloco.report.tape import read_jsonl
from ddiloco.service.base.wire import encode

log = logging.getLogger(__name__)

MAX_LISTED = 4096
"""Most learners (and fragments) a status lists; ``learners_total``/``fragments_total`` count all."""


def _age(now: float, then: float) -> float | None:
    """Seconds since ``then`` (None when never: -inf)."""
    return max(0.0, now - then) if math.isfinite(then) else None


def _behind(view: SyncerView, held: tuple[tuple[int, int], ...]) -> int | None:
    """Versions it lacks, summed over this shard's fragments it is known to hold (None: unknown)."""
    if not held:
        return None
    current = {f.fragment: f.version for f in view.fragments}
    return sum(max(0, current[p] - v) for p, v in held if p in current)


def fleet_status(session: SyncerSession, now: float, *, shard: int, run_time_s: float,
                 max_listed: int = MAX_LISTED, traffic: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The shard's fleet view at session time ``now`` (JSON values only, bounded by ``max_listed``).

    ``learners``: per learner id (lowest ids first) its state, the progress its heartbeats
    report, its pace (steps/s, from the step-time EMA), the age of its last accepted
    contribution and how many versions of this shard's fragments it lacks. ``fragments``: per
    owned fragment its version, the age of that version, how many learners its last merge
    took (with a positive weight) and that round's grace window. ``traffic``: the shard's
    traffic meter (``TrafficMeter.to_dict``): each learner gets its steady-state bytes per inner
    step up and down on this shard's link, and ``traffic`` the fleet's with the ratio to
    data-parallel's fp32 ring all-reduce (``protocol.traffic.traffic_figures``)."""
    view = session.view(now, max_listed)
    figures = traffic_figures(traffic) if traffic is not None else None
    per_learner = figures.pop("by_learner") if figures is not None else {}
    learners = []
    for lv in view.learners:
        pr = session.fleet.progress.get(lv.learner) or Progress(lv.incarnation)
        learners.append(
            {
                "learner": lv.learner,
                "state": lv.state,
                "incarnation": lv.incarnation,
                "step": pr.step,
                "tokens": pr.tokens,
                "steps_per_s": 1.0 / lv.step_time_s if lv.step_time_s else None,
                "loss": pr.loss,
                "busy_s": pr.busy_s,
                "bytes_sent": pr.bytes_sent,
                "heard_age_s": _age(now, lv.last_heard),
                "contribution_age_s": _age(now, lv.last_contribution_at),
                "behind": _behind(view, lv.held),
                "up_bytes_per_step": per_learner.get(str(lv.learner), {}).get("up_bytes_per_step"),
                "down_bytes_per_step": per_learner.get(str(lv.learner), {}).get("down_bytes_per_step"),
            }
        )
    fragments = [
        {
            "fragment": f.fragment,
            "version": f.version,
            "merge_age_s": _age(now, f.made_at) if f.version > 0 else None,
            "merged": f.merged,
            "grace_s": f.grace_s,
            "tokens_merged": f.tokens_merged,
            "open": f.open,
        }
        for f in view.fragments
    ]
    return {
        "shard": shard,
        "epoch": session.epoch,
        "run_time_s": run_time_s,
        "merged_tokens": view.merged_tokens,
        "processed_tokens": session.processed_tokens(),
        "versions": {str(f.fragment): f.version for f in view.fragments},
        "live": list(view.live),
        "learners_total": view.learners_total,
        "fragments_total": len(session.core.owned),
        "learners": learners,
        "fragments": fragments,
        **({"traffic": figures} if figures is not None else {}),
    }


def learner_records(session: SyncerSession, now: float, time_s: float) -> list[dict[str, Any]]:
    """One metrics/learners.jsonl record per known learner (``time_s``: seconds since the run
    started; the other figures are cumulative over the learner's current incarnation)."""
    out = []
    for lv in session.view(now).learners:
        pr = session.fleet.progress.get(lv.learner)
        # Not heard since it (re)joined this syncer: zeros would read as a restart of its counters.
        if pr is None or pr.incarnation != lv.incarnation or not (pr.step or pr.tokens or pr.busy_s):
            continue
        out.append(
            {
                "event": "learner",
                "time": time_s,
                "learner": lv.learner,
                "incarnation": lv.incarnation,
                "state": lv.state,
                "steps": pr.step,
                "tokens": pr.tokens,
                "busy_s": pr.busy_s,
                "loss": pr.loss,
                "bytes_sent": pr.bytes_sent,
            }
        )
    return out


class LearnerMetrics:
    """Appends records to metrics/learners.jsonl. A courtesy to readers like the status file:
    a failed write logs one warning and the syncer goes on."""

    def __init__(self, path: Path, read_back: bool = True) -> None:
        self.path = path
        self._warned = False
        # the learners' busy seconds over every incarnation, by the summary's rule (core.counters),
        # from what the folder holds (``read_back``: a restarted shard 0) and then what it appends
        self.busy = IncarnationCounters()
        for r in read_jsonl(path) if read_back else ():
            self.busy.add(r.get("learner"), r.get("incarnation"), r.get("busy_s"), r.get("time"))

    def goodput(self, num_learners: int, run_time_s: float) -> float | None:
        """Learner time in inner steps over allocated learner time so far (M x the run's age, M the
        larger of ``run.num_learners`` and the learners seen), as the summary counts a hand-started run."""
        m = max(num_learners, len(self.busy.per_learner()))
        return self.busy.total() / (m * run_time_s) if run_time_s > 0 and m > 0 else None

    def goodput_figures(self, num_learners: int, run_time_s: float) -> dict[str, Any]:
        """The goodput and what it is made of: learner seconds in inner steps (``busy_s``) over
        learner seconds allocated (M x the run's age; what is not busy is the goodput's loss)."""
        m = max(num_learners, len(self.busy.per_learner()))
        return {
            "goodput": self.goodput(num_learners, run_time_s),
            "learner_busy_s": self.busy.total(),
            "learner_allocated_s": m * run_time_s,
        }

    def append(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            self.busy.add(r.get("learner"), r.get("incarnation"), r.get("busy_s"), r.get("time"))
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
