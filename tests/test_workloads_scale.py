"""The scale workload (synthetic, ``teacher_hidden = 64``): its options are validated in one line,
the teacher and the data stay small whatever the student's size, and the defaults build exactly
the model and data they built before the options existed."""

from __future__ import annotations

import pytest
import torch

from ddiloco.errors import ConfigError
from ddiloco.workloads.config import WorkloadConfig
from ddiloco.workloads.synthetic import SyntheticWorkload

torch.set_num_threads(1)

SYNTHETIC = "ddiloco.workloads.synthetic:make_workload"


def _workload(**options: object) -> SyntheticWorkload:
    return SyntheticWorkload(WorkloadConfig(factory=SYNTHETIC, batch_size=4, eval_windows=8, options=dict(options)))


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters()) + sum(b.numel() for b in module.buffers())


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"depth": 0}, "depth must be an integer >= 1"),
        ({"depth": 1.5}, "depth must be an integer >= 1"),
        ({"teacher_hidden": 0}, "teacher_hidden must be an integer >= 1"),
        ({"teacher_hidden": "64"}, "teacher_hidden must be an integer >= 1"),
        ({"teacher_hidden": True}, "teacher_hidden must be an integer >= 1"),
        ({"hidden": True}, "hidden must be an integer >= 1"),
        ({"teacher_width": 64}, "teacher_width"),
    ],
)
def test_bad_options_are_refused_in_one_line(options: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words) as err:
        _workload(**options)
    assert "\n" not in str(err.value)


def test_the_teacher_stays_small_while_the_student_grows() -> None:
    small = _workload(hidden=32, teacher_hidden=16)
    wide = _workload(hidden=512, depth=3, teacher_hidden=16)
    # the teacher is the same fixed network at every student size
    assert _numel(small.teacher) == _numel(wide.teacher) == 16 * 16 + 16 + 16 * 16 + 16 + 16 * 8 + 8
    for a, b in zip(small.teacher.state_dict().values(), wide.teacher.state_dict().values()):
        assert torch.equal(a, b)
    # hence the same data: what grows with hidden and depth is the model alone
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    x, y = small.make_batch(g()), wide.make_batch(g())
    assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
    assert x.inputs.numel() == 4 * 16 and x.targets.numel() == 4 * 8
    assert all(b.inputs.shape[1] == 16 and b.targets.shape[1] == 8 for b in wide.eval_batches())
    model = wide.build_model(0)
    h, d = 512, 3
    assert _numel(model) == d * h * h + (d + 25) * h + 8  # the docstring's size formula
    names = [n for n, _ in model.named_parameters()]
    assert names[:4] == ["embed.weight", "embed.bias", "hidden.weight", "hidden.bias"]
    assert {"layers.0.weight", "layers.1.bias", "head.weight"} <= set(names)
    assert wide.loss(model, x).isfinite()


def test_defaults_build_what_they_built_before() -> None:
    """depth = 1 and no teacher_hidden: the teacher as wide as the student, no new tensor."""
    wl = _workload(hidden=24)
    model = wl.build_model(5)
    assert [n for n, _ in model.named_parameters()] == [
        "embed.weight",
        "embed.bias",
        "hidden.weight",
        "hidden.bias",
        "head.weight",
        "head.bias",
    ]
    assert _numel(wl.teacher) == _numel(model)
    # teacher_hidden = hidden is the same task as leaving it out
    same = _workload(hidden=24, teacher_hidden=24)
    g = lambda: torch.Generator().manual_seed(9)  # noqa: E731
    assert torch.equal(wl.make_batch(g()).targets, same.make_batch(g()).targets)
    deeper = _workload(hidden=24, depth=2).build_model(5)
    for name in ("embed.weight", "hidden.weight"):  # depth draws the extra layers after these
        assert torch.equal(dict(model.named_parameters())[name], dict(deeper.named_parameters())[name])
