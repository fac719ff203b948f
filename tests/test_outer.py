"""The outer optimizer equals torch.optim.SGD(nesterov=True) on the same pseudo-gradients."""

import torch

from ddiloco.core.outer import OuterNesterov


def test_outer_nesterov_matches_torch_sgd():
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    grads = [[torch.randn(5, 3, generator=g), torch.randn(7, generator=g)] for _ in range(10)]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    ours = OuterNesterov(0.7, 0.9)
    values = [t.clone() for t in start]
    for gs in grads:
        for p, gr in zip(ref, gs):
            p.grad = gr.clone()
        sgd.step()
        values = ours.step(values, [g.clone() for g in gs])
        for p, v in zip(ref, values):
            assert torch.allclose(p.detach(), v, rtol=1e-6, atol=1e-6)


def test_outer_state_dict_round_trips():
    a = OuterNesterov(0.7, 0.9)
    v = [torch.zeros(3)]
    v = a.step(v, [torch.ones(3)])
    b = OuterNesterov(0.7, 0.9)  # hyper-parameters come from the config; the state is the momentum
    b.load_state_dict(a.state_dict())
    g = [torch.tensor([1.0, -2.0, 0.5])]
    assert torch.equal(a.step(v, [t.clone() for t in g])[0], b.step(v, [t.clone() for t in g])[0])


def test_lr_one_momentum_zero_lands_on_learner_values():
    theta_global, theta_learner = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 3.0])
    out = OuterNesterov(1.0, 0.0).step([theta_global], [theta_global - theta_learner])
    assert torch.equal(out[0], theta_learner)
