"""Resharding priced in the search: a stage's messages to neighbours of another degree, as the
engine sends them (one message per peer rank that holds a rank's rows), against a brute force over
partitions and degrees priced the same way, and against the simulator (pure)."""

from __future__ import annotations

import itertools
import math
import random

import networkx as nx
import pytest

from costdbs import chain, hardware, synthetic_db
from gpp_deepspeed.graph.placement import reshard
from gpp_deepspeed.models import V100_SUMMIT, analytic_costs, candle_uno
from gpp_deepspeed.planner import CommFit, StageCostModel
from gpp_deepspeed.planner import search
from gpp_deepspeed.planner.costs import reshard_messages
from gpp_deepspeed.planner.simulate import simulate_plan
from gpp_deepspeed.planner.sp import sp_tree
from test_search import _convex_partitions, _random_dag, _sp_candidates

OVERHEAD = 0.5   # seconds a message keeps each end busy: dear, so that resharding decides plans


def test_a_stage_beside_a_wider_one_is_priced_one_message_per_peer_rank():
    # l0 on 1 rank feeds l1 on 4 ranks: l0 sends its rows to each of the 4 (and takes 4 gradient
    # messages back); each rank of l1 receives from the one producer.
    db = chain(3, out_bytes={"l0": 1, "l1": 1}, hw=hardware(link=CommFit(alpha_s=OVERHEAD, beta_s_per_byte=0.0)))
    plain = StageCostModel(db, 4)
    l0, l1, l2 = (plain.mask_of([n]) for n in ("l0", "l1", "l2"))
    priced = plain.with_degrees([(l0, 1), (l1, 4), (l2, 1)])
    assert (plain.boundary(l0).out_messages, priced.boundary(l0, 1).out_messages) == (1, 4)
    assert priced.boundary(l1, 4).in_messages == 1 and priced.boundary(l1, 4).out_messages == 1
    assert priced.boundary(l2, 1).in_messages == 4      # l2 on 1 rank gathers the rows of 4
    # forward and backward each busy once per message: 4 messages instead of 1 costs 2 * 3 * OVERHEAD per micro-batch
    assert priced.time_per_sample(l0, 4, 1) - plain.time_per_sample(l0, 4, 1) == pytest.approx(2 * 3 * OVERHEAD / 4)


def test_a_plans_exact_bottleneck_is_the_simulators_and_the_dp_estimate_understates_candle_unos_by_its_resharding():
    # CANDLE-Uno on 16 V100s: five single-rank branch stages feed an 8-rank stage, so each sends 8
    # messages where the DP, pricing a stage before its neighbours are placed, counted 1.
    db = analytic_costs(candle_uno(), V100_SUMMIT)
    plan = search.graphpipe_search(db, num_devices=16, mini_batch=256).plan
    cm = StageCostModel(db, plan.mini_batch, p2p_devices=16)
    stages = [(cm.mask_of(s.layers), s.devices) for s in plan.stages]
    exact = cm.plan_bottleneck(stages, plan.micro_batch)
    assert exact == pytest.approx(simulate_plan(plan, db).prediction.bottleneck_tps_s, rel=1e-12)
    assert [s.devices for s in plan.stages] == [1, 1, 1, 1, 1, 8, 1, 2]
    assert exact > plan.notes["bottleneck_tps_s"] * 1.05


def _exact_brute_force(db, *, num_devices: int, b: int, stage_devices, allowed, mini_batch: int) -> float:
    """Least exact bottleneck over the partitions the DP may form and every degree per stage."""
    cm = StageCostModel(db, mini_batch, p2p_devices=num_devices)
    dag = nx.DiGraph()
    dag.add_nodes_from(c.name for c in db.layers)
    dag.add_edges_from((r, c.name) for c in db.layers for r in c.inputs if r in cm.index)
    best = float("inf")
    for blocks, _ in _convex_partitions([c.name for c in db.layers], dag):
        if any(frozenset(block) not in allowed for block in blocks):
            continue
        masks = [cm.mask_of(block) for block in blocks]
        for degrees in itertools.product(stage_devices, repeat=len(blocks)):
            if sum(degrees) == num_devices:
                best = min(best, cm.plan_bottleneck(list(zip(masks, degrees)), b))
    return best


def _case(seed: int):
    rng = random.Random(seed)
    layers = _random_dag(rng, rng.randint(3, 6))
    names = [n for n, _ in layers]
    db = synthetic_db(layers, fwd={n: rng.uniform(0.5, 3) for n in names}, bwd={n: rng.uniform(1, 5) for n in names},
                      out_bytes={n: rng.randint(1, 8) for n in names},
                      hw=hardware(link=CommFit(alpha_s=rng.choice([0.3, 1.0]), beta_s_per_byte=0.0)))
    return db, rng.randint(3, 6)


def _searched_bottleneck(db, num_devices: int, b: int, mini_batch: int) -> float:
    plan = search.graphpipe_search(db, num_devices=num_devices, mini_batch=mini_batch, micro_batches=[b]).plan
    cm = StageCostModel(db, mini_batch, p2p_devices=num_devices)
    return cm.plan_bottleneck([(cm.mask_of(s.layers), s.devices) for s in plan.stages], b)


# Random DAGs (series-parallel, stage degrees 1, 2, 4, messages as dear as a layer) on which the DP
# alone misses the exact optimum by its under-priced resharding. On 300 such seeds it missed on 38;
# searching again against the found plan's degrees and polishing the result reached the optimum on
# 33 of them (the polish alone finds the split of a wide stage feeding a narrow one, as in 55-113).
@pytest.mark.parametrize("seed", [55, 70, 86, 113, 121, 128, 150, 197, 256])
def test_searching_again_against_the_found_plans_degrees_reaches_the_brute_force_optimum(seed, monkeypatch):
    db, num_devices = _case(seed)
    tree, added = sp_tree(db.graph)
    assert not added
    b, mini_batch = 4, 4 * 64   # many micro-batches: the fastest plan is the least bottleneck
    truth = _exact_brute_force(db, num_devices=num_devices, b=b, stage_devices=(1, 2, 4),
                               allowed=_sp_candidates(tree), mini_batch=mini_batch)
    assert _searched_bottleneck(db, num_devices, b, mini_batch) == pytest.approx(truth, rel=2e-3)
    monkeypatch.setattr(search._Sweep, "_repriced", lambda *args, **kwargs: [])
    assert _searched_bottleneck(db, num_devices, b, mini_batch) > truth * 1.01


def test_the_messages_of_an_edge_between_two_degrees_are_those_the_engines_row_exchange_sends():
    # reshard_messages counts overlapping row blocks; the engine's exchange is graph.placement.reshard
    for num_src, num_dst in itertools.product(range(1, 13), repeat=2):
        transfers = reshard(math.lcm(num_src, num_dst), num_src=num_src, num_dst=num_dst)
        sends = max(sum(1 for t in transfers if t.src_idx == i) for i in range(num_src))
        receives = max(sum(1 for t in transfers if t.dst_idx == j) for j in range(num_dst))
        assert reshard_messages(num_src, num_dst) == (sends, receives), (num_src, num_dst)
