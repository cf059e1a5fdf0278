"""Heterogeneous devices (EdgePipe): the chain DP against brute force and worked examples."""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from costdbs import chain, hardware, synthetic_db
from gpp_deepspeed.errors import GPPConfigError
from gpp_deepspeed.planner import CommFit
from gpp_deepspeed.planner.hetero import Cluster, DeviceClass, hetero_search
from gpp_deepspeed.planner.plan import Plan, PlanStage
from gpp_deepspeed.planner.simulate import simulate_plan

ROOT = Path(__file__).resolve().parents[1]


def _brute_force(db, cluster, b, train) -> float:  # mini-batch 8, as the searches below
    """Every cut of the layer order into contiguous stages, every class and replica count per stage."""
    n = cluster.num_devices
    models = {c.name: cluster.stage_model(db, c.name, 8, n) for c in cluster.classes}
    L = len(db.layers)
    replicas = [r for r in (1, 2, 4) if b % r == 0]
    best = math.inf
    for cuts in itertools.chain.from_iterable(itertools.combinations(range(1, L), k) for k in range(L)):
        bounds = (0, *cuts, L)
        ranges = list(zip(bounds, bounds[1:]))
        for pick in itertools.product([(c.name, r) for c in cluster.classes for r in replicas], repeat=len(ranges)):
            used = {c.name: 0 for c in cluster.classes}
            for name, r in pick:
                used[name] += r
            if any(used[c.name] > c.count for c in cluster.classes):
                continue
            worst = 0.0
            for s, ((i, j), (name, r)) in enumerate(zip(ranges, pick)):
                cm = models[name]
                mask = sum(1 << x for x in range(i, j))
                if train:
                    ok, t = cm.fits(mask, b, r, len(ranges) - s), cm.time_per_sample(mask, b, r)
                else:
                    ok = cm.inference_memory(mask, b, r) <= cm.db.hardware.memory_bytes
                    t = cm.time_per_sample_inference(mask, b, r)
                worst = max(worst, t if ok else math.inf)
            best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(10))
def test_hetero_bottleneck_matches_brute_force_for_training_and_inference(seed):
    rng = random.Random(seed)
    L = rng.randint(2, 4)
    names = [f"l{i}" for i in range(L)]
    link = CommFit(alpha_s=rng.choice([0.0, 0.05]), beta_s_per_byte=rng.choice([0.0, 0.01]))
    db = chain(L, fwd={n: rng.uniform(0.5, 3) for n in names}, bwd={n: rng.uniform(1, 5) for n in names},
               stash_bytes={n: rng.randint(1, 5) for n in names}, param_bytes={n: rng.randint(0, 20) for n in names},
               out_bytes={n: rng.randint(0, 8) for n in names}, hw=hardware(memory_bytes=rng.uniform(30, 90), link=link))
    cluster = Cluster(classes=(DeviceClass(name="fast", count=rng.randint(1, 2), speed=rng.uniform(1.5, 3),
                                           memory_bytes=int(rng.uniform(20, 60))),
                               DeviceClass(name="slow", count=rng.randint(1, 3), speed=1.0)))
    b = rng.choice([1, 2])
    for objective in ("train", "inference"):
        result = hetero_search(db, cluster, mini_batch=8, objective=objective, micro_batches=[b])
        truth = _brute_force(db, cluster, b, objective == "train")
        if result.plan is None:
            assert truth == math.inf
            continue
        assert result.plan.notes["bottleneck_tps_s"] == pytest.approx(truth, rel=1e-9)
        used = {}
        for s in result.plan.stages:
            used[s.device_class] = used.get(s.device_class, 0) + s.devices
        assert all(used.get(c.name, 0) <= c.count for c in cluster.classes)


def test_a_twice_as_fast_device_takes_twice_the_layers_for_inference():
    # Three equal layers (1 s forward each), one device 2x as fast and one as fast as profiled:
    # the fast one runs two layers in 1 s, the slow one the third in 1 s; 1 s per sample.
    db = chain(3, fwd={f"l{i}": 1.0 for i in range(3)})
    cluster = Cluster(classes=(DeviceClass(name="fast", count=1, speed=2.0), DeviceClass(name="slow", count=1)))
    plan = hetero_search(db, cluster, mini_batch=4, objective="inference", micro_batches=[1]).plan
    assert plan.notes["bottleneck_tps_s"] == pytest.approx(1.0)
    assert sorted((len(s.layers), s.device_class) for s in plan.stages) == [(1, "slow"), (2, "fast")]
    # forward-only chain of two 1 s stages, 4 micro-batches: (2 - 1 + 4) x 1 s
    assert plan.predicted.iteration_time_s == pytest.approx(5.0)


