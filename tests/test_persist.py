"""Durable syncer state: rotating logs + meta snapshots restore a syncer bit for bit; torn tails,
corrupt snapshots, layout mismatches and shards."""

import os

import pytest
import torch

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.messages import Contribution, Join
from ddiloco.core.syncer import Output, Syncer
from ddiloco.service.syncer import store as persist
from ddiloco.service.syncer.store import FORMAT, StateError, SyncerStore

torch.set_num_threads(1)

# Lock-step pushes ("wait"), K = 1, no grace: every contribution is merged at once.
CFG = DiLoCoConfig(
    num_fragments=2,
    sync_every=4,
    overlap=1,
    quorum=1,
    grace=False,
    late_fragment="wait",
    outer_lr=0.7,
    outer_momentum=0.9,
)
SPECS = [TensorSpec("w", (6, 4)), TensorSpec("b", (5,))]


def unmark_last(run_dir) -> None:
    """What a crash before the newest version's marks leaves: neither mark file has it."""
    for name in (persist.MARKS, persist.MIRROR):
        marks = run_dir / "state" / name
        os.truncate(marks, marks.stat().st_size - persist.MARK_SIZE)


def restore_into(store: SyncerStore, core: Syncer) -> bool:
    """What a syncer does at start: take back what its store made durable (True: found some)."""
    found = store.restore(core.layout, core.owned)
    if found is None:
        return False
    core.restore(found.fragments, found.syncer_meta)
    return True


def snapshot(store: SyncerStore, core: Syncer) -> None:
    store.snapshot([core.fragment_record(p) for p in core.owned], core.meta_state())


