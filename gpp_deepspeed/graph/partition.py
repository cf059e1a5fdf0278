"""Partitioners that cut a topological order of the layers into contiguous, balanced stages.

Both minimise the heaviest stage (``max`` of summed layer weights, the pipeline's bottleneck) and
return ``{layer_name: stage_idx}``; :func:`~gpp_deepspeed.graph.stages.derive_partition` then
derives the stage graph from the layer edges, so stages that share no tensor run side by side.

* :func:`sequential_partition` cuts the list order: the chain baseline, what DeepSpeed's
  ``PipelineModule`` does.
* :func:`balanced_partition` cuts the branch-contiguous order of :class:`LayerGraph` and, among cuts
  with the same bottleneck, prefers to end a stage where the next layer starts a new branch or
  merges branches, so that independent branches land on different stages (a shallower stage graph).
  GraphPipe's own search (arXiv 2406.17145, Sec. 5) arrives as a separate planner.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import PartitionError
from .ir import LayerGraph

__all__ = ["balanced_partition", "sequential_partition", "min_bottleneck"]


def _check_counts(graph: LayerGraph, num_stages: int, weights: Sequence[float]) -> None:
    if num_stages < 1:
        raise PartitionError(f"num_stages must be at least 1, got {num_stages}")
    if num_stages > len(graph.nodes):
        raise PartitionError(f"{num_stages} stages but only {len(graph.nodes)} layers: "
                             "every stage needs at least one layer; use fewer stages")
    if len(weights) != len(graph.nodes):
        raise PartitionError(f"{len(weights)} weights for {len(graph.nodes)} layers")


def _parts_needed(weights: Sequence[float], cap: float) -> int:
    """Fewest contiguous parts with sums <= cap (greedy is optimal for contiguous packing)."""
    parts, load = 1, 0.0
    for w in weights:
        if load + w > cap and load > 0:
            parts, load = parts + 1, 0.0
        load += w
    return parts


def min_bottleneck(weights: Sequence[float], num_parts: int) -> float:
    """The least possible heaviest part when ``weights`` are cut into ``num_parts`` contiguous parts.

    >>> min_bottleneck([1, 2, 3, 4], 2)
    6
    """
    candidates = sorted(_subarray_sums(weights))
    lo, hi = 0, len(candidates) - 1
    floor = max(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if candidates[mid] >= floor and _parts_needed(weights, candidates[mid]) <= num_parts:
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]


def _cut(order: Sequence[str], weights: dict[str, float], num_stages: int, graph: LayerGraph | None,
         cap: float | None = None) -> dict[str, int]:
    w = [weights[n] for n in order]
    cap = min_bottleneck(w, num_stages) if cap is None else cap
    inputs_of = {n.name: {r.node for r in n.inputs} for n in graph.nodes} if graph is not None else {}
    stage_of: dict[str, int] = {}
    stage, load, current = 0, 0.0, set()
    for i, name in enumerate(order):
        if current:
            parts_left = num_stages - stage - 1
            must = load + w[i] > cap or len(order) - i == parts_left
            want = False
            if graph is not None and parts_left > 0 and len(order) - i >= parts_left:
                deps = inputs_of[name]
                new_branch = not (deps & current)
                earlier = {stage_of[d] for d in deps if d in stage_of and d not in current}
                current_preds = {stage_of[d] for n in current for d in inputs_of[n]
                                 if d in stage_of and d not in current}
                merge = bool(earlier - current_preds)
                want = (new_branch or merge) and _parts_needed(w[i:], cap) <= parts_left
            if must or want:
                stage, load, current = stage + 1, 0.0, set()
        stage_of[name] = stage
        load += w[i]
        current.add(name)
    return _split_until(order, w, stage_of, num_stages)


def _split_until(order: Sequence[str], w: Sequence[float], stage_of: dict[str, int], num_stages: int) -> dict[str, int]:
    """Split the heaviest multi-layer stage in two until there are ``num_stages`` stages."""
    groups: list[list[int]] = []
    for i, name in enumerate(order):
        if not groups or stage_of[order[groups[-1][-1]]] != stage_of[name]:
            groups.append([])
        groups[-1].append(i)
    while len(groups) < num_stages:
        k = max((g for g in range(len(groups)) if len(groups[g]) > 1), key=lambda g: sum(w[i] for i in groups[g]))
        g = groups[k]
        total, run, at = sum(w[i] for i in g), 0.0, 1
        for j in range(1, len(g)):
            run += w[g[j - 1]]
            if run >= total / 2:
                at = j
                break
        groups[k:k + 1] = [g[:at], g[at:]]
    return {order[i]: s for s, g in enumerate(groups) for i in g}


def sequential_partition(graph: LayerGraph, num_stages: int, *, weights: Sequence[float]) -> dict[str, int]:
    """Cut the list order (a topological order) into contiguous stages of balanced weight.

    ``weights`` are per layer, in ``graph.nodes`` order.

    >>> from gpp_deepspeed.graph import build_layer_graph
    >>> g = build_layer_graph(["x"], [("a", ["x"]), ("b", ["x"]), ("c", ["a", "b"]), ("d", ["c"])])
    >>> sequential_partition(g, 2, weights=[1, 1, 1, 1])
    {'a': 0, 'b': 0, 'c': 1, 'd': 1}
    """
    _check_counts(graph, num_stages, weights)
    by_name = dict(zip(graph.names, weights))
    return _cut(graph.list_topological_order(), by_name, num_stages, None)


def balanced_partition(graph: LayerGraph, num_stages: int, *, weights: Sequence[float],
                       slack: float = 0.0) -> dict[str, int]:
    """Cut the branch-contiguous order into balanced stages, keeping branches on separate stages.

    With ``slack > 0`` the heaviest stage may exceed the least possible one by up to that fraction
    when this makes the stage graph shallower (fewer warm-up forwards and in-flight micro-batches);
    among the shallowest candidates the lightest bottleneck wins.

    >>> from gpp_deepspeed.graph import build_layer_graph
    >>> g = build_layer_graph(["x"], [("a", ["x"]), ("b", ["x"]), ("c", ["a", "b"])])
    >>> balanced_partition(g, 3, weights=[1, 1, 1])
    {'a': 0, 'b': 1, 'c': 2}
    """
    _check_counts(graph, num_stages, weights)
    by_name = dict(zip(graph.names, weights))
    w = [by_name[n] for n in graph.order]
    best = min_bottleneck(w, num_stages)
    caps = sorted({c for c in _subarray_sums(w) if best <= c <= best * (1 + slack)})
    if len(caps) > 64:  # a sample of the range is enough to find the shallower cuts
        caps = [caps[round(i * (len(caps) - 1) / 63)] for i in range(64)]
    candidates = [_cut(graph.order, by_name, num_stages, graph, cap=c) for c in caps]
    return min(candidates, key=lambda so: (_depth(graph, so), _bottleneck(by_name, so)))


def _subarray_sums(w: Sequence[float]) -> set[float]:
    prefix = [0]
    for x in w:
        prefix.append(prefix[-1] + x)
    return {prefix[j] - prefix[i] for i in range(len(w)) for j in range(i + 1, len(w) + 1)}


def _bottleneck(weights: dict[str, float], stage_of: dict[str, int]) -> float:
    loads: dict[int, float] = {}
    for name, s in stage_of.items():
        loads[s] = loads.get(s, 0) + weights[name]
    return max(loads.values())


def _depth(graph: LayerGraph, stage_of: dict[str, int]) -> int:
    """Stages on the longest path of the stage graph that ``stage_of`` induces."""
    succs: dict[int, set[int]] = {s: set() for s in stage_of.values()}
    for node in graph.nodes:
        for ref in node.inputs:
            if ref.node in stage_of and stage_of[ref.node] != stage_of[node.name]:
                succs[stage_of[ref.node]].add(stage_of[node.name])
    depth: dict[int, int] = {}
    for s in sorted(succs, reverse=True):  # stages of a cut are numbered in topological order
        depth[s] = 1 + max((depth[t] for t in succs[s]), default=0)
    return max(depth.values())
