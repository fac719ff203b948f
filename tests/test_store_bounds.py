"""The syncer's state folder stays bounded whatever the merge rate: logs rotate on size (no byte
copied), snapshots hold no tensors, and the store counts its bytes on disk and written."""

import math
import random
from pathlib import Path

import pytest
import torch
from test_store_hardening import full_on

from ddiloco.config import load_config
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.syncer import FragmentRecord
from ddiloco.errors import ConfigError
from ddiloco.service.syncer import store as persist
from ddiloco.service.syncer.store import StoreFull, SyncerStore

torch.set_num_threads(1)

# 4 fragments of about 16K fp32 parameters each: a model of 256 KiB (header bytes are small beside it)
SPECS = [TensorSpec(f"w{i}", (128, 128)) for i in range(4)]
LAYOUT = balanced_layout(SPECS, 4)
MODEL_BYTES = sum(4 * math.prod(s.shape) for s in SPECS)
META = {"clock": 1, "learners": {str(m): {"trust": 1.0} for m in range(8)}}


def record(p: int, version: int) -> FragmentRecord:
    values = [torch.full(pc.shape, float(version)) for pc in LAYOUT.fragments[p]]
    return FragmentRecord(p, version, version, values, [v * 0.5 for v in values])


def run_merges(tmp_path: Path, log_bound: float, merges: int = 400, snapshot_every: int = 100) -> SyncerStore:
    """A high merge rate: ``merges`` versions of random fragments, a snapshot now and then."""
    store = SyncerStore(tmp_path, fsync=False, log_bound=log_bound)
    store.restore(LAYOUT, list(range(4)))
    rng = random.Random(0)
    version = [0] * 4
    for i in range(1, merges + 1):
        p = rng.randrange(4)
        version[p] += 1
        store.append(record(p, version[p]), META)
        store.append_tape([{"event": "round", "fragment": p, "version": version[p]}])
        if i % snapshot_every == 0:
            store.snapshot([record(q, version[q]) for q in range(4)], META)
    return store


@pytest.mark.parametrize("log_bound", [1.0, 2.0, 3.0])
def test_the_folder_stays_within_its_bound_and_each_merge_writes_one_record(tmp_path, log_bound):
    store = run_merges(tmp_path, log_bound)
    state = 2 * MODEL_BYTES  # values + outer momentum
    one = state // 4  # a fragment's tensors
    headers = 4096  # per record (JSON header + frame) and the small files, generously
    # At most log_bound records per fragment, one more in flight: a rotation writes the new log
    # before it drops the old one.
    assert store.peak_disk_bytes <= int(log_bound) * state + one + headers * (4 * int(log_bound) + 1) + 65536
    if log_bound <= 2:
        assert store.peak_disk_bytes <= 5 * MODEL_BYTES  # the target, at the default bound
    assert store.disk_bytes() == store._disk_now <= store.peak_disk_bytes
    # Write amplification: each merge writes its record once (no compaction copies) + marks + tape.
    assert store.records_written == 400
    per_merge = store.record_bytes_written / store.records_written
    assert one < per_merge < one + headers
    assert store.bytes_written / store.records_written < per_merge * 1.05
    store.close()
    again = SyncerStore(tmp_path, fsync=False, log_bound=log_bound)
    found = again.restore(LAYOUT, list(range(4)))
    assert found is not None and set(found.fragments) == {0, 1, 2, 3}
    assert again.peak_disk_bytes == again.disk_bytes()  # a new store starts its peak at the folder
    again.close()


def test_fsyncs_per_merge_with_rotation(tmp_path):
    store = SyncerStore(tmp_path, fsync=True, log_bound=2.0, tape_sync_s=3600)
    store.restore(LAYOUT, [0, 1, 2, 3])
    start = store.fsyncs  # the fresh folder's
    store.append(record(0, 1), META)  # a new log: the record, the folder, the mark
    assert store.fsyncs - start == 3
    store.append(record(0, 2), META)  # appended: the record, the mark
    assert store.fsyncs - start == 5
    store.append(record(0, 3), META)  # rotated: the new log, the folder, the mark; the rename needs none
    assert store.fsyncs - start == 8
    assert sorted(x.name for x in (tmp_path / "state").glob("frag-*")) == ["frag-0.log"]
    store.close()


