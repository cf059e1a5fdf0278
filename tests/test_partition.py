"""Unit tests of the partitioners and of derive_partition: pure, CPU-only, no torch.distributed."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpp_deepspeed.errors import GPPConfigError, PartitionError
from gpp_deepspeed.graph import (LayerGraph, StageEdge, StageGraph, TensorRef, balanced_partition,
                                 build_layer_graph, derive_partition, sequential_partition)

from graphs import two_branch_graph


# ---------------------------------------------------------------------------------------------
# independent references


def brute_force_bottleneck(weights, num_parts):
    """Least heaviest part over every cut of ``weights`` into ``num_parts`` contiguous non-empty parts."""
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), num_parts - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(weights[bounds[k]:bounds[k + 1]]) for k in range(num_parts))
        best = worst if best is None else min(best, worst)
    return best


def assert_contiguous_cut(stage_of, order, num_stages):
    """Every layer has a stage; along ``order`` the stages run 0, 0, .., 1, .., num_stages - 1 without gaps."""
    assert set(stage_of) == set(order)
    seq = [stage_of[n] for n in order]
    assert seq[0] == 0 and seq[-1] == num_stages - 1
    assert all(b - a in (0, 1) for a, b in zip(seq, seq[1:])), seq
    assert sorted(set(seq)) == list(range(num_stages))  # every stage non-empty


def stage_weights(stage_of, weight_of, num_stages):
    totals = [0] * num_stages
    for name, s in stage_of.items():
        totals[s] += weight_of[name]
    return totals


@st.composite
def random_dags(draw):
    """A small random layer DAG written in a random list order, plus per-layer weights."""
    n = draw(st.integers(1, 8))
    input_names = ["x", "y"][:draw(st.integers(1, 2))]
    names = [f"l{i}" for i in range(n)]  # l0..l{n-1} is a topological order; l{n-1} is the output
    inputs = []
    for i in range(n):
        pool = input_names + names[:i]
        chosen = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
        inputs.append(chosen)
    for i in range(n - 1):  # route every otherwise unread layer into the output
        if not any(names[i] in inputs[j] for j in range(i + 1, n)):
            inputs[n - 1].append(names[i])
    listed = draw(st.permutations(range(n)))
    graph = build_layer_graph(input_names, [(names[i], inputs[i]) for i in listed], output=names[n - 1])
    weights = draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))  # in graph.nodes (list) order
    num_stages = draw(st.integers(1, min(4, n)))
    return graph, weights, num_stages


# ---------------------------------------------------------------------------------------------
# partitioners: structure and optimality


@pytest.mark.parametrize("partitioner, order_of", [
    (balanced_partition, lambda g: g.order),
    (sequential_partition, lambda g: g.list_topological_order()),
])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=random_dags())
def test_partitioners_cut_their_order_into_contiguous_stages_with_the_least_bottleneck(partitioner, order_of, case):
    graph, weights, num_stages = case
    stage_of = partitioner(graph, num_stages, weights=weights)
    order = order_of(graph)
    assert_contiguous_cut(stage_of, order, num_stages)
    weight_of = dict(zip(graph.names, weights))
    got = max(stage_weights(stage_of, weight_of, num_stages))
    assert got == brute_force_bottleneck([weight_of[n] for n in order], num_stages)
    # A contiguous cut of a topological order never makes stages depend on each other in a loop.
    part = derive_partition(graph, stage_of, num_stages=num_stages)
    assert part.stage_graph.output_stage == num_stages - 1


@pytest.mark.parametrize("partitioner", [balanced_partition, sequential_partition])
def test_partitioners_match_hand_computed_cuts_of_a_weighted_chain(partitioner):
    g = build_layer_graph(["x"], [("a", ["x"]), ("b", ["a"]), ("c", ["b"]), ("d", ["c"]), ("e", ["d"])])
    # weights 4 1 1 1 4 into 3 parts: the least bottleneck is 4, reached only by [a] [b c d] [e].
    assert partitioner(g, 3, weights=[4, 1, 1, 1, 4]) == {"a": 0, "b": 1, "c": 1, "d": 1, "e": 2}
    # one stage per layer when stages == layers
    assert partitioner(g, 5, weights=[1, 1, 1, 1, 1]) == {"a": 0, "b": 1, "c": 2, "d": 3, "e": 4}
    assert partitioner(g, 1, weights=[1, 2, 3, 4, 5]) == dict.fromkeys("abcde", 0)


def test_balanced_partition_puts_the_two_branches_on_different_stages():
    g = two_branch_graph()
    stage_of = balanced_partition(g, 3, weights=[1] * 6)
    assert stage_of["text_proj"] == stage_of["text_block"]
    assert stage_of["image_proj"] == stage_of["image_block"]
    assert stage_of["text_proj"] != stage_of["image_proj"]
    assert stage_of["fuse"] == stage_of["head"] == 2
    part = derive_partition(g, stage_of, num_stages=3)
    sg = part.stage_graph
    assert sorted((e.src, e.dst) for e in sg.edges) == [(0, 2), (1, 2)]
    assert sg.pipeline_depth == 2
    assert [sg.depth(s) for s in range(3)] == [2, 2, 1]


def test_sequential_partition_of_the_interleaved_list_gives_a_chain_of_depth_three():
    g = two_branch_graph()
    stage_of = sequential_partition(g, 3, weights=[1] * 6)
    assert stage_of == {"text_proj": 0, "image_proj": 0, "text_block": 1, "image_block": 1, "fuse": 2, "head": 2}
    sg = derive_partition(g, stage_of, num_stages=3).stage_graph
    assert sorted((e.src, e.dst) for e in sg.edges) == [(0, 1), (1, 2)]
    assert sg.pipeline_depth == 3


@pytest.mark.parametrize("partitioner", [balanced_partition, sequential_partition])
def test_partitioners_reject_more_stages_than_layers(partitioner):
    g = build_layer_graph(["x"], [("a", ["x"]), ("b", ["a"]), ("c", ["b"])])
    with pytest.raises(PartitionError, match="4 stages"):
        partitioner(g, 4, weights=[1, 1, 1])


@pytest.mark.parametrize("partitioner", [balanced_partition, sequential_partition])
def test_partitioners_reject_zero_stages_and_a_wrong_number_of_weights(partitioner):
    g = build_layer_graph(["x"], [("a", ["x"]), ("b", ["a"])])
    with pytest.raises(PartitionError):
        partitioner(g, 0, weights=[1, 1])
    with pytest.raises(PartitionError, match="weights"):
        partitioner(g, 2, weights=[1, 1, 1])


# ---------------------------------------------------------------------------------------------
# derive_partition: errors


def chain_abc() -> LayerGraph:
    return build_layer_graph(["x"], [("a", ["x"]), ("b", ["a"]), ("c", ["b"])])


def test_partition_error_is_a_value_error():
    assert issubclass(PartitionError, GPPConfigError)
    assert issubclass(PartitionError, ValueError)


def test_derive_partition_rejects_a_mapping_that_misses_a_layer():
    with pytest.raises(PartitionError, match="misses") as info:
        derive_partition(chain_abc(), {"a": 0, "c": 1}, num_stages=2)
    assert "'b'" in str(info.value)


def test_derive_partition_rejects_an_unknown_layer():
    with pytest.raises(PartitionError, match="unknown") as info:
        derive_partition(chain_abc(), {"a": 0, "b": 0, "c": 1, "ghost": 1}, num_stages=2)
    assert "ghost" in str(info.value)


@pytest.mark.parametrize("bad_stage", [2, -1, 7])
def test_derive_partition_rejects_an_out_of_range_stage(bad_stage):
    with pytest.raises(PartitionError) as info:
        derive_partition(chain_abc(), {"a": 0, "b": 1, "c": bad_stage}, num_stages=2)
    msg = str(info.value)
    assert '"c"' in msg and str(bad_stage) in msg


def test_derive_partition_rejects_an_empty_stage():
    with pytest.raises(PartitionError, match="no layers") as info:
        derive_partition(chain_abc(), {"a": 0, "b": 0, "c": 2}, num_stages=3)
    assert "[1]" in str(info.value)


def test_derive_partition_rejects_more_stages_than_layers():
    with pytest.raises(PartitionError):
        derive_partition(chain_abc(), {"a": 0, "b": 1, "c": 2}, num_stages=4)


def test_derive_partition_rejects_a_cycle_between_stages():
    with pytest.raises(PartitionError, match="cycle") as info:
        derive_partition(chain_abc(), {"a": 0, "b": 1, "c": 0}, num_stages=2)
    msg = str(info.value)
    assert "stage 0" in msg and "stage 1" in msg


# ---------------------------------------------------------------------------------------------
# derive_partition: hand-made examples


def test_derive_partition_sends_a_skip_tensor_straight_to_its_reader():
    # enc (stage 0) returns a tuple: element 0 goes to mid (stage 1), element 1 skips to head (stage 2).
    g = build_layer_graph(["x", "y"], [("enc", ["x"]), ("mid", ["enc:0"]), ("head", ["mid", "enc:1", "y"])])
    part = derive_partition(g, {"enc": 0, "mid": 1, "head": 2}, num_stages=3)
    sg = part.stage_graph
    assert sg.edges == (
        StageEdge(0, 1, (TensorRef("enc", 0),)),
        StageEdge(0, 2, (TensorRef("enc", 1),)),
        StageEdge(1, 2, (TensorRef("mid"),)),
    )
    assert sg.output_stage == 2
    assert [sg.depth(s) for s in range(3)] == [3, 2, 1]
    s0, s1, s2 = part.stages
    assert (s0.layers, s0.loads, s0.in_ports) == (("enc",), ("x",), (TensorRef("x"),))
    assert s0.out_ports == (TensorRef("enc", 0), TensorRef("enc", 1))
    assert (s1.loads, s1.in_ports, s1.out_ports) == ((), (TensorRef("enc", 0),), (TensorRef("mid"),))
    # loaded graph inputs first, then received tensors edge by edge in increasing source stage
    assert s2.loads == ("y",)
    assert s2.in_ports == (TensorRef("y"), TensorRef("enc", 1), TensorRef("mid"))
    assert s2.out_ports == ()
    assert part.layer_order == ("enc", "mid", "head")
    assert part.bounds == [0, 1, 2, 3]


def test_derive_partition_puts_a_tensor_read_by_three_stages_on_three_edges():
    g = build_layer_graph(["x"], [("emb", ["x"]), ("a1", ["emb"]), ("b1", ["emb", "a1"]), ("head", ["b1", "emb"])])
    part = derive_partition(g, {"emb": 0, "a1": 1, "b1": 2, "head": 3}, num_stages=4)
    sg = part.stage_graph
    emb = TensorRef("emb")
    assert sg.edges == (
        StageEdge(0, 1, (emb,)),
        StageEdge(0, 2, (emb,)),
        StageEdge(0, 3, (emb,)),
        StageEdge(1, 2, (TensorRef("a1"),)),
        StageEdge(2, 3, (TensorRef("b1"),)),
    )
    assert part.stages[0].out_ports == (emb,)  # one port, fanned out to three readers
    assert part.stages[2].in_ports == (emb, TensorRef("a1"))
    assert part.stages[3].in_ports == (emb, TensorRef("b1"))
    assert [sg.depth(s) for s in range(4)] == [4, 3, 2, 1]
    assert sorted(sg.preds(3)) == [0, 2] and sorted(sg.succs(0)) == [1, 2, 3]


def test_derive_partition_keeps_same_stage_reads_off_the_edges_and_orders_multi_tensor_edges():
    g = build_layer_graph(["x"], [("p", ["x"]), ("q", ["p"]), ("r", ["q", "p"])])
    part = derive_partition(g, {"p": 0, "q": 0, "r": 1}, num_stages=2)
    # both p and q cross 0 -> 1; p is earlier in the cut order, so it is sent first
    assert part.stage_graph.edges == (StageEdge(0, 1, (TensorRef("p"), TensorRef("q"))),)
    assert part.stages[0].in_ports == (TensorRef("x"),)
    assert part.stages[1].in_ports == (TensorRef("p"), TensorRef("q"))


@pytest.mark.parametrize("edges, expected", [
    ([], [1]),
    ([(0, 1), (1, 2), (2, 3)], [4, 3, 2, 1]),
    ([(0, 2), (1, 2)], [2, 2, 1]),
    ([(0, 1), (0, 2), (1, 3), (2, 3), (0, 3)], [3, 2, 2, 1]),
    ([(0, 4), (1, 4), (2, 4), (3, 4)], [2, 2, 2, 2, 1]),
    ([(0, 1), (1, 3), (2, 3), (0, 3)], [3, 2, 2, 1]),
])
def test_stage_graph_depth_counts_stages_on_the_longest_path_to_the_output(edges, expected):
    n = len(expected)
    sg = StageGraph(num_stages=n, edges=tuple(StageEdge(a, b, ()) for a, b in edges), output_stage=n - 1)
    assert [sg.depth(s) for s in range(n)] == expected
    assert sg.pipeline_depth == max(expected)


def test_stage_graph_chain_and_json_round_trip():
    assert [StageGraph.chain(5).depth(s) for s in range(5)] == [5, 4, 3, 2, 1]
    g = build_layer_graph(["x", "y"], [("enc", ["x"]), ("mid", ["enc:0"]), ("head", ["mid", "enc:1", "y"])])
    sg = derive_partition(g, {"enc": 0, "mid": 1, "head": 2}, num_stages=3).stage_graph
    assert StageGraph.from_json(sg.to_json()) == sg


# ---------------------------------------------------------------------------------------------
# chains: skip tensors relayed through the stages in between (DeepSpeed's PipelineEngine)


def test_derive_partition_as_a_chain_relays_a_skip_tensor_through_every_stage_in_between():
    # the same graph as above, cut the same way, run as a chain: enc:1 passes through stage 1
    g = build_layer_graph(["x", "y"], [("enc", ["x"]), ("mid", ["enc:0"]), ("head", ["mid", "enc:1", "y"])])
    part = derive_partition(g, {"enc": 0, "mid": 1, "head": 2}, num_stages=3, relay=True)
    assert part.stage_graph.edges == (
        StageEdge(0, 1, (TensorRef("enc", 0), TensorRef("enc", 1))),
        StageEdge(1, 2, (TensorRef("enc", 1), TensorRef("mid"))),
    )
    s0, s1, s2 = part.stages
    assert s0.out_ports == (TensorRef("enc", 0), TensorRef("enc", 1))
    # stage 1 receives the skip tensor and sends it on unchanged: an in-port and an out-port
    assert s1.in_ports == (TensorRef("enc", 0), TensorRef("enc", 1))
    assert s1.out_ports == (TensorRef("enc", 1), TensorRef("mid"))
    assert s2.in_ports == (TensorRef("y"), TensorRef("enc", 1), TensorRef("mid"))


def test_build_schedule_of_a_chain_shows_the_relay_on_the_intermediate_stage():
    from gpp_deepspeed.schedule import ActionKind as K, build_schedule, validate_schedule

    g = build_layer_graph(["x"], [("l1", ["x"]), ("l2", ["l1"]), ("l3", ["l2"]), ("res", ["l3", "l1"])])
    part = derive_partition(g, {"l1": 0, "l2": 1, "l3": 2, "res": 3}, num_stages=4, relay=True)
    sg = part.stage_graph
    assert [(e.src, e.dst) for e in sg.edges] == [(0, 1), (1, 2), (2, 3)]
    assert [[str(t) for t in e.tensors] for e in sg.edges] == [["l1"], ["l1", "l2"], ["l1", "l3"]]
    sched = build_schedule(sg, 2)
    validate_schedule(sched, sg, 2, train=True)
    for s in (1, 2):  # l1 comes in from the stage before and goes out to the one after, both ways
        ops = {(op.kind, op.peer) for a in sched[s] for op in a.transfers}
        assert {(K.RECV_F, s - 1), (K.SEND_F, s + 1), (K.RECV_B, s + 1), (K.SEND_B, s - 1)} <= ops
    # the same cut as a DAG sends l1 straight to stage 3
    assert (0, 3) in [(e.src, e.dst) for e in derive_partition(g, part.stage_of, num_stages=4).stage_graph.edges]


def test_derive_partition_as_a_chain_rejects_a_stage_reading_a_later_one():
    g = build_layer_graph(["x"], [("a", ["x"]), ("b", ["a"]), ("c", ["b"])])
    stage_of = {"a": 1, "b": 0, "c": 2}  # a DAG 1 -> 0 -> 2, but not a chain in index order
    derive_partition(g, stage_of, num_stages=3)
    with pytest.raises(PartitionError, match='layer "b" on stage 0 reads "a" from stage 1'):
        derive_partition(g, stage_of, num_stages=3, relay=True)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=random_dags(), num_mb=st.integers(1, 5))
def test_sequential_chains_with_relays_carry_every_skip_tensor_and_pass_the_rendezvous_validator(case, num_mb):
    from gpp_deepspeed.schedule import SCHEDULES, assign_buffers, build_schedule, validate_schedule

    graph, weights, num_stages = case
    stage_of = sequential_partition(graph, num_stages, weights=weights)
    part = derive_partition(graph, stage_of, num_stages=num_stages, relay=True)
    sg = part.stage_graph
    assert [(e.src, e.dst) for e in sg.edges] == [(k, k + 1) for k in range(num_stages - 1)]
    for node in graph.nodes:  # every tensor a stage reads from an earlier one is on each hop between
        for ref in node.inputs:
            if not graph.is_input(ref):
                for k in range(stage_of[ref.node], stage_of[node.name]):
                    assert ref in sg.edge(k, k + 1).tensors
    for name in [n for n, spec in SCHEDULES.items() if not spec.asynchronous and spec.folded is None]:
        sched = build_schedule(sg, num_mb, name=name)
        validate_schedule(sched, sg, num_mb, train=True, slots=assign_buffers(sched))
