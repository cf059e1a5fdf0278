"""Asynchronous schedules train exactly as their paper's update rule, micro-batch by micro-batch.

Every case trains on real gloo processes (``tests/workers/train_cases.py``: 3 batches, eval, which
flushes first) and is compared with a single-process reference written here, which knows nothing
of the engine: a :class:`GraphModel`, the parameters of each stage kept as a history of versions,
and the optimizers' update rules written out by hand. Stage ``s`` trails its forwards by
``lag = depth - 1`` backwards (``S - 1 - s`` on a chain):

* PipeDream (weight stashing): micro-batch ``j`` runs forward and backward on the weights stage
  ``s`` had after ``max(0, j - lag)`` updates, and stage ``s`` updates once per micro-batch with it;
* PipeDream-2BW: every micro-batch of batch ``b`` runs on ``W(b-1)`` (``W(0)`` for the first two),
  and ``W(b+1) = W(b) - lr * mean grad f(W(b-1))``;
* PipeOptim: as PipeDream, but the forward runs on ``W(t) - lr * s * dW(t)``, ``t = max(0, j - lag)``,
  ``s = min(j, lag)``, ``dW`` the optimizer's direction (SGD: ``momentum * v + grad``; Adam:
  ``m_hat / (sqrt(v_hat) + eps)``), and the backward differentiates that forward.
"""

import math

import pytest
import torch
from torch import nn

from gpp_deepspeed import GraphModel
from models import MODELS, make_batches

pytestmark = pytest.mark.dist

BASE = {"mbs": 4, "gas": 4, "steps": 3, "zero": 0, "clip": 0.0, "lr": 0.05}


def _case(model, schedule, optimizer="sgd", **extra):
    name = f"async-{model}-{schedule}-{optimizer}" + "".join(f"-{k}{v}" for k, v in sorted(extra.items()))
    c = {**BASE, "id": name, "model": model, "stages": 3, "schedule": schedule,
         "partition": "explicit" if model == "skip" else "uniform", **extra}
    if optimizer == "adam":
        c.update(optimizer="adam", lr=0.01)
    return c


CASES = [_case(m, s) for m in ("chain", "skip") for s in ("pipedream", "2bw", "pipeoptim")]
CASES += [_case(m, "pipeoptim", "adam") for m in ("chain", "skip")]
CASES += [_case("skip", "pipedream", gas=1, steps=4)]  # a gradient that waits two batches for its receiver
CKPT = [_case("skip", "pipeoptim", checkpoint=True)]  # save_checkpoint flushes; resume from it
TRAINED = list(CASES)
CASES += CKPT


# -- the reference ----------------------------------------------------------------------------------

def _sgd(w, g, state, lr, momentum=0.9):
    buf = g.clone() if "buf" not in state else momentum * state["buf"] + g
    return w - lr * buf, {"buf": buf, "grad": g}


def _adam(w, g, state, lr, betas=(0.9, 0.999), eps=1e-8):
    t = state.get("t", 0) + 1
    m = betas[0] * state.get("m", torch.zeros_like(g)) + (1 - betas[0]) * g
    v = betas[1] * state.get("v", torch.zeros_like(g)) + (1 - betas[1]) * g * g
    denom = v.sqrt() / math.sqrt(1 - betas[1]**t) + eps
    return w - lr / (1 - betas[0]**t) * m / denom, {"t": t, "m": m, "v": v}


def _direction(state, adam, betas=(0.9, 0.999), eps=1e-8, momentum=0.9):
    """PipeOptim's dW after the updates that made ``state`` (None before the first)."""
    if not state:
        return None
    if adam:
        t = state["t"]
        return state["m"] / (1 - betas[0]**t) / (state["v"].sqrt() / math.sqrt(1 - betas[1]**t) + eps)
    return momentum * state["buf"] + state["grad"]


