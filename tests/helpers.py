"""Helpers shared by the tests that run a syncer and learners (imported as ``helpers``: pytest
puts this folder on the path of the test modules)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import TensorSpec, balanced_layout
from ddiloco.core.tape import RoundRecord
from ddiloco.protocol.config import RuntimeConfig
from ddiloco.protocol.learner_session import Registration
from ddiloco.report.tape import read_rounds

# A two-fragment toy model for the protocol sessions' tests (fuzz, insider).
SESSION_SPECS = [TensorSpec("w", (3, 2)), TensorSpec("b", (2,))]
SESSION_LAYOUT = balanced_layout(SESSION_SPECS, 2)
SESSION_PARAMS = [[s.name, list(s.shape)] for s in SESSION_SPECS]
SESSION_REGISTRATION = Registration(SESSION_PARAMS, SESSION_LAYOUT.digest())
SESSION_CFG = DiLoCoConfig(num_fragments=2, sync_every=4, overlap=1, liveness_timeout_s=2.0, takeover_after_s=1.0)
SESSION_RT = RuntimeConfig(heartbeat_interval_s=0.5, syncer_liveness_s=2.0, backoff_initial_s=0.1, backoff_max_s=1.0)

# A real runtime's timings shrunk for tests in one process (threads): liveness in a second,
# status twice a second, short backoff. Each test adds its own budgets and join timeout.
FAST_RUNTIME = [
    "algo.liveness_timeout_s=1.0",
    "runtime.heartbeat_interval_s=0.1",
    "runtime.syncer_liveness_s=1.0",
    "runtime.status_interval_s=0.5",
    "runtime.snapshot_interval_s=1.0",
    "runtime.backoff_max_s=0.3",
]


def wait_for(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition", poll: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something true (returned), or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def wait_while_progress(
    pred: Callable[[], Any], progress: Callable[[], Any], stall_s: float, cap_s: float, what: str, poll: float = 0.1
) -> Any:
    """Poll ``pred`` until it returns something true (returned). Fail when ``progress()`` (a
    count that grows while the run moves: merges, steps) has not changed for ``stall_s``, or
    after ``cap_s`` in all: a loaded machine makes a run slower, not stuck."""
    start = last_change = time.monotonic()
    seen = progress()
    while time.monotonic() < start + cap_s:
        value = pred()
        if value:
            return value
        now_seen = progress()
        if now_seen != seen:
            seen, last_change = now_seen, time.monotonic()
        elif time.monotonic() > last_change + stall_s:
            raise AssertionError(f"no progress for {stall_s:.0f} s waiting for {what} (progress {seen!r})")
        time.sleep(poll)
    raise AssertionError(f"timed out after {cap_s:.0f} s waiting for {what} (progress {seen!r})")


def merges(run_dir: Path) -> list[RoundRecord]:
    """The rounds on a syncer's tape that merged something (an entry took part: ``was_merged``)."""
    return [r for r in read_rounds(Path(run_dir) / "state" / "tape.jsonl") if r.took_part]


@contextlib.contextmanager
def keyed_syncer(run_dir: Path, keys: Path, settings: list[str], host: str, learners: int = 2) -> Iterator[Any]:
    """A syncer with CURVE keys (made in ``keys`` for ``learners`` learners) on ``host``,
    serving in a thread until the block ends: yields (cfg, address, service)."""
    from ddiloco.config import load_config
    from ddiloco.service.base.keys import ServerKeys, make_keys
    from ddiloco.service.base.transport import ZmqSyncerSocket
    from ddiloco.service.ops.launcher import free_port
    from ddiloco.service.syncer.service import SyncerService

    make_keys(keys, learners=learners)
    cfg = load_config(None, settings)
    addr = f"tcp://{host}:{free_port(host)}"
    service = SyncerService(cfg, ZmqSyncerSocket(addr, keys=ServerKeys.load(keys)), run_dir,
                            fsync=False, keys=ServerKeys.load(keys))  # fmt: skip
    t = threading.Thread(target=service.serve, daemon=True)
    t.start()
    try:
        yield cfg, addr, service
    finally:
        service.stop()
        t.join(timeout=30)


class _TensorHost:
    """A learner's model as plain CPU tensors, for the boundary executor (``protocol/boundary.py``)."""

    def __init__(self, tensors: dict[str, Any], layout: Any) -> None:
        self.tensors, self.layout = tensors, layout

    def write(self, p: int, values: Any, alpha: float, add: bool) -> None:
        from ddiloco.core.fragments import write_fragment

        write_fragment(self.tensors, self.layout.fragments[p], values, alpha, add)

    def read(self, p: int) -> list[Any]:
        from ddiloco.core.fragments import read_fragment

        return read_fragment(self.tensors, self.layout.fragments[p])

    def load_peer_state(self, state: Any) -> None:
        pass  # no optimizer: a session made with wants_peer_state=False never gets one

    def serve(self, learner: int) -> Any:
        return None  # nothing to give: the asker trains on cold


