"""Durable syncer state: logs + snapshots restore a syncer bit for bit; torn tails, corrupt
snapshots, layout mismatches and shards."""

import os

import pytest
import torch

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.messages import Contribution
from ddiloco.core.syncer import Syncer
from ddiloco.service import store as persist
from ddiloco.service.store import StateError, SyncerStore

torch.set_num_threads(1)

# Lock-step pushes ("wait"), K = 1, no grace: every contribution is merged at once.
CFG = DiLoCoConfig(num_fragments=2, sync_every=4, overlap=1, quorum=1, grace=False, late_fragment="wait", outer_lr=0.7, outer_momentum=0.9)
SPECS = [TensorSpec("w", (6, 4)), TensorSpec("b", (5,))]


def make(specs=SPECS, owned=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    init = {s.name: torch.randn(s.shape, generator=g) for s in specs}
    return Syncer(CFG, balanced_layout(specs, 2), init, owned=owned)


def merge(s: Syncer, p: int, learner: int, step: int, now: float = 1.0) -> None:
    """One real round: join if needed, contribute random values, which K = 1 merges at once."""
    if learner not in s.learners:
        s.on_join(learner, now)
    g = torch.Generator().manual_seed(1000 * step + 10 * p + learner)
    vals = [v + 0.1 * torch.randn(v.shape, generator=g) for v in s.fragments[p].values]
    before = s.fragments[p].version
    s.on_contribution(Contribution(learner, p, before, vals, steps=4, tokens=100 + step, data_position=step, step=step), now)
    assert s.fragments[p].version == before + 1


def persist_new(store: SyncerStore, s: Syncer) -> None:
    """What the service does: drain new_versions, make each durable, then (would) send."""
    drained, s.new_versions = s.new_versions, []
    for p, _ in drained:
        store.append(s, p)


def assert_same(a: Syncer, b: Syncer) -> None:
    assert a.versions() == b.versions()
    assert a.meta_state() == b.meta_state()
    for p in a.owned:
        ta, ma = a.fragment_state(p)
        tb, mb = b.fragment_state(p)
        assert ma == mb and ta.keys() == tb.keys()
        for k in ta:
            assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), (p, k)


def restored(tmp_path, **kw) -> tuple[Syncer, SyncerStore, bool]:
    s = make(owned=kw.pop("owned", None))
    store = SyncerStore(tmp_path, fsync=False, **kw)
    return s, store, store.restore(s)


def test_real_merges_with_snapshot_in_the_middle_restore_bit_for_bit(tmp_path):
    s, store = make(), SyncerStore(tmp_path)  # fsync on: the real path, still fast
    assert store.restore(s) is False
    for step in range(1, 4):
        merge(s, step % 2, step % 3, step)
        persist_new(store, s)
        store.append_tape(s.tape[-1:])
    store.snapshot(s)
    for step in range(4, 8):
        merge(s, step % 2, step % 3, step)
        persist_new(store, s)
        store.append_tape(s.tape[-1:])
    assert s.fragments[0].outer.buffers is not None and s.versions() == [3, 4]
    s2, store2, ok = restored(tmp_path)
    assert ok
    assert_same(s, s2)
    assert store2.durable_versions() == {0: 3, 1: 4}
    assert store2.read_tape() == s.tape
    # the restored syncer keeps merging from where it was, and a second restart sees that too
    merge(s2, 0, 1, 8)
    persist_new(store2, s2)
    store2.snapshot(s2)
    s3, _, _ = restored(tmp_path)
    assert_same(s2, s3)


def test_snapshot_compacts_logs_and_append_is_idempotent(tmp_path):
    s, store, _ = restored(tmp_path)
    for step in range(1, 4):
        merge(s, 0, 0, step)
        store.append(s, 0)
        store.append(s, 0)  # already durable: not written again
    log = tmp_path / "state" / "frag-0.log"
    three = log.stat().st_size
    store.snapshot(s)
    assert 0 < log.stat().st_size < three / 2  # only the newest record is kept
    assert (tmp_path / "state" / "snapshot.bin").exists() and not (tmp_path / "state" / "snapshot.prev.bin").exists()
    store.snapshot(s)
    assert (tmp_path / "state" / "snapshot.prev.bin").exists()
    s2, _, _ = restored(tmp_path)
    assert_same(s, s2)


