"""The run folder is the truth: damage to any two of the store's files either restores every
durable version or is one StateError line (never a silent rollback); a CRC-valid record whose
header is not ours is one line, not a traceback; a run folder whose state was deleted is refused
at start, and ``start_over`` is the explicit way to begin again."""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.syncer import FragmentRecord
from ddiloco.service.syncer import store as persist
from ddiloco.service.syncer.store import StateError, SyncerStore, start_over

torch.set_num_threads(1)

LAYOUT = balanced_layout([TensorSpec("w", (6, 4)), TensorSpec("b", (5,))], 2)
META = {"clock": 1}


def record(p: int, version: int) -> FragmentRecord:
    g = torch.Generator().manual_seed(100 * p + version)
    values = [torch.randn(pc.shape, generator=g) for pc in LAYOUT.fragments[p]]
    return FragmentRecord(p, version, 10 * version, values, [v * 0.5 for v in values])


def opened(run_dir: Path) -> tuple[SyncerStore, persist.Restored | None]:
    store = SyncerStore(run_dir, fsync=False)
    return store, store.restore(LAYOUT, [0, 1])


def a_store(run_dir: Path) -> dict[int, int]:
    """Appends around two snapshots, so that both snapshots, both logs (one with several
    records), both mark files and the tape exist; the durable versions."""
    store, _ = opened(run_dir)
    store.append(record(1, 1), META)
    store.append(record(0, 1), META)
    store.append(record(0, 2), META)
    store.snapshot([record(0, 2), record(1, 1)], META)
    store.append(record(0, 3), META)
    store.append(record(1, 2), META)
    store.snapshot([record(0, 3), record(1, 2)], META)
    for v in (4, 5):
        store.append(record(0, v), META)
    store.append(record(1, 3), META)
    store.append_tape([{"event": "round", "fragment": 0, "version": 5}])
    durable = store.durable_versions()
    store.close()
    return durable


def _last_record_start(data: bytes) -> int:
    pos = last = 0
    while pos + 16 <= len(data):
        last = pos
        pos += 16 + struct.unpack_from("<Q", data, pos + 4)[0]
    return last


def drop_last(path: Path) -> None:
    """The sneakiest truncation: a file that still reads as valid, one entry shorter."""
    data = path.read_bytes()
    if path.name.startswith("frag-"):
        cut = _last_record_start(data)
    elif path.name.startswith("durable"):
        cut = max(0, len(data) - persist.MARK_SIZE)
    else:
        cut = len(data) // 2
    path.write_bytes(data[:cut])


DAMAGES: dict[str, Callable[[Path], None]] = {
    "delete": lambda p: p.unlink(),
    "truncate": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "zero": lambda p: p.write_bytes(bytes(p.stat().st_size)),
    "drop-last": drop_last,
}


def check_restore(run_dir: Path, durable: dict[int, int], what: str) -> str:
    """Restore: every durable version with its exact values, or one StateError line."""
    try:
        store, found = opened(run_dir)
    except StateError as e:
        msg = str(e)
        assert "\n" not in msg and len(msg) < 2000, (what, msg)
        return "refused"
    try:
        got = {p: r.version for p, r in (found.fragments if found else {}).items()}
        assert got == durable, (what, got, durable)  # never lower, and nothing that was not made
        for p, rec in (found.fragments if found else {}).items():
            want = record(p, rec.version)
            assert all(torch.equal(a, b) for a, b in zip(rec.values, want.values)), (what, p)
    finally:
        store.close()
    again, found = opened(run_dir)  # the marks were written anew: a second restore agrees
    assert {p: r.version for p, r in found.fragments.items()} == durable, what
    again.close()
    return "restored"


