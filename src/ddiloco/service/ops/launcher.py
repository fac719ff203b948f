"""``ddiloco train``: a syncer, M learners and an evaluator as processes on this machine.

The syncer decides when the run ends (its token or time budget) and runs the final sync; the
launcher supervises until then: it restarts a learner that exits abnormally (bounded), injects
the configured chaos into real processes (SIGKILL learners, SIGSTOP/SIGCONT duty cycles for
stragglers, SIGKILL + restart of the syncer), logs every fault with its time, and shows a
combined progress view. Asked to stop (``request_stop``, from a signal), it stops the learners,
then the syncer (which keeps what was merged and marks the run interrupted). Every child runs
in its own process group, and every group it ever started is killed before ``run`` returns:
no path leaves an orphan. The summary comes from the run folder, as for every other command.

Keys by default: the run's CURVE keys live in ``RUN_DIR/keys`` (made at the first start, kept on
``--resume``) and every child gets them, so that on loopback too a local process can neither take
a learner id nor pose as the syncer; ``insecure`` turns that off. A resumed run whose syncer
state is gone is refused here, in one line, before anything starts (``start_over`` starts it over).

Emulated hosts (``chaos.hosts``): every child runs in a network namespace of its own (the
syncer, each learner, the evaluator; the relays in the syncer's), made before the syncer starts
and deleted after the last child is gone; a learner's link rate is its host's (the kernel's
``tbf``), the relay adds only the delay, stalls and faults.
"""

from __future__ import annotations

import json
import logging
import math
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

from ddiloco.chaos.schedule import link_plan, make_schedule
from ddiloco.config import Config, to_dict
from ddiloco.errors import DDiLoCoError
from ddiloco.link.config import split_rates
from ddiloco.link.hosts import EmulatedHosts
from ddiloco.link.hosts import unavailable as hosts_unavailable
from ddiloco.report.accounting import STATES, uptime
from ddiloco.report.rundir import prepare_run_dir
from ddiloco.report.summary import is_injected, run_started_at, write_summary
from ddiloco.report.tape import append_run_event, read_json, read_jsonl
from ddiloco.service.base.keys import run_keys
from ddiloco.service.base.status import read_status
from ddiloco.service.learner.process import EXIT_REFUSED, EXIT_SUPERSEDED
from ddiloco.service.ops.learner_book import LearnerBook
from ddiloco.service.syncer.store import check_state
from ddiloco.service.syncer.store import start_over as start_over_state

log = logging.getLogger(__name__)

HOSTS_PORT = 5600
"""The syncer's port on its emulated host (its relays take the ports above it)."""


