"""What crosses the link between each learner and the syncer, counted by kind (pure: no I/O).

Both drivers count every message they move with one ``TrafficMeter``: the syncer service the
frame bytes it received and sent, the simulator the modelled wire size of what it delivers.
``classify`` says which category a message is and whether it is *steady-state* traffic (what
a learner pays for every inner step it trains: contributions, merged versions, requests, acks,
heartbeats) or *one-off* (registration, a join or rebase fetch, the optimizer hand-off, the
run's final sync, leaving and the run's end). Observers' requests and answers (the evaluator,
``ddiloco status``, a live export) are nobody's learner traffic: counted as ``observer`` on an
unattributed connection and reported apart (``traffic_figures``'s ``observer_*``).

The figure a run is judged by is steady-state bytes per learner per inner step, up
(learner -> syncer) and down, against data-parallel training's: an fp32 ring all-reduce of the
gradients every step (``dp_ring_bytes``; the bandwidth planner in ``ddiloco.goodput`` uses the
same function).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ddiloco.core.counters import IncarnationCounters
from ddiloco.core.messages import Ack, Contribution, FragmentRequest, FragmentUpdate, Heartbeat, Join, Leave
from ddiloco.protocol.messages import (
    FetchGlobal,
    GlobalState,
    JoinReply,
    PeerState,
    PeerStateRequest,
    Register,
    RunEnd,
    RunSettings,
    SettingsRequest,
    StatusReply,
    StatusRequest,
    SyncerHeartbeat,
)

FORMAT = 1
"""Version of ``TrafficMeter.to_dict``'s layout (metrics/traffic*.json)."""

Direction = Literal["up", "down"]
DIRECTIONS: tuple[Direction, ...] = ("up", "down")
"""up: learner -> syncer; down: syncer -> learner."""

STEADY: tuple[str, ...] = ("contribution", "version", "request", "ack", "heartbeat")
"""Categories a learner pays for every inner step it trains."""
ONE_OFF: tuple[str, ...] = (
    "registration", "rejoin", "handoff", "final_sync", "leave", "run_end", "observer", "malformed", "other",
)  # fmt: skip
"""Categories paid once per process, per rejoin or per run (or by nobody's learner)."""

OBSERVER = "observer"
"""The category of observers' requests and answers (``FetchGlobal``/``GlobalState``,
``StatusRequest``/``StatusReply``): nobody's learner traffic, reported apart."""
UNATTRIBUTED = "unattributed"
"""The bucket of messages no learner can be named for (an unbound connection, an observer)."""

DP_BYTES_PER_VALUE = 4.0
"""Data-parallel's baseline sends fp32 gradients."""

HEADER_BYTES: dict[str, int] = {
    "contribution": 230, "version": 200, "request": 100, "ack": 115, "heartbeat": 205, "syncer_heartbeat": 110,
}  # fmt: skip
"""Header bytes of a steady-state message on the wire (schema 4's JSON header with realistic
field values, measured with ``service/base/wire.py: encode``; tests/test_traffic.py keeps them within
reach of it), not counting the tensor list."""
TENSOR_SPEC_BYTES = 32
"""Header bytes per tensor a message carries (its name, dtype and shape in the header)."""


@dataclass(frozen=True)
class Kind:
    """What a message is, for counting."""

    category: str
    """One of ``STEADY`` or ``ONE_OFF``."""
    steady: bool
    """Whether it is steady-state traffic (every inner step pays for it)."""


def classify(msg: Any, final: bool = False) -> Kind:
    """The category of ``msg`` (a core or protocol message; ``None``: one that could not be
    decoded). ``final``: the syncer has announced the run's end, so contributions, versions,
    requests and acks are the final sync (one-off), not steady state."""
    steady = _STEADY_TYPES.get(type(msg))
    if steady is not None:
        if isinstance(msg, FragmentUpdate) and msg.reason != "merged":
            return Kind("rejoin", False)  # a join fetch or a stale learner's rebase
        if final and steady != "heartbeat":
            return Kind("final_sync", False)
        return Kind(steady, True)
    if msg is None:
        return Kind("malformed", False)
    return Kind(_ONE_OFF_TYPES.get(type(msg), "other"), False)


_STEADY_TYPES: dict[type, str] = {
    Contribution: "contribution",
    FragmentUpdate: "version",
    FragmentRequest: "request",
    Ack: "ack",
    Heartbeat: "heartbeat",
    SyncerHeartbeat: "heartbeat",
}
_ONE_OFF_TYPES: dict[type, str] = {
    Register: "registration",
    Join: "registration",
    JoinReply: "registration",
    SettingsRequest: "registration",
    RunSettings: "registration",
    PeerStateRequest: "handoff",
    PeerState: "handoff",
    Leave: "leave",
    RunEnd: "run_end",
    FetchGlobal: OBSERVER,
    GlobalState: OBSERVER,
    StatusRequest: OBSERVER,
    StatusReply: OBSERVER,
}


