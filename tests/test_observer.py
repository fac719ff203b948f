"""The one observer client (service/base/observer.py) against a hand-driven ROUTER socket: the reply of
the expected type is returned, anything else is skipped, and no reply is one clear error. And an
observer that follows the global model by what changed (``GlobalCopy``) against a syncer session
in memory: it fetches only the fragments whose version moved, at a cadence in merged tokens
(``EvalCadence``), and its bytes are counted apart from the learners'."""

from __future__ import annotations

import itertools
import json
import math
import threading
from typing import Any

import pytest
import torch
import zmq
from helpers import SESSION_LAYOUT, SESSION_SPECS, SessionPair
from torch import nn

from ddiloco.protocol.config import EvalCadence, auto_eval_tokens
from ddiloco.protocol.messages import FetchGlobal, GlobalState, StatusReply, StatusRequest
from ddiloco.protocol.traffic import TrafficMeter, classify, payload_nbytes, traffic_figures
from ddiloco.service.base.observer import Evaluations, GlobalCopy, Moved, NoReply, ask, fetch_status, frames_nbytes
from ddiloco.service.base.wire import SCHEMA, WireError, decode, encode
from ddiloco.service.ops.launcher import free_port

torch.set_num_threads(1)


class FakeSyncer:
    """A ROUTER that answers the first request with the given messages (lists of frames)."""

    def __init__(self, answers: list[list[bytes]]) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.address)
        self.answers = answers
        self.asked: list[object] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        if not self.sock.poll(30_000):
            return
        identity, *frames = self.sock.recv_multipart()
        self.asked.append(decode(frames))
        for frames in self.answers:
            self.sock.send_multipart([identity, *frames])

    def close(self) -> None:
        self.thread.join(timeout=30)
        self.sock.close(0)


@pytest.fixture
def fake():
    made: list[FakeSyncer] = []

    def make(*answers: list[bytes]) -> FakeSyncer:
        made.append(FakeSyncer(list(answers)))
        return made[-1]

    yield make
    for f in made:
        f.close()


def frames(msg) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


def test_the_reply_comes_back_after_messages_of_another_type_and_unreadable_ones(fake):
    syncer = fake([b"\x00garbage"], frames(FetchGlobal("not a reply")), frames(StatusReply({"shard": 0})))
    assert fetch_status(syncer.address, 30.0) == {"shard": 0}
    assert syncer.asked == [StatusRequest("ddiloco status")]


def test_no_reply_in_time_is_one_clear_error(fake):
    syncer = fake()
    with pytest.raises(NoReply, match=r"no answer from .* within 0.3 s: is the syncer running\?.*--keys DIR"):
        ask(syncer.address, StatusRequest("test"), StatusReply, 0.3)


def test_only_unreadable_answers_say_so(fake):
    syncer = fake([b"\x00garbage"])
    with pytest.raises(NoReply, match="cannot read .* same ddiloco version"):
        ask(syncer.address, StatusRequest("test"), StatusReply, 3.0)  # waits it out: garbage is not the reply


# -- following the global model by what changed (issue 32, item 3) --------------------------------


class Toy(nn.Module):
    """The session pair's model (``helpers.SESSION_SPECS``) as an observer builds it."""

    def __init__(self) -> None:
        super().__init__()
        for s in SESSION_SPECS:
            self.register_parameter(s.name, nn.Parameter(torch.full(s.shape, float("nan"))))


class Observer:
    """An observer of a ``SessionPair``'s syncer session through the wire (encode, decode): the
    ``AskShard`` of a ``GlobalCopy``, each request on a fresh connection, as ``observer.ask``."""

    def __init__(self, pair: SessionPair) -> None:
        self.pair = pair
        self.notes: list[str] = []
        self.answers: list[GlobalState] = []
        self._peers = itertools.count()

    def __call__(self, shard: int, request: FetchGlobal, moved: Moved) -> GlobalState | None:
        frames = encode(request)
        moved.up += frames_nbytes(frames)
        out = self.pair.syncer.receive(f"observer-{next(self._peers)}", decode(frames), self.pair.now)
        self.notes += [f"{n.kind}: {n.text}" for n in out.notes]
        ((_, reply),) = out.send
        back = [bytes(memoryview(f)) for f in encode(reply)]
        moved.down += frames_nbytes(back)
        self.answers.append(decode(back))
        return self.answers[-1]

    def ask(self, request: FetchGlobal) -> GlobalState:
        answer = self(0, request, Moved())
        assert answer is not None
        return answer


def pieces(state: GlobalState) -> set[int]:
    """The fragments a GlobalState carries values for."""
    return {int(name.split(".")[0]) for name in state.tensors}


