"""The library API (``ddiloco.Learner``, ``ddiloco.SyncerServer``, ``workload_from``, exports):
a user's own model, optimizer and batch structure, in one process over the in-process network,
on loopback, in a 2-rank torchrun group, and its misuse errors. Bounded in time; progress is
asserted, never durations."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import FAST_RUNTIME, merges, wait_for
from torch import nn

import ddiloco
from ddiloco.config import load_config
from ddiloco.report.tape import read_jsonl
from ddiloco.service.base.transport import InProcessNetwork

ROOT = Path(__file__).resolve().parents[1]
ADDRESS = "inproc://library-syncer"
SETTINGS = [
    "algo.sync_every=8",
    *FAST_RUNTIME,
    "runtime.join_timeout_s=10.0",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "src")}


class DictNet(nn.Module):
    """A user's model that takes a dict batch (like a Hugging Face model)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(batch["input_ids"]).mean(1))))


def make_batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 32, (8, 6), generator=g)
    return {"input_ids": ids, "labels": ids[:, 0] % 4}


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch), batch["labels"])


def cfg(*extra: str):
    return load_config(None, [*SETTINGS, *extra])


def train(learner: ddiloco.Learner, model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """The user's loop: their own optimizer, a dict batch, then ``learner.step``."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = make_batch(g)
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        learner.step(tokens=batch["input_ids"].numel())
        time.sleep(0.01)  # a stand-in for a real step's compute


@pytest.fixture
def fleet(tmp_path):
    """A syncer on an in-process network (a thread), torn down by the test's end."""
    torch.set_num_threads(1)
    net = InProcessNetwork()
    torch.manual_seed(0)
    server = ddiloco.SyncerServer(
        DictNet(), ADDRESS, tmp_path, config=cfg(), transport=net.syncer(ADDRESS), fsync=False
    ).start()
    yield net, server, tmp_path
    server.stop()


def test_two_learners_with_sgd_momentum_and_dict_batches_merge_in_one_process(fleet):
    net, server, run_dir = fleet
    learners: dict[int, ddiloco.Learner] = {}
    errors: list[BaseException] = []

    def run(m: int) -> None:
        try:
            torch.manual_seed(100 + m)  # each learner's own init: the join overwrites it with the global one
            model = DictNet()
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            with ddiloco.Learner(
                model, ADDRESS, learner_id=m, config=cfg(), optimizer=opt, transport=net.learner
            ) as learner:
                learners[m] = learner
                assert all(v == 0 for v in learner.versions)  # joined: every fragment's version 0 taken
                train(learner, model, opt, 120, seed=m)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(m,)) for m in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    merged = {e.learner for r in merges(run_dir) for e in r.took_part}
    assert merged == {0, 1}
    for ln in learners.values():
        assert ln.closed and ln.stats.steps == 120 and ln.stats.applied > 0
        assert ln.data_position == 120
        assert ln.fleet_tokens >= ln.stats.tokens  # the fleet's position, not only its own
        assert 0 < ln.stats.sync_s < ln.stats.step_s
        # its own answers were merged: the start-up phases say when the first one came back
        assert ln.startup.phases["first_step"] <= ln.startup.phases["first_merged"]


@pytest.mark.slow  # a real service run in threads, for several seconds
def test_a_restarted_learner_takes_a_peers_optimizer_state_and_its_data_position(fleet):
    net, server, run_dir = fleet
    model0 = DictNet()
    opt0 = torch.optim.SGD(model0.parameters(), lr=0.05, momentum=0.9)
    first = ddiloco.Learner(model0, ADDRESS, learner_id=0, config=cfg(), optimizer=opt0, transport=net.learner)
    model1 = DictNet()
    opt1 = torch.optim.SGD(model1.parameters(), lr=0.05, momentum=0.9)
    second = ddiloco.Learner(model1, ADDRESS, learner_id=1, config=cfg(), optimizer=opt1, transport=net.learner)
    peer = threading.Thread(target=train, args=(first, model0, opt0, 400, 0))
    peer.start()
    try:
        train(second, model1, opt1, 60, seed=1)
        wait_for(lambda: any(e.learner == 1 for r in merges(run_dir) for e in r.took_part), 60, "a merge of 1")
        second.close()
        # The restarted process: a fresh model and optimizer, the same id.
        model2 = DictNet()
        opt2 = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9)
        again = ddiloco.Learner(model2, ADDRESS, learner_id=1, config=cfg(), optimizer=opt2, transport=net.learner)
        assert again.data_position > 0  # where the syncer recorded its last merged contribution
        # It never steps its optimizer here: any momentum it has came from the live peer.
        deadline = time.monotonic() + 60
        while not opt2.state and time.monotonic() < deadline:
            again.step(tokens=48)
            time.sleep(0.02)
        again.close()
    finally:
        peer.join(timeout=120)
        first.close()
    assert opt2.state, "no optimizer state arrived from the live peer"
    bufs = [s["momentum_buffer"] for s in opt2.state.values()]
    assert len(bufs) == len(list(model2.parameters())) and all(torch.isfinite(b).all() for b in bufs)


