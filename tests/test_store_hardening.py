"""The store never rolls a fragment back silently (damaged, truncated, zeroed or deleted files are
hard errors once a version was acknowledged), keeps a second syncer out, turns a full disk into
StoreFull without leaving a half record or a mark, survives a crash at any syscall, and keeps tape
lines and status files cheap and harmless."""

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.syncer import FragmentRecord
from ddiloco.service.base import status
from ddiloco.service.syncer import store as persist
from ddiloco.service.syncer.store import MARK_SIZE, StateError, StoreFull, StoreLocked, SyncerStore

torch.set_num_threads(1)

LAYOUT = balanced_layout([TensorSpec("w", (6, 4)), TensorSpec("b", (5,))], 2)
META = {"clock": 1}


def record(p: int, version: int) -> FragmentRecord:
    """Fragment p at ``version``: values that tell versions apart."""
    g = torch.Generator().manual_seed(100 * p + version)
    values = [torch.randn(pc.shape, generator=g) for pc in LAYOUT.fragments[p]]
    return FragmentRecord(p, version, 10 * version, values, [v * 0.5 for v in values])


def opened(tmp_path: Path, fsync: bool = False, **kw) -> tuple[SyncerStore, persist.Restored | None]:
    store = SyncerStore(tmp_path, fsync=fsync, **kw)
    return store, store.restore(LAYOUT, [0, 1])


def versions(found: persist.Restored | None) -> dict[int, int]:
    return {} if found is None else {p: r.version for p, r in sorted(found.fragments.items())}


def written(tmp_path: Path, upto: int = 3, snap_at: int | None = None) -> Path:
    """Versions 1..upto of fragment 0 (and 1 of fragment 1) acknowledged, the store closed; frag-0.log."""
    store, _ = opened(tmp_path)
    store.append(record(1, 1), META)
    for v in range(1, upto + 1):
        store.append(record(0, v), META)
        if v == snap_at:
            store.snapshot([record(0, v), record(1, 1)], META)
    store.close()
    return tmp_path / "state" / "frag-0.log"