def merge_one_round(pair: SessionPair) -> None:
    """Learner 0 steps until the syncer closes its next round (one fragment merges)."""
    rounds = len(pair.tape)
    while len(pair.tape) == rounds:
        pair.step(0, tokens=16)


def test_a_second_fetch_with_the_current_versions_returns_no_tensors():
    pair = SessionPair()
    pair.tick()
    obs = Observer(pair)
    first = obs.ask(FetchGlobal("evaluator"))  # an old-style request: every fragment's values
    assert first.versions == {"0": 0, "1": 0} and pieces(first) == {0, 1}
    again = obs.ask(FetchGlobal("evaluator", held=first.versions))
    assert again.versions == {"0": 0, "1": 0} and again.tensors == {}
    poll = obs.ask(FetchGlobal("evaluator", versions_only=True))  # holds nothing, wants no values
    assert poll.versions == {"0": 0, "1": 0} and poll.tensors == {} and poll.merged_tokens == 0
    assert obs.notes == []


def test_after_one_fragment_merges_only_that_fragment_moves():
    pair = SessionPair()
    pair.tick()
    copy = GlobalCopy(Toy(), SESSION_LAYOUT, 1, Observer(pair), "evaluator")
    first = copy.refresh()
    assert first is not None and first.fetched == 2 and copy.versions() == {"0": 0, "1": 0}
    merge_one_round(pair)  # fragment 1 merges first (the staggered schedule)
    assert pair.syncer.core.versions() == [0, 1]
    poll = copy.poll()
    assert poll is not None and poll.versions == {"0": 0, "1": 1} and poll.fetched == 0
    assert copy.versions() == {"0": 0, "1": 0}  # a poll changes nothing the copy holds
    seen = copy.refresh()
    assert seen is not None and seen.fetched == 1 and copy.versions() == {"0": 0, "1": 1}
    assert pieces(copy.ask.answers[-1]) == {1}  # type: ignore[attr-defined]
    params = dict(copy.model.named_parameters())
    for p in (0, 1):  # the copy is the exact global model
        for pc, value in zip(SESSION_LAYOUT.fragments[p], pair.syncer.core.values(p)):
            assert torch.equal(params[pc.name].detach()[pc.row_start : pc.row_end].flatten(), value.flatten())
    nothing = copy.refresh()
    assert nothing is not None and nothing.fetched == 0 and copy.fetched == 3


def test_the_copy_asks_again_for_a_fragment_it_was_not_sent():
    """A fragment an answer lists at a new version without its values stays unheld: asked again."""
    pair = SessionPair()
    pair.tick()
    real = Observer(pair)

    def stingy(shard: int, request: FetchGlobal, moved: Moved) -> GlobalState | None:
        answer = real(shard, request, moved)
        assert answer is not None
        return GlobalState(answer.versions, answer.merged_tokens, {k: v for k, v in answer.tensors.items()
                                                                   if k.startswith("0.")})  # fmt: skip

    copy = GlobalCopy(Toy(), SESSION_LAYOUT, 1, stingy, "evaluator")
    copy.refresh()
    assert copy.versions() == {"0": 0}
    copy.ask = real
    seen = copy.refresh()
    assert seen is not None and seen.fetched == 1 and copy.versions() == {"0": 0, "1": 0}


def test_a_hostile_held_map_is_refused_by_the_wire_or_ignored_with_a_note():
    pair = SessionPair()
    pair.tick()
    obs = Observer(pair)
    # fragments this shard does not own, and keys that are no fragment index: ignored, and noted
    odd = obs.ask(FetchGlobal("evaluator", held={"1": 0, "2": 0, "01": 0, "x" * 1000: 5, "-1": 0}))
    assert pieces(odd) == {0} and odd.versions == {"0": 0, "1": 0}  # fragment 1 is held: not sent
    assert obs.notes == [
        "malformed: FetchGlobal from 'observer-0' (no key): its held versions name 4 fragments this shard does not "
        "own (the first: '2'); ignored"
    ]
    # a version the syncer never had (ahead, or from another run): it differs, so the values come
    assert pieces(obs.ask(FetchGlobal("evaluator", held={"0": 7, "1": 0}))) == {0}
    # negative versions and too many entries never reach the session: encode and decode refuse them
    for held in ({"0": -1}, {str(i): 0 for i in range(65537)}, {"0": 2**60}, {"0": True}):
        with pytest.raises(ValueError, match="refusing to encode"):
            encode(FetchGlobal("evaluator", held=held))  # type: ignore[arg-type]
        fields = {"requester": "x", "held": held, "versions_only": False}
        raw = json.dumps({"v": SCHEMA, "type": "FetchGlobal", "fields": fields, "tensors": []}).encode()
        with pytest.raises(WireError, match="FetchGlobal.held"):
            decode([raw])


