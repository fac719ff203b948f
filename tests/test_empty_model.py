"""A joining learner builds its model without initialising it (``training/empty_model.py``): the
join writes every synced tensor. Where the model does not allow that, it is built the ordinary
way, and why is said; the fragments a join that went quiet did not deliver take the ordinary
build's values (``Learner(initial=...)``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import FAST_RUNTIME
from torch import nn

import ddiloco
from ddiloco.config import load_config
from ddiloco.core.fragments import read_fragment
from ddiloco.core.messages import FragmentUpdate
from ddiloco.service.base.transport import InProcessNetwork
from ddiloco.service.base.wire import decode
from ddiloco.training.empty_model import build_to_receive
from ddiloco.training.layout import load_global, synced_tensors
from ddiloco.workloads.config import WorkloadConfig
from ddiloco.workloads.gpt import GPT, GPTConfig, build_gpt
from ddiloco.workloads.synthetic import SyntheticWorkload

torch.set_num_threads(1)
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


class Builds:
    """A workload as far as building its model goes."""

    def __init__(self, make: Any) -> None:
        self.make = make

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)  # (a user's factory may seed the global RNG: workloads/custom.py does)
        model: nn.Module = self.make()
        return model


class GPTWorkload:
    """The GPT workload's model (``workloads/text.py`` builds it so), small."""

    def build_model(self, seed: int) -> nn.Module:
        return build_gpt(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2), seed)


class Tied(nn.Module):
    """An LM head that shares the embedding, and BatchNorm's persistent statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.emb(x)))


class Masked(Tied):
    """A non-persistent buffer: the join would not write it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(8), persistent=False)


class Cached(Tied):
    """A tensor kept as a plain attribute: ``to_empty`` would leave it on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.ones(8)


class Eager(Tied):
    """Reads its own values while it is built: it cannot be built on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = float(self.emb.weight.norm().item())


def receive(model: nn.Module, source: nn.Module) -> None:
    """Write every synced tensor of ``source`` into ``model``, as a join does."""
    load_global(model, {n: t.detach().cpu() for n, t in synced_tensors(source).items()})


def test_the_gpt_is_built_without_its_initialisation(monkeypatch):
    def refuse(*_: Any) -> None:
        raise AssertionError("initialised a model the join overwrites")

    monkeypatch.setattr(GPT, "init_weights", refuse)
    rng = torch.random.get_rng_state()
    built = build_to_receive(GPTWorkload(), 0, "cpu")
    assert built.empty and built.how == "empty" and built.why == ""
    assert torch.equal(torch.random.get_rng_state(), rng)  # nothing drawn either


@pytest.mark.parametrize("device", DEVICES)
def test_after_the_join_an_empty_model_computes_what_a_built_one_does(device):
    wl = GPTWorkload()
    built = build_to_receive(wl, 0, device)
    assert built.empty
    tensors = [*built.model.parameters(), *built.model.buffers()]
    assert tensors and all(t.device.type == device for t in tensors)
    reference = wl.build_model(0)
    receive(built.model, reference)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(built.model(idx.to(device)).cpu(), reference.to(device)(idx.to(device)).cpu())


def test_the_scale_workload_is_built_empty_with_its_buffers():
    cfg = WorkloadConfig(factory="ddiloco.workloads.synthetic:make_workload", options={"hidden": 8, "batchnorm": True})
    wl = SyntheticWorkload(cfg)
    built = build_to_receive(wl, 3, "cpu")
    assert built.empty
    reference = wl.build_model(3)
    receive(built.model, reference)
    for model in (built.model, reference):
        model.train()  # BatchNorm's running statistics are read and written
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(built.model(x), reference(x))
    assert set(synced_tensors(built.model)) == set(synced_tensors(reference))