def check_chaos_horizon(cfg: Config) -> None:
    """Refuse (one line) chaos without a time budget: the launcher places its faults over the
    run's length, ``runtime.duration_s`` (stragglers and syncer kills at fractions of it)."""
    if cfg.chaos.enabled and not math.isfinite(cfg.runtime.duration_s):
        raise DDiLoCoError(
            "chaos in ddiloco train places its faults over the run's length, runtime.duration_s, and this run has no "
            "time budget: set one (e.g. --set runtime.duration_s=300; the run still ends at its tokens if those come "
            "first)"
        )
    if cfg.chaos.enabled:  # the links' partitions, now that the run's length is known (one line if they overlap)
        link_plan(cfg.chaos, cfg.run.num_learners, cfg.runtime.duration_s)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _distinct_free_ports(host: str, n: int, taken: set[int]) -> list[int]:
    """``n`` free ports, none in ``taken`` and no two the same (each is free now, not reserved)."""
    out: list[int] = []
    while len(out) < n:
        p = free_port(host)
        if p not in taken and p not in out:
            out.append(p)
    return out


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

    groups: list[int] = field(default_factory=list)
    """Process groups of every incarnation started (each child leads its own)."""

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        if self.log is not None:
            self.log.close()
        self.log = open(log_dir / f"{self.name}.log", "ab")  # noqa: SIM115 (open for the child's lifetime)
        self.popen = subprocess.Popen(
            self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.groups.append(self.popen.pid)
        self.started_at = time.time()

    def kill_groups(self) -> None:
        """SIGKILL every process group this Proc ever started (children of children too)."""
        if self.alive():
            self.signal(signal.SIGCONT)
        for pgid in self.groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.popen is not None:
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.log is not None:
            self.log.close()
            self.log = None

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
        self,
        cfg: Config,
        run_dir: str | Path,
        host: str = "127.0.0.1",
        on_status: Callable[[dict], None] | None = None,
        port: int | None = None,
        insecure: bool = False,
        start_over: bool = False,
    ) -> None:
        """``insecure``: no CURVE keys (any local process may join or pose as the syncer);
        ``start_over``: the run folder's syncer state is missing: start it over at version 0."""
        check_chaos_horizon(cfg)
        self.cfg, self.run_dir = cfg, prepare_run_dir(run_dir, "ddiloco train")
        if start_over:
            start_over_state(self.run_dir, by="--start-over")
        else:  # the syncer would refuse it too, but only into its log: say it here, in one line
            check_state(self.run_dir)
        self.logs = self.run_dir / "logs"
        self.logs.mkdir(exist_ok=True)
        (self.run_dir / "metrics").mkdir(exist_ok=True)
        saved = self.run_dir / "config.toml"
        if not saved.exists():
            saved.write_text(tomli_w.dumps(to_dict(cfg)))
        # What this launch's processes are given: the run's config with this command's runtime.* and
        # run.threads (a resumed run's --set; the saved config.toml keeps the run's own, and each
        # process checks the two agree in everything else).
        self.cfg_path = self.logs / "config.toml"
        self.cfg_path.write_text(tomli_w.dumps(to_dict(cfg)))
        # Chaos links: learner m talks to its relay, which forwards to the syncer (docs/runtime.md#link-emulator).
        relayed = link_plan(cfg.chaos, cfg.run.num_learners, cfg.runtime.duration_s) if cfg.chaos.enabled else {}
        self.hosts = self._emulated_hosts(cfg, insecure, relayed)
        """Each role's network namespace (None: every process on this machine's loopback)."""
        if self.hosts is not None:  # a fresh namespace: every port is free there
            host, port = self.hosts.address("syncer"), port or HOSTS_PORT
        self.addr = f"tcp://{host}:{port or free_port(host)}"
        self.host = host
        self.on_status = on_status
        py = [sys.executable, "-m", "ddiloco"]
        rd = str(self.run_dir)
        self.keys: Path | None = None
        """The run's keys folder (None: --insecure)."""
        if insecure:
            log.warning("INSECURE: the run's processes talk without keys: any local process may join or pose as them")
            secure = ["--insecure"]
        else:
            self.keys = run_keys(self.run_dir, cfg.run.num_learners)
            secure = ["--keys", str(self.keys)]
        self.syncer = Proc("syncer", [*py, "syncer", "--bind", self.addr, "--run-dir", rd, *secure, str(self.cfg_path)])
        if self.hosts is not None and not cfg.chaos.site_link:  # a link that is only a rate is its host's
            relayed = {m: r for m, r in relayed.items() if split_rates(r[0])[1] or r[1]}
        syncer_port = int(self.addr.rsplit(":", 1)[1])
        ports = (
            [syncer_port + 1 + i for i in range(len(relayed))]
            if self.hosts is not None
            else _distinct_free_ports(host, len(relayed), taken={syncer_port})
        )
        self.link_routes = {m: (port, *relayed[m]) for m, port in zip(sorted(relayed), ports)}
        """Learner -> (its relay's port, link string, fault strings)."""
        self.link_plan_path = self.run_dir / "links.json"
        self.links: Proc | None = None
        if self.link_routes:
            self.links = Proc("links", [*py, "link", "--plan", str(self.link_plan_path), "--faults-log",
                                        str(self.run_dir / "metrics" / "faults.jsonl"), "--ready-file",
                                        str(self.logs / "links.ready")])  # fmt: skip
        tail = ["--run-dir", rd, *secure, str(self.cfg_path)]
        self.learners = [
            Proc(f"learner-{m}", [*py, "learner", "--syncer", self._learner_addr(host, m), "--id", str(m), *tail])
            for m in range(cfg.run.num_learners)
        ]
        self.evaluator = Proc(
            "evaluator", [*py, "evaluator", "--syncer", self.addr, "--run-dir", rd, *secure, str(self.cfg_path)]
        )
        if self.hosts is not None:  # each role in its host's namespace (the relays in the syncer's)
            hosted = self.hosts
            for p, where in [(self.syncer, "syncer"), (self.evaluator, "evaluator"),
                             *((p, p.name) for p in self.learners),
                             *([(self.links, "syncer")] if self.links else [])]:  # fmt: skip
                p.argv = hosted.command(where, p.argv)
        self.books = [LearnerBook() for _ in self.learners]
        self.faults: list[dict] = []
        self._phases_said: set[tuple[int, str]] = set()  # (straggler entry, straggle | straggle_end) recorded
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.stop_requested = False
        self.interrupted = False
        self.syncer_restarts = 0
        self._t0 = time.time()
        self._t_learners: float | None = None  # when the learners were started (their time counts from then)
        self._ending = False  # the syncer announced the run's end: no more chaos
        # A resumed run (train --resume) adds this session's accounting to the earlier ones'.
        self._previous_accounting = read_json(self.run_dir / "metrics" / "accounting.json")

    @staticmethod
    def _emulated_hosts(
        cfg: Config, insecure: bool, relayed: dict[int, tuple[str, tuple[str, ...]]]
    ) -> EmulatedHosts | None:
        """The run's emulated hosts (not made yet), each learner's rate from its link string in
        ``relayed``, or None when chaos.hosts is off; one line when they cannot be had here."""
        if not (cfg.chaos.enabled and cfg.chaos.hosts):
            return None
        why = hosts_unavailable()
        if why is not None:
            raise DDiLoCoError(f"chaos.hosts: {why}; set chaos.hosts = false to run every process on loopback")
        if insecure:
            raise DDiLoCoError("chaos.hosts: the processes talk across emulated hosts, off loopback: keys are "
                               "required; drop --insecure")  # fmt: skip
        rates = {f"learner-{m}": split_rates(spec)[0] for m, (spec, _) in relayed.items() if spec}
        names = ["syncer", "evaluator", *(f"learner-{m}" for m in range(cfg.run.num_learners))]
        return EmulatedHosts(names, rates)

    def _learner_addr(self, host: str, m: int) -> str:
        """The syncer's address as learner m dials it: its relay's when its link is emulated."""
        return f"tcp://{host}:{self.link_routes[m][0]}" if m in self.link_routes else self.addr

    def link_plan(self) -> dict[str, Any]:
        """The relays' plan (``ddiloco link --plan``): one route per relayed learner, to the
        syncer, with the faults on the run's clock (``start_at``: when the run started)."""
        syncer = self.addr.removeprefix("tcp://")
        routes = [
            {
                "name": f"link-{m}",
                "listen": f"{self.host}:{port}",
                "to": syncer,
                "link": split_rates(spec)[1] if self.hosts is not None else spec,
                "faults": list(faults),
            }
            for m, (port, spec, faults) in sorted(self.link_routes.items())
        ]
        return {"routes": routes, "site_link": self.cfg.chaos.site_link, "horizon_s": self.cfg.runtime.duration_s,
                "seed": self.cfg.run.seed, "start_at": self._t0}  # fmt: skip

    def _start_links(self) -> None:
        """Write the relays' plan and start them; wait until they listen."""
        assert self.links is not None
        self.link_plan_path.write_text(json.dumps(self.link_plan(), indent=1))
        ready = self.logs / "links.ready"
        ready.unlink(missing_ok=True)
        self.links.start(self.env, self.logs)
        deadline = time.time() + 60
        while time.time() < deadline and not self.stop_requested:
            if not self.links.alive():
                raise DDiLoCoError(
                    f"the link relays exited at start{_last_error(self.logs / 'links.log')}; see its log"
                )
            st = read_json(ready)
            if st and st.get("pid") == self.links.popen.pid:
                return
            time.sleep(0.05)
        if not self.stop_requested:
            raise DDiLoCoError(f"the link relays did not come up within 60 s; see {self.logs / 'links.log'}")

    def _watch_links(self) -> None:
        """Relays that died are started again (same ports: the learners reconnect), bounded."""
        if self.links is None or self.links.popen is None or self.links.alive():
            return
        self._fault(f"exit {self.links.popen.returncode}", "links")
        if self.links.restarts >= self.cfg.runtime.restart_limit:
            raise DDiLoCoError(
                f"the link relays exited {self.links.restarts + 1} times (runtime.restart_limit); see "
                f"{self.logs / 'links.log'}"
            )
        self.links.restarts += 1
        self._start_links()
        self._fault("restart", "links")

    def request_stop(self) -> None:
        """Stop early (from a signal handler): ``run`` stops the learners, then the syncer, and
        writes the partial results."""
        self.stop_requested = True

    def _fault(self, kind: str, target: str, **extra: Any) -> None:
        now = time.time()
        rec = {"event": "fault", "time": now - self._t0, "kind": kind, "target": target, **extra}
        self.faults.append(rec)
        with open(self.run_dir / "metrics" / "faults.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _wait_syncer_ready(self, timeout: float = 60.0) -> None:
        status = self.run_dir / "status" / "syncer-0.json"
        deadline = time.time() + timeout
        while time.time() < deadline and not self.stop_requested:
            if not self.syncer.alive():
                raise DDiLoCoError(f"the syncer exited at start{_last_error(self.logs / 'syncer.log')}; see its log")
            st = read_status(status)
            if st and st.get("pid") == self.syncer.popen.pid:
                return
            time.sleep(0.1)
        if not self.stop_requested:
            raise DDiLoCoError(f"the syncer did not come up within {timeout:.0f} s; see {self.logs / 'syncer.log'}")

    def _own_status(self, m: int) -> dict | None:
        """Learner m's status file if its current process wrote it, else None."""
        st = read_status(self.run_dir / "status" / f"learner-{m}.json")
        pid = self.learners[m].popen.pid if self.learners[m].popen else None
        return st if st and pid is not None and st.get("pid") == pid else None

    def run(self) -> dict:
        """Run until the syncer ends the run (or ``request_stop``); returns the summary, which
        is also in the run folder."""
        try:
            if self.hosts is not None:
                self.hosts.up()
            self._supervise()
        finally:
            end = self._stop_all()
            for p in self._procs():
                p.kill_groups()  # whatever is left, in any path: no orphans
            if self.hosts is not None:
                self.hosts.down()
        return self.finish(end)

    def _procs(self) -> list[Proc]:
        return [*self.learners, self.evaluator, self.syncer, *([self.links] if self.links else [])]

    def _supervise(self) -> None:
        self._t0 = run_started_at(self.run_dir) or time.time()
        plan = _Plan.of(self.cfg, len(self.learners))
        self.syncer.start(self.env, self.logs)
        self._wait_syncer_ready()
        if self.links is not None:
            self._start_links()
        self._t_learners = time.time()  # the learners' allocated time starts: every account at once
        self.books = [LearnerBook.starting_at(self._t_learners) for _ in self.learners]
        for p in self.learners:
            if self.stop_requested:
                return
            p.start(self.env, self.logs)
        self.evaluator.start(self.env, self.logs)
        last_view = last_look = 0.0
        was_ending = self._ending
        while not self.stop_requested:
            now = time.time()
            if self._syncer_exited(plan, now):
                return
            if now - last_look >= 0.1:  # chaos stops once the syncer ends the run
                last_look = now
                stage = (read_status(self.run_dir / "status" / "syncer-0.json") or {}).get("run_end")
                if stage == "done" and not any(p.alive() for p in self.learners):
                    return  # every learner it runs has heard the end: the syncer need not linger for others
                self._ending = self._ending or bool(stage)
            if self._ending and not was_ending:
                was_ending = True
                self._release_stragglers()
                if self.links is not None:  # no more link faults: the final sync must get through
                    self.links.signal(signal.SIGUSR1)
            if not self._ending:
                self._inject_chaos(plan, now)
            self._reap_dead(plan, now)
            self._restart_due(plan, now)
            self._watch_links()
            self._track_first_steps()
            if now - last_view >= 0.5 and self.on_status:
                last_view = now
                self.on_status(self.status())
            time.sleep(0.02)
        self.interrupted = True

    def _syncer_exited(self, plan: _Plan, now: float) -> bool:
        """True when the syncer has ended the run; a syncer that died otherwise is restarted
        (it resumes from its durable state), at most runtime.restart_limit times."""
        if self.syncer.alive() or plan.syncer_back_at is not None:
            return False
        code = self.syncer.popen.returncode if self.syncer.popen else None
        st = read_status(self.run_dir / "status" / "syncer-0.json") or {}
        if code == 0 and st.get("run_end") == "done":
            return True
        if code == 0:  # stopped from outside (not by us): the run is interrupted
            self.interrupted = True
            return True
        self._fault(f"exit {code}", "syncer")
        if self.syncer_restarts >= self.cfg.runtime.restart_limit:
            raise DDiLoCoError(
                f"the syncer exited {self.syncer_restarts + 1} times (runtime.restart_limit); "
                f"see {self.logs}/syncer.log"
            )
        self.syncer_restarts += 1
        self.syncer.start(self.env, self.logs)
        self._fault("restart", "syncer")
        return False

    def _release_stragglers(self) -> None:
        """The run is ending: a SIGSTOPped learner must hear it and answer the final sync."""
        for p in self.learners:
            if p.stopped:
                p.signal(signal.SIGCONT)
                p.stopped = False

    def _inject_chaos(self, plan: _Plan, now: float) -> None:
        """Scheduled SIGKILLs of learners and of the syncer, syncer restarts, straggler duty cycles."""
        t = now - self._t0  # the schedule spans the run's time budget, from the run's start
        while plan.kills and plan.kills[0][0] <= t:
            _, m, back = plan.kills.pop(0)
            if self.learners[m].alive():
                self.learners[m].signal(signal.SIGKILL)
                self.learners[m].wait()
                self._on_learner_death(m, now, kind="sigkill")
                plan.restarts.append((self._t0 + max(back, t), m))  # back when its outage ends
        while plan.syncer_kills and plan.syncer_kills[0] <= t:
            plan.syncer_kills.pop(0)
            self.syncer.signal(signal.SIGKILL)
            self.syncer.wait()
            self._fault("sigkill", "syncer")
            plan.syncer_back_at = now + self.cfg.chaos.syncer_down_s
        if plan.syncer_back_at is not None and now >= plan.syncer_back_at:
            plan.syncer_back_at = None
            self.syncer.start(self.env, self.logs)
            self._fault("restart", "syncer")
        self._duty_cycle(plan.schedule, t)

    def _reap_dead(self, plan: _Plan, now: float) -> None:
        """A learner that exited by itself is restarted (bounded), unless the syncer refused it
        or it left because the run ended."""
        rt = self.cfg.runtime
        for m, p in enumerate(self.learners):
            if p.popen is None or p.alive() or p.popen.returncode == 0 or any(mm == m for _, mm in plan.restarts):
                continue
            code = p.popen.returncode
            self._on_learner_death(m, now, kind=f"exit {code}")
            if code == EXIT_REFUSED:
                raise DDiLoCoError(f"learner {m} was refused by the syncer; see {self.logs / p.name}.log")
            if code == EXIT_SUPERSEDED:  # another process holds its id: a restart would fight it
                raise DDiLoCoError(
                    f"learner {m} was superseded by another process with its id; see {self.logs / p.name}.log"
                )
            if p.restarts >= rt.restart_limit:
                raise DDiLoCoError(
                    f"learner {m} exited {p.restarts + 1} times (runtime.restart_limit = "
                    f"{rt.restart_limit}); see {self.logs / p.name}.log"
                )
            plan.restarts.append((now + rt.restart_delay_s, m))

    def _restart_due(self, plan: _Plan, now: float) -> None:
        for when, m in list(plan.restarts):
            if now < when or self._ending:
                continue
            plan.restarts.remove((when, m))
            p = self.learners[m]
            p.restarts += 1
            p.start(self.env, self.logs)
            self.books[m].respawned(p.started_at)
            self._fault("restart", p.name)

    def _stop_all(self) -> float:
        """Bring every child down; returns when the learners' time stopped counting.

        After the run's end the learners leave by themselves (they heard it from the syncer);
        otherwise they are stopped (SIGTERM: they leave cleanly at a step boundary), then the
        evaluator, then the syncer, which flushes and marks the run interrupted."""
        for p in self.learners:
            if p.stopped:
                p.signal(signal.SIGCONT)
                p.stopped = False
        end = time.time()
        ended = [r for r in read_jsonl(self.run_dir / "metrics" / "run.jsonl") if r.get("what") == "end"]
        if ended and not self.stop_requested:  # the learners' time ran until the syncer ended the run
            end = min(end, self._t0 + float(ended[-1].get("time", end - self._t0)))
        if not self.interrupted and not self.stop_requested:
            deadline = time.time() + 15
            while any(p.alive() for p in self.learners) and time.time() < deadline:
                time.sleep(0.05)
        for p in self.learners:
            p.signal(signal.SIGTERM)
        for m, p in enumerate(self.learners):
            if p.popen is not None:
                p.wait(timeout=15)
                self._track_first_steps(m)  # one that stepped since the last look: compute since then
                if (st := self._own_status(m)) is not None:
                    self.books[m].bank(st)
            if self._t_learners is not None:
                self.books[m].close(end)
        if self.links is not None:  # the learners are gone: their relays may go
            self.links.signal(signal.SIGTERM)
            self.links.wait(timeout=10)
        self.evaluator.signal(signal.SIGTERM)
        if self.syncer.alive():
            self.syncer.signal(signal.SIGTERM)  # it flushes, writes the final model and summary
        self.syncer.wait(timeout=120)
        self.evaluator.wait(timeout=30)
        return end

    def _on_learner_death(self, m: int, now: float, kind: str) -> None:
        self._track_first_steps(m)  # a first step it made before dying still ends its start-up
        self.books[m].died(now, self._own_status(m))
        self._fault(kind, f"learner-{m}")

    def _track_first_steps(self, *only: int) -> None:
        """A starting or restarting learner's first inner step (its status file says when: it is
        written at once after the first step) starts its compute time."""
        for m in only or range(len(self.books)):
            if self.books[m].account.state not in ("starting", "restarting"):
                continue
            st = self._own_status(m)
            first = st.get("first_step_at") if st else None
            if isinstance(first, (int, float)) and not isinstance(first, bool):
                self.books[m].first_step(first)

    def _duty_cycle(self, schedule: Any, t: float) -> None:
        """Stragglers: SIGSTOP for (1 - 1/factor) of every second, SIGCONT for the rest; each
        phase of the schedule (each ``chaos.stragglers`` entry, as the simulator counts them) is a
        fault record as it starts (``straggle``, with its factor) and ends (``straggle_end``)."""
        for i, s in enumerate(schedule.stragglers):
            for edge, kind in ((s.start_s, "straggle"), (s.end_s, "straggle_end")):
                if t >= edge and (i, kind) not in self._phases_said:
                    self._phases_said.add((i, kind))
                    self._fault(
                        kind, self.learners[s.learner].name, **({"factor": s.factor} if kind == "straggle" else {})
                    )
        for m, p in enumerate(self.learners):
            f = schedule.slowdown(m, t)
            want_stop = f > 1.0 and (t % 1.0) >= 1.0 / f
            if want_stop != p.stopped and p.alive():
                p.signal(signal.SIGSTOP if want_stop else signal.SIGCONT)
                p.stopped = want_stop

    def status(self) -> dict:
        learners = [read_status(self.run_dir / "status" / f"learner-{m}.json") or {} for m in range(len(self.learners))]
        return {
            "t": time.time() - self._t0,
            "T": self.cfg.runtime.duration_s,
            "tokens_budget": self.cfg.run.processed_tokens,
            "syncer": read_status(self.run_dir / "status" / "syncer-0.json") or {},
            "learners": learners,
            "alive": [p.alive() for p in self.learners],
            "faults": sum(1 for f in self.faults if is_injected(f)),
        }

    def finish(self, end: float) -> dict:
        """Where the learners' time went (metrics/accounting.json), then the summary from the
        run folder, through the function every command uses."""
        if self.interrupted or self.stop_requested:
            self._run_event("interrupted", "ddiloco train was stopped by a signal")
        t_start = self._t_learners if self._t_learners is not None else end
        horizon = max(end - t_start, 0.0)
        time_in = {s: sum(b.account.totals[s] for b in self.books) for s in STATES}
        outages = [(m, a - t_start, min(b - t_start, horizon)) for m, k in enumerate(self.books) for a, b in k.outages]
        need = self.cfg.algo.quorum_size or 1
        accounting = {
            "method": f"{self.cfg.run.method} (real)",
            "horizon_s": horizon,
            "learners": len(self.books),
            "tokens": sum(b.tokens for b in self.books),
            # blocked: the launcher sees no lock-step wait (it stays in compute, as before)
            **{f"{s}_s": time_in[s] for s in STATES},
            "uptime": uptime(outages, len(self.books), min(need, len(self.books)), horizon) if horizon else None,
            "lost_steps": sum(b.lost_steps for b in self.books),
            "restart_latencies_s": [x for b in self.books for x in b.restart_latencies],
        }
        accounting = _add_sessions(self._previous_accounting, accounting)
        (self.run_dir / "metrics" / "accounting.json").write_text(json.dumps(accounting, indent=2))
        return write_summary(self.run_dir)

    def _run_event(self, what: str, reason: str) -> None:
        append_run_event(self.run_dir, time.time() - self._t0, what, reason)


def _last_error(path: Path) -> str:
    """``: LINE`` for the last ``error: ...`` line of a child's log (its one-line reason), or ``''``."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in tail if line.startswith("error: ")]
    return f": {errors[-1].removeprefix('error: ')[:2000]} ({path})" if errors else f" ({path})"


SUMMED = ("horizon_s", "tokens", "compute_s", "blocked_s", "down_s", "restarting_s", "starting_s", "lost_steps")
"""Accounting figures that add up over the sessions of a resumed run."""


def _add_sessions(previous: dict[str, Any] | None, this: dict[str, Any]) -> dict[str, Any]:
    """One accounting for a run and its resumed sessions: time and work add up; uptime is
    weighted by each session's length; restart latencies are all kept."""
    if not previous:
        return {**this, "sessions": 1}
    out = dict(this)
    for key in SUMMED:
        prev = previous.get(key)
        if isinstance(prev, (int, float)) and not isinstance(prev, bool):
            out[key] = this[key] + prev
    h0, h1 = previous.get("horizon_s"), this["horizon_s"]
    u0, u1 = previous.get("uptime"), this["uptime"]
    if all(isinstance(x, (int, float)) for x in (h0, u0, u1)) and h0 + h1 > 0:
        out["uptime"] = (u0 * h0 + u1 * h1) / (h0 + h1)
    latencies = previous.get("restart_latencies_s")
    out["restart_latencies_s"] = [*(latencies if isinstance(latencies, list) else []), *this["restart_latencies_s"]]
    sessions = previous.get("sessions")
    out["sessions"] = (sessions if isinstance(sessions, int) else 1) + 1
    return out
