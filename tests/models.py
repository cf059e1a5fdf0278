"""Small multi-branch models for the tests, as layer lists, with their data.

Each builder returns a :class:`Case` model: the layer list, the graph input names and shapes, the
number of classes, and the explicit partitions that force a shape (a skip that crosses two stage
boundaries, a tensor fanned out to three stages) at a given stage count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from gpp_deepspeed import GraphLayerSpec


class Block(nn.Module):
    """Linear + tanh with a residual: enough non-linearity for gradients to differ per layer."""

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Concat(nn.Module):
    def forward(self, *xs):
        return torch.cat(xs, dim=-1)


class Add(nn.Module):
    def forward(self, *xs):
        out = xs[0]
        for x in xs[1:]:
            out = out + x
        return out


class Split(nn.Module):
    """Returns a tuple: consumers read it as "name:0" and "name:1"."""

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, 2 * dim)

    def forward(self, x):
        a, b = self.lin(x).chunk(2, dim=-1)
        return torch.tanh(a), b


@dataclass
class ModelCase:
    layers: list
    input_names: tuple[str, ...]
    input_dims: tuple[int, ...]
    num_classes: int
    partitions: dict[int, dict[str, int]] = field(default_factory=dict)  # num_stages -> explicit mapping
    seq_lens: tuple[int, ...] = ()  # if set, inputs are [batch, seq, dim] with seq cycling through these


D = 8


def chain() -> ModelCase:
    """A plain DeepSpeed layer list (no names): the drop-in path."""
    layers = [LayerSpec(nn.Linear, 6, D)] + [LayerSpec(Block, D) for _ in range(4)] + [LayerSpec(nn.Linear, D, 3)]
    return ModelCase(layers, ("input", ), (6, ), 3)


def diamond() -> ModelCase:
    layers = [
        GraphLayerSpec("stem", nn.Linear, 6, D, inputs=["x"]),
        GraphLayerSpec("split", Split, D, inputs=["stem"]),
        GraphLayerSpec("left", Block, D, inputs=["split:0"]),
        GraphLayerSpec("right", Block, D, inputs=["split:1"]),
        GraphLayerSpec("merge", Add, inputs=["left", "right"]),
        GraphLayerSpec("head", nn.Linear, D, 3, inputs=["merge"]),
    ]
    parts = {4: {"stem": 0, "split": 0, "left": 1, "right": 2, "merge": 3, "head": 3}}
    return ModelCase(layers, ("x", ), (6, ), 3, parts)


def four_branch() -> ModelCase:
    layers = []
    for b in range(4):
        layers += [GraphLayerSpec(f"proj{b}", nn.Linear, 6, D, inputs=["x"]),
                   GraphLayerSpec(f"block{b}", Block, D, inputs=[f"proj{b}"])]
    layers += [GraphLayerSpec("cat", Concat, inputs=[f"block{b}" for b in range(4)]),
               GraphLayerSpec("head", nn.Linear, 4 * D, 3, inputs=["cat"])]
    return ModelCase(layers, ("x", ), (6, ), 3)


def skip() -> ModelCase:
    """``l1``'s output skips over the stages of l2 and l3 straight to the merge."""
    layers = [
        GraphLayerSpec("l1", nn.Linear, 6, D, inputs=["x"]),
        GraphLayerSpec("l2", Block, D, inputs=["l1"]),
        GraphLayerSpec("l3", Block, D, inputs=["l2"]),
        GraphLayerSpec("l4", Block, D, inputs=["l3"]),
        GraphLayerSpec("res", Add, inputs=["l4", "l1"]),
        GraphLayerSpec("head", nn.Linear, D, 3, inputs=["res"]),
    ]
    parts = {3: {"l1": 0, "l2": 1, "l3": 1, "l4": 2, "res": 2, "head": 2},
             4: {"l1": 0, "l2": 1, "l3": 2, "l4": 3, "res": 3, "head": 3}}
    return ModelCase(layers, ("x", ), (6, ), 3, parts)


class FrozenLinear(nn.Linear):
    """A projection that is not trained (a pretrained embedding, say): its parameters are frozen."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requires_grad_(False)


def skip_frozen() -> ModelCase:
    """:func:`skip` whose first layer is frozen: at 3 stages its stage has nothing to train, and its
    edges carry no gradient."""
    mc = skip()
    mc.layers[0] = GraphLayerSpec("l1", FrozenLinear, 6, D, inputs=["x"])
    return mc


def fanout3() -> ModelCase:
    """``a``'s output is read by three other stages."""
    layers = [
        GraphLayerSpec("a", nn.Linear, 6, D, inputs=["x"]),
        GraphLayerSpec("b", Block, D, inputs=["a"]),
        GraphLayerSpec("c", Block, D, inputs=["a"]),
        GraphLayerSpec("d", Block, D, inputs=["a"]),
        GraphLayerSpec("merge", Add, inputs=["b", "c", "d"]),
        GraphLayerSpec("head", nn.Linear, D, 3, inputs=["merge"]),
    ]
    parts = {3: {"a": 0, "b": 1, "c": 2, "d": 2, "merge": 2, "head": 2},
             4: {"a": 0, "b": 1, "c": 2, "d": 3, "merge": 3, "head": 3}}
    return ModelCase(layers, ("x", ), (6, ), 3, parts)