class OptimizerHost(_TensorHost):
    """``_TensorHost`` with an optimizer of its own (over parameters apart from the session's
    model): it serves that optimizer's state through a ``StateServer`` (each piece's time, budget
    and bytes recorded in ``pieces``) and keeps every state a peer hands it (``taken``: (time, state))."""

    def __init__(self, tensors: dict[str, Any], layout: Any, opt: Any, learner: int, clock: Any) -> None:
        super().__init__(tensors, layout)
        self.opt, self.learner, self.clock = opt, learner, clock
        self.pieces: list[tuple[float, int, int]] = []
        self.taken: list[tuple[float, Any]] = []

    def load_peer_state(self, state: Any) -> None:
        self.taken.append((self.clock(), state))

    def serve(self, learner: int) -> Any:
        from ddiloco.protocol.handoff import handoff_nbytes
        from ddiloco.training.peer_state import StateServer

        server, pieces, clock = StateServer(self.opt, learner, self.learner), self.pieces, self.clock

        class Recorded:
            copy_s = 0.0

            @property
            def done(self) -> bool:
                return server.done

            def piece(self, budget_bytes: int) -> Any:
                ps = server.piece(budget_bytes)
                if ps is not None:
                    pieces.append((clock(), budget_bytes, handoff_nbytes(ps)))
                return ps

        return Recorded()