def restore_fails(tmp_path: Path, *words: str) -> str:
    with pytest.raises(StateError) as e:
        opened(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


# -- a version that was acknowledged never goes down silently ----------------------------------


@pytest.mark.parametrize("snap_at", [None, 3])
def test_flipped_byte_in_the_newest_durable_record_is_an_error_not_a_rollback(tmp_path, snap_at):
    log = written(tmp_path, snap_at=snap_at)
    data = bytearray(log.read_bytes())
    data[-1] ^= 0x01  # the old store called this full-length record "torn" and restored version 2
    log.write_bytes(bytes(data))
    restore_fails(tmp_path, "corrupt at byte", "fsynced", "backup", "durable.log")
    assert log.read_bytes() == bytes(data)  # evidence is left as it was


def test_truncated_newest_durable_record_is_an_error(tmp_path):
    log = written(tmp_path)
    os.truncate(log, log.stat().st_size - 7)
    restore_fails(tmp_path, "frag-0.log", "truncated or deleted")


def test_zero_filled_log_is_an_error(tmp_path):
    log = written(tmp_path)
    log.write_bytes(bytes(log.stat().st_size))
    restore_fails(tmp_path, "corrupt at byte 0")


def test_deleted_log_is_an_error(tmp_path):
    log = written(tmp_path, snap_at=2)  # the snapshot holds version 2, the log 3
    log.unlink()
    restore_fails(tmp_path, "frag-0.log", "truncated or deleted")


def test_deleted_snapshot_never_lowers_a_version(tmp_path):
    # The usual case: compacted logs still hold every newest version, so nothing is lost.
    written(tmp_path, snap_at=3)
    for name in ("snapshot.bin", "snapshot.prev.bin"):
        (tmp_path / "state" / name).unlink(missing_ok=True)
    store, found = opened(tmp_path)
    assert versions(found) == {0: 3, 1: 1} and store.durable_versions() == {0: 3, 1: 1}
    store.close()
    # A snapshot given a version its log lacks writes it to the log: the snapshot holds no tensors.
    store, _ = opened(tmp_path)
    store.snapshot([record(0, 4), record(1, 1)], META)
    assert store.durable_versions()[0] == 4
    store.close()
    (tmp_path / "state" / "snapshot.bin").unlink()
    store, found = opened(tmp_path)
    assert versions(found) == {0: 4, 1: 1}
    store.close()
    # The log that alone holds it is lost: an error, not a rollback.
    (tmp_path / "state" / "frag-0.log").unlink()
    restore_fails(tmp_path, "frag-0.log", "truncated or deleted")


def test_crash_between_the_record_and_its_mark_restores_the_record(tmp_path):
    written(tmp_path)
    marks = tmp_path / "state" / "durable.log"
    os.truncate(marks, marks.stat().st_size - MARK_SIZE)  # version 3's mark never made it
    store, found = opened(tmp_path)
    assert versions(found) == {0: 3, 1: 1}
    store.close()
    os.truncate(marks, marks.stat().st_size - MARK_SIZE // 2)  # a torn mark is cut, not an error
    store, found = opened(tmp_path)
    assert versions(found)[0] == 3 and marks.stat().st_size % MARK_SIZE == 0
    store.close()


def test_damaged_or_missing_marks(tmp_path):
    written(tmp_path)
    marks = tmp_path / "state" / "durable.log"
    data = bytearray(marks.read_bytes())
    data[5] ^= 0x01  # the first of several marks
    marks.write_bytes(bytes(data))
    restore_fails(tmp_path, "durable.log is corrupt at byte 0")
    # One lost mark file: the mirror still holds every mark, and both are written anew.
    marks.unlink()
    store, found = opened(tmp_path)
    assert versions(found) == {0: 3, 1: 1} and marks.stat().st_size == 2 * MARK_SIZE
    assert (tmp_path / "state" / "durable.mirror.log").read_bytes() == marks.read_bytes()
    store.close()
    # Deleting both is the documented way to accept what is readable; they are written anew.
    marks.unlink()
    (tmp_path / "state" / "durable.mirror.log").unlink()
    store, found = opened(tmp_path)
    assert versions(found) == {0: 3, 1: 1} and marks.stat().st_size == 2 * MARK_SIZE
    store.close()
    (tmp_path / "state" / "frag-0.log").unlink()
    restore_fails(tmp_path, "truncated or deleted")  # protected again from then on


# -- one syncer per folder ------------------------------------------------------------------


def test_second_store_is_refused_until_the_first_closes(tmp_path):
    first, _ = opened(tmp_path)
    with pytest.raises(StoreLocked) as e:
        opened(tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "state") in msg and "another syncer" in msg and f"pid {os.getpid()}" in msg
    assert "\n" not in msg
    first.append(record(0, 1), META)  # the holder still writes
    first.close()
    second, found = opened(tmp_path)
    assert versions(found) == {0: 1}
    second.close()


def test_shards_lock_separately(tmp_path):
    a = SyncerStore(tmp_path, shard=0, num_shards=2, fsync=False)
    b = SyncerStore(tmp_path, shard=1, num_shards=2, fsync=False)
    assert a.restore(LAYOUT, [0]) is None and b.restore(LAYOUT, [1]) is None
    with pytest.raises(StoreLocked, match="shard-1"):
        SyncerStore(tmp_path, shard=1, num_shards=2).restore(LAYOUT, [1])
    a.close()
    b.close()


@pytest.mark.slow  # a second process holds the lock
def test_lock_held_by_another_process_names_its_pid(tmp_path):
    store, _ = opened(tmp_path)
    store.close()
    holder = (
        "import fcntl, os, sys\n"
        f"f = open({str(tmp_path / 'state' / 'syncer.lock')!r}, 'a+')\n"
        "fcntl.flock(f, fcntl.LOCK_EX)\n"
        "f.truncate(0); f.write(str(os.getpid())); f.flush()\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLocked, match=f"pid {proc.pid}"):
            opened(tmp_path)
    finally:
        proc.communicate("", timeout=10)
    store, _ = opened(tmp_path)  # its lock died with it
    store.close()


# -- a full disk ----------------------------------------------------------------------------


def full_on(monkeypatch, name: str, nth: int) -> list[int]:
    """Make the nth call of os.<name> fail with ENOSPC (a write first writes half of its bytes)."""
    real = getattr(os, name)
    calls = [0]

    def fake(fd, *args):
        calls[0] += 1
        if calls[0] == nth:
            if name == "write":
                real(fd, memoryview(args[0])[: len(args[0]) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, *args)

    monkeypatch.setattr(os, name, fake)
    return calls


@pytest.mark.parametrize(("name", "nth"), [("fsync", 1), ("fsync", 2), ("write", 1), ("write", 4)])
def test_full_disk_on_append_raises_store_full_and_marks_nothing(tmp_path, monkeypatch, name, nth):
    log = written(tmp_path, upto=2)
    marks = tmp_path / "state" / "durable.log"
    before = (log.read_bytes(), marks.read_bytes())
    store, _ = opened(tmp_path, fsync=True)
    full_on(monkeypatch, name, nth)  # fsync 1: the record, 2: its mark; write 4: the tensor bytes
    with pytest.raises(StoreFull) as e:
        store.append(record(0, 3), META)
    monkeypatch.undo()
    assert str(tmp_path / "state") in str(e.value) and "free space" in str(e.value)
    assert (log.read_bytes(), marks.read_bytes()) == before  # no half record, no mark
    assert store.durable_versions()[0] == 2
    store.close()
    store, found = opened(tmp_path)
    assert versions(found) == {0: 2, 1: 1}
    store.close()


def test_full_disk_on_the_mirror_mark_undoes_the_record_and_its_mark(tmp_path, monkeypatch):
    log = written(tmp_path, upto=2)
    state = tmp_path / "state"
    before = [(state / n).read_bytes() for n in ("frag-0.log", "durable.log", "durable.mirror.log")]
    store, _ = opened(tmp_path, fsync=True)

    def full(mark: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "_append_mirror", full)
    with pytest.raises(StoreFull, match="free space"):
        store.append(record(0, 3), META)
    monkeypatch.undo()
    assert [(state / n).read_bytes() for n in ("frag-0.log", "durable.log", "durable.mirror.log")] == before
    assert store.durable_versions()[0] == 2 and log.exists()
    store.close()
    store, found = opened(tmp_path)
    assert versions(found) == {0: 2, 1: 1}
    store.close()


def test_full_disk_at_any_point_of_a_snapshot_loses_nothing(tmp_path, monkeypatch):
    failures = 0
    for nth in range(1, 50):
        d = tmp_path / str(nth)
        written(d, upto=3, snap_at=2)
        store, _ = opened(d, fsync=True)
        store.append_tape([{"event": "x"}])
        calls = full_on(monkeypatch, "fsync", nth)
        try:
            store.snapshot([record(0, 3), record(1, 1)], META)
        except StoreFull as e:
            failures += 1
            assert str(d / "state") in str(e)
        monkeypatch.undo()
        store.close()
        assert not (d / "state" / "snapshot.tmp").exists()
        store, found = opened(d)
        assert versions(found) == {0: 3, 1: 1}, nth
        store.close()
        if calls[0] < nth:  # the snapshot needed fewer fsyncs: every failure point was tried
            break
    assert failures >= 3


# -- a crash at any syscall, as SIGKILL leaves it ------------------------------------------


class Crash(BaseException):
    pass


class Killer:
    """Kills the process at its ``point``-th write, fsync, truncate, rename or unlink: a write
    is left half done, page-cache contents survive, and no cleanup runs (every later call fails)."""

    NAMES = ("write", "fsync", "ftruncate", "truncate", "replace", "unlink")

    def __init__(self, point: int) -> None:
        self.point, self.calls, self.dead = point, 0, False
        self.reals = {n: getattr(os, n) for n in self.NAMES}

    def patch(self, monkeypatch) -> None:
        for n in self.NAMES:
            monkeypatch.setattr(os, n, self._fake(n))

    def _fake(self, name: str):
        def fake(*args):
            if self.dead:
                raise Crash
            self.calls += 1
            if self.calls == self.point:
                self.dead = True
                if name == "write":
                    self.reals["write"](args[0], memoryview(args[1])[: len(args[1]) // 2])
                raise Crash
            if name == "fsync":
                return None  # the page cache survives this crash: a real fsync changes nothing, and is slow
            return self.reals[name](*args)

        return fake


def crash_workload(store: SyncerStore, acked: dict[int, int]) -> None:
    """Appends, tape lines and snapshots; ``acked``: the versions whose append returned. The logs
    rotate on size (every ``log_bound`` records) and after each snapshot."""
    for v in range(1, 6):
        for p in (0, 1):
            store.append(record(p, v), META)
            acked[p] = v
            store.append_tape([{"event": "round", "fragment": p, "version": v}])
        if v == 3:
            store.snapshot([record(0, v), record(1, v)], META)


def records_in(log: Path) -> int:
    buf, pos, n = bytearray(log.read_bytes()), 0, 0
    while pos < len(buf):
        pos, n = persist._parse(buf, pos, b"DDLR")[0], n + 1
    return n


@pytest.mark.parametrize("log_bound", [1.0, 2.0])
def test_a_crash_at_any_syscall_never_loses_an_acknowledged_version(tmp_path, monkeypatch, caplog, log_bound):
    """A restore after a crash at any syscall, size-triggered rotations of the logs included,
    reaches every version whose append returned, and never one that was not attempted (SIGKILL
    at random moments lost nothing: it still does not); it leaves no rotation half done, no log
    over its bound, and a store that goes on writing."""
    point = 0
    caplog.set_level(logging.WARNING, logger="ddiloco.service.syncer.store")
    while True:
        point += 1
        d = tmp_path / str(point)
        store, _ = opened(d, fsync=True, log_bound=log_bound)
        killer = Killer(point)
        killer.patch(monkeypatch)
        acked: dict[int, int] = {}
        try:
            crash_workload(store, acked)
        except Crash:
            pass
        monkeypatch.undo()
        store._lock.close()  # the kernel drops a dead process's lock
        again, found = opened(d, log_bound=log_bound)
        got = versions(found)
        for p in (0, 1):
            assert acked.get(p, 0) <= got.get(p, 0) <= acked.get(p, 0) + 1, (point, acked, got)
            if p in got:
                assert torch.equal(found.fragments[p].values[0], record(p, got[p]).values[0])
            log = d / "state" / f"frag-{p}.log"
            assert not log.with_name(f"frag-{p}.next.log").exists(), point
            assert not log.exists() or records_in(log) <= int(log_bound), point
        assert again.disk_bytes() == again._disk_now, point  # the store's own count is the folder's
        for p in (0, 1):  # it goes on from there, and a second restore finds that
            again.append(record(p, got.get(p, 0) + 1), META)
        again.close()
        last, found = opened(d, log_bound=log_bound)
        assert versions(found) == {p: got.get(p, 0) + 1 for p in (0, 1)}, point
        last.close()
        if not killer.dead:
            break
    assert point > 80  # the workload really went through many crash points
    said = " ".join(r.getMessage() for r in caplog.records)
    # a crash between a rotation's mark and its rename, and one before its mark
    assert "finishing the rotation" in said and "never marked" in said


# -- cheap tape, harmless status files -------------------------------------------------------


def test_tape_lines_are_written_at_once_but_fsynced_in_batches(tmp_path, monkeypatch):
    store, _ = opened(tmp_path, fsync=True, tape_sync_s=3600)
    store.append_tape([{"event": "first"}])  # creates the folder (and syncs its directory once)
    syncs = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (syncs.append(fd), real(fd))[1])
    for i in range(100):  # e.g. rejections: each one a tape line
        store.append_tape([{"event": "rejected", "i": i}])
    assert syncs == [] and len(store.read_tape()) == 101  # readers see them at once
    store.flush_tape()
    store.flush_tape()  # nothing new: no second fsync
    assert len(syncs) == 1
    store.append_tape([{"event": "last"}])
    store.close()
    assert len(syncs) == 2 and SyncerStore(tmp_path).read_tape()[-1] == {"event": "last"}
    with pytest.raises(RuntimeError, match="closed"):
        store.append_tape([{"event": "late"}])
    eager, _ = opened(tmp_path, fsync=True, tape_sync_s=0)
    eager.append_tape([{"event": "a"}])
    eager.append_tape([{"event": "b"}])
    assert len(syncs) == 4
    eager.close()


def test_two_fsyncs_per_merged_version(tmp_path, monkeypatch):
    store, _ = opened(tmp_path, fsync=True, tape_sync_s=3600)
    store.append(record(0, 1), META)  # the first record also syncs the new log's directory
    syncs = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (syncs.append(fd), real(fd))[1])
    store.append(record(0, 2), META)
    store.append_tape([{"event": "round"}])
    assert len(syncs) == 2  # the record, then its mark; the mirror's copy is written through
    mirror = tmp_path / "state" / "durable.mirror.log"
    assert mirror.read_bytes() == (tmp_path / "state" / "durable.log").read_bytes()
    store.flush_tape()
    assert len(syncs) == 4  # ... and fsynced with the tape
    store.close()


def test_status_write_errors_warn_once_and_never_raise(tmp_path, monkeypatch, caplog):
    path = tmp_path / "status" / "syncer-0.json"
    status.write_status(path, {"v": 1})

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with caplog.at_level(logging.WARNING, logger="ddiloco.service.base.status"):
        for v in (2, 3, 4):
            status.write_status(path, {"v": v})
    monkeypatch.undo()
    assert [r.getMessage().count(str(path)) for r in caplog.records] == [1]
    assert status.read_status(path) == {"v": 1} and not path.with_suffix(".tmp").exists()
    status.write_status(path, {"v": 5})
    assert status.read_status(path) == {"v": 5}
