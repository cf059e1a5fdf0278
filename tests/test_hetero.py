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
