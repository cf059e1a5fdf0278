"""The planner prices what the engine sends: relayed tensors of a chain, edge by edge, and one
message per stage edge and peer rank (fan-in, fan-out, resharding) (pure, no torch).

The reference is the runtime's own stage graph (``derive_partition``, the edges the engine sends
along), the engine's resharding rule (``graph.placement.reshard``) and stage times written out by
hand from the affine link model.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costdbs import branches, hardware, synthetic_db
from gpp_deepspeed.planner import CommFit, StageCostModel
from gpp_deepspeed.planner.costs import edge_bytes, plan_boundaries
from gpp_deepspeed.planner.plan import Plan, PlanStage
from gpp_deepspeed.planner.simulate import simulate_plan

LINK = CommFit(alpha_s=1e-3, beta_s_per_byte=1e-6)
# l1 skips l2 and l3 to the residual add, as in tests/models.py's "skip"
SKIP = [("l1", ["x"]), ("l2", ["l1"]), ("l3", ["l2"]), ("res", ["l3", "l1"])]
OUT = {"l1": 100, "l2": 10, "l3": 20, "res": 1}


def skip_plan(pipeline: str) -> Plan:
    return Plan(model="skip", method="manual", source="test", micro_batch=1, mini_batch=4, pipeline=pipeline,
                stages=tuple(PlanStage(layers=(n,)) for n in ("l1", "l2", "l3", "res")))


def test_edge_bytes_of_a_chain_relay_the_skip_tensor_on_every_hop_it_crosses():
    db = synthetic_db(SKIP, out_bytes=OUT)
    stage_of = {"l1": 0, "l2": 1, "l3": 2, "res": 3}
    assert edge_bytes(db, stage_of, relay=False) == {(0, 1): 100.0, (0, 3): 100.0, (1, 2): 10.0, (2, 3): 20.0}
    assert edge_bytes(db, stage_of, relay=True) == {(0, 1): 100.0, (1, 2): 110.0, (2, 3): 120.0}


def test_a_chain_plans_predicted_stage_time_includes_the_bytes_it_relays():
    db = synthetic_db(SKIP, out_bytes=OUT, hw=hardware(link=LINK))
    chain = simulate_plan(skip_plan("chain"), db)
    graph = simulate_plan(skip_plan("graph"), db)
    # stage 2 receives l1 and l2's output (110 B) and sends l1 and l3's (120 B): forward compute 1 s
    assert chain.stage_costs[2].fwd_s == pytest.approx(1.0 + LINK.time(110) + LINK.time(120))
    # as a DAG stage 2 only receives l2's output and sends l3's
    assert graph.stage_costs[2].fwd_s == pytest.approx(1.0 + LINK.time(10) + LINK.time(20))
    # l1 is read on stages 1 and 3: the DAG sends it to each, the chain only to stage 1 (which relays it)
    assert graph.stage_costs[0].fwd_s == pytest.approx(1.0 + 2 * LINK.time(100))
    assert chain.stage_costs[0].fwd_s == pytest.approx(1.0 + LINK.time(100))


@st.composite
def cut_dbs(draw):
    """A random layer DAG in topological list order with random output bytes, cut into a chain."""
    n = draw(st.integers(2, 9))
    names = [f"l{i}" for i in range(n)]
    layers = []
    for i, name in enumerate(names):
        pool = ["x"] + names[:i]
        layers.append((name, draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))))
    for i in range(n - 1):  # every layer reaches the output
        if not any(names[i] in ins for _, ins in layers[i + 1:]):
            layers[-1][1].append(names[i])
    out = {name: draw(st.integers(1, 1000)) for name in names}
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=min(3, n - 1))))
    bounds = [0, *cuts, n]
    stage_of = {names[i]: k for k in range(len(bounds) - 1) for i in range(bounds[k], bounds[k + 1])}
    return synthetic_db(layers, out_bytes=out), stage_of


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cut_dbs())
def test_chain_boundaries_kernel_prices_the_relayed_edges_the_engine_sends(case):
    db, stage_of = case
    num_stages = max(stage_of.values()) + 1
    model = StageCostModel(db, 1)
    masks = [model.mask_of([n for n, s in stage_of.items() if s == k]) for k in range(num_stages)]
    edges = edge_bytes(db, stage_of, relay=True)
    expected = [(edges.get((k - 1, k), 0.0), edges.get((k, k + 1), 0.0)) for k in range(num_stages)]
    assert [(bd.in_bytes, bd.out_bytes) for bd in model.chain_boundaries(masks)] == expected


def test_viz_draws_the_bytes_a_chain_plan_relays_and_a_graph_plan_sends_once_per_reader():
    from gpp_deepspeed import viz
    from gpp_deepspeed.errors import PartitionError

    db = synthetic_db(SKIP, out_bytes=OUT)
    # written out by hand: the chain relays l1 (100 B) through stages 1 and 2 to the residual add
    assert viz.stage_edge_bytes(skip_plan("chain"), db) == {(0, 1): 100.0, (1, 2): 110.0, (2, 3): 120.0}
    assert viz.stage_edge_bytes(dataclasses.replace(skip_plan("chain"), pipeline="graph"), db) == \
        {(0, 1): 100.0, (0, 3): 100.0, (1, 2): 10.0, (2, 3): 20.0}
    partial = dataclasses.replace(skip_plan("chain"), stages=skip_plan("chain").stages[:3])
    with pytest.raises(PartitionError):
        viz.stage_edge_bytes(partial, db)   # a plan that leaves out "res" is not drawn


# -- messages as the engine sends them: fan-in, fan-out, resharding --------------------------------

def test_a_fan_in_stage_pays_one_message_per_edge_and_a_narrow_sender_one_per_wide_peer():
    # Three branches (one rank each) into a merge stage of two ranks. Each branch rank sends its
    # rows in two messages, one to each merge rank; each merge rank receives one message per branch.
    db = branches(3, 1, out_bytes={f"b{i}_0": 8 for i in range(3)}, hw=hardware(link=LINK))
    plan = Plan(model="b", method="manual", source="test", micro_batch=2, mini_batch=4,
                stages=(*(PlanStage(layers=(f"b{i}_0",)) for i in range(3)), PlanStage(layers=("cat",), devices=2)))
    sim = simulate_plan(plan, db)
    # a branch: 2 samples x 1 s forward, two messages of 8 bytes x 1 sample each
    assert sim.stage_costs[0].fwd_s == pytest.approx(2.0 + 2 * LINK.alpha_s + 2 * 8 * LINK.beta_s_per_byte)
    # a merge rank: 1 sample x 1 s forward, three messages of 8 bytes x 1 sample
    assert sim.stage_costs[3].fwd_s == pytest.approx(1.0 + 3 * LINK.alpha_s + 3 * 8 * LINK.beta_s_per_byte)


@st.composite
def partitioned_dbs(draw):
    """A random layer DAG cut into stages along a random topological order, with random degrees."""
    db, _ = draw(cut_dbs())
    names = [c.name for c in db.layers]
    readers = {n: [c.name for c in db.layers if n in c.inputs] for n in names}
    indegree = {c.name: sum(1 for r in c.inputs if r in readers) for c in db.layers}
    order, ready = [], [n for n in names if indegree[n] == 0]
    while ready:
        n = ready.pop(draw(st.integers(0, len(ready) - 1)))
        order.append(n)
        for r in readers[n]:
            indegree[r] -= 1
            if not indegree[r]:
                ready.append(r)
    cuts = sorted(draw(st.sets(st.integers(1, len(order) - 1), max_size=min(4, len(order) - 1))))
    bounds = [0, *cuts, len(order)]
    stage_of = {order[i]: k for k in range(len(bounds) - 1) for i in range(bounds[k], bounds[k + 1])}
    degrees = draw(st.lists(st.sampled_from([1, 2, 4]), min_size=len(bounds) - 1, max_size=len(bounds) - 1))
    return db, stage_of, degrees


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=partitioned_dbs())
def test_the_bitmask_boundaries_are_plan_boundaries_of_the_edge_bytes_the_engine_sends(case):
    db, stage_of, degrees = case
    model = StageCostModel(db, 1)
    masks = [model.mask_of([n for n, s in stage_of.items() if s == k]) for k in range(len(degrees))]
    assert model.stage_boundaries(masks, degrees) == plan_boundaries(edge_bytes(db, stage_of, relay=False), degrees)
    if stage_of[db.output] == len(degrees) - 1:   # a chain needs the output on its last stage
        assert model.stage_boundaries(masks, degrees, relay=True) == \
            plan_boundaries(edge_bytes(db, stage_of, relay=True), degrees)


def test_the_searchs_estimate_is_exact_for_branch_stages_and_their_merge():
    db = branches(4, 2, out_bytes={**{f"b{i}_1": 8 for i in range(4)}, **{f"b{i}_0": 3 for i in range(4)}})
    model = StageCostModel(db, 1)
    names = [[f"b{i}_0", f"b{i}_1"] for i in range(4)] + [["cat"]]
    masks = [model.mask_of(n) for n in names]
    assert [model.boundary(m) for m in masks] == model.stage_boundaries(masks, [1] * 5)
