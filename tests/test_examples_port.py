"""examples/resnet_port.py is examples/resnet_plain.py as a ddiloco learner (one-cycle LR,
gradient accumulation, clipping, BatchNorm): this script counts the lines the port adds or
changes, and runs it, two learners against examples/resnet_syncer.py, to its end."""

from __future__ import annotations

import ast
import difflib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddiloco

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MOST_ADDED = 15  # issue 35: a ResNet-style loop's port in at most 15 added lines


def code_lines(path: Path) -> list[str]:
    """The file's lines of code: no module docstring, comment-only or blank lines."""
    text = path.read_text()
    tree = ast.parse(text)
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    skip = set(range(doc.lineno, (doc.end_lineno or doc.lineno) + 1)) if doc is not None else set()
    return [
        line.rstrip()
        for n, line in enumerate(text.splitlines(), 1)
        if n not in skip and line.strip() and not line.strip().startswith("#")
    ]


def added_lines(plain: Path, port: Path) -> list[str]:
    """The port's lines that the plain loop lacks (a changed line counts once, as added)."""
    diff = difflib.ndiff(code_lines(plain), code_lines(port))
    return [d[2:] for d in diff if d.startswith("+ ")]


def test_the_port_adds_at_most_15_lines_to_the_plain_loop():
    added = added_lines(EXAMPLES / "resnet_plain.py", EXAMPLES / "resnet_port.py")
    assert len(added) <= MOST_ADDED, "\n".join(added)
    assert any("ddiloco.Learner(" in line for line in added)  # it is a port, not a copy
    assert any("recalibrate_batch_norm" in line for line in added)
    assert not any("OneCycleLR" in line for line in code_lines(EXAMPLES / "resnet_port.py"))


def test_the_counter_counts_changed_and_added_lines(tmp_path):
    (tmp_path / "a.py").write_text('"""doc"""\nx = 1\n\n# note\ny = 2\n')
    (tmp_path / "b.py").write_text('"""other doc\n"""\nx = 1\ny = 3\n# more\nz = 4\n')
    assert added_lines(tmp_path / "a.py", tmp_path / "b.py") == ["y = 3", "z = 4"]


@pytest.mark.slow  # a syncer and two learner processes, about a minute on 2 cores
def test_the_port_runs_two_learners_to_the_end_and_saves_recalibrated_weights(tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{EXAMPLES}"}
    syncer = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "resnet_syncer.py"), "--bind", f"tcp://127.0.0.1:{port}",
         "--images", "6400", "--sync-every", "10", "--linger", "2"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        from helpers import wait_for

        wait_for(lambda: (tmp_path / "runs" / "resnet" / "status" / "syncer-0.json").exists(), 60, "the syncer")
        learners = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(EXAMPLES / "resnet_port.py"),
                    "--syncer",
                    f"tcp://127.0.0.1:{port}",
                    "--id",
                    str(m),
                    "--seed",
                    str(m),
                    "--out",
                    f"learner-{m}.pt",
                ],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for m in (0, 1)
        ]
        outs = [p.communicate(timeout=240)[0] for p in learners]
        out, _ = syncer.communicate(timeout=120)
    finally:
        for p in [syncer, *locals().get("learners", [])]:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in learners] == [0, 0], outs
    assert syncer.returncode == 0, out[-3000:]
    sys.path.insert(0, str(EXAMPLES))
    try:
        from resnet_model import ResNet, held_out_loss, images
    finally:
        sys.path.remove(str(EXAMPLES))
    saved = [torch.load(tmp_path / f"learner-{m}.pt") for m in (0, 1)]
    for key, value in saved[0].items():  # both hold the final global weights, recalibrated alike
        assert torch.equal(value, saved[1][key]), key
    final = ddiloco.load_state_dict(tmp_path / "runs" / "resnet")
    for key, value in final.items():  # the syncer's final model: the same weights, calibrate='s statistics
        if "num_batches" not in key:
            torch.testing.assert_close(value, saved[0][key])
    model = ResNet()
    model.load_state_dict(saved[0])
    exported = held_out_loss(model)
    ddiloco.recalibrate_batch_norm(model, (images(64, seed=10_000 + i) for i in range(50)))  # other batches
    assert abs(exported / held_out_loss(model) - 1) <= 0.01
    assert "final model written again with 10 buffers re-estimated on its weights" in out


def free_port() -> int:
    from ddiloco.service.ops.launcher import free_port

    return free_port("127.0.0.1")
