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
import os
from pathlib import Path

from ddiloco.errors import DDiLoCoError
from ddiloco.report.rundir import RUN_FORMAT, is_run_dir
from ddiloco.service.syncer.store.migrate import migrate_state, state_dirs

PREVIOUS_RUN_FORMAT = 1


def migrate_run_json(run_dir: Path) -> str | None:
    """Run folder format 1 -> 2 (``run.json`` gains ``started_at``); None when it is format 2."""
    marker = run_dir / "run.json"
    try:
        info = json.loads(marker.read_text())
        found = info.get("format")
    except FileNotFoundError:
        raise DDiLoCoError(
            f"{run_dir} has no run.json: it was written before run folders had a format, and cannot be migrated"
        ) from None
    except (OSError, ValueError, AttributeError) as e:
        raise DDiLoCoError(f"{marker} is unreadable ({e}): restore it from a backup") from None
    if found == RUN_FORMAT:
        return None
    if found != PREVIOUS_RUN_FORMAT:
        raise DDiLoCoError(
            f"{run_dir} is a run folder of format {found}; `ddiloco migrate` moves format {PREVIOUS_RUN_FORMAT} to "
            f"{RUN_FORMAT} only"
        )
    try:
        started = dt.datetime.fromisoformat(str(info.get("created"))).timestamp()
    except ValueError:
        started = marker.stat().st_mtime  # (no stamp we can read: when run.json was last written)
    tmp = run_dir / "run.json.migrate.tmp"
    tmp.write_text(json.dumps({**info, "format": RUN_FORMAT, "started_at": started}))
    os.replace(tmp, marker)
    return f"{run_dir}: run folder format {PREVIOUS_RUN_FORMAT} -> {RUN_FORMAT} (run.json gains started_at)"


def migrate(run_dir: str | Path) -> list[str]:
    """Migrate a run folder in place; one line per change (empty: it was current already)."""
    d = Path(run_dir)
    if (d / "FORMAT").exists() and not (d / "run.json").exists():
        raise DDiLoCoError(f"{d} is a syncer state folder, not a run folder: give the folder that holds it")
    if not is_run_dir(d):
        raise DDiLoCoError(f"{d} is not a run folder (no run.json, no state/): give the --run-dir of the run")
    done = [migrate_run_json(d)]
    done += [migrate_state(s) for s in state_dirs(d)]
    return [line for line in done if line is not None]
