"""Partition options and resolve_partition: pure, CPU-only, no torch.

The references are independent of the code under test: a brute force over contiguous cuts, hand
counts of layer classes, and plans written out in the test.
"""

from __future__ import annotations

import itertools

import pytest

from gpp_deepspeed.errors import PartitionError
from gpp_deepspeed.graph import build_layer_graph
from gpp_deepspeed.partitioning import (PARTITION_ALIASES, BranchBalanced, FromPlan, GraphPipeSearch, Manual,
                                        ResolvedPartition, SequentialChain, TypeBalanced, parse_partition_method,
                                        resolve_partition)
from gpp_deepspeed.planner import CostDB, Plan, PlanStage

from costdbs import chain as chain_db
from graphs import TWO_BRANCH_LAYERS, two_branch_graph


def chain_graph(n: int):
    names = [f"l{i}" for i in range(n)]
    return build_layer_graph(["x"], [(nm, ["x"] if i == 0 else [names[i - 1]]) for i, nm in enumerate(names)])


def brute_force_bottleneck(weights, num_parts):
    """Least heaviest part over every cut of ``weights`` into ``num_parts`` contiguous non-empty parts."""
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), num_parts - 1):
        bounds = (0, *cuts, len(weights))
        worst = max(sum(weights[bounds[k]:bounds[k + 1]]) for k in range(num_parts))
        best = worst if best is None else min(best, worst)
    return best


def stage_loads(stage_of, weight_of):
    loads = {}
    for name, s in stage_of.items():
        loads[s] = loads.get(s, 0) + weight_of[name]
    return [loads[s] for s in sorted(loads)]


def plan(*stages, pipeline="graph", schedule="1f1b", placement=()):
    """A hand-written plan: each stage is ``(layers, devices)`` or ``(layers, devices, recompute)``."""
    return Plan(model="two_branch", method="manual", source="test", micro_batch=2, mini_batch=8,
                pipeline=pipeline, schedule=schedule, placement=placement,
                stages=tuple(PlanStage(layers=tuple(s[0]), devices=s[1], recompute=(s[2:] or [False])[0])
                             for s in stages))


NEVER = {"param_count": lambda name: pytest.fail(f"read the parameters of {name}"),
         "layer_type": lambda name: pytest.fail(f"read the class of {name}")}


# ---------------------------------------------------------------------------------------------
# the user-facing names


def test_each_partition_method_name_maps_to_the_option_it_stands_for():
    assert parse_partition_method("parameters") == BranchBalanced(weight="parameters")
    assert parse_partition_method("uniform") == BranchBalanced(weight="layers")
    assert parse_partition_method("sequential") == SequentialChain(weight="parameters")
    assert parse_partition_method("graphpipe") == GraphPipeSearch()
    assert parse_partition_method("Uniform") == BranchBalanced(weight="layers")  # as DeepSpeed: any case
    assert parse_partition_method("type:TransformerBlock") == TypeBalanced(pattern="TransformerBlock")
    assert parse_partition_method({"a": 0}) == Manual(stage_of={"a": 0})
    assert sorted(PARTITION_ALIASES) == ["graphpipe", "parameters", "sequential", "uniform"]


def test_an_option_or_a_resolved_partition_passes_through_the_parser_unchanged():
    option = BranchBalanced(weight="layers", slack=0.0)
    assert parse_partition_method(option) is option
    resolved = resolve_partition(two_branch_graph(), option, num_stages=2)
    assert parse_partition_method(resolved) is resolved


def test_an_unknown_partition_method_is_refused_listing_the_valid_names():
    with pytest.raises(PartitionError, match=r'unknown partition_method "balanced"; valid: .*parameters.*uniform'):
        parse_partition_method("balanced")
    with pytest.raises(PartitionError, match="partition_method must be one of .*BranchBalanced.*got 3"):
        parse_partition_method(3)


