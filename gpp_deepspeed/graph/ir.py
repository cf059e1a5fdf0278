"""The layer graph: what the user writes, as pure data (no torch, no deepspeed).

Glossary
--------
graph input
    A tensor fed from the batch, named in ``input_names`` (``"text"``, ``"image"``).
layer
    A node with a unique name; its forward takes its inputs positionally.
tensor ref
    ``"name"`` (a graph input or a layer's whole output), ``"name:i"`` (element ``i`` of a layer
    that returns a tuple) or ``"name.key"`` (a key or attribute of a structured output: a dict, a
    dataclass, a ``transformers`` ``ModelOutput``); steps chain. :class:`TensorRef` is its parsed
    form.
output
    The layer whose output goes to the loss function.

Every function here is pure and returns new frozen objects; invalid graphs raise
:class:`~gpp_deepspeed.errors.GraphError` naming the layer at fault.
"""

from __future__ import annotations

import json
import re
import functools
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import networkx as nx

from ..errors import GraphError

__all__ = ["TensorRef", "LayerNode", "LayerGraph", "build_layer_graph"]


_STEP_RE = re.compile(r"(:-?\d+)|(\.[A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A reference to a tensor: a graph input, a layer's output, or a leaf inside that output.

    ``path`` selects into a structured output, one step at a time: an ``int`` indexes a tuple or
    list (``"enc:1"``), a ``str`` picks a key of a dict or an attribute of a dataclass or a
    ``transformers`` ``ModelOutput`` (``"vision.pooler_output"``). Steps chain:
    ``"enc.hidden_states:-1"``. The producer's stage applies the path, so only the selected
    leaves cross a stage edge.

    >>> TensorRef.parse("enc:1")
    TensorRef(node='enc', path=(1,))
    >>> TensorRef.parse("vision.hidden_states:-1").path
    ('hidden_states', -1)
    >>> str(TensorRef("enc", 0)), str(TensorRef("enc"))
    ('enc:0', 'enc')
    """

    node: str
    path: tuple[int | str, ...] = ()

    def __post_init__(self):
        if isinstance(self.path, (int, str)):   # TensorRef("enc", 0): one step
            object.__setattr__(self, "path", (self.path, ))
        elif self.path is None:
            object.__setattr__(self, "path", ())
        else:
            object.__setattr__(self, "path", tuple(self.path))

    @property
    def index(self) -> int | None:
        """The tuple index of a ``"name:i"`` reference; ``None`` for any other form."""
        return self.path[0] if len(self.path) == 1 and isinstance(self.path[0], int) else None

    @property
    def whole(self) -> "TensorRef":
        """The reference to the whole output this one selects from."""
        return TensorRef(self.node)

    @classmethod
    def parse(cls, text: str | "TensorRef") -> "TensorRef":
        if isinstance(text, TensorRef):
            return text
        if not isinstance(text, str) or not text:
            raise GraphError(f"an input reference must be a non-empty string, got {text!r}")
        return _parse_ref(cls, text)

    def __str__(self) -> str:
        return self.node + "".join(f":{p}" if isinstance(p, int) else f".{p}" for p in self.path)

    def sort_key(self) -> tuple:
        """Orders references of one node: the whole output first, then by path (ints before keys)."""
        return tuple((0, p, "") if isinstance(p, int) else (1, 0, p) for p in self.path)


@dataclass(frozen=True, slots=True)
class LayerNode:
    """One layer of the graph: its name and the tensors its forward takes, in order."""

    name: str
    inputs: tuple[TensorRef, ...]


@dataclass(frozen=True, slots=True)
class LayerGraph:
    """A validated DAG of layers.

    ``nodes`` keeps the user's list order; ``order`` is a topological order in which the layers of
    each branch are contiguous (a depth-first post-order from the output), which is the order in
    which stages are cut and layers are numbered.
    """

    input_names: tuple[str, ...]
    nodes: tuple[LayerNode, ...]
    output: str
    order: tuple[str, ...] = field(default=())

    def node(self, name: str) -> LayerNode:
        return self._by_name()[name]

    def _by_name(self) -> dict[str, LayerNode]:
        return {n.name: n for n in self.nodes}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)

    def is_input(self, ref: TensorRef) -> bool:
        return not ref.path and ref.node in self.input_names

    def consumers(self) -> dict[str, list[str]]:
        """Layer or input name -> names of the layers that read it, in list order."""
        out: dict[str, list[str]] = {name: [] for name in (*self.input_names, *self.names)}
        for node in self.nodes:
            for ref in node.inputs:
                if node.name not in out[ref.node]:
                    out[ref.node].append(node.name)
        return out

    def list_topological_order(self) -> tuple[str, ...]:
        """A topological order that keeps the user's list order wherever it can.

        For a chain (a plain DeepSpeed layer list) it is the list itself.
        """
        graph = _to_nx(self)
        rank = {name: i for i, name in enumerate(self.names)}
        layers = nx.lexicographical_topological_sort(graph, key=lambda n: rank.get(n, -1))
        return tuple(n for n in layers if n in rank)

    def to_json(self) -> str:
        return json.dumps({
            "input_names": list(self.input_names),
            "nodes": [{"name": n.name, "inputs": [str(r) for r in n.inputs]} for n in self.nodes],
            "output": self.output,
        })

    @classmethod
    def from_json(cls, text: str) -> "LayerGraph":
        data = json.loads(text)
        return build_layer_graph(data["input_names"], [(n["name"], n["inputs"]) for n in data["nodes"]],
                                 output=data["output"])


def _to_nx(graph: LayerGraph) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(graph.input_names)
    for node in graph.nodes:
        g.add_node(node.name)
        for ref in node.inputs:
            g.add_edge(ref.node, node.name)
    return g


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise GraphError(f"every {what} needs a non-empty string name, got {name!r}")
    for bad in (":", "."):
        if bad in name:
            raise GraphError(f'{what} name "{name}" must not contain "{bad}" '
                             f'(":" selects a tuple element and "." separates parameter names)')
    return name


def build_layer_graph(input_names: Sequence[str], nodes: Iterable[tuple[str, Sequence[str | TensorRef]]], *,
                      output: str | None = None) -> LayerGraph:
    """Validate a layer DAG and return it as a :class:`LayerGraph`.

    Parameters
    ----------
    input_names : names of the graph inputs, in the order batches provide them.
    nodes : ``(name, inputs)`` pairs in the user's list order.
    output : the layer whose output goes to the loss; default the last one.

    Examples
    --------
    >>> g = build_layer_graph(["x"], [("a", ["x"]), ("b", ["x"]), ("c", ["a", "b"])])
    >>> g.order
    ('a', 'b', 'c')
    >>> build_layer_graph(["x"], [("a", ["y"])])
    Traceback (most recent call last):
    ...
    gpp_deepspeed.errors.GraphError: layer "a" reads "y", which is neither a graph input (['x']) nor a layer
    """
    input_names = tuple(_check_name(n, "graph input") for n in input_names)
    if not input_names:
        raise GraphError("a graph needs at least one input name")
    if len(set(input_names)) != len(input_names):
        raise GraphError(f"duplicate graph input names in {list(input_names)}")
    layer_nodes = []
    seen: set[str] = set()
    for name, inputs in nodes:
        _check_name(name, "layer")
        if name in seen:
            raise GraphError(f'duplicate layer name "{name}": every layer needs a unique name')
        if name in input_names:
            raise GraphError(f'layer name "{name}" is also a graph input name')
        seen.add(name)
        refs = tuple(TensorRef.parse(r) for r in inputs)
        if not refs:
            raise GraphError(f'layer "{name}" has no inputs; give it inputs=[...]')
        layer_nodes.append(LayerNode(name, refs))
    if not layer_nodes:
        raise GraphError("a graph needs at least one layer")
    for node in layer_nodes:
        for ref in node.inputs:
            if ref.node in input_names:
                if ref.path:
                    raise GraphError(f'layer "{node.name}" reads "{ref}", but graph input "{ref.node}" '
                                     'is a single tensor and cannot be indexed')
            elif ref.node not in seen:
                raise GraphError(f'layer "{node.name}" reads "{ref.node}", which is neither a graph input '
                                 f'({list(input_names)}) nor a layer')
    output = layer_nodes[-1].name if output is None else output
    if output not in seen:
        raise GraphError(f'output "{output}" is not a layer name')

    draft = LayerGraph(input_names, tuple(layer_nodes), output)
    g = _to_nx(draft)
    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle:
        path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
        raise GraphError(f"the layer graph has a cycle: {path}")
    needed = nx.ancestors(g, output) | {output}
    dangling = [n.name for n in layer_nodes if n.name not in needed]
    if dangling:
        raise GraphError(f"no path connects layer(s) {dangling} to the output \"{output}\"; "
                         "remove them or route their result into the output")
    return LayerGraph(input_names, tuple(layer_nodes), output, order=_branch_order(draft))


def _branch_order(graph: LayerGraph) -> tuple[str, ...]:
    """Depth-first post-order from the output, inputs visited in order: a topological order
    in which each input branch of a merge is contiguous."""
    by_name = graph._by_name()
    order: list[str] = []
    done: set[str] = set()
    stack: list[tuple[str, int]] = [(graph.output, 0)]
    while stack:
        name, i = stack.pop()
        node = by_name[name]
        if i < len(node.inputs):
            stack.append((name, i + 1))
            dep = node.inputs[i].node
            if dep in by_name and dep not in done and all(dep != s for s, _ in stack):
                stack.append((dep, 0))
        elif name not in done:
            done.add(name)
            order.append(name)
    return tuple(order)


@functools.lru_cache(maxsize=4096)
def _parse_ref(cls, text: str) -> TensorRef:
    """:meth:`TensorRef.parse` of a string, made once: the interpreter parses every layer's input
    references at every call."""
    cut = min((i for i in (text.find(":"), text.find(".")) if i >= 0), default=len(text))
    node, rest = text[:cut], text[cut:]
    if not node:
        raise GraphError(f'bad input reference "{text}": it names no layer or graph input before "{rest[:1]}"')
    steps: list[int | str] = []
    pos = 0
    while pos < len(rest):
        m = _STEP_RE.match(rest, pos)
        if not m:
            raise GraphError(f'bad input reference "{text}": expected "name", "name:i" (an integer i) or '
                             '"name.key", steps chained as in "enc.hidden_states:-1"')
        steps.append(int(m.group(1)[1:]) if m.group(1) else m.group(2)[1:])
        pos = m.end()
    return cls(node, tuple(steps))
