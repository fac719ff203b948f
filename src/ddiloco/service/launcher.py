"""``ddiloco train``: a syncer, M learners and an evaluator as processes on this machine.

It restarts a learner that exits abnormally (bounded), injects the configured chaos into real
processes (SIGKILL learners, SIGSTOP/SIGCONT duty cycles for stragglers, SIGKILL + restart of
the syncer), logs every fault with its time, shows a combined progress view, and writes the
same run folder and summary table as ``ddiloco simulate``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from ddiloco.chaos.schedule import make_schedule
from ddiloco.config import Config, to_dict
from ddiloco.errors import DDiLoCoError
from ddiloco.report.accounting import Goodput, uptime
from ddiloco.report.result import RunResult, summarise_tape
from ddiloco.report.rundir import prepare_run_dir
from ddiloco.report.tape import read_tape
from ddiloco.service.learner import EXIT_REFUSED
from ddiloco.service.status import read_status


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    """A child process the launcher supervises."""

    name: str
    argv: list[str]
    popen: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    stopped: bool = False  # SIGSTOPped by a straggler duty cycle
    log: Any = None

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        if self.log is not None:
            self.log.close()
        self.log = open(log_dir / f"{self.name}.log", "ab")  # noqa: SIM115 (open for the child's lifetime)
        self.popen = subprocess.Popen(
            self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.started_at = time.time()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the process to end; past ``timeout`` it is SIGKILLed."""
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


@dataclass
class LearnerBook:
    """Per-learner accounting across its incarnations."""

    steps: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    down_s: float = 0.0
    restarting_s: float = 0.0
    failures: int = 0
    down_since: float | None = None
    restart_spawned: float | None = None
    restart_latencies: list[float] = field(default_factory=list)
    lost_steps: float = 0.0
    outages: list[tuple[float, float]] = field(default_factory=list)  # (death, first step after)


@dataclass
class _Plan:
    """What the chaos schedule still has in store, and the restarts that are due."""

    schedule: Any
    kills: list[tuple[float, int, float]]
    syncer_kills: list[float]
    restarts: list[tuple[float, int]] = field(default_factory=list)
    syncer_back_at: float | None = None

    @classmethod
    def of(cls, cfg: Config, learners: int) -> _Plan:
        T = cfg.runtime.duration_s
        schedule = make_schedule(cfg.chaos, learners, T, cfg.run.seed)
        kills = sorted((o.start_s, o.learner, o.end_s) for o in schedule.outages)
        syncer_kills = sorted(f * T for f in cfg.chaos.syncer_kills) if cfg.chaos.enabled else []
        return cls(schedule, kills, syncer_kills)


