"""The vision workload: Fashion-MNIST from the Debian package, shards and streams, the BatchNorm CNN
and the MLP-Mixer.

The tests that read the real data skip when it is not installed, with the install line as the
reason, except under CI (``.ci/run`` exports ``DDILOCO_CI=1``), where they fail: CI installs
the package, so a missing dataset there is a broken set-up, not a machine without it.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from ddiloco.errors import ConfigError, DataError
from ddiloco.training.evaluate import evaluate
from ddiloco.workloads.base import Batch, DataStream, Workload
from ddiloco.workloads.config import WorkloadConfig, load_workload
from ddiloco.workloads.vision import (
    DEFAULT_PATH,
    FILES,
    INSTALL,
    SmallCNN,
    VisionOptions,
    VisionWorkload,
    build_cnn,
    load_fashion_mnist,
    read_idx,
)
from ddiloco.workloads.vision_mixer import SmallMixer, build_mixer

torch.set_num_threads(1)

VISION = "ddiloco.workloads.vision:make_workload"
HAVE_DATA = all((Path(DEFAULT_PATH) / f"{name}.gz").is_file() for name in FILES)
needs_data = pytest.mark.skipif(
    not HAVE_DATA and not os.environ.get("DDILOCO_CI"),
    reason=f"Fashion-MNIST is not installed: {INSTALL}",
)


def _workload(batch_size: int = 64, **kw: object) -> VisionWorkload:
    options = kw.pop("options", {})
    cfg = WorkloadConfig(factory=VISION, batch_size=batch_size, options=options, **kw)  # type: ignore[arg-type]
    wl = load_workload(cfg)
    assert isinstance(wl, VisionWorkload)
    return wl


def _same(a: Batch, b: Batch) -> bool:
    return torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets) and a.tokens == b.tokens


# ---------------------------------------------------------------------------- the data


def test_ci_has_the_data() -> None:
    """Under CI the data-reading tests run rather than skip; this one names the cause first."""
    if not os.environ.get("DDILOCO_CI"):
        pytest.skip("not under CI (DDILOCO_CI unset)")
    assert HAVE_DATA, f"CI must install Fashion-MNIST ({INSTALL}); {DEFAULT_PATH} lacks its files"


@needs_data
def test_the_loader_reads_the_real_files() -> None:
    d = load_fashion_mnist()
    assert d.train_images.shape == (60000, 28, 28) and d.train_images.dtype == np.uint8
    assert d.train_labels.shape == (60000,) and d.test_images.shape == (10000, 28, 28)
    assert d.test_labels.shape == (10000,)
    for labels in (d.train_labels, d.test_labels):
        assert set(np.unique(labels).tolist()) == set(range(10))
    assert np.bincount(d.train_labels).tolist() == [6000] * 10  # Fashion-MNIST is balanced
    assert not d.train_images.flags.writeable  # shared by in-process learners: read-only


def test_missing_data_is_one_line_with_the_install_command(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        load_workload(WorkloadConfig(factory=VISION, options={"path": str(tmp_path)}))
    assert str(info.value) == (
        f"Fashion-MNIST not found: {tmp_path} has no train-images-idx3-ubyte.gz; install it with "
        "`sudo apt-get update && sudo apt-get install dataset-fashion-mnist`, or set workload.options.path "
        "to a folder with the four IDX files"
    )


def _write_idx(path: Path, array: np.ndarray, gz: bool = True) -> None:
    header = bytes([0, 0, 8, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    raw = header + array.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(path.with_name(path.name + ".gz"), "wb") as f:
            f.write(raw)
    else:
        path.write_bytes(raw)


def _small_dataset(folder: Path) -> None:
    """40 random 28x28 training images and the first 12 of them as the test set."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (40, 28, 28))
    labels = np.arange(40) % 10
    _write_idx(folder / FILES[0], images)
    _write_idx(folder / FILES[1], labels, gz=False)
    _write_idx(folder / FILES[2], images[:12])
    _write_idx(folder / FILES[3], labels[:12])


def test_a_folder_of_small_idx_files_works_gzipped_or_not(tmp_path: Path) -> None:
    _small_dataset(tmp_path)
    labels = np.arange(40) % 10
    wl = _workload(batch_size=8, eval_windows=12, options={"path": str(tmp_path)})
    assert np.array_equal(wl.data.train_labels, labels)
    assert sum(b.tokens for b in wl.eval_batches()) == 12
    with pytest.raises(ConfigError, match="more than the 12 test images"):
        _workload(eval_windows=13, options={"path": str(tmp_path)})


