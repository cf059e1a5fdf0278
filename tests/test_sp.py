"""Unit tests of the series-parallel decomposition (gpp_deepspeed.planner.sp): pure, CPU-only.

The references are independent of the code under test: randomly built trees (their DAG must
decompose back to them), networkx transitive closures (SP-ization must keep every ordering), and
the N-free characterisation of series-parallel orders (Valdes, Tarjan and Lawler 1982: a DAG is
node-SP exactly when its transitive closure has no induced "N" a<c, b<c, b<d).
"""

from __future__ import annotations

import doctest
import random
from itertools import combinations

import networkx as nx
import pytest
from hypothesis import given, settings, strategies as st

from gpp_deepspeed.errors import GraphError
from gpp_deepspeed.graph import build_layer_graph
from gpp_deepspeed.planner import sp as sp_module
from gpp_deepspeed.planner.sp import (Leaf, Parallel, Series, from_json, layer_dag, leaves, sp_decompose,
                                      sp_ize, sp_tree, to_json, tree_dag)

from graphs import two_branch_graph


def S(*children):
    return Series(tuple(Leaf(c) if isinstance(c, str) else c for c in children))


def P(*children):
    return Parallel(tuple(Leaf(c) if isinstance(c, str) else c for c in children))


def random_tree(rng: random.Random, names: list[str], outer: type | None = None):
    """A random canonical tree over ``names``: Series and Parallel alternate down every path."""
    if len(names) == 1:
        return Leaf(names[0])
    if outer is None:
        kind = rng.choice([Series, Parallel])
    else:
        kind = Parallel if outer is Series else Series
    num_children = rng.randint(2, min(4, len(names)))
    bounds = [0, *sorted(rng.sample(range(1, len(names)), num_children - 1)), len(names)]
    return kind(tuple(random_tree(rng, names[lo:hi], kind) for lo, hi in zip(bounds, bounds[1:])))


def random_dag(rng: random.Random, num_nodes: int, edge_prob: float) -> nx.DiGraph:
    """Edges only from lower to higher numbers, nodes inserted in a shuffled (non-topological) order."""
    dag = nx.DiGraph()
    order = list(range(num_nodes))
    rng.shuffle(order)
    dag.add_nodes_from(f"v{i}" for i in order)
    dag.add_edges_from((f"v{i}", f"v{j}") for i, j in combinations(range(num_nodes), 2)
                       if rng.random() < edge_prob)
    return dag


def closure_pairs(dag: nx.DiGraph) -> set[tuple[str, str]]:
    return set(nx.transitive_closure_dag(dag).edges)


def contains_induced_n(dag: nx.DiGraph) -> bool:
    """Brute force: four layers a, b, c, d with a<c, b<c, b<d and every other pair unordered."""
    less = closure_pairs(dag)

    def apart(x, y):
        return (x, y) not in less and (y, x) not in less

    for b in dag:
        above_b = [v for v in dag if (b, v) in less]
        for c, d in combinations(above_b, 2):
            if not apart(c, d):
                continue
            for low, high in ((c, d), (d, c)):
                # a sits below ``low`` only: unordered with b and with ``high``.
                if any((a, low) in less and apart(a, b) and apart(a, high) for a in dag):
                    return True
    return False


def sorted_tree(tree):
    """The tree with Parallel children sorted by their leaves: equality up to branch order."""
    if isinstance(tree, Leaf):
        return tree
    children = tuple(sorted_tree(c) for c in tree.children)
    if isinstance(tree, Parallel):
        children = tuple(sorted(children, key=leaves))
    return type(tree)(children)


def stratum_sync_pairs(dag: nx.DiGraph) -> int:
    """Ordered pairs of plain stratum sync: a barrier between every two longest-path depths."""
    depth = {}
    for v in nx.topological_sort(dag):
        depth[v] = max((depth[u] + 1 for u in dag.predecessors(v)), default=0)
    return sum(1 for u in dag for v in dag if depth[u] < depth[v])


# ---------------------------------------------------------------------------------------------
# The tree types


def test_series_and_parallel_reject_fewer_than_two_children():
    with pytest.raises(GraphError, match="at least 2 children"):
        Series((Leaf("a"),))
    with pytest.raises(GraphError, match="at least 2 children"):
        Parallel(())
    with pytest.raises(GraphError, match="must be a tuple"):
        Series([Leaf("a"), Leaf("b")])


