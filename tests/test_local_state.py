"""A learner's own saved state (``runtime.local_state_s``): a restart on the same machine takes
it back and catches up by what changed (the chain's encoded changes) instead of the whole model
and a peer's optimizer state; a save of another run, format, learner or layout, too old or
damaged, is not taken back (one line says why) and the learner joins afresh. In one process
over the in-process network; bounded in time, asserting progress and bytes, never durations."""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import FAST_RUNTIME, wait_for
from torch import nn

import ddiloco
from ddiloco.config import load_config
from ddiloco.service.base.transport import InProcessNetwork
from ddiloco.service.learner.local_state import FORMAT, Saved, read_local_state

SETTINGS = [
    "algo.sync_every=8",
    "algo.num_fragments=4",
    "algo.up_encoding=int4",
    "algo.down_encoding=int4",
    "algo.error_feedback=true",
    *FAST_RUNTIME,
    "runtime.join_timeout_s=10.0",
    "runtime.local_state_s=0.2",
    "runtime.local_state_chunk_mb=0.04",  # a few pieces a save: the spread over boundaries is exercised
]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 48)
        self.body = nn.Linear(48, 48)
        self.mid = nn.Linear(48, 48)
        self.head = nn.Linear(48, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(torch.tanh(self.body(self.embed(ids).mean(1))))))


N_BYTES = 4 * sum(p.numel() for p in Net().parameters())


def cfg(*extra: str):
    return load_config(None, [*SETTINGS, *extra])


def train(learner: ddiloco.Learner, model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 32, (8, 6), generator=g)
        F.cross_entropy(model(ids), ids[:, 0] % 4).backward()
        opt.step()
        opt.zero_grad()
        learner.step(tokens=ids.numel())
        time.sleep(0.01)


def start(net: InProcessNetwork, address: str, m: int, folder: Path | None, config) -> tuple:
    torch.manual_seed(100 + m)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    learner = ddiloco.Learner(
        model, address, learner_id=m, config=config, optimizer=opt, transport=net.learner, local_state=folder
    )
    return learner, model, opt


def rejoin_bytes(server: ddiloco.SyncerServer, m: int) -> int:
    """What the syncer sent learner m to join (full versions and catch-up changes), so far."""
    row = server.service.traffic.to_dict()["by_learner"].get(str(m), {})
    return int(row.get("down", {}).get("rejoin", {}).get("bytes", 0))