def test_a_plan_file_and_a_cost_db_file_are_read_by_the_parser(tmp_path):
    written = plan((["text_proj", "text_block"], 1), (["image_proj", "image_block"], 1), (["fuse", "head"], 1))
    written.save(tmp_path / "plan.json")
    assert parse_partition_method(str(tmp_path / "plan.json")) == FromPlan(plan=written)
    assert parse_partition_method(tmp_path / "plan.json") == FromPlan(plan=written)  # a PathLike
    with pytest.raises(PartitionError, match='plan file ".*nope.json", which does not exist'):
        parse_partition_method(str(tmp_path / "nope.json"))
    db = chain_db(3)
    db.save(tmp_path / "db.json")
    assert parse_partition_method("graphpipe", cost_db=str(tmp_path / "db.json")) == GraphPipeSearch(cost_db=db)
    assert parse_partition_method("graphpipe", cost_db=db) == GraphPipeSearch(cost_db=db)
    with pytest.raises(PartitionError, match="given twice"):
        parse_partition_method(GraphPipeSearch(cost_db=db), cost_db=db)


def test_the_cost_db_argument_is_not_read_for_a_method_that_does_not_search_and_a_warning_says_so(tmp_path):
    # As before options existed: cost_db only matters to "graphpipe", so a missing file is no error.
    with pytest.warns(UserWarning, match='cost_db is ignored: .* the partition here is partition_method "uniform"'):
        assert parse_partition_method("uniform", cost_db=tmp_path / "absent.json") == BranchBalanced(weight="layers")


def test_a_manual_option_keeps_its_own_copy_of_the_mapping():
    mapping = {"a": 0}
    option = Manual(stage_of=mapping)
    mapping["a"] = 5
    assert option.stage_of == {"a": 0}


# ---------------------------------------------------------------------------------------------
# what each option cuts


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_branch_balanced_by_parameters_reaches_the_least_bottleneck_of_the_cut_order(num_stages):
    graph = two_branch_graph()
    params = {"text_proj": 5, "image_proj": 1, "text_block": 7, "image_block": 2, "fuse": 3, "head": 4}
    resolved = resolve_partition(graph, BranchBalanced(weight="parameters", slack=0.0), num_stages=num_stages,
                                 param_count=params)
    best = brute_force_bottleneck([params[n] for n in graph.order], num_stages)
    assert max(stage_loads(resolved.partition.stage_of, params)) == best


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_branch_balanced_by_layers_counts_layers_and_never_reads_parameters(num_stages):
    graph = two_branch_graph()
    resolved = resolve_partition(graph, BranchBalanced(weight="layers", slack=0.0), num_stages=num_stages, **NEVER)
    ones = dict.fromkeys(graph.names, 1)
    assert max(stage_loads(resolved.partition.stage_of, ones)) == brute_force_bottleneck([1] * 6, num_stages)


def test_branch_balanced_puts_the_two_branches_side_by_side_and_sequential_chains_them():
    graph = two_branch_graph()
    branchy = resolve_partition(graph, BranchBalanced(weight="layers"), num_stages=3, **NEVER).partition
    assert branchy.stage_graph.pipeline_depth == 2          # text and image stages both feed the fuse stage
    chained = resolve_partition(graph, SequentialChain(weight="layers"), num_stages=3, **NEVER).partition
    assert [(e.src, e.dst) for e in chained.stage_graph.edges] == [(0, 1), (1, 2)]
    # The list interleaves the branches, so the chain cuts it [text_proj, image_proj] [text_block,
    # image_block] [fuse, head], and every tensor crosses exactly one hop.
    assert [list(s.layers) for s in chained.stages] == [[n for n, _ in TWO_BRANCH_LAYERS[2 * k:2 * k + 2]]
                                                        for k in range(3)]


def test_sequential_chain_relays_a_tensor_through_every_stage_it_skips():
    graph = build_layer_graph(["x"], [("a", ["x"]), ("b", ["a"]), ("c", ["b"]), ("d", ["c", "a"])])
    resolved = resolve_partition(graph, SequentialChain(weight="layers"), num_stages=4, **NEVER)
    assert [(e.src, e.dst, [str(t) for t in e.tensors]) for e in resolved.partition.stage_graph.edges] == [
        (0, 1, ["a"]), (1, 2, ["a", "b"]), (2, 3, ["a", "c"])]


def test_type_balanced_counts_only_the_layers_whose_class_matches():
    graph = chain_graph(6)
    types = dict(zip(graph.names, ["Embedding", "Block", "Block", "LayerNorm", "Block", "Block"]))
    resolved = resolve_partition(graph, TypeBalanced(pattern="^block$"), num_stages=2, layer_type=types,
                                 param_count=NEVER["param_count"])
    blocks = {n: int(t == "Block") for n, t in types.items()}
    assert stage_loads(resolved.partition.stage_of, blocks) == [2, 2]
    assert resolved.source == 'partition_method "type:^block$"'
    with pytest.raises(PartitionError, match='partition_method "type:Attention" matches no layer class'):
        resolve_partition(graph, TypeBalanced(pattern="Attention"), num_stages=2, layer_type=types)