def test_damage_to_any_two_files_restores_every_durable_version_or_is_refused(tmp_path, caplog):
    pristine = tmp_path / "pristine"
    durable = a_store(pristine)
    assert durable == {0: 5, 1: 3}
    files = sorted(p.name for p in (pristine / "state").iterdir() if p.name != "syncer.lock")  # a lock, no state
    assert {"FORMAT", "durable.log", "durable.mirror.log", "frag-0.log", "frag-1.log", "snapshot.bin",
            "tape.jsonl"} <= set(files)  # fmt: skip
    outcomes: dict[str, int] = {}
    cases = [((a,), (da,)) for a in files for da in DAMAGES]
    cases += [((a, b), (da, db)) for a, b in itertools.combinations(files, 2) for da in DAMAGES for db in DAMAGES]
    caplog.set_level(logging.ERROR, logger="ddiloco.service.syncer.store")  # the warnings are expected here
    for i, (names, damages) in enumerate(cases):
        d = tmp_path / f"case-{i}"
        shutil.copytree(pristine, d)
        for name, damage in zip(names, damages):
            DAMAGES[damage](d / "state" / name)
        what = " + ".join(f"{dmg} {n}" for n, dmg in zip(names, damages))
        result = check_restore(d, durable, what)
        outcomes[result] = outcomes.get(result, 0) + 1
        shutil.rmtree(d)
    assert outcomes["restored"] > 0 and outcomes["refused"] > 0, outcomes
    assert sum(outcomes.values()) == len(cases) > 300


def test_losing_a_log_and_a_mark_file_at_once_is_refused_not_a_rollback(tmp_path):
    """The issue's own case: frag-0.log and durable.log gone; the old store restored version 2
    from the snapshot and said nothing."""
    a_store(tmp_path)
    (tmp_path / "state" / "frag-0.log").unlink()
    (tmp_path / "state" / "durable.log").unlink()
    with pytest.raises(StateError, match="truncated or deleted.*durable.mirror.log") as e:
        opened(tmp_path)
    assert "\n" not in str(e.value)


# -- a record with a valid checksum and a header that is not ours ----------------------------


def framed(header: bytes, magic: bytes = b"DDLR", tail: bytes = b"") -> bytes:
    body = struct.pack("<I", len(header)) + header + tail
    return struct.pack("<4sQI", magic, len(body), zlib.crc32(body)) + body


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (b"\xff\xfenot json", "not JSON"),
        (b"[1, 2]", "a JSON list, not an object"),
        (b'{"tensors": []}', "no sequence number"),
        (b'{"seq": 1, "syncer": {}, "pieces": [], "meta": {"fragment": "x"}, "tensors": []}', "fragment meta"),
        (b'{"tensors": [["v0", "float32", [4], 999]]}', "claims 999 bytes"),
        (b'{"tensors": [["v0", "pickle", [4], 16]]}', "is not [name, dtype, shape, bytes]"),
        (b"[" * 5000 + b"]" * 5000, "not JSON"),
    ],
)
def test_a_crc_valid_record_with_a_bad_header_is_one_line(tmp_path, header, why):
    store, _ = opened(tmp_path)
    store.append(record(0, 1), META)
    store.close()
    log = tmp_path / "state" / "frag-0.log"
    good = log.read_bytes()
    for at in ("tail", "fsynced"):  # past the marked end (never a torn append), and inside it
        log.write_bytes(good + framed(header) if at == "tail" else framed(header) + good)
        with pytest.raises(StateError, match="bad header") as e:
            opened(tmp_path)
        msg = str(e.value)
        assert "\n" not in msg and why in msg and "frag-0.log is corrupt at byte" in msg, msg


def test_a_record_whose_tensors_do_not_fit_the_layout_is_one_line(tmp_path):
    store, _ = opened(tmp_path)
    store.append(record(0, 1), META)
    store.close()
    log = tmp_path / "state" / "frag-0.log"
    end, header = persist._parse(bytearray(log.read_bytes()), 0, b"DDLR")
    fields = {k: v for k, v in header.items() if k not in ("_data", "tensors", "format")}
    log.write_bytes(b"".join(bytes(memoryview(b)) for b in persist._frame(b"DDLR", fields, {"v0": torch.ones(3)})))
    for name in ("durable.log", "durable.mirror.log"):  # accept what is readable: the record is read
        (tmp_path / "state" / name).unlink()
    with pytest.raises(StateError, match="holds float32 \\(3,\\) as v0 of fragment 0.*damaged") as e:
        opened(tmp_path)
    assert "\n" not in str(e.value)


