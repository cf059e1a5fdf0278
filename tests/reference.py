"""The independent reference: the same model trained on one device with plain PyTorch.

:func:`train_reference` trains :class:`gpp_deepspeed.GraphModel` on exactly the micro-batches that
every data-parallel replica of the pipeline sees, with the arithmetic of synchronous pipeline
training written out by hand: the gradient of a step is the mean over all micro-batches of all
replicas, clipped by global norm (DeepSpeed's default, 1.0, unless the case says otherwise), then one SGD step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gpp_deepspeed import GraphModel
from models import MODELS, make_batches


@dataclass
class Reference:
    losses: list[float]          # mean loss of each step
    eval_loss: float             # mean eval loss over every replica's micro-batches
    state: dict                  # final GraphModel state_dict
    last_logits: list            # per replica: output of its last eval micro-batch


def train_reference(case: dict, *, dp: int, steps=None) -> Reference:
    mc = MODELS[case["model"]]()
    model = GraphModel(mc.layers, input_names=mc.input_names)
    cast = (lambda t: t.double() if t.is_floating_point() else t) if case.get("float64") else (lambda t: t)  # noqa: E731
    if case.get("float64"):
        model.double()
    if case.get("optimizer") == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=case["lr"])
    else:
        opt = torch.optim.SGD(model.parameters(), lr=case["lr"], momentum=case.get("momentum", 0.9))
    loss_fn = nn.CrossEntropyLoss()
    m = case["gas"]
    losses = []
    for step in (steps if steps is not None else range(case["steps"])):
        opt.zero_grad()
        total = 0.0
        for r in range(dp):
            for x, y in make_batches(mc, step=step, dp_rank=r, micro_batches=m, micro_batch_size=case["mbs"]):
                loss = loss_fn(model(*(cast(t) for t in (x if isinstance(x, tuple) else (x, )))), y)
                (loss / (m * dp)).backward()
                total += loss.item()
        if case.get("clip", 1.0) > 0:  # DeepSpeed's default gradient_clipping is 1.0
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.get("clip", 1.0))
        opt.step()
        losses.append(total / (m * dp))
    evals, last_logits = [], []
    with torch.no_grad():
        for r in range(dp):
            for x, y in make_batches(mc, step=100, dp_rank=r, micro_batches=m, micro_batch_size=case["mbs"]):
                out = model(*(cast(t) for t in (x if isinstance(x, tuple) else (x, ))))
                evals.append(loss_fn(out, y).item())
            last_logits.append(out)  # eval_batch(return_logits=True) returns the last micro-batch's
    return Reference(losses, sum(evals) / len(evals), model.state_dict(), last_logits)


def assert_stage_parameters_match(ranks: list[dict], ref: Reference) -> None:
    """Every rank's parameters equal the single-device model's (rtol 1e-5), and the ranks together
    hold every one of them."""
    seen = set()
    for r, res in enumerate(ranks):
        for name, value in res["state"].items():
            torch.testing.assert_close(value, ref.state[name], rtol=1e-5, atol=1e-6, msg=f"rank {r}: {name}")
            seen.add(name)
    assert seen == set(ref.state), "every parameter lives on the stages that own it"
