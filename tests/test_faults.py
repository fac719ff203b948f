"""Deterministic fault tests in virtual time, over the real protocol sessions.

Each run pumps the same ``LearnerSession``s and ``SyncerSession``s as the real runtime, with a
fault placed exactly (``ddiloco.sim.faults``), and checks the run's invariants with the one
function the soak and the chaos runs use (``ddiloco.report.invariants``). No sleep, no wall
clock: the same run gives the same result bit for bit, on any machine, however busy.
"""

from __future__ import annotations

import pytest

from ddiloco.config import load_config
from ddiloco.core.tape import RoundRecord
from ddiloco.methods import PRESETS
from ddiloco.sim.faults import KillLearner, Partition, RestartSyncer, Slow, SlowLink
from ddiloco.sim.simulation import Simulation
from ddiloco.workloads.config import load_workload

SMALL = [
    "workload.factory=ddiloco.workloads.synthetic:make_workload",
    "workload.options={hidden = 16}",
    "workload.batch_size=8",
    "run.eval_points=1",
    "run.num_learners=3",
    "run.processed_tokens=2400",  # 100 steps of each learner (the synthetic task counts 8 tokens a step)
    "algo.sync_every=8",
    "algo.num_fragments=4",
]


def run(faults=(), *extra: str, method: str = "decoupled"):
    cfg = load_config(None, [*SMALL, *extra, f"run.method={method}"], base=PRESETS[method])
    sim = Simulation(cfg, load_workload(cfg.workload), faults=faults)
    result = sim.run()
    return sim, result


def rounds(sim: Simulation) -> list[RoundRecord]:
    return [r for r in sim.tape if isinstance(r, RoundRecord)]


def merged_by(sim: Simulation, learner: int, incarnation: int | None = None) -> list[RoundRecord]:
    return [
        r
        for r in rounds(sim)
        if any(e.learner == learner and e.was_merged and incarnation in (None, e.incarnation) for e in r.merged)
    ]


def assert_invariants(sim: Simulation) -> None:
    assert sim.invariants() == []
    assert all(sh.done for sh in sim.shards), "the run ended with its final sync"


def test_a_learner_killed_at_a_step_is_left_out_then_rejoins_and_merges_again():
    sim, result = run([KillLearner(1, at_step=20, restart_after_s=6.0)])
    assert_invariants(sim)
    died = next(e["time"] for e in sim.log if e["event"] == "fail")
    back = next(e["time"] for e in sim.log if e["event"] == "rejoin")
    assert back == pytest.approx(died + 6.0)
    # while it was down the others merged without it: no round waited for it
    down = [r for r in rounds(sim) if died + 5.0 < r.closed_at < back]  # past its liveness timeout
    assert down and all(all(e.learner != 1 for e in r.merged) for r in down)
    # its new process merged again, took a peer's optimizer state and resumed its data
    assert merged_by(sim, 1, incarnation=1)
    assert any(e["event"] == "peer_state" and e["learner"] == 1 for e in sim.log)
    assert result.failures == 1


def test_the_syncer_restarted_at_a_round_comes_back_from_what_it_made_durable():
    sim, _ = run([RestartSyncer(0, after_rounds=30, down_s=4.0)])
    assert_invariants(sim)
    (restore,) = sim.restores
    assert restore.served and all(restore.versions[p] >= v for p, v in restore.served.items())
    # the learners noticed (a new epoch) and registered again keeping their progress: merges go on
    later = [r for r in rounds(sim) if r.closed_at > restore.time and any(e.was_merged for e in r.merged)]
    assert {e.learner for r in later for e in r.merged} == {0, 1, 2}
    assert all(r.version > restore.versions.get(r.fragment, 0) for r in later)


def test_a_partitioned_learner_trains_on_registers_again_and_its_work_merges():
    sim, result = run([Partition(2, start_s=20.0, duration_s=12.0)])
    assert_invariants(sim)
    cut = [r for r in rounds(sim) if 20.0 + 5.5 < r.closed_at < 32.0]
    assert cut and all(all(e.learner != 2 for e in r.merged) for r in cut)
    after = [r for r in merged_by(sim, 2) if r.closed_at > 32.0]
    assert after, "its work after the partition merged"
    # it never stopped training: the run lost no learner time (only its start-up)
    assert result.goodput.down == 0 and result.goodput.restarting == 0 and result.failures == 0
    assert any("unreachable" in e.get("text", "") for e in sim.log if e["event"] == "note" and e["learner"] == 2)


