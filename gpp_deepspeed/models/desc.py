"""Model descriptions: a model as a DAG of sized layers, pure data (no torch).

Glossary
--------
layer description
    A :class:`LayerDesc`: a node of the model DAG with a unique ``name`` (the name a
    ``GraphLayerSpec`` and a ``CostDB`` layer carry), a ``kind`` saying what it computes, the
    names of the tensors it reads, and its sizes (``dims``).
model description
    A :class:`ModelDesc`: graph inputs (name, per-sample shape, dtype), layers in a topological
    order, the output layer and the loss it feeds. The analytic cost model
    (:mod:`.analytic`) and the torch layers (:mod:`.torch_layers`) both read it, so the costs
    and the runtime describe the same layers.
granularity
    ``"layer"``: a transformer layer is one node. ``"sublayer"``: it is four nodes, layernorm ->
    attention -> layernorm -> MLP, where attention and MLP also read the tensor before their
    layernorm (the residual), so the DAG carries the skip edges. Feed-forward and embedding
    models have the same DAG at both granularities: a linear layer is never split from its
    activation, since a cut between them would ship the same bytes as a cut after them.

Kinds and their ``dims`` (per-sample output shape in brackets):

=================  ==========================================  ==========================
kind               dims                                        output per sample
=================  ==========================================  ==========================
``linear``         ``in``, ``out``, ``activation`` (relu/none)  ``[out]``
``embedding_bag``  ``rows``, ``dim``, ``bag``                  ``[bag * dim]`` (concat)
``transformer``    ``hidden``, ``heads``, ``ffn``, ``seq``     ``[seq, hidden]``
``layernorm``      ``hidden``, ``seq``                         ``[seq, hidden]``
``attention``      ``hidden``, ``heads``, ``seq``              ``[seq, hidden]``
``mlp``            ``hidden``, ``ffn``, ``seq``                ``[seq, hidden]``
``concat``         ``widths`` (per input), ``seq`` (0: none)   ``[seq, sum(widths)]``
``head``           ``in``, ``out``, ``seq`` (0: no pooling)    ``[out]``
=================  ==========================================  ==========================

A transformer layer is pre-LayerNorm (``x + Attn(LN(x))`` then ``h + MLP(LN(h))``), MLP
``hidden -> ffn -> hidden`` with GELU, attention with biases, as in GPT-2/Megatron-LM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..errors import GPPConfigError

__all__ = ["KINDS", "GRANULARITIES", "LOSSES", "InputDesc", "LayerDesc", "ModelDesc", "param_count",
           "output_elements"]

KINDS = ("linear", "embedding_bag", "transformer", "layernorm", "attention", "mlp", "concat", "head")
GRANULARITIES = ("layer", "sublayer")
LOSSES = ("cross_entropy", "bce", "mse")
_DIMS = {
    "linear": {"in", "out", "activation"},
    "embedding_bag": {"rows", "dim", "bag"},
    "transformer": {"hidden", "heads", "ffn", "seq"},
    "layernorm": {"hidden", "seq"},
    "attention": {"hidden", "heads", "seq"},
    "mlp": {"hidden", "ffn", "seq"},
    "concat": {"widths", "seq"},
    "head": {"in", "out", "seq"},
}


@dataclass(frozen=True, slots=True)
class InputDesc:
    """A graph input per sample: ``shape`` without the batch dimension, ``dtype`` (``"float32"``
    or ``"int64"``) and, for integer inputs, ``high``, the exclusive upper bound of its values."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    high: int = 0