def serve(tmp: Path, name: str, config) -> tuple[InProcessNetwork, ddiloco.SyncerServer, str]:
    net = InProcessNetwork()
    address = f"inproc://local-state-{name}"
    torch.manual_seed(0)
    server = ddiloco.SyncerServer(Net(), address, tmp / name, config=config, transport=net.syncer(address), fsync=False)
    return net, server.start(), address


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """Learner 0 saves its state while it trains beside learner 1, leaves; learner 1 trains on
    (the fragments move a version or two); learner 0 comes back from its saved state. Yields
    what the test reads."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("local")
    config = cfg()
    net, server, address = serve(tmp, "run", config)
    folder = tmp / "learner-0"
    try:
        a, model_a, opt_a = start(net, address, 0, folder, config)
        b, model_b, opt_b = start(net, address, 1, None, config)
        threads = [
            threading.Thread(target=train, args=args)
            for args in ((a, model_a, opt_a, 60, 0), (b, model_b, opt_b, 60, 1))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        saver = a._saver
        assert saver is not None
        # Its last save right before it dies (a fixed distance behind, whatever the machine's pace):
        # a save under way ends, then one is made due now and it steps until that one is complete.
        for k in range(400):
            if saver._pieces is None:
                break
            train(a, model_a, opt_a, 1, seed=1000 + k)
        # its writer may still be finishing that save (slow on a busy machine): counting from
        # before it finished would take that older save for the last one
        wait_for(lambda: not saver._writing.is_set(), 60, "the save under way to be written")
        saves, saver._ended_at = saver.saves, -math.inf
        for k in range(400):
            if saver.saves > saves:
                break
            train(a, model_a, opt_a, 1, seed=2000 + k)
        steps_then = a.session.core.step if a.session is not None else 0
        a.close()  # (its writer finishes the piece in hand; a save under way is left, the last complete one stays)
        saved = read_local_state(folder, 0, a.layout.digest, 3600.0)
        before = rejoin_bytes(server, 0)
        train(b, model_b, opt_b, 8, seed=2)  # the fleet moves on without it: H steps, a version a fragment
        current = list(server.service.core.versions())
        back, model_back, opt_back = start(net, address, 0, folder, config)
        # (the catch-up follows the acceptance: the learner may start before all of it arrived)
        caught_up = lambda: all(v >= c for v, c in zip(back.versions, current))  # noqa: E731
        wait_for(lambda: (back._idle_boundary(), caught_up())[1], 30, "the catch-up")
        joined = rejoin_bytes(server, 0) - before
        restored_step = back.session.core.step if back.session is not None else 0
        position = back.data_position
        train(back, model_back, opt_back, 24, seed=3)
        wait_for(lambda: "first_merged" in back.startup.phases, 30, "the restarted learner's first merge")
        fresh, *_ = start(net, address, 2, None, config)
        fresh_bytes = rejoin_bytes(server, 2)
        yield {
            "saves": saves, "steps_then": steps_then, "saved": saved, "joined": joined, "fresh": fresh_bytes,
            "restored_step": restored_step, "position": position, "back": back, "folder": folder, "tmp": tmp,
            "config": config, "layout": a.layout.digest,
        }  # fmt: skip
        for ln in (back, b, fresh):
            ln.close()
    finally:
        server.stop()


def test_a_restarted_learner_takes_back_its_saved_state_and_catches_up_by_what_changed(restarted):
    r = restarted
    assert r["saves"] >= 1 and isinstance(r["saved"], Saved)
    # its counters and data position come back (the save is from a boundary before it left)
    assert 60 <= r["restored_step"] <= r["steps_then"]
    assert 60 <= r["position"] <= r["steps_then"]
    assert r["back"].session.restored_runs is not None
    # the catch-up moved the chain's int4 changes of what moved, not the model in fp32
    assert 0 < r["joined"] < 0.5 * r["fresh"], (r["joined"], r["fresh"], N_BYTES)
    assert r["fresh"] >= N_BYTES  # a learner without saved state takes every fragment in full


def test_a_save_of_another_run_is_not_claimed_there_and_the_learner_takes_every_fragment(restarted):
    r = restarted
    net, server, address = serve(r["tmp"], "other-run", r["config"])
    try:
        ln, model, _ = start(net, address, 0, r["folder"], r["config"])
        assert rejoin_bytes(server, 0) >= N_BYTES  # the other run's syncer sent it everything
        global_state = server.service.core.global_state()
        for name, p in model.state_dict().items():
            assert torch.equal(p, global_state[name].to(p.dtype)), name
        ln.close()
    finally:
        server.stop()


def _copy(r, tmp_path: Path) -> Path:
    dst = tmp_path / "saved"
    shutil.copytree(r["folder"], dst)
    return dst


def _meta(folder: Path) -> dict:
    return json.loads((folder / "current" / "meta.json").read_text())


def _write_meta(folder: Path, meta: dict) -> None:
    (folder / "current" / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda m: m.update(format=FORMAT + 1), "format"),
        (lambda m: m.update(learner=5), "learner 5"),
        (lambda m: m.update(layout="abc"), "layout"),
        (lambda m: m.update(saved_at=time.time() - 7200), "old"),
        (lambda m: m.update(saved_at="yesterday"), "save time"),
        (lambda m: m.update(versions=[-1, 0, 0, 0]), "counters"),
        (lambda m: m.update(steps=[0]), "counters"),
        (lambda m: m.update(step=2**60), "counters"),
        (lambda m: m.update(merged_tokens=float("nan")), "counters"),
        (lambda m: m.update(model=["../../etc/passwd.safetensors"]), "counters"),
        (lambda m: m.update(model=["nope.safetensors"]), "unreadable"),
        (lambda m: m.update(runs=[7]), "run"),
    ],
)
def test_a_save_that_is_not_this_learners_or_is_damaged_is_refused_with_the_reason(restarted, tmp_path, change, says):
    folder = _copy(restarted, tmp_path)
    meta = _meta(folder)
    change(meta)
    _write_meta(folder, meta)
    got = read_local_state(folder, 0, restarted["layout"], 3600.0)
    assert isinstance(got, str) and says in got, got


def test_damaged_files_are_refused_not_raised(restarted, tmp_path):
    folder = _copy(restarted, tmp_path)
    assert isinstance(read_local_state(folder, 0, restarted["layout"], 3600.0), Saved)
    (folder / "current" / "meta.json").write_text("{not json")
    assert "unreadable" in read_local_state(folder, 0, restarted["layout"], 3600.0)
    (folder / "current" / "meta.json").write_text(json.dumps([1, 2]))
    assert "not a JSON object" in read_local_state(folder, 0, restarted["layout"], 3600.0)
    shutil.rmtree(folder)
    shutil.copytree(restarted["folder"], folder)
    (folder / "current" / "session.safetensors").write_bytes(b"\x00" * 64)
    assert "unreadable" in read_local_state(folder, 0, restarted["layout"], 3600.0)
    assert read_local_state(tmp_path / "none", 0, restarted["layout"], 3600.0) == "no complete save"


def test_a_save_whose_tensors_do_not_fit_is_refused_by_the_session_and_changes_nothing(restarted, monkeypatch):
    """Form checked on reading; fit (names, shapes and dtypes from the files' headers, the
    session's copies, the optimizer's moments) checked before anything is written: such a
    refused save leaves the model, optimizer and session as they were. Values are read and
    checked as they are written, one tensor at a time: a non-finite one stops the write there
    and the session is not restored, so the learner joins afresh and the syncer overwrites
    every fragment."""
    import dataclasses

    from ddiloco.service.learner.local_state import take_back
    from ddiloco.service.learner.saved_files import SavedTensors

    saved = read_local_state(restarted["folder"], 0, restarted["layout"], 3600.0)
    assert isinstance(saved, Saved) and isinstance(saved.model, SavedTensors)  # nothing read but headers
    back = restarted["back"]
    model_before = {k: v.clone() for k, v in back.params.items()}
    names = list(saved.model)
    wrong = dict(saved.model)
    wrong[names[-1]] = wrong[names[-1]][:1]
    assert "the model's" in take_back(Saved(saved.state, wrong, {}, None, 0, 0.0), back.session, back.params, None)
    p0 = next(iter(saved.state.base))
    base = dict(saved.state.base)
    base[p0] = [v[:1] for v in base[p0]]
    state = dataclasses.replace(saved.state, base=base)
    assert "base copy" in take_back(Saved(state, saved.model, {}, None, 0, 0.0), back.session, back.params, None)
    for k, v in back.params.items():
        assert torch.equal(v, model_before[k])
    # A non-finite value in the last tensor (the session's own checks passed, as for a learner not
    # yet registered): the ones before it are written, the session is not restored.
    import ddiloco.protocol.local_state as session_state

    restored = []
    monkeypatch.setattr(session_state, "check", lambda session, state: None)
    monkeypatch.setattr(session_state, "restore", lambda session, state: restored.append(state))
    params = {k: v.clone() for k, v in back.params.items()}
    bad = dict(saved.model)
    bad[names[-1]] = torch.full_like(bad[names[-1]], float("nan"))
    first = bad[names[0]].clone()
    problem = take_back(Saved(saved.state, bad, {}, None, 0, 0.0), back.session, params, None)
    assert "non-finite" in problem and "left to the join" in problem, problem
    assert torch.equal(params[names[0]], first) and not restored


def test_the_session_claims_saved_versions_in_their_run_and_forgets_them_in_another():
    """Pure sessions in virtual time: a learner session that took back a save registers with its
    versions and run; a syncer of that run sends nothing for current versions, one of another
    run sends every fragment and the learner forgets what it took back of them."""
    from helpers import SessionPair

    from ddiloco.protocol.local_state import capture, restore

    pair = SessionPair((0,))
    pair.syncer.run = "runA"
    pair.advance(1.0)  # joined: every fragment at version 0
    saved = capture(pair.sessions[0])
    assert saved.runs == ("runA",) and saved.versions == (0, 0)
    for run, claimed in (("runA", True), ("runB", False)):
        fresh = SessionPair((0,))
        fresh.syncer.run = run
        session = fresh.sessions[0]
        assert restore(session, saved) is None and session.received == {0, 1}
        fresh.advance(1.0)
        sent = [name for d, _, name in fresh.transcript if d == "<-" and name == "FragmentUpdate"]
        if claimed:
            assert sent == []  # it holds the current versions: nothing moves
        else:
            assert len(sent) == 2 and any("another run" in n for n in fresh.notes)
            assert any("claims versions of run 'runA'" in n for n in fresh.notes)
        assert session.received == {0, 1} and not session.wants_peer_state
    # refused: a session that registered already, a save of another layout
    assert restore(pair.sessions[0], saved) == "the learner has registered already"
    import dataclasses

    other = SessionPair((0,))
    assert "fragments" in (restore(other.sessions[0], dataclasses.replace(saved, versions=(0,))) or "")
    assert other.sessions[0].restored_runs is None


def test_a_save_in_pieces_smaller_than_a_parameter_comes_back_bit_for_bit(tmp_path):
    """A chunk smaller than a parameter's optimizer state: its moments go as ranges of rows over
    several boundaries (the hand-off's pieces) and are put back together on reading."""
    from helpers import SESSION_LAYOUT, SessionPair

    from ddiloco.service.learner.local_state import LocalStateSaver, take_back

    def model() -> tuple[nn.Module, torch.optim.Optimizer]:
        m = nn.Module()
        m.w, m.b = nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(2))
        opt = torch.optim.AdamW([m.w, m.b], lr=0.1)
        (m.w.sum() * 2 + m.b.sum()).backward()
        opt.step()
        return m, opt

    pair = SessionPair((0,))
    pair.advance(1.0)
    session = pair.sessions[0]
    m, opt = model()
    params = {"w": m.w, "b": m.b}
    saver = LocalStateSaver(tmp_path, 0, SESSION_LAYOUT.digest(), params, opt, 0.0, chunk_bytes=8)
    for _ in range(600):  # save after save (each starts once the last one is on disk)
        if saver.saves >= 3:
            break
        saver.boundary(session, 5)
        time.sleep(0.01)
    saver.close()
    assert saver.saves >= 3
    stats = saver.stats()  # what the learner's status reports of its saves
    assert stats["saves"] == saver.saves and stats["boundaries"] > stats["saves"]
    assert 0 <= stats["longest_copy_s"] <= stats["copy_s"]
    assert stats["last"]["began"] <= stats["last"]["done"]
    from safetensors.torch import load_file

    names = [k for f in sorted((tmp_path / "current").glob("optimizer-*")) for k in load_file(str(f))]
    assert any("@" in k for k in names)  # ranges of rows
    saved = read_local_state(tmp_path, 0, SESSION_LAYOUT.digest(), 3600.0)
    assert isinstance(saved, Saved) and saved.data_position == 5
    back_pair = SessionPair((0,))
    m2, opt2 = model()
    assert take_back(saved, back_pair.sessions[0], {"w": m2.w, "b": m2.b}, opt2) is None
    assert torch.equal(m2.w, m.w) and torch.equal(m2.b, m.b)
    for p, q in ((m.w, m2.w), (m.b, m2.b)):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key]), key