def test_the_cadence_in_merged_tokens():
    fixed = EvalCadence(every_tokens=1000)
    assert fixed.next_mark(0.0) == 1000 and not fixed.due(999, 0.0) and fixed.due(1000, 0.0)
    fixed.evaluated(1250)  # evaluated past the mark: the next is the next multiple
    assert fixed.next_mark(0.0) == 2000 and not fixed.due(1999, 0.0)
    late = EvalCadence(every_tokens=1000)
    assert late.due(5300, 0.0)  # an evaluator that starts late evaluates at its first poll...
    late.evaluated(5300)
    assert late.next_mark(0.0) == 6000  # ...then at the marks
    auto = EvalCadence(0.0, sync_every=24, up_encoding="int4", down_encoding="int4")
    assert auto.next_mark(0.0) is None and not auto.due(1e12, 0.0)  # no tokens per step reported yet
    # 40 x H x B / (u + d): the default GPT's 8 x 128 tokens per step, H = 24
    assert auto.every(1024) == auto_eval_tokens(24, "int4", "int4", 1024) == 40 * 24 * 1024
    assert auto_eval_tokens(24, "fp32", "fp32", 1024) == 5 * 24 * 1024
    assert auto_eval_tokens(24, "int8", "bf16", 1024) == pytest.approx(40 * 24 * 1024 / 3)


def test_the_evaluator_follows_the_cadence_and_its_bytes_stay_within_a_tenth_of_the_learners():
    """Two learners train through the session pair while an observer polls at every step and
    evaluates at the automatic cadence: it evaluates once per mark, fetches only what moved, and
    its payload stays within 0.1 of the learners' steady payload (both ways), as the arithmetic of
    ``runtime.eval_every_tokens`` says; the meter counts its bytes as observer traffic."""
    pair = SessionPair(learners=(0, 1))
    meter = TrafficMeter()
    payload = {"learners": 0, "observer": 0}

    def metered(receive: Any, direction: str, learner: int | None) -> Any:
        def wrapped(peer: Any, msg: Any, now: float, *rest: Any) -> Any:
            who = learner if learner is not None else peer if isinstance(peer, int) else None  # observers: nobody
            kind = meter.count(msg, frames_nbytes(encode(msg)), direction, who)  # type: ignore[arg-type]
            if kind.steady:
                payload["learners"] += payload_nbytes(msg)
            return receive(peer, msg, now, *rest)

        return wrapped

    pair.syncer.receive = metered(pair.syncer.receive, "up", None)  # type: ignore[method-assign]
    for m, session in pair.sessions.items():
        session.receive = metered(session.receive, "down", m)  # type: ignore[method-assign]
    obs = Observer(pair)
    copy = GlobalCopy(Toy(), SESSION_LAYOUT, 1, obs, "evaluator")
    evals = Evaluations(copy, EvalCadence(0.0, sync_every=4), "test")
    made: list[dict[str, Any]] = []
    pair.tick()
    for _ in range(120):
        for m in (0, 1):
            pair.step(m, tokens=16)
        seen = copy.poll()
        assert seen is not None and seen.tokens_per_step == 16
        if evals.due(seen):
            seen = copy.refresh()
            assert seen is not None
            made.append({"merged": seen.merged_tokens, **evals.made(seen)})
    every = auto_eval_tokens(4, "fp32", "fp32", 16)  # 5 x H x B = 320
    merged = pair.syncer.core.merged_tokens
    assert len(made) == math.floor(merged / every) >= 10  # one evaluation per mark passed
    assert [math.floor(e["merged"] / every) for e in made] == list(range(1, len(made) + 1))
    assert all(1 <= e["fragments_fetched"] <= 2 and e["bytes_down"] > 0 for e in made)
    assert sum(e["bytes_down"] + e["bytes_up"] for e in made) <= copy.moved.total()  # the last polls come after
    payload["observer"] = sum(payload_nbytes(a) for a in obs.answers)
    assert payload["observer"] <= 0.1 * payload["learners"], payload
    # the syncer's meter: the observer's frames are its own category, on no learner's link
    for a in obs.answers:
        meter.count(a, frames_nbytes(encode(a)), "down", None)
    f = traffic_figures(meter.to_dict(params=8, learners=2))
    assert f["observer_down_bytes"] == sum(frames_nbytes(encode(a)) for a in obs.answers)
    assert classify(FetchGlobal("evaluator", versions_only=True)).category == "observer"
    steady = (f["up_bytes_per_step"] + f["down_bytes_per_step"]) * f["steps"]
    assert f["observer_up_bytes"] > 0  # its requests, counted as they arrived
    assert f["observer_share"] == pytest.approx((f["observer_up_bytes"] + f["observer_down_bytes"]) / steady)


