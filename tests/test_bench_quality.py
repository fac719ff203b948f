"""The quality benchmark's cache is keyed on the code that computed each run (bench/quality.py:
``code_digest``), so a change to the simulator never mixes old runs with new ones. Nothing here
runs the benchmark."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location("bench_quality", ROOT / "bench" / "quality.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.fixture
def src(tmp_path):
    """A copy of src/ddiloco to edit."""
    copy = tmp_path / "src" / "ddiloco"
    shutil.copytree(ROOT / "src" / "ddiloco", copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_digest_covers_what_a_simulated_run_imports_and_nothing_else(quality):
    layers = set(quality.code_layers())
    assert {"core", "sim", "training", "workloads", "chaos", "report", "config", "methods", "errors"} <= layers
    assert not layers & {"service", "cli", "goodput", "export"}


def test_the_digest_changes_with_the_simulators_code_only(quality, src):
    digest = quality.code_digest(src)
    assert digest == quality.code_digest(ROOT / "src" / "ddiloco")  # paths are relative: any checkout
    wire = src / "service" / "base" / "wire.py"
    wire.write_text(wire.read_text() + "\n# a runtime-only change\n")
    assert quality.code_digest(src) == digest
    merge = src / "core" / "merge.py"
    merge.write_text(merge.read_text() + "\n# a core change\n")
    assert quality.code_digest(src) != digest


def test_a_new_package_the_simulator_imports_lazily_is_covered(quality, src):
    assert "protocol" in quality.code_layers(src)  # the sessions the simulator pumps
    (src / "newpkg").mkdir()
    (src / "newpkg" / "__init__.py").write_text('"""Something new."""\n')
    (src / "newpkg" / "session.py").write_text("X = 1\n")
    assert "newpkg" not in quality.code_layers(src)
    sim = src / "sim" / "run.py"
    sim.write_text(sim.read_text() + "\n\ndef _later():\n    from ..newpkg import session\n\n    return session\n")
    assert "newpkg" in quality.code_layers(src)
    digest = quality.code_digest(src)
    (src / "newpkg" / "session.py").write_text("X = 2\n")
    assert quality.code_digest(src) != digest


def test_a_cached_run_of_another_code_digest_is_not_reused(quality, tmp_path):
    job = ("decoupled", ("run.seed=0", "algo.merge=mean"))
    old = quality.Runner(tmp_path, 1, "aaaa")
    new = quality.Runner(tmp_path, 1, "bbbb")
    try:
        assert old.path(*job) != new.path(*job) and old.path(*job).name.startswith("decoupled-")
        old.path(*job).write_text(json.dumps({"code": "aaaa", "eval_loss": 1.5}))
        assert old.cached(*job) == {"code": "aaaa", "eval_loss": 1.5}
        assert new.cached(*job) is None
        # a file at the new key that another digest wrote (copied, renamed): not taken either
        new.path(*job).write_text(json.dumps({"code": "aaaa", "eval_loss": 1.5}))
        assert new.cached(*job) is None
        new.path(*job).write_text(json.dumps({"eval_loss": 1.5}))  # written before digests existed
        assert new.cached(*job) is None
    finally:
        old.pool.shutdown()
        new.pool.shutdown()
