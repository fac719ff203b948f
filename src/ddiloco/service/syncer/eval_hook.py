"""``SyncerServer(..., evaluate=fn)``: the user's evaluation of the global model, off the merge path.

A background thread of the syncer's process follows the global model as an observer, like
``ddiloco evaluator`` (``observer.GlobalCopy``, through the syncer's own message loop: the
syncer answers between messages with a consistent copy, and never waits on the evaluation): it
polls every ``eval_interval_s`` (versions only, no values), and when the merged tokens have
passed the next mark of ``eval_every_tokens`` (``runtime.eval_every_tokens``; automatic by
default) it fetches the fragments whose version moved since its last fetch, writes them into its
own copy of the model and calls ``fn(model)``; on Linux the thread runs at nice 10. When the
syncer stops, after the final sync and the final model, it evaluates that final model once more.
Each result is one ``metrics/eval.jsonl`` record in the evaluator's format (with where it ran,
the fragments fetched and the bytes moved), so the summary's eval loss and the report's first
figure show it. The copy is kept between evaluations and only what moved is written into it:
``fn`` must not change it (copy it first to move it to an accelerator or train it).

``fn`` returns the loss (a number, or a one-element tensor), or a dict with a numeric ``"loss"``
and any other numeric metrics (``{"loss": 0.29, "accuracy": 0.90}``: the others go to the
record's ``"metrics"``). A ``fn`` that raises, or returns anything else, costs one log line and
no record; the syncer serves on.

Memory: one copy of the model (parameters and persistent buffers given memory when the hook is
set up, without initialising them or copying the model's values: the first fetch writes every
fragment, and ``fn`` is called only once every fragment has been written), plus, for each
evaluation, the fetched fragments that moved (at most one more copy of the parameters,
transient; the syncer encodes one for the reply too) and whatever ``fn`` allocates. The final
evaluation writes the syncer's final values into the same copy, which is then let go.
"""

from __future__ import annotations

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
from ddiloco.protocol.config import EvalCadence
from ddiloco.protocol.messages import FetchGlobal, GlobalState
from ddiloco.report.tape import read_jsonl
from ddiloco.service.base import observer
from ddiloco.service.base.keys import ClientKeys
from ddiloco.service.base.transport import InProcessNetwork
from ddiloco.service.base.wire import WireError, decode, encode
from ddiloco.training.empty_model import let_go, receiving_copy, synced_bytes

log = logging.getLogger(__name__)

EvalResult = float | Mapping[str, float]
"""What an evaluation hook returns: the loss, or ``{"loss": ..., other metrics ...}``."""
EvalFn = Callable[[nn.Module], EvalResult]
"""An evaluation hook: the global model (the hook's own CPU copy, in eval mode, under
``torch.no_grad()``) -> its loss, or a dict of metrics with a ``"loss"``."""

FETCH_TIMEOUT_S = 10.0
"""How long one request to the syncer may take; without an answer the hook asks again at its
next poll."""

FINAL_WAIT_S = 60.0
"""How long the final evaluation waits for an interval one still under way before it gives up."""

NICE = 10
"""The evaluation thread's niceness on Linux (a learner on the same machine keeps its core)."""

_REQUESTER = "evaluate hook"