def test_a_straggler_slows_nobody_and_its_answers_still_merge():
    sim, result = run([Slow(0, factor=3.0, start_s=0.0, end_s=40.0)])
    assert_invariants(sim)
    assert result.goodput.blocked == 0
    slow = [r for r in rounds(sim) if r.closed_at < 40.0 and any(e.was_merged for e in r.merged)]
    assert slow and any(any(e.learner == 0 and e.was_merged for e in r.merged) for r in slow)
    # the others kept stepping at their own pace: they took about three times the straggler's steps
    steps = {ln.id: ln.steps_taken for ln in sim.learners}
    assert steps[1] > steps[0] and steps[2] > steps[0]


def test_a_syncer_restart_inside_a_grace_window_loses_nothing():
    far = SlowLink(2, extra_s=0.4)  # learner 2's answers arrive after the quorum, inside the grace window
    base, _ = run([far])
    graced = [r for r in rounds(base) if r.closed_at > 20 and any(e.in_grace for e in r.merged)]
    assert graced, "the far learner is admitted in grace windows"
    r = graced[0]
    at = r.closed_at - 0.2  # after its quorum, before the far answer closes it
    sim, _ = run([far, RestartSyncer(0, at_s=at, down_s=3.0)])
    assert_invariants(sim)
    # up to the restart the two runs are the same run
    before = [x.to_json() for x in rounds(base) if x.closed_at < at]
    assert [x.to_json() for x in rounds(sim) if x.closed_at < at] == before
    # the open round died with the syncer (nothing of it was durable): the version it would have
    # made is made by a round opened after the restart
    assert sim.restores[0].time == pytest.approx(at + 3.0)
    assert sim.restores[0].versions[r.fragment] == r.version - 1
    after = [x for x in rounds(sim) if x.fragment == r.fragment and x.closed_at > at]
    assert after[0].opened_at > at + 3.0 and after[0].version == r.version
    assert any(x.fragment == r.fragment and x.closed_at > at + 3.0 for x in merged_by(sim, 2))


def test_a_rejoin_refused_while_the_old_process_holds_the_id_is_retried_and_accepted():
    # The new process starts 0.2 s after the kill: its predecessor was heard less than
    # algo.takeover_after_s ago, so the syncer refuses the id for now; the session honours that.
    sim, _ = run([KillLearner(0, at_step=15, restart_after_s=0.2)], "algo.takeover_after_s=2.0")
    assert_invariants(sim)
    notes = [e["text"] for e in sim.log if e["event"] == "note" and e["learner"] == 0]
    assert any("not registered yet" in n and "held by a live process" in n for n in notes)
    assert merged_by(sim, 0, incarnation=1)


def test_the_run_ends_with_a_final_sync_while_a_learner_is_down():
    sim, result = run([KillLearner(2, at_step=80, restart_after_s=None)])
    assert_invariants(sim)
    finals = [r for r in rounds(sim) if r.close_reason == "final"]
    assert {r.fragment for r in finals} == {0, 1, 2, 3}
    assert all({e.learner for e in r.merged} == {0, 1} for r in finals)  # nobody waited for the dead one
    assert result.tokens_processed >= 2400 and not result.partial


def test_a_second_shards_restart_leaves_the_first_shard_merging():
    sim, _ = run([RestartSyncer(1, after_rounds=12, down_s=5.0)], "sim.syncer_shards=2")
    assert_invariants(sim)
    (restore,) = sim.restores
    assert set(restore.versions) <= {1, 3}  # shard 1 owns the odd fragments
    down = [r for r in rounds(sim) if restore.time - 5.0 < r.closed_at < restore.time]
    assert down and {r.fragment % 2 for r in down} == {0}  # shard 0 merged on while shard 1 was down
    assert any(r.fragment % 2 == 1 and r.closed_at > restore.time for r in rounds(sim))


def test_a_lock_step_baseline_survives_a_kill_and_a_syncer_restart():
    sim, result = run(
        [KillLearner(1, at_step=30, restart_after_s=4.0), RestartSyncer(0, after_rounds=20, down_s=3.0)],
        method="streaming",
    )
    assert_invariants(sim)
    assert result.goodput.blocked > 0  # lock-step learners wait for their fragments
    assert merged_by(sim, 1, incarnation=1)


def test_the_same_faults_give_the_same_run_bit_for_bit():
    faults = [KillLearner(1, at_step=20, restart_after_s=3.0), Partition(0, 30.0, 8.0), RestartSyncer(0, at_s=50.0)]
    a, ra = run(faults)
    b, rb = run(faults)
    assert [r.to_json() for r in a.tape] == [r.to_json() for r in b.tape]
    assert all(bool((ra.state[k] == rb.state[k]).all()) for k in ra.state)
