"""PipeOptim's prediction direction against the optimizers themselves, and weight versions on a
module (one process, no pipeline)."""

import pytest
import torch
from torch import nn

from gpp_deepspeed.engine.weights import MasterWeights, WeightVersions, predicted_direction
from gpp_deepspeed.errors import GPPConfigError


def _direction(opt, p, last_grad):
    group = opt.param_groups[0]
    return predicted_direction(opt.state.get(p, {}), group, adam=isinstance(opt, torch.optim.Adam), last_grad=last_grad)


def _stepped(optimizer_cls, **kw):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(5))
    opt = optimizer_cls([p], **kw)
    g = torch.randn(5)
    before = p.detach().clone()
    p.grad = g.clone()
    opt.step()
    return p, opt, g, before


def test_sgd_prediction_is_the_step_sgd_takes_if_the_gradient_stays_the_same():
    p, opt, g, _ = _stepped(torch.optim.SGD, lr=0.1, momentum=0.9)
    direction = _direction(opt, p, g)
    now = p.detach().clone()
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(now - 0.1 * direction, p.detach())


def test_adam_prediction_is_the_step_adam_just_took():
    p, opt, g, before = _stepped(torch.optim.Adam, lr=0.01)
    torch.testing.assert_close(before - 0.01 * _direction(opt, p, g), p.detach())


def test_no_prediction_before_the_first_update():
    p = nn.Parameter(torch.randn(3))
    assert _direction(torch.optim.SGD([p], lr=0.1, momentum=0.9), p, None) is None
    assert _direction(torch.optim.Adam([p], lr=0.1), p, None) is None


@pytest.mark.parametrize("make, option", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, nesterov=True, momentum=0.9), "nesterov"),
    (lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True), "amsgrad"),
    (lambda ps: torch.optim.AdamW(ps, lr=0.1), "AdamW"),
    (lambda ps: torch.optim.RMSprop(ps, lr=0.1), "RMSprop"),
])
def test_pipeoptim_refuses_what_its_prediction_does_not_model_by_name(make, option):
    with pytest.raises(GPPConfigError, match=option):
        params = [nn.Parameter(torch.zeros(2))]
        MasterWeights(make(params), params).check_predictable("pipeoptim")


def test_a_backward_differentiates_the_version_its_forward_ran_on_whatever_updates_came_between():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    versions = WeightVersions(lin)
    x = torch.randn(4, 3)
    w0 = lin.weight.detach().clone()
    versions.stash(0)
    with versions.on_current(0):
        out0 = lin(x).sum()
    versions.stash(1)
    with versions.on_current(1):
        out1 = (lin(x) ** 2).sum()
    out0.backward()
    versions.retire(0, scale=1.0)
    MasterWeights(opt, versions.params).step()              # the live weights move...
    assert not torch.equal(lin.weight.detach(), w0)
    out1.backward()                                         # ...and version 1 still holds w0
    weight, bias = versions.versions[1]
    torch.testing.assert_close(weight.detach(), w0)
    expected = torch.autograd.grad((nn.functional.linear(x, weight, bias) ** 2).sum(), weight)[0]
    torch.testing.assert_close(weight.grad, expected)
    assert versions.peak_versions == 2 and lin.weight.grad is None


def test_an_inplace_prediction_covers_the_live_weights_for_the_forward_and_its_backward_meets_the_live_ones():
    """PipeOptim's code: the forward on W - lr * s * dW, the backward on the live weights of its time
    (their storage), the weight gradient from the forward's inputs."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 2, bias=False)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    versions = WeightVersions(lin)
    masters = MasterWeights(opt, versions.params)
    x = torch.randn(4, 3, requires_grad=True)
    lin.weight.grad = torch.ones_like(lin.weight)
    opt.step()                                              # one update: SGD's dW is the gradient
    versions.keep_newest_grads(masters)
    lin.weight.grad = None
    live = lin.weight.detach().clone()
    versions.predict_inplace(0, masters, steps=2)
    with versions.on_current(0):
        out = lin(x)
    versions.restore(0)
    torch.testing.assert_close(out, x @ (live - 0.5 * 2 * torch.ones_like(live)).T)
    torch.testing.assert_close(lin.weight.detach(), live)   # restored before any backward
    assert versions.peak_versions == 1
    out.sum().backward()
    (weight,) = versions.versions[0]
    torch.testing.assert_close(x.grad, torch.ones(4, 2) @ live)          # the live weights
    torch.testing.assert_close(weight.grad, torch.ones(4, 2).T @ x.detach())


def test_a_low_precision_version_accumulates_its_gradients_in_fp32():
    lin = nn.Linear(3, 2, bias=False).bfloat16()
    versions = WeightVersions(lin)
    versions.stash(0)
    xs = [torch.randn(4, 3).bfloat16() for _ in range(3)]
    for x in xs:
        with versions.on_current(0):
            lin(x).float().sum().backward()
    versions.retire(0, scale=1.0)
    each = [(torch.ones(4, 2).bfloat16().T @ x).float() for x in xs]   # one backward's bf16 gradient
    assert lin.weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lin.weight.grad, sum(each).bfloat16(), rtol=0, atol=0)