def test_a_corrupt_idx_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "x-idx1-ubyte"
    bad.write_bytes(b"\x00\x00\x0d\x01\x00\x00\x00\x02ab")  # type 0x0d: floats
    with pytest.raises(DataError, match="not an IDX file of unsigned bytes"):
        read_idx(bad)
    bad.write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x05ab")
    with pytest.raises(DataError, match="header says"):
        read_idx(bad)


@needs_data
def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"\['layers'\] unknown to the vision workload"):
        _workload(options={"layers": 3})
    with pytest.raises(ConfigError, match="width must be an integer"):
        _workload(options={"width": 0})
    with pytest.raises(ConfigError, match="norm = 'layer' is unknown"):
        _workload(options={"norm": "layer"})
    with pytest.raises(ConfigError, match="full_test must be true or false"):
        _workload(options={"full_test": 1})
    with pytest.raises(ConfigError, match="eval_windows = 20000 is more than the 10000 test images"):
        _workload(eval_windows=20000)


# ---------------------------------------------------------------------------- shards and streams


@needs_data
def test_shards_are_disjoint_cover_the_training_set_and_are_deterministic() -> None:
    wl = _workload(batch_size=100)
    seen = []
    for shard in range(3):
        stream = wl.train_stream(shard, 3, seed=5)
        assert isinstance(stream, DataStream)
        assert len(stream.examples) == 20000
        seen.append(set(stream.examples.tolist()))
        again = wl.train_stream(shard, 3, seed=5)
        assert all(_same(stream.next_batch(), again.next_batch()) for _ in range(3))
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert set().union(*seen) == set(range(60000))
    other_seed = wl.train_stream(0, 3, seed=6).next_batch()
    assert not _same(wl.train_stream(0, 3, seed=5).next_batch(), other_seed)


@needs_data
def test_an_epoch_visits_every_example_once_and_the_next_is_reshuffled() -> None:
    wl = _workload(batch_size=1000)
    stream = wl.train_stream(1, 4, seed=0)  # 15,000 examples: 15 batches an epoch
    epoch0 = np.concatenate([stream.indices(k) for k in range(15)])
    epoch1 = np.concatenate([stream.indices(k) for k in range(15, 30)])
    assert np.array_equal(np.sort(epoch0), stream.examples) and np.array_equal(np.sort(epoch1), stream.examples)
    assert not np.array_equal(epoch0, epoch1)
    batch = stream.next_batch()
    assert torch.equal(batch.targets, torch.from_numpy(wl.data.train_labels[epoch0[:1000]].astype(np.int64)))
    pixels = wl.data.train_images[epoch0[:1000]].astype(np.float32) / 255.0
    assert torch.allclose(batch.inputs[:, 0] * 0.3530 + 0.2860, torch.from_numpy(pixels), atol=1e-5)


@needs_data
def test_seek_resumes_exactly_across_an_epoch_boundary() -> None:
    wl = _workload(batch_size=7000)
    a = wl.train_stream(0, 4, seed=3)  # 15,000 examples: batch 2 straddles epochs 0 and 1
    batches = [a.next_batch() for _ in range(5)]
    b = wl.train_stream(0, 4, seed=3)
    b.seek(2)
    assert b.position == 2 and _same(b.next_batch(), batches[2])
    b.seek(4)
    assert _same(b.next_batch(), batches[4])
    b.seek(1)  # back to an epoch no longer cached
    assert _same(b.next_batch(), batches[1]) and b.position == 2
    with pytest.raises(DataError, match="positions are >= 0"):
        b.seek(-1)
    assert batches[0].inputs.shape == (7000, 1, 28, 28) and batches[0].inputs.dtype == torch.float32
    assert batches[0].targets.dtype == torch.int64 and batches[0].tokens == 7000


@needs_data
def test_eval_set_is_fixed_nested_and_chunked() -> None:
    small, large = _workload(eval_windows=100), _workload(eval_windows=1000, batch_size=3)
    assert [b.tokens for b in small.eval_batches()] == [32, 32, 32, 4]  # whatever batch_size is
    assert set(small.eval_indices().tolist()) <= set(large.eval_indices().tolist())
    assert all(_same(x, y) for x, y in zip(small.eval_batches(), _workload(eval_windows=100).eval_batches()))
    full = _workload(options={"full_test": True})
    assert sum(b.tokens for b in full.eval_batches()) == 10000


# ---------------------------------------------------------------------------- the model


