"""Random layer DAGs for fuzzed real runs, reproducible from a seed.

``fuzz_model(seed)`` builds a model with 1-3 graph inputs, branches, skip connections that reach
back several layers (so they cross several stages), layers returning tuples, and ``Gate`` layers
whose boolean mask and integer index outputs cross stages without gradients (consumed by
``Masked`` and ``Lookup`` layers, possibly on other stages). Every layer's output is used: all
sinks are summed into the head. ``random_partition(model, num_stages, seed)`` assigns each layer a
stage no earlier than its inputs' (so the stage graph is a DAG) with every stage used.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from gpp_deepspeed import GraphLayerSpec
from models import Add, Block, ModelCase, Split

D = 8
CLASSES = 3


class Gate(nn.Module):
    """Returns (hidden, mask: bool [batch], bucket: int64 [batch]): two tensors without gradients."""

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return h, h.sum(-1) > 0, (h.detach().abs().sum(-1) * 3).long() % 4


class Masked(nn.Module):
    def forward(self, x, mask):
        return x * mask.unsqueeze(-1).to(x.dtype) + 0.5 * x


class Lookup(nn.Module):
    """Adds an embedding row chosen by an integer index from another layer."""

    def __init__(self, dim):
        super().__init__()
        self.emb = nn.Embedding(4, dim)

    def forward(self, x, idx):
        return x + self.emb(idx)


class CatProj(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(2 * dim, dim)

    def forward(self, a, b):
        return self.lin(torch.cat([a, b], dim=-1))


def fuzz_model(seed: int, *, num_layers: int = 12) -> ModelCase:
    rng = random.Random(seed)
    num_inputs = rng.randint(1, 3)
    input_names = tuple(f"in{i}" for i in range(num_inputs))
    input_dims = tuple(rng.choice([4, 5, 6]) for _ in range(num_inputs))
    layers: list = []
    floats: list[str] = []          # references to float [batch, D] values
    used: set[str] = set()
    pending: list[tuple[str, str]] = []   # (kind, reference) of gate outputs still to consume

    def add(name, typename, *args, inputs):
        layers.append(GraphLayerSpec(name, typename, *args, inputs=list(inputs)))
        used.update(i.split(":")[0] for i in inputs)

    for i, (name, dim) in enumerate(zip(input_names, input_dims)):
        add(f"proj{i}", nn.Linear, dim, D, inputs=[name])
        floats.append(f"proj{i}")
    for k in range(num_layers):
        name = f"n{k}"
        choice = rng.random()
        # prefer recent values, sometimes reach far back (a skip across several layers)
        pick = lambda: floats[-1 - min(int(rng.expovariate(0.6)), len(floats) - 1)]  # noqa: E731
        if pending and choice < 0.35:
            kind, ref = pending.pop(rng.randrange(len(pending)))
            add(name, Masked if kind == "mask" else Lookup, *(() if kind == "mask" else (D, )), inputs=[pick(), ref])
            floats.append(name)
        elif choice < 0.45:
            add(name, Gate, D, inputs=[pick()])
            floats.append(f"{name}:0")
            pending += [("mask", f"{name}:1"), ("idx", f"{name}:2")]
        elif choice < 0.55:
            add(name, Split, D, inputs=[pick()])
            floats += [f"{name}:0", f"{name}:1"]
        elif choice < 0.75 and len(floats) > 1:
            a, b = rng.sample(floats, 2)
            if rng.random() < 0.5:
                add(name, Add, inputs=[a, b])
            else:
                add(name, CatProj, D, inputs=[a, b])
            floats.append(name)
        else:
            add(name, Block, D, inputs=[pick()])
            floats.append(name)
    for j, (kind, ref) in enumerate(pending):   # every mask and index is read by someone
        name = f"tail{j}"
        add(name, Masked if kind == "mask" else Lookup, *(() if kind == "mask" else (D, )), inputs=[floats[-1], ref])
        floats.append(name)
    sinks = [f for f in floats if f.split(":")[0] not in used or f == floats[-1]]
    sinks = list(dict.fromkeys(sinks))
    add("merge", Add, inputs=sinks)
    add("head", nn.Linear, D, CLASSES, inputs=["merge"])
    model = ModelCase(layers, input_names, input_dims, CLASSES)
    model.partitions = {s: random_partition(model, s, seed) for s in (2, 3, 4)}
    return model


def random_partition(model: ModelCase, num_stages: int, seed: int) -> dict[str, int]:
    """A random stage per layer, never earlier than its inputs' stages, every stage used."""
    rng = random.Random(seed)
    for _ in range(1000):
        stage_of: dict[str, int] = {}
        for spec in model.layers:
            lowest = max([stage_of[i.split(":")[0]] for i in spec.inputs if i.split(":")[0] in stage_of], default=0)
            stage_of[spec.name] = min(num_stages - 1, lowest + (rng.random() < 0.3) * rng.randint(1, 2))
        if len(set(stage_of.values())) == num_stages:
            return stage_of
    raise AssertionError(f"no partition of fuzz model into {num_stages} stages found")
