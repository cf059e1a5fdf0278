"""The schedule inside GraphPipe's search: each candidate stage graph priced with the memory of
the schedule it will run, against the schedule generators themselves and a brute force (pure)."""

from __future__ import annotations

import itertools
import random

import networkx as nx
import pytest

from costdbs import chain, hardware
from gpp_deepspeed.errors import GPPConfigError
from gpp_deepspeed.graph.stages import StageEdge, StageGraph
from gpp_deepspeed.planner import StageCostModel
from gpp_deepspeed.planner.inflight import schedule_memory
from gpp_deepspeed.planner.search import graphpipe_search, schedule_bottleneck_search
from gpp_deepspeed.planner.sp import sp_tree
from gpp_deepspeed.schedule import SCHEDULES, AsyncProgram
from gpp_deepspeed.schedule.zero_bubble import peak_in_flight
from test_search import _convex_partitions, _random_dag, _random_db, _sp_candidates

# One stage per rank: a folded schedule's memory is a rank's, priced by the fold search
# (planner/fold.py, tests/test_fold_planning.py), not the per-stage stash this file checks.
SYNC = tuple(name for name, spec in SCHEDULES.items() if not spec.asynchronous and spec.folded is None)
ASYNC = tuple(name for name, spec in SCHEDULES.items() if spec.asynchronous)
TOL = 1e-3


def _random_stage_graph(rng: random.Random, num_stages: int) -> StageGraph:
    edges = set()
    for s in range(num_stages - 1):
        edges.add((s, rng.randrange(s + 1, num_stages)))
        edges |= {(s, t) for t in range(s + 1, num_stages) if rng.random() < 0.2}
    return StageGraph(num_stages=num_stages, edges=tuple(StageEdge(a, b, ()) for a, b in sorted(edges)),
                      output_stage=num_stages - 1)


def generated_stash(stage_graph: StageGraph, num_microbatches: int, schedule: str) -> list[tuple[int, int]] | None:
    """Per stage, the micro-batches and weight versions the schedule's own program stashes at its
    peak (None where the engine refuses the schedule on this stage graph)."""
    n = stage_graph.num_stages
    if schedule in ASYNC:
        try:
            report = AsyncProgram(stage_graph, num_microbatches, schedule=schedule).validate()
        except GPPConfigError:
            return None
        return [(report.peak_in_flight[s], report.peak_versions[s]) for s in range(n)]
    program = SCHEDULES[schedule].generator(stage_graph, num_microbatches)
    return [(peak_in_flight(program[s]), 0) for s in range(n)]


@pytest.mark.parametrize("seed", range(30))
def test_the_search_stashes_what_each_schedules_program_stashes(seed):
    rng = random.Random(seed)
    sg = _random_stage_graph(rng, rng.randint(1, 7))
    num_mb = rng.randint(1, 10)
    for name in SYNC + ASYNC:
        stash = generated_stash(sg, num_mb, name)
        if stash is None:
            continue
        assert stash == [schedule_memory(name, depth=sg.depth(s), pipeline_depth=sg.pipeline_depth,
                                         num_microbatches=num_mb) for s in range(sg.num_stages)], name


# -- against a brute force over partitions x schedules --------------------------------------------

