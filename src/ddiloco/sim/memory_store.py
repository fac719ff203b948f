"""An in-memory syncer store with the real store's semantics, for restarts in virtual time.

``service/syncer/store/`` keeps, per fragment, the newest record made durable and the meta state of
the newest record or snapshot; a restart gets exactly that back. This keeps the same, in memory:
what was made durable is what comes back (copies, so the restarted core shares nothing with the
one that was "killed"), and nothing that was not.
"""

from __future__ import annotations

import copy
from typing import Any

from ddiloco.core.syncer import FragmentRecord


def _copy(rec: FragmentRecord) -> FragmentRecord:
    momentum = None if rec.momentum is None else [m.clone() for m in rec.momentum]
    return FragmentRecord(rec.fragment, rec.version, rec.tokens_merged, [v.clone() for v in rec.values], momentum)


class MemoryStore:
    """Durable fragment records and meta state of one syncer shard, in memory."""

    def __init__(self) -> None:
        self.records: dict[int, FragmentRecord] = {}
        self.meta: dict[str, Any] | None = None
        self.appends = 0
        """Records made durable so far (every merged version, in order)."""

    def append(self, rec: FragmentRecord, meta: dict[str, Any]) -> None:
        """Make ``rec`` (a new version of its fragment) durable, with the meta state as of it."""
        self.records[rec.fragment] = _copy(rec)
        self.meta = copy.deepcopy(meta)
        self.appends += 1

    def snapshot(self, records: list[FragmentRecord], meta: dict[str, Any]) -> None:
        """Make every record and the meta state durable at once."""
        for rec in records:
            self.records[rec.fragment] = _copy(rec)
        self.meta = copy.deepcopy(meta)

    def restore(self) -> tuple[dict[int, FragmentRecord], dict[str, Any] | None]:
        """What a restarted shard gets back: copies of the durable records and meta state."""
        return {p: _copy(r) for p, r in self.records.items()}, copy.deepcopy(self.meta)

    def durable_versions(self) -> dict[int, int]:
        """The durable version of each fragment."""
        return {p: r.version for p, r in self.records.items()}