class SessionPair:
    """Learner sessions wired to one syncer session in memory, the way h11's ``ConnectionPair``
    wires two connections: messages are handed over directly, in order, and time is a virtual
    ``now`` that only the test moves (``advance``), so a protocol test reads as a conversation.

    ``transcript`` records every message delivered as (direction, learner, type name):
    ``"->"`` learner to syncer, ``"<-"`` syncer to learner. A learner that is ``cut`` loses
    every message to and from it until ``heal``. Each learner's model is a pair of zero
    tensors (``SESSION_SPECS``) that ``step`` moves by ``drift`` per step; its boundaries go
    through the real ``BoundaryExecutor``."""

    def __init__(
        self,
        learners: tuple[int, ...] = (0,),
        cfg: DiLoCoConfig = SESSION_CFG,
        rt: RuntimeConfig = SESSION_RT,
        budget: Any = None,
        optimizers: dict[int, Any] | None = None,
        uplink: dict[int, float] | None = None,
    ) -> None:
        """``optimizers``: learners with an optimizer (``OptimizerHost``: they serve its state and
        take a peer's); ``uplink``: learners whose optimizer hand-off crosses a link of that many
        bytes per second, one piece after another (``release``), the way the comm thread sends
        it, and is told to the session (``LearnerSession.sending``); other messages go at once."""
        import torch

        from ddiloco.core.syncer import Syncer
        from ddiloco.protocol.boundary import BoundaryExecutor
        from ddiloco.protocol.learner_session import LearnerSession
        from ddiloco.protocol.syncer_session import Budget, SyncerSession

        self.now = 0.0
        self.layout = SESSION_LAYOUT
        initial = {s.name: torch.zeros(s.shape) for s in SESSION_SPECS}
        core = Syncer(cfg, self.layout, initial, [False] * sum(len(f) for f in self.layout.fragments))
        budget = budget or Budget()
        self.syncer = SyncerSession(core, rt, budget, SESSION_REGISTRATION, self.now)
        opts = optimizers or {}
        self.sessions = {
            m: LearnerSession(
                cfg,
                rt,
                m,
                1,
                self.layout,
                SESSION_REGISTRATION,
                self.now,
                wants_peer_state=m in opts,
                processed_budget=budget.processed_tokens,
            )  # fmt: skip
            for m in learners
        }
        self.models = {m: {s.name: torch.zeros(s.shape) for s in SESSION_SPECS} for m in learners}
        self.hosts: dict[int, Any] = {
            m: OptimizerHost(self.models[m], self.layout, opts[m], m, lambda: self.now)
            if m in opts
            else _TensorHost(self.models[m], self.layout)
            for m in learners
        }
        self.executors = {m: BoundaryExecutor(self.hosts[m]) for m in learners}
        self.uplink = dict(uplink or {})
        self.training: set[int] = set()
        """Learners in the middle of training: their boundaries run only at their steps (the
        drivers run one on receipt only for a learner that is not stepping)."""
        self.stalled: set[int] = set()
        """Learners whose hand-off link carries nothing for now (``uplink``)."""
        self.queued: dict[int, list[tuple[Any, int]]] = {m: [] for m in self.uplink}
        """Per learner with an uplink: the hand-off messages waiting for it, with their bytes."""
        self.handed_off: dict[int, int] = {m: 0 for m in self.uplink}
        self._link_at: dict[int, float] = {m: 0.0 for m in self.uplink}
        self.transcript: list[tuple[str, int, str]] = []
        self.tape: list[Any] = []
        self.notes: list[str] = []
        self.info: list[str] = []
        """The syncer session's INFO lines (a learner joined, lost, back, left)."""
        self.cut_off: set[int] = set()
        self._to_syncer: list[tuple[int, Any]] = []
        self._to_learners: list[tuple[int, Any]] = []

    # -- the wire ------------------------------------------------------------------------------

    def _from_learner(self, m: int, out: Any) -> None:
        from ddiloco.protocol.handoff import handoff_nbytes
        from ddiloco.protocol.messages import PeerState

        self.notes += out.notes
        if m not in self.cut_off:
            for s in out.send:
                if m in self.uplink and isinstance(s.msg, PeerState) and s.msg.tensors:
                    self.queued[m].append((s.msg, handoff_nbytes(s.msg)))
                else:
                    self._to_syncer.append((m, s.msg))

    def release(self) -> None:
        """Each uplink carries its hand-off messages, in order, for the time since it last did
        (bytes / rate each; a stalled link carries nothing), and its session hears how far it got."""
        for m, rate in self.uplink.items():
            queue, at = self.queued[m], self._link_at[m]  # when its last message was through
            while queue and m not in self.stalled and at + queue[0][1] / rate <= self.now + 1e-9:
                msg, n = queue.pop(0)
                at += n / rate
                self.handed_off[m] += n
                self._to_syncer.append((m, msg))
            self._link_at[m] = at if queue and m not in self.stalled else self.now  # idle: no time saved up
            self.sessions[m].sending(self.handed_off[m], 0.0 if m in self.stalled else rate)

    def _from_syncer(self, out: Any) -> None:
        self.info += out.info
        self.tape += out.tape
        self.notes += [n.text for n in out.notes]
        self._to_learners += [(peer, msg) for peer, msg in out.send if peer not in self.cut_off]

    def deliver(self) -> None:
        """Hand every message in flight over, in order, until the wire is quiet; a learner that
        is not stepping (not in ``training``) runs a boundary after each message it receives (as
        both drivers do)."""
        for _ in range(100):  # bounded: answers beget answers
            if not (self._to_syncer or self._to_learners):
                return
            while self._to_syncer:
                m, msg = self._to_syncer.pop(0)
                self.transcript.append(("->", m, type(msg).__name__))
                self._from_syncer(self.syncer.receive(m, msg, self.now))
            while self._to_learners:
                m, msg = self._to_learners.pop(0)
                self.transcript.append(("<-", m, type(msg).__name__))
                self._from_learner(m, self.sessions[m].receive(0, msg, self.now))
                if m not in self.training:
                    self._run(m, self.sessions[m].boundary(self.now))
        raise AssertionError("the sessions never went quiet")

    def _run(self, m: int, plan: Any) -> None:
        out = self.executors[m].run(plan, self.sessions[m])
        assert out is not None
        self._from_learner(m, out)

    # -- the test's moves ----------------------------------------------------------------------

    def tick(self) -> None:
        """Every session's deadlines due now, then the wire until quiet."""
        self.release()
        self._from_syncer(self.syncer.tick(self.now))
        for m, session in self.sessions.items():
            self._from_learner(m, session.tick(self.now))
        self.deliver()

    def advance(self, seconds: float, every: float = 0.1) -> None:
        """Time passes, ticking every ``every`` seconds (the sessions' own deadlines are finer)."""
        end = self.now + seconds
        while self.now < end:
            self.now = min(end, self.now + every)
            self.tick()

    def step(self, m: int, tokens: int = 16, duration: float = 0.5, drift: float = 0.01) -> None:
        """Learner m trains one inner step of ``duration`` (its model moves by ``drift``) while
        the others wait: time moves on, the step's boundary runs, then the wire and the ticks."""
        for t in self.models[m].values():
            t.add_(drift)
        self.now += duration
        self.release()
        self._run(m, self.sessions[m].step(tokens, duration, self.now))
        self.tick()

    def cut(self, m: int) -> None:
        """Learner m's link goes dark both ways (its process lives on)."""
        self.cut_off.add(m)

    def heal(self, m: int) -> None:
        self.cut_off.discard(m)

    def said(self, direction: str, m: int) -> list[str]:
        """The types of the messages delivered in ``direction`` for learner m, in order."""
        return [kind for d, who, kind in self.transcript if d == direction and who == m]


def stop_processes(procs: Iterable[subprocess.Popen[Any]], timeout: float = 30.0) -> None:
    """SIGTERM every process still running, then wait for each (bounded), killing what stays."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=timeout)