def test_standalone_learner_needs_no_syncer():
    model = DictNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with ddiloco.Learner(model, config=ddiloco.DiLoCoConfig(sync_every=4)) as learner:
        train(learner, model, opt, 5, seed=0)
        assert learner.data_position == 5 and learner.stats.steps == 5
        assert learner.fleet_tokens == 5 * 48  # alone, the fleet is this learner
        learner.step(tokens=0, data_position=42)
        assert learner.data_position == 42


def test_misuse_gives_one_clear_error(fleet, tmp_path):
    net, server, _ = fleet
    model = DictNet()
    learner = ddiloco.Learner(model, ADDRESS, learner_id=0, config=cfg(), transport=net.learner)
    with pytest.raises(ddiloco.UsageError, match="tokens must be an integer"):
        learner.step(tokens=-1)
    with pytest.raises(ddiloco.UsageError, match="tokens must be an integer"):
        learner.step(tokens=2.5)  # type: ignore[arg-type]
    model.head = nn.Linear(16, 5)  # the model changed under the learner
    with pytest.raises(ddiloco.UsageError, match="model changed after the Learner was made: module head is a new"):
        learner.step(tokens=1)
    learner.close()
    learner.close()  # idempotent
    with pytest.raises(ddiloco.UsageError, match=r"step\(\) after close\(\)"):
        learner.step(tokens=1)
    with pytest.raises(ddiloco.UsageError, match="is closed"):
        learner.__enter__()
    # a layout different from the syncer's (another P): refused by the syncer, naming the setting
    with pytest.raises(ddiloco.RefusedError, match="algo.num_fragments is 1 on this learner and 'auto' on the syncer"):
        ddiloco.Learner(DictNet(), ADDRESS, learner_id=1, config=cfg("algo.num_fragments=1"), transport=net.learner)
    # a different model: refused, naming the first tensor that differs
    other = nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(ddiloco.RefusedError, match="does not match the syncer's fragment layout: tensor #0"):
        ddiloco.Learner(other, ADDRESS, learner_id=2, config=cfg(), transport=net.learner)
    # no key off this machine
    with pytest.raises(ddiloco.DDiLoCoError, match="is not on this machine: pass the keys folder"):
        ddiloco.Learner(DictNet(), "tcp://10.9.8.7:5555", learner_id=3, config=cfg())
    # a syncer makes its own keys by default (so it is never keyless off this machine); an address
    # it cannot bind is one line
    with pytest.raises(ddiloco.DDiLoCoError, match="cannot bind the syncer to tcp://10.9.8.7:5555"):
        ddiloco.SyncerServer(DictNet(), "tcp://10.9.8.7:5555", tmp_path / "s", config=cfg())
    assert (tmp_path / "s" / "keys" / "syncer.key_secret").is_file()
    for kwargs, text in (
        ({"learner_id": -1}, "learner_id = -1 is out of range"),
        ({"config": {"sync_every": 3}}, "config must be a ddiloco Config"),
        ({"join_timeout_s": 0}, "join_timeout_s = 0 is out of range"),
    ):
        with pytest.raises(ddiloco.UsageError, match=text):
            ddiloco.Learner(DictNet(), None, **kwargs)
    with pytest.raises(ddiloco.UsageError, match="not a ZeroMQ address"):
        ddiloco.Learner(DictNet(), "localhost:5555")
    with pytest.raises(ddiloco.UsageError, match="must be a torch.nn.Module"):
        ddiloco.Learner(lambda x: x)  # type: ignore[arg-type]


