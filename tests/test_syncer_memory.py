"""The syncer process's memory beyond the core's ``held_bytes`` (issue 32 item 5, the syncer side):
no transient copy of the whole model where one fragment's will do, and what remains shown in the
status ``memory``."""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SESSION_LAYOUT, SessionPair
from test_library_run import BUDGET, Net, cfg, run_fleet
from test_observer import Observer, ScriptedSyncer, Toy, merge_one_round
from test_store_bounds import LAYOUT, META, record
from torch import nn

import ddiloco
from ddiloco.core.fragments import read_fragment, write_fragment
from ddiloco.core.syncer import FragmentRecord
from ddiloco.errors import UsageError
from ddiloco.protocol.config import EvalCadence
from ddiloco.protocol.messages import FetchGlobal, GlobalState
from ddiloco.service.base.observer import Moved
from ddiloco.service.base.transport import InProcessNetwork
from ddiloco.service.syncer.eval_hook import EvalHook
from ddiloco.service.syncer.store import SyncerStore
from ddiloco.training.layout import synced_tensors

torch.set_num_threads(1)


def test_a_snapshot_makes_each_record_after_the_one_before_is_let_go(tmp_path):
    """A record copies its fragment's momentum: a snapshot of P fragments reads them one at a
    time (each let go before the next is made), not P copies at once."""
    store = SyncerStore(tmp_path, fsync=False, log_bound=2.0)
    store.restore(LAYOUT, list(range(4)))
    for p in range(4):
        store.append(record(p, 1), META)
    alive: list[weakref.ref[torch.Tensor]] = []

    def records() -> Iterator[FragmentRecord]:
        for p in range(4):
            gc.collect()
            assert all(r() is None for r in alive), f"fragment {p - 1}'s record is still held"
            rec = record(p, 1 + (p == 3))  # (the last one newer than its log: appended first)
            alive.append(weakref.ref(rec.momentum[0]))
            yield rec
            del rec

    store.snapshot(records(), META)
    assert len(alive) == 4
    assert store.restore(LAYOUT, list(range(4))) is not None


# -- SyncerServer: one copy of the values, not two -----------------------------------------------


class BNNet(nn.Module):
    """A user's model: a row-split embedding (``algo.num_fragments=4``), a tied head, BatchNorm's
    persistent statistics and a non-persistent buffer (not the syncer's: left as it is)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.body = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(2.0), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.body(self.embed(ids).mean(1)))) * self.scale)


def server_for(model: nn.Module, run_dir: Path, *extra: str, **kwargs: Any) -> ddiloco.SyncerServer:
    address = f"inproc://{run_dir.name}"
    return ddiloco.SyncerServer(
        model, address, run_dir, config=cfg("algo.num_fragments=4", *extra),
        transport=InProcessNetwork().syncer(address), fsync=False, **kwargs,
    )  # fmt: skip


def storages(tensors: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_the_syncer_takes_the_models_values_and_the_model_keeps_its_structure_while_it_serves(tmp_path):
    torch.manual_seed(0)
    model = BNNet()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mine = storages(t for t in synced_tensors(model).values() if t.dtype == torch.float32)
    weight, mean = model.embed.weight, model.norm.running_mean
    server = server_for(model, tmp_path)
    core = server.service.core
    # version 0 is the model's memory (views), not a copy of it (an integer count is converted)
    assert mine <= storages(t for p in range(core.layout.num_fragments) for t in core.values(p))
    # the model: the same tensor objects, tied as before, on the meta device (no memory)
    assert all(t.is_meta for t in synced_tensors(model).values())
    assert model.embed.weight is weight and model.head.weight is weight and model.norm.running_mean is mean
    assert not model.scale.is_meta and float(model.scale) == 2.0  # not synced: left as it is
    assert server.service.memory()["model"] == 0
    server.stop()  # never started: the model gets its values back
    assert model.embed.weight is weight and model.head.weight is model.embed.weight
    assert set(model.state_dict()) == set(before)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_at_the_stop_the_model_is_the_final_global_model_shared_not_copied(tmp_path):
    """A run with merges: the model given ends as the final model file says; a tensor the
    syncer holds whole in the model's dtype is the syncer's final value itself (no copy), a
    row-split one is written into new memory; the evaluate hook's copy is let go."""
    torch.manual_seed(0)
    model = Net()
    calls: list[bool] = []

    def evaluate(m: nn.Module) -> float:
        calls.append(all(bool(torch.isfinite(t).all()) for t in m.state_dict().values()))
        return 1.0

    def while_serving(server: ddiloco.SyncerServer) -> None:
        assert all(t.is_meta for t in synced_tensors(model).values())  # (the learners are joining)

    server = run_fleet(tmp_path / "run", cfg(f"run.processed_tokens={BUDGET}", "algo.num_fragments=4"),
                       serve=while_serving, model=model, evaluate=evaluate, eval_interval_s=0.05)  # fmt: skip
    core = server.service.core
    assert max(core.versions()) > 0 and calls and all(calls)  # merged; every evaluation saw a whole model
    final = ddiloco.load_state_dict(tmp_path / "run")
    state = model.state_dict()
    assert set(state) == set(final) and all(torch.equal(state[k], final[k]) for k in final)
    body = next(p for p in range(4) if core.layout.fragments[p][0].name == "body.weight")
    assert model.body.weight.untyped_storage().data_ptr() == core.values(body)[0].untyped_storage().data_ptr()
    assert model.embed.weight.untyped_storage().data_ptr() not in storages(core.values(0) + core.values(1))
    assert server.evaluation is not None and server.evaluation.held_bytes() == 0
    out = model(torch.randint(0, 32, (2, 6)))  # a usable module again
    assert out.shape == (2, 4) and torch.isfinite(out).all()


