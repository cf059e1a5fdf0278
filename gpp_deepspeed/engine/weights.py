"""Weight versions of the asynchronous schedules (:mod:`gpp_deepspeed.schedule.asynchronous`).

A stage's *live* weights are its module's parameters, which DeepSpeed's optimizer updates in
place. A forward of an asynchronous schedule never runs on them: it runs on a *version*, a set of
leaf tensors (one per parameter) made by ``STASH`` (a copy of the live weights) or ``PREDICT`` (the
optimizer's prediction of them), swapped into the module for the duration of the forward. The
autograd graph keeps the version, so the backward differentiates exactly the forward it belongs
to, whatever updates ran in between, and the gradient lands on the version (``UPDATE`` moves it to
the live weights, steps the optimizer and frees the version).

Glossary
--------
live weights
    the module's ``nn.Parameter`` objects, owned by the optimizer.
version ``v``
    leaf tensors named by the micro-batch whose forward first runs on them.
``s``
    PipeOptim's weight version difference: updates between a forward and its backward.

Representative use::

    versions.stash(v); with versions.forward_on_current(): forward(); ...; versions.update(v, opt, scale=M)
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from ..errors import GPPConfigError

__all__ = ["WeightVersions", "predicted_direction", "check_predictable"]

_LAST_GRADS = "gpp_pipeoptim_last_grads"


def check_predictable(optimizer: torch.optim.Optimizer) -> None:
    """PipeOptim predicts with SGD (with or without momentum) and Adam, as written in the paper;
    anything the prediction formula below does not model is an error naming the option."""
    if not isinstance(optimizer, (torch.optim.SGD, torch.optim.Adam)) or isinstance(optimizer, torch.optim.AdamW):
        raise GPPConfigError(f'schedule "pipeoptim" predicts weights for torch.optim.SGD and torch.optim.Adam '
                             f"(with \"torch_adam\": true in DeepSpeed's optimizer section), got "
                             f"{type(optimizer).__name__}")
    for group in optimizer.param_groups:
        for option in ("weight_decay", "nesterov", "amsgrad", "maximize"):
            if group.get(option):
                raise GPPConfigError(f'schedule "pipeoptim" does not model the optimizer option "{option}" in its '
                                     f"weight prediction; set it off")


def predicted_direction(optimizer: torch.optim.Optimizer, p: nn.Parameter, last_grad: torch.Tensor | None):
    """PipeOptim's ``dW`` (arXiv 2312.00839, Sec. IV-B; the authors' ``optimizer.py``), the update
    direction the optimizer is predicted to keep, so that ``W(t+s) ~ W(t) - lr * s * dW(t)``:

    * SGD with momentum ``g`` and dampening ``d``: ``dW = g * v + (1 - d) * grad``, ``v`` the momentum
      buffer and ``grad`` the newest gradient (``dW = grad`` without momentum);
    * Adam: ``dW = m_hat / (sqrt(v_hat) + eps)``, the bias-corrected moments after ``t`` steps.

    ``None`` before the first update (no gradient yet: the prediction is the current weights).
    """
    state = optimizer.state.get(p, {})
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    if isinstance(optimizer, torch.optim.Adam):
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
        self.current: int | None = None
        self.peak_versions = 0
        self._last_grads: list[torch.Tensor | None] | None = None

    # -- making versions ---------------------------------------------------------------------------

    def _add(self, v: int, tensors: list[torch.Tensor]) -> None:
        self.versions[v] = [t.detach().clone().requires_grad_(True) for t in tensors]
        self.current = v
        self.peak_versions = max(self.peak_versions, len(self.versions))

    def stash(self, v: int) -> None:
        """Version ``v`` := a copy of the live weights."""
        self._add(v, list(self.params))

    @torch.no_grad()
    def predict(self, v: int, optimizer: torch.optim.Optimizer, steps: int) -> None:
        """Version ``v`` := ``W - lr * steps * dW`` (:func:`predicted_direction`)."""
        predicted = []
        for i, p in enumerate(self.params):
            last = self._last_grads[i] if self._last_grads is not None else None
            direction = predicted_direction(optimizer, p, last) if steps else None
            lr = next(g["lr"] for g in optimizer.param_groups if any(q is p for q in g["params"]))
            predicted.append(p if direction is None else p - lr * steps * direction)
        self._add(v, predicted)

    @contextmanager
    def forward_on_current(self):
        """Swap the current version into the module for one forward."""
        tensors = self.versions[self.current]
        saved = [owner._parameters[name] for owner, name, _ in self._slots]
        for owner, name, i in self._slots:
            owner._parameters[name] = tensors[i]
        try:
            yield
        finally:
            for (owner, name, _), p in zip(self._slots, saved):
                owner._parameters[name] = p

    # -- updates -----------------------------------------------------------------------------------

    def update(self, v: int, optimizer: torch.optim.Optimizer, *, scale: float, keep_grads: bool) -> None:
        """One optimizer step on the live weights with version ``v``'s gradient times ``scale``,
        then free the version (every backward that used it has run)."""
        tensors = self.versions.pop(v)
        for p, t in zip(self.params, tensors):
            p.grad = None if t.grad is None else t.grad.mul_(scale)
        optimizer.step()
        if keep_grads:  # PipeOptim's SGD prediction reads the newest gradient
            self._last_grads = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        for p in self.params:
            p.grad = None

    def checkpoint_state(self) -> dict:
        """What a checkpoint needs besides the optimizer's state: PipeOptim's SGD prediction reads
        the newest gradient, which the momentum buffer alone does not give back."""
        if self._last_grads is None:
            return {}
        return {_LAST_GRADS: [None if g is None else g.cpu() for g in self._last_grads]}

    def load_checkpoint_state(self, state: dict) -> None:
        grads = state.get(_LAST_GRADS)
        if grads is not None:
            self._last_grads = [None if g is None else g.to(p.device) for g, p in zip(grads, self.params)]

    def reset(self) -> None:
        if self.versions:
            raise RuntimeError(f"weight versions {sorted(self.versions)} left after a flush")
        self.current = None

    def version_bytes(self) -> int:
        """Bytes of one weight version of this stage."""
        return sum(p.numel() * p.element_size() for p in self.params)
