"""Topology-aware mapping: placements against brute force and a worked asymmetric example."""

from __future__ import annotations

import itertools
import random

import pytest

from costdbs import branches, chain, hardware
from gpp_deepspeed.planner import CommFit
from gpp_deepspeed.planner.plan import Plan, PlanStage
from gpp_deepspeed.planner.simulate import simulate_plan
from gpp_deepspeed.planner.topology import (Topology, contiguous, mpiexec_segments, place, placement_time,
                                            rank_order)

FAST = CommFit(alpha_s=0.0, beta_s_per_byte=0.001)
SLOW = CommFit(alpha_s=0.0, beta_s_per_byte=0.1)


def _topo(n, fast_pairs):
    links = [[SLOW] * n for _ in range(n)]
    for i, j in fast_pairs:
        links[i][j] = links[j][i] = FAST
    return Topology(tuple(map(tuple, links)))


def test_on_uniform_links_the_placement_time_is_the_simulators():
    db = chain(3, param_bytes={"l0": 40, "l1": 40, "l2": 40}, out_bytes={"l0": 6, "l1": 6}, hw=hardware(link=FAST))
    plan = Plan(model="c", method="m", source="", micro_batch=2, mini_batch=8,
                stages=(PlanStage(layers=("l0",), devices=2), PlanStage(layers=("l1", "l2"), devices=2)))
    topo = Topology(tuple(tuple(FAST for _ in range(4)) for _ in range(4)))
    assert placement_time(plan, db, topo, contiguous(plan)) == pytest.approx(
        simulate_plan(plan, db).prediction.iteration_time_s)


def test_on_uniform_links_placement_and_simulator_price_resharded_messages_alike():
    # Stage degrees 1 -> 2 -> 4: each narrower rank sends one message per wider peer that holds
    # its rows, a latency each, as the engine does; both models count the same messages.
    link = CommFit(alpha_s=0.25, beta_s_per_byte=0.01)
    db = chain(3, param_bytes={"l0": 40, "l1": 40, "l2": 40}, out_bytes={"l0": 6, "l1": 6}, hw=hardware(link=link))
    plan = Plan(model="c", method="m", source="", micro_batch=4, mini_batch=8,
                stages=(PlanStage(layers=("l0",)), PlanStage(layers=("l1",), devices=2),
                        PlanStage(layers=("l2",), devices=4)))
    topo = Topology(tuple(tuple(link for _ in range(7)) for _ in range(7)))
    assert placement_time(plan, db, topo, contiguous(plan)) == pytest.approx(
        simulate_plan(plan, db).prediction.iteration_time_s)


def test_placement_and_simulator_send_a_tensor_once_per_reading_stage_or_relay_it_in_a_chain():
    from costdbs import synthetic_db
    link = CommFit(alpha_s=0.0, beta_s_per_byte=0.01)
    db = synthetic_db([("l1", ["x"]), ("l2", ["l1"]), ("l3", ["l2"]), ("res", ["l3", "l1"])],
                      out_bytes={"l1": 100, "l2": 10, "l3": 20, "res": 1}, hw=hardware(link=link))
    stages = tuple(PlanStage(layers=(n,)) for n in ("l1", "l2", "l3", "res"))
    topo = Topology(tuple(tuple(link for _ in range(4)) for _ in range(4)))
    for pipeline in ("chain", "graph"):
        plan = Plan(model="s", method="m", source="", micro_batch=1, mini_batch=4, stages=stages, pipeline=pipeline)
        assert placement_time(plan, db, topo, contiguous(plan)) == pytest.approx(
            simulate_plan(plan, db).prediction.iteration_time_s)


def test_replicas_of_a_stage_go_where_their_all_reduce_is_fast():
    # NVLink pairs {0, 2} and {1, 3}; everything else slow. Contiguous puts stage 0 on {0, 1}: its
    # all-reduce of 100 bytes crosses a slow link. Placed on {0, 2} and {1, 3}, both all-reduces are
    # fast; the activations between the stages (0 bytes here) cost nothing either way.
    db = chain(2, param_bytes={"l0": 100, "l1": 100}, hw=hardware(link=SLOW))
    plan = Plan(model="c", method="m", source="", micro_batch=2, mini_batch=4,
                stages=(PlanStage(layers=("l0",), devices=2), PlanStage(layers=("l1",), devices=2)))
    topo = _topo(4, [(0, 2), (1, 3)])
    best, t = place(plan, db, topo)
    assert sorted(best) == [(0, 2), (1, 3)]
    slow = placement_time(plan, db, topo, contiguous(plan))
    # each all-reduce: 2 (n-1) steps of 50 bytes; 0.1 s/byte contiguous, 0.001 s/byte placed
    assert slow - t == pytest.approx(2 * 50 * (0.1 - 0.001))


