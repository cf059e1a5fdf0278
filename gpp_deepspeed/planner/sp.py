"""Series-parallel (SP) decomposition of a layer DAG: the tree GraphPipe's partition search runs over.

GraphPipe (arXiv 2406.17145, Sec. 5) searches stage partitions by dynamic programming over a
series-parallel decomposition of the model's graph: a series split cuts a graph into a front and
a back part, a parallel split gives independent branches their own devices. This module builds
that decomposition and, for the rare graph that is not SP, an SP graph that computes the same
thing (Sec. 5: "converting the DNN to an arithmetically identical one whose structure is a
series-parallel graph").

Glossary
--------
node-SP tree
    An :data:`SPTree`: every layer is one :class:`Leaf`; a :class:`Series` runs its children one
    after the other (every sink of child ``i`` feeds every source of child ``i + 1``); a
    :class:`Parallel` has no edge between its children. Layers are nodes, not edges, so each layer
    sits in exactly one leaf and can be placed on exactly one stage.
canonical tree
    No Series directly inside a Series and no Parallel directly inside a Parallel. Series children
    come in precedence order; Parallel children by the first position of any of their layers in
    the graph's topological order (the lexicographic topological sort keyed by the graph's node
    order). A DAG has at most one canonical tree.
series cut
    A split of a connected DAG into a front ``A`` and a back ``B`` such that every node of ``A``
    reaches every node of ``B``. Equivalently, in the transitive reduction every sink of ``A``
    points to every source of ``B`` and no other edge crosses. Skip and residual edges are
    implied by the other paths, so they never stop a cut.
stratum
    The layers of one longest-path depth in a piece of the graph; no edge joins two of them.
added edges
    Dependency-only edges that SP-ization puts in (``u`` must finish before ``v`` starts although
    ``v`` never reads ``u``). They restrict which stage orders the search may pick; they move no
    tensor and change no arithmetic.

Representative signatures::

    sp_decompose(dag) -> SPTree | None              # None: not node-SP
    sp_ize(dag) -> (SPTree, added_edges)             # always SP; added_edges == () if it was
    sp_tree(layer_graph) -> (SPTree, added_edges)    # sp_ize(layer_dag(layer_graph))
    tree_dag(tree) -> nx.DiGraph                     # the DAG a tree stands for

Every function is pure: inputs are never mutated and trees are frozen, hashable values. The
decomposition recurses once per Series/Parallel nesting level, so a tree nested more than about
400 levels deep (never seen in a DNN; 1000 layers in a chain nest 1 level) exceeds Python's
recursion limit, as does ``==`` between trees nested about 250 levels deep.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import chain
from typing import Iterable, Iterator

import networkx as nx

from ..errors import GraphError
from ..graph.ir import LayerGraph

__all__ = ["Leaf", "Series", "Parallel", "SPTree", "leaves", "sp_decompose", "layer_dag", "sp_ize",
           "sp_tree", "tree_dag", "to_json", "from_json"]

# SP-ization groups at most this many consecutive strata into one part of a barrier split. It bounds
# the work on a non-SP piece with L strata to O(L * 8) sub-decompositions; 8 strata already span
# most of the cross-branch edges that make real models non-SP (Sec. 5 calls such models unusual).
_MAX_GROUP_STRATA = 8


@dataclass(frozen=True, slots=True)
class Leaf:
    """One layer of the graph.

    >>> Leaf("fc1").leaves()
    ('fc1',)
    """

    name: str

    def leaves(self) -> tuple[str, ...]:
        return (self.name,)


@dataclass(frozen=True, slots=True)
class Series:
    """Children run one after the other: every sink of ``children[i]`` feeds every source of
    ``children[i + 1]``.

    >>> Series((Leaf("a"), Parallel((Leaf("b"), Leaf("c"))), Leaf("d"))).leaves()
    ('a', 'b', 'c', 'd')
    """

    children: tuple[SPTree, ...]

    def __post_init__(self):
        _check_children(self)

    def leaves(self) -> tuple[str, ...]:
        return leaves(self)


@dataclass(frozen=True, slots=True)
class Parallel:
    """Children with no edge between them (independent branches).

    >>> Parallel((Leaf("a"), Leaf("b"))).leaves()
    ('a', 'b')
    """

    children: tuple[SPTree, ...]

    def __post_init__(self):
        _check_children(self)

    def leaves(self) -> tuple[str, ...]:
        return leaves(self)


SPTree = Leaf | Series | Parallel
"""A node-SP tree: a :class:`Leaf`, :class:`Series` or :class:`Parallel`."""


def _check_children(node: Series | Parallel) -> None:
    kind = type(node).__name__
    if not isinstance(node.children, tuple):
        raise GraphError(f"{kind}.children must be a tuple of trees, got {type(node.children).__name__}")
    if len(node.children) < 2:
        raise GraphError(f"a {kind} needs at least 2 children, got {len(node.children)}; "
                         "use the single child itself instead")
    for child in node.children:
        if not isinstance(child, (Leaf, Series, Parallel)):
            raise GraphError(f"{kind} children must be Leaf, Series or Parallel, got {child!r}")


def _series(children: Iterable[SPTree]) -> SPTree:
    """Series of ``children`` in canonical form: nested Series flattened into this one."""
    flat = tuple(chain.from_iterable(c.children if isinstance(c, Series) else (c,) for c in children))
    return flat[0] if len(flat) == 1 else Series(flat)


def _parallel(children: Iterable[SPTree]) -> SPTree:
    """Parallel of ``children`` in canonical form: nested Parallels flattened into this one."""
    flat = tuple(chain.from_iterable(c.children if isinstance(c, Parallel) else (c,) for c in children))
    return flat[0] if len(flat) == 1 else Parallel(flat)


def leaves(tree: SPTree) -> tuple[str, ...]:
    """The layer names of ``tree``, children left to right: a topological order of its DAG.

    >>> leaves(Series((Parallel((Leaf("a"), Leaf("b"))), Leaf("c"))))
    ('a', 'b', 'c')
    """
    out: list[str] = []
    stack = [tree]
    # An explicit stack, not recursion: a chain of thousands of layers nests no deeper than 1, but a
    # hand-built tree may nest deeply.
    while stack:
        node = stack.pop()
        if isinstance(node, Leaf):
            out.append(node.name)
        else:
            stack.extend(reversed(node.children))
    return tuple(out)


def _ends(tree: SPTree, *, last: bool) -> list[str]:
    """The sources (``last=False``) or sinks (``last=True``) of the DAG ``tree`` stands for."""
    if isinstance(tree, Leaf):
        return [tree.name]
    if isinstance(tree, Series):
        return _ends(tree.children[-1 if last else 0], last=last)
    return [name for child in tree.children for name in _ends(child, last=last)]


def _tree_edges(tree: SPTree) -> Iterator[tuple[str, str]]:
    """The edges of ``tree_dag(tree)``: sinks of each Series child to sources of the next one."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, Leaf):
            continue
        if isinstance(node, Series):
            for front, back in zip(node.children, node.children[1:]):
                sources = _ends(back, last=False)
                for u in _ends(front, last=True):
                    for v in sources:
                        yield u, v
        stack.extend(reversed(node.children))


