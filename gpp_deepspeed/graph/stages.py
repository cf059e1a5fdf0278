"""The stage graph: layers assigned to stages, and the tensors that flow between stages.

Glossary
--------
stage
    A node of the stage graph; one pipeline rank (per data-parallel replica) runs it.
stage edge
    ``src -> dst`` with the tensors that ``dst`` reads from ``src``, in message order. A tensor read
    by several stages is on one edge per reader (fan-out); a skip tensor goes straight from its
    producer to its reader, except in a chain (``relay=True``), where it is relayed through every
    stage in between, as DeepSpeed's ``PipelineEngine`` carries it.
output stage
    The stage holding the output layer: it reads the labels, computes the loss, and is the unique
    sink of the stage graph.
loading stages
    The stages that read the batch (``StageGraph.loading``): every stage whose layers read a graph
    input, which need not be a source of the stage graph, and the output stage.
depth
    Number of stages on the longest path from a stage to the output stage, itself included. In
    GraphPipe's synchronous 1F1B a stage keeps ``depth`` micro-batches in flight and runs
    ``depth - 1`` warm-up forwards (GraphPipe, arXiv 2406.17145, Sec. 6; for a chain this is
    PipeDream-Flush's ``S - i``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Collection, Mapping

import networkx as nx

from ..errors import PartitionError
from .ir import LayerGraph, TensorRef

__all__ = ["StageEdge", "StageGraph", "StageSpec", "Partition", "derive_partition", "mark_gradient_flow"]


@dataclass(frozen=True, slots=True)
class StageEdge:
    """Tensors sent from stage ``src`` to stage ``dst`` for every micro-batch, in order.

    ``grad`` is false when none of them depends on a trainable parameter (a frozen tower's
    output): then no gradient comes back along the edge.
    """

    src: int
    dst: int
    tensors: tuple[TensorRef, ...]
    grad: bool = True


@dataclass(frozen=True)
class StageGraph:
    """A DAG of stages with a unique sink, the output stage.

    >>> g = StageGraph(num_stages=3, edges=(StageEdge(0, 2, ()), StageEdge(1, 2, ())), output_stage=2)
    >>> [g.depth(s) for s in range(3)]
    [2, 2, 1]
    """

    num_stages: int
    edges: tuple[StageEdge, ...]
    output_stage: int
    frozen: frozenset[int] = frozenset()
    """Stages with nothing to differentiate (no trainable parameter, no input that needs a
    gradient): they run forwards only."""
    loading: frozenset[int] = None  # type: ignore[assignment]
    """Stages that read the batch: those whose layers read a graph input, and the output stage
    (labels). :func:`derive_partition` sets it from the layers; a graph built by hand gets the
    stages without predecessors and the output stage.

    >>> sorted(StageGraph.chain(3).loading)
    [0, 2]
    """

    def __post_init__(self):
        if self.loading is None:
            sources = {s for s in range(self.num_stages) if not self.preds(s)}
            object.__setattr__(self, "loading", frozenset(sources | {self.output_stage}))
        else:
            object.__setattr__(self, "loading", frozenset(self.loading))

    def preds(self, stage: int) -> list[int]:
        return [e.src for e in self.edges if e.dst == stage]

    def succs(self, stage: int) -> list[int]:
        return [e.dst for e in self.edges if e.src == stage]

    def grad_preds(self, stage: int) -> list[int]:
        """Predecessors this stage sends gradients back to."""
        return [e.src for e in self.edges if e.dst == stage and e.grad]

    def grad_succs(self, stage: int) -> list[int]:
        """Successors this stage receives gradients from."""
        return [e.dst for e in self.edges if e.src == stage and e.grad]

    def edge(self, src: int, dst: int) -> StageEdge:
        for e in self.edges:
            if e.src == src and e.dst == dst:
                return e
        raise KeyError((src, dst))

    @cached_property
    def _depths(self) -> tuple[int, ...]:
        depth = [0] * self.num_stages
        for s in reversed(self.topological_order()):
            depth[s] = 1 + max((depth[t] for t in self.succs(s)), default=0)
        return tuple(depth)

    def depth(self, stage: int) -> int:
        """Stages on the longest path from ``stage`` to the output stage, itself included."""
        return self._depths[stage]

    @property
    def pipeline_depth(self) -> int:
        """The longest path through the stage graph, in stages (the paper's pipeline depth)."""
        return max(self._depths)

    def topological_order(self) -> list[int]:
        g = nx.DiGraph()
        g.add_nodes_from(range(self.num_stages))
        g.add_edges_from((e.src, e.dst) for e in self.edges)
        return list(nx.lexicographical_topological_sort(g))

    def to_json(self) -> str:
        return json.dumps({
            "num_stages": self.num_stages,
            "output_stage": self.output_stage,
            "edges": [{"src": e.src, "dst": e.dst, "tensors": [str(t) for t in e.tensors], "grad": e.grad}
                      for e in self.edges],
            "frozen": sorted(self.frozen),
            "loading": sorted(self.loading),
        })

    @classmethod
    def from_json(cls, text: str) -> "StageGraph":
        d = json.loads(text)
        edges = tuple(StageEdge(e["src"], e["dst"], tuple(TensorRef.parse(t) for t in e["tensors"]), e.get("grad", True))
                      for e in d["edges"])
        loading = d.get("loading")
        return cls(num_stages=d["num_stages"], edges=edges, output_stage=d["output_stage"],
                   frozen=frozenset(d.get("frozen", ())), loading=None if loading is None else frozenset(loading))

    @classmethod
    def chain(cls, num_stages: int) -> "StageGraph":
        """The linear pipeline ``0 -> 1 -> ... -> S-1`` (what DeepSpeed runs)."""
        edges = tuple(StageEdge(s, s + 1, ()) for s in range(num_stages - 1))
        return cls(num_stages=num_stages, edges=edges, output_stage=num_stages - 1)


@dataclass(frozen=True, slots=True)
class StageSpec:
    """What one stage computes and exchanges.

    ``in_ports`` are the arguments of the stage's forward, in order: first the graph inputs it
    loads from the batch (``loads``, in ``input_names`` order), then the tensors it receives, edge
    by edge in increasing source stage. ``out_ports`` are the tensors it sends, each to every
    stage that reads it.
    """

    stage_idx: int
    layers: tuple[str, ...]
    loads: tuple[str, ...]
    in_ports: tuple[TensorRef, ...]
    out_ports: tuple[TensorRef, ...]


@dataclass(frozen=True)
class Partition:
    """Layers assigned to stages, with every stage's ports and the stage graph."""

    graph: LayerGraph
    stage_of: Mapping[str, int]
    stages: tuple[StageSpec, ...]
    stage_graph: StageGraph

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def layer_order(self) -> tuple[str, ...]:
        """All layers numbered stage by stage (each stage a contiguous index range)."""
        return tuple(name for spec in self.stages for name in spec.layers)

    @property
    def bounds(self) -> list[int]:
        """``S + 1`` cut points into :attr:`layer_order`, as DeepSpeed's ``PipelineModule.parts``."""
        parts = [0]
        for spec in self.stages:
            parts.append(parts[-1] + len(spec.layers))
        return parts

    def describe(self) -> str:
        """A human-readable listing of stages, their layers and the stage edges."""
        lines = [f"stage graph: {self.num_stages} stages, depth {self.stage_graph.pipeline_depth}, "
                 f"output stage {self.stage_graph.output_stage}"]
        for spec in self.stages:
            loads = f" loads {list(spec.loads)}" if spec.loads else ""
            frozen = " (frozen: forwards only)" if spec.stage_idx in self.stage_graph.frozen else ""
            lines.append(f"  stage {spec.stage_idx}: {list(spec.layers)}{loads}{frozen}")
        for e in self.stage_graph.edges:
            lines.append(f"  {e.src} -> {e.dst}: {[str(t) for t in e.tensors]}" + ("" if e.grad else " (no gradient)"))
        return "\n".join(lines)


def derive_partition(graph: LayerGraph, stage_of: Mapping[str, int], *, num_stages: int,
                     relay: bool = False) -> Partition:
    """Check an assignment of layers to stages and derive stage ports and the stage graph.

    With ``relay`` the stages form a chain ``0 -> 1 -> ... -> S-1`` in index order, as DeepSpeed's
    ``PipelineEngine`` runs them: edge ``k -> k+1`` carries every tensor produced on a stage up to
    ``k`` and read on a stage after it, so a tensor that skips stages passes through each stage in
    between (an in-port and an out-port there) and its gradient comes back the same way. Graph
    inputs are still loaded by the stages that read them.

    Raises :class:`PartitionError` when a layer is missing or unknown, a stage index is out of range,
    a stage is empty, the stages depend on each other in a cycle, or, with ``relay``, a layer reads
    a tensor of a later stage (so the output layer, which every layer reaches, is on the last one).

    >>> from gpp_deepspeed.graph import build_layer_graph
    >>> g = build_layer_graph(["x"], [("a", ["x"]), ("b", ["x"]), ("c", ["a", "b"])])
    >>> p = derive_partition(g, {"a": 0, "b": 1, "c": 2}, num_stages=3)
    >>> [(e.src, e.dst) for e in p.stage_graph.edges]
    [(0, 2), (1, 2)]
    >>> chain = derive_partition(g, {"a": 0, "b": 1, "c": 2}, num_stages=3, relay=True)
    >>> [(e.src, e.dst, [str(t) for t in e.tensors]) for e in chain.stage_graph.edges]
    [(0, 1, ['a']), (1, 2, ['a', 'b'])]
    >>> [str(t) for t in chain.stages[1].in_ports], [str(t) for t in chain.stages[1].out_ports]
    (['x', 'a'], ['a', 'b'])
    """
    names = set(graph.names)
    unknown = sorted(set(stage_of) - names)
    if unknown:
        raise PartitionError(f"partition names unknown layer(s) {unknown}; layers are {list(graph.names)}")
    missing = [n for n in graph.names if n not in stage_of]
    if missing:
        raise PartitionError(f"partition misses layer(s) {missing}: every layer needs a stage index")
    for name, s in stage_of.items():
        if not isinstance(s, int) or not 0 <= s < num_stages:
            raise PartitionError(f'layer "{name}" is assigned to stage {s!r}, outside 0..{num_stages - 1}')
    empty = [s for s in range(num_stages) if s not in set(stage_of.values())]
    if empty:
        raise PartitionError(f"stage(s) {empty} have no layers; {num_stages} stages need at least one layer each")

    position = {name: i for i, name in enumerate(graph.order)}
    producers: dict[tuple[int, int], set[TensorRef]] = {}
    for node in graph.nodes:
        dst = stage_of[node.name]
        for ref in node.inputs:
            if graph.is_input(ref) or stage_of[ref.node] == dst:
                continue
            producers.setdefault((stage_of[ref.node], dst), set()).add(ref)

    def ref_key(ref: TensorRef):
        return (position[ref.node], ref.sort_key())

    if relay:
        producers = _relayed(graph, stage_of, producers)
    edges = tuple(StageEdge(src, dst, tuple(sorted(refs, key=ref_key))) for (src, dst), refs in sorted(producers.items()))
    _check_stage_cycle(graph, stage_of, edges, num_stages)
    output_stage = stage_of[graph.output]

    stages = []
    nodes = {n.name: n for n in graph.nodes}   # graph.node() rebuilds this map on every call
    for s in range(num_stages):
        layers = tuple(n for n in graph.order if stage_of[n] == s)
        loads = tuple(i for i in graph.input_names
                      if any(graph.is_input(r) and r.node == i for n in layers for r in nodes[n].inputs))
        received = tuple(t for e in edges if e.dst == s for t in e.tensors)
        sent = sorted({t for e in edges if e.src == s for t in e.tensors}, key=ref_key)
        stages.append(StageSpec(stage_idx=s, layers=layers, loads=loads,
                                in_ports=tuple(TensorRef(i) for i in loads) + received, out_ports=tuple(sent)))
    loading = frozenset(spec.stage_idx for spec in stages if spec.loads) | {output_stage}
    stage_graph = StageGraph(num_stages=num_stages, edges=edges, output_stage=output_stage, loading=loading)
    sinks = [s for s in range(num_stages) if not stage_graph.succs(s)]
    assert sinks == [output_stage], (sinks, output_stage)  # every layer is an ancestor of the output
    return Partition(graph=graph, stage_of=dict(stage_of), stages=tuple(stages), stage_graph=stage_graph)


def mark_gradient_flow(partition: Partition, trainable: Collection[str]) -> Partition:
    """The partition with its stage graph told where gradients flow, given the layers that have
    trainable parameters.

    A layer's output needs a gradient if the layer is trainable or reads an output that needs
    one; an edge carries gradients back if one of its tensors needs one; a stage none of whose
    layers' outputs needs one and that sends no such tensor on is frozen (it runs no backward).

    >>> from gpp_deepspeed.graph import build_layer_graph
    >>> g = build_layer_graph(["x", "y"], [("a", ["x"]), ("b", ["y"]), ("c", ["a", "b"])])
    >>> p = mark_gradient_flow(derive_partition(g, {"a": 0, "b": 1, "c": 2}, num_stages=3), {"b", "c"})
    >>> [(e.src, e.dst, e.grad) for e in p.stage_graph.edges], sorted(p.stage_graph.frozen)
    ([(0, 2, False), (1, 2, True)], [0])
    """
    graph = partition.graph
    needs: set[str] = set()
    for name in graph.order:
        if name in trainable or any(r.node in needs for r in graph.node(name).inputs):
            needs.add(name)
    if graph.output not in needs:
        raise PartitionError(f'nothing is trained: no layer up to the output "{graph.output}" has a trainable parameter')
    sg = partition.stage_graph
    edges = tuple(replace(e, grad=any(t.node in needs for t in e.tensors)) for e in sg.edges)
    # A stage relaying another stage's tensor (a true chain) passes its gradient back too.
    relays = {e.src for e in edges if e.grad}
    frozen = frozenset(s.stage_idx for s in partition.stages
                       if not needs.intersection(s.layers) and s.stage_idx not in relays)
    return replace(partition, stage_graph=replace(sg, edges=edges, frozen=frozen))


def _relayed(graph: LayerGraph, stage_of: Mapping[str, int],
             producers: dict[tuple[int, int], set[TensorRef]]) -> dict[tuple[int, int], set[TensorRef]]:
    """The chain's edges: every tensor of edge ``src -> dst`` on each hop ``k -> k+1`` in between."""
    for (src, dst), refs in producers.items():
        if src > dst:
            ref = min(refs, key=str)
            reader = next(n.name for n in graph.nodes if stage_of[n.name] == dst and ref in n.inputs)
            raise PartitionError(f'a chain runs its stages in index order, but layer "{reader}" on stage {dst} reads '
                                 f'"{ref}" from stage {src}; list the layers so that each reads only earlier ones')
    hops: dict[tuple[int, int], set[TensorRef]] = {}
    for (src, dst), refs in producers.items():
        for k in range(src, dst):
            hops.setdefault((k, k + 1), set()).update(refs)
    return hops


def _check_stage_cycle(graph: LayerGraph, stage_of: Mapping[str, int], edges, num_stages: int) -> None:
    g = nx.DiGraph()
    g.add_nodes_from(range(num_stages))
    g.add_edges_from((e.src, e.dst) for e in edges)
    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        return
    hops = []
    for src, dst in cycle:
        edge = next(e for e in edges if e.src == src and e.dst == dst)
        ref = edge.tensors[0]
        reader = next(n.name for n in graph.nodes if stage_of[n.name] == dst and ref in n.inputs)
        hops.append(f'stage {src} -> stage {dst} (layer "{reader}" reads "{ref}")')
    raise PartitionError("the partition creates a cycle between stages: " + ", ".join(hops)
                         + "; move layers so that stages depend on each other without a loop")