def _brute_force(db, *, num_devices: int, b: int, stage_devices, allowed, schedule: str, mini_batch: int) -> float:
    """Least bottleneck over the partitions whose stages the DP may form and every degree per
    stage, each stage fitting with what the schedule's generated program stashes on it."""
    cm = StageCostModel(db, mini_batch, p2p_devices=num_devices)
    dag = nx.DiGraph()
    dag.add_nodes_from(c.name for c in db.layers)
    dag.add_edges_from((r, c.name) for c in db.layers for r in c.inputs if r in cm.index)
    best = float("inf")
    stashes: dict = {}
    for blocks, q in _convex_partitions([c.name for c in db.layers], dag):
        if any(frozenset(bl) not in allowed for bl in blocks):
            continue
        # stages numbered in a topological order, the output's stage last
        order = list(nx.topological_sort(q))
        renumber = {s: i for i, s in enumerate(order)}
        key = tuple(sorted((renumber[u], renumber[v]) for u, v in q.edges))
        if key not in stashes:
            sg = StageGraph(num_stages=len(blocks), edges=tuple(StageEdge(u, v, ()) for u, v in key),
                            output_stage=len(blocks) - 1)
            stashes[key] = generated_stash(sg, mini_batch // b, schedule)
        stash = stashes[key]
        if stash is None:
            continue
        masks = [cm.mask_of(blocks[s]) for s in order]
        for devices in itertools.product(stage_devices, repeat=len(blocks)):
            if sum(devices) != num_devices:
                continue
            costs = [cm.stage(m, b, n) for m, n in zip(masks, devices)]
            if all(c.memory(*k) <= db.hardware.memory_bytes for c, k in zip(costs, stash)):
                best = min(best, max(cm.time_per_sample(m, b, n) for m, n in zip(masks, devices)))
    return best


@pytest.mark.parametrize("seed", range(24))
def test_the_least_bottleneck_under_each_schedule_matches_a_brute_force_over_partitions_and_schedules(seed):
    rng = random.Random(1000 + seed)
    layers = _random_dag(rng, rng.randint(3, 6))
    db = _random_db(rng, layers, memory=True)
    num_devices, b, mini_batch = rng.randint(2, 4), rng.choice([1, 2]), rng.choice([4, 8])
    stage_devices = [n for n in (1, 2) if b % n == 0]
    tree, added = sp_tree(db.graph)
    if added:
        pytest.skip("not series-parallel: the DP's space is then smaller than the brute force's")
    cm = StageCostModel(db, mini_batch, p2p_devices=num_devices)
    for name in ("1f1b", "zb1", "zb2", "pipedream", "2bw"):
        found, _ = schedule_bottleneck_search(cm, tree, schedule=name, num_devices=num_devices, micro_batch=b,
                                              stage_devices=stage_devices, rel_tol=TOL)
        truth = _brute_force(db, num_devices=num_devices, b=b, stage_devices=stage_devices,
                             allowed=_sp_candidates(tree), schedule=name, mini_batch=mini_batch)
        tps = min((t for t, _ in found), default=float("inf"))
        if truth == float("inf"):
            assert tps == float("inf"), name
        else:
            assert truth * (1 - 1e-9) <= tps <= truth / (1 - TOL), name


# -- the schedule changes the plan ----------------------------------------------------------------

def test_under_zb1_the_search_moves_a_heavy_stash_off_the_last_stage_that_1f1b_keeps_there():
    # Four equal layers on two devices; the last two stash 10 bytes per sample, the first two 1.
    # Under 1F1B the last stage holds one micro-batch, so the balanced cut [l0 l1 | l2 l3] fits in
    # 24 bytes (2 x 10 + ...). Under ZB-H1 every stage holds D = 2 micro-batches: l2 and l3 together
    # would stash 40 bytes, so the search must cut elsewhere.
    stash = {"l0": 1, "l1": 1, "l2": 10, "l3": 10}
    db = chain(4, stash_bytes=stash, hw=hardware(memory_bytes=24))
    one_f, zb = (graphpipe_search(db, num_devices=2, mini_batch=4, micro_batches=[1], schedules=(s,)).plan
                 for s in ("1f1b", "zb1"))
    assert [s.layers for s in one_f.stages] == [("l0", "l1"), ("l2", "l3")]
    assert one_f.schedule == "1f1b" and zb.schedule == "zb1"
    assert [s.layers for s in zb.stages] != [("l0", "l1"), ("l2", "l3")]
    assert zb.predicted.fits_memory and max(zb.predicted.stage_mem_bytes) <= 24
    # the 1F1B plan indeed does not fit under zb1: the search did not move it for nothing
    from gpp_deepspeed.planner.simulate import predict
    assert not predict(one_f, db, schedule="zb1").predicted.fits_memory


def test_with_few_micro_batches_1f1b_takes_a_shallow_data_parallel_plan_and_zb1_the_deeper_pipeline():
    # Six equal layers, four devices, four samples per batch; replicas pay a slow all-reduce. 1F1B's
    # fill and drain cost (D - 1)(F + B): it prefers two stages of two replicas. ZB-H1's cost a third
    # of that: the four-stage pipeline without replicas wins there.
    from gpp_deepspeed.planner import CommFit
    from gpp_deepspeed.planner.simulate import predict
    db = chain(6, param_bytes={f"l{i}": 50 for i in range(6)},
               hw=hardware(link=CommFit(alpha_s=0.0, beta_s_per_byte=0.05)))
    result = graphpipe_search(db, num_devices=4, mini_batch=4, schedules=("1f1b", "zb1"))
    one_f, zb = result.alternatives
    assert [s.devices for s in one_f.stages] == [2, 2] and [s.devices for s in zb.stages] == [1, 1, 1, 1]
    # each is the better of the two under its own schedule
    assert predict(zb, db, schedule="1f1b").predicted.iteration_time_s > one_f.predicted.iteration_time_s
    assert predict(one_f, db, schedule="zb1").predicted.iteration_time_s > zb.predicted.iteration_time_s
    # the search returns the fastest over its schedules, each schedule's best kept in order
    assert result.plan == zb and [p.schedule for p in result.alternatives] == ["1f1b", "zb1"]


def test_an_unknown_schedule_is_refused_by_name_before_any_search():
    with pytest.raises(GPPConfigError, match="zb3"):
        graphpipe_search(chain(2), num_devices=2, mini_batch=2, schedules=("zb3",))