def check_hook(
    evaluate: Any, eval_interval_s: Any, default_interval_s: float, eval_every_tokens: Any = None
) -> tuple[float, float | None]:
    """The poll interval in seconds and the cadence in merged tokens (None: the run's
    ``runtime.eval_every_tokens``), once ``evaluate``, ``eval_interval_s`` and
    ``eval_every_tokens`` are checked (``UsageError`` in one line)."""
    if evaluate is not None and not callable(evaluate):
        raise UsageError(f"evaluate must be a function fn(model) -> loss or dict, not a {type(evaluate).__name__}")
    for name, value, unit in (
        ("eval_interval_s", eval_interval_s, "seconds"),
        ("eval_every_tokens", eval_every_tokens, "merged tokens"),
    ):
        if value is None:
            continue
        if evaluate is None:
            raise UsageError(f"{name} is given without evaluate=fn: pass the function that evaluates the model")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"{name} must be a number of {unit}, not a {type(value).__name__}")
    if eval_interval_s is not None and not (eval_interval_s > 0 and math.isfinite(eval_interval_s)):
        raise UsageError(f"eval_interval_s = {eval_interval_s} is out of range; allowed: a finite number > 0")
    if eval_every_tokens is not None and not (eval_every_tokens >= 0 and math.isfinite(eval_every_tokens)):
        raise UsageError(
            f"eval_every_tokens = {eval_every_tokens} is out of range; allowed: a finite number >= 0 (0: automatic)"
        )
    interval = default_interval_s if eval_interval_s is None else float(eval_interval_s)
    return interval, None if eval_every_tokens is None else float(eval_every_tokens)


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
    """The hook's requests to the syncer (``observer.AskShard``), over its own transport."""

    def __init__(self, address: str, keys: ClientKeys | None, network: InProcessNetwork | None) -> None:
        self.address, self.keys, self.network = address, keys, network

    def __call__(
        self, shard: int, request: FetchGlobal, moved: observer.Moved, timeout_s: float = FETCH_TIMEOUT_S
    ) -> GlobalState | None:
        """The syncer's answer to ``request``, or None when none came in time."""
        if self.network is None:
            try:
                return observer.ask(self.address, request, GlobalState, timeout_s, self.keys, moved)
            except observer.NoReply as e:
                log.debug("evaluate hook: %s", e)
                return None
        return self._in_process(request, moved, timeout_s)

    def _in_process(self, request: FetchGlobal, moved: observer.Moved, timeout_s: float) -> GlobalState | None:
        """The same request over an ``InProcessNetwork`` (a fresh connection, as ``observer.ask``)."""
        assert self.network is not None
        sock = self.network.learner([self.address], b"evaluate-hook")
        try:
            frames = encode(request)
            if not sock.send(0, frames):
                return None
            moved.up += observer.frames_nbytes(frames)
            deadline = time.monotonic() + timeout_s
            while (left := deadline - time.monotonic()) > 0:
                for _link, got in sock.recv(left):
                    moved.down += observer.frames_nbytes(got)
                    try:
                        msg = decode(got)
                    except WireError:
                        continue
                    if isinstance(msg, GlobalState):
                        return msg
            return None
        finally:
            sock.close()


