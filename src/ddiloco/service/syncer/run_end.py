"""The syncer's work at the run's end, done while it goes on answering: ``EndWork``, and the
final evaluation of the global model (``final_eval``).

After the end the session hands the core nothing more, so its values are final: the final
evaluation reads them on its own thread while the loop answers ``RunEnd`` to any learner that
registers or speaks (a supervisor's restart, a learner behind a held link). The driver leaves
once ``runtime.end_linger_s`` has passed (or it was stopped) and this work is over.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from torch import nn

from ddiloco.config import Config
from ddiloco.report.tape import read_jsonl
from ddiloco.training.empty_model import build_to_receive

log = logging.getLogger(__name__)


class EndWork:
    """Tasks run once, one after the other, on a thread of their own."""

    def __init__(self) -> None:
        self.tasks: list[Callable[[], None]] = []
        """Run after those ``start`` is given (``SyncerServer``: its evaluate hook's final evaluation)."""
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def busy(self) -> bool:
        """Started and not over."""
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        """Wait for the tasks to be over, at most ``timeout_s`` (a failing loop's close waits so)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def start(self, first: list[Callable[[], None]]) -> None:
        """Run ``first``, then ``tasks``; a task that fails is logged and the next one runs."""
        tasks = [*first, *self.tasks]
        self._thread = threading.Thread(target=self._run, args=(tasks,), name="ddiloco-run-end", daemon=True)
        self._thread.start()

    @staticmethod
    def _run(tasks: list[Callable[[], None]]) -> None:
        for task in tasks:
            try:
                task()
            except Exception:  # the run's model is written; an evaluation that fails costs its figure only
                log.exception("the final evaluation failed; the final model is written all the same")


def final_eval(
    cfg: Config,
    run_dir: Path,
    load_into: Callable[[nn.Module], None],
    merged_tokens: float,
    run_age: float,
    processed_tokens: float | None = None,
) -> None:
    """Evaluate the final global model once (summary.json's eval loss): the workload's model,
    given every value by ``load_into``, on its evaluation batches; appended to
    ``metrics/eval.jsonl`` as ``final``. Skipped when the last record already is (a syncer
    started again on a finished run)."""
    from ddiloco.training.evaluate import evaluate
    from ddiloco.workloads.base import loss_unit
    from ddiloco.workloads.config import load_workload

    evals = read_jsonl(run_dir / "metrics" / "eval.jsonl")
    if any(e.get("final") for e in evals):  # (a run ends once: a final record is its final evaluation)
        return
    wl = load_workload(cfg.workload)
    # built for this one evaluation, then let go; not initialised where the workload allows,
    # since one shard (final_eval needs num_shards == 1) writes every value into it
    model = build_to_receive(wl, cfg.run.seed, "cpu").model
    load_into(model)
    loss = evaluate(wl, model, wl.eval_batches())
    rec = {
        "event": "eval",
        "time": run_age,
        "tokens": processed_tokens,
        "merged_tokens": merged_tokens,
        "loss": loss,
        "final": True,
        "unit": loss_unit(wl),
    }
    with open(run_dir / "metrics" / "eval.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    log.info("final eval loss %.4f %s", loss, loss_unit(wl))
