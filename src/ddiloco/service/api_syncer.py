"""``ddiloco.SyncerServer``: a syncer for a model built in Python (what ``ddiloco syncer`` runs for
a config's workload), in the foreground or on a background thread.

The syncer holds the global model: it starts from the model it is given (learners overwrite
their own initialisation with it when they join), so build it the way the learners build
theirs. It is CPU-only and never computes a forward pass.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from ddiloco.errors import DDiLoCoError, UsageError
from ddiloco.lifecycle import StopSignals
from ddiloco.service.api_learner import ConfigLike, as_config
from ddiloco.service.syncer import open_syncer
from ddiloco.service.transport import SyncerSocket

log = logging.getLogger(__name__)


class SyncerServer:
    """A syncer shard serving ``model``'s fragments at ``bind``.

    ``with SyncerServer(model, "tcp://127.0.0.1:*", "runs/x") as s: ... s.address ...`` runs it
    on a thread; ``serve()`` runs it in the foreground until SIGTERM/SIGINT or ``stop()``.
    Either way it writes ``run_dir/final/model.safetensors`` when it stops.
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
    ) -> None:
        """
        Args:
            model: the initial global model (the same architecture the learners train).
            bind: ``tcp://HOST:PORT`` (``PORT`` may be ``*``: any free port; see ``address``).
            run_dir: the syncer's folder: durable versions, tape, status, final model. A restart
                on the same folder resumes from the last durable version.
            config: the run's Config (or DiLoCoConfig, or TOML file), as the learners use.
            keys: the ``ddiloco keys`` folder; required to bind anything but loopback.
            insecure: bind off loopback without keys (trusted networks only).
            embedding_like: which tensors are merged by weighted mean (default: the
                parameters of ``nn.Embedding`` modules).
            shard, num_shards: this shard of a syncer sharded by fragment.
            transport: an in-process socket (tests); default a ZeroMQ socket bound to ``bind``.
            fsync: make every version durable on disk before sending it (off only in tests).
        """
        if not isinstance(model, nn.Module):
            raise UsageError(f"model must be a torch.nn.Module, not a {type(model).__name__}")
        if not isinstance(bind, str) or not bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise UsageError(f"bind = {bind!r} is not a ZeroMQ address; write it as 'tcp://HOST:PORT'")
        self.service, self.address = open_syncer(
            as_config(config), bind, run_dir, model=model, embedding_like=embedding_like, shard=shard,
            num_shards=num_shards, keys_dir=keys, insecure=insecure, transport=transport, fsync=fsync,
        )  # fmt: skip
        self.model = model
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def final_model_path(self) -> Path:
        """Where the final global model is written when the syncer stops."""
        name = "model.safetensors" if self.service.num_shards == 1 else f"model.shard-{self.service.shard}.safetensors"
        return self.service.run_dir / "final" / name

    def serve(self, max_seconds: float | None = None, handle_signals: bool = True) -> Path:
        """Serve in the foreground until the run's end (its token or time budget: run.processed_tokens,
        runtime.duration_s; the final sync included), ``stop()``, SIGTERM/SIGINT or
        ``max_seconds``; then write the final model and return its path."""
        if handle_signals and threading.current_thread() is threading.main_thread():
            with StopSignals("ddiloco syncer", on_stop=self.service.stop):
                self.service.serve(max_seconds)
        else:
            self.service.serve(max_seconds)
        return self.final_model_path

    def start(self) -> SyncerServer:
        """Serve on a background thread (the learners may be threads of this process too)."""
        if self._thread is not None:
            raise UsageError("this SyncerServer is already started")

        def run() -> None:
            try:
                self.service.serve()
            except BaseException as e:  # kept for stop() to raise on the caller's thread
                self._error = e

        self._thread = threading.Thread(target=run, name="ddiloco-syncer", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> Path:
        """Ask it to stop; when it runs on a thread, wait for the final model to be written."""
        self.service.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
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
