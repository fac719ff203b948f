"""``ddiloco.recalibrate_batch_norm``: BatchNorm statistics measured afresh on the model's
current weights (the merged statistics lag the final weights: docs/algorithm.md, "Buffers")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddiloco
from ddiloco.errors import UsageError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.drop = nn.Dropout(0.5)
        self.bn = nn.BatchNorm1d(6, momentum=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.drop(self.fc(x)))


def batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [3 + 2 * torch.randn(16, 4, generator=g) for _ in range(n)]


def test_the_statistics_are_the_average_over_the_batches_with_dropout_off():
    torch.manual_seed(0)
    model = Net().train()
    data = batches(5)
    assert ddiloco.recalibrate_batch_norm(model, data) == 5
    with torch.no_grad():
        feats = [model.fc(x) for x in data]  # dropout off: what eval mode feeds the BatchNorm
    mean = torch.stack([f.mean(0) for f in feats]).mean(0)
    var = torch.stack([f.var(0, unbiased=True) for f in feats]).mean(0)
    torch.testing.assert_close(model.bn.running_mean, mean)
    torch.testing.assert_close(model.bn.running_var, var)
    assert int(model.bn.num_batches_tracked) == 5
    assert model.training and model.drop.training and model.bn.momentum == 0.3  # modes and momentum as they were


def test_it_stops_at_max_batches_and_takes_tuples_dicts_and_a_forward():
    model = Net().eval()
    pairs = ((x, torch.zeros(16)) for x in batches(50))
    assert ddiloco.recalibrate_batch_norm(model, pairs, max_batches=3) == 3
    assert not model.training
    seen: list[torch.Tensor] = []

    def forward(m: nn.Module, batch: dict[str, torch.Tensor]) -> None:
        seen.append(batch["x"])
        m(batch["x"])

    assert ddiloco.recalibrate_batch_norm(model, [{"x": x} for x in batches(2)], forward=forward) == 2
    assert len(seen) == 2


def test_a_model_without_batch_norm_is_left_alone():
    assert ddiloco.recalibrate_batch_norm(nn.Linear(4, 2), batches(2)) == 0


def test_wrong_inputs_are_one_line_and_leave_the_statistics_as_they_were():
    model = Net()
    model.bn.running_mean.fill_(7.0)
    with pytest.raises(UsageError, match="was given no batches: give it some of the training data"):
        ddiloco.recalibrate_batch_norm(model, iter(()))
    assert torch.all(model.bn.running_mean == 7.0)
    with pytest.raises(UsageError, match="max_batches is 0"):
        ddiloco.recalibrate_batch_norm(model, batches(1), max_batches=0)
    with pytest.raises(UsageError, match="cannot feed a batch of type str to the model: pass forward="):
        ddiloco.recalibrate_batch_norm(model, ["text"])
    assert model.bn.momentum == 0.3


def test_statistics_that_lag_the_weights_are_repaired():
    """A BatchNorm network whose weights moved after its statistics were measured (as the outer
    step moves the global weights past every learner's): recalibration restores its loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = 3 + 2 * torch.randn(512, 4, generator=g)
    y = (x[:, 0] > x[:, 1]).long()
    for i in range(300):
        s = slice(i % 8 * 64, i % 8 * 64 + 64)
        loss = F.cross_entropy(model(x[s]), y[s])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    good = F.cross_entropy(model(x), y).item()
    with torch.no_grad():
        model[0].weight.mul_(0.5)  # the statistics now lag: scale-invariant downstream, not with these statistics
        model[0].bias.mul_(0.5)
    lagging = F.cross_entropy(model(x), y).item()
    ddiloco.recalibrate_batch_norm(model, [x[i : i + 64] for i in range(0, 512, 64)])
    repaired = F.cross_entropy(model(x), y).item()
    assert lagging > 1.5 * good and repaired == pytest.approx(good, rel=0.05)