def three_input() -> ModelCase:
    layers = [
        GraphLayerSpec("px", nn.Linear, 6, D, inputs=["x"]),
        GraphLayerSpec("py", nn.Linear, 5, D, inputs=["y"]),
        GraphLayerSpec("pz", nn.Linear, 4, D, inputs=["z"]),
        GraphLayerSpec("bx", Block, D, inputs=["px"]),
        GraphLayerSpec("cat", Concat, inputs=["bx", "py", "pz"]),
        GraphLayerSpec("head", nn.Linear, 3 * D, 3, inputs=["cat"]),
    ]
    return ModelCase(layers, ("x", "y", "z"), (6, 5, 4), 3)


def late_input() -> ModelCase:
    """A middle stage reads a graph input: at 3 stages, stage 1 adds ``y``'s projection to what
    stage 0 sends (it has a predecessor and loads the batch)."""
    layers = [
        GraphLayerSpec("px", nn.Linear, 6, D, inputs=["x"]),
        GraphLayerSpec("py", nn.Linear, 5, D, inputs=["y"]),
        GraphLayerSpec("mix", Add, inputs=["px", "py"]),
        GraphLayerSpec("body", Block, D, inputs=["mix"]),
        GraphLayerSpec("head", nn.Linear, D, 3, inputs=["body"]),
    ]
    parts = {3: {"px": 0, "py": 1, "mix": 1, "body": 1, "head": 2}}
    return ModelCase(layers, ("x", "y"), (6, 5), 3, parts)


class MeanPool(nn.Module):
    def forward(self, x):  # [batch, seq, dim] -> [batch, dim]
        return x.mean(dim=1)


def varlen() -> ModelCase:
    """Sequences whose length changes from micro-batch to micro-batch (``dynamic_shape=True``)."""
    layers = [
        GraphLayerSpec("proj", nn.Linear, 6, D, inputs=["x"]),
        GraphLayerSpec("left", Block, D, inputs=["proj"]),
        GraphLayerSpec("right", Block, D, inputs=["proj"]),
        GraphLayerSpec("merge", Add, inputs=["left", "right"]),
        GraphLayerSpec("pool", MeanPool, inputs=["merge"]),
        GraphLayerSpec("head", nn.Linear, D, 3, inputs=["pool"]),
    ]
    parts = {4: {"proj": 0, "left": 1, "right": 2, "merge": 3, "pool": 3, "head": 3}}
    return ModelCase(layers, ("x", ), (6, ), 3, parts, seq_lens=(3, 5, 2))


def tied() -> ModelCase:
    """One weight shared by two parallel branches (a DeepSpeed TiedLayerSpec).

    DeepSpeed synchronises only ``tied_weight_attr`` (default ``["weight"]``) across stages, so the
    tied layer has no bias, as an embedding would not.
    """
    layers = [
        GraphLayerSpec("pa", nn.Linear, 6, D, inputs=["x"]),
        TiedLayerSpec("shared", nn.Linear, D, D, bias=False),  # layer1: reads pa
        GraphLayerSpec("pb", nn.Linear, 6, D, inputs=["x"]),
        TiedLayerSpec("shared", nn.Linear, D, D, bias=False),  # layer3: reads pb
        GraphLayerSpec("merge", Add, inputs=["layer1", "layer3"]),
        GraphLayerSpec("head", nn.Linear, D, 3, inputs=["merge"]),
    ]
    parts = {4: {"pa": 0, "layer1": 1, "pb": 2, "layer3": 2, "merge": 3, "head": 3}}  # copies on stages 1, 2
    return ModelCase(layers, ("x", ), (6, ), 3, parts)


def tied_head(module, x):
    """The output projection of a language model tied to its embedding: ``x @ E`` with ``E`` the
    embedding's weight (``nn.Linear(V, D).weight``, ``D x V``), logits over the ``V`` input classes."""
    return x @ module.weight


def tied_lm() -> ModelCase:
    """A language model's tie: the first layer (the embedding, ``V -> D``) and the last (the head,
    ``D -> V``, its transpose) are one DeepSpeed ``TiedLayerSpec`` key, as Megatron ties its
    embedding and output layer. At 4 stages they sit on stages 0 and 3: one rank under a V fold,
    two ranks under a looped one."""
    V = 6
    layers = [TiedLayerSpec("embed", nn.Linear, V, D, bias=False),     # layer0
              *(LayerSpec(Block, D) for _ in range(4)),                # layer1..layer4
              TiedLayerSpec("embed", nn.Linear, V, D, bias=False, forward_fn=tied_head)]   # layer5
    parts = {4: {"layer0": 0, "layer1": 0, "layer2": 1, "layer3": 2, "layer4": 3, "layer5": 3}}
    return ModelCase(layers, ("input", ), (V, ), V, parts)