def test_the_cnn_has_batchnorm_buffers_and_a_deterministic_init() -> None:
    state = torch.get_rng_state()
    a, b, c = build_cnn(7), build_cnn(7), build_cnn(8)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is untouched
    buffers = dict(a.named_buffers())
    assert set(buffers) == {
        f"bn{i}.{n}" for i in (1, 2) for n in ("running_mean", "running_var", "num_batches_tracked")
    }
    assert torch.equal(buffers["bn1.running_var"], torch.ones(16)) and int(buffers["bn2.num_batches_tracked"]) == 0
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["conv1.weight"], sc["conv1.weight"])
    assert 15_000 < sum(p.numel() for p in a.parameters()) < 25_000
    plain = SmallCNN(width=8, norm="none")
    assert not list(plain.buffers()) and plain.conv1.bias is not None
    assert a(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


@needs_data
def test_the_workload_meets_the_contract() -> None:
    wl = _workload()
    assert isinstance(wl, Workload) and wl.loss_unit == "nats/example"
    model = wl.build_model(0)
    assert not any(wl.is_embedding_like(name) for name, _ in model.named_parameters())
    loss = wl.loss(model, wl.train_stream(0, 2, 0).next_batch())
    assert abs(loss.item() - np.log(10)) < 1.0  # about uniform at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@needs_data
def test_plain_adam_training_learns_and_eval_uses_running_statistics() -> None:
    wl = _workload(batch_size=64, eval_windows=1000)
    model = wl.build_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    stream = wl.train_stream(0, 1, seed=0)
    model.train()
    for _ in range(150):
        loss = wl.loss(model, stream.next_batch())
        opt.zero_grad()
        loss.backward()
        opt.step()
    batches = wl.eval_batches()
    acc = wl.accuracy(model, batches)
    assert model.training  # accuracy() restored the mode
    assert acc > 0.70, acc
    eval_loss = evaluate(wl, model, batches)  # the runtimes' evaluation: model.eval() first
    assert eval_loss < 0.8, eval_loss
    assert int(model.bn1.num_batches_tracked) == 150
    # Running statistics matter: the same weights with fresh BatchNorm buffers score far worse
    # (measured: 0.89 nats/example against 0.48), which is why buffers must reach the global model.
    fresh = wl.build_model(0)
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if "running" not in k}, strict=False)
    assert evaluate(wl, fresh, batches) > 1.5 * eval_loss


@needs_data
def test_the_example_config_builds_its_workload() -> None:
    from ddiloco.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "vision.toml").validate()
    wl = load_workload(cfg.workload)
    assert isinstance(wl, VisionWorkload) and cfg.run.num_learners == 4
    assert sum(b.tokens for b in wl.eval_batches()) == cfg.workload.eval_windows


@needs_data
def test_the_cnn_in_the_simulator_carries_its_batchnorm_statistics_into_the_global_model():
    """The same CNN in the simulator: the global model's running statistics are the merged
    ones, so the final model, loaded strictly into a fresh CNN, scores what the run reported;
    with fresh statistics it scores far worse."""
    from ddiloco.config import load_config
    from ddiloco.sim.run import simulate
    from ddiloco.training.layout import load_global

    torch.set_num_threads(1)
    settings = [
        "workload.factory=ddiloco.workloads.vision:make_workload",
        "workload.batch_size=32",
        "workload.eval_windows=500",
        "run.num_learners=2",
        "run.processed_tokens=6400",
        "run.eval_points=1",
        "algo.sync_every=8",
        "inner.lr=0.003",
    ]
    cfg = load_config(None, settings)
    wl = load_workload(cfg.workload)
    result = simulate(cfg, wl)
    counts = [k for k in result.state if k.endswith("num_batches_tracked")]
    assert counts and all(float(result.state[k]) > 0 for k in counts)
    model = wl.build_model(0)
    load_global(model, result.state)
    batches = wl.eval_batches()
    assert evaluate(wl, model, batches) == pytest.approx(result.final_loss, rel=1e-5)
    assert wl.accuracy(model, batches) > 0.6
    fresh = wl.build_model(0)
    kept = {k: v for k, v in result.state.items() if "running" not in k and "num_batches" not in k}
    fresh.load_state_dict(kept, strict=False)
    assert evaluate(wl, fresh, batches) > 1.2 * result.final_loss


# ---------------------------------------------------------------------------- the MLP-Mixer