def test_a_model_another_syncer_server_holds_is_refused_in_one_line(tmp_path):
    model = BNNet()
    first = server_for(model, tmp_path / "a")
    with pytest.raises(UsageError, match=r"^model holds no values \(embed.weight is on the meta device; another"):
        server_for(model, tmp_path / "b", shard=1, num_shards=2)
    first.stop()
    second = server_for(model, tmp_path / "c")  # the first one stopped: the model holds values again
    second.stop()


def test_a_bf16_model_keeps_its_dtype_and_a_shard_gives_back_the_fragments_it_does_not_own(tmp_path):
    torch.manual_seed(0)
    model = BNNet().to(torch.bfloat16)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    server = server_for(model, tmp_path, shard=0, num_shards=2)
    assert all(t.is_meta for t in synced_tensors(model).values())
    assert server.service.memory()["unowned"] > 0  # the other shard's fragments, as version 0
    server.stop()
    state = model.state_dict()
    assert all(state[k].dtype == v.dtype and torch.equal(state[k], v) for k, v in before.items())


# -- the evaluate hook and the evaluator: built to receive, evaluated only whole -----------------


def stingy(real: Any, on: list[bool]) -> Any:
    """An ``AskShard`` whose answers carry no values of fragment 0 while ``on[0]``."""

    def ask(shard: int, request: FetchGlobal, moved: Moved) -> GlobalState | None:
        answer = real(shard, request, moved)
        if answer is None or not on[0]:
            return answer
        kept = {k: v for k, v in answer.tensors.items() if not k.startswith("0.")}
        return GlobalState(answer.versions, answer.merged_tokens, kept, answer.run_ended, answer.tokens_per_step)

    return ask


def exact(model: nn.Module, layout: Any, values: Any) -> bool:
    """Whether every fragment of ``model`` holds ``values(p)``."""
    params = synced_tensors(model)
    pairs = [
        (a, b) for p, pieces in enumerate(layout.fragments) for a, b in zip(read_fragment(params, pieces), values(p))
    ]
    return all(torch.equal(a, b) for a, b in pairs)


