"""The real service in one process: a syncer and three learners as threads over an in-process
network that drops, duplicates and delays messages on a seeded schedule, with an injected
clock; one learner is killed and restarted. Only invariants are asserted, never durations."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from helpers import FAST_RUNTIME, merges, wait_for, wait_while_progress

from ddiloco.config import load_config
from ddiloco.core.tape import RoundRecord
from ddiloco.report.invariants import check_run
from ddiloco.report.tape import read_tape
from ddiloco.service.base.clock import SkewedClock
from ddiloco.service.base.transport import FaultInjector, InProcessNetwork, learner_identity
from ddiloco.service.learner.process import LearnerProcess
from ddiloco.service.syncer.service import SyncerService

pytestmark = pytest.mark.slow  # a real service run in threads: tens of seconds of real time

ADDRESS = "inproc://syncer"
SETTINGS = [
    "workload.factory=ddiloco.workloads.synthetic:make_workload",
    "workload.options={hidden = 16}",
    "run.num_learners=3",
    "algo.sync_every=8",
    *FAST_RUNTIME,
    "runtime.join_timeout_s=15.0",  # a lossy network may drop the first registrations
    "runtime.step_sleep_s=0.01",
]


class Fleet:
    """A syncer and learners as threads on one in-process network."""

    def __init__(self, run_dir: Path, faults: FaultInjector, extra: tuple[str, ...] = ()) -> None:
        self.cfg = load_config(None, [*SETTINGS, *extra])
        self.net = InProcessNetwork(faults)
        # The processes' monotonic clocks start far from zero, as they do on a real host.
        self.clock = SkewedClock(monotonic_offset=12_345.0)
        self.run_dir = run_dir
        self.syncer = SyncerService(self.cfg, self.net.syncer(ADDRESS), run_dir, clock=self.clock, fsync=False)
        self.threads: list[threading.Thread] = [threading.Thread(target=self.syncer.serve, name="syncer")]
        self.learners: dict[int, LearnerProcess] = {}
        self.exits: dict[int, list[int]] = defaultdict(list)

    def start_learner(self, m: int) -> LearnerProcess:
        ln = LearnerProcess(self.cfg, [ADDRESS], m, self.run_dir, connect=self.net.learner, clock=self.clock)
        self.learners[m] = ln
        t = threading.Thread(target=lambda: self.exits[m].append(ln.run()), name=f"learner-{m}")
        self.threads.append(t)
        t.start()
        return ln

    def kill(self, m: int) -> None:
        """What SIGKILL does: the process's messages stop, in both directions, with no goodbye."""
        self.net.cut(learner_identity(m))
        self.learners[m].stop = True

    def stop(self) -> None:
        for ln in self.learners.values():
            ln.stop = True
        self.syncer.stop()
        for t in self.threads:
            t.join(timeout=30)

    def merges(self) -> list[RoundRecord]:
        return merges(self.run_dir)


COMPRESSED = ("algo.up_encoding=int4", "algo.down_encoding=int4", "algo.error_feedback=true")
SPARSE = (  # top-k both ways through the real driver and the wire: 3 % up at 2 bits, 10 % down at 4
    "algo.up_encoding=int2",
    "algo.down_encoding=int4",
    "algo.up_density=0.03",
    "algo.down_density=0.1",
    "algo.error_feedback=true",
)


EAGER = ("algo.on_merged=eager",)  # the learner's moves and shifts through the real driver


@pytest.mark.parametrize("extra", [(), COMPRESSED, SPARSE, EAGER], ids=["fp32", "int4", "sparse", "eager"])
def test_syncer_and_learners_keep_their_invariants_on_a_faulty_network(tmp_path, extra):
    faults = FaultInjector(seed=7, drop=0.10, duplicate=0.05, delay=0.05, delay_s=1.5)
    fleet = Fleet(tmp_path, faults, extra)
    fleet.threads[0].start()
    try:
        for m in range(3):
            fleet.start_learner(m)
        # Bounds, not assertions on durations: by progress, so a loaded machine only makes it slower.
        count = lambda: len(fleet.merges())  # noqa: E731
        wait_while_progress(lambda: count() >= 10, count, 240, 900, "the first merges")
        old_incarnation = fleet.learners[1].incarnation
        fleet.kill(1)
        wait_for(lambda: fleet.exits[1], 60, "the killed learner's thread to end")
        time.sleep(0.01)  # a later start: a larger incarnation, as a restarted process has
        new_incarnation = fleet.start_learner(1).incarnation
        assert new_incarnation > old_incarnation

        def contributed_again() -> bool:
            return any(e.learner == 1 and e.incarnation == new_incarnation for r in fleet.merges() for e in r.took_part)

        def kept() -> bool:
            """Under eager, a merge of 0's and 2's answers has kept the steps they took since
            (it needs a step between an answer and its merge: a short run may have none yet)."""
            if extra != EAGER:
                return True
            sessions = [fleet.learners[m].learner for m in (0, 2)]
            return all(ln is not None and ln.session is not None and ln.session.core.kept_tokens > 0 for ln in sessions)

        # Bounded by progress: fails when no merge came for 120 s (or after 15 minutes in all).
        wait_while_progress(
            lambda: len(fleet.merges()) >= 20 and contributed_again() and kept(),
            lambda: len(fleet.merges()), 120, 900, "20 merges and the restarted learner",
        )  # fmt: skip
    finally:
        fleet.stop()
    assert all(not t.is_alive() for t in fleet.threads)
    merges = fleet.merges()
    assert len(merges) >= 20
    # the run's invariants, as every harness checks them: versions increase, nothing merged twice
    assert check_run(read_tape(tmp_path / "state" / "tape.jsonl")) == []
    # the faults really happened, and nothing from the killed incarnation was merged after its successor's join
    assert faults.counts["dropped"] > 0 and faults.counts["duplicated"] > 0 and faults.counts["delayed"] > 0
    firsts = [r.closed_at for r in merges for e in r.merged if e.incarnation == new_incarnation]
    late = [e for r in merges if r.closed_at > min(firsts) for e in r.merged]
    assert not any(e.learner == 1 and e.incarnation == old_incarnation for e in late)
    # every learner that was stopped cleanly exited 0
    assert fleet.exits[0] == [0] and fleet.exits[2] == [0]
    if extra == EAGER:
        for m in (0, 2):
            learner = fleet.learners[m].learner
            assert learner is not None and learner.session is not None
            assert learner.session.core.kept_tokens > 0  # merges kept the steps since the contribution
            assert all(bool(torch.isfinite(t).all()) for t in learner.params.values())
    if extra in (COMPRESSED, SPARSE):
        # Lost, duplicated and delayed versions never leave a learner's copy apart from the
        # syncer's: wherever a learner holds the version the chain serves, the bits are the same.
        same = 0
        for m in (0, 2):
            learner = fleet.learners[m].learner
            assert learner is not None and learner.session is not None
            for p, (version, values) in learner.session.codec.base.items():
                chain = fleet.syncer.core.fragments[p].chain
                assert chain is not None
                if version == chain.version and version >= chain.start:
                    assert all(torch.equal(a, b) for a, b in zip(values, chain.served)), (m, p, version)
                    same += 1
        assert same > 0
