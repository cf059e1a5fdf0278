"""Keep the batch dimension of a shape-specialised capture symbolic.

The shaped trace (:mod:`gpp_deepspeed.frontend._tracing`) writes every size it reads as a constant:
Llama's mask code becomes ``arange(4)`` and ``expand(4, -1, 6, 6)`` for a micro-batch of 4 rows.
Tracing again at 5 and 6 rows shows which constants follow the rows: those that change, linearly,
between three traces that are otherwise the same graph. Each function layer then computes them from
the rows of a tensor it holds (``x.size(0)``), so one capture serves every micro-batch size and
every per-stage degree (a rank of a stage of degree ``n`` sees ``b / n`` rows).

Glossary
--------
rows
    The size of dimension 0 of every graph input: the micro-batch as one rank sees it.
batch argument
    An integer argument of a node equal to ``coef * rows + offset`` in every trace
    (``node.meta[BATCH_ARGS]``: ``[(path, coef, offset)]``, ``path`` into ``(args, kwargs)``).
batch dimension
    A dimension of a node's value whose size is the rows in every trace (``node.meta[BATCH_DIM]``).

When the three traces differ in anything else (their structure: Llava unrolls
``list(image_features)`` into one node per row; a constant that is not linear in the rows), nothing
is marked and the capture stays specialised to the example's rows.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch import fx

from ._tracing import META
from ..errors import GraphError

__all__ = ["BATCH_ARGS", "BATCH_DIM", "mark_batch", "batch_source", "substitute_batch"]

BATCH_ARGS = "gpp_batch_args"
BATCH_DIM = "gpp_batch_dim"


def mark_batch(graph: fx.Graph, consts: dict, trace_at: Callable[[int], tuple[fx.Graph, dict]], rows: int) -> bool:
    """Mark the batch arguments and dimensions of ``graph`` (traced at ``rows``) by comparing it
    with ``trace_at(rows + 1)`` and ``trace_at(rows + 2)``; return whether the batch dimension is
    symbolic (False: nothing marked, the graph stays specialised)."""
    try:
        others = [trace_at(rows + k) for k in (1, 2)]
    except GraphError:
        return False
    if any(not _same_consts(consts, c) for _, c in others):
        return False
    columns = [list(graph.nodes), *(list(g.nodes) for g, _ in others)]
    if len({len(c) for c in columns}) != 1:
        return False
    marks: dict[fx.Node, tuple[list, int | None]] = {}
    for node, *later in zip(*columns):
        if any((o.op, o.name, o.target) != (node.op, node.name, node.target) for o in later):
            return False
        leaves = [_leaves((n.args, n.kwargs)) for n in (node, *later)]
        if len({tuple(p for p, _ in leaf) for leaf in leaves}) != 1:
            return False
        args = []
        for (path, v0), (_, v1), (_, v2) in zip(*leaves):
            if _same(v0, v1) and _same(v1, v2):
                continue
            if not all(type(v) is int for v in (v0, v1, v2)) or v2 - v1 != v1 - v0:
                return False
            args.append((path, v1 - v0, v0 - (v1 - v0) * rows))
        marks[node] = (args, _batch_dim([n.meta.get(META) for n in (node, *later)], rows))
    for node, (args, dim) in marks.items():
        if args:
            node.meta[BATCH_ARGS] = args
        if dim is not None:
            node.meta[BATCH_DIM] = dim
    return True


def batch_source(nodes: list[fx.Node]) -> fx.Node | None:
    """The first of ``nodes`` whose value has a batch dimension."""
    return next((n for n in nodes if BATCH_DIM in n.meta), None)


def substitute_batch(sub: fx.Graph, copied: fx.Node, original: fx.Node, rows: Callable[[], fx.Node]) -> None:
    """Replace the batch arguments of ``copied`` (the copy in ``sub`` of ``original``) by nodes
    computing them from ``rows()`` (a node of ``sub`` holding the rows)."""
    if BATCH_ARGS not in original.meta:
        return
    args, kwargs = copied.args, copied.kwargs
    with sub.inserting_before(copied):
        for path, coef, offset in original.meta[BATCH_ARGS]:
            value = rows()
            if coef != 1:
                value = sub.call_function(operator.mul, (value, coef))
            if offset:
                value = sub.call_function(operator.add, (value, offset))
            args, kwargs = _replace((args, kwargs), path, value)
    copied.args, copied.kwargs = args, kwargs


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):   # meta tensors: no values to compare
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype
    return type(a) is type(b) and a == b


def _batch_dim(values: list[Any], rows: int) -> int | None:
    if not all(torch.is_tensor(v) for v in values):
        return None
    dims = [d for d in range(values[0].dim()) if [v.shape[d] if d < v.dim() else None for v in values]
            == [rows, rows + 1, rows + 2]]
    return dims[0] if dims else None


def _same_consts(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)


def _leaves(value: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """``(path, leaf)`` of every leaf of a node's arguments; nodes become their names."""
    if isinstance(value, fx.Node):
        return [(path, ("node", value.name))]
    if isinstance(value, (tuple, list)):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, path + (i, ))]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, path + (k, ))]
    if isinstance(value, slice):
        return [leaf for k in ("start", "stop", "step") for leaf in _leaves(getattr(value, k), path + (k, ))]
    return [(path, value)]


def _replace(value: Any, path: tuple, new: Any) -> Any:
    """``value`` with the leaf at ``path`` replaced by ``new`` (containers rebuilt, same types)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, slice):
        parts = {k: getattr(value, k) for k in ("start", "stop", "step")}
        parts[head] = _replace(parts[head], rest, new)
        return slice(parts["start"], parts["stop"], parts["step"])
    if isinstance(value, dict):
        return {**value, head: _replace(value[head], rest, new)}
    items = list(value)
    items[head] = _replace(items[head], rest, new)
    if isinstance(value, torch.Size):
        return tuple(items)     # a torch.Size holds ints only; a tuple holds the node
    return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
