"""Weight versions of the asynchronous schedules (:mod:`gpp_deepspeed.schedule.asynchronous`).

A stage's *live* weights are its module's parameters, in the training dtype (fp32, or bf16/fp16
with DeepSpeed keeping fp32 master weights in its optimizer). A forward of an asynchronous
schedule never runs on them directly: it runs on a *version*, a set of leaf tensors (one per
trainable parameter, in the training dtype, as PipeDream-2BW stored them) made by ``STASH`` (a copy
of the live weights) or ``PREDICT`` (the optimizer's prediction of them, from the fp32 master
weights), swapped into the module for the forward and again for the backward (so that a
recomputed forward runs on it too). The autograd graph keeps the version, so the backward
differentiates exactly the forward it belongs to, whatever updates ran in between, and the
gradient lands on the version (accumulated in fp32 when the training dtype is lower). ``RETIRE``
hands it to the live weights (and to the master weights' fp32 gradient) and frees the version;
``UPDATE`` (a stage's own step) or DeepSpeed's ``STEP`` then uses it.

``PREDICT_INPLACE`` (PipeOptim's own code) writes the prediction over the live weights' storage,
keeping a copy of them, and its version aliases that storage: ``RESTORE`` writes the copy back right
after the forward, so the backward sees the live weights of its own time.

Glossary
--------
live weights
    the module's ``nn.Parameter`` objects, in the training dtype.
master weights
    the fp32 weights the optimizer steps: the live weights themselves in fp32, else DeepSpeed's
    bf16 optimizer's flat fp32 partitions (:class:`MasterWeights`).
version ``v``
    leaf tensors named by the micro-batch whose forward first runs on them.
``s``
    PipeOptim's weight version difference: updates between a forward and its backward.

Representative use::

    versions.stash(v); with versions.on_current(buffer_id): forward(); ...
    with versions.on_version_of(buffer_id): backward(); ...; versions.retire(v, scale=M); masters.step()
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

from ..errors import GPPConfigError
from .compat import (base_optimizer, base_optimizer_state, flat_optimizer_groups, hand_grads_to_master,
                     stage_local_norm)

__all__ = ["WeightVersions", "MasterWeights", "predicted_direction"]

def predicted_direction(state: dict, group: dict, *, adam: bool, last_grad: torch.Tensor | None):
    """PipeOptim's ``dW`` (arXiv 2312.00839, Sec. IV-B; the authors' ``optimizer.py``), the update
    direction the optimizer is predicted to keep, so that ``W(t+s) ~ W(t) - lr * s * dW(t)``, from
    one parameter's optimizer ``state`` and its ``group``'s hyper-parameters:

    * SGD with momentum ``g`` and dampening ``d``: ``dW = g * v + (1 - d) * grad``, ``v`` the momentum
      buffer and ``grad`` the newest gradient (``dW = grad`` without momentum);
    * Adam: ``dW = m_hat / (sqrt(v_hat) + eps)``, the bias-corrected moments after ``t`` steps.

    ``None`` before the first update (no gradient yet: the prediction is the current weights).
    """
    if adam:
        if "step" not in state or float(state["step"]) == 0:
            return None
        t = float(state["step"])
        beta1, beta2 = group["betas"]
        denom = state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**t) + group["eps"]
        return state["exp_avg"] / (1 - beta1**t) / denom
    if last_grad is None:
        return None
    buf = state.get("momentum_buffer")
    if group["momentum"] == 0 or buf is None:
        return last_grad
    return group["momentum"] * buf + (1 - group["dampening"]) * last_grad


class MasterWeights:
    """The fp32 master weights, their optimizer state and the stage's own step, whatever keeps
    them: a torch optimizer over the live parameters (fp32), or DeepSpeed's bf16 optimizer (flat
    fp32 partitions over the stage's data-parallel ranks, read whole through DeepSpeed's public
    ``safe_get_full_*``: collectives over the stage's data-parallel group, which every rank of the
    stage runs at the same point of the same program)."""

    def __init__(self, optimizer, params: list[nn.Parameter]):
        self.optimizer = optimizer
        self.params = params
        self.groups = flat_optimizer_groups(optimizer)   # None: a torch optimizer over the parameters
        self.base = base_optimizer(optimizer) if self.groups is not None else optimizer
        self._group_of = ({id(p): g for g, (lp, _) in enumerate(self.groups) for p in lp}
                          if self.groups is not None else None)

    def check_predictable(self, schedule: str) -> None:
        """PipeOptim predicts with SGD (with or without momentum) and Adam, as written in the paper;
        anything the prediction formula does not model is an error naming the option."""
        opt = self.base
        if not isinstance(opt, (torch.optim.SGD, torch.optim.Adam)) or isinstance(opt, torch.optim.AdamW):
            raise GPPConfigError(f'schedule "{schedule}" predicts weights for torch.optim.SGD and torch.optim.Adam '
                                 f"(with \"torch_adam\": true in DeepSpeed's optimizer section), got "
                                 f"{type(opt).__name__}")
        for group in opt.param_groups:
            for option in ("weight_decay", "nesterov", "amsgrad", "maximize"):
                if group.get(option):
                    raise GPPConfigError(f'schedule "{schedule}" does not model the optimizer option "{option}" in '
                                         f"its weight prediction; set it off")

    def prediction(self, p: nn.Parameter, last_grad: torch.Tensor | None, steps: int) -> torch.Tensor | None:
        """``W - lr * steps * dW`` of one live parameter from its fp32 master weight, in fp32; None
        before its first update (the prediction is then the weights themselves)."""
        adam = isinstance(self.base, torch.optim.Adam)
        if self.groups is None:
            group = next(g for g in self.base.param_groups if any(q is p for q in g["params"]))
            d = predicted_direction(self.base.state.get(p, {}), group, adam=adam, last_grad=last_grad)
            return None if d is None else p.detach().float() - group["lr"] * steps * d
        g = self._group_of[id(p)]
        group = self.base.param_groups[g]
        base = base_optimizer_state(self.optimizer, self.groups[g][1])
        state = {key: safe_get_full_optimizer_state(p, key) for key in ("exp_avg", "exp_avg_sq", "momentum_buffer")
                 if torch.is_tensor(base.get(key))}
        if "step" in base:
            state["step"] = base["step"]
        d = predicted_direction(state, group, adam=adam, last_grad=last_grad)
        return None if d is None else safe_get_full_fp32_param(p).float() - group["lr"] * steps * d

    @property
    def reads_newest_grad(self) -> bool:
        """PipeOptim's SGD prediction reads the newest gradient besides the optimizer's state."""
        return isinstance(self.base, torch.optim.SGD)

    def take_grads(self) -> None:
        """After ``RETIRE`` put a gradient on the live weights: hand it to the fp32 master
        gradient where the optimizer keeps one (DeepSpeed's bf16 optimizer)."""
        hand_grads_to_master(self.optimizer)

    def newest_grads(self) -> list[torch.Tensor | None]:
        """The gradient the next step uses, after its reduction over the stage's replicas, in fp32
        (what PipeOptim's SGD prediction reads)."""
        if self.groups is None:
            return [None if p.grad is None else p.grad.detach().float().clone() for p in self.params]
        return [safe_get_full_grad(p).detach().float().clone() for p in self.params]

    def step(self) -> None:
        """One step of this stage's optimizer with the live (reduced) gradient, then no gradient.
        DeepSpeed's bf16 optimizer checks the norm of this stage's gradient only (a non-finite one
        skips the step): the other stages update at other times."""
        with stage_local_norm(self.optimizer):
            self.optimizer.step()
        self.optimizer.zero_grad()
        for p in self.params:
            p.grad = None


class WeightVersions:
    """The weight versions of one stage (see module docstring)."""

    def __init__(self, module: nn.Module):
        self._slots: list[tuple[nn.Module, str, int]] = []   # (owner, name, index into params)
        self.params: list[nn.Parameter] = []
        index: dict[int, int] = {}
        for owner in module.modules():
            for name, p in owner._parameters.items():
                if p is None or not p.requires_grad:
                    continue
                if id(p) not in index:
                    index[id(p)] = len(self.params)
                    self.params.append(p)
                self._slots.append((owner, name, index[id(p)]))
        self.versions: dict[int, list[torch.Tensor]] = {}
        self.fp32_grads: dict[int, list[torch.Tensor | None]] = {}   # low-precision versions' gradients
        self.current: int | None = None
        self.version_of_buffer: dict[int, int] = {}
        self.loss_scale_of: dict[int, float] = {}
        self.peak_versions = 0
        self._copies: set[int] = set()
        self._saved: list[torch.Tensor] | None = None     # the live weights an in-place prediction covers
        self._last_grads: list[torch.Tensor | None] | None = None

    # -- making versions ---------------------------------------------------------------------------

    def _add(self, v: int, tensors: list[torch.Tensor], *, copy: bool, loss_scale: float) -> None:
        leaves = [t.detach().clone() if copy else t for t in tensors]
        for i, t in enumerate(leaves):
            t.requires_grad_(True)
            if t.dtype != torch.float32:
                t.register_post_accumulate_grad_hook(self._accumulate_fp32(v, i))
        self.versions[v] = leaves
        self.fp32_grads[v] = [None] * len(leaves)
        self.loss_scale_of[v] = loss_scale
        self.current = v
        if copy:
            self._copies.add(v)
        self.peak_versions = max(self.peak_versions, len(self._copies) + (self._saved is not None))

    def _accumulate_fp32(self, v: int, i: int):
        """A gradient hook: a low-precision version's gradient adds up in fp32 (2BW's ``M``
        backwards on one version), as DeepSpeed's bf16 optimizer accumulates micro-batches."""
        def hook(t: torch.Tensor) -> None:
            acc = self.fp32_grads[v]
            acc[i] = t.grad.float() if acc[i] is None else acc[i].add_(t.grad.float())
            t.grad = None
        return hook

    def stash(self, v: int, *, loss_scale: float = 1.0) -> None:
        """Version ``v`` := a copy of the live weights."""
        self._add(v, list(self.params), copy=True, loss_scale=loss_scale)

    @torch.no_grad()
    def _prediction(self, masters: MasterWeights, steps: int) -> list[torch.Tensor]:
        """``W - lr * steps * dW`` per live parameter (:func:`predicted_direction`), from the fp32
        master weights, in the training dtype."""
        out = []
        for i, p in enumerate(self.params):
            last = self._last_grads[i] if self._last_grads is not None else None
            predicted = masters.prediction(p, last, steps) if steps else None
            out.append(p.detach() if predicted is None else predicted.to(p.dtype))
        return out

    def predict(self, v: int, masters: MasterWeights, steps: int) -> None:
        """Version ``v`` := the prediction of the weights ``steps`` updates later."""
        self._add(v, self._prediction(masters, steps), copy=True, loss_scale=1.0)

    @torch.no_grad()
    def predict_inplace(self, v: int, masters: MasterWeights, steps: int) -> None:
        """The live weights := their prediction, a copy of them kept until :meth:`restore`; version
        ``v`` aliases the live storage (``.data``: updates to it do not trip autograd's checks, as
        in the authors' code), so its backward runs on the live weights of its time."""
        predicted = self._prediction(masters, steps)
        self._saved = [p.detach().clone() for p in self.params]
        for p, w in zip(self.params, predicted):
            p.data.copy_(w)
        self._add(v, [p.data for p in self.params], copy=False, loss_scale=1.0)

    @torch.no_grad()
    def restore(self, v: int) -> None:
        """Write back the live weights that :meth:`predict_inplace` covered."""
        for p, saved in zip(self.params, self._saved):
            p.data.copy_(saved)
        self._saved = None
        self.current = None

    # -- running on a version ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _swapped(self, v: int | None):
        if v is None or not self.params:
            yield
            return
        tensors = self.versions[v]
        saved = [owner._parameters[name] for owner, name, _ in self._slots]
        for owner, name, i in self._slots:
            owner._parameters[name] = tensors[i]
        try:
            yield
        finally:
            for (owner, name, _), p in zip(self._slots, saved):
                owner._parameters[name] = p

    def on_current(self, buffer_id: int):
        """Swap the current version into the module for one forward, whose micro-batch keeps its
        buffer slot until its backward (a stage without trainable weights runs on its live ones)."""
        if self.params:
            self.version_of_buffer[buffer_id] = self.current
        return self._swapped(self.current)

    def on_version_of(self, buffer_id: int):
        """Swap in the version the micro-batch of ``buffer_id`` ran its forward on, for its backward
        (a recomputed forward then runs on it as well)."""
        return self._swapped(self.version_of_buffer.pop(buffer_id, None))

    # -- gradients ---------------------------------------------------------------------------------

    def retire(self, v: int, *, scale: float) -> None:
        """The live weights' gradient := version ``v``'s times ``scale``; free the version (every
        backward that used it has run)."""
        tensors, acc = self.versions.pop(v), self.fp32_grads.pop(v)
        self.loss_scale_of.pop(v, None)
        self._copies.discard(v)
        for p, t, g in zip(self.params, tensors, acc):
            g = t.grad if g is None else g
            p.grad = None if g is None else (g.float() * scale).to(p.dtype)

    def keep_newest_grads(self, masters: MasterWeights) -> None:
        """Remember the reduced gradient of this update (PipeOptim's SGD prediction reads it)."""
        self._last_grads = masters.newest_grads()

    def newest_grads(self) -> dict[int, torch.Tensor]:
        """``{id(live parameter): newest gradient}``: what a checkpoint needs besides the optimizer's
        state (PipeOptim's SGD prediction reads it, which the momentum buffer alone does not give
        back); empty when there is none."""
        if self._last_grads is None:
            return {}
        return {id(p): g for p, g in zip(self.params, self._last_grads) if g is not None}

    def set_newest_grads(self, grads: dict[int, torch.Tensor]) -> None:
        """Take the newest gradient of the parameters in ``grads`` (by ``id``), as saved."""
        if grads:
            self._last_grads = [None if id(p) not in grads else grads[id(p)].to(p.device) for p in self.params]

    def reset(self) -> None:
        if self.versions:
            raise RuntimeError(f"weight versions {sorted(self.versions)} left after a flush")
        self.current = None
        self.version_of_buffer.clear()

    def version_bytes(self) -> int:
        """Bytes of one weight version of this stage (in the training dtype)."""
        return sum(p.numel() * p.element_size() for p in self.params)