def test_a_run_identity_read_back_from_the_store_is_taken_only_when_plausible():
    """The store's meta is a file on disk: its ``run`` is taken back only as a short alphanumeric
    string; anything else keeps the identity this start made (learners' claims then miss, and
    they are sent every fragment: the safe side)."""
    from helpers import SessionPair

    for stored, taken in (("a1b2c3d4", True), ("../../x", False), ("x" * 65, False), (7, False), ("", False)):
        s = SessionPair((0,)).syncer
        s.run = "fresh0"
        s.restore({}, {**s.meta(), "run": stored})
        assert s.run == (stored if taken else "fresh0"), stored


def _small_saver(tmp_path, **kw):
    """A saver of a 3-parameter model with AdamW state, beside a session of the test layout."""
    from helpers import SESSION_LAYOUT, SessionPair

    from ddiloco.service.learner.local_state import LocalStateSaver

    m = nn.Module()
    m.a, m.b, m.c = (nn.Parameter(torch.randn(4, 4)) for _ in range(3))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    sum(p.sum() for p in m.parameters()).backward()
    opt.step()
    pair = SessionPair((0,))
    pair.advance(1.0)
    params = {"a": m.a, "b": m.b, "c": m.c}
    return LocalStateSaver(tmp_path, 0, SESSION_LAYOUT.digest(), params, opt, **kw), pair.sessions[0]


