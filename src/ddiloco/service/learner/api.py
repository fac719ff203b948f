"""``ddiloco.Learner``: any PyTorch training loop as a Decoupled DiLoCo learner.

The user keeps their model, optimizer, LR scheduler, data loader and batch structure; after
each optimizer step they call ``learner.step(tokens=n)``. That call never waits on the network
(``late_fragment = continue``): it applies the global fragments that arrived since the last
call, answers requests the comm thread could not answer itself, and copies to host memory only
the fragments the schedule says will be asked for next. The comm thread (``service/learner/comm.py``) does
all the talking. ``ddiloco learner`` (``service/learner/process.py``) is one user of this class.

Inside a torchrun group (DDP or FSDP2) rank 0 alone talks to the syncer and broadcasts what it
received at each step boundary, so every rank applies the same fragments at the same step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddiloco.config import Config, ConfigLike, as_config
from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import read_fragment, tensor_rows
from ddiloco.core.learner import routed_counts
from ddiloco.core.messages import ID, FragmentUpdate
from ddiloco.errors import CommError, RefusedError, UsageError
from ddiloco.protocol.boundary import BoundaryExecutor
from ddiloco.protocol.config import RuntimeConfig
from ddiloco.protocol.learner_session import BoundaryPlan, LearnerSession, Registration
from ddiloco.protocol.messages import PeerState
from ddiloco.protocol.settings import SettingsQuery, said
from ddiloco.service.base.clock import SYSTEM_CLOCK, Clock
from ddiloco.service.base.keys import ClientKeys, client_keys, handshake_problem
from ddiloco.service.base.startup import LEARNER_LAST, StartupTimes
from ddiloco.service.base.transport import LearnerSocket, ZmqLearnerSocket, learner_identity
from ddiloco.service.base.wire import WireError, decode, encode
from ddiloco.service.learner.comm import LearnerComm
from ddiloco.service.learner.local_state import open_local_state
from ddiloco.service.learner.model_host import ModelHost, fsdp_rows
from ddiloco.service.learner.model_watch import ModelWatch
from ddiloco.service.learner.stats import LearnerStats
from ddiloco.settings import EVERY_LEARNER, adopt, run_settings
from ddiloco.training.layout import layout_of, param_spec, synced_tensors
from ddiloco.workloads.base import embedding_parameters

log = logging.getLogger(__name__)

SocketFactory = Callable[[list[str], bytes], LearnerSocket]
"""Makes a learner's transport from (syncer addresses, transport identity): ZeroMQ by default,
``InProcessNetwork.learner`` in tests."""
ADDRESS_SCHEMES = ("tcp://", "ipc://", "inproc://")


def check_addresses(syncer: str | Sequence[str] | None) -> list[str]:
    """The syncer shard addresses, in shard order (empty: standalone)."""
    if syncer is None:
        return []
    addrs = [syncer] if isinstance(syncer, str) else list(syncer)
    if not addrs:
        raise UsageError("syncer is an empty list: pass 'tcp://HOST:PORT' (one per shard), or None to train alone")
    for a in addrs:
        if not isinstance(a, str) or not a.startswith(ADDRESS_SCHEMES):
            raise UsageError(f"syncer address {a!r} is not a ZeroMQ address; write it as 'tcp://HOST:PORT'")
    return addrs


def _check_arguments(model: Any, learner_id: Any, optimizer: Any, join_timeout_s: Any) -> None:
    """The constructor's arguments that no config check covers, each with what is allowed."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"model must be a torch.nn.Module, not a {type(model).__name__}")
    if type(learner_id) is not int or not 0 <= learner_id <= ID["max"]:
        raise UsageError(f"learner_id = {learner_id!r} is out of range; allowed: an integer in 0..{ID['max']}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"optimizer must be a torch.optim.Optimizer, not a {type(optimizer).__name__}")
    if join_timeout_s is not None and not (isinstance(join_timeout_s, (int, float)) and join_timeout_s > 0):
        raise UsageError(f"join_timeout_s = {join_timeout_s!r} is out of range; allowed: > 0 seconds")


@dataclass(frozen=True)
class _Link:
    """How a learner reaches its syncer: what ``Learner(...)`` was given for it."""

    addresses: list[str]
    """The shards' addresses, in shard order (empty: standalone)."""
    key: str | Path | ClientKeys | None
    """Its keys (``client_keys``)."""
    insecure: bool
    """An unencrypted connection off this machine is allowed."""
    transport: SocketFactory | None
    """A test's transport (None: ZeroMQ)."""
    join_timeout_s: float | None
    """The caller's join timeout (None: ``runtime.join_timeout_s``)."""


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose parameters are synced: DDP's ``.module``, or the model itself."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


class Learner:
    """One Decoupled DiLoCo learner around the user's own model and training loop.

    ``Learner(model, syncer="tcp://host:port", learner_id=3)`` registers with the syncer and
    waits up to ``join_timeout_s`` for every global fragment before it returns; then call
    ``step(tokens=n)`` after every optimizer step and ``close()`` at the end (or use it as a
    context manager). ``syncer=None`` trains alone (for debugging: no network at all).
    """

    def __init__(
        self,
        model: nn.Module,
        syncer: str | Sequence[str] | None = None,
        *,
        learner_id: int = 0,
        key: str | Path | ClientKeys | None = None,
        config: ConfigLike = None,
        optimizer: torch.optim.Optimizer | None = None,
        join_timeout_s: float | None = None,
        insecure: bool = False,
        transport: SocketFactory | None = None,
        clock: Clock = SYSTEM_CLOCK,
        incarnation: int | None = None,
        max_data_position: int | None = None,
        max_merged_tokens: float = math.inf,
        claims: Sequence[str] = EVERY_LEARNER,
        startup: StartupTimes | None = None,
        initial: Callable[[], nn.Module] | None = None,
        local_state: str | Path | None = None,
    ) -> None:
        """
        Args:
            model: the model the loop trains (an ``nn.Module``, DDP around one, or an FSDP2 module).
            syncer: the syncer's address (a list: one per shard, in shard order); None: standalone.
            learner_id: this learner's id (0..65535), unique in the fleet; a restarted learner
                takes its id back, with its data position and a peer's optimizer state.
            key: ``ddiloco keys`` folder (or this learner's ``learner-ID.key_secret`` in it);
                required for a syncer that is not on this machine (see docs/security.md).
            config: the run's ``Config`` or a TOML file: its settings that a learner must agree
                with (``ddiloco.settings``) must be the run's, or the syncer refuses the learner,
                naming the first that differs. A ``DiLoCoConfig``: its ``algo`` settings must be
                the run's, the rest is adopted. None (the default): the learner asks the syncer
                for the run's settings and adopts them (``self.cfg``), before it builds its layout.
            optimizer: the user's inner optimizer; with it, a (re)starting learner loads a live
                peer's ``optimizer.state_dict()`` at a step boundary, and serves its own to peers.
            join_timeout_s: how long to wait for the global state (default ``runtime.join_timeout_s``).
            insecure: allow an unencrypted connection off this machine (trusted networks only).
            transport, clock, incarnation, startup: injected by tests and ``ddiloco learner``
                (``startup``: the process's start-up record, ``service.startup``).
            max_data_position: a data position beyond this from the syncer is not believed.
            max_merged_tokens: a global token count beyond this from the syncer is not believed
                (``ddiloco learner`` passes 1000x the run's budget).
            claims: the run settings an explicit config claims (``ddiloco learner`` adds its own
                training loop's, ``ddiloco.settings.INNER_LOOP``).
            initial: makes the model with the run's initial values, for the fragments a join
                that went quiet did not deliver (it trains on from what it has): ``ddiloco
                learner`` passes it for a model built empty (``training/empty_model.py``); not
                for an FSDP2 model (only rank 0 would write them).
            local_state: a folder on this machine where the learner saves its own state every
                ``runtime.local_state_s`` and, restarted, takes it back: it then catches up by
                what changed since instead of the whole model (one process per learner only).
        """
        _check_arguments(model, learner_id, optimizer, join_timeout_s)
        addrs = check_addresses(syncer)
        given = as_config(config)
        self.id, self.clock, self.optimizer, self._initial = learner_id, clock, optimizer, initial
        self._local_dir, self._saver = (Path(local_state) if local_state is not None else None), None
        self._bind_model(model)
        # One incarnation per process start: the syncer drops whatever its predecessor still sends.
        self.incarnation = incarnation if incarnation is not None else int(clock.wall() * 1e6)
        self.max_merged_tokens, self.max_data_position = max_merged_tokens, max_data_position
        self.stats = LearnerStats()
        self.startup = startup or StartupTimes("learner", LEARNER_LAST, id=learner_id, incarnation=self.incarnation)
        """When this learner joined, downloaded, took a peer's optimizer state, stepped and was
        first merged (seconds from its process's start; ``ddiloco learner`` writes it to the run)."""
        self._joined: list[FragmentUpdate] = []
        self._position = 0
        self._closed = False
        self._last_end: float | None = None
        self._last_start: float | None = None
        self._waited = 0.0  # the last step()'s lock-step wait: not busy time (``LearnerSession.step``)
        self._shared = False  # a torchrun group has shared rank 0's join
        self._told_end = False  # run_ended was true when a step() (or the join) returned, or was read true
        self._keyed = False
        self.session: LearnerSession | None = None
        self.comm: LearnerComm | None = None
        # What this learner claims (checked by the syncer at registration) and what it adopts
        # from the run: a whole config claims its settings; a DiLoCoConfig its algo ones; none, none.
        adopting = config is None or isinstance(config, DiLoCoConfig)
        claimed = [k for k in claims if config is not None and (not adopting or k.startswith("algo."))]
        link = _Link(addrs, key, insecure, transport, join_timeout_s)
        self._start(given, link, adopting, claimed)

    def _bind_model(self, model: nn.Module) -> None:
        """The model's synced tensors (the parameters and the persistent buffers, BatchNorm's
        statistics: the whole model), its FSDP2 rows, its device and its torchrun group."""
        self.trained = model
        self.model = unwrap(model)
        params = synced_tensors(self.model)
        if not params:
            raise UsageError("the model has no parameters to synchronise")
        if any(t.is_meta for t in params.values()):  # e.g. the model a SyncerServer in this process serves
            raise UsageError("the model holds no values (its tensors are on the meta device): give the learner its own")
        self.params = params
        self.sharded = fsdp_rows(params)  # name -> this rank's rows, for FSDP2 parameters
        self._watch = ModelWatch(self.model, params)
        self.device = next(iter(params.values())).device
        self.rank, self.world = 0, 1
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def _start(self, given: Config, link: _Link, adopting: bool, claimed: list[str]) -> None:
        """The construction's I/O, in order: open the transport (rank 0), ask the run's settings
        when adopting them (the layout depends on them, so it is built only then), build the
        layout and the session, start the comm thread and join. A failure closes what it opened."""
        timeout_s = link.join_timeout_s if link.join_timeout_s is not None else given.runtime.join_timeout_s
        sock = self._open(link, given.runtime) if link.addresses and self.rank == 0 else None
        try:
            run = self._run_settings(sock, link.addresses, given.runtime, timeout_s) if adopting else {}
            self._configure(adopt(given, {k: v for k, v in run.items() if k not in claimed}) if run else given)
            if self.rank == 0:
                self.session = self._make_session(len(link.addresses), claimed, link.join_timeout_s)
            if self._local_dir is not None and self.session is not None and self.world == 1:
                # (before the comm thread registers: it claims the versions it took back)
                local = self._local_dir, self.session, self.params, self.optimizer, self.cfg.runtime
                algo = self.cfg.algo
                chain = algo.chain_history if algo.down_payload != "fp32" else 0  # no chain: no versions rule
                self._saver = open_local_state(*local, chain_history=chain)
                if self.session.restored_runs is not None:
                    self.startup.mark("restore")
            if sock is not None and self.session is not None:
                self.comm = LearnerComm(self.session, link.addresses, sock, self.clock)
        except BaseException:
            if sock is not None and self.comm is None:
                sock.close()
            raise
        try:
            self._join(timeout_s)
        except BaseException:
            self.close()
            raise
        self._told_end = self.run_ended

    def _open(self, link: _Link, rt: RuntimeConfig) -> LearnerSocket:
        """Rank 0's transport to the syncer shards (ZeroMQ, with this learner's keys, unless a
        test injects its own)."""
        keys = client_keys(link.addresses, link.key, f"learner-{self.id}", link.insecure)
        self._keyed = keys is not None
        factory = link.transport or (
            lambda a, ident: ZmqLearnerSocket(a, ident, rt.backoff_initial_s, rt.backoff_max_s, keys)
        )
        return factory(link.addresses, learner_identity(self.id))

    def _run_settings(
        self, sock: LearnerSocket | None, addresses: list[str], rt: RuntimeConfig, timeout_s: float
    ) -> dict[str, Any]:
        """The run's settings for a learner that adopts them: rank 0 asks, every rank of a
        torchrun group gets the same (each builds the same layout from them)."""
        run = self._ask_settings(sock, addresses, rt, timeout_s) if sock is not None else {}
        if self.world > 1 and addresses:
            import torch.distributed as dist

            box: list[Any] = [run]
            dist.broadcast_object_list(box, src=0)
            run = box[0]
        return run

    def _configure(self, cfg: Config) -> None:
        """The run's config taken: the fragment layout, and the boundary's executor."""
        self.cfg = cfg
        self.layout = layout_of(self.model, cfg.algo, embedding_parameters(self.model))
        self.pieces = self.layout.fragments.fragments
        # Rows (dim 0) of each parameter: what routed-token counts must match (``step(routed=...)``).
        self._expert_rows = tensor_rows(self.layout.fragments)
        if self.world > 1 and cfg.algo.late_fragment == "wait":
            raise UsageError(
                "a multi-rank learner supports algo.late_fragment = 'continue' only; run lock-step "
                "baselines with one process per learner"
            )
        # Rank 0 runs the protocol; the other ranks of a torchrun group follow its boundaries
        # and keep what it tells them of the fleet (LR position, versions, the run's end).
        self._facts: tuple[float, tuple[int, ...], str | None] = (0.0, (0,) * self.layout.num_fragments, None)
        self._host = ModelHost(self.id, self.params, self.pieces, self.sharded, self.device, self.optimizer,
                               self._took_state)  # fmt: skip
        self._executor = BoundaryExecutor(self._host)

    def _make_session(self, num_shards: int, claimed: list[str], join_timeout_s: float | None) -> LearnerSession:
        """Rank 0's protocol session (its registration says what it claims of the run's settings)."""
        cfg = self.cfg
        registration = Registration(
            param_spec(self.model), self.layout.digest, os.getpid(), str(self.device),
            settings=said(run_settings(cfg, claimed)),
        )  # fmt: skip
        # The session's join deadline (when training starts from what it has) is the caller's
        # timeout too, not only the wait in _join.
        runtime = cfg.runtime if join_timeout_s is None else replace(cfg.runtime, join_timeout_s=join_timeout_s)
        return LearnerSession(
            cfg.algo,
            runtime,
            self.id,
            self.incarnation,
            self.layout.fragments,
            registration,
            self.clock.monotonic(),
            num_shards=max(1, num_shards),
            max_merged_tokens=self.max_merged_tokens,
            processed_budget=cfg.run.processed_tokens,
            wants_peer_state=self.optimizer is not None and not self.sharded,
        )

    # -- the public surface ------------------------------------------------------------------

    @property
    def fleet_tokens(self) -> float:
        """Where the run is: the tokens the whole fleet has processed, as this learner estimates
        them (the syncer's merged count plus what the fleet trained since). Drive an LR schedule
        with it, over ``cfg.run.processed_tokens``."""
        return self.session.core.fleet_tokens() if self.session is not None else self._facts[0]

    @property
    def fleet_fraction(self) -> float:
        """``fleet_tokens`` over the run's budget (``cfg.run.processed_tokens``), at most 1: the
        position an LR schedule reads (``ddiloco.fleet_scheduler``), a restarted learner's too."""
        return min(1.0, self.fleet_tokens / self.cfg.run.processed_tokens)

    @property
    def global_tokens(self) -> float:
        """``fleet_tokens``'s earlier name, kept for loops written against it (warns)."""
        warnings.warn("Learner.global_tokens is now Learner.fleet_tokens", DeprecationWarning, stacklevel=2)
        return self.fleet_tokens

    @property
    def data_position(self) -> int:
        """Where this learner's data resumes: the position the syncer recorded with its last
        merged contribution (on a restart), advanced by one per ``step()`` unless ``step`` is
        told the position."""
        return self._position

    @property
    def versions(self) -> tuple[int, ...]:
        """The global version of each fragment this learner last took."""
        return tuple(self.session.core.base_version) if self.session is not None else self._facts[1]

    @property
    def closed(self) -> bool:
        """``close()`` was called (or ``finish()``, or the ``with`` block ended)."""
        return self._closed

    @property
    def run_ended(self) -> bool:
        """The syncer ended the run (its budget is spent; also told to a learner that joins or
        reconnects after the end): leave the loop and call ``finish()``. A ``step()`` after the
        one that returned with it true raises ``UsageError``, and so does one after it was read
        true (the comm thread may hear the end between a step's return and the loop's check of
        this). In a torchrun group every rank sees it at the same step."""
        if self.world > 1:
            ended = self._facts[2] is not None
        else:
            ended = self.comm is not None and self.session is not None and self.session.run_end is not None
        self._told_end = self._told_end or ended
        return ended

    @property
    def end_reason(self) -> str:
        """Why the syncer ended the run ("" while it goes on)."""
        if self.world > 1:
            return self._facts[2] or ""
        return self.session.end_reason if self.comm is not None and self.session is not None else ""

    def finish(self, timeout_s: float | None = None) -> bool:
        """After ``run_ended``: take part in the final sync without training (apply the last
        merged versions, answer the syncer's final requests) until the syncer says the final
        model is written, then ``close()``. Bounded by ``timeout_s`` (default: the liveness
        timeout plus 30 s). True when the syncer confirmed the end; while the run goes on it
        only closes (False)."""
        comm, session = self.comm, self.session
        if comm is None or session is None or session.run_end is None:  # the run goes on (or no syncer): just leave
            self.close()
            return False
        if timeout_s is None:
            timeout_s = self.cfg.algo.liveness_timeout_s + 30.0
        deadline = self.clock.monotonic() + timeout_s
        while session.run_end != "done" and self.clock.monotonic() < deadline:
            if comm.stop.is_set():
                break  # the comm thread died: nothing more will come
            self._idle_boundary()
            comm.arrived.wait(0.05)
            comm.arrived.clear()
        done = session.run_end == "done"
        if done:
            self._idle_boundary()  # the last versions that arrived with the end
        self.close()
        return done

    def step(
        self,
        tokens: int,
        data_position: int | None = None,
        *,
        loss: float | torch.Tensor | None = None,
        routed: Mapping[str, torch.Tensor | Sequence[int]] | None = None,
    ) -> None:
        """Count one finished inner step of ``tokens`` tokens (this process's; a torchrun group
        counts ``tokens x world size``) and run the step boundary. Never waits on the network
        (except for the lock-step baselines, ``late_fragment = wait``).

        ``data_position``: where the data would resume after this step (default: one more than
        before), recorded by the syncer with this learner's merged contributions.

        ``loss``: this step's training loss (a number or a one-element tensor), shown by
        ``ddiloco status`` and recorded in metrics/learners.jsonl; the last one given is kept, so
        it may be passed every N steps only. A tensor is read at once: on an accelerator that
        waits for the step to finish (a device sync), so pass a number you already have, or the
        tensor every N steps. A loss that is not finite (or negative) is reported as unknown.

        ``routed``: for a mixture of experts with ``algo.expert_weights = "routed"``, the tokens
        this step routed to each expert, keyed by the name of each expert-stacked parameter (the
        expert index on dim 0): one count per row, each at most ``tokens`` (e.g. a bincount of
        the router's choices). The merge then weighs each expert's row by the tokens it saw on
        this learner. Read at once (a device sync for an accelerator tensor); ignored under
        "tokens". In a torchrun group the counts are this rank's, scaled by the world size as
        ``tokens`` is. A model without it needs nothing: plain token weighting."""
        t0 = time.perf_counter()
        self._check_can_step(tokens, data_position)
        counts = None
        if routed is not None and self.cfg.algo.expert_weights == "routed":
            try:
                counts = routed_counts(routed, self._expert_rows, tokens, self.world)
            except ValueError as e:
                raise UsageError(f"step(routed=...): {e}") from None
        if loss is not None:
            self.stats.loss = self._loss_value(loss)
        if self._last_end is not None:
            self.stats.step_s += t0 - self._last_end
        # The step's time for the syncer's step clock: from the last call's start to this one's,
        # its own boundary included. Of it, the last call's lock-step wait is not busy: the session
        # counts the rest (``LearnerSession.busy_s``) and reports its mean as the step time.
        duration = t0 - self._last_start if self._last_start is not None else 0.0
        waited, self._waited = self._waited, 0.0
        self._last_start = t0
        n = tokens * self.world
        self._position = self._position + 1 if data_position is None else data_position
        plan = None
        if self.session is not None:
            with self._lock():
                now = self.clock.monotonic()
                plan = self.session.step(n, duration, now, self._position, self.stats.loss, counts, waited)
        self._boundary(plan)
        blocked = self._waited = self._block_if_lock_step()
        self.stats.steps += 1
        self.stats.tokens += n
        if self.stats.steps == 1:
            self.startup.mark("first_step")
        end = time.perf_counter()
        self.stats.sync_s += end - t0 - blocked
        self._last_end = end
        if self.session is not None:
            self.stats.bytes_sent = self.session.bytes_sent
        self._raise_if_comm_stopped()
        self._told_end = self.run_ended

    def local_state_stats(self) -> dict[str, Any] | None:
        """What saving its own state has cost so far (saves, copy seconds on the step path, the
        last save's span); None when it saves none (``runtime.local_state_s`` = 0, no folder)."""
        return self._saver.stats() if self._saver is not None else None

    def close(self) -> None:
        """Leave the fleet (the syncer stops waiting for this learner at once) and stop the comm
        thread. Idempotent; the model keeps its last values."""
        if self._closed:
            return
        self._closed = True
        if self._saver is not None:
            self._saver.close()
        if self.comm is not None:
            self.comm.close()

    def __enter__(self) -> Learner:
        if self._closed:
            raise UsageError("this Learner is closed; make a new one")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- checks --------------------------------------------------------------------------------

    def _check_can_step(self, tokens: int, data_position: int | None) -> None:
        if self._closed:
            raise UsageError("step() after close(): make a new Learner (it rejoins and fetches the global state)")
        if self._told_end:
            raise UsageError(
                f"learner {self.id}: the run has ended ({self.end_reason}); step() trains no more: leave the loop "
                "when learner.run_ended is true and call learner.finish()"
            )
        if type(tokens) is not int or tokens < 0:
            raise UsageError(f"step(tokens={tokens!r}): tokens must be an integer >= 0 (tokens in this step)")
        if data_position is not None and (type(data_position) is not int or data_position < 0):
            raise UsageError(f"step(data_position={data_position!r}): must be an integer >= 0")
        problem = self._watch.check(walk=self.stats.steps % 16 == 0)
        if problem is not None:
            raise UsageError(problem)

    @staticmethod
    def _loss_value(loss: Any) -> float:
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise UsageError(f"step(loss=...): a tensor of shape {tuple(loss.shape)}; pass one value (loss.mean())")
            return float(loss.detach().reshape(()).item())
        if isinstance(loss, bool) or not isinstance(loss, (int, float)):
            raise UsageError(f"step(loss={loss!r}): must be a number or a one-element tensor")
        return float(loss)

    def _raise_if_comm_stopped(self) -> None:
        """Raised at the end of a step, after its boundary: in a torchrun group every rank took
        part in the boundary's broadcast, so the ranks' collectives stay paired."""
        comm, session = self.comm, self.session
        if comm is None or session is None or session.run_end is not None:
            return
        if session.refused:
            raise RefusedError(self._refusal(session))
        if session.gave_up:
            raise CommError(session.gave_up)
        if comm.stop.is_set():
            raise CommError(f"learner {self.id}: its comm thread died ({comm.died}); restart the learner")

    def _refusal(self, session: LearnerSession | SettingsQuery) -> str:
        """The line a final refusal raises: a superseded process is told by whom, in the syncer's words."""
        reason = session.refused or ""
        if isinstance(session, LearnerSession) and session.superseded:
            return reason
        return f"learner {self.id} was refused by the syncer: {reason}"

    # -- joining -------------------------------------------------------------------------------

    def _join(self, timeout_s: float) -> None:
        """Take the global state before training (bounded: a dead syncer must not stall us)."""
        comm, session = self.comm, self.session
        if comm is not None and session is not None:
            with self._lock():
                session.join_begins(self.clock.monotonic())
            comm.start()
            self._wait_for_fragments(comm, session, timeout_s)
            if session.refused:
                raise RefusedError(self._refusal(session))
            self._write_initial(session)
        if self.world > 1:
            self._share_initial()
        self._idle_boundary()

    def _wait_for_fragments(self, comm: LearnerComm, session: LearnerSession, timeout_s: float) -> None:
        """Apply the global fragments as they arrive until the session says training may start
        (all of them, or ``join_timeout_s`` without progress: a join over a thin link waits as
        long as its fragments keep coming). The wait is ``stats.join_s``."""
        t0 = time.perf_counter()
        while not comm.stop.is_set() and not session.done:
            self._idle_boundary(keep=bool(self.sharded), joining=True)  # (keep: an FSDP2 group's other ranks' rows)
            now = self.clock.monotonic()
            with self._lock():
                ready, deadline = session.ready(now), session.join_deadline
                if session.joined_once:
                    self.startup.mark("join")
            if ready or now >= deadline:
                break
            self._raise_on_handshake_failure(comm.sock, comm.addresses)
            comm.arrived.wait(0.05)
            comm.arrived.clear()
        if not session.joined_once and not comm.stop.is_set() and not session.done:
            # Never reached: a wrong address or port, a syncer not up, a firewall. Fail loudly
            # (once joined, a lost syncer is different: the learner trains on and rejoins).
            self._raise_on_handshake_failure(comm.sock, comm.addresses)
            if session.held is not None:  # it did answer: another live process holds this id
                raise RefusedError(f"learner {self.id} was refused by the syncer: {session.held}")
            raise CommError(self._no_answer(comm.addresses, timeout_s))
        if session.data_position:
            self._position = self._plausible_position(session.data_position)
        self.stats.join_s = time.perf_counter() - t0
        if session.joined_once:
            self.startup.mark("download")
        got, total = len(session.received), self.layout.num_fragments
        if got < total and not session.done:
            log.warning(
                "learner %d: got %d/%d global fragments in %.0f s, then none for %.0f s (runtime.join_timeout_s); "
                "training on from what it has",
                self.id, got, total, self.stats.join_s, timeout_s,
            )  # fmt: skip
        if session.joined_once and session.run_end is None:
            versions = sorted(set(session.core.base_version))
            shown = f"{versions[0]}" if len(versions) == 1 else f"{versions[0]}..{versions[-1]}"
            log.info(
                "learner %d joined the run at %s: global version %s of its %d fragments (%d/%d received), data "
                "position %d, the fleet at %s tokens",
                self.id, ", ".join(comm.addresses), shown, total, got, total, self._position,
                f"{session.core.fleet_tokens():,.0f}",
            )  # fmt: skip

    def _write_initial(self, session: LearnerSession) -> None:
        """The fragments the join did not deliver take the ``initial`` model's values (a model
        built empty has none of its own), before anything reads them or the group shares them."""
        lacking = [p for p in range(self.layout.num_fragments) if p not in session.received]
        if lacking and self._initial is not None:
            values = synced_tensors(self._initial())
            for p in lacking:
                self._host.write(p, read_fragment(values, self.pieces[p]), 0.0, False)
            log.info("learner %d: %d fragments the join did not deliver take the initial values", self.id, len(lacking))

    def _no_answer(self, addresses: list[str], timeout_s: float) -> str:
        return (
            f"learner {self.id}: no answer from the syncer at {', '.join(addresses)} within {timeout_s:.0f} s "
            "(runtime.join_timeout_s): is it running, are the host and port right, and does it take this learner's "
            "key (ddiloco train and SyncerServer make keys in RUN_DIR/keys: pass key=RUN_DIR/keys, --keys "
            "RUN_DIR/keys)?"
        )

    def _raise_on_handshake_failure(self, sock: LearnerSocket, addresses: list[str]) -> None:
        """A connection refused at its handshake is a key problem, not a network one: say which."""
        probe = getattr(sock, "handshake_failure", None)  # a test's transport may have no handshake
        failure = probe() if probe is not None else None
        if failure is not None:
            raise CommError(handshake_problem(self.id, addresses[failure[0]], failure[1], self._keyed))

    def _ask_settings(
        self, sock: LearnerSocket, addresses: list[str], rt: RuntimeConfig, timeout_s: float
    ) -> dict[str, Any]:
        """The run's settings from syncer shard 0, before the layout is built (a learner given no
        config adopts them). A finished run gives none: the join then hears that it is over."""
        now = self.clock.monotonic()
        query, deadline = SettingsQuery(self.id, self.incarnation, rt, now), now + timeout_s
        while not query.done and now < deadline:
            for send in query.tick(now).send:
                sock.send(send.shard, encode(send.msg))
            wake = query.next_deadline(now)
            for link, frames in sock.recv(min(deadline, wake if wake is not None else deadline, now + 0.25) - now):
                try:
                    msg = decode(frames)
                except WireError:
                    continue  # counted nowhere: the join that follows says what is wrong, if anything
                query.receive(link, msg, self.clock.monotonic())
            self._raise_on_handshake_failure(sock, addresses)
            now = self.clock.monotonic()
        if query.refused is not None:
            raise RefusedError(self._refusal(query))
        if query.ended is None and query.settings is None:
            raise CommError(self._no_answer(addresses, timeout_s))
        if query.settings is not None:
            log.info("learner %d: adopted the run's %d settings from the syncer", self.id, len(query.settings))
        return query.settings or {}

    def _plausible_position(self, position: int) -> int:
        most = self.max_data_position
        if most is not None and position > most:
            log.warning("learner %d: ignored a data position of %d (at most %d is plausible)", self.id, position, most)
            return 0
        return position

    # -- the step boundary ---------------------------------------------------------------------

    def _idle_boundary(self, keep: bool = False, joining: bool = False) -> None:
        """A boundary without a step: while joining, waiting (lock-step) or finishing, what
        arrived is applied and answered at once. ``keep``: remember the applied fragments (an
        FSDP2 group's other ranks write their rows of the join's fragments). ``joining``: snapshot
        no fragment the join has not delivered (the model does not hold its values yet)."""
        plan = None
        if self.session is not None:
            with self._lock():
                plan = self.session.boundary(self.clock.monotonic())
                if joining:  # no answer is built on a fragment the join has not delivered yet
                    plan.prepare = [p for p in plan.prepare if p in self.session.received]
            if keep:
                self._joined += [u for u, _ in plan.apply]
        if self.world > 1 and not self._shared:
            self._boundary(plan, collective=False)  # before the group shares the join, rank 0 alone applies
        else:
            self._boundary(plan)

    def _lock(self) -> Any:
        """The session's lock (the comm thread shares the session), or a no-op when there is none."""
        return self.comm.lock if self.comm is not None else contextlib.nullcontext()

    def _boundary(self, plan: BoundaryPlan | None, collective: bool = True) -> None:
        """Everything the training thread does at a step boundary, as the session planned it:
        write the fragments that arrived, load a requested optimizer state, read the fragments
        to send or snapshot, then hand the values back to the session.

        In a torchrun group rank 0 plans and broadcasts the plan with what it knows of the
        fleet; then every rank writes the same fragments and joins the same FSDP2 gathers in the
        same order. Only rank 0 sends. Inside a learner a collective is fine: it is one failure
        domain."""
        if self.world > 1 and collective:
            import torch.distributed as dist

            s = self.session
            facts = None if s is None else (s.core.fleet_tokens(), self.versions, s.end_reason if s.run_end else None)
            box: list[Any] = [plan, facts]
            dist.broadcast_object_list(box, src=0)
            plan, facts = box
            if facts is not None:
                self._facts = facts  # rank 0 too: every rank sees the run's end at the same step
        if plan is None:
            return
        for _, receipt in plan.apply:
            self.stats.applied += 1
            if receipt.own:
                self.startup.mark("first_merged")  # merged this process's own answer (not a predecessor's)
        # Only rank 0 sends; the other ranks join the gathers of an FSDP2 model.
        gather = collective and bool(self.sharded)
        out = self._executor.run(plan, self.session, read=self.rank == 0 or gather, lock=self._lock())
        if out is not None and self.comm is not None:
            self.comm.post(out)
        if self._saver is not None and self.session is not None:
            self._saver.boundary(self.session, self._position)

    def _took_state(self, ps: PeerState) -> None:
        """A live peer's optimizer state was loaded at a boundary."""
        self.startup.mark("handoff")
        steps = [int(v.max()) for k, v in ps.tensors.items() if k.endswith(".step") and v.numel()]
        at = f"its optimizer at step {max(steps)}" if steps else "an optimizer that counts no steps"
        log.info("learner %d: took learner %d's optimizer state (%s) at its own step %d",
                 self.id, ps.source, at, self.stats.steps)  # fmt: skip

    def _share_initial(self) -> None:
        """After the join, every rank starts from rank 0's model and data position."""
        import torch.distributed as dist

        box: list[Any] = [(self._position, self._joined if self.sharded else [])]
        dist.broadcast_object_list(box, src=0)
        position, joined = box[0]
        if self.rank != 0:
            for u in joined:  # FSDP2: each rank writes its own rows of the global state
                self._host.write(u.fragment, u.values, 0.0, False)
        # rank 0 applied the global state it fetched on join: every rank starts from it
        with torch.no_grad():
            for name, prm in synced_tensors(self.model).items():
                if name not in self.sharded:
                    dist.broadcast(prm.data, src=0)
        if self.rank != 0:
            self._position = position
        self._joined = []
        self._shared = True

    def _block_if_lock_step(self) -> float:
        """Lock-step baselines wait at step send+tau for the fragment (bounded by syncer_timeout_s);
        returns how long."""
        comm, session = self.comm, self.session
        if self.cfg.algo.late_fragment != "wait" or comm is None or session is None:
            return 0.0
        t0 = time.perf_counter()
        while not comm.stop.is_set():
            with self._lock():
                waiting = session.core.blocking_fragments(self.clock.monotonic())
            if not waiting:
                break
            comm.arrived.wait(0.01)
            comm.arrived.clear()
            self._idle_boundary()
        waited = time.perf_counter() - t0
        self.stats.blocked_s += waited
        return waited
