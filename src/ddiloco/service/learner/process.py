"""``ddiloco learner``: one learner process (or one torchrun group with DDP inside).

It trains the config's workload with AdamW and its LR schedule over the fleet's tokens, and does
everything else through ``ddiloco.Learner`` (``service/learner/api.py``), as a user's own loop would:
the step boundary, the comm thread, joining, DDP broadcasts, the optimizer-state hand-off. The
model the join overwrites is built without its initialisation where it allows that
(``training/empty_model.py``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from ddiloco.config import Config
from ddiloco.errors import CommError, DDiLoCoError, RefusedError
from ddiloco.lifecycle import EXIT_INTERRUPTED, ProgressLines, StopSignals
from ddiloco.report.rundir import prepare_run_dir
from ddiloco.service.base.clock import SYSTEM_CLOCK, Clock
from ddiloco.service.base.heap import release_free_memory
from ddiloco.service.base.keys import ClientKeys, client_keys
from ddiloco.service.base.startup import LEARNER_LAST, StartupTimes
from ddiloco.service.base.status import write_status
from ddiloco.service.learner.api import Learner, SocketFactory
from ddiloco.settings import SETTINGS
from ddiloco.training.empty_model import build_to_receive
from ddiloco.training.inner import inner_step, lr_at, make_optimizer
from ddiloco.workloads.base import routed_tokens
from ddiloco.workloads.config import load_workload
from ddiloco.workloads.custom import move_to

log = logging.getLogger(__name__)

EXIT_REFUSED = 3
"""The syncer refused this learner for good (another model or layout, a differing run setting,
an id outside 0 .. run.num_learners - 1, a key that is not learner m's)."""
EXIT_COMM_DIED = 4
"""The comm thread died (a bug): no learner trains on alone."""
EXIT_NO_SYNCER = 5
"""The first join never got an answer within runtime.join_timeout_s (or a key problem said so)."""
EXIT_SUPERSEDED = 6
"""A newer process took this learner id over: this one stops (do not restart it)."""
EXIT_GAVE_UP = 7
"""A joined learner heard nothing from a syncer shard for runtime.give_up_after_s."""


class LearnerProcess:
    """A learner process: the config's workload, AdamW and its LR schedule, trained through
    ``ddiloco.Learner`` (the same class a user's own training loop uses)."""

    def __init__(
        self,
        cfg: Config,
        syncers: list[str],
        learner_id: int,
        run_dir: str | Path,
        device: str = "cpu",
        threads: int = 1,
        connect: SocketFactory | None = None,
        clock: Clock = SYSTEM_CLOCK,
        incarnation: int | None = None,
        keys: ClientKeys | None = None,
    ) -> None:
        torch.set_num_threads(threads)
        self.cfg, self.id, self.run_dir, self.clock = cfg, learner_id, Path(run_dir), clock
        self.syncers, self.connect, self.keys = syncers, connect, keys
        # One incarnation per process start: the syncer drops whatever its predecessor still sends.
        self.incarnation = incarnation if incarnation is not None else int(clock.wall() * 1e6)
        self.startup = StartupTimes("learner", LEARNER_LAST, id=learner_id, incarnation=self.incarnation)
        self.startup.mark("imports")
        # A torchrun group is one learner: ranks run DDP inside it; rank 0 talks to the syncer.
        self.rank, self.world = 0, 1
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch.distributed as dist

            if device.startswith("cuda"):
                device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
                torch.cuda.set_device(torch.device(device))
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(device)
        prepare_run_dir(self.run_dir, f"ddiloco learner {learner_id}")
        (self.run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        self.wl = load_workload(cfg.workload)
        # The join writes every synced tensor before the first step: with a syncer to join, the
        # model is built without its initialisation where the workload's model allows it.
        built = build_to_receive(self.wl, cfg.run.seed, self.device) if syncers else None
        self.model = built.model if built is not None else self.wl.build_model(cfg.run.seed).to(self.device)
        self.empty = built is not None and built.empty
        self.opt = make_optimizer(self.model, cfg.inner)
        self.startup.who["model"] = built.how if built is not None else "initialised"  # (the record says which)
        self.startup.mark("model")
        if self.rank == 0:  # one record per learner, not per rank
            self.startup.run_dir = self.run_dir
        self.trained: torch.nn.Module = self.model
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.trained = DistributedDataParallel(self.model, device_ids=ids)
        m = cfg.run.num_learners
        # Each rank reads its own slice of the learner's shard.
        self.stream = self.wl.train_stream((learner_id % m) * self.world + self.rank, m * self.world, cfg.run.seed)
        self.learner: Learner | None = None
        self.stop = False
        self.stats: dict[str, Any] = {
            "steps": 0,
            "tokens": 0,
            "compute_s": 0.0,
            "sync_s": 0.0,
            "blocked_s": 0.0,
            "loss": None,
            "applied": 0,
            "started": clock.wall(),
            "first_step_at": None,
        }

    def _join(self) -> Learner:
        """Register and take the global state: ``Learner`` waits up to runtime.join_timeout_s."""
        # A global token count 1000x the budget is not a schedule position but a broken or hostile syncer.
        most_tokens = 1000.0 * self.cfg.run.processed_tokens
        learner = Learner(
            self.trained,
            self.syncers or None,
            learner_id=self.id,
            config=self.cfg,
            optimizer=self.opt,
            transport=self.connect,
            clock=self.clock,
            incarnation=self.incarnation,
            # a position past what the whole budget could have read (>= 1 token per example) is not believed
            max_data_position=int(most_tokens / max(1, self.cfg.workload.batch_size)),
            max_merged_tokens=most_tokens,
            key=self.keys,
            claims=SETTINGS,  # its own loop reads the run's seed and inner schedule too
            startup=self.startup,
            # what a join that went quiet did not deliver: the ordinary build's values (version 0)
            initial=(lambda: self.wl.build_model(self.cfg.run.seed)) if self.empty else None,
            # its own saved state on this machine (runtime.local_state_s): a restart catches up from it
            local_state=self.run_dir / "learners" / f"learner-{self.id}" if self.world == 1 else None,
        )
        if learner.data_position:
            self.stream.seek(learner.data_position)
        return learner

    # -- the loop ----------------------------------------------------------------------------

    def _should_stop(self, learner: Learner) -> bool:
        """Ranks of one learner stop at the same step: rank 0's decision is shared."""
        stop = self.stop or learner.run_ended or (learner.comm is not None and learner.comm.stop.is_set())
        if self.world == 1:
            return stop
        import torch.distributed as dist

        flag = torch.tensor([1 if stop else 0], device=self.device if self.device.type == "cuda" else "cpu")
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def run(self) -> int:
        """Train until stopped; the exit code says why it stopped."""
        try:
            self.learner = learner = self._join()
        except RefusedError as e:
            log.error("%s", e)
            self._finish(None)
            return EXIT_REFUSED
        except CommError as e:
            log.error("%s", e)
            self._finish(None)
            return EXIT_NO_SYNCER
        rt = self.cfg.runtime
        last_status = -float("inf")
        step_log = self._open_step_log()
        progress = ProgressLines(rt.progress_interval_s, enabled=self.rank == 0 and not sys.stderr.isatty())
        while not self._should_stop(learner):
            t0 = time.perf_counter()
            batch = self.stream.next_batch()
            inputs, targets = move_to(batch.inputs, self.device), move_to(batch.targets, self.device)
            self.trained.train()
            loss = self.wl.loss(self.trained, type(batch)(inputs, targets, batch.tokens * self.world))
            lr = lr_at(learner.fleet_tokens, self.cfg.run.processed_tokens, self.cfg.inner)
            inner_step(self.model, self.opt, loss, lr, self.cfg.inner.grad_clip)
            if rt.step_sleep_s:
                time.sleep(rt.step_sleep_s)
            loss_value = float(loss.detach())  # read once: the status file and the heartbeats show it
            try:
                routed = routed_tokens(self.wl, self.model) if self.cfg.algo.expert_weights == "routed" else None
                learner.step(batch.tokens, data_position=self.stream.position, loss=loss_value, routed=routed)
            except (RefusedError, CommError):
                pass  # the comm thread stopped: _should_stop ends the loop on every rank, _finish says why
            dt = time.perf_counter() - t0
            s = self.stats
            s["steps"] += 1
            s["tokens"] += batch.tokens * self.world
            s["compute_s"] += dt
            s["loss"] = loss_value
            if s["first_step_at"] is None:
                s["first_step_at"] = self.clock.wall()
            progress.maybe(
                lambda: f"learner {self.id}: step {self.stats['steps']:,}, {self.stats['tokens']:,} tokens, "
                f"loss {self.stats['loss']:.4f}, "
                f"{self.stats['steps'] / max(self.stats['compute_s'], 1e-9):.1f} steps/s, "
                f"fleet at {learner.fleet_tokens:,.0f} tokens"
            )
            if step_log is not None:
                step_log.write(f"{self.clock.wall():.6f},{dt:.6f}\n")
            if self.clock.monotonic() - last_status >= rt.status_interval_s and self.rank == 0:
                last_status = self.clock.monotonic()
                self.write_status()
                if step_log is not None:
                    step_log.flush()
        return self._finish(step_log)

    def _finish(self, step_log: TextIO | None) -> int:
        learner = self.learner
        comm = learner.comm if learner is not None else None
        session = learner.session if learner is not None else None
        if learner is not None and learner.run_ended and self.world == 1:  # (a torchrun group just leaves)
            confirmed = learner.finish()  # the session said the run ended, and why
            said = "final sync done" if confirmed else "the syncer did not confirm the final sync in time"
            if session is not None and session.tokens == 0:  # told at its join: it had nothing to sync
                said = "the run had ended before this process trained; it leaves"
            log.info("learner %d: %s", self.id, said)
        if learner is not None:
            learner.close()
        self.write_status()
        if self.rank == 0:
            self.startup.write()  # (a no-op when its first merged contribution wrote it)
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
        if step_log is not None:
            step_log.close()
        if session is not None and session.refused and session.superseded:
            log.error("%s", session.refused)
            return EXIT_SUPERSEDED
        if session is not None and session.refused:
            log.error("learner %d refused by the syncer: %s", self.id, session.refused)
            return EXIT_REFUSED
        if session is not None and session.run_end is not None:
            return 0
        if session is not None and session.gave_up:
            log.error("%s", session.gave_up)
            return EXIT_GAVE_UP
        if comm is not None and comm.died:
            log.error("learner %d stops: its comm thread died (%s)", self.id, comm.died)
            return EXIT_COMM_DIED
        return 0

    def _open_step_log(self) -> TextIO | None:
        if not (self.cfg.runtime.step_log and self.rank == 0):
            return None
        return open(self.run_dir / "metrics" / f"steps-{self.id}-{os.getpid()}.csv", "w")

    def write_status(self) -> None:
        release_free_memory()  # versions applied and contributions sent since the last write
        name = f"learner-{self.id}" if self.rank == 0 else f"learner-{self.id}.rank{self.rank}"
        learner = self.learner
        # (summed in float64 without a float64 copy of the model: this runs every status write;
        # none for a model built empty that never joined: it holds no values)
        checksum = None
        if learner is not None or not self.empty:
            checksum = float(sum(p.detach().sum(dtype=torch.float64) for p in self.model.parameters()))
        comm = learner.comm if learner is not None else None
        if learner is not None:  # the protocol's share of the step: time inside Learner.step()
            st = learner.stats
            self.stats.update(sync_s=st.sync_s, blocked_s=st.blocked_s, applied=st.applied)
        write_status(
            self.run_dir / "status" / f"{name}.json",
            {
                "rank": self.rank,
                "world": self.world,
                "param_checksum": checksum,
                "learner": self.id,
                "incarnation": self.incarnation,
                "pid": os.getpid(),
                "time": self.clock.wall(),
                "step_time_s": learner.session.step_time_s if learner is not None and learner.session else 0.0,
                "base_versions": list(learner.versions) if learner is not None else [],
                "pending_steps": _pending_steps(learner),
                "answered": learner.session.answered if learner is not None and learner.session else 0,
                "comm_cpu_s": 0.0 if comm is None else comm.cpu_s,
                "local_state": learner.local_state_stats() if learner is not None else None,
                **self.stats,
            },
        )


def _pending_steps(learner: Learner | None) -> float:
    """Steps it trained that are not merged yet, averaged over its fragments (lost if it dies now)."""
    if learner is None or learner.session is None:
        return 0.0
    steps = learner.session.core.steps
    return sum(steps) / len(steps)


def run_learner(
    cfg: Config,
    syncers: list[str],
    learner_id: int,
    run_dir: str,
    device: str,
    threads: int,
    keys_dir: str | None = None,
    insecure: bool = False,
) -> int:
    """The ``ddiloco learner`` process: SIGTERM/SIGINT stop it cleanly at a step boundary."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DDiLoCoError(f"--device {device} requested but CUDA is not available here; use --device cpu")
    keys = client_keys(syncers, keys_dir, f"learner-{learner_id}", insecure)
    learner = LearnerProcess(cfg, syncers, learner_id, run_dir, device, threads, keys=keys)

    def stop() -> None:
        learner.stop = True

    with StopSignals(f"ddiloco learner {learner_id}", on_stop=stop) as signals:  # it leaves at a step boundary
        code = learner.run()
    # Stopped by a signal before the run ended (a drain, a preemption): not a finished learner, so a
    # supervisor (a Kubernetes Job, Slurm) starts it again rather than counting it done.
    ended = learner.learner is not None and learner.learner.run_ended
    return EXIT_INTERRUPTED if code == 0 and signals.requested and not ended else code
