"""Unit tests of the layer graph IR (gpp_deepspeed.graph.ir): pure, CPU-only, no torch.distributed."""

from __future__ import annotations

import pytest

from gpp_deepspeed.errors import GPPConfigError, GraphError
from gpp_deepspeed.graph import LayerGraph, LayerNode, TensorRef, build_layer_graph

from graphs import TWO_BRANCH_LAYERS, two_branch_graph


def is_topological(graph: LayerGraph, order) -> bool:
    """Independent check: a permutation of the layers in which every layer follows the layers it reads."""
    if sorted(order) != sorted(graph.names):
        return False
    pos = {name: i for i, name in enumerate(order)}
    return all(pos[ref.node] < pos[node.name]
               for node in graph.nodes for ref in node.inputs if ref.node in pos)


# ---------------------------------------------------------------------------------------------
# build_layer_graph: accepted graphs


def test_build_layer_graph_keeps_list_order_inputs_and_default_output():
    g = two_branch_graph()
    assert g.input_names == ("text", "image")
    assert g.names == ("text_proj", "image_proj", "text_block", "image_block", "fuse", "head")
    assert g.output == "head"
    assert g.node("fuse") == LayerNode("fuse", (TensorRef("text_block"), TensorRef("image_block")))


def test_build_layer_graph_order_keeps_each_branch_contiguous():
    # Hand-derived: a depth-first post-order from "head" visits fuse's inputs in order, so the
    # whole text branch comes first, then the whole image branch, then the merge and the head.
    g = two_branch_graph()
    assert g.order == ("text_proj", "text_block", "image_proj", "image_block", "fuse", "head")


def test_build_layer_graph_order_keeps_three_branches_and_a_shared_stem_contiguous():
    # stem feeds three branches of different lengths, which merge in "merge".
    g = build_layer_graph(["x"], [
        ("stem", ["x"]),
        ("a1", ["stem"]), ("b1", ["stem"]), ("c1", ["stem"]),
        ("a2", ["a1"]), ("b2", ["b1"]), ("b3", ["b2"]),
        ("merge", ["a2", "b3", "c1"]),
    ])
    assert g.order == ("stem", "a1", "a2", "b1", "b2", "b3", "c1", "merge")


def test_build_layer_graph_accepts_an_explicit_output_and_tuple_element_refs():
    g = build_layer_graph(["x"], [("enc", ["x"]), ("head", ["enc:0", "enc:1"]), ("aux", ["head"])],
                          output="aux")
    assert g.output == "aux"
    assert g.node("head").inputs == (TensorRef("enc", 0), TensorRef("enc", 1))


def test_build_layer_graph_is_a_value_error_subclass_chain():
    assert issubclass(GraphError, GPPConfigError)
    assert issubclass(GraphError, ValueError)


# ---------------------------------------------------------------------------------------------
# build_layer_graph: rejected graphs, each message names the culprit


def test_build_layer_graph_rejects_a_cycle_naming_its_layers():
    with pytest.raises(GraphError) as info:
        build_layer_graph(["x"], [("enc", ["x", "dec"]), ("mid", ["enc"]), ("dec", ["mid"]), ("head", ["dec"])],
                          output="head")
    msg = str(info.value)
    assert "cycle" in msg
    for name in ("enc", "mid", "dec"):
        assert name in msg
    assert "head" not in msg


def test_build_layer_graph_rejects_a_layer_reading_itself():
    with pytest.raises(GraphError, match="cycle") as info:
        build_layer_graph(["x"], [("loop", ["x", "loop"])])
    assert "loop" in str(info.value)


def test_build_layer_graph_rejects_an_unknown_input_naming_it_and_its_reader():
    with pytest.raises(GraphError) as info:
        build_layer_graph(["x"], [("a", ["x"]), ("b", ["a", "missing_tensor"])])
    msg = str(info.value)
    assert "missing_tensor" in msg and '"b"' in msg


def test_build_layer_graph_rejects_a_duplicate_layer_name():
    with pytest.raises(GraphError, match="duplicate") as info:
        build_layer_graph(["x"], [("twice", ["x"]), ("other", ["twice"]), ("twice", ["other"])])
    assert "twice" in str(info.value)


def test_build_layer_graph_rejects_a_layer_not_connected_to_the_output():
    with pytest.raises(GraphError) as info:
        build_layer_graph(["x"], [("a", ["x"]), ("orphan", ["x"]), ("head", ["a"])], output="head")
    msg = str(info.value)
    assert "orphan" in msg and "head" in msg


