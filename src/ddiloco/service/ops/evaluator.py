"""``ddiloco evaluator``: a low-priority, single-thread process that evaluates the syncer's
latest global model every ``runtime.eval_interval_s`` and appends the loss to the run's metrics."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch

from ddiloco.config import Config
from ddiloco.lifecycle import ProgressLines, StopSignals
from ddiloco.protocol.messages import GlobalState
from ddiloco.report.rundir import prepare_run_dir
from ddiloco.report.summary import run_started_at
from ddiloco.report.tape import read_jsonl
from ddiloco.service.base import observer
from ddiloco.service.base.heap import release_free_memory
from ddiloco.service.base.keys import ClientKeys
from ddiloco.service.base.observer import write_global_states
from ddiloco.training.evaluate import evaluate
from ddiloco.training.layout import layout_for
from ddiloco.workloads.base import loss_unit
from ddiloco.workloads.config import load_workload

log = logging.getLogger(__name__)


def fetch_global(
    syncers: list[str], timeout_s: float = 5.0, keys: ClientKeys | None = None
) -> list[GlobalState] | None:
    """Every syncer shard's fragments (``observer.fetch_global``); None if any shard does not
    answer in time: the evaluator tries again at its next interval."""
    try:
        return observer.fetch_global(syncers, timeout_s, keys, requester="evaluator")
    except observer.NoReply as e:
        log.debug("%s", e)
        return None


def run_evaluator(
    cfg: Config, syncers: list[str], run_dir: str, once: bool = False, keys: ClientKeys | None = None
) -> int:
    torch.set_num_threads(1)
    try:
        os.nice(10)  # low priority: never steal a core from a learner
    except OSError:
        pass
    with StopSignals("ddiloco evaluator") as signals:
        return _evaluate_until_the_end(cfg, syncers, run_dir, once, keys, signals)


def _evaluate_until_the_end(
    cfg: Config, syncers: list[str], run_dir: str, once: bool, keys: ClientKeys | None, signals: StopSignals
) -> int:
    """Evaluate every runtime.eval_interval_s until the run ends (or a signal)."""
    wl = load_workload(cfg.workload)
    model = wl.build_model(cfg.run.seed)
    layout = layout_for(model, wl, cfg.algo).fragments
    batches = wl.eval_batches()
    folder = prepare_run_dir(run_dir, "ddiloco evaluator")
    out = folder / "metrics" / "eval.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = run_started_at(folder) or time.time()
    progress = ProgressLines(cfg.runtime.progress_interval_s, enabled=not sys.stderr.isatty())
    next_at = next_look = time.monotonic()
    while not signals.requested:
        if time.monotonic() >= next_look:  # a syncer sharing this folder recorded the run's end
            next_look = time.monotonic() + 1.0
            runlog = read_jsonl(folder / "metrics" / "run.jsonl")
            if runlog and runlog[-1].get("what") == "end":
                log.info("the run ended: the evaluator stops")
                return 0
        if time.monotonic() >= next_at:
            next_at += cfg.runtime.eval_interval_s
            states = fetch_global(syncers, keys=keys)
            if states is not None:
                versions = write_global_states(model, layout, states)
                merged = sum(s.merged_tokens for s in states) / len(states)
                ended = all(s.run_ended for s in states)
                del states  # the model holds the values now: one copy, not two, while it evaluates
                release_free_memory()
                loss = evaluate(wl, model, batches)
                rec = {
                    "event": "eval",
                    "time": time.time() - t0,
                    "tokens": 0,
                    "merged_tokens": merged,
                    "loss": loss,
                    "final": False,
                    "unit": loss_unit(wl),
                    "versions": versions,
                }
                with open(out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                line = f"evaluator: eval loss {loss:.4f} {loss_unit(wl)} at {merged:,.0f} merged tokens"
                progress.maybe(lambda: line)  # noqa: B023 (called at once, inside this iteration)
                if ended:
                    log.info("the run ended: the evaluator stops")
                    return 0
            if once:
                return 0
        time.sleep(0.1)
    return 0