def test_bound_is_validated(tmp_path):
    for bad in (0.5, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="log_bound"):
            SyncerStore(tmp_path, log_bound=bad)
    assert load_config(overrides=["runtime.store_log_bound=1"]).runtime.store_log_bound == 1.0
    with pytest.raises(ConfigError, match="runtime.store_log_bound = 0.5 is out of range"):
        load_config(overrides=["runtime.store_log_bound=0.5"])


# fsync 1: the new log, 2: the folder, 3: the mark; write 2: the record's header, 5: the mark
@pytest.mark.parametrize(("name", "nth"), [("fsync", 1), ("fsync", 2), ("fsync", 3), ("write", 2), ("write", 5)])
def test_full_disk_during_a_rotation_leaves_the_old_log_and_no_mark(tmp_path, monkeypatch, name, nth):
    store = SyncerStore(tmp_path, fsync=True, log_bound=1.0)
    store.restore(LAYOUT, [0, 1, 2, 3])
    store.append(record(0, 1), META)
    state = tmp_path / "state"
    before = {n: (state / n).read_bytes() for n in ("frag-0.log", "durable.log", "durable.mirror.log")}
    full_on(monkeypatch, name, nth)
    with pytest.raises(StoreFull, match="free space"):
        store.append(record(0, 2), META)
    monkeypatch.undo()
    assert {n: (state / n).read_bytes() for n in before} == before
    assert not (state / "frag-0.next.log").exists() and store.durable_versions()[0] == 1
    assert store.disk_bytes() == store._disk_now
    store.append(record(0, 2), META)  # space again: it goes on
    store.close()
    again = SyncerStore(tmp_path, fsync=False)
    assert again.restore(LAYOUT, [0, 1, 2, 3]).fragments[0].version == 2
    again.close()


def test_a_folder_whose_snapshots_held_tensors_is_read_and_kept(tmp_path):
    """Folders written before the logs rotated: snapshot.bin and snapshot.prev.bin hold every
    fragment. They restore as before, and the next snapshot moves what only the old snapshot
    held (here fragment 1's version 4) into its log before it drops the tensors."""
    store = SyncerStore(tmp_path, fsync=False)
    store.restore(LAYOUT, [0, 1, 2, 3])
    store.append(record(0, 3), META)
    tensors, frags = {}, []
    for rec in (record(0, 3), record(1, 4), record(2, 0), record(3, 0)):
        ts, meta = persist._encode(rec)
        tensors.update({f"{rec.fragment}/{k}": v for k, v in ts.items()})
        frags.append(meta)
    header = {"snapshot": 1, "seq": 99, "signature": store.signature, "owned": [0, 1, 2, 3], "fragments": frags,
              "syncer": {"clock": 2}}  # fmt: skip
    data = b"".join(bytes(memoryview(b).cast("B")) for b in persist._frame(b"DDLS", header, tensors))
    for name in ("snapshot.bin", "snapshot.prev.bin"):
        (tmp_path / "state" / name).write_bytes(data)
    store.close()
    store = SyncerStore(tmp_path, fsync=False)
    found = store.restore(LAYOUT, [0, 1, 2, 3])
    assert {p: r.version for p, r in found.fragments.items()} == {0: 3, 1: 4, 2: 0, 3: 0}
    assert found.syncer_meta == {"clock": 2}
    store.snapshot([record(0, 3), record(1, 4), record(2, 0), record(3, 0)], {"clock": 3})
    assert not (tmp_path / "state" / "snapshot.prev.bin").exists()
    assert (tmp_path / "state" / "snapshot.bin").stat().st_size < 4096
    store.close()
    store = SyncerStore(tmp_path, fsync=False)
    found = store.restore(LAYOUT, [0, 1, 2, 3])
    assert {p: r.version for p, r in found.fragments.items()} == {0: 3, 1: 4}
    assert torch.equal(found.fragments[1].values[0], record(1, 4).values[0])
    assert found.syncer_meta == {"clock": 3}
    store.close()