class Launcher:
    def __init__(
        self, cfg: Config, run_dir: str | Path, host: str = "127.0.0.1", on_status: Callable[[dict], None] | None = None
    ) -> None:
        self.cfg, self.run_dir = cfg, prepare_run_dir(run_dir, "ddiloco train")
        self.logs = self.run_dir / "logs"
        self.logs.mkdir(exist_ok=True)
        self.cfg_path = self.run_dir / "config.toml"
        self.cfg_path.write_text(tomli_w.dumps(to_dict(cfg)))
        self.addr = f"tcp://{host}:{free_port(host)}"
        self.on_status = on_status
        py = [sys.executable, "-m", "ddiloco"]
        rd = str(self.run_dir)
        self.syncer = Proc("syncer", [*py, "syncer", "--bind", self.addr, "--run-dir", rd, str(self.cfg_path)])
        self.learners = [
            Proc(
                f"learner-{m}",
                [*py, "learner", "--syncer", self.addr, "--id", str(m), "--run-dir", rd, str(self.cfg_path)],
            )
            for m in range(cfg.run.num_learners)
        ]
        self.evaluator = Proc(
            "evaluator", [*py, "evaluator", "--syncer", self.addr, "--run-dir", rd, str(self.cfg_path)]
        )
        self.books = [LearnerBook() for _ in self.learners]
        self.faults: list[dict] = []
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def _fault(self, kind: str, target: str, t0: float, **extra: Any) -> None:
        rec = {"event": "fault", "kind": kind, "target": target, "time": time.time(), "t": time.time() - t0, **extra}
        self.faults.append(rec)
        with open(self.run_dir / "metrics" / "faults.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _wait_syncer_ready(self, timeout: float = 60.0) -> None:
        status = self.run_dir / "status" / "syncer-0.json"
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.syncer.alive():
                raise DDiLoCoError(f"the syncer exited at start; see {self.run_dir / 'logs' / 'syncer.log'}")
            st = read_status(status)
            if st and st.get("pid") == self.syncer.popen.pid:
                return
            time.sleep(0.1)
        raise DDiLoCoError(
            f"the syncer did not come up within {timeout:.0f} s; see {self.run_dir / 'logs' / 'syncer.log'}"
        )

    def _bank(self, m: int) -> dict | None:
        """Add a finished incarnation's figures (from its last status) to the learner's book."""
        st = read_status(self.run_dir / "status" / f"learner-{m}.json")
        pid = self.learners[m].popen.pid if self.learners[m].popen else None
        if st and st.get("pid") == pid:
            b = self.books[m]
            b.steps += st["steps"]
            b.tokens += st["tokens"]
            b.compute_s += st["compute_s"]
            return st
        return None

    def run(self) -> dict:
        """Run for ``runtime.duration_s``; returns the summary (and writes the run folder)."""
        rt = self.cfg.runtime
        (self.run_dir / "metrics").mkdir(exist_ok=True)
        plan = _Plan.of(self.cfg, len(self.learners))
        self.syncer.start(self.env, self.logs)
        self._wait_syncer_ready()
        self._t0 = time.time()
        for m, p in enumerate(self.learners):
            p.start(self.env, self.logs)
            self.books[m].restart_spawned = p.started_at  # start-up counts as restarting time
        self.evaluator.start(self.env, self.logs)
        last_view = 0.0
        try:
            while (now := time.time()) - self._t0 < rt.duration_s:
                self._inject_chaos(plan, now)
                self._reap_dead(plan, now)
                self._restart_due(plan, now)
                self._track_restarts()
                if self.on_status and now - last_view >= 0.5:
                    last_view = now
                    self.on_status(self.status(self._t0))
                time.sleep(0.02)
        finally:
            end = self._stop_all()
        return self.finish(end - self._t0)

    def _inject_chaos(self, plan: _Plan, now: float) -> None:
        """Scheduled SIGKILLs of learners and of the syncer, syncer restarts, straggler duty cycles."""
        t0, t = self._t0, now - self._t0
        while plan.kills and plan.kills[0][0] <= t:
            _, m, back = plan.kills.pop(0)
            if self.learners[m].alive():
                self.learners[m].signal(signal.SIGKILL)
                self.learners[m].wait()
                self._on_learner_death(m, now, t0, kind="sigkill")
                plan.restarts.append((t0 + max(back, t), m))  # back when its outage ends
        while plan.syncer_kills and plan.syncer_kills[0] <= t:
            plan.syncer_kills.pop(0)
            self.syncer.signal(signal.SIGKILL)
            self.syncer.wait()
            self._fault("sigkill", "syncer", t0)
            plan.syncer_back_at = now + self.cfg.chaos.syncer_down_s
        if plan.syncer_back_at is not None and now >= plan.syncer_back_at:
            plan.syncer_back_at = None
            self.syncer.start(self.env, self.logs)
            self._fault("restart", "syncer", t0)
        self._duty_cycle(plan.schedule, t)

    def _reap_dead(self, plan: _Plan, now: float) -> None:
        """A learner that exited by itself is restarted (bounded), unless the syncer refused it."""
        rt = self.cfg.runtime
        for m, p in enumerate(self.learners):
            if p.popen is None or p.alive() or any(mm == m for _, mm in plan.restarts):
                continue
            code = p.popen.returncode
            self._on_learner_death(m, now, self._t0, kind=f"exit {code}")
            if code == EXIT_REFUSED:
                raise DDiLoCoError(f"learner {m} was refused by the syncer; see {self.logs / p.name}.log")
            if p.restarts >= rt.restart_limit:
                raise DDiLoCoError(
                    f"learner {m} exited {p.restarts + 1} times (runtime.restart_limit = "
                    f"{rt.restart_limit}); see {self.logs / p.name}.log"
                )
            plan.restarts.append((now + rt.restart_delay_s, m))

    def _restart_due(self, plan: _Plan, now: float) -> None:
        for when, m in list(plan.restarts):
            if now < when:
                continue
            plan.restarts.remove((when, m))
            p = self.learners[m]
            p.restarts += 1
            p.start(self.env, self.logs)
            b = self.books[m]
            if b.down_since is not None:
                b.down_s += now - b.down_since
                b.down_since = None
            b.restart_spawned = p.started_at
            self._fault("restart", p.name, self._t0)

    def _stop_all(self) -> float:
        """Stop the learners (they leave cleanly), the evaluator, then the syncer, which flushes
        and writes the final model; returns when the learners' time stopped counting."""
        for p in self.learners:
            if p.stopped:
                p.signal(signal.SIGCONT)
        end = time.time()
        for p in self.learners:
            p.signal(signal.SIGTERM)
        for m, p in enumerate(self.learners):
            if p.popen is not None:
                p.wait(timeout=15)
                self._bank(m)
            b = self.books[m]
            if b.down_since is not None:
                b.down_s += end - b.down_since
            if b.restart_spawned is not None:
                b.restarting_s += end - b.restart_spawned
        self.evaluator.signal(signal.SIGTERM)
        if not self.syncer.alive():
            self.syncer.start(self.env, self.logs)  # bring it back to flush and write the final model
            self._wait_syncer_ready()
        self.syncer.signal(signal.SIGTERM)
        self.syncer.wait(timeout=60)
        self.evaluator.wait(timeout=30)
        for p in (self.syncer, self.evaluator, *self.learners):
            if p.log is not None:
                p.log.close()
        return end

    def _on_learner_death(self, m: int, now: float, t0: float, kind: str) -> None:
        st = self._bank(m)
        b = self.books[m]
        b.failures += 1
        b.lost_steps += (st or {}).get("pending_steps", 0.0)  # steps it had not yet had merged back
        b.down_since = now
        if not b.outages or b.outages[-1][1] != float("inf"):
            b.outages.append((now - t0, float("inf")))
        if b.restart_spawned is not None:  # died while still restarting
            b.restarting_s += now - b.restart_spawned
            b.restart_spawned = None
        self._fault(kind, f"learner-{m}", t0)

    def _track_restarts(self) -> None:
        """A restart ends at the new incarnation's first inner step."""
        for m, b in enumerate(self.books):
            if b.restart_spawned is None:
                continue
            st = read_status(self.run_dir / "status" / f"learner-{m}.json")
            if st and st.get("pid") == self.learners[m].popen.pid and st.get("first_step_at"):
                b.restarting_s += st["first_step_at"] - b.restart_spawned
                b.restart_latencies.append(st["first_step_at"] - b.restart_spawned)
                b.restart_spawned = None
                if b.outages and b.outages[-1][1] == float("inf"):
                    b.outages[-1] = (b.outages[-1][0], st["first_step_at"] - self._t0)

    def _duty_cycle(self, schedule: Any, t: float) -> None:
        """Stragglers: SIGSTOP for (1 - 1/factor) of every second, SIGCONT for the rest."""
        for m, p in enumerate(self.learners):
            f = schedule.slowdown(m, t)
            want_stop = f > 1.0 and (t % 1.0) >= 1.0 / f
            if want_stop != p.stopped and p.alive():
                p.signal(signal.SIGSTOP if want_stop else signal.SIGCONT)
                p.stopped = want_stop

    def status(self, t0: float) -> dict:
        learners = [read_status(self.run_dir / "status" / f"learner-{m}.json") or {} for m in range(len(self.learners))]
        return {
            "t": time.time() - t0,
            "T": self.cfg.runtime.duration_s,
            "syncer": read_status(self.run_dir / "status" / "syncer-0.json") or {},
            "learners": learners,
            "alive": [p.alive() for p in self.learners],
            "faults": len(self.faults),
        }

    def finish(self, elapsed: float) -> dict:
        """Final evaluation of the global model and the run folder."""
        from safetensors.torch import load_file

        from ddiloco.report.rundir import write_run_dir
        from ddiloco.training.evaluate import evaluate
        from ddiloco.workloads.config import load_workload

        wl = load_workload(self.cfg.workload)
        model = wl.build_model(self.cfg.run.seed)
        model.load_state_dict(load_file(str(self.run_dir / "final" / "model.safetensors")))
        final_loss = evaluate(wl, model, wl.eval_batches())
        tape = read_tape(self.run_dir / "state" / "tape.jsonl")
        evals = (
            [json.loads(line) for line in (self.run_dir / "metrics" / "eval.jsonl").read_text().splitlines()]
            if (self.run_dir / "metrics" / "eval.jsonl").exists()
            else []
        )
        evals.append({"time": time.time(), "loss": final_loss, "final": True})
        for e in evals:
            e["time"] -= self._t0  # seconds since the learners started, like the fault log's "t"
        alloc = elapsed * len(self.books)
        compute = sum(b.compute_s for b in self.books)
        down = sum(b.down_s for b in self.books)
        restarting = sum(b.restarting_s for b in self.books)
        syncer_status = read_status(self.run_dir / "status" / "syncer-0.json") or {}
        P = len(syncer_status.get("versions", {})) or 1
        outages = [(m, a, min(b, elapsed)) for m, bk in enumerate(self.books) for a, b in bk.outages]
        need = self.cfg.algo.quorum_size or 1
        result = RunResult(
            method=f"{self.cfg.run.method} (real)",
            final_loss=final_loss,
            evals=[
                {
                    "time": e["time"],
                    "tokens": 0,
                    "merged_tokens": e.get("merged_tokens", 0.0),
                    "loss": e["loss"],
                    "final": e.get("final", False),
                }
                for e in evals
            ],
            horizon_s=elapsed,
            tokens_processed=sum(b.tokens for b in self.books),
            tokens_merged=float(syncer_status.get("global_tokens", 0.0)),
            goodput=Goodput(compute / alloc, 0.0, down / alloc, restarting / alloc),
            uptime=uptime(outages, len(self.books), min(need, len(self.books)), elapsed),
            lost_steps=sum(b.lost_steps for b in self.books),
            failures=sum(b.failures for b in self.books),
            num_fragments=P,
            tape=tape,
            log=self.faults,
            state=dict(model.state_dict()),
            **summarise_tape(tape, P),
        )
        write_run_dir(self.run_dir, self.cfg, result)
        summary = result.summary()
        summary["restart_latencies_s"] = [x for b in self.books for x in b.restart_latencies]
        summary["wall_s"] = elapsed
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
