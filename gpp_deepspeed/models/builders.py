"""The GraphPipe paper's models as :class:`~.desc.ModelDesc` layer DAGs, at configurable sizes.

The defaults are the sizes of GraphPipe (arXiv 2406.17145) Appendix A.2; where A.2 is silent the
choice is ours and the docstring says so. :data:`TINY` holds each model at a size that trains in
seconds on a CPU, with the paper's branch structure and fewer, narrower layers.

Layer names use ``_`` separators (``.`` separates parameter names, ``:`` tuple elements), e.g.
``b0_l3`` (branch 0, transformer layer 3) or ``b0_l3_attn`` at sublayer granularity.

>>> m = multimodal_transformer()
>>> m.count("transformer"), [layer.name for layer in m.layers[-2:]]
(32, ['concat', 'head'])
>>> len(dlrm().input_names)
14
"""

from __future__ import annotations

from typing import Callable

from ..errors import GPPConfigError
from .desc import GRANULARITIES, InputDesc, LayerDesc, ModelDesc, output_elements

__all__ = ["multimodal_transformer", "sequential_transformer", "dlrm", "candle_uno", "BUILDERS", "TINY", "tiny"]


def _check(granularity: str, **sizes: int) -> None:
    if granularity not in GRANULARITIES:
        raise GPPConfigError(f'granularity must be one of {GRANULARITIES}, got "{granularity}"')
    for key, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise GPPConfigError(f"{key} must be a positive integer, got {value!r}")


def _transformer(prefix: str, x: str, *, hidden: int, heads: int, ffn: int, seq: int,
                 granularity: str) -> list[LayerDesc]:
    """One pre-LN transformer layer reading ``x``: one node, or four with the residual edges."""
    if hidden % heads:
        raise GPPConfigError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    if granularity == "layer":
        return [LayerDesc(prefix, "transformer", (x, ), {"hidden": hidden, "heads": heads, "ffn": ffn, "seq": seq})]
    return [
        LayerDesc(f"{prefix}_ln1", "layernorm", (x, ), {"hidden": hidden, "seq": seq}),
        LayerDesc(f"{prefix}_attn", "attention", (f"{prefix}_ln1", x), {"hidden": hidden, "heads": heads, "seq": seq}),
        LayerDesc(f"{prefix}_ln2", "layernorm", (f"{prefix}_attn", ), {"hidden": hidden, "seq": seq}),
        LayerDesc(f"{prefix}_mlp", "mlp", (f"{prefix}_ln2", f"{prefix}_attn"),
                  {"hidden": hidden, "ffn": ffn, "seq": seq}),
    ]


def _ff_chain(prefix: str, x: str, widths: list[int]) -> list[LayerDesc]:
    """Linear + ReLU layers ``widths[0] -> widths[1] -> ...`` named ``<prefix>_fc<i>``."""
    layers, src = [], x
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(LayerDesc(f"{prefix}_fc{i}", "linear", (src, ), {"in": a, "out": b, "activation": "relu"}))
        src = layers[-1].name
    return layers