def _brute(plan, db, topo):
    """Every ordered choice of devices per stage, replica order included."""
    n = topo.num_devices
    best = float("inf")
    counts = [s.devices for s in plan.stages]
    for perm in itertools.permutations(range(n), sum(counts)):
        it, p = iter(perm), []
        for c in counts:
            p.append(tuple(next(it) for _ in range(c)))
        best = min(best, placement_time(plan, db, topo, p))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_placement_matches_brute_force_on_small_random_topologies(seed):
    rng = random.Random(seed)
    db = branches(2, 1, out_bytes={"b0_0": rng.randint(1, 9), "b1_0": rng.randint(1, 9)},
                  param_bytes={"b0_0": rng.randint(0, 50), "b1_0": rng.randint(0, 50), "cat": rng.randint(0, 50)})
    stages = (PlanStage(layers=("b0_0",), devices=rng.choice([1, 2])), PlanStage(layers=("b1_0",), devices=1),
              PlanStage(layers=("cat",), devices=rng.choice([1, 2])))
    plan = Plan(model="b", method="m", source="", micro_batch=2, mini_batch=8, stages=stages)
    n = sum(s.devices for s in stages) + rng.randint(0, 1)
    links = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(i, n):
            links[i][j] = links[j][i] = CommFit(alpha_s=rng.choice([0.0, 0.01]), beta_s_per_byte=rng.uniform(0.001, 0.2))
    topo = Topology(tuple(map(tuple, links)))
    best, t = place(plan, db, topo)
    assert t == pytest.approx(_brute(plan, db, topo), rel=1e-12)
    assert t <= placement_time(plan, db, topo, contiguous(plan)) * (1 + 1e-12)


def test_the_local_search_beats_contiguous_on_a_two_level_cluster():
    # 2 hosts x 4 GPUs, NVLink inside, a slow network across; four 2-way stages where stage 0's
    # and stage 1's replicas hold many parameters: descent from contiguous must not end worse.
    intra, inter = CommFit(alpha_s=1e-6, beta_s_per_byte=1e-4), CommFit(alpha_s=1e-5, beta_s_per_byte=1e-2)
    topo = Topology.two_level(["a", "b"], 4, intra=intra, inter=inter)
    db = chain(4, param_bytes={f"l{i}": 400 for i in range(4)}, out_bytes={f"l{i}": 50 for i in range(4)},
               hw=hardware(link=inter))
    plan = Plan(model="c", method="m", source="", micro_batch=2, mini_batch=8,
                stages=tuple(PlanStage(layers=(f"l{i}",), devices=2) for i in range(4)))
    import gpp_deepspeed.planner.topology as T
    old, T._EXHAUSTIVE = T._EXHAUSTIVE, 0     # force the local search
    try:
        best, t = place(plan, db, topo)
    finally:
        T._EXHAUSTIVE = old
    assert t <= placement_time(plan, db, topo, contiguous(plan))


def test_the_placement_travels_in_the_plan_and_becomes_a_rank_order_and_an_mpiexec_line(tmp_path):
    plan = Plan(model="c", method="m", source="", micro_batch=2, mini_batch=4,
                stages=(PlanStage(layers=("l0",), devices=2), PlanStage(layers=("l1",), devices=2)),
                placement=((0, 2), (1, 3)))
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan
    assert rank_order(plan) == (0, 2, 1, 3)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("nodeA slots=2\nnodeB slots=2\n")
    topo = Topology.from_hostfile(hostfile, intra=FAST, inter=SLOW)
    argv = mpiexec_segments(plan, topo, ["python", "train.py"])
    # MPICH numbers ranks in segment order: rank 0 on nodeA, 1 on nodeB, 2 on nodeA, 3 on nodeB;
    # device 2 is nodeB's GPU 0, device 1 nodeA's GPU 1
    segments = " ".join(argv[1:]).split(" : ")
    assert [s.split()[3] for s in segments] == ["nodeA", "nodeB", "nodeA", "nodeB"]
    assert "CUDA_VISIBLE_DEVICES 0,1" in segments[0] and "CUDA_VISIBLE_DEVICES 0,1" in segments[1]
    assert [topo.hosts[d] for d in rank_order(plan)] == ["nodeA", "nodeB", "nodeA", "nodeB"]


def test_gpp_plan_places_a_plan_on_a_hostfile(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path
    gpp = str(Path(sys.executable).parent / "gpp")
    db = tmp_path / "candle.json"
    subprocess.run([gpp, "profile", "candle_uno", "--analytic", "v100", "--size", "branches=2", "-o", str(db)],
                   check=True, capture_output=True)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=4\nb slots=4\n")
    out = subprocess.run([gpp, "plan", str(db), "--devices", "8", "--mini-batch", "128", "--space", "runtime",
                          "--micro-batches", "32", "--json", "--quiet", "--topology", str(hostfile)],
                         check=True, capture_output=True, text=True).stdout
    plan = json.loads(out)["plan"]
    assert sorted(d for p in plan["placement"] for d in p) == list(range(8))
    assert plan["notes"]["placement_iteration_s"] <= plan["notes"]["contiguous_iteration_s"] * (1 + 1e-12)