def test_torn_tail_is_cut_and_the_previous_version_restored(tmp_path):
    s, store, _ = restored(tmp_path)
    merge(s, 0, 0, 1)
    store.append(s, 0)
    merge(s, 0, 0, 2)
    store.append(s, 0)
    at_v2 = make()
    at_v2.load_fragment_state(*s.fragment_state(0))
    at_v2.load_meta_state(s.meta_state())
    log = tmp_path / "state" / "frag-0.log"
    good = log.stat().st_size
    merge(s, 0, 0, 3)
    store.append(s, 0)
    with open(log, "r+b") as f:
        f.truncate(log.stat().st_size - 7)  # crash mid-write of version 3
    s2, store2, ok = restored(tmp_path)
    assert ok and s2.versions()[0] == 2 and log.stat().st_size == good
    assert_same(at_v2, s2)
    # appending after the cut works and is found again
    merge(s2, 0, 0, 3)
    store2.append(s2, 0)
    s3, _, _ = restored(tmp_path)
    assert_same(s2, s3)


def test_zero_filled_tail_is_torn_but_corruption_in_the_middle_is_an_error(tmp_path):
    s, store, _ = restored(tmp_path)
    for step in (1, 2):
        merge(s, 0, 0, step)
        store.append(s, 0)
    log = tmp_path / "state" / "frag-0.log"
    with open(log, "ab") as f:
        f.write(b"\0" * 64)
    s2, _, _ = restored(tmp_path)
    assert_same(s, s2)
    size = log.stat().st_size
    data = bytearray(log.read_bytes())
    data[-1] ^= 0xFF  # full-length but unwritten last record (e.g. after a crash on ext4)
    log.write_bytes(bytes(data))
    s3, _, _ = restored(tmp_path)
    assert s3.versions()[0] == 1 and log.stat().st_size < size
    merge(s3, 0, 0, 2)
    store3 = SyncerStore(tmp_path, fsync=False)
    store3.restore(make())
    store3.append(s3, 0)
    data = bytearray(log.read_bytes())
    data[40] ^= 0xFF  # inside the first of two records
    log.write_bytes(bytes(data))
    with pytest.raises(StateError, match="corrupt at byte 0.*--run-dir"):
        restored(tmp_path)


def test_corrupt_snapshot_falls_back_to_prev_and_logs(tmp_path):
    s, store, _ = restored(tmp_path)
    merge(s, 0, 0, 1)
    persist_new(store, s)
    store.snapshot(s)
    merge(s, 1, 1, 2)
    persist_new(store, s)
    store.snapshot(s)
    snap = tmp_path / "state" / "snapshot.bin"
    data = bytearray(snap.read_bytes())
    data[-3] ^= 0x01
    snap.write_bytes(bytes(data))
    s2, store2, ok = restored(tmp_path)
    assert ok
    assert_same(s, s2)  # prev snapshot + the newest record of every log
    # the bad snapshot.bin is replaced, not rotated over the good prev
    store2.snapshot(s2)
    s3, _, _ = restored(tmp_path)
    assert_same(s, s3)
    # both snapshots unreadable: initial values + the logs still hold every merged version
    for name in ("snapshot.bin", "snapshot.prev.bin"):
        (tmp_path / "state" / name).write_bytes(b"garbage")
    s4, _, ok = restored(tmp_path)
    assert ok and s4.versions() == s.versions()
    for p in s.owned:
        assert torch.equal(s4.fragments[p].values[0], s.fragments[p].values[0])


