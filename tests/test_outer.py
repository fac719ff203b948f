"""The outer optimizer: Nesterov SGD as torch computes it, and its delayed form."""

import pytest
import torch

from ddiloco.core.outer import OuterNesterov


def torch_nesterov(lr, momentum, grads, start):
    p = torch.nn.Parameter(start.clone())
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum, nesterov=True)
    out = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        out.append(p.detach().clone())
    return out


def test_matches_torch_nesterov_step_for_step():
    grads = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5]), torch.tensor([-1.0, 3.0])]
    start = torch.tensor([0.3, -0.7])
    outer, p = OuterNesterov(0.7, 0.9), start
    for g, want in zip(grads, torch_nesterov(0.7, 0.9, grads, start)):
        (p,) = outer.step([p], [g.clone()])
        assert torch.allclose(p, want)


def test_delayed_with_whole_shares_is_plain_nesterov():
    grads = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5])]
    start = torch.tensor([0.0, 0.0])
    outer, p = OuterNesterov(0.5, 0.8, delayed=True), start
    for g, want in zip(grads, torch_nesterov(0.5, 0.8, grads, start)):
        (p,) = outer.step([p], [g.clone()], share=1.0)
        assert torch.allclose(p, want)


def test_delayed_half_shares_by_hand():
    lr, mu = 0.5, 0.8
    outer = OuterNesterov(lr, mu, delayed=True)
    p = torch.tensor([0.0])
    g1, g2, g3, g4 = (torch.tensor([v]) for v in (2.0, 4.0, 1.0, 3.0))
    (p,) = outer.step([p], [g1.clone()], share=0.5)
    assert p.item() == pytest.approx(-lr * 0.5 * 2.0)  # -0.5: a plain step, no momentum yet
    assert outer.buffers is None
    (p,) = outer.step([p], [g2.clone()], share=0.5)
    # a whole fleet merged: mean = 3, b = 3 (the first buffer), push -lr * mu * b
    assert outer.buffers[0].item() == pytest.approx(3.0)
    assert p.item() == pytest.approx(-0.5 - lr * 0.5 * 4.0 - lr * mu * 3.0)  # -0.5 - 1 - 1.2 = -2.7
    (p,) = outer.step([p], [g3.clone()], share=0.5)
    (p,) = outer.step([p], [g4.clone()], share=0.5)
    b = mu * 3.0 + 2.0  # mean of the second pair = 2
    assert outer.buffers[0].item() == pytest.approx(b)
    assert p.item() == pytest.approx(-2.7 - lr * 0.5 * (1.0 + 3.0) - lr * mu * b)
    # over a whole fleet's worth, that is the Nesterov step with the mean gradient
    ref = torch_nesterov(lr, mu, [torch.tensor([3.0]), torch.tensor([2.0])], torch.tensor([0.0]))
    assert p.item() == pytest.approx(ref[-1].item())