def tree_dag(tree: SPTree) -> nx.DiGraph:
    """The DAG ``tree`` stands for: its transitive reduction, nodes in ``leaves(tree)`` order.

    Examples
    --------
    >>> g = tree_dag(Series((Leaf("a"), Parallel((Leaf("b"), Leaf("c"))), Leaf("d"))))
    >>> sorted(g.edges)
    [('a', 'b'), ('a', 'c'), ('b', 'd'), ('c', 'd')]
    """
    names = leaves(tree)
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise GraphError(f"layer(s) {dup} appear in more than one leaf; each layer needs exactly one")
    dag = nx.DiGraph()
    dag.add_nodes_from(names)
    dag.add_edges_from(_tree_edges(tree))
    return dag


def _num_ordered_pairs(tree: SPTree) -> int:
    """How many (u, v) pairs the tree orders (u must run before v): its DAG's closure size."""
    def walk(node: SPTree) -> tuple[int, int]:
        if isinstance(node, Leaf):
            return 1, 0
        sizes_pairs = [walk(child) for child in node.children]
        size = sum(s for s, _ in sizes_pairs)
        pairs = sum(p for _, p in sizes_pairs)
        if isinstance(node, Series):
            # Every layer of a child precedes every layer of each later child.
            before = 0
            for s, _ in sizes_pairs:
                pairs += before * s
                before += s
        return size, pairs
    return walk(tree)[1]