def test_the_hook_copies_no_values_and_never_evaluates_a_copy_not_every_fragment_was_written_into(tmp_path):
    pair = SessionPair()
    pair.tick()
    merge_one_round(pair)  # merged tokens past the first mark
    toy = Toy()  # (NaN values: a copy of them would show)
    on = [True]
    seen: list[bool] = []
    core = pair.syncer.core
    cadence = EvalCadence(1.0, 4, "fp32", "fp32")

    def fn(m: nn.Module) -> float:
        seen.append(exact(m, SESSION_LAYOUT, core.values))
        return 0.5

    hook = EvalHook(fn, toy, SESSION_LAYOUT, stingy(Observer(pair), on), tmp_path, 0.01, cadence, lambda: 1.0)
    assert not storages(synced_tensors(hook.model).values()) & storages(synced_tensors(toy).values())
    hook.start()
    try:
        time.sleep(0.3)  # polls and refreshes, fragment 0 never sent
        assert seen == [] and hook.copy.versions() == {"1": 1} and not hook.copy.complete
        on[0] = False
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        hook.stop()
    assert seen and all(seen)  # evaluated once whole, on the exact global model
    # the end-of-run path writes every fragment from the syncer's values itself, then lets the copy go
    fresh = EvalHook(fn, toy, SESSION_LAYOUT, stingy(Observer(pair), [True]), tmp_path, 0.01, cadence, lambda: 1.0)
    before = len(seen)

    def load(m: nn.Module) -> None:
        params = synced_tensors(m)
        for p, pieces in enumerate(SESSION_LAYOUT.fragments):
            write_fragment(params, pieces, core.values(p))

    fresh.final(load, 16.0, ended=True)
    assert len(seen) == before + 1 and seen[-1]
    assert fresh.held_bytes() > 0
    fresh.release()
    assert fresh.held_bytes() == 0


def test_an_evaluation_that_never_ends_does_not_hold_the_stop(tmp_path, monkeypatch):
    from ddiloco.service.syncer import eval_hook

    monkeypatch.setattr(eval_hook, "FINAL_WAIT_S", 0.2)
    pair = SessionPair()
    cadence = EvalCadence(1.0, 4, "fp32", "fp32")
    go = threading.Event()
    hook = EvalHook(lambda m: go.wait(10) and 1.0, Toy(), SESSION_LAYOUT, Observer(pair), tmp_path, 1.0, cadence, float)
    stuck = threading.Thread(target=hook.final, args=(lambda m: None, 0.0, False))  # an evaluation under way
    stuck.start()
    try:
        time.sleep(0.1)
        started = time.monotonic()
        hook.final(lambda m: None, 0.0, True)  # gives up after FINAL_WAIT_S
        hook.release()  # and so does not wait again
        assert time.monotonic() - started < 1.0 and hook.held_bytes() > 0  # (the evaluation keeps its copy)
    finally:
        go.set()
        stuck.join(10)


