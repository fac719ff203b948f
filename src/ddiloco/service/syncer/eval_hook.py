"""``SyncerServer(..., evaluate=fn)``: the user's evaluation of the global model, off the merge path.

A background thread of the syncer's process fetches the global model as an observer (a
``FetchGlobal`` through the syncer's own message loop, like ``ddiloco evaluator``: the syncer
answers it between messages with a consistent copy, and never waits on the evaluation), writes
it into its own copy of the model and calls ``fn(model)`` every ``eval_interval_s``; on Linux the
thread runs at nice 10. When the syncer stops, after the final sync and the final model, it
evaluates that final model once more. Each result is one ``metrics/eval.jsonl`` record in the
evaluator's format, so the summary's eval loss and the report's first figure show it.

``fn`` returns the loss (a number, or a one-element tensor), or a dict with a numeric ``"loss"``
and any other numeric metrics (``{"loss": 0.29, "accuracy": 0.90}``: the others go to the
record's ``"metrics"``). A ``fn`` that raises, or returns anything else, costs one log line and
no record; the syncer serves on.

Memory: one copy of the model (parameters and buffers, made when the hook is set up), plus,
for each evaluation, the fetched global parameters (one more copy of them, transient; the syncer
encodes one for the reply too) and whatever ``fn`` allocates.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import reprlib
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddiloco.core.fragments import FragmentLayout
from ddiloco.errors import UsageError
from ddiloco.protocol.messages import FetchGlobal, GlobalState
from ddiloco.report.tape import read_jsonl
from ddiloco.service.base import observer
from ddiloco.service.base.keys import ClientKeys
from ddiloco.service.base.transport import InProcessNetwork
from ddiloco.service.base.wire import WireError, decode, encode

log = logging.getLogger(__name__)

EvalResult = float | Mapping[str, float]
"""What an evaluation hook returns: the loss, or ``{"loss": ..., other metrics ...}``."""
EvalFn = Callable[[nn.Module], EvalResult]
"""An evaluation hook: the global model (the hook's own CPU copy, in eval mode, under
``torch.no_grad()``) -> its loss, or a dict of metrics with a ``"loss"``."""

FETCH_TIMEOUT_S = 10.0
"""How long one fetch of the global model may take; without an answer the evaluation is
skipped until the next interval."""

FINAL_WAIT_S = 60.0
"""How long the final evaluation waits for an interval one still under way before it gives up."""

NICE = 10
"""The evaluation thread's niceness on Linux (a learner on the same machine keeps its core)."""

_REQUESTER = "evaluate hook"


def check_hook(evaluate: Any, eval_interval_s: Any, default_interval_s: float) -> float:
    """The evaluation interval in seconds, once ``evaluate`` and ``eval_interval_s`` are checked
    (``UsageError`` in one line)."""
    if evaluate is not None and not callable(evaluate):
        raise UsageError(f"evaluate must be a function fn(model) -> loss or dict, not a {type(evaluate).__name__}")
    if eval_interval_s is None:
        return default_interval_s
    if evaluate is None:
        raise UsageError("eval_interval_s is given without evaluate=fn: pass the function that evaluates the model")
    if isinstance(eval_interval_s, bool) or not isinstance(eval_interval_s, (int, float)):
        raise UsageError(f"eval_interval_s must be a number of seconds, not a {type(eval_interval_s).__name__}")
    if not (eval_interval_s > 0 and math.isfinite(eval_interval_s)):
        raise UsageError(f"eval_interval_s = {eval_interval_s} is out of range; allowed: a finite number > 0")
    return float(eval_interval_s)


def as_result(value: Any) -> tuple[float, dict[str, float]]:
    """``fn``'s result as (loss, other metrics); ``ValueError`` saying what was wrong."""

    def number(x: Any, what: str) -> float:
        if isinstance(x, torch.Tensor) and x.numel() == 1:
            return float(x.detach().item())
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise ValueError(f"{what} is {reprlib.repr(x)}, not a number")
        return float(x)

    if isinstance(value, Mapping):
        if "loss" not in value:
            raise ValueError(f"its dict has no 'loss' (keys: {', '.join(map(str, list(value)[:8]))})")
        extra = {str(k): number(v, f"metric {k!r}") for k, v in value.items() if k != "loss"}
        return number(value["loss"], "'loss'"), extra
    return number(value, "the result"), {}