def test_layout_or_ownership_mismatch_is_one_line_state_error(tmp_path):
    s, store, _ = restored(tmp_path)
    merge(s, 0, 0, 1)
    persist_new(store, s)
    other = make([TensorSpec("w", (6, 4)), TensorSpec("bias", (5,))])
    with pytest.raises(StateError) as e:  # logs only, no snapshot yet
        SyncerStore(tmp_path).restore(other)
    assert "'b'" in str(e.value) and "'bias'" in str(e.value) and "--run-dir" in str(e.value) and "\n" not in str(e.value)
    store.snapshot(s)
    with pytest.raises(StateError, match="different model layout.*fresh --run-dir"):
        SyncerStore(tmp_path).restore(make([TensorSpec("w", (6, 4)), TensorSpec("b", (7,))]))
    with pytest.raises(StateError, match="owning fragments"):
        SyncerStore(tmp_path).restore(make(owned=[0]))


def test_shards_have_separate_dirs_and_cannot_be_mixed_up(tmp_path):
    syncers = [make(owned=[i]) for i in (0, 1)]
    stores = [SyncerStore(tmp_path, shard=i, num_shards=2, fsync=False) for i in (0, 1)]
    for s, st in zip(syncers, stores):
        assert st.restore(s) is False
    merge(syncers[0], 0, 0, 1)
    merge(syncers[1], 1, 0, 2)
    merge(syncers[1], 1, 0, 3)
    for s, st in zip(syncers, stores):
        persist_new(st, s)
        st.snapshot(s)
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["shard-0", "shard-1"]
    for i in (0, 1):
        s, st, ok = restored(tmp_path, owned=[i], shard=i, num_shards=2)
        assert ok and st.durable_versions() == {i: i + 1}
        assert_same(syncers[i], s)
    with pytest.raises(StateError, match="several syncer shards"):
        SyncerStore(tmp_path).restore(make())
    with pytest.raises(StateError, match="out of range"):
        SyncerStore(tmp_path, shard=2, num_shards=2)


def test_empty_dir_restores_nothing_and_writes_need_restore_first(tmp_path):
    s, store, ok = restored(tmp_path)
    assert ok is False and s.versions() == [0, 0] and store.durable_versions() == {0: 0, 1: 0}
    assert not (tmp_path / "state").exists()  # restore creates nothing
    with pytest.raises(RuntimeError, match="restore"):
        SyncerStore(tmp_path).append(s, 0)


def test_tape_torn_last_line_is_dropped(tmp_path):
    store = SyncerStore(tmp_path, fsync=False)
    store.append_tape([{"event": "a"}, {"event": "b"}])
    with open(tmp_path / "state" / "tape.jsonl", "a") as f:
        f.write('{"event": "c", "ti')
    assert SyncerStore(tmp_path).read_tape() == [{"event": "a"}, {"event": "b"}]
    store2 = SyncerStore(tmp_path, fsync=False)
    store2.append_tape([{"event": "d"}])
    assert store2.read_tape() == [{"event": "a"}, {"event": "b"}, {"event": "d"}]


def test_frames_round_trip_every_dtype_and_odd_shapes():
    g = torch.Generator().manual_seed(0)
    ts = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "f16": torch.randn(2, 2, generator=g).half(),
        "i64": torch.tensor([-(2**40), 3]),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(1.5),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(4, 6, generator=g).t(),
    }
    buf = bytearray(b"".join(bytes(memoryview(b)) for b in persist._frame(b"DDLR", {"x": 1}, ts)))
    end, header = persist._parse(buf, 0, b"DDLR")
    assert end == len(buf) and header["x"] == 1
    out = persist._tensors(buf, header)
    for k, t in ts.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape and torch.equal(out[k], t), k
    buf[-1] ^= 1
    assert persist._parse(buf, 0, b"DDLR") == "checksum mismatch"


def test_versions_never_go_backwards(tmp_path):
    s, store, _ = restored(tmp_path)
    merge(s, 0, 0, 1)
    store.append(s, 0)
    ahead = make()
    for step in (1, 2, 3):
        merge(ahead, 0, 0, step)
    SyncerStore(tmp_path, fsync=False).restore(ahead)  # the dir only holds version 1
    assert ahead.versions()[0] == 3
    assert os.path.getsize(tmp_path / "state" / "frag-0.log") > 0
