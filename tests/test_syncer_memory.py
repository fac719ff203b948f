"""The syncer process's memory beyond the core's ``held_bytes`` (issue 32 item 5, the syncer side):
no transient copy of the whole model where one fragment's will do, and what remains shown in the
status ``memory``."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import torch
from test_store_bounds import LAYOUT, META, record

from ddiloco.core.syncer import FragmentRecord
from ddiloco.service.syncer.store import SyncerStore

torch.set_num_threads(1)


def test_a_snapshot_makes_each_record_after_the_one_before_is_let_go(tmp_path):
    """A record copies its fragment's momentum: a snapshot of P fragments reads them one at a
    time (each let go before the next is made), not P copies at once."""
    store = SyncerStore(tmp_path, fsync=False, log_bound=2.0)
    store.restore(LAYOUT, list(range(4)))
    for p in range(4):
        store.append(record(p, 1), META)
    alive: list[weakref.ref[torch.Tensor]] = []

    def records() -> Iterator[FragmentRecord]:
        for p in range(4):
            gc.collect()
            assert all(r() is None for r in alive), f"fragment {p - 1}'s record is still held"
            rec = record(p, 1 + (p == 3))  # (the last one newer than its log: appended first)
            alive.append(weakref.ref(rec.momentum[0]))
            yield rec
            del rec

    store.snapshot(records(), META)
    assert len(alive) == 4
    assert store.restore(LAYOUT, list(range(4))) is not None