def payload_nbytes(msg: Any) -> int:
    """Bytes of the tensors ``msg`` puts on the wire: its encoded payloads when it has any
    (``encoded``: a compressed contribution or update sends those instead of its values), else
    its values (or a tensor dict's tensors); 0 for a message without tensors."""
    encoded = getattr(msg, "encoded", None)
    if encoded:
        return sum(int(e.nbytes) for e in encoded)
    values = getattr(msg, "values", None)
    tensors: Iterable[Any] = values if isinstance(values, list) else ()
    if isinstance(msg, (PeerState, GlobalState)):
        tensors = msg.tensors.values()
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def dp_ring_bytes(params: float, learners: int, bytes_per_value: float = DP_BYTES_PER_VALUE) -> float:
    """Bytes each of ``learners`` sends (and receives) per step in data-parallel training of a
    model of ``params`` values: a ring all-reduce of the gradients, 2 (M - 1) / M of them, fp32
    by default. 0 for a single learner (nothing to reduce)."""
    if learners < 1 or params < 0:
        raise ValueError(f"dp_ring_bytes: learners = {learners} must be >= 1 and params = {params} >= 0")
    return 2.0 * (learners - 1) / learners * params * bytes_per_value


def ratio(baseline: float, measured: float) -> float | None:
    """How many times fewer bytes than ``baseline`` were ``measured`` (None when none were)."""
    return baseline / measured if measured > 0 else None


class TrafficMeter:
    """Bytes and messages per learner, direction and category, and the learners' inner steps
    (from their heartbeats, cumulative per incarnation; ``core.counters``'s restart rule)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, Direction, str], list[int]] = {}
        """(learner id as a string or UNATTRIBUTED, direction, category) -> [bytes, messages]."""
        self._steps = IncarnationCounters()

    def count(self, msg: Any, nbytes: int, direction: Direction, learner: int | None, final: bool = False) -> Kind:
        """One message of ``nbytes`` on the wire, to or from ``learner`` (None: unattributed);
        a heartbeat going up also tells the learner's steps. Returns its kind."""
        kind = classify(msg, final)
        self.add(learner, direction, kind.category, nbytes)
        if direction == "up" and learner is not None and isinstance(msg, Heartbeat) and msg.learner == learner:
            self.observe_steps(learner, msg.incarnation, msg.step)
        return kind

    def add(self, learner: int | None, direction: Direction, category: str, nbytes: int, messages: int = 1) -> None:
        key = (UNATTRIBUTED if learner is None else str(learner), direction, category)
        cell = self._counts.setdefault(key, [0, 0])
        cell[0] += max(0, int(nbytes))
        cell[1] += messages

    def observe_steps(self, learner: int, incarnation: int, steps: int) -> None:
        """``learner``'s process ``incarnation`` has taken ``steps`` inner steps so far."""
        self._steps.add(learner, incarnation, steps, 0.0)

    def steps(self) -> dict[int, int]:
        """Inner steps per learner, over its incarnations (as reported)."""
        return {m: int(v) for m, v in self._steps.per_learner().items()}

    def bytes(self, learner: int | None = None, direction: Direction | None = None, steady: bool | None = None) -> int:
        """Bytes counted, optionally of one learner, one direction, steady or one-off only."""
        who = None if learner is None else str(learner)
        return sum(
            cell[0]
            for (m, d, c), cell in self._counts.items()
            if (who is None or m == who)
            and (direction is None or d == direction)
            and (steady is None or (c in STEADY) == steady)
        )

    def per_step(self, steps: int, learner: int | None = None) -> tuple[float, float]:
        """Steady-state bytes (up, down) per inner step over ``steps`` inner steps: of one
        learner, or of every learner (then ``steps`` is the fleet's total: the mean per learner
        per step). (0, 0) for no steps."""
        if steps <= 0:
            return 0.0, 0.0
        return tuple(self.bytes(learner, d, steady=True) / steps for d in DIRECTIONS)  # type: ignore[return-value]

    def to_dict(self, params: int | None = None, learners: int | None = None) -> dict[str, Any]:
        """JSON: per learner its steps and, per direction, each category's bytes and messages;
        ``params`` (N, the synced values) and ``learners`` (M) for the data-parallel baseline."""
        steps = self.steps()
        out: dict[str, dict[str, Any]] = {}
        for (m, d, c), (b, n) in sorted(self._counts.items()):
            entry = out.setdefault(m, {"steps": 0, "up": {}, "down": {}})
            entry[d][c] = {"bytes": b, "messages": n}
        for learner, n_steps in steps.items():
            out.setdefault(str(learner), {"steps": 0, "up": {}, "down": {}})["steps"] = n_steps
        return {"format": FORMAT, "params": params, "learners": learners, "by_learner": out}