def test_tree_dag_joins_every_sink_of_a_series_child_to_every_source_of_the_next():
    tree = S(P("a", "b"), P(S("c", "d"), "e"), "f")
    dag = tree_dag(tree)
    assert list(dag.nodes) == ["a", "b", "c", "d", "e", "f"]
    assert set(dag.edges) == {("a", "c"), ("a", "e"), ("b", "c"), ("b", "e"), ("c", "d"),
                              ("d", "f"), ("e", "f")}


def test_tree_dag_rejects_a_layer_in_two_leaves():
    with pytest.raises(GraphError, match=r"\['a'\] appear in more than one leaf"):
        tree_dag(S("a", P("b", "a")))


# ---------------------------------------------------------------------------------------------
# sp_decompose


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_leaves=st.integers(1, 30))
def test_sp_decompose_round_trips_random_sp_trees_even_with_skip_edges(seed, num_leaves):
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(num_leaves)]
    rng.shuffle(names)
    tree = random_tree(rng, names)
    dag = tree_dag(tree)
    # tree_dag is the transitive reduction, and leaves() is a topological order of it.
    assert set(nx.transitive_reduction(dag).edges) == set(dag.edges)
    pos = {name: i for i, name in enumerate(leaves(tree))}
    assert all(pos[u] < pos[v] for u, v in dag.edges)
    assert sp_decompose(dag) == tree
    # Any implied (skip, residual) edges change nothing.
    implied = sorted(closure_pairs(dag) - set(dag.edges))
    with_skips = nx.DiGraph()
    with_skips.add_nodes_from(dag)
    with_skips.add_edges_from([*dag.edges, *rng.sample(implied, len(implied) // 2)])
    assert sp_decompose(with_skips) == tree
    # The node order only orders Parallel children.
    shuffled = nx.DiGraph()
    shuffled.add_nodes_from(rng.sample(list(dag), len(dag)))
    shuffled.add_edges_from(dag.edges)
    assert sorted_tree(sp_decompose(shuffled)) == sorted_tree(tree)


def test_sp_decompose_ignores_a_skip_edge_beside_a_chain():
    assert sp_decompose([("a", "b"), ("b", "c"), ("a", "c")]) == S("a", "b", "c")


def test_sp_decompose_sees_pre_norm_transformer_blocks_with_residuals_as_a_chain():
    # x -> ln1 -> attn -> add1 (also reads x) -> ln2 -> mlp -> add2 (also reads add1), twice.
    edges, prev, chain_order = [], "emb", ["emb"]
    for block in range(2):
        sublayers = ("ln1", "attn", "add1", "ln2", "mlp", "add2")
        ln1, attn, add1, ln2, mlp, add2 = (f"{block}.{s}" for s in sublayers)
        edges += [(prev, ln1), (ln1, attn), (attn, add1), (prev, add1),
                  (add1, ln2), (ln2, mlp), (mlp, add2), (add1, add2)]
        chain_order += [ln1, attn, add1, ln2, mlp, add2]
        prev = add2
    assert sp_decompose(edges) == S(*chain_order)


def test_sp_decompose_orders_parallel_children_by_the_graph_node_order():
    dag = nx.DiGraph()
    dag.add_nodes_from(["x", "r", "l", "y"])
    dag.add_edges_from([("x", "l"), ("x", "r"), ("l", "y"), ("r", "y")])
    assert sp_decompose(dag) == S("x", P("r", "l"), "y")


def test_sp_decompose_makes_disconnected_graphs_parallel():
    dag = nx.DiGraph([("a", "b")])
    dag.add_node("c")
    assert sp_decompose(dag) == P(S("a", "b"), "c")
    assert sp_decompose(nx.DiGraph([("only", "only2")])) == S("only", "only2")
    single = nx.DiGraph()
    single.add_node("only")
    assert sp_decompose(single) == Leaf("only")


def test_sp_decompose_returns_none_for_the_n_graph():
    assert sp_decompose([("a", "c"), ("a", "d"), ("b", "d")]) is None
    # Inside a larger SP graph the N still makes the whole graph non-SP.
    assert sp_decompose([("s", "a"), ("s", "b"), ("a", "c"), ("a", "d"), ("b", "d"),
                         ("c", "t"), ("d", "t")]) is None


def test_sp_decompose_is_none_exactly_when_the_order_contains_an_induced_n():
    rng = random.Random(1234)
    num_sp = 0
    for _ in range(150):
        dag = random_dag(rng, rng.randint(1, 12), rng.uniform(0.1, 0.5))
        tree = sp_decompose(dag)
        assert (tree is None) == contains_induced_n(dag), sorted(dag.edges)
        if tree is not None:
            num_sp += 1
            assert closure_pairs(tree_dag(tree)) == closure_pairs(dag)
    assert 20 < num_sp < 150  # both kinds were exercised


def test_sp_decompose_rejects_cycles_empty_and_undirected_graphs():
    with pytest.raises(GraphError, match="cycle: a -> b -> a"):
        sp_decompose([("a", "b"), ("b", "a")])
    with pytest.raises(GraphError, match="empty graph"):
        sp_decompose(nx.DiGraph())
    with pytest.raises(GraphError, match="directed graph"):
        sp_decompose(nx.Graph([("a", "b")]))


# ---------------------------------------------------------------------------------------------
# sp_ize


def check_sp_ize(dag: nx.DiGraph):
    """The invariants every SP-ization must meet; returns the tree and the added edges."""
    before = (list(dag.nodes), list(dag.edges))
    tree, added = sp_ize(dag)
    assert (list(dag.nodes), list(dag.edges)) == before, "sp_ize mutated its input"
    result = tree_dag(tree)
    assert sorted(result) == sorted(dag)
    assert nx.is_directed_acyclic_graph(result)
    assert sp_decompose(result) == tree
    tree_order = closure_pairs(result)
    dag_order = closure_pairs(dag)
    assert dag_order <= tree_order, f"lost edges {sorted(dag_order - tree_order)}"
    # ``added`` are exactly the tree's edges the DAG does not imply, and they account for all
    # the extra order.
    assert set(added) == set(result.edges) - dag_order
    assert closure_pairs(nx.DiGraph([*dag.edges, *added])) | dag_order == tree_order
    return tree, added


def test_sp_ize_fixes_the_n_graph_with_one_barrier():
    dag = nx.DiGraph([("a", "c"), ("a", "d"), ("b", "d")])
    tree, added = check_sp_ize(dag)
    assert tree == S(P("a", "b"), P("c", "d"))
    assert added == (("b", "c"),)


def test_sp_ize_keeps_two_branches_apart_between_rare_cross_edges():
    # Two chains of four layers with one cross edge a2 -> b3. A barrier after the second stratum
    # costs one constraint (b2 before a3); a barrier between every stratum would cost more.
    dag = nx.DiGraph([("a1", "a2"), ("a2", "a3"), ("a3", "a4"), ("b1", "b2"), ("b2", "b3"), ("b3", "b4"),
                      ("a2", "b3")])
    tree, added = check_sp_ize(dag)
    assert tree == S(P(S("a1", "a2"), S("b1", "b2")), P(S("a3", "a4"), S("b3", "b4")))
    assert added == (("b2", "a3"),)


def test_sp_ize_only_touches_the_non_sp_piece():
    # An N between a stem and a head, beside an untouched branch.
    dag = nx.DiGraph([("stem", "a"), ("stem", "b"), ("a", "c"), ("a", "d"), ("b", "d"),
                      ("c", "head"), ("d", "head"), ("stem", "side1"), ("side1", "side2"), ("side2", "head")])
    tree, added = check_sp_ize(dag)
    assert tree == S("stem", P(S(P("a", "b"), P("c", "d")), S("side1", "side2")), "head")
    assert added == (("b", "c"),)


def test_sp_ize_keeps_every_edge_of_random_dags_and_leaves_sp_ones_alone():
    rng = random.Random(2406)
    for _ in range(120):
        dag = random_dag(rng, rng.randint(1, 15), rng.uniform(0.08, 0.5))
        tree, added = check_sp_ize(dag)
        reference = sp_decompose(dag)
        if reference is not None:
            assert (tree, added) == (reference, ())
        else:
            assert added
        # Never more order than plain stratum sync (one barrier between every two strata).
        assert len(closure_pairs(tree_dag(tree))) <= stratum_sync_pairs(dag)


def test_sp_ize_handles_long_ladders_beyond_the_strata_group_limit():
    # 40 strata: more than one DP group can span, so barriers must split it into several groups.
    edges = []
    for i in range(39):
        edges += [(f"a{i}", f"a{i + 1}"), (f"b{i}", f"b{i + 1}")]
        if i % 4 == 0:
            edges.append((f"a{i}", f"b{i + 1}"))
    tree, added = check_sp_ize(nx.DiGraph(edges))
    assert isinstance(tree, Series)
    assert len(added) < 39  # far fewer than lock-step strata (one constraint b_i -> a_i+1 per stratum)


# ---------------------------------------------------------------------------------------------
# Layer graphs


def test_layer_dag_drops_graph_inputs_and_keeps_layer_edges_in_branch_order():
    dag = layer_dag(two_branch_graph())
    assert list(dag.nodes) == ["text_proj", "text_block", "image_proj", "image_block", "fuse", "head"]
    assert set(dag.edges) == {("text_proj", "text_block"), ("image_proj", "image_block"),
                              ("text_block", "fuse"), ("image_block", "fuse"), ("fuse", "head")}


def test_sp_tree_of_the_two_branch_graph_is_two_chains_then_fuse_and_head():
    assert sp_tree(two_branch_graph()) == (
        S(P(S("text_proj", "text_block"), S("image_proj", "image_block")), "fuse", "head"), ())


def test_sp_tree_of_a_dlrm_like_graph_is_parallel_bottoms_then_concat_then_top_mlp():
    # 7 dense features each through a 2-layer chain and 7 sparse features each through one
    # embedding, all concatenated, then a 3-layer top MLP (DLRM has 14 inputs, Sec. 7).
    inputs = [f"dense{i}" for i in range(7)] + [f"sparse{i}" for i in range(7)]
    layers = []
    for i in range(7):
        layers += [(f"bot{i}_0", [f"dense{i}"]), (f"bot{i}_1", [f"bot{i}_0"])]
    layers += [(f"emb{i}", [f"sparse{i}"]) for i in range(7)]
    layers.append(("concat", [f"bot{i}_1" for i in range(7)] + [f"emb{i}" for i in range(7)]))
    layers += [("top0", ["concat"]), ("top1", ["top0"]), ("top2", ["top1"])]
    tree, added = sp_tree(build_layer_graph(inputs, layers))
    bottoms = [S(f"bot{i}_0", f"bot{i}_1") for i in range(7)] + [f"emb{i}" for i in range(7)]
    assert tree == S(P(*bottoms), "concat", "top0", "top1", "top2")
    assert added == ()


def test_sp_tree_of_multi_branch_transformers_with_residuals_keeps_the_branches():
    layers = [("emb", ["x"])]
    ends = []
    for branch in range(4):
        prev = "emb"
        for block in range(2):
            name = f"br{branch}_{block}"
            # Each block reads its input twice: the sublayer path and the residual.
            layers += [(f"{name}_attn", [prev]), (f"{name}_add", [f"{name}_attn", prev])]
            prev = f"{name}_add"
        ends.append(prev)
    layers += [("merge", ends), ("head", ["merge"])]
    tree, added = sp_tree(build_layer_graph(["x"], layers))
    branches = [S(*(f"br{b}_{k}_{s}" for k in range(2) for s in ("attn", "add"))) for b in range(4)]
    assert tree == S("emb", P(*branches), "merge", "head")
    assert added == ()


# ---------------------------------------------------------------------------------------------
# JSON


def test_to_json_is_readable_nested_lists_and_round_trips():
    tree = S("a", P(S("b", "c"), "d"), "e")
    text = to_json(tree)
    assert text == '{"series": ["a", {"parallel": [{"series": ["b", "c"]}, "d"]}, "e"]}'
    assert from_json(text) == tree
    assert from_json(to_json(Leaf("solo"))) == Leaf("solo")


def test_from_json_flattens_nested_series_into_canonical_form():
    assert from_json('{"series": [{"series": ["a", "b"]}, "c"]}') == S("a", "b", "c")


@pytest.mark.parametrize("text, match", [
    ('{"series": ["a"]}', "at least 2 children"),
    ('{"chain": ["a", "b"]}', "bad SP tree fragment"),
    ('["a", "b"]', "bad SP tree fragment"),
    ('{"parallel": ["a", {"series": ["b", "a"]}]}', "more than one leaf"),
])
def test_from_json_rejects_malformed_trees(text, match):
    with pytest.raises(GraphError, match=match):
        from_json(text)


def test_sp_module_docstring_examples_run():
    result = doctest.testmod(sp_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
