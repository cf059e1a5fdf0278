"""The split backward (``I`` then ``W``) gives exactly the gradients of a fused backward.

The reference is one ``torch.autograd.backward(outputs, grads)`` on an identical copy of each
graph; every input gradient and every parameter gradient must match, on graphs chosen for their
traps: weights used twice on the input path, outputs that do not depend on the inputs, a stage
with no input needing a gradient, tuple-valued layers, a scalar loss, a non-reentrant checkpoint (a reentrant one refuses ``inputs=``: the engine recomputes with torch's
non-reentrant one under a split schedule), and
gradients accumulated over several micro-batches with ``W`` run out of order.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gpp_deepspeed.nn.split_backward import backward_input


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x, loaded):
        return (self.c(torch.tanh(self.b(torch.tanh(self.a(x))))), )


class TiedTwice(nn.Module):
    """One weight on two depths of the input path: the double-counting trap."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x, loaded):
        h = torch.tanh(self.lin(x)) * self.scale
        return (self.lin(h) * self.scale, )


class Mixed(nn.Module):
    """Two outputs: one from the received input, one from loaded data alone; a tuple-returning
    split; and a parameter used both on and off the input path."""

    def __init__(self):
        super().__init__()
        self.split = nn.Linear(4, 8)
        self.side = nn.Linear(4, 4)
        self.shared = nn.Parameter(torch.randn(4))

    def forward(self, x, loaded):
        a, b = self.split(x).chunk(2, dim=-1)
        side = torch.relu(self.side(loaded)) * self.shared
        return (a * b + side, side * self.shared, torch.sigmoid(a))


class LoadedOnly(nn.Module):
    """No input needs a gradient: I has nothing to do, W is the whole backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, loaded):
        return (torch.tanh(self.lin(loaded)), )


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, loaded):
        h = checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=False)
        return (self.b(h), )


def _run(model, x, loaded, grads_for, split, *, loss=False):
    outs = model(x, loaded)
    if loss:
        outs = (nn.functional.cross_entropy(outs[0], torch.tensor([0, 2, 1])) / 4, )
    grads = [None] * len(outs) if loss else grads_for(outs)
    if not split:
        torch.autograd.backward(outs, grads)
        return None
    return backward_input(outs, grads, inputs=[x], params=list(model.parameters()))


@pytest.mark.parametrize("make", [Chain, TiedTwice, Mixed, LoadedOnly, Checkpointed])
@pytest.mark.parametrize("loss", [False, True])
def test_split_backward_equals_fused_backward_over_micro_batches(make, loss):
    torch.manual_seed(0)
    fused = make()
    split = copy.deepcopy(fused)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)) for _ in range(3)]
    grads_for = lambda outs: [torch.randn(o.shape, generator=gen) for o in outs]  # noqa: E731
    pending, input_grads = [], []
    for x, loaded in batches:
        state = gen.get_state()
        xf = x.clone().requires_grad_(not isinstance(fused, LoadedOnly))
        _run(fused, xf, loaded, grads_for, False, loss=loss)
        gen.set_state(state)
        xs = x.clone().requires_grad_(xf.requires_grad)
        pending.append(_run(split, xs, loaded, grads_for, True, loss=loss))
        assert all(p.grad is None for p in split.parameters()) or len(pending) > 1 or isinstance(split, Checkpointed), \
            "I leaves the weight gradients to W"
        input_grads.append((xf.grad, xs.grad))
    for work in reversed(pending):  # W in another order than I: accumulation must not care
        work.run()
    for gf, gs in input_grads:
        if gf is None:
            assert gs is None
        else:
            torch.testing.assert_close(gs, gf, rtol=1e-6, atol=1e-7)
    for (name, pf), ps in zip(fused.named_parameters(), split.parameters()):
        torch.testing.assert_close(ps.grad, pf.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_split_backward_input_pass_skips_weight_gradients_and_weight_pass_fires_grad_hooks():
    torch.manual_seed(0)
    model = Chain()
    fired = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    x = torch.randn(3, 4, requires_grad=True)
    work = backward_input(model(x, None), [torch.ones(3, 3)], inputs=[x], params=list(model.parameters()))
    assert x.grad is not None and fired == [] and all(p.grad is None for p in model.parameters())
    work.run()
    assert sorted(fired) == sorted(n for n, _ in model.named_parameters())  # each once, as a fused backward


def test_split_backward_weight_pass_releases_the_saved_activations():
    import gc
    import weakref
    model = Chain()
    saved = []
    model.b.register_forward_hook(lambda mod, args, out: saved.append(weakref.ref(args[0])))
    x = torch.randn(3, 4, requires_grad=True)
    out = model(x, None)
    work = backward_input(out, [torch.ones(3, 3)], inputs=[x], params=list(model.parameters()))
    del out
    gc.collect()
    assert saved[0]() is not None, "W still needs the input of b to form b's weight gradient"
    work.run()
    del work
    gc.collect()
    assert saved[0]() is None