def make(specs=SPECS, owned=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    init = {s.name: torch.randn(s.shape, generator=g) for s in specs}
    layout = balanced_layout(specs, 2)
    return Syncer(CFG, layout, init, [False] * sum(len(f) for f in layout.fragments), owned=owned)


def merge(s: Syncer, p: int, learner: int, step: int, now: float = 1.0) -> Output:
    """One real round: join if needed, contribute random values, which K = 1 merges at once."""
    if learner not in s.learners:
        s.handle(Join(learner, 0, []), now)
    g = torch.Generator().manual_seed(1000 * step + 10 * p + learner)
    vals = [v + 0.1 * torch.randn(v.shape, generator=g) for v in s.fragments[p].values]
    before = s.fragments[p].version
    c = Contribution(
        learner=learner,
        incarnation=0,
        fragment=p,
        base_version=before,
        seq=step,
        values=vals,
        steps=4,
        tokens=100 + step,
        data_position=step,
        step=step,
    )
    out = s.handle(c, now)
    assert s.fragments[p].version == before + 1 and out.durable == [p]
    return out


def save(store: SyncerStore, s: Syncer, p: int) -> None:
    store.append(s.fragment_record(p), s.meta_state())


def persist_new(store: SyncerStore, s: Syncer) -> None:
    """What the service does with new versions; versions already durable are not written again."""
    for p in s.owned:
        save(store, s, p)


def assert_same(a: Syncer, b: Syncer) -> None:
    assert a.versions() == b.versions()
    assert a.meta_state() == b.meta_state()
    for p in a.owned:
        ra, rb = a.fragment_record(p), b.fragment_record(p)
        assert (ra.fragment, ra.version, ra.tokens_merged) == (rb.fragment, rb.version, rb.tokens_merged)
        assert (ra.momentum is None) == (rb.momentum is None)
        for x, y in zip([*ra.values, *(ra.momentum or [])], [*rb.values, *(rb.momentum or [])]):
            assert x.dtype == y.dtype and torch.equal(x, y), p


def restored(tmp_path, **kw) -> tuple[Syncer, SyncerStore, bool]:
    s = make(owned=kw.pop("owned", None))
    store = SyncerStore(tmp_path, fsync=False, **kw)
    return s, store, restore_into(store, s)


def test_real_merges_with_snapshot_in_the_middle_restore_bit_for_bit(tmp_path):
    s, store = make(), SyncerStore(tmp_path)  # fsync on: the real path, still fast
    assert restore_into(store, s) is False
    tape = []
    for step in range(1, 8):
        out = merge(s, step % 2, step % 3, step)
        persist_new(store, s)
        tape += [r.to_json() for r in out.tape]
        store.append_tape([r.to_json() for r in out.tape])
        if step == 3:
            snapshot(store, s)
    assert s.fragments[0].outer.buffers is not None and s.versions() == [3, 4]
    store.close()  # a syncer's restart: the folder's lock is released
    s2, store2, ok = restored(tmp_path)
    assert ok
    assert_same(s, s2)
    assert store2.durable_versions() == {0: 3, 1: 4}
    assert store2.read_tape() == tape
    # the restored syncer keeps merging from where it was, and a second restart sees that too
    merge(s2, 0, 1, 8)
    persist_new(store2, s2)
    snapshot(store2, s2)
    store2.close()
    s3, _, _ = restored(tmp_path)
    assert_same(s2, s3)


def test_logs_rotate_and_append_is_idempotent(tmp_path):
    s, store, _ = restored(tmp_path)  # log_bound 2: a log holds at most two records
    log = tmp_path / "state" / "frag-0.log"
    sizes = []
    for step in range(1, 6):
        merge(s, 0, 0, step)
        save(store, s, 0)
        save(store, s, 0)  # already durable: not written again
        sizes.append(log.stat().st_size)
    one = sizes[0]  # records grow a little with the meta state
    assert [round(n / one) for n in sizes] == [1, 2, 1, 2, 1]  # a third record starts a new log: no copy
    assert store.records_written == 5 and one * 5 <= store.record_bytes_written < one * 6
    snapshot(store, s)
    snap = tmp_path / "state" / "snapshot.bin"
    _, header = persist._parse(bytearray(snap.read_bytes()), 0, b"DDLS")
    assert header["tensors"] == [] and header["versions"] == {"0": 5, "1": 0}  # the logs hold the tensors
    assert not (tmp_path / "state" / "snapshot.prev.bin").exists()
    merge(s, 0, 0, 6)
    save(store, s, 0)
    assert round(log.stat().st_size / one) == 1  # the first append after a snapshot rotates
    store.close()
    s2, _, _ = restored(tmp_path)
    assert_same(s, s2)


def test_torn_tail_is_cut_and_the_previous_version_restored(tmp_path):
    s, store, _ = restored(tmp_path, log_bound=10)  # no rotation: version 3 is torn off a long log
    merge(s, 0, 0, 1)
    save(store, s, 0)
    merge(s, 0, 0, 2)
    save(store, s, 0)
    at_v2 = make()
    at_v2.load_fragment_record(s.fragment_record(0))
    at_v2.load_meta_state(s.meta_state())
    log = tmp_path / "state" / "frag-0.log"
    good = log.stat().st_size
    merge(s, 0, 0, 3)
    save(store, s, 0)
    store.close()
    # crash mid-write of version 3: its record was never fsynced, so it has no durable mark
    unmark_last(tmp_path)
    with open(log, "r+b") as f:
        f.truncate(log.stat().st_size - 7)
    s2, store2, ok = restored(tmp_path)
    assert ok and s2.versions()[0] == 2 and log.stat().st_size == good
    assert_same(at_v2, s2)
    # appending after the cut works and is found again
    merge(s2, 0, 0, 3)
    save(store2, s2, 0)
    store2.close()
    s3, _, _ = restored(tmp_path)
    assert_same(s2, s3)


def test_zero_filled_tail_is_torn_but_corruption_in_the_middle_is_an_error(tmp_path):
    s, store, _ = restored(tmp_path)
    for step in (1, 2):
        merge(s, 0, 0, step)
        save(store, s, 0)
    store.close()
    log = tmp_path / "state" / "frag-0.log"
    with open(log, "ab") as f:
        f.write(b"\0" * 64)
    s2, store2, _ = restored(tmp_path)
    assert_same(s, s2)
    store2.close()
    size = log.stat().st_size
    data = bytearray(log.read_bytes())
    # Full-length but unwritten last record (e.g. after a crash on ext4): the crash came before
    # its mark, so version 2 was never acknowledged and its record may be cut.
    data[-1] ^= 0xFF
    log.write_bytes(bytes(data))
    unmark_last(tmp_path)
    s3, store3, _ = restored(tmp_path)
    assert s3.versions()[0] == 1 and log.stat().st_size < size
    merge(s3, 0, 0, 2)
    save(store3, s3, 0)
    store3.close()
    data = bytearray(log.read_bytes())
    data[40] ^= 0xFF  # inside the first of two records
    log.write_bytes(bytes(data))
    with pytest.raises(StateError, match="corrupt at byte 0.*--run-dir"):
        restored(tmp_path)


def test_corrupt_snapshot_loses_no_version(tmp_path):
    s, store, _ = restored(tmp_path)
    merge(s, 0, 0, 1)
    persist_new(store, s)
    snapshot(store, s)
    merge(s, 1, 1, 2)
    persist_new(store, s)
    snapshot(store, s)
    snap = tmp_path / "state" / "snapshot.bin"
    data = bytearray(snap.read_bytes())
    data[-3] ^= 0x01
    snap.write_bytes(bytes(data))
    store.close()
    s2, store2, ok = restored(tmp_path)
    assert ok
    assert_same(s, s2)  # the newest record of every log (the meta state of the newest record)
    snapshot(store2, s2)  # the bad snapshot.bin is replaced
    store2.close()
    s3, store3, _ = restored(tmp_path)
    assert_same(s, s3)
    store3.close()
    snap.write_bytes(b"garbage")  # unreadable: initial values + the logs still hold every merged version
    s4, _, ok = restored(tmp_path)
    assert ok and s4.versions() == s.versions()
    for p in s.owned:
        assert torch.equal(s4.fragments[p].values[0], s.fragments[p].values[0])


def test_layout_or_ownership_mismatch_is_one_line_state_error(tmp_path):
    s, store, _ = restored(tmp_path)
    merge(s, 0, 0, 1)
    persist_new(store, s)
    store.close()
    other = make([TensorSpec("w", (6, 4)), TensorSpec("bias", (5,))])
    with pytest.raises(StateError) as e:  # logs only, no snapshot yet
        restore_into(SyncerStore(tmp_path), other)
    assert (
        "'b'" in str(e.value) and "'bias'" in str(e.value) and "--run-dir" in str(e.value) and "\n" not in str(e.value)
    )
    s, store, _ = restored(tmp_path)  # a refused restore left the folder unlocked
    snapshot(store, s)
    store.close()
    with pytest.raises(StateError, match="different model layout.*fresh --run-dir"):
        restore_into(SyncerStore(tmp_path), make([TensorSpec("w", (6, 4)), TensorSpec("b", (7,))]))
    with pytest.raises(StateError, match="owning fragments"):
        restore_into(SyncerStore(tmp_path), make(owned=[0]))


def test_shards_have_separate_dirs_and_cannot_be_mixed_up(tmp_path):
    syncers = [make(owned=[i]) for i in (0, 1)]
    stores = [SyncerStore(tmp_path, shard=i, num_shards=2, fsync=False) for i in (0, 1)]
    for s, st in zip(syncers, stores):
        assert restore_into(st, s) is False
    merge(syncers[0], 0, 0, 1)
    merge(syncers[1], 1, 0, 2)
    merge(syncers[1], 1, 0, 3)
    for s, st in zip(syncers, stores):
        persist_new(st, s)
        snapshot(st, s)
        st.close()
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["shard-0", "shard-1"]
    for i in (0, 1):
        s, st, ok = restored(tmp_path, owned=[i], shard=i, num_shards=2)
        assert ok and st.durable_versions() == {i: i + 1}
        assert_same(syncers[i], s)
    with pytest.raises(StateError, match="several syncer shards"):
        restore_into(SyncerStore(tmp_path), make())
    with pytest.raises(StateError, match="out of range"):
        SyncerStore(tmp_path, shard=2, num_shards=2)


def test_empty_dir_restores_nothing_and_writes_need_restore_first(tmp_path):
    s, store, ok = restored(tmp_path)
    assert ok is False and s.versions() == [0, 0] and store.durable_versions() == {0: 0, 1: 0}
    # restore creates the lock that keeps a second syncer out, FORMAT and empty mark files: from
    # now on a deleted state folder is told from a fresh one
    names = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert names == ["FORMAT", "durable.log", "durable.mirror.log", "syncer.lock"]
    assert all((tmp_path / "state" / n).stat().st_size == 0 for n in ("durable.log", "durable.mirror.log"))
    store.close()
    with pytest.raises(RuntimeError, match="restore"):
        save(SyncerStore(tmp_path), s, 0)


def test_tape_torn_last_line_is_dropped(tmp_path):
    store = SyncerStore(tmp_path, fsync=False)
    store.append_tape([{"event": "a"}, {"event": "b"}])
    with open(tmp_path / "state" / "tape.jsonl", "a") as f:
        f.write('{"event": "c", "ti')
    assert SyncerStore(tmp_path).read_tape() == [{"event": "a"}, {"event": "b"}]
    store2 = SyncerStore(tmp_path, fsync=False)
    store2.append_tape([{"event": "d"}])
    assert store2.read_tape() == [{"event": "a"}, {"event": "b"}, {"event": "d"}]
    store.close()
    store2.close()


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
    save(store, s, 0)
    store.close()
    ahead = make()
    for step in (1, 2, 3):
        merge(ahead, 0, 0, step)
    restore_into(SyncerStore(tmp_path, fsync=False), ahead)  # the dir only holds version 1
    assert ahead.versions()[0] == 3
    assert os.path.getsize(tmp_path / "state" / "frag-0.log") > 0


def test_state_of_another_format_is_refused_with_what_to_do(tmp_path):
    s, store, _ = restored(tmp_path)
    merge(s, 0, 0, 1)
    persist_new(store, s)
    assert (tmp_path / "state" / "FORMAT").read_text() == f'{{"format": {FORMAT}}}'
    store.close()
    (tmp_path / "state" / "FORMAT").unlink()  # next to mark files: damage, not format 1
    with pytest.raises(StateError, match="FORMAT is missing but .* holds durable marks.*backup"):
        restored(tmp_path)
    for name in ("durable.log", "durable.mirror.log"):
        (tmp_path / "state" / name).unlink()  # what a store of format 1 looks like
    with pytest.raises(StateError, match="format 1.*fresh --run-dir"):
        restored(tmp_path)
    (tmp_path / "state" / "FORMAT").write_text('{"format": 3}')  # the format before the mirror
    with pytest.raises(StateError, match=r"format 3 \(one durable.log, before durable.mirror.log\).*format 4"):
        restored(tmp_path)
    (tmp_path / "state" / "FORMAT").write_text('{"format": 99}')
    with pytest.raises(StateError, match="format 99"):
        restored(tmp_path)
