"""``ddiloco migrate RUN_DIR``: bring a run folder written by the previous ddiloco to this one's
formats, in place, so that the run resumes where it was.

What it moves (each from the previous format only; another is refused with what to do):

- ``run.json``, run folder format 1 -> 2: it gains ``started_at`` (from its ``created`` stamp);
- each syncer state folder, store format 3 -> 4 (``service/syncer/store/migrate.py``).

A learner's saved state (``learner-M/``, format 1) has had one format so far. The command is
idempotent: run again, it says there is nothing to do.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from ddiloco.errors import DDiLoCoError
from ddiloco.report.rundir import RUN_FORMAT, is_run_dir
from ddiloco.service.syncer.store.migrate import check_state, locked, migrate_state, replace_whole, state_dirs

PREVIOUS_RUN_FORMAT = 1


def run_json_needs_migrating(run_dir: Path) -> bool:
    """Whether ``run.json`` is of format 1 (False: format 2); DDiLoCoError for anything else."""
    marker = run_dir / "run.json"
    try:
        found = json.loads(marker.read_text()).get("format")
    except FileNotFoundError:
        raise DDiLoCoError(
            f"{run_dir} has no run.json: it was written before run folders had a format, and cannot be migrated"
        ) from None
    except (OSError, ValueError, AttributeError) as e:
        raise DDiLoCoError(f"{marker} is unreadable ({e}): restore it from a backup") from None
    if found not in (PREVIOUS_RUN_FORMAT, RUN_FORMAT):
        raise DDiLoCoError(
            f"{run_dir} is a run folder of format {found}; `ddiloco migrate` moves format {PREVIOUS_RUN_FORMAT} to "
            f"{RUN_FORMAT} only"
        )
    return found == PREVIOUS_RUN_FORMAT


def migrate_run_json(run_dir: Path) -> str:
    """Run folder format 1 -> 2: ``run.json`` gains ``started_at`` (from its ``created`` stamp)."""
    marker = run_dir / "run.json"
    info = json.loads(marker.read_text())
    try:
        started = dt.datetime.fromisoformat(str(info.get("created"))).timestamp()
    except ValueError:
        started = marker.stat().st_mtime  # (no stamp we can read: when run.json was last written)
    replace_whole(marker, json.dumps({**info, "format": RUN_FORMAT, "started_at": started}).encode())
    return f"{run_dir}: run folder format {PREVIOUS_RUN_FORMAT} -> {RUN_FORMAT} (run.json gains started_at)"


def migrate(run_dir: str | Path) -> list[str]:
    """Migrate a run folder in place; one line per change (empty: it was current already). Every
    check comes first and every store's lock is held throughout; run.json goes last, so a folder
    refused or interrupted half-way still reads as the previous format and migrates again."""
    d = Path(run_dir)
    if (d / "FORMAT").exists() and not (d / "run.json").exists():
        raise DDiLoCoError(f"{d} is a syncer state folder, not a run folder: give the folder that holds it")
    if not is_run_dir(d):
        raise DDiLoCoError(f"{d} is not a run folder (no run.json, no state/): give the --run-dir of the run")
    run_json = run_json_needs_migrating(d)
    stores = [s for s in state_dirs(d) if check_state(s)]
    with locked(stores):
        done = [migrate_state(s) for s in stores]
        if run_json:
            done.append(migrate_run_json(d))
    return done
