"""A cluster of ``python -m ddiloco ...`` processes on this machine: a bench's own small supervisor.

A bench names its roles (``syncer``, ``learner-M``, ``evaluator``, ``links``, or a helper of its
own such as an attacker) and starts, kills, pauses, resumes and restarts them by name; every start
is kept (``spawned``), every role logs to RUN/NAME.log, and the status files, step logs and tape
of the run folder are read back through the same object.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from harness.files import TapeReader, read_json_dict, step_logs
from harness.paths import ENV


def free_port() -> int:
    """A free TCP port on loopback (the runtime's own helper, imported late: it pulls in ddiloco)."""
    from ddiloco.service.ops.launcher import free_port as runtime_free_port

    return int(runtime_free_port())


def wait_until(pred: Callable[[], Any], timeout: float, every: float = 0.1) -> bool:
    """Poll ``pred`` until it is truthy or ``timeout`` seconds have passed; whether it became so."""
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(every)
    return False


class Cluster:
    """Processes of one run folder, by role name."""

    def __init__(self, run_dir: Path, extra: Sequence[str] = (), keys: Path | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.extra = list(extra)
        """Arguments every ddiloco role gets last (the run's ``--set`` overrides)."""
        self.keys = keys
        """The CURVE key folder (None: no encryption)."""
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.argv: dict[str, list[str]] = {}
        """Each role's last command line (``restart`` starts it again)."""
        self.spawned: dict[str, list[float]] = {}
        """Each role's start times (wall clock), oldest first."""
        self.t0_wall = 0.0
        """When the bench's measured window began (a bench sets it)."""

    # -- starting --------------------------------------------------------------------------------

    def start(self, name: str, argv: list[str]) -> None:
        """Start ``argv`` (a whole command line) as role ``name``, its output in RUN/NAME.log."""
        log = open(self.run_dir / f"{name}.log", "ab")
        self.spawned.setdefault(name, []).append(time.time())
        self.argv[name] = list(argv)
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=ENV)

    def ddiloco(self, name: str, *args: str) -> None:
        """Start ``python -m ddiloco ARGS... EXTRA...`` as role ``name``."""
        self.start(name, [sys.executable, "-m", "ddiloco", *args, *self.extra])

    def _keys(self) -> list[str]:
        return ["--keys", str(self.keys)] if self.keys is not None else []

    def syncer(self) -> None:
        self.ddiloco("syncer", "syncer", "--bind", self.addr, "--run-dir", str(self.run_dir), *self._keys())

    def learner_args(self, m: int, standalone: bool = False, threads: int | None = None) -> list[str]:
        """``ddiloco learner`` arguments for learner ``m`` (without the run's overrides)."""
        target = ["--standalone"] if standalone else ["--syncer", self.addr]
        argv = ["learner", *target, "--id", str(m), "--run-dir", str(self.run_dir), *self._keys(), "--device", "cpu"]
        return argv + (["--threads", str(threads)] if threads is not None else [])

    def learner(self, m: int, standalone: bool = False, threads: int | None = None) -> None:
        self.ddiloco(f"learner-{m}", *self.learner_args(m, standalone, threads))

    def evaluator(self) -> None:
        self.ddiloco("evaluator", "evaluator", "--syncer", self.addr, "--run-dir", str(self.run_dir), *self._keys())

    def links(self, *args: str) -> None:
        """The link relay (``ddiloco link ARGS``)."""
        self.ddiloco("links", "link", *args)

    def restart(self, name: str) -> None:
        """Start role ``name`` again with its last command line (kill it first if it runs)."""
        if self.alive(name):
            self.kill(name)
        self.start(name, self.argv[name])

    # -- signals ---------------------------------------------------------------------------------

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` and wait for the process to end (SIGKILL after 30 s)."""
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(sig)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)

    def pause(self, name: str) -> None:
        """SIGSTOP: the process holds its sockets and memory but runs no code (a stall)."""
        if self.alive(name):
            self.procs[name].send_signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        """SIGCONT after ``pause``."""
        if self.alive(name):
            self.procs[name].send_signal(signal.SIGCONT)

    def stop(self, wait_for: Sequence[str] = (), last: Sequence[str] = ("syncer",), wait_s: float = 15.0) -> None:
        """Stop every role: first wait up to ``wait_s`` for the roles in ``wait_for`` (they end on
        their own and report), then SIGTERM the rest, those in ``last`` last (learners first, so
        the syncer's final flush sees them gone)."""
        for name in wait_for:
            if self.alive(name):
                try:
                    self.procs[name].wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    pass
        names = [n for n in self.procs if n not in last] + [n for n in last if n in self.procs]
        for name in names:
            if self.alive(name):
                self.resume(name)  # a paused process cannot act on SIGTERM
                self.kill(name, signal.SIGTERM)

    # -- reading the run folder ------------------------------------------------------------------

    def status(self, name: str) -> dict[str, Any]:
        """RUN/status/NAME.json ({} while it is missing or being rewritten)."""
        return read_json_dict(self.run_dir / "status" / f"{name}.json")

    def steps(self, m: int) -> list[tuple[float, float]]:
        """Learner ``m``'s (time, step duration), every incarnation, sorted."""
        return [(t, d) for t, d, _ in step_logs(self.run_dir).get(m, [])]

    def tape(self) -> list[dict[str, Any]]:
        """The tape so far (RUN/state/tape.jsonl, wall offsets as recorded)."""
        from ddiloco.report.tape import read_tape

        return list(read_tape(self.run_dir / "state" / "tape.jsonl"))

    def tape_reader(self) -> TapeReader:
        """An incremental reader of the tape (for a bench that checks it while the run goes on)."""
        return TapeReader(self.run_dir / "state" / "tape.jsonl")


class Launch:
    """One ``python -m ddiloco train ARGS`` run: the launcher supervises the syncer, learners,
    evaluator and relays itself; the bench watches it and stops it (in its own session, so a
    signal to the bench's terminal does not reach the run's processes)."""

    def __init__(self, args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        """``env``: the run's environment (default ``ENV``: this tree's sources; a bench that runs
        other sources, such as an older commit's, puts those on ``PYTHONPATH``)."""
        self.argv = [sys.executable, "-m", "ddiloco", "train", *args]
        self.started = time.time()
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env or ENV,
                                     start_new_session=True)  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def elapsed(self) -> float:
        return time.time() - self.started

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 120.0) -> None:
        """Ask the launcher to stop (it stops its children and writes the summary); SIGKILL it
        after ``timeout_s``."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def wait(self) -> int:
        """Wait for the end; the launcher's exit status."""
        rc = self.proc.wait()
        self._log.close()
        return rc