def test_tied_tensors_stay_tied():
    built = build_to_receive(Builds(Tied), 0, "cpu")
    assert built.empty
    model = built.model
    assert isinstance(model, Tied) and model.head.weight is model.emb.weight
    assert list(synced_tensors(model)) == list(synced_tensors(Tied()))
    reference = Builds(Tied).build_model(0)
    receive(model, reference)
    model.eval(), reference.eval()
    x = torch.arange(10)
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (Masked, "buffer mask is not persistent"),
        (Cached, "the model.scale is a tensor outside its parameters and buffers"),
        (Eager, "it does not build on the meta device"),
    ],
)
def test_a_model_the_join_would_not_fill_is_built_and_says_why(make, why, caplog):
    caplog.set_level("INFO", logger="ddiloco")
    built = build_to_receive(Builds(make), 5, "cpu")
    assert not built.empty and built.how == "initialised" and why in built.why
    assert why in caplog.text
    expected = Builds(make).build_model(5)  # the ordinary build, the same seed: the same values
    got, want = synced_tensors(built.model), synced_tensors(expected)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert all(not t.is_meta for t in [*built.model.parameters(), *built.model.buffers()])


def test_a_model_a_workload_builds_with_values_is_built_the_ordinary_way():
    values = Builds(Tied).build_model(0)
    built = build_to_receive(Builds(lambda: values), 0, "cpu")  # (a given module, as workload_from's)
    assert not built.empty and "not on the meta device" in built.why


# -- a join that went quiet --------------------------------------------------------------------------


class Quiet:
    """A learner's transport that never delivers fragment ``lost`` of the join."""

    def __init__(self, inner: Any, lost: int) -> None:
        self.inner, self.lost = inner, lost

    def recv(self, timeout_s: float) -> list[Any]:
        out = []
        for link, frames in self.inner.recv(timeout_s):
            msg = decode(frames)
            if not (isinstance(msg, FragmentUpdate) and msg.fragment == self.lost):
                out.append((link, frames))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_fragments_a_join_did_not_deliver_take_the_initial_values(tmp_path):
    address = "inproc://empty-model"
    cfg = load_config(None, ["run.num_learners=1", "algo.num_fragments=2", *FAST_RUNTIME, "runtime.join_timeout_s=1.0"])
    net = InProcessNetwork()
    torch.manual_seed(0)
    global_model = Tied()
    version_0 = {k: v.detach().clone() for k, v in synced_tensors(global_model).items()}  # (the server takes them)
    server = ddiloco.SyncerServer(
        global_model, address, tmp_path, config=cfg, transport=net.syncer(address), fsync=False
    )
    server.start()
    initial = Builds(Tied).build_model(7)  # what this learner's own build would hold
    built = build_to_receive(Builds(Tied), 7, "cpu")
    assert built.empty
    try:
        learner = ddiloco.Learner(
            built.model, address, config=cfg, transport=lambda a, i: Quiet(net.learner(a, i), lost=1),
            initial=lambda: Builds(Tied).build_model(7),
        )  # fmt: skip
        try:
            assert learner.session is not None and learner.session.received == {0}
            mine = synced_tensors(built.model)
            pieces = learner.pieces
            received = zip(read_fragment(mine, pieces[0]), read_fragment(version_0, pieces[0]))
            assert all(torch.equal(got, want) for got, want in received)  # the global model's
            lacking = zip(read_fragment(mine, pieces[1]), read_fragment(synced_tensors(initial), pieces[1]))
            assert all(torch.equal(got, want) for got, want in lacking)  # the ordinary build's
        finally:
            learner.close()
    finally:
        server.stop()


def test_ddiloco_learner_builds_the_model_it_joins_with_empty(tmp_path):
    from ddiloco.service.base.status import read_status
    from ddiloco.service.learner.process import LearnerProcess

    synthetic = ["workload.factory=ddiloco.workloads.synthetic:make_workload", "workload.options={hidden = 8}"]
    cfg = load_config(None, synthetic)
    joining = LearnerProcess(cfg, ["inproc://nobody"], 0, tmp_path / "a")
    alone = LearnerProcess(cfg, [], 0, tmp_path / "b")  # --standalone: nothing will write its values
    assert joining.empty and joining.startup.who["model"] == "empty"
    assert not alone.empty and alone.startup.who["model"] == "initialised"
    joining.write_status(), alone.write_status()  # (what a learner whose join failed writes)
    status = read_status(tmp_path / "a" / "status" / "learner-0.json")
    assert status is not None and status["param_checksum"] is None  # no sum of unwritten memory
    status = read_status(tmp_path / "b" / "status" / "learner-0.json")
    assert status is not None and isinstance(status["param_checksum"], float)