def _wait_saved(saver, session, saves: int) -> None:
    for _ in range(500):
        if saver.saves >= saves:
            return
        saver.boundary(session, 0)
        time.sleep(0.01)
    raise AssertionError(f"no save {saves} in 500 boundaries")


def test_a_save_is_due_once_a_fragment_moved_past_what_the_chain_can_catch_up(tmp_path):
    """With a lossy down-link a save starts before the interval once a fragment moved
    chain_history - 1 versions past the last save (a restart then catches up by the chain),
    but not within a quarter of the interval after the last one, and not while one is written."""
    saver, session = _small_saver(tmp_path, interval_s=1000.0, chunk_bytes=64, versions_behind=2)
    saver._ended_at = -math.inf  # the first save: due by the interval
    _wait_saved(saver, session, 1)
    now = time.monotonic()
    assert not saver.due(session, now)  # just saved, nothing moved
    versions = session.core.base_version
    versions[1] += 1
    saver._ended_at = now - 300.0  # past a quarter of the interval
    assert not saver.due(session, now)  # one version: the chain still covers it
    versions[1] += 1
    assert saver.due(session, now)  # two: the next would pass chain_history - 1
    saver._ended_at = now - 100.0
    assert not saver.due(session, now)  # too soon after the last save
    off, _ = _small_saver(tmp_path / "fp32", interval_s=1000.0, chunk_bytes=64, versions_behind=0)
    off._saved_versions, off._ended_at = [0] * len(versions), now - 300.0
    assert not off.due(session, now)  # no chain (fp32 down-link): the interval alone
    saver.close()
    off.close()