# ------------------------------------------------------------------------------------------------
# The decomposition


def _numbered(edges_or_graph: nx.DiGraph | Iterable[tuple[str, str]]) -> tuple[list, list, list]:
    """Number the nodes in topological order: ``(names, preds, succs)`` with integer adjacency.

    The order is the lexicographic topological sort keyed by the graph's own node order, so a
    graph whose node order is already topological keeps it.
    """
    if isinstance(edges_or_graph, nx.DiGraph):
        dag = edges_or_graph
    elif isinstance(edges_or_graph, nx.Graph):
        raise GraphError("SP decomposition needs a directed graph (networkx.DiGraph), got an undirected one")
    else:
        dag = nx.DiGraph()
        dag.add_edges_from(edges_or_graph)
    if dag.number_of_nodes() == 0:
        raise GraphError("cannot decompose an empty graph: it needs at least one layer")
    rank = {name: i for i, name in enumerate(dag)}
    try:
        names = list(nx.lexicographical_topological_sort(dag, key=rank.__getitem__))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(dag)
        path = " -> ".join(str(n) for n in [u for u, _ in cycle] + [cycle[0][0]])
        raise GraphError(f"the graph has a cycle: {path}; an SP decomposition needs a DAG") from None
    pos = {name: i for i, name in enumerate(names)}
    preds = [[pos[u] for u in dag.predecessors(v)] for v in names]
    succs = [[pos[w] for w in dag.successors(v)] for v in names]
    return names, preds, succs


def _ancestor_masks(members: tuple[int, ...], preds: list[list[int]]) -> list[int]:
    """Bit ``j`` of ``masks[i]`` is set when ``members[j]`` reaches ``members[i]`` inside ``members``.

    ``members`` is sorted by topological number, so every predecessor's mask is ready; Python ints
    serve as bitsets, which keeps a piece of k nodes and e edges at O(e * k / 64) word operations.
    """
    local = {v: i for i, v in enumerate(members)}
    masks: list[int] = []
    for v in members:
        mask = 0
        for u in preds[v]:
            i = local.get(u)
            if i is not None:
                mask |= masks[i] | (1 << i)
        masks.append(mask)
    return masks


