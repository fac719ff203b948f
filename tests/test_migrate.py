"""Formats of the previous ddiloco restore after `ddiloco migrate`, or are refused naming it
(issue 36 item 6).

``tests/fixtures/store-3/run`` is a run folder as the build before 1a3601d (syncer store format
3) left it when its `ddiloco train` was interrupted mid-run (its run.json, config.toml and
state/; made with that build's own `ddiloco train` on the synthetic workload, hidden 16).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.config import load_config
from ddiloco.errors import DDiLoCoError
from ddiloco.migrate_cmd import migrate
from ddiloco.report.rundir import prepare_run_dir
from ddiloco.service.base.transport import InProcessNetwork
from ddiloco.service.syncer.service import SyncerService
from ddiloco.service.syncer.store.errors import StateError
from ddiloco.service.syncer.store.frames import MARK_SIZE, MIRROR, _unpack_mark
from ddiloco.service.syncer.store.migrate import check_state

FIXTURE = Path(__file__).parent / "fixtures" / "store-3" / "run"


@pytest.fixture()
def old_run(tmp_path) -> Path:
    d = tmp_path / "run"
    shutil.copytree(FIXTURE, d)
    return d


def marked_versions(state: Path) -> dict[int, int]:
    """Each fragment's newest durable version, from the format-3 marks (what must come back)."""
    buf, out = (state / "durable.log").read_bytes(), {}
    for pos in range(0, len(buf) - MARK_SIZE + 1, MARK_SIZE):
        mark = _unpack_mark(buf, pos)
        assert mark is not None
        out[mark[0]] = max(out.get(mark[0], 0), mark[1])
    return out


def open_service(run_dir: Path) -> SyncerService:
    cfg = load_config(run_dir / "config.toml", [f"run.run_dir={run_dir}"])
    return SyncerService(cfg, InProcessNetwork().syncer("inproc://s"), run_dir, fsync=False)


def test_a_format_3_store_is_refused_naming_the_command_that_migrates_it(old_run):
    with pytest.raises(StateError, match=rf"format 3 .* migrate it in place with `ddiloco migrate {old_run}`"):
        open_service(old_run)
    assert json.loads((old_run / "state" / "FORMAT").read_text()) == {"format": 3}  # nothing was written


def test_after_migrate_every_durable_version_of_the_old_store_restores(old_run):
    want = marked_versions(old_run / "state")
    assert len(want) == 24 and min(want.values()) >= 1  # the fixture holds merged versions
    assert migrate(old_run) == [f"{old_run / 'state'}: syncer state format 3 -> 4 (durable.mirror.log written, "
                                f"{24 * 28} bytes of marks)"]  # fmt: skip
    assert migrate(old_run) == []  # idempotent
    service = open_service(old_run)
    try:
        assert service.restored and service.core.versions() == [want[p] for p in range(24)]
    finally:
        service.stop()
        service.shutdown()


def test_the_cli_migrates_and_says_so_in_a_line_each(old_run):
    run = [sys.executable, "-m", "ddiloco", "migrate", str(old_run)]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"{old_run / 'state'}: syncer state format 3 -> 4 (durable.mirror.log written, 672 bytes of marks)",
        f"{old_run}: migrated; it resumes as before",
    ]
    again = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert again.stdout.strip() == f"{old_run}: nothing to migrate"
    not_run = subprocess.run([*run[:-1], str(old_run / "state")], capture_output=True, text=True, timeout=120)
    assert not_run.returncode != 0 and "Traceback" not in not_run.stderr
    assert "is a syncer state folder, not a run folder" in not_run.stderr


def test_a_store_held_by_a_running_syncer_is_not_migrated_and_nothing_else_is_either(old_run):
    import fcntl

    info = json.loads((old_run / "run.json").read_text())
    (old_run / "run.json").write_text(json.dumps({**info, "format": 1}))  # a folder that needs both moves
    with open(old_run / "state" / "syncer.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(StateError, match="in use by a running syncer: stop it, then migrate"):
            migrate(old_run)
    assert json.loads((old_run / "state" / "FORMAT").read_text()) == {"format": 3}
    assert json.loads((old_run / "run.json").read_text())["format"] == 1 and not (old_run / "state" / MIRROR).exists()
    assert len(migrate(old_run)) == 2  # once the syncer has stopped: both


def test_a_migration_cut_between_the_mirror_and_format_is_done_again_and_restores(old_run):
    """A crash after the mirror was written, before FORMAT: the folder still reads as format 3
    (the mirror a torn copy here), and a second run of the command finishes it."""
    marks = (old_run / "state" / "durable.log").read_bytes()
    (old_run / "state" / MIRROR).write_bytes(marks[: len(marks) // 2 + 3])
    assert json.loads((old_run / "state" / "FORMAT").read_text()) == {"format": 3}
    assert migrate(old_run) and (old_run / "state" / MIRROR).read_bytes() == marks
    service = open_service(old_run)
    try:
        assert service.core.versions() == [marked_versions(old_run / "state")[p] for p in range(24)]
    finally:
        service.stop()
        service.shutdown()


@pytest.mark.parametrize("found", [1, 2, 5, "unreadable"])
def test_other_store_formats_are_refused_not_guessed(old_run, found):
    fmt = old_run / "state" / "FORMAT"
    fmt.write_text("{" if found == "unreadable" else json.dumps({"format": found}))
    with pytest.raises(StateError, match=f"format {found}; `ddiloco migrate` moves format 3 to 4 only"):
        check_state(old_run / "state")
    with pytest.raises(StateError, match=f"format {found}"):
        migrate(old_run)


def test_a_format_1_run_folder_is_refused_naming_migrate_and_migrates(tmp_path):
    d = tmp_path / "run1"
    d.mkdir()
    # run.json exactly as the format-1 build wrote it (37f6e90^, report/rundir.py)
    (d / "run.json").write_text(
        json.dumps({"format": 1, "created": "2026-11-30T10:00:00+00:00", "by": "ddiloco train"})
    )
    with pytest.raises(DDiLoCoError, match=rf"format 1, this ddiloco writes format 2: migrate it in place with "
                                           rf"`ddiloco migrate {d}`"):  # fmt: skip
        prepare_run_dir(d, "test")
    assert migrate(d) == [f"{d}: run folder format 1 -> 2 (run.json gains started_at)"]
    info = json.loads((d / "run.json").read_text())
    assert info["format"] == 2 and info["started_at"] == 1796032800.0 and info["by"] == "ddiloco train"
    assert prepare_run_dir(d, "test") == d