def test_a_boundary_copies_for_its_share_of_the_step_within_the_buffer(tmp_path, monkeypatch):
    """A long step lets one boundary copy every piece (the share of its time is large); a
    buffer smaller than two pieces holds the copies to one per boundary while the writer is
    behind; either way the save completes and reads back."""
    from helpers import SESSION_LAYOUT

    import ddiloco.service.learner.local_state as local_state

    fast, session = _small_saver(tmp_path / "fast", interval_s=0.0, chunk_bytes=64, copy_share=1.0)
    fast.boundary(session, 0)  # begins the save (and times the boundary)
    fast._last_boundary = time.monotonic() - 10.0  # a 10 s step: a 10 s copy budget
    fast.boundary(session, 0)
    assert fast._pieces is None  # every piece copied at that one boundary
    _wait_saved(fast, session, 1)
    fast.close()
    gate, write = threading.Event(), local_state._save_file
    monkeypatch.setattr(local_state, "_save_file", lambda t, path: (gate.wait(30), write(t, path)))
    slow, session = _small_saver(tmp_path / "slow", interval_s=0.0, chunk_bytes=64, copy_share=1.0, buffer_bytes=1)
    slow.boundary(session, 0)
    slow._last_boundary = time.monotonic() - 10.0
    slow.boundary(session, 0)
    held = slow._pending
    assert slow._pieces is not None and held > 0  # one piece copied, held: the writer is behind
    slow.boundary(session, 0)
    assert slow._pending == held  # nor does the next boundary copy anything
    gate.set()
    _wait_saved(slow, session, 1)
    slow.close()
    for folder in (tmp_path / "fast", tmp_path / "slow"):
        assert isinstance(read_local_state(folder, 0, SESSION_LAYOUT.digest(), 3600.0), Saved)
