"""Tensor parallelism: the layout is DeepSpeed's, transfers go leader to leader, and bad input
fails by name before any rank blocks.

Pure tests: the placement with TP degrees lays ranks out as DeepSpeed's
``PipeModelDataParallelTopology`` does, its groups, its checks, the composition refusals, and
stage transfers between stages of different TP degrees over an in-process transport. One
distributed test (4 gloo ranks, ``tests/workers/tp_bad_inputs.py``): each bad input raises the
same ValueError naming the culprit on every rank, and no rank hangs.
"""

import json
from collections import deque

import pytest
import torch
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from dist import launch
from conftest import WORKERS
from test_engine_rooms import _InProcessTransport, _PostOffice
from gpp_deepspeed.engine.buffers import StageBuffers
from gpp_deepspeed.engine.reshard import edge_peers, warm_up_pairs
from gpp_deepspeed.engine.transfers import StageTransfers
from gpp_deepspeed.graph.ir import TensorRef
from gpp_deepspeed.schedule.ir import ActionKind as K, Buffer
from gpp_deepspeed.engine.topology import StageTopology, check_tp_composes
from gpp_deepspeed.errors import GPPConfigError
from gpp_deepspeed.graph.placement import Placement
from gpp_deepspeed.graph.stages import StageEdge, StageGraph


@pytest.mark.parametrize("pp,mp,dp", [(2, 2, 2), (3, 2, 1), (2, 4, 1), (1, 2, 3)])
def test_placement_with_tp_lays_ranks_out_as_deepspeeds_3d_topology(pp, mp, dp):
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=mp, num_dp=dp)
    placement = Placement.build([mp] * pp, world_size=pp * mp * dp, tp=[mp] * pp)
    ours = StageTopology(placement)
    assert ours.get_axis_names() == ["pipe", "data", "model"]
    for rank in range(pp * mp * dp):
        assert tuple(ours.get_coord(rank)) == (topo.get_coord(rank).pipe, topo.get_coord(rank).data,
                                              topo.get_coord(rank).model), rank
        assert ours.get_rank_repr(rank) == topo.get_rank_repr(rank)   # layer_XX-model_YY file names
    for group in topo.get_axis_comm_lists("model"):
        place = placement.locate(group[0])
        assert placement.tp_group(place.stage, place.replica, place.dp_idx) == tuple(group)
    for group in topo.get_axis_comm_lists("data"):
        place = placement.locate(group[0])
        assert placement.data_group(place.stage, place.tp_idx) == tuple(group)


def test_placement_splits_a_stage_into_row_shards_of_adjacent_tp_ranks():
    p = Placement.build([2, 2, 2], world_size=6, tp=[2, 1, 2])
    assert p.dp == (1, 2, 1) and p.shard_leaders(0, 0) == (0, ) and p.shard_leaders(1, 0) == (2, 3)
    assert [(p.locate(r).dp_idx, p.locate(r).tp_idx) for r in range(6)] == [(0, 0), (0, 1), (0, 0), (1, 0), (0, 0),
                                                                            (0, 1)]
    p.check_micro_batch(2)   # stage 1's two row shards; the TP stages hold the whole micro-batch
    with pytest.raises(GPPConfigError, match="stage 1 runs on 2 ranks .* 3 samples"):
        p.check_micro_batch(3)


def test_edges_between_tp_stages_connect_shard_leaders_only():
    p = Placement.build([2, 2, 2], world_size=6, tp=[2, 1, 2])
    assert [x.rank for x in edge_peers(p, src=0, dst=1, replica=0, idx=0, side="src")] == [2, 3]
    assert [x.rank for x in edge_peers(p, src=1, dst=2, replica=0, idx=1, side="src")] == [4]
    assert [x.rank for x in edge_peers(p, src=0, dst=2, replica=0, idx=0, side="dst")] == [0]
    chain = StageGraph.chain(3)
    assert warm_up_pairs(p, chain, replica=0) == [(0, 1, 0, 2), (0, 1, 0, 3), (1, 2, 2, 4), (1, 2, 3, 4)]


def test_placement_refuses_a_tp_degree_that_does_not_divide_the_stage_naming_it():
    with pytest.raises(GPPConfigError, match="stage 1 runs on 3 ranks per replica, which its TP degree 2"):
        Placement.build([2, 3], world_size=5, tp=[2, 2])
    with pytest.raises(GPPConfigError, match=r"one per stage \(2\)"):
        Placement.build([2, 2], world_size=4, tp=[2])


def test_placement_refuses_a_tp_group_across_nodes_unless_asked():
    with pytest.raises(GPPConfigError, match=r"stage 1's tensor-parallel group \[1, 2\] spans two nodes of 2 ranks"):
        Placement.build([1, 2], world_size=3, tp=[1, 2], local_size=2)
    assert Placement.build([1, 2], world_size=3, tp=[1, 2], local_size=2, tp_across_nodes=True).tp_group(1, 0, 0) == (1, 2)
    Placement.build([2, 2], world_size=4, tp=[2, 2], local_size=2)   # each group inside its node


