"""The runtime side of a :class:`~.desc.ModelDesc`: ``GraphLayerSpec`` lists, batches and losses.

:func:`build_layers` gives one ``GraphLayerSpec`` per layer description, with the same name and
inputs, so a cost database made from the description and the pipelined model agree on every
layer. Parameter counts equal :func:`~.desc.param_count`.

Representative use::

    desc = tiny("dlrm")
    model = GraphPipelineModule(build_layers(desc), input_names=desc.input_names, num_stages=4,
                                loss_fn=loss_fn(desc))
    inputs, labels = make_batch(desc, 8, seed=0)   # inputs: one tensor per graph input

Losses: ``"cross_entropy"`` (transformer classifiers; int64 class labels), ``"bce"`` (DLRM's
click logit; float 0/1 labels ``[batch, 1]``), ``"mse"`` (CANDLE-Uno's response; float labels
``[batch, 1]``). Labels are random: the models are benchmarks of speed, not of accuracy.
Dropout is absent so a pipelined run and its single-device twin compute the same function.
"""

from __future__ import annotations

import torch
from torch import nn

from ..spec import GraphLayerSpec
from .desc import LayerDesc, ModelDesc

__all__ = ["FeedForward", "EmbeddingConcat", "SelfAttention", "MLP", "TransformerLayer", "Concat", "Head",
           "build_layers", "make_batch", "loss_fn"]


class FeedForward(nn.Module):
    """``Linear(in, out)`` followed by ReLU (or nothing): ``[batch, in] -> [batch, out]``."""

    def __init__(self, in_features: int, out_features: int, activation: str = "relu"):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.activation = nn.ReLU() if activation == "relu" else nn.Identity()

    def forward(self, x):
        return self.activation(self.linear(x))


class EmbeddingConcat(nn.Module):
    """An embedding bag whose embeddings are concatenated, not summed (GraphPipe A.2):
    indices ``[batch, bag]`` int64 -> ``[batch, bag * dim]``. ``nn.EmbeddingBag`` only reduces
    (sum, mean, max), hence ``nn.Embedding`` and a reshape."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.embedding = nn.Embedding(rows, dim)

    def forward(self, idx):
        return self.embedding(idx).flatten(1)  # [batch, bag, dim] -> [batch, bag * dim]


class SelfAttention(nn.Module):
    """Multi-head self-attention on the normed tensor plus the residual: ``res + MHA(x)``,
    both ``[batch, seq, hidden]``."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(hidden, heads, dropout=0.0, batch_first=True)

    def forward(self, x, res):
        return res + self.attn(x, x, x, need_weights=False)[0]


class MLP(nn.Module):
    """``res + fc2(gelu(fc1(x)))`` with ``fc1: hidden -> ffn``, both tensors ``[batch, seq, hidden]``."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x, res):
        return res + self.fc2(nn.functional.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    """A pre-LN transformer layer built from the sublayer modules, so both granularities compute
    the same function: ``h = x + Attn(LN1(x)); out = h + MLP(LN2(h))``."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x):  # [batch, seq, hidden]
        h = self.attn(self.ln1(x), x)
        return self.mlp(self.ln2(h), h)


class Concat(nn.Module):
    """Concatenates its inputs along the last (feature) dimension."""

    def forward(self, *xs):
        return torch.cat(xs, dim=-1)


class Head(nn.Module):
    """Mean over the sequence when ``pool`` (``[batch, seq, in] -> [batch, in]``), then
    ``Linear(in, out)``: logits or a regression output ``[batch, out]``."""

    def __init__(self, in_features: int, out_features: int, pool: bool):
        super().__init__()
        self.pool = pool
        self.proj = nn.Linear(in_features, out_features)

    def forward(self, x):
        return self.proj(x.mean(dim=1) if self.pool else x)


def _spec(layer: LayerDesc) -> GraphLayerSpec:
    d, kind = layer.dims, layer.kind
    if kind == "linear":
        args = (FeedForward, d["in"], d["out"], d["activation"])
    elif kind == "embedding_bag":
        args = (EmbeddingConcat, d["rows"], d["dim"])
    elif kind == "transformer":
        args = (TransformerLayer, d["hidden"], d["heads"], d["ffn"])
    elif kind == "layernorm":
        args = (nn.LayerNorm, d["hidden"])
    elif kind == "attention":
        args = (SelfAttention, d["hidden"], d["heads"])
    elif kind == "mlp":
        args = (MLP, d["hidden"], d["ffn"])
    elif kind == "concat":
        args = (Concat, )
    else:
        args = (Head, d["in"], d["out"], bool(d["seq"]))
    return GraphLayerSpec(layer.name, *args, inputs=list(layer.inputs))


def build_layers(model: ModelDesc) -> list[GraphLayerSpec]:
    """One ``GraphLayerSpec`` per layer of ``model``, same names and inputs, in the same order."""
    return [_spec(layer) for layer in model.layers]


def loss_fn(model: ModelDesc) -> nn.Module:
    """The loss module for ``model.loss`` (see the module docstring)."""
    return {"cross_entropy": nn.CrossEntropyLoss, "bce": nn.BCEWithLogitsLoss, "mse": nn.MSELoss}[model.loss]()


def make_batch(model: ModelDesc, batch_size: int, *, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Deterministic synthetic ``(inputs, labels)`` for ``batch_size`` samples.

    Float inputs (token embeddings, dense features) are standard normal ``[batch, *shape]``;
    integer inputs (embedding-bag indices) uniform in ``[0, high)``. Labels match ``model.loss``.
    """
    g = torch.Generator().manual_seed(seed)
    inputs = []
    for spec in model.input_shapes:
        if spec.dtype == "int64":
            inputs.append(torch.randint(0, spec.high, (batch_size, *spec.shape), generator=g))
        else:
            inputs.append(torch.randn(batch_size, *spec.shape, generator=g, dtype=getattr(torch, spec.dtype)))
    out = model.layer(model.output).dims["out"]
    if model.loss == "cross_entropy":
        labels = torch.randint(0, out, (batch_size, ), generator=g)
    elif model.loss == "bce":
        labels = torch.randint(0, 2, (batch_size, out), generator=g).float()
    else:
        labels = torch.randn(batch_size, out, generator=g)
    return tuple(inputs), labels
