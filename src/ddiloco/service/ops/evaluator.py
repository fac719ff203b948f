"""``ddiloco evaluator``: a low-priority, single-thread process that follows the syncer's global
model by what changed and evaluates it at a cadence in merged tokens, appending the loss to the
run's metrics.

Every ``runtime.eval_interval_s`` it polls every shard (a versions-only ``FetchGlobal``: a few
hundred bytes, no values). When the merged tokens have passed the next mark of
``runtime.eval_every_tokens`` (automatic by default: a tenth of the learners' steady traffic at
most; ``protocol.config.EvalCadence``), it sends each shard the versions it holds and gets back
the exact (fp32) values of the fragments whose version moved since, writes them into its model
and evaluates it. Each record of ``metrics/eval.jsonl`` says where the evaluator runs, the
fragments it fetched and the bytes it moved since the previous one (polls included); the syncer
counts the same bytes as ``observer`` traffic, apart from the learners'. It may run anywhere the
syncer can be reached, the syncer's machine included.

Its model is built to receive (``training.empty_model.build_to_receive``: on the meta device,
then given memory without initialising it, where the workload allows): every value comes from
the syncer, and it evaluates only once every fragment has been written into the model (a shard
that did not answer leaves it incomplete: it asks again at the next poll).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch

from ddiloco.config import Config
from ddiloco.lifecycle import StopSignals
from ddiloco.protocol.messages import FetchGlobal, GlobalState
from ddiloco.report.rundir import prepare_run_dir
from ddiloco.report.summary import run_started_at
from ddiloco.report.tape import read_jsonl
from ddiloco.service.base import observer
from ddiloco.service.base.heap import release_free_memory
from ddiloco.service.base.keys import ClientKeys
from ddiloco.service.base.observer import Evaluations, GlobalCopy, Moved, Seen, cadence_of, here
from ddiloco.training.empty_model import build_to_receive
from ddiloco.training.evaluate import evaluate
from ddiloco.training.layout import layout_for
from ddiloco.workloads.base import loss_unit
from ddiloco.workloads.config import load_workload

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 5.0
"""How long one request to a shard may wait for its answer; without one the evaluator asks again
at its next poll."""


def fetch_global(
    syncers: list[str], timeout_s: float = 5.0, keys: ClientKeys | None = None
) -> list[GlobalState] | None:
    """Every syncer shard's fragments, all of them (``observer.fetch_global``); None if any shard
    does not answer in time."""
    try:
        return observer.fetch_global(syncers, timeout_s, keys, requester="evaluator")
    except observer.NoReply as e:
        log.debug("%s", e)
        return None


def shard_asker(syncers: list[str], keys: ClientKeys | None, timeout_s: float = FETCH_TIMEOUT_S) -> observer.AskShard:
    """``GlobalCopy``'s requests over ZeroMQ, one connection per request (None: no answer in time)."""

    def ask(shard: int, request: FetchGlobal, moved: Moved) -> GlobalState | None:
        try:
            return observer.ask(syncers[shard], request, GlobalState, timeout_s, keys, moved)
        except observer.NoReply as e:
            log.debug("%s", e)
            return None

    return ask


def processed_tokens(syncer: str, keys: ClientKeys | None) -> float | None:
    """The fleet's processed tokens as the syncer counts them now (a ``StatusRequest``: every
    shard counts the whole fleet), for an evaluation's record; None when it does not answer."""
    try:
        value = observer.fetch_status(syncer, FETCH_TIMEOUT_S, keys, requester="evaluator").get("processed_tokens")
    except observer.NoReply as e:
        log.debug("%s", e)
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


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
    """Poll every runtime.eval_interval_s, evaluate at the cadence, until the run ends (or a
    signal). ``once``: one fetch and evaluation now, whatever the cadence."""
    wl = load_workload(cfg.workload)
    built = build_to_receive(wl, cfg.run.seed, "cpu")  # every value comes from the syncer
    model = built.model
    layout = layout_for(model, wl, cfg.algo).fragments
    batches = wl.eval_batches()
    folder = prepare_run_dir(run_dir, "ddiloco evaluator")
    out = folder / "metrics" / "eval.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = run_started_at(folder) or time.time()
    copy = GlobalCopy(model, layout, len(syncers), shard_asker(syncers, keys), "evaluator")
    evals = Evaluations(copy, cadence_of(cfg), f"ddiloco evaluator on {here()}")
    log.info(
        "%s follows %s: a poll every %g s (runtime.eval_interval_s), an evaluation %s; its model %s",
        evals.where, ", ".join(syncers), cfg.runtime.eval_interval_s, evals.describe(),
        "is given memory without initialisation" if built.empty else f"is initialised ({built.why})",
    )  # fmt: skip
    next_poll = next_look = time.monotonic()
    while not signals.requested:
        if time.monotonic() >= next_look:  # a syncer sharing this folder recorded the run's end
            next_look = time.monotonic() + 1.0
            runlog = read_jsonl(folder / "metrics" / "run.jsonl")
            if runlog and runlog[-1].get("what") == "end":
                log.info("the run ended: the evaluator stops")
                return 0
        if time.monotonic() >= next_poll:
            next_poll = time.monotonic() + cfg.runtime.eval_interval_s
            seen = copy.poll()
            final = seen is not None and seen.run_ended
            if final and cfg.runtime.final_eval:
                log.info("the run ended: the evaluator stops (the syncer evaluates the final model)")
                return 0
            if seen is not None and (once or final or evals.due(seen)):
                seen = copy.refresh()
                if seen is not None and not copy.complete:
                    log.info("not every fragment has come from the syncer yet: no evaluation; asking again")
                    seen = None
                if seen is not None:
                    tokens = processed_tokens(syncers[0], keys)  # the fleet's count as the model was fetched
                    rec = {**_evaluate(wl, model, batches, seen, time.time() - t0), "versions": copy.versions()}
                    rec["tokens"] = tokens
                    rec.update(evals.made(seen))
                    with open(out, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    log.info(
                        "eval loss %.4f %s at %s merged tokens; %s",
                        rec["loss"], rec["unit"], f"{seen.merged_tokens:,.0f}", evals.line(rec, seen),
                    )  # fmt: skip
                    if seen.run_ended:
                        log.info("the run ended: the evaluator stops")
                        return 0
            if once:
                return 0
        time.sleep(0.1)
    return 0


def _evaluate(wl: Any, model: torch.nn.Module, batches: Any, seen: Seen, age_s: float) -> dict[str, Any]:
    """Evaluate the model as the copy holds it: the record for metrics/eval.jsonl."""
    release_free_memory()  # the fetched values are in the model now: one copy, not two, while it evaluates
    loss = evaluate(wl, model, batches)
    return {
        "event": "eval",
        "time": age_s,
        "tokens": None,  # the fleet's processed tokens: the caller asks the syncer's status
        "merged_tokens": seen.merged_tokens,
        "loss": loss,
        "final": False,
        "unit": loss_unit(wl),
    }