def test_schedules_and_folds_that_do_not_compose_with_tp_are_refused_by_name():
    tp = Placement.build([2, 1], world_size=3, tp=[2, 1])
    with pytest.raises(GPPConfigError, match='"pipedream" is asynchronous.*stage_tp \\[2, 1\\]'):
        check_tp_composes(tp, schedule="pipedream", asynchronous=True)
    with pytest.raises(GPPConfigError, match="several stages per rank"):
        check_tp_composes(tp, schedule="1f1b", asynchronous=False, stages_per_rank=2)
    check_tp_composes(tp, schedule="zb1", asynchronous=False)
    check_tp_composes(Placement.build([1, 1], world_size=2), schedule="pipedream", asynchronous=True, stages_per_rank=2)


EXPECTED = {  # case -> words the message must contain
    "tp_does_not_divide_stage": ["stage 0 runs on 3 ranks", "TP degree 2"],
    "tp_not_one_per_stage": ["one per stage (2)", "[2]"],
    "tp_group_spans_nodes": ["tensor-parallel group [0, 1]", "spans two nodes of 1 ranks", "tp_across_nodes=True"],
    "topology_contradicts_stage_tp": ["stage_tp [1, 1]", "model axis (2"],
    "async_schedule_with_tp": ['"pipedream" is asynchronous', "stage_tp [2, 1]", '"1f1b"'],
    "config_stage_tp_is_not_the_modules": ["graph_pipeline.stage_tp [1, 1]", "[2, 1]"],
    "mpu_for_another_layout": ["mpu.get_tensor_model_parallel_world_size() is 4", "the module's grid says", "mpu=model.mpu()"],
}


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_bad_inputs")
    result = launch(4, WORKERS / "tp_bad_inputs.py", str(out), timeout=300, log_dir=out / "logs")
    assert result.ok, result.report()
    return [json.loads((out / f"errors.rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_tp_input_raises_a_value_error_naming_the_culprit_on_every_rank(errors, case):
    for rank, per_rank in enumerate(errors):
        kind, message, is_value_error = (per_rank[case] + [False])[:3]
        assert kind is not None, f"rank {rank}: {case} raised nothing"
        assert is_value_error, f"rank {rank}: {case} raised {kind}: {message}"
        for word in EXPECTED[case]:
            assert word in message, f"rank {rank}: {case}: {word!r} not in {message!r}"


# -- transfers between stages of different TP degrees, without an engine ----------------------------

class _InProcessTPTransport(_InProcessTransport):
    """test_engine_rooms' in-process transport, with TP-group broadcasts handed over in process
    too (the group is its tuple of ranks)."""

    def broadcast(self, buffers, *, src, group):
        if self.rank == src:
            for peer in group:
                if peer != src:
                    self.post.queues.setdefault(("bcast", src, peer), deque()).append([b.clone() for b in buffers])
        else:
            for into, got in zip(buffers, self.post.queues[("bcast", src, self.rank)].popleft()):
                into.copy_(got)


@pytest.mark.parametrize("tp", [(2, 1), (1, 2)], ids=lambda t: f"tp{t}")
def test_tp_transfers_send_once_per_row_shard_and_broadcast_in_the_tp_group(tp):
    """Stages of (TP, DP) (2, 1) -> (1, 2), and the reverse, on 4 ranks: only TP leaders exchange
    messages, each row shard's rows once; every TP rank ends with the same tensors."""
    graph = StageGraph(num_stages=2, edges=(StageEdge(0, 1, (TensorRef("a"), )), ), output_stage=1)
    placement = Placement.build([2, 2], world_size=4, tp=tp)
    post = _PostOffice()
    rooms = {}
    for rank in range(4):
        place = placement.locate(rank)
        group = placement.tp_group(place.stage, 0, place.dp_idx)
        rooms[rank] = (place, StageTransfers(graph, placement, stage_idx=place.stage, replica=0,
                                             rank_idx=place.dp_idx, out_ports=(TensorRef("a"), ),
                                             transport=_InProcessTPTransport(post, rank=rank, stage=place.stage),
                                             tp_group=group, tp_leader=group[0]), StageBuffers(num_slots=1))
    micro_batch = torch.arange(12.0).reshape(4, 3)
    rows = lambda s, place: micro_batch[place.dp_idx * (4 // placement.dp[s]):][:4 // placement.dp[s]]  # noqa: E731
    for rank in (0, 1):
        place, t, buffers = rooms[rank]
        buffers[Buffer.OUTPUTS, 0] = (rows(0, place), )
        t.run([(K.SEND_L, 0, 1), (K.SEND_F, 0, 1)], buffers)
    assert not [k for k in post.queues if k[0] != "bcast" and k[0] not in placement.shard_leaders(0, 0)]
    assert sum(len(q) for k, q in post.queues.items() if k[0] != "bcast") == 2 * max(placement.dp)   # layout + rows, per leader pair
    for rank in (2, 3):
        place, t, buffers = rooms[rank]
        t.run([(K.RECV_L, 0, 0)], buffers)
        t.run([(K.RECV_F, 0, 0)], buffers)
        got = buffers[Buffer.RECEIVED, 0][TensorRef("a")]
        assert torch.equal(got, rows(1, place)), (rank, got)
        got.grad = -got.detach()
        t.run([(K.SEND_B, 0, 0)], buffers)
    for rank in (0, 1):
        place, t, buffers = rooms[rank]
        t.run([(K.RECV_B, 0, 1)], buffers)
        want = -rows(0, place) * placement.dp[0] / placement.dp[1]
        assert torch.equal(buffers[Buffer.GRADS, 0][0], want), rank
    assert all(not q for q in post.queues.values()), "every message sent was received"
