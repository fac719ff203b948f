"""``ddiloco alive RUN_DIR --within SECONDS``: is the learner writing to RUN_DIR still stepping?

A learner's rank 0 rewrites ``RUN_DIR/status/learner-M.json`` between inner steps, every
``runtime.status_interval_s`` (``service/learner/process.py``), and at no other time while it
trains: a file written within SECONDS means the training loop went round recently. This is a
liveness probe for a supervisor (a Kubernetes exec probe, a cron check): exit 0 when the file
is fresh, else exit 1 with one line saying how old it is, or that there is none yet. It reads the
file's modification time, not its contents (a file being replaced is still a fresh one), and
imports neither torch nor the rest of ddiloco: a probe runs every few seconds.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from ddiloco.errors import UsageError

_STATUS = re.compile(r"^learner-(\d+)\.json$")  # rank 0's file; other ranks write learner-M.rankR.json


def status_file(run_dir: str | Path, learner: int | None) -> Path:
    """Learner ``learner``'s status file in ``run_dir``; without an id, the one learner whose
    file the folder holds (a learner pod's own run folder), or ``status/learner-?.json`` when it
    holds none yet. Several learners' files and no id: a UsageError."""
    folder = Path(run_dir) / "status"
    if learner is not None:
        return folder / f"learner-{learner}.json"
    try:
        found = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _STATUS.match(p.name)))
    except OSError:  # no status folder yet: the learner has not stepped
        found = []
    if len(found) > 1:
        ids = ", ".join(str(i) for i, _ in found)
        raise UsageError(f"{folder} holds the status files of learners {ids}: say which with --learner M")
    return found[0][1] if found else folder / "learner-?.json"


def check_alive(run_dir: str | Path, learner: int | None, within_s: float) -> tuple[bool, str]:
    """Whether the learner's status file was written within the last ``within_s`` seconds (by
    the wall clock), and one line saying so."""
    path = status_file(run_dir, learner)
    try:
        written = path.stat().st_mtime
    except OSError:
        return False, f"{path} is missing: the learner has not finished an inner step here yet"
    age = time.time() - written
    if age <= within_s:
        return True, f"{path} written {max(age, 0.0):.1f} s ago (within {within_s:g} s)"
    return False, f"{path} is {age:.1f} s old, older than {within_s:g} s: the learner has not stepped since"