def test_build_layer_graph_rejects_an_index_on_a_graph_input():
    with pytest.raises(GraphError) as info:
        build_layer_graph(["x"], [("a", ["x:0"])])
    msg = str(info.value)
    assert "x:0" in msg and '"a"' in msg


@pytest.mark.parametrize("bad", ["a:b", "a.b"])
def test_build_layer_graph_rejects_a_layer_name_with_a_separator(bad):
    with pytest.raises(GraphError) as info:
        build_layer_graph(["x"], [(bad, ["x"])])
    assert bad in str(info.value)


def test_build_layer_graph_rejects_a_graph_input_name_with_a_colon():
    with pytest.raises(GraphError) as info:
        build_layer_graph(["x:1"], [("a", ["x"])])
    assert "x:1" in str(info.value)


@pytest.mark.parametrize("inputs, nodes, needle", [
    ([], [("a", ["x"])], "input"),
    (["x", "x"], [("a", ["x"])], "duplicate"),
    (["x"], [], "layer"),
    (["x"], [("a", [])], '"a"'),
    (["x"], [("x", ["x"])], '"x"'),
])
def test_build_layer_graph_rejects_degenerate_graphs(inputs, nodes, needle):
    with pytest.raises(GraphError) as info:
        build_layer_graph(inputs, nodes)
    assert needle in str(info.value)


def test_build_layer_graph_rejects_an_output_that_is_not_a_layer():
    with pytest.raises(GraphError) as info:
        build_layer_graph(["x"], [("a", ["x"])], output="nope")
    assert "nope" in str(info.value)


# ---------------------------------------------------------------------------------------------
# TensorRef


@pytest.mark.parametrize("text, ref", [
    ("enc", TensorRef("enc")),
    ("enc:0", TensorRef("enc", 0)),
    ("enc:12", TensorRef("enc", 12)),
    ("image_block", TensorRef("image_block")),
    ("enc:-1", TensorRef("enc", -1)),
    ("enc:1:2", TensorRef("enc", (1, 2))),
    ("vision.pooler_output", TensorRef("vision", "pooler_output")),
    ("enc.hidden_states:-1", TensorRef("enc", ("hidden_states", -1))),
])
def test_tensor_ref_parse_and_str_round_trip(text, ref):
    assert TensorRef.parse(text) == ref
    assert str(ref) == text
    assert TensorRef.parse(str(ref)) == ref
    assert TensorRef.parse(ref) is ref


@pytest.mark.parametrize("bad", ["", "enc:", "enc:x", "enc.", "enc.1x", ":0", ".key", "enc:1.", "enc..a"])
def test_tensor_ref_parse_rejects_malformed_references(bad):
    with pytest.raises(GraphError):
        TensorRef.parse(bad)


# ---------------------------------------------------------------------------------------------
# JSON and list orders


def test_layer_graph_json_round_trip_is_identity():
    for g in (two_branch_graph(),
              build_layer_graph(["x", "y"], [("enc", ["x"]), ("mid", ["enc:0"]), ("head", ["mid", "enc:1", "y"])])):
        back = LayerGraph.from_json(g.to_json())
        assert back == g
        assert back.order == g.order


def test_layer_graph_list_topological_order_is_the_list_for_a_chain():
    names = [f"layer{i}" for i in range(7)]
    g = build_layer_graph(["x"], [(n, [names[i - 1] if i else "x"]) for i, n in enumerate(names)])
    assert g.list_topological_order() == tuple(names)
    assert g.order == tuple(names)


def test_layer_graph_list_topological_order_is_the_list_for_the_interleaved_two_branch_list():
    g = two_branch_graph()
    assert g.list_topological_order() == tuple(n for n, _ in TWO_BRANCH_LAYERS)


def test_layer_graph_list_topological_order_is_valid_for_a_list_written_out_of_order():
    g = build_layer_graph(["x"], [("head", ["mid"]), ("mid", ["enc", "side"]), ("side", ["x"]), ("enc", ["x"])],
                          output="head")
    order = g.list_topological_order()
    assert is_topological(g, order)
    # Hand-derived: the earliest-listed layer whose inputs are ready goes first.
    assert order == ("side", "enc", "mid", "head")
    assert is_topological(g, g.order)


def test_layer_graph_consumers_list_readers_once_in_list_order():
    g = build_layer_graph(["x"], [("a", ["x"]), ("b", ["a", "a"]), ("c", ["a", "b"])])
    assert g.consumers() == {"x": ["a"], "a": ["b", "c"], "b": ["c"], "c": []}