def test_graphpipe_without_a_cost_db_prices_layers_by_their_parameters():
    graph = chain_graph(4)
    params = {"l0": 1, "l1": 1, "l2": 1, "l3": 100}   # the last layer is all the work
    resolved = resolve_partition(graph, GraphPipeSearch(), num_stages=2, param_count=params)
    assert resolved.partition.stage_of == {"l0": 0, "l1": 0, "l2": 0, "l3": 1}


def test_graphpipe_with_a_cost_db_prices_by_its_times_and_refuses_one_of_another_model():
    graph = chain_graph(4)
    db = chain_db(4, fwd={"l0": 100.0}, bwd={"l0": 200.0})   # now the first layer is all the work
    resolved = resolve_partition(graph, GraphPipeSearch(cost_db=db), num_stages=2, **NEVER)
    assert resolved.partition.stage_of == {"l0": 0, "l1": 1, "l2": 1, "l3": 1}
    with pytest.raises(PartitionError, match=r"does not describe this model's layers: missing \['l3'\]"):
        resolve_partition(graph, GraphPipeSearch(cost_db=chain_db(3)), num_stages=2)


def test_a_manual_mapping_is_taken_as_written_and_checked():
    graph = two_branch_graph()
    mapping = {"text_proj": 0, "text_block": 0, "image_proj": 1, "image_block": 1, "fuse": 2, "head": 2}
    resolved = resolve_partition(graph, Manual(stage_of=mapping), num_stages=3, **NEVER)
    assert resolved.partition.stage_of == mapping and resolved.stage_degrees == (1, 1, 1)
    with pytest.raises(PartitionError, match=r"misses layer\(s\) \['head'\]"):
        resolve_partition(graph, Manual(stage_of={k: v for k, v in mapping.items() if k != "head"}), num_stages=3)


# ---------------------------------------------------------------------------------------------
# plans: stages, degrees, schedule and recomputation come through the resolved partition


def test_a_plan_brings_its_stages_devices_schedule_and_recomputation():
    written = plan((["text_proj", "text_block"], 2, True), (["image_proj", "image_block"], 1),
                   (["fuse", "head"], 1), schedule="zb1")
    resolved = resolve_partition(two_branch_graph(), FromPlan(plan=written), world_size=8, **NEVER)
    assert resolved.partition.stage_of == written.stage_of
    assert resolved.stage_degrees == (2, 1, 1)
    assert resolved.schedule == "zb1" and resolved.recompute == {0} and not resolved.keep_stage_order
    assert [(e.src, e.dst) for e in resolved.partition.stage_graph.edges] == [(0, 2), (1, 2)]


def test_a_plan_priced_as_a_chain_runs_as_a_chain_and_a_placed_plan_keeps_stage_order():
    written = plan((["text_proj", "image_proj"], 1), (["text_block", "image_block"], 1), (["fuse", "head"], 1),
                   pipeline="chain", placement=((0, ), (1, ), (2, )))
    resolved = resolve_partition(two_branch_graph(), FromPlan(plan=written), num_stages=3)
    assert [(e.src, e.dst) for e in resolved.partition.stage_graph.edges] == [(0, 1), (1, 2)]
    assert resolved.keep_stage_order and resolved.schedule == "1f1b" and resolved.recompute == frozenset()


def test_a_plan_whose_counts_disagree_with_the_launch_is_refused_naming_both():
    written = plan((["text_proj", "text_block"], 1), (["image_proj", "image_block"], 2), (["fuse", "head"], 1))
    graph = two_branch_graph()
    with pytest.raises(PartitionError, match=r"plan manual for two_branch has 3 stages but the pipeline has 2; "
                                             r"launch with 3 pipeline stages \(num_stages=3\)"):
        resolve_partition(graph, FromPlan(plan=written), num_stages=2)
    with pytest.raises(PartitionError, match=r"stage_degrees=\[1, 1, 1\] disagrees with the plan's devices per "
                                             r"stage \[1, 2, 1\]"):
        resolve_partition(graph, FromPlan(plan=written), stage_degrees=[1, 1, 1])
    with pytest.raises(PartitionError, match=r"places its 3 stages on 4 devices \[1, 2, 1\], but the world size is 6"):
        resolve_partition(graph, FromPlan(plan=written), world_size=6)