class ScriptedSyncer:
    """A syncer shard's observer side as a script (the ``AskShard`` of ``ddiloco evaluator``):
    each poll, ``tokens`` more merged tokens and fragment ``polls mod P`` at a new version (its
    values + 1); after ``end_after`` polls the run has ended. A refresh gets the values of the
    fragments whose version differs from what the request holds, as the session answers."""

    def __init__(self, model: nn.Module, layout: Any, tokens: float, end_after: int) -> None:
        from ddiloco.core.fragments import read_fragment
        from ddiloco.training.layout import synced_tensors

        params = synced_tensors(model)
        self.values = [read_fragment(params, pieces) for pieces in layout.fragments]
        self.versions = [0] * len(self.values)
        self.tokens, self.end_after = tokens, end_after
        self.polls, self.merged = 0, 0.0
        self.sent: list[int] = []

    def __call__(self, shard: int, request: FetchGlobal, moved: Moved) -> GlobalState:
        moved.up += frames_nbytes(encode(request))
        if request.versions_only and self.polls < self.end_after:
            self.polls += 1
            self.merged += self.tokens
            p = self.polls % len(self.values)
            self.versions[p] += 1
            self.values[p] = [v + 1 for v in self.values[p]]
        versions = {str(p): v for p, v in enumerate(self.versions)}
        moved_p = (
            [] if request.versions_only else [p for p, v in enumerate(self.versions) if request.held.get(str(p)) != v]
        )
        self.sent += moved_p
        tensors = {f"{p}.{i}": v for p in moved_p for i, v in enumerate(self.values[p])}
        answer = GlobalState(versions, self.merged, tensors, self.polls >= self.end_after, tokens_per_step=8.0)
        moved.down += frames_nbytes(encode(answer))
        return answer


@pytest.mark.parametrize("final_eval", [True, False])
def test_ddiloco_evaluator_evaluates_at_the_marks_and_fetches_only_what_moved(tmp_path, monkeypatch, final_eval):
    from types import SimpleNamespace

    from ddiloco.config import load_config
    from ddiloco.core.fragments import read_fragment
    from ddiloco.service.ops import evaluator
    from ddiloco.training.layout import layout_for, synced_tensors
    from ddiloco.workloads.config import load_workload

    cfg = load_config(None, [
        "workload.factory=ddiloco.workloads.synthetic:make_workload", "algo.num_fragments=4",
        "runtime.eval_interval_s=0.01", "runtime.eval_every_tokens=1000", f"runtime.final_eval={final_eval}",
    ])  # fmt: skip
    wl = load_workload(cfg.workload)
    layout = layout_for(wl.build_model(cfg.run.seed), wl, cfg.algo).fragments
    script = ScriptedSyncer(wl.build_model(cfg.run.seed), layout, tokens=300.0, end_after=12)
    monkeypatch.setattr(evaluator, "shard_asker", lambda syncers, keys: script)
    monkeypatch.setattr(evaluator, "processed_tokens", lambda syncer, keys: 4321.0)  # the syncer's status
    built: list[nn.Module] = []
    build = type(wl).build_model
    monkeypatch.setattr(type(wl), "build_model", lambda self, seed: built.append(build(self, seed)) or built[-1])
    signals = SimpleNamespace(requested=False)
    assert evaluator._evaluate_until_the_end(cfg, ["tcp://h:1"], str(tmp_path), False, None, signals) == 0  # type: ignore[arg-type]

    recs = [json.loads(line) for line in (tmp_path / "metrics" / "eval.jsonl").read_text().splitlines()]
    # 300 merged tokens a poll, a mark every 1,000: at 1,200, 2,100, 3,000 (and the run's end at 3,600)
    assert [r["merged_tokens"] for r in recs] == [1200.0, 2100.0, 3000.0] + ([] if final_eval else [3600.0])
    assert all(r["where"].startswith("ddiloco evaluator on ") and r["final"] is False for r in recs)
    # the first fetch is the whole model; then only the fragments that moved since (one per poll)
    assert [r["fragments_fetched"] for r in recs] == [4, 3, 3] + ([] if final_eval else [2])
    assert all(r["bytes_down"] > 0 and r["bytes_up"] > 0 for r in recs)
    assert all(r["tokens"] == 4321.0 for r in recs)  # the fleet's processed tokens, asked of the syncer
    if not final_eval:  # the evaluator's model is the final global model, exactly
        assert recs[-1]["versions"] == {str(p): v for p, v in enumerate(script.versions)}
        params = synced_tensors(built[0])
        for p, pieces in enumerate(layout.fragments):
            assert all(torch.equal(a, b) for a, b in zip(read_fragment(params, pieces), script.values[p]))