def _concat(name: str, layers: list[LayerDesc], sources: list[str], *, seq: int = 0) -> LayerDesc:
    """Concatenate ``sources`` (layers of ``layers``) along the feature dimension."""
    by_name = {layer.name: layer for layer in layers}
    widths = tuple(output_elements(by_name[s]) // max(seq, 1) for s in sources)
    return LayerDesc(name, "concat", tuple(sources), {"widths": widths, "seq": seq})


def multimodal_transformer(branches: int = 4, layers_per_branch: int = 8, hidden: int = 1024, heads: int = 16,
                           ffn: int = 4096, seq: int = 256, classes: int = 1000, *,
                           granularity: str = "layer") -> ModelDesc:
    """MMT: ``branches`` modalities, each a token-embedding input ``[seq, hidden]`` and a chain of
    ``layers_per_branch`` transformer layers; the branch outputs are concatenated along the
    features, mean-pooled over the sequence and classified (GraphPipe A.2: 4 branches of 8
    layers, sequence 256, hidden 1024, 16 heads, FFN 4096). A.2 gives no head; a
    ``classes``-way classifier with cross-entropy is our choice (0.3% of the parameters)."""
    _check(granularity, branches=branches, layers_per_branch=layers_per_branch, hidden=hidden, heads=heads,
           ffn=ffn, seq=seq, classes=classes)
    layers: list[LayerDesc] = []
    ends = []
    for b in range(branches):
        src = f"tokens{b}"
        for i in range(layers_per_branch):
            layers += _transformer(f"b{b}_l{i}", src, hidden=hidden, heads=heads, ffn=ffn, seq=seq,
                                   granularity=granularity)
            src = layers[-1].name
        ends.append(src)
    layers.append(_concat("concat", layers, ends, seq=seq))
    layers.append(LayerDesc("head", "head", ("concat", ), {"in": branches * hidden, "out": classes, "seq": seq}))
    return ModelDesc("mmt", tuple(f"tokens{b}" for b in range(branches)),
                     tuple(InputDesc((seq, hidden)) for _ in range(branches)), tuple(layers), "head",
                     loss="cross_entropy", granularity=granularity)


def sequential_transformer(layers: int = 32, hidden: int = 1024, heads: int = 16, ffn: int = 4096, seq: int = 256,
                           classes: int = 1000, *, granularity: str = "layer") -> ModelDesc:
    """The sequential control of GraphPipe A.3: MMT's sizes as one chain of ``layers`` transformer
    layers over one ``[seq, hidden]`` input, then the same pooled classifier."""
    _check(granularity, layers=layers, hidden=hidden, heads=heads, ffn=ffn, seq=seq, classes=classes)
    out: list[LayerDesc] = []
    src = "tokens"
    for i in range(layers):
        out += _transformer(f"l{i}", src, hidden=hidden, heads=heads, ffn=ffn, seq=seq, granularity=granularity)
        src = out[-1].name
    out.append(LayerDesc("head", "head", (src, ), {"in": hidden, "out": classes, "seq": seq}))
    return ModelDesc("sequential_transformer", ("tokens", ), (InputDesc((seq, hidden)), ), tuple(out), "head",
                     loss="cross_entropy", granularity=granularity)


def dlrm(dense_branches: int = 7, dense_layers: int = 4, dense_hidden: int = 4096, sparse_branches: int = 7,
         embedding_dim: int = 64, bag_size: int = 100, rows: int = 1_000_000, top_layers: int = 4,
         top_hidden: int = 4096, dense_features: int | None = None, *, granularity: str = "layer") -> ModelDesc:
    """DLRM (GraphPipe A.2): ``dense_branches`` dense-feature inputs, each through ``dense_layers``
    FF layers of ``dense_hidden``; ``sparse_branches`` embedding tables of ``rows`` x
    ``embedding_dim`` looked up by a bag of ``bag_size`` indices whose embeddings are
    concatenated (A.2), not summed; all branches concatenated (the "interaction"), then
    ``top_layers`` FF layers of ``top_hidden`` and a one-logit click head (binary
    cross-entropy). Dense features default to ``dense_hidden`` (A.2: "dense feature / FF hidden
    4096"). A.2 does not give the number of top layers; 4, the depth of a dense branch, is ours.
    """
    dense_features = dense_hidden if dense_features is None else dense_features
    _check(granularity, dense_branches=dense_branches, dense_layers=dense_layers, dense_hidden=dense_hidden,
           sparse_branches=sparse_branches, embedding_dim=embedding_dim, bag_size=bag_size, rows=rows,
           top_layers=top_layers, top_hidden=top_hidden, dense_features=dense_features)
    layers: list[LayerDesc] = []
    ends = []
    for i in range(dense_branches):
        layers += _ff_chain(f"dense{i}", f"dense{i}", [dense_features] + [dense_hidden] * dense_layers)
        ends.append(layers[-1].name)
    for i in range(sparse_branches):
        layers.append(LayerDesc(f"emb{i}", "embedding_bag", (f"sparse{i}", ),
                                {"rows": rows, "dim": embedding_dim, "bag": bag_size}))
        ends.append(layers[-1].name)
    layers.append(_concat("interaction", layers, ends))
    width = sum(layers[-1].dims["widths"])
    layers += _ff_chain("top", "interaction", [width] + [top_hidden] * top_layers)
    layers.append(LayerDesc("head", "head", (layers[-1].name, ), {"in": top_hidden, "out": 1, "seq": 0}))
    names = tuple(f"dense{i}" for i in range(dense_branches)) + tuple(f"sparse{i}" for i in range(sparse_branches))
    shapes = (tuple(InputDesc((dense_features, )) for _ in range(dense_branches))
              + tuple(InputDesc((bag_size, ), "int64", rows) for _ in range(sparse_branches)))
    return ModelDesc("dlrm", names, shapes, tuple(layers), "head", loss="bce", granularity=granularity)


def candle_uno(branches: int = 7, layers_per_branch: int = 4, hidden: int = 4096, input_features: int | None = None,
               top_layers: int = 4, top_hidden: int = 4096, *, granularity: str = "layer") -> ModelDesc:
    """CANDLE-Uno (GraphPipe A.2: 7 branches of 4 FF layers, all FF hidden 4096): one feature
    input per branch, concatenated, ``top_layers`` FF layers and a one-output regression head
    (drug response, mean squared error). The top depth, 4, follows the authors' prototype
    (FlexFlow PR #308 ``candle_uno.cc``: concat then 4 dense layers); input features default
    to ``hidden`` as A.2 gives none. Fig. 7 sweeps ``branches`` over 2, 4, 8, 16."""
    input_features = hidden if input_features is None else input_features
    _check(granularity, branches=branches, layers_per_branch=layers_per_branch, hidden=hidden,
           input_features=input_features, top_layers=top_layers, top_hidden=top_hidden)
    layers: list[LayerDesc] = []
    for i in range(branches):
        layers += _ff_chain(f"branch{i}", f"feature{i}", [input_features] + [hidden] * layers_per_branch)
    layers.append(_concat("concat", layers, [f"branch{i}_fc{layers_per_branch - 1}" for i in range(branches)]))
    layers += _ff_chain("top", "concat", [branches * hidden] + [top_hidden] * top_layers)
    layers.append(LayerDesc("head", "head", (layers[-1].name, ), {"in": top_hidden, "out": 1, "seq": 0}))
    return ModelDesc("candle_uno", tuple(f"feature{i}" for i in range(branches)),
                     tuple(InputDesc((input_features, )) for _ in range(branches)), tuple(layers), "head",
                     loss="mse", granularity=granularity)


BUILDERS: dict[str, Callable[..., ModelDesc]] = {
    "mmt": multimodal_transformer, "dlrm": dlrm, "candle_uno": candle_uno,
    "sequential_transformer": sequential_transformer,
}

# CPU-sized presets: the paper's branch counts, 2 layers per branch instead of 4 or 8, width 16.
TINY: dict[str, dict] = {
    "mmt": dict(branches=4, layers_per_branch=2, hidden=16, heads=2, ffn=32, seq=8, classes=5),
    "dlrm": dict(dense_branches=7, dense_layers=2, dense_hidden=16, sparse_branches=7, embedding_dim=4, bag_size=3,
                 rows=100, top_layers=2, top_hidden=16),
    "candle_uno": dict(branches=7, layers_per_branch=2, hidden=16, top_layers=2, top_hidden=16),
    "sequential_transformer": dict(layers=8, hidden=16, heads=2, ffn=32, seq=8, classes=5),
}


def tiny(name: str, *, granularity: str = "layer", **overrides) -> ModelDesc:
    """Model ``name`` (a key of :data:`BUILDERS`) at its :data:`TINY` size.

    >>> tiny("mmt").count("transformer")
    8
    """
    if name not in BUILDERS:
        raise GPPConfigError(f'unknown model "{name}"; valid: {sorted(BUILDERS)}')
    return BUILDERS[name](**{**TINY[name], **overrides}, granularity=granularity)