def test_the_simulator_prices_each_stage_for_its_device_class():
    db = chain(2, fwd={"l0": 1.0, "l1": 1.0}, bwd={"l0": 2.0, "l1": 2.0})
    cluster = Cluster(classes=(DeviceClass(name="fast", count=1, speed=3.0), DeviceClass(name="slow", count=1)))
    plan = Plan(model="c", method="manual", source="", micro_batch=1, mini_batch=2,
                stages=(PlanStage(layers=("l0",), device_class="fast"), PlanStage(layers=("l1",), device_class="slow")))
    busy = simulate_plan(plan, db, cluster=cluster).prediction.stage_busy_s
    assert busy == pytest.approx((2 * 3.0 / 3, 2 * 3.0))
    assert Plan.from_json(plan.to_json()) == plan


def test_a_cluster_file_names_what_is_wrong(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"classes": [{"name": "a100", "count": 2, "sped": 2.0}]}))
    with pytest.raises(GPPConfigError, match="sped"):
        Cluster.load(bad)
    bad.write_text(json.dumps({"classes": [{"name": "a100", "count": 0}]}))
    with pytest.raises(GPPConfigError, match="a100"):
        Cluster.load(bad)


def test_gpp_plan_with_the_mixed_generation_example_cluster(tmp_path):
    gpp = [str(Path(sys.executable).parent / "gpp")]
    db = tmp_path / "candle.json"
    subprocess.run(gpp + ["profile", "candle_uno", "--analytic", "v100", "--size", "branches=2", "-o", str(db)],
                   check=True, capture_output=True)
    out = subprocess.run(gpp + ["plan", str(db), "--devices", "8", "--mini-batch", "128", "--micro-batches", "32",
                                "--json", "--quiet", "--cluster",
                                str(ROOT / "examples" / "clusters" / "a100_v100.json")],
                         check=True, capture_output=True, text=True).stdout
    data = json.loads(out)
    classes = {s["device_class"] for s in data["plan"]["stages"]}
    assert classes <= {"a100", "v100"} and data["samples_per_s"] > 0


# -- stage DAGs over device classes ---------------------------------------------------------------

def _brute_force_graph(db, cluster, b, train, allowed) -> float:
    """Every partition into stages the DP may form, every class and replica count per stage (at
    most the class's devices in all), each stage fitting with its depth in flight (1F1B)."""
    import networkx as nx
    from test_search import _convex_partitions

    n = cluster.num_devices
    models = [cluster.stage_model(db, c.name, 8, n) for c in cluster.classes]
    dag = nx.DiGraph()
    dag.add_nodes_from(c.name for c in db.layers)
    dag.add_edges_from((r, c.name) for c in db.layers for r in c.inputs if r in models[0].index)
    replicas = [r for r in (1, 2, 4) if b % r == 0]
    best = math.inf
    for blocks, q in _convex_partitions([c.name for c in db.layers], dag):
        if any(frozenset(bl) not in allowed for bl in blocks):
            continue
        depth = {}
        for s in reversed(list(nx.topological_sort(q))):
            depth[s] = 1 + max((depth[t] for t in q.successors(s)), default=0)
        masks = [models[0].mask_of(bl) for bl in blocks]
        for pick in itertools.product(range(len(models)), replicas, repeat=len(blocks)):
            classes, degrees = pick[0::2], pick[1::2]
            if any(sum(r for k, r in zip(classes, degrees) if k == c) > cl.count
                   for c, cl in enumerate(cluster.classes)):
                continue
            worst = 0.0
            for s, (m, c, r) in enumerate(zip(masks, classes, degrees)):
                cm = models[c]
                if train:
                    ok, t = cm.fits(m, b, r, depth[s]), cm.time_per_sample(m, b, r)
                else:
                    ok = cm.inference_memory(m, b, r) <= cm.db.hardware.memory_bytes
                    t = cm.time_per_sample_inference(m, b, r)
                worst = max(worst, t if ok else math.inf)
            best = min(best, worst)
    return best