def test_a_snapshot_with_a_bad_header_is_passed_over_and_the_marks_still_hold(tmp_path, caplog):
    durable = a_store(tmp_path)
    (tmp_path / "state" / "snapshot.bin").write_bytes(framed(b'{"seq": "x", "tensors": []}', b"DDLS"))
    with caplog.at_level(logging.WARNING, logger="ddiloco.service.syncer.store"):
        store, found = opened(tmp_path)
    assert {p: r.version for p, r in found.fragments.items()} == durable
    assert any("snapshot.bin" in r.getMessage() and "bad header" in r.getMessage() for r in caplog.records)
    store.close()


# -- a run folder whose state is gone -------------------------------------------------------


def a_run_folder(run_dir: Path) -> None:
    """What a syncer leaves: run.json, its run log, a durable state."""
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"format": 2, "started_at": 0.0}))
    store, _ = opened(run_dir)
    (run_dir / "metrics").mkdir()
    (run_dir / "metrics" / "run.jsonl").write_text('{"event": "run", "time": 0.0, "what": "start", "reason": ""}\n')
    store.append(record(0, 1), META)
    store.close()


def test_a_deleted_state_folder_is_refused_and_start_over_is_explicit(tmp_path):
    run = tmp_path / "run"
    a_run_folder(run)
    shutil.rmtree(run / "state")
    with pytest.raises(StateError) as e:
        opened(run)
    msg = str(e.value)
    assert "\n" not in msg and "1 records in metrics/run.jsonl" in msg and "is missing or empty" in msg
    assert "--start-over" in msg and "backup" in msg
    assert not (run / "state" / "FORMAT").exists()  # nothing was started
    start_over(run)
    runlog = [json.loads(line) for line in (run / "metrics" / "run.jsonl").read_text().splitlines()]
    assert runlog[-1]["what"] == "start_over" and "missing" in runlog[-1]["reason"]
    store, found = opened(run)
    assert found is None and store.durable_versions() == {0: 0, 1: 0}
    store.append(record(0, 1), META)
    store.close()
    with pytest.raises(StateError, match="holds syncer state.*drop it"):
        start_over(run)  # it never deletes a version
    store, found = opened(run)  # and restarts resume, no flag needed
    assert found.fragments[0].version == 1
    store.close()


@pytest.mark.parametrize("left", ["empty folder", "only the lock", "only the tape"])
def test_an_emptied_state_folder_is_refused_too(tmp_path, left):
    run = tmp_path / "run"
    a_run_folder(run)
    for f in (run / "state").iterdir():
        if not (left == "only the lock" and f.name == "syncer.lock") and not (
            left == "only the tape" and f.name == "tape.jsonl"
        ):
            f.unlink()
    store = SyncerStore(run, fsync=False)
    with pytest.raises(StateError, match="is missing or empty|FORMAT|format 1") as e:
        store.restore(LAYOUT, [0, 1])
    assert "\n" not in str(e.value)


def test_a_fresh_or_just_started_folder_is_no_history(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"format": 2}))
    store, found = opened(run)  # a fresh run: nothing to refuse
    assert found is None
    store.close()
    (run / "metrics").mkdir()
    (run / "metrics" / "run.jsonl").write_text('{"event": "run", "time": 0.0, "what": "start", "reason": ""}\n')
    store, found = opened(run)  # killed before its first merge: its state folder says it started
    assert found is None
    store.close()


def test_shards_see_each_others_marks_but_not_the_first_ones_early_run_log(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    stores = [SyncerStore(run, shard=i, num_shards=2, fsync=False) for i in (0, 1)]
    assert stores[0].restore(LAYOUT, [0]) is None
    (run / "metrics").mkdir()  # shard 0 writes the run log after its restore ...
    (run / "metrics" / "run.jsonl").write_text('{"event": "run", "time": 0.0, "what": "start", "reason": ""}\n')
    assert stores[1].restore(LAYOUT, [1]) is None  # ... which a slower second shard must not take for history
    for i, store in enumerate(stores):
        store.append(record(i, 1), META)
        store.close()
    shutil.rmtree(run / "state" / "shard-1")
    with pytest.raises(StateError, match="durable marks in .*shard-0.*start-over"):
        SyncerStore(run, shard=1, num_shards=2, fsync=False).restore(LAYOUT, [1])
    start_over(run, shard=1, num_shards=2)
    assert SyncerStore(run, shard=1, num_shards=2, fsync=False).restore(LAYOUT, [1]) is None
