"""What must hold after any run, whatever failed during it: one check for the fault-harness
tests, the soak, the chaos runs and every run folder's summary.

- no contribution is merged twice (its identity: learner, incarnation, fragment, seq);
- each fragment's versions increase: a round that merged makes a newer version than any before,
  one that did not leaves it (a restarted syncer continues from what it made durable);
- no served version is lost: a restarted syncer comes back with at least every version it had
  sent to anyone before it went down;
- a restarted learner merges again: every learner process that ran long enough before the run's
  end had some of its work merged;
- a run that ended did so with a final sync: every fragment has a final round.

The tape is read as the run folder holds it (dicts; a malformed record is skipped, not
trusted). The other evidence is what the driver saw: served versions, restores, incarnations.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddiloco.core.tape import MergedEntry, RoundRecord


@dataclass(frozen=True)
class Violation:
    """One invariant that did not hold."""

    kind: str
    """Which: merged_twice, version_order, served_version_lost, never_merged_again, no_final_sync."""
    detail: str
    """What, for a human."""


@dataclass(frozen=True)
class Restore:
    """A syncer shard came back at ``time`` with ``versions``; before it, ``served`` had been sent."""

    time: float
    """When it came back."""
    versions: Mapping[int, int]
    """The version of each fragment it restored."""
    served: Mapping[int, int]
    """The newest version of each fragment it had sent to anyone before it went down."""


@dataclass(frozen=True)
class Incarnation:
    """One learner process: when it started and (if it did) died."""

    learner: int
    """Learner id."""
    incarnation: int
    """Its incarnation."""
    start: float
    """When it started."""
    end: float | None = None
    """When it died (None: it ran to the run's end)."""


def _rounds(tape: Iterable[Any]) -> list[RoundRecord]:
    return [r for r in (RoundRecord.from_json(x) for x in tape if isinstance(x, dict)) if r is not None]


def check_run(
    tape: Iterable[Any],
    *,
    restores: Sequence[Restore] = (),
    incarnations: Sequence[Incarnation] = (),
    min_life_s: float = float("inf"),
    run_end: float | None = None,
    fragments: Sequence[int] = (),
) -> list[Violation]:
    """The invariants' violations (empty: all hold). ``min_life_s``: how long a learner process
    must have run before ``run_end`` (or its death) to be expected to merge; ``run_end``: when
    the run ended (None: it did not end, so no final sync is expected); ``fragments``: the
    fragments a final sync must cover."""
    rounds = sorted(_rounds(tape), key=lambda r: (r.closed_at, r.round_id))
    out: list[Violation] = []
    seen: set[tuple[int, int, int, int]] = set()
    last: dict[int, int] = {}
    merged_by: dict[tuple[int, int], float] = {}
    for r in rounds:
        for e in r.merged:
            key = (e.learner, e.incarnation, r.fragment, e.seq)
            if key in seen:
                out.append(Violation("merged_twice", f"contribution {key} merged again in round {r.round_id}"))
            seen.add(key)
            if e.was_merged:
                merged_by.setdefault((e.learner, e.incarnation), r.closed_at)
        prev = last.get(r.fragment)
        made = any(e.was_merged for e in r.merged)
        if prev is not None and (r.version < prev or (made and r.version <= prev)):
            out.append(
                Violation("version_order", f"fragment {r.fragment}: round {r.round_id} has version {r.version} "
                          f"after {prev}")
            )  # fmt: skip
        last[r.fragment] = r.version if prev is None else max(prev, r.version)
    for rs in restores:
        for p, v in rs.served.items():
            if rs.versions.get(p, 0) < v:
                out.append(
                    Violation("served_version_lost", f"fragment {p}: restored at {rs.versions.get(p, 0)} at "
                              f"t={rs.time:.2f} after version {v} was served")
                )  # fmt: skip
    end = run_end if run_end is not None else max((r.closed_at for r in rounds), default=0.0)
    for inc in incarnations:
        until = inc.end if inc.end is not None else end
        if until - inc.start >= min_life_s and (inc.learner, inc.incarnation) not in merged_by:
            out.append(
                Violation("never_merged_again", f"learner {inc.learner} incarnation {inc.incarnation} ran "
                          f"{until - inc.start:.1f} s from t={inc.start:.2f} and none of its work was merged")
            )  # fmt: skip
    if run_end is not None:
        finals = {r.fragment for r in rounds if r.close_reason == "final"}
        missing = sorted(set(fragments) - finals)
        if missing:
            out.append(Violation("no_final_sync", f"the run ended without a final round of fragments {missing}"))
    return out


def merged_entries(tape: Iterable[Any]) -> list[tuple[RoundRecord, MergedEntry]]:
    """Every entry that took part in a merge, with its round (tape order)."""
    return [(r, e) for r in _rounds(tape) for e in r.merged if e.was_merged]
