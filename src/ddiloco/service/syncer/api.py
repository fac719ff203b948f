"""``ddiloco.SyncerServer``: a syncer for a model built in Python (what ``ddiloco syncer`` runs for
a config's workload), in the foreground or on a background thread.

The syncer holds the global model: it starts from the model it is given (learners overwrite
their own initialisation with it when they join), so build it the way the learners build
theirs. It is CPU-only and never computes a forward pass. It takes the model's values as its
version 0 without copying them, and the model keeps its structure alone while the syncer serves
(its parameters and persistent buffers on the meta device: the same tensor objects, no memory);
when the syncer stops, they get memory again and hold the final global model. One copy of the
model's values in the process, not two.

It uses CURVE keys by default, also on loopback: without ``keys`` it makes the run's own in
``run_dir/keys`` (learners 0 .. ``run.num_learners`` - 1 and an observer); learners in other
processes pass ``key=run_dir/keys``, those in this process find them by themselves.
``insecure=True`` turns that off.

Its run folder is a run folder like ``ddiloco syncer``'s: ``run.json``, the resolved
``config.toml`` (``run.run_dir`` set to the folder) and, since the model comes from code rather
than from ``workload.*``, ``model.json`` describing it (``report.rundir.MODEL_INFO``). With
``evaluate=fn`` a background thread evaluates the global model (``service/syncer/eval_hook.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from ddiloco.config import Config, ConfigLike, as_config
from ddiloco.core.fragments import tensor_pieces
from ddiloco.errors import DDiLoCoError, UsageError
from ddiloco.lifecycle import StopSignals
from ddiloco.protocol.config import EvalCadence
from ddiloco.report.rundir import prepare_run_dir, write_model_info
from ddiloco.report.summary import log_time_budget_short, write_summary
from ddiloco.service.base.keys import forget_local_keys, is_local, remember_local_keys, run_keys
from ddiloco.service.base.observer import cadence_of, observer_keys
from ddiloco.service.base.transport import InProcessNetwork, SyncerSocket
from ddiloco.service.syncer.eval_hook import EvalFn, EvalHook, Fetcher, check_hook
from ddiloco.service.syncer.final_model import Calibrate, recalibrated, statistics_shapes
from ddiloco.service.syncer.service import open_syncer
from ddiloco.service.syncer.store import start_over as start_store_over
from ddiloco.training.empty_model import LetGo, let_go, synced_bytes, take_back
from ddiloco.training.layout import synced_tensors

log = logging.getLogger(__name__)


class SyncerServer:
    """A syncer shard serving ``model``'s fragments at ``bind``.

    ``with SyncerServer(model, "tcp://127.0.0.1:*", "runs/x") as s: ... s.address ...`` runs it
    on a thread; ``serve()`` runs it in the foreground until SIGTERM/SIGINT or ``stop()``.
    Either way it writes ``run_dir/final/model.safetensors`` when it stops, and ``model`` ends
    as the final global model. Between construction and the stop, ``model`` holds no values
    (the syncer has them): build another model for a learner in the same process, and read the
    live global model with ``ddiloco.fetch_state``.
    """

    def __init__(
        self,
        model: nn.Module,
        bind: str,
        run_dir: str | Path,
        *,
        config: ConfigLike = None,
        keys: str | Path | None = None,
        insecure: bool = False,
        embedding_like: Callable[[str], bool] | None = None,
        shard: int = 0,
        num_shards: int = 1,
        transport: SyncerSocket | None = None,
        fsync: bool = True,
        start_over: bool = False,
        evaluate: EvalFn | None = None,
        eval_interval_s: float | None = None,
        eval_every_tokens: float | None = None,
        calibrate: Calibrate | None = None,
    ) -> None:
        """
        Args:
            model: the initial global model (the same architecture the learners train). Its
                values become the syncer's (not copied); it holds its structure alone until the
                syncer stops, then the final global model.
            bind: ``tcp://HOST:PORT`` (``PORT`` may be ``*``: any free port; see ``address``).
            run_dir: the syncer's folder: durable versions, tape, status, final model. A restart
                on the same folder resumes from the last durable version.
            config: the run's Config (or DiLoCoConfig, or TOML file), as the learners use.
            keys: the ``ddiloco keys`` folder (default: ``run_dir/keys``, made if missing, for
                learner ids 0 .. ``run.num_learners`` - 1; ``self.keys`` says where).
            insecure: no keys at all, on loopback or off it (trusted networks only): any local
                process may then take a learner id or pose as this syncer.
            embedding_like: which tensors are merged by weighted mean (default: the
                parameters of ``nn.Embedding`` modules).
            shard, num_shards: this shard of a syncer sharded by fragment.
            transport: an in-process socket (tests); default a ZeroMQ socket bound to ``bind``.
            fsync: make every version durable on disk before sending it (off only in tests).
            start_over: ``run_dir`` holds a run whose syncer state is missing (deleted, lost):
                start it over from ``model`` at version 0 instead of refusing to start.
            evaluate: ``fn(model) -> loss`` (a number) or ``-> {"loss": ..., "accuracy": ...}``,
                called on a copy of the global model (CPU, eval mode, no grad) by a
                low-priority background thread each time the merged tokens pass the next mark
                of ``eval_every_tokens``, and once more on the final model when the syncer
                stops; each result is a ``metrics/eval.jsonl`` record. The copy follows the
                global model by what changed (only fragments whose version moved are fetched):
                ``fn`` must not modify it. A ``fn`` that raises costs one log line; the syncer
                serves on. Memory: one copy of the model (given memory, not initialised: ``fn``
                sees it once every fragment has been written into it; let go when the syncer
                stops), plus a transient copy of what moved per evaluation.
            eval_interval_s: seconds between the hook's polls of the syncer (versions only), so
                the least time between two evaluations (default ``runtime.eval_interval_s``).
            eval_every_tokens: merged tokens between evaluations (default
                ``runtime.eval_every_tokens``; 0: automatic, a tenth of the learners' steady
                traffic at most).
            calibrate: ``fn(model)``, called once at the run's end on a copy of the final global
                model (CPU, train mode): it re-estimates the model's BatchNorm statistics on the
                final weights, e.g. ``lambda m: ddiloco.recalibrate_batch_norm(m, batches)``.
                Its running means and variances replace the merged ones (measured by the
                learners on their own weights, which the last outer step moved past) in
                ``final/model.safetensors``, the final evaluations and the model given back;
                the counts keep their merged values. A ``fn`` that raises, or leaves a value
                that is not finite or a negative variance, costs one WARNING line: the merged
                statistics stay. Not on a syncer stopped before the end.
        """
        cfg, interval_s, every = checked_config(
            model, bind, run_dir, config, evaluate, eval_interval_s, num_shards, transport, eval_every_tokens
        )
        check_calibrate(calibrate, num_shards)
        by = f"ddiloco.SyncerServer (shard {shard})"
        prepare_folder(run_dir, cfg, shard, num_shards, start_over, by)
        self.keys: Path | None = keys_folder(keys, insecure, transport, bind, run_dir, cfg.run.num_learners)
        """The keys folder this syncer uses (None: insecure, or an in-process transport)."""
        # The core takes the model's values as version 0 (views, not copies): the model lets them go below.
        self.service, self.address = open_syncer(
            cfg, bind, run_dir, model=model, embedding_like=embedding_like, shard=shard, num_shards=num_shards,
            keys_dir=self.keys, insecure=insecure, transport=transport, fsync=fsync, take=True,
        )  # fmt: skip
        if self.keys is not None:
            remember_local_keys(self.address, self.keys)
        if shard == 0:
            write_model_info(run_dir, model, by)  # what `ddiloco export` rebuilds instead of workload.*
        self.model = model
        """The model given: its structure alone while the syncer serves, the final global model once it stopped."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._serving = False
        self.evaluation: EvalHook | None = None
        """The evaluation hook (``evaluate=``); ``evaluation.evaluations`` counts its records."""
        if evaluate is not None:
            hook_net = getattr(transport, "net", None)
            self.evaluation = self._eval_hook(evaluate, interval_s, cadence_of(cfg, every), hook_net, insecure)
        self.service.beside["model"] = lambda: synced_bytes(self.model)
        self._calibrate = calibrate
        if calibrate is not None:  # first: the final evaluations then see its statistics
            self.service.end_work.tasks.append(self._final_calibration)
        if self.evaluation is not None:
            self.service.beside["eval_copy"] = self.evaluation.held_bytes
            self.service.end_work.tasks.append(self._final_evaluation)
        # Last, once nothing can fail: the core holds the values, the model its structure alone.
        self._let_go: LetGo | None = let_go(model)

    def _eval_hook(
        self, evaluate: EvalFn, interval_s: float, cadence: EvalCadence, network: Any, insecure: bool
    ) -> EvalHook:
        """The hook that evaluates the global model, read as an observer of this syncer (its
        thread starts with ``serve``)."""
        obs = None if network is not None else observer_keys([self.address], self.keys, insecure)
        fetch = Fetcher(self.address, obs, network)
        return EvalHook(
            evaluate, self.model, self.service.layout.fragments, fetch, self.service.run_dir, interval_s, cadence,
            self.service.run_age, lambda: self.service.processed_seen,
        )  # fmt: skip

    def _final_calibration(self) -> None:
        """``calibrate=`` on a copy of the final model; its statistics then are the final
        model's (``SyncerService.use_final_statistics``)."""
        if self._calibrate is None or self.service.shard != 0 or self.service.kept_final:
            return  # (started again on an ended run: its final model is kept as it was written)
        shapes = statistics_shapes(self.service.layout.fragments)
        found = recalibrated(self.model, self.service.load_into, self._calibrate, shapes)
        if found is not None:
            self.service.use_final_statistics(found)

    def _final_evaluation(self) -> None:
        """The hook's evaluation of the final model (shard 0), while the syncer still answers
        after the run's end (``SyncerService.end_work``)."""
        if self.evaluation is not None and self.service.shard == 0:
            self.evaluation.final(self.service.load_into, self.service.core.merged_tokens, ended=True)

    @property
    def final_model_path(self) -> Path:
        """Where the final global model is written when the syncer stops."""
        name = "model.safetensors" if self.service.num_shards == 1 else f"model.shard-{self.service.shard}.safetensors"
        return self.service.run_dir / "final" / name

    def serve(self, max_seconds: float | None = None, handle_signals: bool = True) -> Path:
        """Serve in the foreground until the run's end (its token or time budget: run.processed_tokens,
        runtime.duration_s; the final sync included), ``stop()``, SIGTERM/SIGINT or
        ``max_seconds``; then write the final model and return its path."""
        try:
            if handle_signals and threading.current_thread() is threading.main_thread():
                with StopSignals("ddiloco syncer", on_stop=self.service.stop):
                    self._serve(max_seconds)
            else:
                self._serve(max_seconds)
        finally:
            forget_local_keys(self.address)
        return self.final_model_path

    def _serve(self, max_seconds: float | None = None) -> None:
        """Serve, then (shard 0) evaluate the final model, give the model given the final global
        model and say how the run ended."""
        self._serving = True
        if self.evaluation is not None:
            self.evaluation.start()
        served = False
        before = self.evaluation.evaluations if self.evaluation is not None else 0
        try:
            self.service.serve(max_seconds)
            served = True
        finally:
            try:
                if self.evaluation is not None:
                    self.evaluation.stop()
                    if served and self.service.shard == 0:  # (a no-op when the run's end already did it)
                        ended = self.service.end_stage == "done"
                        self.evaluation.final(self.service.load_into, self.service.core.merged_tokens, ended)
                    self.evaluation.release()  # (before the model given takes its memory back)
            finally:
                self._give_back()
                self._serving = False
        if self.service.shard != 0:
            return
        if self.evaluation is not None and self.evaluation.evaluations > before:
            write_summary(self.service.run_dir)  # again: now with the final evaluation
        log_time_budget_short(self.service.run_dir)

    def _give_back(self) -> None:
        """The model given ends as the final global model: its tensors take the syncer's values
        back (every fragment: a shard's own final values, the others' as this shard holds them,
        the initial ones). A tensor the syncer holds whole, in its dtype, becomes the syncer's
        value (no copy: the syncer has stopped and never touches it again); a tensor split over
        fragments, or of another dtype, is written into new memory."""
        core = self.service.core
        if self._let_go is not None:
            every = {p: core.values(p) for p in range(core.layout.num_fragments)}
            pieces = tensor_pieces(core.layout, every)
            for name, value in self.service.final_statistics.items():  # calibrate='s (a buffer is one piece)
                pieces[name] = [(pieces[name][0][0], value.clone())]
            take_back(self._let_go, pieces)
            self._let_go = None
        else:
            self.service.load_into(self.model)  # (a second serve() of the same server)

    def start(self) -> SyncerServer:
        """Serve on a background thread (the learners may be threads of this process too)."""
        if self._thread is not None:
            raise UsageError("this SyncerServer is already started")

        def run() -> None:
            try:
                self._serve()
            except BaseException as e:  # kept for stop() to raise on the caller's thread
                self._error = e

        self._thread = threading.Thread(target=run, name="ddiloco-syncer", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> Path:
        """Ask it to stop; when it runs on a thread, wait for the final model to be written.
        Never started: the model given gets its values back (version 0, or the restored ones)."""
        self.service.stop()
        forget_local_keys(self.address)
        if self._thread is None and not self._serving and self._let_go is not None:
            self._give_back()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive() and self.service.end_work.busy:  # calibration, final evaluations
                log.info("the run's end work (calibration, final evaluation) still runs: waiting for it")
                while self._thread.is_alive() and self.service.end_work.busy:
                    self._thread.join(1.0)
                self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise DDiLoCoError(f"the syncer did not stop within {timeout_s:.0f} s")
            if self._error is not None:
                raise self._error
        return self.final_model_path

    def __enter__(self) -> SyncerServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def checked_config(
    model: Any,
    bind: Any,
    run_dir: str | Path,
    config: ConfigLike,
    evaluate: EvalFn | None,
    eval_interval_s: float | None,
    num_shards: int,
    transport: SyncerSocket | None,
    eval_every_tokens: float | None = None,
) -> tuple[Config, float, float | None]:
    """The run's resolved config (``run.run_dir`` where the run actually is, as `ddiloco train`
    saves it), the evaluation hook's poll interval and its cadence in merged tokens (None: the
    config's), once the arguments are checked (UsageError)."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"model must be a torch.nn.Module, not a {type(model).__name__}")
    meta = next((name for name, t in synced_tensors(model).items() if t.is_meta), None)
    if meta is not None:
        raise UsageError(
            f"model holds no values ({meta} is on the meta device; another SyncerServer's model while it serves?): "
            "give each SyncerServer its own model (copy.deepcopy(model) before the first takes its values)"
        )
    if not isinstance(bind, str) or not bind.startswith(("tcp://", "ipc://", "inproc://")):
        raise UsageError(f"bind = {bind!r} is not a ZeroMQ address; write it as 'tcp://HOST:PORT'")
    cfg = as_config(config)
    interval_s, every = check_hook(evaluate, eval_interval_s, cfg.runtime.eval_interval_s, eval_every_tokens)
    if evaluate is not None and num_shards != 1:
        raise UsageError(
            "evaluate= needs the whole model, which a sharded syncer does not hold: evaluate in your own loop "
            "with ddiloco.fetch_state(model, [every shard's address])"
        )
    if (
        evaluate is not None
        and transport is not None
        and not isinstance(getattr(transport, "net", None), InProcessNetwork)
    ):
        raise UsageError("evaluate= reads the global model as an observer: use ZeroMQ (no transport=)")
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=str(run_dir))), interval_s, every


def check_calibrate(calibrate: Any, num_shards: int) -> None:
    """``calibrate=`` is a function, on a syncer that holds the whole model."""
    if calibrate is not None and not callable(calibrate):
        raise UsageError(
            f"calibrate must be a function of the model, not a {type(calibrate).__name__}: "
            "calibrate=lambda model: ddiloco.recalibrate_batch_norm(model, batches)"
        )
    if calibrate is not None and num_shards != 1:
        raise UsageError(
            "calibrate= needs the whole model, which a sharded syncer does not hold: re-estimate the statistics "
            "of the exported model with ddiloco.recalibrate_batch_norm"
        )


def prepare_folder(run_dir: str | Path, cfg: Config, shard: int, num_shards: int, start_over: bool, by: str) -> None:
    """Refuse a foreign folder, or one whose saved config.toml differs, before any write; with
    ``start_over``, make a run whose syncer state is missing start over."""
    prepare_run_dir(run_dir, by, cfg)
    if start_over:
        start_store_over(run_dir, shard, num_shards, by="start_over=True")


def keys_folder(
    keys: str | Path | None,
    insecure: bool,
    transport: SyncerSocket | None,
    bind: str,
    run_dir: str | Path,
    num_learners: int,
) -> Path | None:
    """The keys folder to serve with: the one given, else the run's own (made if missing), or
    None when insecure (said once on loopback) or in process."""
    if keys is not None:
        return Path(keys)
    if not insecure and transport is None and not bind.startswith("inproc://"):
        return run_keys(run_dir, num_learners)
    if insecure and is_local(bind):
        log.warning("INSECURE: %s takes any local process as a learner or an observer (insecure=True)", bind)
    return None
