"""The learner's state machine: counters, apply policy, lock-step sending and blocking."""

import dataclasses

import torch

from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.learner import LearnerCore, Receipt
from ddiloco.core.messages import FragmentUpdate

CFG = DiLoCoConfig(num_fragments=2, sync_every=4, overlap=1)


def update(p, version, reason="merged", tokens=0.0, live=1):
    return FragmentUpdate(0, p, version, [torch.zeros(1)], tokens, live, 0, reason)


def test_counters_grow_and_reset_per_fragment_on_receipt():
    core = LearnerCore(CFG, 0, 2)
    for _ in range(3):
        assert core.on_step(100) == []  # 'continue' learners send only when asked
    c = core.contribution(1, [torch.ones(1)], data_position=3)
    assert (c.base_version, c.steps, c.tokens, c.step, c.data_position) == (0, 3, 300, 3, 3)
    assert core.on_update(update(1, 1)).mode == "overwrite"
    assert core.steps == [3, 0] and core.tokens == [300, 0] and core.base_version == [0, 1]


def test_versions_never_go_backwards_and_blend_applies_to_merges_only():
    core = LearnerCore(dataclasses.replace(CFG, alpha=0.5), 0, 2)
    assert core.on_update(update(0, 3)) == Receipt("blend", 0.5)
    core.on_step(10)
    assert core.on_update(update(0, 2)).mode == "ignore"  # older than the base: dropped
    assert core.steps[0] == 1
    assert core.on_update(update(0, 4, reason="join")) == Receipt("overwrite")  # a fetch always overwrites


def test_lr_position_extrapolates_from_the_global_token_count():
    core = LearnerCore(CFG, 0, 2)
    core.on_update(update(0, 1, tokens=5000.0, live=4))
    core.on_step(100)
    assert core.fleet_tokens() == 5000.0 + 4 * 100


def test_lr_position_counts_the_unmerged_tokens_of_every_fragment():
    """Fragments merge in turn, so the merged count (a mean over fragments) trails the fleet by
    about H/2 steps; each fragment's unmerged tokens make that up, with no lag after a merge."""
    core = LearnerCore(CFG, 0, 2)
    for _ in range(4):
        core.on_step(100)  # 4 steps: both fragments hold 400 unmerged tokens
    # Fragment 0 merges this learner's 400 tokens (and 3 peers' 400 each): mean merged = 1600 / 2.
    core.on_update(update(0, 1, tokens=800.0, live=4))
    # The fleet has processed 4 x 400 = 1600; fragment 1's 400 unmerged tokens x 4 learners / 2
    # fragments make up the rest. (The old estimate, reset at every update, said 800.)
    assert core.fleet_tokens() == 800.0 + 4 * (0 + 400) / 2 == 1600.0


def test_lock_step_sends_on_schedule_blocks_at_send_plus_tau_and_times_out():
    cfg = dataclasses.replace(CFG, late_fragment="wait", syncer_timeout_s=10.0)
    core = LearnerCore(cfg, 0, 2)
    sent = []
    for _ in range(4):
        due = core.on_step(1)
        for p in due:
            core.sent(core.contribution(p, [torch.zeros(1)], 0))  # the runtime sends it at once
        sent.append(due)
    assert sent == [[], [1], [], [0]]  # offsets floor(p*H/P) = 0, 2; step 4 = 0 mod 4
    # fragment 1 sent at step 2, tau = 1: at step 4 the learner must wait for it
    assert core.blocking_fragments(now=100.0) == [1]
    assert core.block_deadline() == 110.0
    core.on_step(1)  # (the runtime would not step while blocked; here: time runs out)
    assert core.blocking_fragments(now=110.0) == [0]  # 1 gave up; 0 (sent at 4) now due
    core.on_update(update(0, 1))
    assert core.blocking_fragments(now=111.0) == []


def test_continue_never_blocks():
    core = LearnerCore(CFG, 0, 2)
    core.on_step(1)
    core.sent(core.contribution(0, [torch.zeros(1)], 0))
    for _ in range(10):
        core.on_step(1)
    assert core.blocking_fragments(now=1e9) == []


def test_a_restarted_lock_step_learner_steps_in_phase_with_the_fleet():
    """A new process's core starts at step 0; the global state it joins with says where the
    fleet's steps are, and a lock-step learner takes that phase (its sends follow it)."""
    core = LearnerCore(dataclasses.replace(CFG, late_fragment="wait"), 0, 2)
    core.on_update(dataclasses.replace(update(0, 3, reason="join"), global_step=40))
    assert core.steps == [0, 0] and core.step == 40 and not core.in_flight
    core.on_update(dataclasses.replace(update(1, 3, reason="join"), global_step=44))
    assert core.step == 40  # only a fresh core takes the fleet's phase


def test_a_snapshot_built_but_never_sent_is_not_counted_as_sent():
    """Contributions are built ahead (snapshots for requests to come); only one that is sent
    makes a lock-step learner wait, or counts the tokens a merge of it will overwrite."""
    core = LearnerCore(dataclasses.replace(CFG, late_fragment="wait"), 0, 2)
    core.on_step(10)
    c = core.contribution(0, [torch.zeros(1)], 0)
    assert not core.in_flight and not core.sent_tokens
    core.sent(c)
    assert core.in_flight == {0: 1} and core.sent_tokens == {0: 10}


def test_a_merge_of_this_process_own_answer_is_marked_own_and_a_predecessors_is_not():
    """``Receipt.own`` (the ``first_merged`` start-up mark): the merge answers a contribution
    this process sent. The core forgets what it sent as it applies the merge, so the driver
    must learn it from the receipt, not from the core's state afterwards."""
    for rule in ("overwrite", "shift"):
        core = LearnerCore(dataclasses.replace(CFG, on_merged=rule), 0, 2)
        assert not core.on_update(update(0, 1)).own  # a merge of a predecessor's answer
        assert not core.on_update(update(1, 1, reason="join")).own
        core.on_step(10)
        core.sent(core.contribution(0, [torch.zeros(1)], 0))
        assert core.on_update(update(0, 2)).own
        assert not core.sent_tokens  # applied: the core no longer knows it sent it
        assert not core.on_update(update(0, 3)).own  # the next merge did not answer a new send


def test_contributions_carry_the_identity_and_increasing_sequence_numbers():
    core = LearnerCore(CFG, 3, 2, incarnation=77)
    core.on_step(10)
    a = core.contribution(0, [torch.zeros(1)], 1)
    b = core.contribution(0, [torch.zeros(1)], 1)
    assert a.identity == (3, 77, 0, 0, a.seq) and b.seq > a.seq


def test_a_request_forecasts_the_next_fragments_on_the_schedule():
    core = LearnerCore(DiLoCoConfig(num_fragments=4, sync_every=8), 0, 4)
    assert core.expected == []  # nothing known before the first request
    core.on_request(1)
    assert core.expected == [2, 3]
    core.on_request(3)
    assert core.expected == [0, 1]  # wraps around to the next period
