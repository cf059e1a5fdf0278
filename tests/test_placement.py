"""Placement arithmetic: which ranks run a stage, and which rows cross a stage edge.

The row transfers are checked against brute force: label every row of the micro-batch with the
producer that holds it and the consumer that needs it, and compare.
"""

import itertools

import pytest

from gpp_deepspeed.errors import GPPConfigError
from gpp_deepspeed.graph.placement import Placement, RowTransfer, reshard, shard_rows


def brute_force_transfers(b, n_src, n_dst):
    """Runs of consecutive rows with the same (holder, needer), ordered by consumer then row."""
    rows = [(r * n_dst // b, r * n_src // b, r) for r in range(b)]  # (consumer, producer, row)
    out = []
    for (dst, src), group in itertools.groupby(sorted(rows), key=lambda x: (x[0], x[1])):
        group = [r for _, _, r in group]
        out.append(RowTransfer(src, dst, group[0], group[-1] + 1))
    return tuple(out)


@pytest.mark.parametrize("n_src,n_dst", [(a, b) for a in range(1, 7) for b in range(1, 7)])
def test_reshard_sends_each_consumer_exactly_the_rows_it_needs_from_the_producers_that_hold_them(n_src, n_dst):
    b = n_src * n_dst * 2
    assert reshard(b, num_src=n_src, num_dst=n_dst) == brute_force_transfers(b, n_src, n_dst)


def test_reshard_between_equal_degrees_pairs_index_i_with_index_i():
    assert reshard(8, num_src=4, num_dst=4) == tuple(RowTransfer(i, i, 2 * i, 2 * i + 2) for i in range(4))


def test_reshard_rejects_a_micro_batch_a_degree_does_not_divide():
    with pytest.raises(GPPConfigError, match="4 samples cannot be split into 3"):
        reshard(4, num_src=1, num_dst=3)


def test_shard_rows_tile_the_micro_batch():
    assert [shard_rows(6, 3, i) for i in range(3)] == [(0, 2), (2, 4), (4, 6)]


def test_placement_gives_each_stage_contiguous_ranks_stage_by_stage_as_deepspeed_does():
    p = Placement.build((2, 1, 1), world_size=8)
    assert [p.ranks(s, 0) for s in range(3)] == [(0, 1), (4, ), (6, )]
    assert [p.ranks(s, 1) for s in range(3)] == [(2, 3), (5, ), (7, )]
    assert p.stage_group(0) == (0, 1, 2, 3) and p.replica_group(1) == (2, 3, 5, 7)
    assert [(p.locate(r).stage, p.locate(r).replica) for r in range(8)] == [
        (0, 0), (0, 0), (0, 1), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_placement_with_one_rank_per_stage_is_deepspeeds_pipe_data_topology():
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    topo = PipeDataParallelTopology(num_pp=3, num_dp=2)
    p = Placement.build((1, 1, 1), world_size=6)
    for rank in range(6):
        coord = topo.get_coord(rank)
        assert (p.locate(rank).stage, p.locate(rank).replica) == (coord.pipe, coord.data)


def test_placement_keeps_a_stage_that_fits_in_a_node_inside_one_node():
    p = Placement.build((1, 2, 1), world_size=4, local_size=2)
    assert p.ranks(1, 0) == (2, 3), "stage 1 (2 ranks) would straddle nodes 0-1 and 2-3 in stage order"
    assert sorted(r for s in range(3) for r in p.ranks(s, 0)) == [0, 1, 2, 3]
    assert Placement.build((1, 2, 1), world_size=4, local_size=4).ranks(1, 0) == (1, 2)


def test_placement_rejects_degrees_that_do_not_divide_the_world_naming_the_numbers():
    with pytest.raises(GPPConfigError, match=r"\[2, 1, 1\] need 4 ranks .* world size \(6\)"):
        Placement.build((2, 1, 1), world_size=6)


def test_placement_rejects_a_micro_batch_naming_the_stage_whose_degree_does_not_divide_it():
    with pytest.raises(GPPConfigError, match="stage 1 runs on 3 ranks .* 4 samples"):
        Placement.build((1, 3), world_size=4).check_micro_batch(4)
    Placement.build((1, 3), world_size=4).check_micro_batch(6)


def test_the_deepspeed_internals_reached_into_are_those_of_the_pinned_deepspeed():
    from gpp_deepspeed.engine import compat
    assert compat.installed_version() == compat.DEEPSPEED_VERSION, (
        "engine/compat.py reaches into DeepSpeed internals (PipelineParallelGrid by name, ZeRO's "
        "_model_parallel_all_reduce); check them against the new version, then update DEEPSPEED_VERSION")


def test_the_simulator_charges_a_link_latency_for_each_message_resharding_adds():
    from costdbs import chain, hardware
    from gpp_deepspeed.planner import CommFit, Plan, PlanStage
    from gpp_deepspeed.planner.simulate import simulate_plan

    alpha = 1e-3
    db = chain(2, out_bytes={"l0": 4}, hw=hardware(link=CommFit(alpha_s=alpha, beta_s_per_byte=0.0)))

    def stage_costs(degrees):
        plan = Plan(model="m", method="manual", source="test", micro_batch=6, mini_batch=12,
                    stages=(PlanStage(layers=("l0",), devices=degrees[0]), PlanStage(layers=("l1",), devices=degrees[1])))
        return simulate_plan(plan, db).stage_costs

    same = stage_costs((2, 2))
    resharded = stage_costs((2, 3))   # consumer rows [2, 4) come from both producers; producer 0 sends to 2 ranks
    assert resharded[0].fwd_s == pytest.approx(same[0].fwd_s + alpha)
    assert resharded[0].bwd_s == pytest.approx(same[0].bwd_s + alpha)
    compute_ratio = 2 / 3   # stage 1's shard shrinks from 3 to 2 rows; the edge itself is one more message
    assert resharded[1].fwd_s - alpha == pytest.approx((same[1].fwd_s - alpha) * compute_ratio + alpha)
