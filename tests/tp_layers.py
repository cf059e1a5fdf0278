"""Megatron-style tensor-parallel test layers (arXiv 1909.08053, Sec. 3), written against the grid.

Each layer builds its *whole* weights from its own seed and keeps its TP rank's slice, so a layer of
TP degree ``tp`` holds exactly the slice of the ``tp=1`` layer of the same seed: the single-device
reference is the same layer list at ``tp=1``. The layers communicate through the TP group of the
grid they are bound to (:func:`bind`: ``module.mpu()``, ours or DeepSpeed's), by the grid's
``get_slice_parallel_group``, the accessor DeepSpeed's grid and ours share:

``f`` (:class:`_CopyToTP`)
    identity forward, all-reduce of the gradient backward (before a column-parallel matmul);
``g`` (:class:`_ReduceFromTP`)
    all-reduce forward, identity backward (after a row-parallel matmul).

Parameters sliced over the TP group carry ``tensor_model_parallel = True``, the attribute
DeepSpeed's ``is_model_parallel_parameter`` reads (gradient norms count them on every TP rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

_GRID = {}
BACKWARD_ALLREDUCES: list = []   # the pass each backward all-reduce ran in (see label_passes)
_PASS: list = [None]


def bind(grid) -> None:
    """Layers of TP degree > 1 all-reduce over ``grid.get_slice_parallel_group()`` from now on."""
    _GRID["grid"] = grid


def _group():
    return _GRID["grid"].get_slice_parallel_group()


def label_passes(stage_backward) -> None:
    """Record which backward pass of ``stage_backward`` (the engine's ``StageBackward``: ``full``,
    ``input``, ``weight``) each TP all-reduce of a backward runs in."""
    for name in ("full", "input", "weight"):
        run = getattr(stage_backward, name)

        def labelled(slot, _run=run, _name=name):
            _PASS[0] = _name
            try:
                return _run(slot)
            finally:
                _PASS[0] = None
        setattr(stage_backward, name, labelled)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=_group())
        BACKWARD_ALLREDUCES.append(_PASS[0])
        return grad


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x, group=_group())
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def _param(t: torch.Tensor, sliced: bool) -> nn.Parameter:
    p = nn.Parameter(t.clone().contiguous())
    if sliced:
        p.tensor_model_parallel = True
    return p


class TPMLP(nn.Module):
    """``x + W2 gelu(W1 x + b1) + b2``: ``W1`` column-parallel (rows sliced), ``W2`` row-parallel
    (columns sliced), ``b2`` replicated (added after the all-reduce), Megatron's MLP block."""

    def __init__(self, d: int, f: int, *, seed: int, tp: int = 1, tp_rank: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w1 = torch.randn(f, d, generator=g, device="cpu") / d**0.5
        b1 = torch.randn(f, generator=g, device="cpu") * 0.1
        w2 = torch.randn(d, f, generator=g, device="cpu") / f**0.5
        b2 = torch.randn(d, generator=g, device="cpu") * 0.1
        k = f // tp
        part = slice(tp_rank * k, (tp_rank + 1) * k)
        self.tp = tp
        self.w1, self.b1 = _param(w1[part], tp > 1), _param(b1[part], tp > 1)
        self.w2, self.b2 = _param(w2[:, part], tp > 1), _param(b2, False)

    def forward(self, x):
        h = _CopyToTP.apply(x) if self.tp > 1 else x
        y = F.linear(F.gelu(F.linear(h, self.w1, self.b1)), self.w2)
        if self.tp > 1:
            y = _ReduceFromTP.apply(y)
        return x + y + self.b2


class Dense(nn.Module):
    """A seeded ``nn.Linear`` (no TP) whose output adds its input: ``x + W x + b``."""

    def __init__(self, d: int, *, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(d, d, generator=g, device="cpu") / d**0.5)
        self.b = nn.Parameter(torch.randn(d, generator=g, device="cpu") * 0.1)

    def forward(self, x):
        return x + torch.tanh(F.linear(x, self.w, self.b))


class Add(nn.Module):
    def forward(self, a, b):
        return a + b


def full_parameters(layer: nn.Module, *, tp: int, group=None) -> dict[str, torch.Tensor]:
    """A TP layer's parameters whole (gathered over its TP group when ``tp > 1``), by name."""
    out = {}
    for name, p in layer.named_parameters():
        t = p.detach().clone()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=1 if name == "w2" else 0)
        out[name] = t
    return out