def test_the_mixer_options_are_validated(tmp_path: Path) -> None:
    assert VisionOptions.from_dict({}).model == "cnn"  # the default: nothing existing changes
    opts = VisionOptions.from_dict({"model": "mixer", "patch": 4, "dim": 32, "depth": 2})
    assert (opts.model, opts.patch, opts.dim, opts.depth) == ("mixer", 4, 32, 2)
    bad = [
        ({"model": "vit"}, r"model = 'vit' is unknown; allowed: \['cnn', 'mixer'\]"),
        ({"model": "mixer", "width": 8}, r"\['width'\] apply to model = 'cnn' only, not 'mixer'"),
        ({"patch": 4}, r"\['patch'\] apply to model = 'mixer' only, not 'cnn'"),
        ({"model": "mixer", "patch": 0}, r"patch must be an integer in 1..28, got 0"),
        ({"model": "mixer", "dim": 7.5}, r"dim must be an integer in 1..512, got 7.5"),
        ({"model": "mixer", "depth": True}, r"depth must be an integer in 1..32, got True"),
        ({"model": "mixer", "depth": 33}, r"depth must be an integer in 1..32, got 33"),
    ]
    for options, message in bad:
        with pytest.raises(ConfigError, match=message) as info:
            VisionOptions.from_dict(options)
        assert "\n" not in str(info.value)
    _small_dataset(tmp_path)
    with pytest.raises(ConfigError, match="patch = 5 does not divide the 28x28 images; use a divisor"):
        _workload(eval_windows=12, options={"path": str(tmp_path), "model": "mixer", "patch": 5})
    wl = _workload(eval_windows=12, options={"path": str(tmp_path), "model": "mixer"})
    assert isinstance(wl.build_model(0), SmallMixer) and wl.name == "fashion-mnist-mixer"


def test_the_mixer_has_the_right_shape_gradients_and_a_deterministic_init() -> None:
    state = torch.get_rng_state()
    a, b, c = build_mixer(7), build_mixer(7), build_mixer(8)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is untouched
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(not torch.equal(sa[k], sc[k]) for k in sa if k.endswith("weight") and "norm" not in k)
    assert not list(a.buffers())  # LayerNorm only: nothing but parameters to merge
    assert len(a.blocks) == 3 and a.blocks[0].token_mlp.fc1.in_features == 16  # 4x4 patches of 7x7
    assert 50_000 < sum(p.numel() for p in a.parameters()) < 150_000
    four = build_mixer(0, patch=4)
    assert four.blocks[0].token_mlp.fc1.in_features == 49
    assert 50_000 < sum(p.numel() for p in four.parameters()) < 150_000
    x = torch.randn(32, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    y = torch.arange(32) % 10
    for model in (a, four):
        logits = model(x)
        assert logits.shape == (32, 10) and torch.isfinite(logits).all()
        torch.nn.functional.cross_entropy(logits, y).backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@needs_data
def test_a_short_simulated_run_of_the_mixer_gives_a_finite_loss_and_an_accuracy() -> None:
    """Decoupled DiLoCo on the mixer, a few rounds: the global model, loaded strictly into a
    fresh mixer, scores the run's reported loss, and its test accuracy is a fraction."""
    from ddiloco.config import load_config
    from ddiloco.sim.run import simulate
    from ddiloco.training.layout import load_global

    settings = [
        "workload.factory=ddiloco.workloads.vision:make_workload",
        'workload.options={model = "mixer"}',
        "workload.batch_size=32",
        "workload.eval_windows=256",
        "run.num_learners=2",
        "run.processed_tokens=1024",  # 16 steps per learner
        "run.eval_points=1",
        "algo.sync_every=4",
        "inner.lr=0.003",
    ]
    cfg = load_config(None, settings)
    wl = load_workload(cfg.workload)
    assert isinstance(wl, VisionWorkload) and wl.opts.model == "mixer"
    result = simulate(cfg, wl)
    assert np.isfinite(result.final_loss) and all(np.isfinite(e["loss"]) for e in result.evals)
    model = wl.build_model(0)
    load_global(model, result.state)  # strict: the state is exactly the mixer's parameters
    assert isinstance(model, SmallMixer)
    batches = wl.eval_batches()
    assert evaluate(wl, model, batches) == pytest.approx(result.final_loss, rel=1e-5)
    assert result.final_loss < np.log(10)  # a few merges already beat uniform guessing
    accuracy = wl.accuracy(model, batches)
    assert 0.0 <= accuracy <= 1.0 and accuracy > 0.1


@needs_data
def test_the_mixer_example_config_builds_its_workload() -> None:
    from ddiloco.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "vision-mixer.toml").validate()
    wl = load_workload(cfg.workload)
    assert isinstance(wl, VisionWorkload) and isinstance(wl.build_model(0), SmallMixer)
    assert sum(b.tokens for b in wl.eval_batches()) == cfg.workload.eval_windows