def merge_traffic(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One traffic dict from several (one per syncer shard): bytes and messages add up; a
    learner's steps are the largest any part saw (every shard hears its heartbeats); params and
    learners from the first part that has them. Malformed entries are skipped (they come from
    files)."""
    merged: dict[str, dict[str, Any]] = {}
    params: Any = None
    learners: Any = None
    for part in parts:
        params = params if params is not None else _count(part.get("params"))
        learners = learners if learners is not None else _count(part.get("learners"))
        by = part.get("by_learner")
        for m, entry in by.items() if isinstance(by, Mapping) else ():
            if not isinstance(entry, Mapping):
                continue
            mine = merged.setdefault(str(m), {"steps": 0, "up": {}, "down": {}})
            mine["steps"] = max(mine["steps"], _count(entry.get("steps")) or 0)
            for d in DIRECTIONS:
                cats = entry.get(d)
                for c, cell in cats.items() if isinstance(cats, Mapping) else ():
                    if not isinstance(cell, Mapping):
                        continue
                    have = mine[d].setdefault(str(c), {"bytes": 0, "messages": 0})
                    have["bytes"] += _count(cell.get("bytes")) or 0
                    have["messages"] += _count(cell.get("messages")) or 0
    return {"format": FORMAT, "params": params, "learners": learners, "by_learner": dict(sorted(merged.items()))}


def traffic_figures(traffic: Mapping[str, Any]) -> dict[str, Any]:
    """The figures a report shows, from a traffic dict (``to_dict`` or ``merge_traffic``):
    per learner and for the fleet, steady-state bytes per inner step up and down, one-off bytes
    up and down, and the ratio of data-parallel's fp32 ring all-reduce bytes per learner per
    step to them (None where not known: no steps, no bytes, or no params or learners given).
    Observers' bytes (the evaluator, ``ddiloco status``, a live export) are apart: up (to the
    syncer) and down in ``observer_up_bytes`` / ``observer_down_bytes``, and ``observer_share``,
    their sum over the learners' steady-state bytes both ways (None: no steady bytes)."""
    by = traffic.get("by_learner")
    by = by if isinstance(by, Mapping) else {}
    params, m_count = _count(traffic.get("params")), _count(traffic.get("learners"))
    dp = dp_ring_bytes(params, m_count) if params is not None and m_count else None
    learners: dict[str, dict[str, Any]] = {}
    total_steps = 0
    totals = {"up": 0, "down": 0, "one_off_up": 0, "one_off_down": 0, "observer_up": 0, "observer_down": 0}
    one_off_kinds: dict[str, dict[str, int]] = {}  # category -> direction -> bytes, every learner
    for m, entry in by.items():
        if not isinstance(entry, Mapping):
            continue
        steps = _count(entry.get("steps")) or 0
        row: dict[str, Any] = {"steps": steps}
        for d in DIRECTIONS:
            raw = entry.get(d)
            cells = (
                {k: _count(c.get("bytes")) or 0 for k, c in raw.items() if isinstance(c, Mapping)}
                if isinstance(raw, Mapping)
                else {}
            )
            steady = sum(b for k, b in cells.items() if k in STEADY)
            once = sum(b for k, b in cells.items() if k not in STEADY and k != OBSERVER)
            for k, b in cells.items():
                if k not in STEADY and k != OBSERVER and b:
                    kind = one_off_kinds.setdefault(k, {"up": 0, "down": 0})
                    kind[d] += b
            totals[f"observer_{d}"] += cells.get(OBSERVER, 0)
            row[f"{d}_bytes"] = steady
            row[f"one_off_{d}_bytes"] = once
            row[f"{d}_bytes_per_step"] = steady / steps if steps else None
            totals[d] += steady if m != UNATTRIBUTED else 0
            totals[f"one_off_{d}"] += once
        if m != UNATTRIBUTED:
            total_steps += steps
        learners[str(m)] = row
    steady_both, observed = totals["up"] + totals["down"], totals["observer_up"] + totals["observer_down"]
    up = totals["up"] / total_steps if total_steps else None
    down = totals["down"] / total_steps if total_steps else None
    return {
        "params": params,
        "learners": m_count,
        "steps": total_steps,
        "up_bytes_per_step": up,
        "down_bytes_per_step": down,
        "one_off_up_bytes": totals["one_off_up"],
        "one_off_down_bytes": totals["one_off_down"],
        "one_off_by_kind": {k: one_off_kinds[k] for k in ONE_OFF if k in one_off_kinds},
        "observer_up_bytes": totals["observer_up"],
        "observer_down_bytes": totals["observer_down"],
        "observer_share": observed / steady_both if steady_both else None,
        "dp_bytes_per_step": dp,
        "dp_ratio_up": ratio(dp, up) if dp is not None and up is not None else None,
        "dp_ratio_down": ratio(dp, down) if dp is not None and down is not None else None,
        "by_learner": learners,
    }


def _count(value: Any) -> int | None:
    """A non-negative whole number from a file, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 2**63:
        return None
    return int(value)
