"""PipeOptim's prediction direction against the optimizers themselves, and weight versions on a
module (one process, no pipeline)."""

import pytest
import torch
from torch import nn

from gpp_deepspeed.engine.weights import WeightVersions, check_predictable, predicted_direction
from gpp_deepspeed.errors import GPPConfigError


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
    direction = predicted_direction(opt, p, g)
    now = p.detach().clone()
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(now - 0.1 * direction, p.detach())


def test_adam_prediction_is_the_step_adam_just_took():
    p, opt, g, before = _stepped(torch.optim.Adam, lr=0.01)
    torch.testing.assert_close(before - 0.01 * predicted_direction(opt, p, g), p.detach())


def test_no_prediction_before_the_first_update():
    p = nn.Parameter(torch.randn(3))
    assert predicted_direction(torch.optim.SGD([p], lr=0.1, momentum=0.9), p, None) is None
    assert predicted_direction(torch.optim.Adam([p], lr=0.1), p, None) is None


@pytest.mark.parametrize("make, option", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, nesterov=True, momentum=0.9), "nesterov"),
    (lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True), "amsgrad"),
    (lambda ps: torch.optim.AdamW(ps, lr=0.1), "AdamW"),
    (lambda ps: torch.optim.RMSprop(ps, lr=0.1), "RMSprop"),
])
def test_pipeoptim_refuses_what_its_prediction_does_not_model_by_name(make, option):
    with pytest.raises(GPPConfigError, match=option):
        check_predictable(make([nn.Parameter(torch.zeros(2))]))


def test_a_backward_differentiates_the_version_its_forward_ran_on_whatever_updates_came_between():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    versions = WeightVersions(lin)
    x = torch.randn(4, 3)
    w0 = lin.weight.detach().clone()
    versions.stash(0)
    with versions.forward_on_current():
        out0 = lin(x).sum()
    versions.stash(1)
    with versions.forward_on_current():
        out1 = (lin(x) ** 2).sum()
    out0.backward()
    versions.update(0, opt, scale=1.0, keep_grads=False)   # the live weights move...
    assert not torch.equal(lin.weight.detach(), w0)
    out1.backward()                                         # ...and version 1 still holds w0
    weight, bias = versions.versions[1]
    torch.testing.assert_close(weight.detach(), w0)
    expected = torch.autograd.grad((nn.functional.linear(x, weight, bias) ** 2).sum(), weight)[0]
    torch.testing.assert_close(weight.grad, expected)
    assert versions.peak_versions == 2 and lin.weight.grad is None