def glue() -> ModelCase:
    """Two branches joined by glue (an Add, then two Concats of skips): at 4 stages every partition
    method puts the glue on a stage of its own, a stage without parameters."""
    layers = [
        GraphLayerSpec("pa", nn.Linear, 6, D, inputs=["x"]),
        GraphLayerSpec("pb", nn.Linear, 6, D, inputs=["x"]),
        GraphLayerSpec("add", Add, inputs=["pa", "pb"]),
        GraphLayerSpec("cat", Concat, inputs=["add", "pa"]),
        GraphLayerSpec("cat2", Concat, inputs=["cat", "pb"]),
        GraphLayerSpec("head", nn.Linear, 3 * D, 3, inputs=["cat2"]),
    ]
    return ModelCase(layers, ("x", ), (6, ), 3)


def glue_out() -> ModelCase:
    """The output layer is glue (an Add of two heads): at 4 stages every partition method, and the
    explicit 2-stage cut, leave the loss stage without parameters."""
    layers = [
        GraphLayerSpec("pa", nn.Linear, 6, 4 * D, inputs=["x"]),
        GraphLayerSpec("pb", nn.Linear, 6, D, inputs=["x"]),
        GraphLayerSpec("add", Add, inputs=["pb", "pb"]),
        GraphLayerSpec("cat", Concat, inputs=["add", "pb"]),
        GraphLayerSpec("ha", nn.Linear, 4 * D, 3, inputs=["pa"]),
        GraphLayerSpec("hb", nn.Linear, 2 * D, 3, inputs=["cat"]),
        GraphLayerSpec("out", Add, inputs=["ha", "hb"]),
    ]
    parts = {2: {"pa": 0, "pb": 0, "add": 0, "cat": 0, "ha": 0, "hb": 0, "out": 1}}
    return ModelCase(layers, ("x", ), (6, ), 3, parts)


class _Models(dict):
    """The named models, and ``"fuzz:<seed>"``: a random DAG (``fuzz_models.fuzz_model``)."""

    def __missing__(self, key):
        if isinstance(key, str) and key.startswith("fuzz:"):
            from fuzz_models import fuzz_model
            return lambda: fuzz_model(int(key.split(":", 1)[1]))
        raise KeyError(key)


MODELS: dict[str, Callable[[], ModelCase]] = _Models({
    "chain": chain, "diamond": diamond, "four_branch": four_branch, "skip": skip, "skip_frozen": skip_frozen,
    "fanout3": fanout3,
    "three_input": three_input, "late_input": late_input, "tied": tied, "tied_lm": tied_lm, "varlen": varlen,
    "glue": glue, "glue_out": glue_out,
})


def make_batches(model: ModelCase, *, step: int, dp_rank: int, micro_batches: int, micro_batch_size: int):
    """Deterministic micro-batches ``[(inputs, labels)]`` for one step of one data-parallel replica."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank + 7)
    batches = []
    for k in range(micro_batches):
        seq = (model.seq_lens[(k + step) % len(model.seq_lens)], ) if model.seq_lens else ()
        xs = tuple(torch.randn(micro_batch_size, *seq, d, generator=g) for d in model.input_dims)
        y = torch.randint(0, model.num_classes, (micro_batch_size, ), generator=g)
        batches.append((xs[0] if len(xs) == 1 else xs, y))
    return batches


class ReplicaOrderedDataset(torch.utils.data.Dataset):
    """The samples of :func:`make_batches`, laid out for DeepSpeed's pipeline loader.

    DeepSpeed's ``training_data=`` loader is a ``DistributedSampler`` over the data-parallel
    replicas, unshuffled (replica ``d`` reads samples ``d, d + dp, d + 2 dp, ...``), cut into
    micro-batches of ``micro_batch_size``. Sample ``n`` here is row ``i`` of micro-batch ``k`` of
    step ``s`` of replica ``n % dp``, where ``n // dp = (s * micro_batches + k) * micro_batch_size +
    i``, so a loader that follows that rule hands every replica exactly ``make_batches``'s
    micro-batches.
    """

    def __init__(self, model: ModelCase, *, dp: int, steps: int, micro_batches: int, micro_batch_size: int):
        shards = []
        for d in range(dp):
            rows = []
            for step in range(steps):
                for xs, y in make_batches(model, step=step, dp_rank=d, micro_batches=micro_batches,
                                          micro_batch_size=micro_batch_size):
                    for i in range(micro_batch_size):
                        x = tuple(t[i] for t in xs) if isinstance(xs, tuple) else xs[i]
                        rows.append((x, y[i]))
            shards.append(rows)
        self.dp = dp
        self.samples = [shards[n % dp][n // dp] for n in range(dp * len(shards[0]))]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, n):
        return self.samples[n]