def _ranges_of_children(tree) -> set[frozenset]:
    """The stages the classes' DP may form: SP-tree nodes and ranges of a node's children."""
    from gpp_deepspeed.planner.sp import Leaf

    out: set[frozenset] = set()

    def visit(t):
        if isinstance(t, Leaf):
            out.add(frozenset([t.name]))
            return frozenset([t.name])
        kids = [visit(c) for c in t.children]
        out.update(frozenset().union(*kids[i:j]) for i in range(len(kids)) for j in range(i + 1, len(kids) + 1))
        return frozenset().union(*kids)

    visit(tree)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_the_stage_dag_search_over_device_classes_matches_brute_force(seed):
    from gpp_deepspeed.planner.hetero import _graph_search
    from gpp_deepspeed.planner.sp import sp_tree
    from test_search import _random_dag, _random_db

    rng = random.Random(500 + seed)
    db = _random_db(rng, _random_dag(rng, rng.randint(3, 5)), memory=seed % 2 == 0)
    tree, added = sp_tree(db.graph)
    if added:
        pytest.skip("not series-parallel")
    cluster = Cluster(classes=(DeviceClass(name="fast", count=rng.randint(1, 2), speed=rng.uniform(1.5, 3)),
                               DeviceClass(name="slow", count=rng.randint(1, 2))))
    b = rng.choice([1, 2])
    models = [cluster.stage_model(db, c.name, 8, cluster.num_devices) for c in cluster.classes]
    for train in (True, False):
        tps, stages, _ = _graph_search(db, cluster, models, b, train, None)
        truth = _brute_force_graph(db, cluster, b, train, _ranges_of_children(tree))
        if truth == math.inf:
            assert tps is None
            continue
        assert truth * (1 - 1e-9) <= tps <= truth / (1 - 1e-3)


def test_a_heterogeneous_plan_of_branches_is_a_stage_dag_with_the_fast_devices_on_the_slow_branch():
    # Two branches, one three times the work of the other, merged by a small head. One fast device
    # (3x) and two slow ones: the heavy branch goes to the fast device, the light branch and the
    # head to the slow ones, each branch its own stage feeding the head: a DAG, not a chain.
    db = synthetic_db([("a0", ["x"]), ("a1", ["a0"]), ("a2", ["a1"]), ("b0", ["y"]), ("head", ["a2", "b0"])],
                      inputs=("x", "y"), fwd={"head": 0.2})
    cluster = Cluster(classes=(DeviceClass(name="fast", count=1, speed=3.0), DeviceClass(name="slow", count=2)))
    plan = hetero_search(db, cluster, mini_batch=8, micro_batches=[1]).plan
    assert plan.notes["shape"] == "graph"
    edges = set(plan.stage_edges)
    assert any(sum(1 for _, dst in edges if dst == t) == 2 for t in range(plan.num_stages))   # a fan-in
    by_layers = {s.layers: s.device_class for s in plan.stages}
    assert by_layers[("a0", "a1", "a2")] == "fast" and by_layers[("b0",)] == "slow"


# -- the golden heterogeneous plan that tests/test_stage_degrees.py trains -------------------------

GOLDEN = ROOT / "tests" / "golden" / "plan_four_branch_hetero.json"


def four_branch_hetero_plan() -> Plan:
    """tests/models.py's four_branch (branches 0 and 1 three times the work of 2 and 3) on one
    device three times as fast and three slow ones, micro-batches of 4 (regenerate the golden
    file with ``python tests/test_hetero.py``)."""
    layers = [x for b in range(4) for x in ((f"proj{b}", ["x"]), (f"block{b}", [f"proj{b}"]))]
    layers += [("cat", [f"block{b}" for b in range(4)]), ("head", ["cat"])]
    fwd = {"block0": 3.0, "block1": 3.0, "cat": 0.1, "head": 0.5}
    db = synthetic_db(layers, fwd=fwd, bwd={k: 2 * v for k, v in fwd.items()}, out_bytes={n: 4 for n, _ in layers},
                      model="four_branch")
    cluster = Cluster(classes=(DeviceClass(name="fast", count=1, speed=3.0), DeviceClass(name="slow", count=3)))
    return hetero_search(db, cluster, mini_batch=16, micro_batches=[4]).plan


def test_the_golden_heterogeneous_plan_is_the_searchs_stage_dag_with_a_wide_stage():
    plan = four_branch_hetero_plan()
    assert Plan.load(GOLDEN) == plan, "regenerate: python tests/test_hetero.py"
    assert plan.notes["shape"] == "graph" and sorted(plan.stage_edges) == [(0, 2), (1, 2)]   # a fan-in
    assert [(s.devices, s.device_class) for s in plan.stages] == [(2, "slow"), (1, "fast"), (1, "slow")]


if __name__ == "__main__":
    four_branch_hetero_plan().save(GOLDEN)
    print(f"wrote {GOLDEN}")
