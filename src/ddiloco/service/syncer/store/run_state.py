"""A run folder whose syncer state is missing or empty: whether it holds a run (then a start is
refused, it would throw the run away) and ``start_over``, the explicit way to begin again."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ddiloco.service.syncer.store.errors import StateError
from ddiloco.service.syncer.store.folder import StateFolder, has_state
from ddiloco.service.syncer.store.frames import MARKS, MIRROR

log = logging.getLogger(__name__)

_HISTORY_RECORDS = 100_000  # lines of metrics/run.jsonl looked at (it holds a few per session)


def run_history(run_dir: Path, state_dir: Path) -> str | None:
    """What in ``run_dir`` shows that a run went on there, for a syncer whose state folder
    ``state_dir`` is missing or empty; None for a run folder that never got that far.

    Evidence: another shard's (or the flat folder's) durable marks, a summary, a final model, and
    for the only or first shard the run log (only shard 0 writes it, after its own restore, so a
    second shard starting beside a fresh first one never sees it too early)."""
    root = run_dir / "state"
    for d in [root, *sorted(root.glob("shard-*"))] if root.is_dir() else []:
        if d != state_dir and any((d / name).is_file() and (d / name).stat().st_size > 0 for name in (MARKS, MIRROR)):
            return f"durable marks in {d}"
    for name in ("summary.json", "tape.jsonl"):
        if (run_dir / name).is_file():
            return name
    final = run_dir / "final"
    if final.is_dir() and any(final.glob("*.safetensors")):
        return "a final model"
    if state_dir in (root, root / "shard-0"):
        runlog = run_dir / "metrics" / "run.jsonl"
        try:
            with open(runlog, "rb") as f:
                lines = sum(1 for _, line in zip(range(_HISTORY_RECORDS), f) if line.strip())
        except OSError:
            lines = 0
        if lines:
            return f"{lines} records in metrics/run.jsonl"
    return None


def check_state(run_dir: str | Path, state_dir: Path | None = None, shard: int = 0, num_shards: int = 1) -> None:
    """StateError (one line) when ``run_dir`` holds a run but this shard's syncer state is missing
    or empty (``state_dir``, default that of ``shard`` of ``num_shards``): a start would silently
    begin at version 0 and write the initial weights as the run's final model."""
    root = Path(run_dir) / "state"
    d = state_dir if state_dir is not None else root if num_shards == 1 else root / f"shard-{shard}"
    if has_state(d):
        return
    history = run_history(Path(run_dir), d)
    if history is not None:
        raise StateError(
            f"{run_dir} holds a run ({history}) but its syncer state {d} is missing or empty: starting at "
            "version 0 would throw the run away; restore that folder from a backup, or start the run over from "
            "its initial model with --start-over (start_over=True in Python)"
        )


def start_over(run_dir: str | Path, shard: int = 0, num_shards: int = 1, by: str = "--start-over") -> None:
    """Start a run over from its initial model in ``run_dir``, whose syncer state is missing or
    empty (``--start-over``): the state folder is made anew (FORMAT, empty marks) and the run log
    says so, so that the syncer's restore starts at version 0 instead of refusing. A state folder
    that still holds anything is refused (this never deletes a version): resume it without the flag."""
    store = StateFolder(run_dir, shard, num_shards, fsync=True)
    d = store.dir
    with store._disk("taking the syncer lock"):
        store._take_lock()
    try:
        if has_state(d):
            raise StateError(
                f"{by}: {d} holds syncer state; a start resumes from it without {by}: drop it (to train from "
                "scratch, use a fresh run folder)"
            )
        history = run_history(store.root.parent, d)
        with store._disk("creating the syncer state folder"):
            store._init_dir()
        log.warning(
            "%s: %s starts over from its initial model at version 0 (%s)", by, store.root.parent,
            f"its state was missing; the run had {history}" if history else "nothing was there",
        )  # fmt: skip
        if shard == 0:  # the run log is the run's own record of what happened to it
            from ddiloco.report.summary import run_started_at
            from ddiloco.report.tape import append_run_event

            started = run_started_at(store.root.parent)
            age = max(0.0, time.time() - started) if started is not None else 0.0
            append_run_event(store.root.parent, age, "start_over", f"{by}: the syncer state was missing ({history})")
    finally:
        store._release_lock()