def test_dtensor_parameters_other_than_fsdp2_shards_are_refused_with_the_reason():
    """FSDP2 shards parameters as Shard(0) DTensors (supported); other placements are refused."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already up")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Linear(4, 4)
        model.weight = nn.Parameter(DTensor.from_local(model.weight.detach(), mesh, [Shard(1)]))
        with pytest.raises(ddiloco.UsageError, match="supports FSDP2's Shard.0."):
            ddiloco.Learner(model)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    from ddiloco.service.ops.launcher import free_port

    return free_port("127.0.0.1")


@pytest.mark.slow  # spawns processes
def test_the_readme_snippet_runs_as_written_against_a_loopback_syncer(tmp_path):
    """The README's "Turn your training script into a learner" code, run as written; only the
    syncer's port is replaced by the one the test's syncer got."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Turn your training script into a learner") :]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    syncer_code, learner_code = blocks[0], blocks[1]
    assert syncer_code.count("tcp://127.0.0.1:5555") == 1 and learner_code.count("tcp://127.0.0.1:5555") == 1
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    syncer = subprocess.Popen(
        [sys.executable, "-c", syncer_code.replace("tcp://127.0.0.1:5555", address)],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: (tmp_path / "runs" / "readme" / "status" / "syncer-0.json").exists(), 60, "the syncer")
        learner = subprocess.run(
            [sys.executable, "-c", learner_code.replace("tcp://127.0.0.1:5555", address)],
            cwd=tmp_path,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert learner.returncode == 0, learner.stderr[-3000:]
        # The run ends by itself, as written (its budget, then the final sync); the syncer would then
        # answer RunEnd for runtime.end_linger_s (60 s): a stop ends that early, as a supervisor's would.
        runlog = tmp_path / "runs" / "readme" / "metrics" / "run.jsonl"
        wait_for(lambda: any(r.get("what") == "end" for r in read_jsonl(runlog)), 120, "the run's end")
        syncer.terminate()
        out, _ = syncer.communicate(timeout=120)
    finally:
        if syncer.poll() is None:
            syncer.terminate()
            out, _ = syncer.communicate(timeout=60)
    assert syncer.returncode == 0, out[-3000:]
    ends = [r for r in read_jsonl(tmp_path / "runs" / "readme" / "metrics" / "run.jsonl") if r.get("what") == "end"]
    assert ends and "run.processed_tokens" in ends[-1]["reason"], out[-3000:]
    final = ddiloco.load_state_dict(tmp_path / "runs" / "readme")
    assert set(final) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(torch.isfinite(t).all() for t in final.values())
    assert merges(tmp_path / "runs" / "readme"), "no contribution of the README's learner was merged"


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.slow  # spawns processes
def test_a_two_rank_torchrun_learner_with_ddp_or_fsdp2(tmp_path, mode):
    """One learner = 2 ranks with DDP or FSDP2 (fully_shard, gloo on CPU); rank 0 talks to the
    syncer; every rank takes the global model on join and applies the same fragments."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    initial = DictNet()
    expected = {k: v.detach().clone() for k, v in initial.state_dict().items()}
    # keyed, as by default: the worker (another process) is given the syncer's keys folder
    server = ddiloco.SyncerServer(initial, "tcp://127.0.0.1:*", tmp_path / "syncer", config=cfg(), fsync=False)
    server.start()
    assert server.keys is not None
    try:
        out = subprocess.run(
            [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                str(ROOT / "tests" / "library_ddp_worker.py"), server.address, str(tmp_path), mode,
                str(server.keys), *SETTINGS,
            ],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=240,
        )  # fmt: skip
    finally:
        server.stop()
    assert out.returncode == 0, out.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for r in ranks:  # both ranks started from different inits: the join wrote the global model on each
        for name, value in expected.items():
            assert torch.equal(r["joined"][name], value), name
    # rank 0 also counts the join's fetch; both then applied the same merged versions
    assert ranks[1]["applied"] > 0 and ranks[0]["versions"] == ranks[1]["versions"] and max(ranks[1]["versions"]) > 0
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name
    assert merges(tmp_path / "syncer"), "the group's contributions were never merged (shapes refused?)"
    assert ranks[0]["fleet_tokens"] == ranks[1]["fleet_tokens"] > 0


def test_workload_from_runs_a_users_model_in_the_simulator_deterministically():
    from ddiloco.sim.run import simulate

    g = torch.Generator().manual_seed(0)
    batches = [make_batch(g) for _ in range(64)]
    torch.manual_seed(0)
    wl = ddiloco.workload_from(DictNet(), loss_of, batches, eval_batches=batches[:4])
    sim_cfg = load_config(
        None, ["run.num_learners=2", "run.processed_tokens=4800", "run.eval_points=1", "algo.sync_every=4"]
    )
    a, b = simulate(sim_cfg, wl), simulate(sim_cfg, wl)
    assert math.isfinite(a.final_loss) and a.final_loss == b.final_loss
    # the syncer ends the run when the learners' reports reach the budget: their steps under way finish
    assert a.tokens_processed == b.tokens_processed >= 4800 and a.tokens_merged > 0
    assert wl.is_embedding_like("embed.weight") and not wl.is_embedding_like("head.weight")
    with pytest.raises(ddiloco.UsageError, match="one-shot iterator"):
        ddiloco.workload_from(DictNet(), loss_of, iter(batches)).train_stream(0, 2, 0)


def test_export_writes_tied_weights_loadably(tmp_path):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.wte.weight

    model = Tied()
    path = ddiloco.save_state_dict(model.state_dict(), tmp_path / "m.safetensors")
    back = ddiloco.load_state_dict(path)
    assert torch.equal(back["wte.weight"], back["head.weight"])
    fresh = Tied()
    fresh.load_state_dict(back)
    assert torch.equal(fresh.head.weight, model.wte.weight)
    out = ddiloco.export_model(Tied(), {"wte.weight": model.wte.weight.detach()}, tmp_path / "out")
    assert torch.equal(ddiloco.load_state_dict(out / "model.safetensors")["head.weight"], model.wte.weight)
    with pytest.raises(ddiloco.DDiLoCoError, match="does not exist"):
        ddiloco.load_state_dict(tmp_path / "nowhere")


@pytest.mark.slow  # spawns processes
def test_plain_loop_example_trains_alone():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plain_loop.py"), "--syncer", "none", "--steps", "200"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "learner 0: loss" in out.stdout


@pytest.mark.slow  # spawns processes
def test_hf_example_end_to_end_two_learners_a_syncer_and_an_export(tmp_path):
    """examples/hf_causal_lm.py for a few steps: a transformers model from a config, byte-level
    text through the text workload, two learner processes and a syncer, save_pretrained."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("ddiloco.workloads.text")
    import random

    rng = random.Random(0)
    words = "the of and to a in that is was he for it with as his on be at by this had not are but".split()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words) for _ in range(10)) + "." for _ in range(4000)))
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable, str(ROOT / "examples" / "hf_causal_lm.py"), "--text", str(corpus), "--run-dir",
            str(run_dir), "--steps", "60", "--sync-every", "8",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    loss = float(re.search(r"eval loss \(nats/byte\): ([0-9.]+)", out.stdout).group(1))
    assert 0 < loss < math.log(256)  # better than uniform bytes
    assert {e.learner for r in merges(run_dir) for e in r.took_part} == {0, 1}
    exported = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    final = ddiloco.load_state_dict(run_dir)
    for name, value in exported.state_dict().items():
        assert torch.equal(value, final[name]), name


def test_the_lazy_and_the_eager_api_export_the_same_objects():
    import ddiloco
    import ddiloco.api as api

    assert sorted(ddiloco.__all__) == sorted(api.__all__)
    assert all(getattr(ddiloco, name) is getattr(api, name) for name in api.__all__)


def test_the_api_reference_lists_every_public_member(tmp_path):
    """docs/library.md's API reference names every public member of the classes it covers."""
    text = (ROOT / "docs" / "library.md").read_text()
    reference = text[text.index("## API reference") :]
    learner = ddiloco.Learner(DictNet())
    server = ddiloco.SyncerServer(DictNet(), "inproc://reference", tmp_path, transport=InProcessNetwork().syncer("x"))
    for obj in (learner, learner.stats, server):
        for name in (n for n in dir(obj) if not n.startswith("_")):
            assert f"`{name}" in reference, f"{type(obj).__name__}.{name} is not in docs/library.md's API reference"
    server.stop()