@dataclass(frozen=True, slots=True)
class LayerDesc:
    """One node of a model DAG: ``kind`` (one of :data:`KINDS`) with sizes ``dims``, reading the
    tensors named in ``inputs`` (graph inputs or earlier layers), in the order its forward takes."""

    name: str
    kind: str
    inputs: tuple[str, ...]
    dims: Mapping

    def __post_init__(self):
        if self.kind not in _DIMS:
            raise GPPConfigError(f'layer "{self.name}": unknown kind "{self.kind}"; valid: {KINDS}')
        missing = _DIMS[self.kind] - set(self.dims)
        if missing:
            raise GPPConfigError(f'layer "{self.name}" ({self.kind}) lacks dims {sorted(missing)}')
        want = 2 if self.kind in ("attention", "mlp") else None
        if want is not None and len(self.inputs) != want:
            raise GPPConfigError(f'layer "{self.name}" ({self.kind}) reads (normed, residual): 2 inputs, '
                                 f"got {len(self.inputs)}")
        if self.kind == "concat" and len(self.dims["widths"]) != len(self.inputs):
            raise GPPConfigError(f'layer "{self.name}": {len(self.dims["widths"])} widths for '
                                 f"{len(self.inputs)} inputs")


@dataclass(frozen=True, slots=True)
class ModelDesc:
    """A model as a layer DAG: what a planner prices and what the runtime builds.

    ``input_shapes`` is aligned with ``input_names``; ``layers`` are in a topological order;
    ``output`` is the layer whose value goes to ``loss`` (one of :data:`LOSSES`).
    """

    name: str
    input_names: tuple[str, ...]
    input_shapes: tuple[InputDesc, ...]
    layers: tuple[LayerDesc, ...]
    output: str
    loss: str = "cross_entropy"
    granularity: str = "layer"

    def __post_init__(self):
        if len(self.input_shapes) != len(self.input_names):
            raise GPPConfigError(f'model "{self.name}": {len(self.input_shapes)} input shapes for '
                                 f"{len(self.input_names)} inputs")
        if self.loss not in LOSSES:
            raise GPPConfigError(f'model "{self.name}": unknown loss "{self.loss}"; valid: {LOSSES}')
        if self.granularity not in GRANULARITIES:
            raise GPPConfigError(f'model "{self.name}": unknown granularity "{self.granularity}"; '
                                 f"valid: {GRANULARITIES}")

    def layer(self, name: str) -> LayerDesc:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def count(self, kind: str) -> int:
        """How many layers of ``kind`` the model has."""
        return sum(layer.kind == kind for layer in self.layers)

    @property
    def num_params(self) -> int:
        return sum(param_count(layer) for layer in self.layers)


def param_count(layer: LayerDesc) -> int:
    """Trainable parameters of one layer, exactly as :mod:`.torch_layers` builds it.

    A transformer layer with hidden ``h`` and MLP ``f`` has ``4h^2 + 4h`` (Q, K, V and output
    projections with biases) ``+ 2hf + f + h`` (MLP) ``+ 4h`` (two layernorms): ``12h^2 + 13h``
    when ``f = 4h``.

    >>> param_count(LayerDesc("t", "transformer", ("x",), {"hidden": 4, "heads": 2, "ffn": 16, "seq": 3}))
    244
    """
    d = layer.dims
    if layer.kind == "linear":
        return d["in"] * d["out"] + d["out"]
    if layer.kind == "head":
        return d["in"] * d["out"] + d["out"]
    if layer.kind == "embedding_bag":
        return d["rows"] * d["dim"]
    if layer.kind == "layernorm":
        return 2 * d["hidden"]
    if layer.kind == "attention":
        return 4 * d["hidden"] ** 2 + 4 * d["hidden"]
    if layer.kind == "mlp":
        return 2 * d["hidden"] * d["ffn"] + d["ffn"] + d["hidden"]
    if layer.kind == "transformer":
        h, f = d["hidden"], d["ffn"]
        return (4 * h * h + 4 * h) + (2 * h * f + f + h) + 4 * h
    return 0  # concat


def output_elements(layer: LayerDesc) -> int:
    """Elements of the layer's output per sample (see the table in the module docstring)."""
    d = layer.dims
    if layer.kind in ("linear", "head"):
        return d["out"]
    if layer.kind == "embedding_bag":
        return d["bag"] * d["dim"]
    if layer.kind == "concat":
        return max(d["seq"], 1) * sum(d["widths"])
    return d["seq"] * d["hidden"]