class EvalHook:
    """The thread that follows the global model and evaluates it at the cadence, and the final
    evaluation."""

    def __init__(
        self,
        fn: EvalFn,
        model: nn.Module,
        layout: FragmentLayout,
        ask: observer.AskShard,
        run_dir: Path,
        interval_s: float,
        cadence: EvalCadence,
        run_age: Callable[[], float],
        processed_tokens: Callable[[], float] | None = None,
    ) -> None:
        self.fn, self.interval_s, self.run_age = fn, interval_s, run_age
        self.processed_tokens = processed_tokens
        """The fleet's processed tokens now (a record's ``tokens``; None: not known here)."""
        # The hook's own copy, of the model's structure: memory for its values, unwritten until
        # the first fetch writes every fragment (the model's values are neither read nor copied).
        self.model = receiving_copy(model, "cpu")
        self.copy = observer.GlobalCopy(self.model, layout, 1, ask, _REQUESTER)
        """What the copy holds, and the bytes the hook moved (``copy.moved``)."""
        self.evals = observer.Evaluations(
            self.copy, cadence, f"evaluate hook in the syncer process on {observer.here()}"
        )
        self.path = run_dir / "metrics" / "eval.jsonl"
        self._stop = threading.Event()
        self._busy = threading.Lock()
        """Held while the model copy is loaded and evaluated."""
        self._gave_up = False  # the final evaluation found an evaluation that did not end in time
        self._thread: threading.Thread | None = None
        self.evaluations = 0
        """Records written (at the cadence, and the final one)."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ddiloco-evaluate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the evaluations at the cadence (at once: a fetch under way is dropped when it
        returns, an evaluation under way finishes before the final one starts)."""
        self._stop.set()

    def _run(self) -> None:
        _lower_priority()
        torch.set_grad_enabled(False)  # grad mode is per thread: this one never trains
        log.info("%s: a poll every %g s, an evaluation %s", self.evals.where, self.interval_s, self.evals.describe())
        while not self._stop.is_set():
            seen = self.copy.poll()
            if seen is not None and seen.run_ended:
                return  # nothing changes any more; the final evaluation follows the syncer's stop
            if seen is not None and self.evals.due(seen):
                with self._busy:  # the model copy is the final evaluation's once the syncer stops
                    if self._stop.is_set():
                        return
                    seen = self.copy.refresh()
                    if seen is not None and not self.copy.complete:
                        log.debug("evaluate hook: not every fragment has come yet; asking again at the next poll")
                    elif seen is not None:
                        fields = self.evals.made(seen)
                        self._evaluate(False, seen.merged_tokens, self.copy.versions(), fields, seen)
            self._stop.wait(self.interval_s)

    def held_bytes(self) -> int:
        """Bytes of the copy's parameters and persistent buffers (0 once let go)."""
        return synced_bytes(self.model)

    def release(self) -> None:
        """Let the copy's values go (the syncer has stopped: nothing evaluates it again). An
        evaluation still under way keeps them: waited for at most ``FINAL_WAIT_S``, not at all
        when the final evaluation already gave up waiting for it."""
        self.stop()
        if not self._busy.acquire(timeout=0 if self._gave_up else FINAL_WAIT_S):
            log.debug("evaluate hook: an evaluation still runs; its copy stays with it")
            return
        try:
            let_go(self.model)
        finally:
            self._busy.release()

    def final(self, load: Callable[[nn.Module], None], merged_tokens: float, ended: bool) -> None:
        """Evaluate the syncer's model as it stopped (after the final sync when the run ended;
        the record is ``final`` then): ``load(model)`` writes every synced tensor of the copy
        from the syncer's values. Skipped when the run had already ended and been evaluated
        before this start (a restart on a finished run)."""
        self.stop()
        if not self._busy.acquire(timeout=FINAL_WAIT_S):
            self._gave_up = True
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
                load(self.model)  # every fragment: the copy is whole whatever the fetches brought
            self._evaluate(final=ended, merged_tokens=merged_tokens, versions=None)
        finally:
            self._busy.release()

    def _evaluate(
        self,
        final: bool,
        merged_tokens: float,
        versions: dict[str, int] | None,
        fields: dict[str, Any] | None = None,
        seen: observer.Seen | None = None,
    ) -> None:
        mark = None if seen is None else self.evals.cadence.next_mark(seen.tokens_per_step)
        nxt = "" if mark is None else f" (the next at {mark:,.0f} merged tokens)"
        when = "the final evaluation" if final or seen is None else f"this evaluation{nxt}"
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
            "tokens": None if self.processed_tokens is None else self.processed_tokens(),
            "merged_tokens": merged_tokens,
            "loss": loss,
            "final": final,
            "unit": "",
        }
        if versions is not None:
            rec["versions"] = versions
        if extra:
            rec["metrics"] = extra
        if fields is not None:
            rec.update(fields)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.evaluations += 1
        if final:
            log.info("final eval loss %.4f (evaluate hook)", loss)
        elif fields is not None and seen is not None:
            log.info("evaluate hook: eval loss %.4f at %s merged tokens; %s", loss, f"{merged_tokens:,.0f}",
                     self.evals.line(fields, seen))  # fmt: skip


def _lower_priority() -> None:
    """Nice this thread (Linux: a thread is a task with its own priority; never raised back if
    the process is nicer already); elsewhere nothing."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(NICE, os.getpriority(os.PRIO_PROCESS, tid)))
    except (AttributeError, OSError):
        pass