def test_the_evaluator_builds_its_model_empty_and_evaluates_only_a_whole_model(tmp_path, monkeypatch, caplog):
    from types import SimpleNamespace

    from ddiloco.config import load_config
    from ddiloco.service.ops import evaluator
    from ddiloco.training.layout import layout_for
    from ddiloco.workloads.config import load_workload

    cfg_ = load_config(None, [
        "workload.factory=ddiloco.workloads.synthetic:make_workload", "algo.num_fragments=4",
        "runtime.eval_interval_s=0.01", "runtime.eval_every_tokens=1000", "runtime.final_eval=false",
    ])  # fmt: skip
    wl = load_workload(cfg_.workload)
    layout = layout_for(wl.build_model(cfg_.run.seed), wl, cfg_.algo).fragments
    script = ScriptedSyncer(wl.build_model(cfg_.run.seed), layout, tokens=300.0, end_after=12)
    on = [True]

    def ask(shard: int, request: FetchGlobal, moved: Moved) -> GlobalState | None:
        answer = stingy(script, on)(shard, request, moved)
        if not request.versions_only:
            on[0] = False  # one refresh without fragment 0's values, then whole answers
        return answer

    monkeypatch.setattr(evaluator, "shard_asker", lambda syncers, keys: ask)
    seen: list[bool] = []

    def evaluate(wl_: Any, model: nn.Module, batches: Any) -> float:
        seen.append(exact(model, layout, lambda p: script.values[p]))
        return 0.25

    monkeypatch.setattr(evaluator, "evaluate", evaluate)
    signals = SimpleNamespace(requested=False)
    with caplog.at_level(logging.INFO, logger="ddiloco.service.ops.evaluator"):
        assert evaluator._evaluate_until_the_end(cfg_, ["tcp://h:1"], str(tmp_path), False, None, signals) == 0  # type: ignore[arg-type]
    assert "its model is given memory without initialisation" in caplog.text
    assert "not every fragment has come from the syncer yet: no evaluation" in caplog.text
    recs = [json.loads(line) for line in (tmp_path / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert seen and all(seen) and len(recs) == len(seen)
    assert recs[0]["merged_tokens"] == 1500.0  # the 1,200 mark's refresh lacked fragment 0: the next poll's


# -- the status shows it ---------------------------------------------------------------------------

PHASES = {"start", "serve", "final sync", "final model", "stop"}


def test_the_status_shows_what_is_held_beside_the_core_and_the_peak_with_its_phase(tmp_path, capsys):
    from ddiloco.cli import main
    from ddiloco.training.empty_model import synced_bytes

    torch.manual_seed(0)
    server = server_for(BNNet(), tmp_path, evaluate=lambda m: 1.0)
    mem = server.service.memory()
    assert mem["model"] == 0 and mem["eval_copy"] == synced_bytes(BNNet()) > 0 and mem["unowned"] == 0
    assert mem["rss_peak"] >= mem["rss"] > 0 and mem["rss_peak_in"] in PHASES
    server.serve(max_seconds=0.3, handle_signals=False)
    status = json.loads((tmp_path / "status" / "syncer-0.json").read_text())["memory"]
    assert {"held_values", "held_momentum", "unowned", "model", "eval_copy", "send_queued", "rss", "rss_peak"} <= set(
        status
    )
    assert status["eval_copy"] > 0 and status["model"] == 0 and status["rss_peak_in"] in PHASES
    assert main(["status", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "memory (shard 0): values " in shown and "evaluation copy " in shown and "(reached in: " in shown
    assert server.evaluation is not None and server.evaluation.held_bytes() == 0  # let go at the stop


def test_each_shards_memory_is_shown_apart():
    from ddiloco.service.ops.status_cmd import memory_line, merge_views

    mem = {"held_values": 4_000_000, "held_momentum": 0, "unowned": 2_000_000, "rss": 9_000_000}
    views = [{"shard": k, "memory": {**mem, "rss_peak": 10_000_000 + k, "rss_peak_in": "serve"}} for k in (0, 1)]
    line = memory_line(merge_views(views))
    assert line.splitlines() == [
        f"memory (shard {k}): values 4.0 MB, other shards' fragments 2.0 MB; resident 9.0 MB, peak 10.0 MB "
        "(reached in: serve)"
        for k in (0, 1)
    ]
    assert memory_line({"shard": 0}) == "memory: not reported"


def test_the_syncers_final_evaluation_builds_its_model_without_initialising_it(tmp_path, monkeypatch):
    from ddiloco.config import load_config
    from ddiloco.service.syncer import run_end
    from ddiloco.service.syncer import service as service_module
    from ddiloco.training.evaluate import evaluate
    from ddiloco.workloads.config import load_workload

    cfg_ = load_config(None, ["workload.factory=ddiloco.workloads.synthetic:make_workload", "algo.num_fragments=4"])
    net = InProcessNetwork()
    service, _ = service_module.open_syncer(
        cfg_, "inproc://f", tmp_path, transport=net.syncer("inproc://f"), fsync=False
    )
    built: list[Any] = []
    real = run_end.build_to_receive
    monkeypatch.setattr(run_end, "build_to_receive", lambda *a: built.append(real(*a)) or built[-1])
    try:
        service._final_eval()
    finally:
        service.serve(0.0)  # (closes it)
    assert len(built) == 1 and built[0].empty
    rec = json.loads((tmp_path / "metrics" / "eval.jsonl").read_text().splitlines()[-1])
    wl = load_workload(cfg_.workload)
    model = wl.build_model(cfg_.run.seed)  # version 0: the seed's build, as the syncer made it
    assert rec["final"] and rec["loss"] == evaluate(wl, model, wl.eval_batches())