# ---------------------------------------------------------------------------------------------
# stage counts and degrees, checked before anything is cut


def test_stage_degrees_give_the_stage_count_and_the_ranks_per_stage():
    resolved = resolve_partition(two_branch_graph(), BranchBalanced(weight="layers"), stage_degrees=[2, 1, 1],
                                 world_size=8)
    assert resolved.num_stages == 3 and resolved.stage_degrees == (2, 1, 1)


@pytest.mark.parametrize("counts, message", [
    ({}, "give num_stages, stage_degrees, a plan or topology"),
    ({"num_stages": 0}, "num_stages must be a positive integer, got 0"),
    ({"num_stages": 2, "stage_degrees": [1, 1, 1]}, r"stage_degrees=\[1, 1, 1\] gives 3 stages but num_stages is 2"),
    ({"num_stages": 3, "world_size": 2}, r"num_stages \(3\) must divide the world size \(2\)"),
    ({"stage_degrees": [2, 1], "world_size": 2}, r"stage degrees \[2, 1\] need 3 ranks .* world size \(2\)"),
])
def test_bad_stage_counts_are_refused_before_any_layer_is_read(counts, message):
    with pytest.raises(ValueError, match=message):
        resolve_partition(two_branch_graph(), BranchBalanced(), **counts, **NEVER)


def test_a_resolved_partition_is_kept_when_it_fits_the_model_and_the_launch():
    graph = two_branch_graph()
    resolved = resolve_partition(graph, BranchBalanced(weight="layers"), stage_degrees=[2, 1, 1])
    assert resolve_partition(graph, resolved, num_stages=3, world_size=4, **NEVER) is resolved
    with pytest.raises(PartitionError, match="has 3 stages but the pipeline has 2"):
        resolve_partition(graph, resolved, num_stages=2)
    with pytest.raises(ValueError, match=r"need 4 ranks .* world size \(6\)"):
        resolve_partition(graph, resolved, world_size=6)
    with pytest.raises(PartitionError, match="made for another layer graph"):
        resolve_partition(chain_graph(3), resolved)


def test_a_resolved_partition_is_a_frozen_value():
    resolved = resolve_partition(two_branch_graph(), BranchBalanced(weight="layers"), num_stages=2)
    assert isinstance(resolved, ResolvedPartition)
    with pytest.raises(AttributeError):
        resolved.stage_degrees = (2, 2)


def test_a_device_profile_given_as_cost_db_asks_graphpipe_to_time_the_layers_at_start_up():
    from gpp_deepspeed.partitioning import DeviceProfile

    profile = DeviceProfile(make_inputs=lambda b: None, micro_batches=(4, 1, 2, 2))
    option = parse_partition_method("graphpipe", cost_db=profile)
    assert option == GraphPipeSearch(profile=profile) and option.profile.micro_batches == (1, 2, 4)
    # the pure resolver cannot time anything: it says who does
    with pytest.raises(PartitionError, match="profile_on_ranks"):
        resolve_partition(chain_graph(3), option, num_stages=2)
    with pytest.raises(PartitionError, match="given twice"):
        parse_partition_method(GraphPipeSearch(profile=profile), cost_db=profile)
    with pytest.raises(PartitionError, match="positive micro_batches"):
        DeviceProfile(make_inputs=lambda b: None, micro_batches=(0,))


def test_graphpipe_without_a_stage_count_plans_for_the_ranks_present():
    # A restart on fewer ranks (issue 31): GraphPipe's whole search on the world size, every rank
    # of it used, the same answer on every rank.
    graph = two_branch_graph()
    for world_size in (6, 4, 3):
        resolved = resolve_partition(graph, GraphPipeSearch(), world_size=world_size, param_count=lambda name: 100)
        assert world_size % sum(resolved.stage_degrees) == 0 and len(set(resolved.stage_degrees)) == 1
        assert "ranks present" in resolved.source
        again = resolve_partition(graph, GraphPipeSearch(), world_size=world_size, param_count=lambda name: 100)
        assert again.partition.stage_of == resolved.partition.stage_of
    with pytest.raises(ValueError, match="give num_stages"):
        resolve_partition(graph, GraphPipeSearch(), param_count=lambda name: 100)   # no world: nothing to plan for