def async_reference(case, stage_of: dict, lag: dict):
    """Losses per batch, eval loss and final parameters of ``case`` under its schedule's rule."""
    mc = MODELS[case["model"]]()
    model = GraphModel(mc.layers, input_names=mc.input_names)
    params = dict(model.named_parameters())
    loss_fn = nn.CrossEntropyLoss()
    m, lr, adam = case["gas"], case["lr"], case.get("optimizer") == "adam"
    step = _adam if adam else _sgd
    hist = {n: [p.detach().clone()] for n, p in params.items()}   # hist[n][t]: after t updates
    states = {n: [{}] for n in params}                             # optimizer state after t updates

    def grad_at(theta, x, y):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(theta[n])
        model.zero_grad()
        loss = loss_fn(model(*(x if isinstance(x, tuple) else (x, ))), y)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in params.items()}

    def apply(n, t, g):
        w, st = step(hist[n][t], g, states[n][t], lr)
        hist[n].append(w)
        states[n].append(st)

    losses = []
    for b in range(case["steps"]):
        batch = make_batches(mc, step=b, dp_rank=0, micro_batches=m, micro_batch_size=case["mbs"])
        if case["schedule"] == "2bw":
            theta = {n: hist[n][max(b - 1, 0)] for n in params}
            results = [grad_at(theta, x, y) for x, y in batch]
            for n in params:
                apply(n, b, sum(g[n] for _, g in results) / m)
            losses.append(sum(loss for loss, _ in results) / m)
            continue
        total = 0.0
        for r, (x, y) in enumerate(batch):
            j = b * m + r
            theta = {}
            for n in params:
                w = lag[stage_of[n]]
                t, s = max(0, j - w), min(j, w)
                direction = _direction(states[n][t], adam) if case["schedule"] == "pipeoptim" else None
                theta[n] = hist[n][t] if direction is None else hist[n][t] - lr * s * direction
            loss, g = grad_at(theta, x, y)
            total += loss
            for n in params:
                apply(n, j, g[n])
        losses.append(total / m)
    final = {n: hist[n][-1] for n in params}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(final[n])
        evals = [loss_fn(model(*(x if isinstance(x, tuple) else (x, ))), y).item()
                 for x, y in make_batches(mc, step=100, dp_rank=0, micro_batches=m, micro_batch_size=case["mbs"])]
    return losses, sum(evals) / len(evals), final


# -- the test ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("c", TRAINED, ids=[c["id"] for c in TRAINED])
def test_async_schedule_matches_its_update_rule_written_out(run_cases, c):
    out = run_cases("async_w3", 3, CASES, timeout=600)
    ranks = [torch.load(out / f"{c['id']}.rank{r}.pt") for r in range(3)]
    stage_of = {name: res["stage"] for res in ranks for name in res["state"]}
    lag = {res["stage"]: res["depth"] - 1 for res in ranks}
    if c["model"] == "chain":
        assert lag == {0: 2, 1: 1, 2: 0}, "a chain's stage s trails by S - 1 - s backwards"
    else:
        assert lag == {0: 2, 1: 1, 2: 0}, "skip: stage 0 feeds both 1 and 2 (skip), 2 merges (fan-in)"
    for res in ranks:  # weight copies stashed: one per micro-batch in flight, or 2BW's two
        want = 2 if c["schedule"] == "2bw" else min(res["depth"], c["gas"] * c["steps"])
        versions = res["weight_versions"]
        assert versions["peak_versions"] == want, f"stage {res['stage']}"
        assert versions["version_bytes"] == 4 * sum(v.numel() for v in res["state"].values())
    losses, eval_loss, state = async_reference(c, stage_of, lag)
    for r, res in enumerate(ranks):
        assert res["losses"] == pytest.approx(losses, rel=1e-5), f"rank {r}"
        assert res["eval"] == pytest.approx(eval_loss, rel=1e-5), f"rank {r}"
    assert set(stage_of) == set(state)
    for res in ranks:
        for name, value in res["state"].items():
            torch.testing.assert_close(value, state[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("c", CKPT, ids=[c["id"] for c in CKPT])
def test_async_checkpoint_flushes_and_resumes_exactly_like_an_uninterrupted_run(run_cases, c):
    out = run_cases("async_w3", 3, CASES, timeout=600)
    for r in range(3):
        res = torch.load(out / f"{c['id']}.rank{r}.pt")
        assert res["resumed"] == res["uninterrupted"], f"rank {r}"
        assert res["weight_versions"]["peak_versions"] == res["depth"]


def test_async_reference_differs_from_synchronous_training():
    """The reference is not vacuous: PipeDream's staleness changes the losses of a 3-stage chain."""
    c = _case("chain", "pipedream")
    mc = MODELS["chain"]()
    names = [n for n, _ in GraphModel(mc.layers, input_names=mc.input_names).named_parameters()]
    stale = async_reference(c, {n: 0 for n in names}, {0: 2})
    fresh = async_reference(c, {n: 0 for n in names}, {0: 0})
    assert stale[0][2] != pytest.approx(fresh[0][2], rel=1e-4)
    assert any(not torch.allclose(stale[2][n], fresh[2][n], rtol=1e-4) for n in names)