class Fetcher:
    """One observer request for the global model, over the syncer's own transport."""

    def __init__(self, address: str, keys: ClientKeys | None, network: InProcessNetwork | None) -> None:
        self.address, self.keys, self.network = address, keys, network

    def __call__(self, timeout_s: float = FETCH_TIMEOUT_S) -> GlobalState | None:
        """The syncer's global state, or None when no answer came in time."""
        if self.network is None:
            try:
                return observer.fetch_global([self.address], timeout_s, self.keys, requester=_REQUESTER)[0]
            except observer.NoReply as e:
                log.debug("evaluate hook: %s", e)
                return None
        return self._in_process(timeout_s)

    def _in_process(self, timeout_s: float) -> GlobalState | None:
        """The same request over an ``InProcessNetwork`` (a fresh connection, as ``observer.ask``)."""
        assert self.network is not None
        sock = self.network.learner([self.address], b"evaluate-hook")
        try:
            if not sock.send(0, encode(FetchGlobal(_REQUESTER))):
                return None
            deadline = time.monotonic() + timeout_s
            while (left := deadline - time.monotonic()) > 0:
                for _link, frames in sock.recv(left):
                    try:
                        msg = decode(frames)
                    except WireError:
                        continue
                    if isinstance(msg, GlobalState):
                        return msg
            return None
        finally:
            sock.close()


class EvalHook:
    """The thread that evaluates the global model every ``interval_s``, and the final evaluation."""

    def __init__(
        self,
        fn: EvalFn,
        model: nn.Module,
        layout: FragmentLayout,
        fetch: Callable[[], GlobalState | None],
        run_dir: Path,
        interval_s: float,
        run_age: Callable[[], float],
    ) -> None:
        self.fn, self.layout, self.fetch, self.interval_s, self.run_age = fn, layout, fetch, interval_s, run_age
        self.model = copy.deepcopy(model)  # the hook's own copy: the syncer's model is never touched
        self.path = run_dir / "metrics" / "eval.jsonl"
        self._stop = threading.Event()
        self._busy = threading.Lock()
        """Held while the model copy is loaded and evaluated."""
        self._thread: threading.Thread | None = None
        self.evaluations = 0
        """Records written (interval ones and the final one)."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ddiloco-evaluate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the interval evaluations (at once: a fetch under way is dropped when it returns,
        an evaluation under way finishes before the final one starts)."""
        self._stop.set()

    def _run(self) -> None:
        _lower_priority()
        torch.set_grad_enabled(False)  # grad mode is per thread: this one never trains
        while not self._stop.is_set():
            state = self.fetch()
            with self._busy:  # the model copy is the final evaluation's once the syncer stops
                if self._stop.is_set():
                    return
                if state is not None:
                    versions = observer.write_global_states(self.model, self.layout, [state])
                    self._evaluate(final=False, merged_tokens=state.merged_tokens, versions=versions)
            if state is not None and state.run_ended:
                return  # nothing changes any more; the final evaluation follows the syncer's stop
            self._stop.wait(self.interval_s)

    def final(self, model: nn.Module, merged_tokens: float, ended: bool) -> None:
        """Evaluate the syncer's model as it stopped (after the final sync when the run ended;
        the record is ``final`` then). Skipped when the run had already ended and been
        evaluated before this start (a restart on a finished run)."""
        self.stop()
        if not self._busy.acquire(timeout=FINAL_WAIT_S):
            log.warning(
                "evaluate hook: an evaluation still runs after %.0f s; no final evaluation (the syncer has stopped)",
                FINAL_WAIT_S,
            )
            return
        try:
            evals = read_jsonl(self.path)
            if ended and any(e.get("final") for e in evals[-1:]):
                return
            with torch.no_grad():
                self.model.load_state_dict(model.state_dict())
            self._evaluate(final=ended, merged_tokens=merged_tokens, versions=None)
        finally:
            self._busy.release()

    def _evaluate(self, final: bool, merged_tokens: float, versions: dict[str, int] | None) -> None:
        when = "the final evaluation" if final else f"this evaluation (next in {self.interval_s:g} s)"
        try:
            self.model.eval()
            with torch.no_grad():
                value = self.fn(self.model)
        except Exception as e:  # the user's code: one line, and the syncer serves on
            log.warning("evaluate hook raised %s: %s; %s is not recorded", type(e).__name__, e, when)
            return
        try:
            loss, extra = as_result(value)
        except ValueError as e:
            log.warning(
                "evaluate hook: %s; return the loss (a number) or a dict with a numeric 'loss' and other metrics; %s "
                "is not recorded",
                e,
                when,
            )
            return
        rec: dict[str, Any] = {
            "event": "eval",
            "time": self.run_age(),
            "tokens": 0,
            "merged_tokens": merged_tokens,
            "loss": loss,
            "final": final,
            "unit": "",
        }
        if versions is not None:
            rec["versions"] = versions
        if extra:
            rec["metrics"] = extra
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.evaluations += 1
        if final:
            log.info("final eval loss %.4f (evaluate hook)", loss)


def _lower_priority() -> None:
    """Nice this thread (Linux: a thread is a task with its own priority; never raised back if
    the process is nicer already); elsewhere nothing."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(NICE, os.getpriority(os.PRIO_PROCESS, tid)))
    except (AttributeError, OSError):
        pass