class _Decomposer:
    """One decomposition run over a DAG numbered by :func:`_numbered`.

    Every piece it looks at is given as a sorted tuple of node numbers and is convex (a path
    between two of its nodes stays inside it), so reachability inside the piece is reachability in
    the whole graph. With ``fix`` set, a connected piece without a series cut is SP-ized instead
    of failing.
    """

    __slots__ = ("names", "preds", "succs", "fix", "fixed", "_memo")

    def __init__(self, names: list, preds: list[list[int]], succs: list[list[int]], *, fix: bool):
        self.names, self.preds, self.succs, self.fix = names, preds, succs, fix
        self.fixed = False
        # SP-ization tries overlapping groups of strata; the same sub-piece recurs, so cache it.
        self._memo: dict[tuple[int, ...], tuple[SPTree, int]] = {}

    def piece(self, members: tuple[int, ...]) -> SPTree | None:
        """The canonical tree of the sub-DAG induced by ``members``, or None if it is not SP."""
        if len(members) == 1:
            return Leaf(self.names[members[0]])
        if self.fix and members in self._memo:
            return self._memo[members][0]
        components = self._components(members)
        if len(components) == 1:
            tree = self._connected(members)
        else:
            children = []
            for component in components:
                child = self._connected(component)
                if child is None:
                    return None
                children.append(child)
            tree = Parallel(tuple(children))
        if self.fix:
            self._memo[members] = (tree, _num_ordered_pairs(tree))
        return tree

    def _components(self, members: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Weakly connected components, ordered by their smallest member."""
        inside = set(members)
        seen: set[int] = set()
        components = []
        for start in members:
            if start in seen:
                continue
            seen.add(start)
            stack, component = [start], [start]
            while stack:
                v = stack.pop()
                for w in chain(self.preds[v], self.succs[v]):
                    if w in inside and w not in seen:
                        seen.add(w)
                        stack.append(w)
                        component.append(w)
            components.append(tuple(sorted(component)))
        return components

    def _connected(self, members: tuple[int, ...]) -> SPTree | None:
        """The tree of a connected piece: a Series over its series cuts."""
        if len(members) == 1:
            return Leaf(self.names[members[0]])
        cuts = _series_cuts(members, self.preds)
        if not cuts:
            if not self.fix:
                return None
            self.fixed = True
            return self._stratum_sync(members)
        bounds = (0, *cuts, len(members))
        children = []
        for lo, hi in zip(bounds, bounds[1:]):
            # Between two consecutive cuts a piece has no cut of its own (a cut of it would be a
            # cut of the whole), so it is one layer, independent branches, or not SP.
            child = self.piece(members[lo:hi])
            if child is None:
                return None
            children.append(child)
        return _series(children)

    def _stratum_sync(self, members: tuple[int, ...]) -> SPTree:
        """SP-ize a connected piece without a series cut by barriers between groups of strata.

        Stratum ``d`` holds the nodes whose longest path inside the piece has ``d`` edges. A
        barrier between strata ``< t`` and ``>= t`` makes the front run entirely before the back;
        each group of consecutive strata is then decomposed again (it may split into branches or
        need barriers of its own). A dynamic programme over the strata picks the barriers:
        ``best[t]`` is the fewest ordered pairs of a tree for strata ``[0, t)`` that ends in a
        barrier at ``t``. The tree's ordered pairs are the graph's own plus the added constraints,
        so the fewest pairs means the fewest lost concurrency.
        """
        local = {v: i for i, v in enumerate(members)}
        depth: list[int] = []
        for v in members:
            depth.append(max((depth[local[u]] + 1 for u in self.preds[v] if u in local), default=0))
        num_strata = max(depth) + 1
        strata: list[list[int]] = [[] for _ in range(num_strata)]
        for v, d in zip(members, depth):
            strata[d].append(v)
        before = [0]
        for stratum in strata:
            before.append(before[-1] + len(stratum))

        best = [0] + [None] * num_strata
        choice: list[tuple[int, SPTree] | None] = [None] * (num_strata + 1)
        for hi in range(1, num_strata + 1):
            for lo in range(max(0, hi - _MAX_GROUP_STRATA), hi):
                if lo == 0 and hi == num_strata:
                    continue  # the whole piece as one group is what we are fixing
                group = tuple(sorted(chain.from_iterable(strata[lo:hi])))
                tree = self.piece(group)
                assert tree is not None, "SP-ization always returns a tree"
                own = self._memo[group][1] if len(group) > 1 else 0
                # The group's own pairs, plus every earlier node ordered before every group node.
                cost = best[lo] + own + before[lo] * (before[hi] - before[lo])
                if best[hi] is None or cost < best[hi]:
                    best[hi], choice[hi] = cost, (lo, tree)
        groups = []
        hi = num_strata
        while hi > 0:
            lo, tree = choice[hi]
            groups.append(tree)
            hi = lo
        return _series(reversed(groups))


def _series_cuts(members: tuple[int, ...], preds: list[list[int]]) -> list[int]:
    """Positions ``c`` such that ``members[:c]`` / ``members[c:]`` is a series cut.

    If ``A`` is a series cut's front, every node of the back has all of ``A`` as ancestors, so
    every topological order starts with ``A``: checking the prefixes of one order finds every cut.
    A prefix of length ``c`` is a cut when each later node has all of the first ``c`` nodes as
    ancestors, i.e. when the trailing ones of its ancestor mask number at least ``c``.
    """
    masks = _ancestor_masks(members, preds)
    cuts = []
    lowest = len(members)
    for i in range(len(members) - 1, 0, -1):
        mask = masks[i]
        lowest = min(lowest, ((~mask) & (mask + 1)).bit_length() - 1)
        if lowest >= i:
            cuts.append(i)
    cuts.reverse()
    return cuts


def sp_decompose(edges_or_graph: nx.DiGraph | Iterable[tuple[str, str]]) -> SPTree | None:
    """The canonical node-SP tree of a DAG, or None if the DAG is not node-SP.

    Works on reachability, so the result is the tree of the transitive reduction: a residual edge
    ``a -> c`` beside ``a -> b -> c`` changes nothing. Recursively, a disconnected piece becomes a
    Parallel of its weakly connected components and a connected one a Series over all its series
    cuts; a connected piece of two or more nodes without a cut means the DAG is not SP. Each
    level costs O(e * k / 64) bitset word operations for a piece of k nodes and e edges.

    Parameters
    ----------
    edges_or_graph : a ``networkx.DiGraph`` over layer names, or an iterable of ``(u, v)`` edges.
        The node order (insertion order) orders the children of each Parallel.

    Returns
    -------
    The canonical tree (see the module glossary), or None.

    Raises
    ------
    GraphError
        If the graph is empty, undirected or has a cycle.

    Examples
    --------
    >>> to_json(sp_decompose([("a", "b"), ("b", "c"), ("a", "c")]))
    '{"series": ["a", "b", "c"]}'
    >>> to_json(sp_decompose([("x", "l"), ("x", "r"), ("l", "y"), ("r", "y")]))
    '{"series": ["x", {"parallel": ["l", "r"]}, "y"]}'
    >>> sp_decompose([("a", "c"), ("a", "d"), ("b", "d")]) is None  # the "N" graph
    True
    """
    names, preds, succs = _numbered(edges_or_graph)
    return _Decomposer(names, preds, succs, fix=False).piece(tuple(range(len(names))))


def layer_dag(graph: LayerGraph) -> nx.DiGraph:
    """The layer-to-layer edges of a :class:`~gpp_deepspeed.graph.ir.LayerGraph`.

    Graph inputs are not nodes: a layer that reads only graph inputs is a source. Nodes come in
    ``graph.order`` (branches contiguous), so Parallel children follow the branches' order.

    Examples
    --------
    >>> from gpp_deepspeed.graph import build_layer_graph
    >>> g = build_layer_graph(["x"], [("a", ["x"]), ("b", ["x"]), ("c", ["a", "b", "x"])])
    >>> list(layer_dag(g).nodes), sorted(layer_dag(g).edges)
    (['a', 'b', 'c'], [('a', 'c'), ('b', 'c')])
    """
    dag = nx.DiGraph()
    dag.add_nodes_from(graph.order or graph.names)
    inputs = set(graph.input_names)
    for node in graph.nodes:
        dag.add_node(node.name)
        dag.add_edges_from((ref.node, node.name) for ref in node.inputs if ref.node not in inputs)
    return dag


def sp_ize(dag: nx.DiGraph) -> tuple[SPTree, tuple[tuple[str, str], ...]]:
    """Make a DAG node-SP by adding dependency-only edges; return the tree and the added edges.

    GraphPipe handles a non-SP model by "converting the DNN to an arithmetically identical one
    whose structure is a series-parallel graph" (arXiv 2406.17145, Sec. 5) and gives no
    algorithm. Here the conversion only adds orderings (a layer waits for one it does not read),
    so every layer computes exactly what it did. The SP parts are decomposed as in
    :func:`sp_decompose`; only a connected piece with no series cut is fixed, in the style of
    FlexFlow's stratum-sync SP-ization (``stratum_sync_sp_ization``, flexflow-train): its layers
    are grouped by longest-path depth and barriers go between groups of consecutive strata. Unlike
    plain stratum sync, which puts a barrier between every two strata, a dynamic programme
    chooses which barriers to keep so that the fewest ordering constraints are added, and each
    group is decomposed again, so branches that the barriers leave apart stay Parallel.

    Parameters
    ----------
    dag : a ``networkx.DiGraph`` over layer names (or an iterable of edges).

    Returns
    -------
    tree : the canonical node-SP tree. The transitive closure of ``tree_dag(tree)`` contains
        every edge of ``dag``, and equals the closure of ``dag`` plus ``added``.
    added : the edges of ``tree_dag(tree)`` that ``dag`` does not imply, in tree order; ``()``
        exactly when ``dag`` is already SP (then ``tree == sp_decompose(dag)``).

    Raises
    ------
    GraphError
        If the graph is empty, undirected or has a cycle.

    Examples
    --------
    >>> tree, added = sp_ize(nx.DiGraph([("a", "c"), ("a", "d"), ("b", "d")]))
    >>> to_json(tree), added
    ('{"series": [{"parallel": ["a", "b"]}, {"parallel": ["c", "d"]}]}', (('b', 'c'),))
    >>> sp_ize(nx.DiGraph([("a", "b")]))[1]
    ()
    """
    names, preds, succs = _numbered(dag)
    everything = tuple(range(len(names)))
    decomposer = _Decomposer(names, preds, succs, fix=True)
    tree = decomposer.piece(everything)
    assert tree is not None, "SP-ization always returns a tree"
    if not decomposer.fixed:
        return tree, ()
    pos = {name: i for i, name in enumerate(names)}
    reach = _ancestor_masks(everything, preds)
    added = tuple((u, v) for u, v in _tree_edges(tree) if not (reach[pos[v]] >> pos[u]) & 1)
    return tree, added


def sp_tree(graph: LayerGraph) -> tuple[SPTree, tuple[tuple[str, str], ...]]:
    """The SP tree of a layer graph and the dependency-only edges it needed: ``sp_ize(layer_dag(graph))``.

    Examples
    --------
    >>> from gpp_deepspeed.graph import build_layer_graph
    >>> g = build_layer_graph(["x"], [("a", ["x"]), ("b", ["x"]), ("c", ["a", "b"])])
    >>> tree, added = sp_tree(g)
    >>> to_json(tree), added
    ('{"series": [{"parallel": ["a", "b"]}, "c"]}', ())
    """
    return sp_ize(layer_dag(graph))


# ------------------------------------------------------------------------------------------------
# JSON


def _to_data(tree: SPTree) -> object:
    if isinstance(tree, Leaf):
        return tree.name
    key = "series" if isinstance(tree, Series) else "parallel"
    return {key: [_to_data(child) for child in tree.children]}


def to_json(tree: SPTree) -> str:
    """The tree as JSON: a leaf is its layer name, a node ``{"series": [...]}`` or ``{"parallel": [...]}``.

    >>> to_json(Series((Leaf("a"), Parallel((Leaf("b"), Leaf("c"))))))
    '{"series": ["a", {"parallel": ["b", "c"]}]}'
    """
    return json.dumps(_to_data(tree))


def _from_data(data: object) -> SPTree:
    if isinstance(data, str):
        return Leaf(data)
    if isinstance(data, dict) and len(data) == 1:
        (key, children), = data.items()
        if key in ("series", "parallel") and isinstance(children, list) and len(children) >= 2:
            parts = [_from_data(child) for child in children]
            return _series(parts) if key == "series" else _parallel(parts)
    raise GraphError(f"bad SP tree fragment {json.dumps(data)}: expected a layer name or "
                     '{"series": [...]} / {"parallel": [...]} with at least 2 children')


def from_json(text: str) -> SPTree:
    """Parse :func:`to_json` output; nested Series (or Parallel) are flattened to canonical form.

    >>> tree = from_json('{"parallel": ["a", {"parallel": ["b", "c"]}]}')
    >>> tree == Parallel((Leaf("a"), Leaf("b"), Leaf("c")))
    True
    """
    tree = _from_data(json.loads(text))
    names = leaves(tree)
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise GraphError(f"layer(s) {dup} appear in more than one leaf; each layer needs exactly one")
    return tree
