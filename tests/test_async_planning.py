"""The planners price what the asynchronous schedules run: PipeDream's partitioner counts its weight
stashing, PipeDream-2BW's planner its two versions and recomputation, and the plans they write are
the plans the engine runs (``tests/golden/plan_skip_*.json``, trained in ``test_async_training``)."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest

from costdbs import chain, hardware, synthetic_db
from gpp_deepspeed.cli import main
from gpp_deepspeed.planner import CommFit, StageCostModel
from gpp_deepspeed.planner.baselines import pipedream_search
from gpp_deepspeed.planner.pipedream import ChainCosts, pipedream_bottleneck
from gpp_deepspeed.planner.pipedream2bw import pipedream_2bw_search
from gpp_deepspeed.planner.plan import Plan
from gpp_deepspeed.schedule import get_schedule
from test_baselines import random_chain_with_skips, random_db

GOLDEN = Path(__file__).resolve().parent / "golden"
REL = 1e-9


def brute_force_with_versions(cm: StageCostModel, *, b: int, num_devices: int, schedule: str) -> float:
    """Least bottleneck over every cut and replica count, a stage fitting with NOAM micro-batches in
    flight and the weight copies ``schedule`` stashes for them, priced by the one memory model
    (:meth:`~gpp_deepspeed.planner.costs.StageCost.memory`)."""
    rule = get_schedule(schedule).weights
    names = cm.db.graph.list_topological_order()
    n, best = len(names), math.inf
    limit = cm.db.hardware.memory_bytes
    for num_cuts in range(n):
        for cuts in itertools.combinations(range(1, n), num_cuts):
            bounds = [0, *cuts, n]
            masks = [cm.mask_of(names[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
            choices = [r for r in range(1, num_devices + 1) if b % r == 0]
            for reps in itertools.product(choices, repeat=len(masks)):
                if sum(reps) != num_devices:
                    continue
                worst = 0.0
                for k, (mask, r, bd) in enumerate(zip(masks, reps, cm.chain_boundaries(masks))):
                    in_flight = math.ceil(sum(reps[k:]) / r)
                    cost = cm.stage(mask, b, r, boundary=bd)
                    if cost.memory(in_flight, rule.stashed_versions(in_flight)) > limit:
                        worst = math.inf
                        break
                    worst = max(worst, cm.time_per_sample(mask, b, r, boundary=bd))
                best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("schedule", ["pipedream", "2bw", "pipeoptim-inplace"])
def test_pipedreams_dp_planning_for_an_asynchronous_schedule_equals_brute_force_with_its_weight_versions(seed, schedule):
    rng = random.Random(seed)
    n, num_devices, b = rng.randint(3, 5), rng.randint(1, 4), rng.choice([2, 4])
    db = random_db(random_chain_with_skips(n, rng), rng, memory=rng.choice([1e9, 1.2, 0.8]))
    cm = StageCostModel(db, 8, p2p_devices=num_devices)
    costs = ChainCosts.build(cm, db.graph.list_topological_order())
    expected = brute_force_with_versions(cm, b=b, num_devices=num_devices, schedule=schedule)
    tps, stages, _ = pipedream_bottleneck(costs, micro_batch=b, num_devices=num_devices,
                                          weights=get_schedule(schedule).weights)
    if expected == math.inf:
        assert tps is None
    else:
        assert tps == pytest.approx(expected, rel=REL)


def weighty(memory_bytes: float, n: int = 4):
    """``n`` layers of 100 parameter bytes and 1 stashed byte per sample each."""
    names = [f"l{i}" for i in range(n)]
    return chain(n, param_bytes={m: 100 for m in names}, stash_bytes={m: 1 for m in names},
                 hw=hardware(memory_bytes=memory_bytes))


def test_a_pipedream_plan_for_weight_stashing_fits_where_a_plan_for_1f1b_would_not():
    # One device per layer; the first stage keeps 4 micro-batches and, stashing, 4 weight copies.
    db = weighty(100 + 4 * 1 + 4 * 100)
    plain = pipedream_search(db, num_devices=4, mini_batch=4, micro_batches=[1])
    stashing = pipedream_search(db, num_devices=4, mini_batch=4, micro_batches=[1], schedules=("pipedream", ))
    assert stashing.plan.schedule == "pipedream" and stashing.plan.predicted.fits_memory
    assert stashing.plan.predicted.peak_mem_bytes <= db.hardware.memory_bytes
    # Priced by the program that runs: stage s holds depth(s) copies besides its live weights.
    assert stashing.plan.predicted.stage_mem_bytes[0] == pytest.approx(100 + 4 * 1 + 4 * 100)
    tighter = weighty(100 + 4 * 1 + 4 * 100 - 1)
    assert pipedream_search(tighter, num_devices=4, mini_batch=4, micro_batches=[1], replication=False,
                            schedules=("pipedream", )).plan is None
    assert pipedream_search(tighter, num_devices=4, mini_batch=4, micro_batches=[1], replication=False).plan \
        is not None, "1F1B holds no weight copies: it fits"
    assert plain.plan.schedule == "1f1b"


def test_pipedream_searches_each_schedule_and_keeps_the_fastest_that_fits():
    db = weighty(1e9)
    result = pipedream_search(db, num_devices=4, mini_batch=8, schedules=("1f1b", "pipedream", "2bw"))
    assert [p.schedule for p in result.alternatives] == ["1f1b", "pipedream", "2bw"]
    fastest = max(result.alternatives, key=lambda p: p.predicted.samples_per_s)
    assert result.plan.predicted.samples_per_s == fastest.predicted.samples_per_s


def test_2bw_planner_recomputes_only_when_two_versions_and_the_stashed_activations_do_not_fit():
    # 4 layers x 100 parameter bytes, 8 stashed bytes per sample per layer, no optimizer state.
    names = [f"l{i}" for i in range(4)]

    def db(memory):
        return chain(4, param_bytes={m: 100 for m in names}, stash_bytes={m: 8 for m in names},
                     out_bytes={m: 1 for m in names}, hw=hardware(memory_bytes=memory))

    loose = pipedream_2bw_search(db(1e9), num_devices=4, mini_batch=16, micro_batches=[4])
    assert loose.plan.schedule == "2bw" and not any(s.recompute for s in loose.plan.stages)
    # Every candidate keeps M >= depth - 1 micro-batches per batch (2BW's m >= d).
    assert all(16 // b >= depth - 1 for b, depth, _, _ in loose.trace)
    depth = loose.plan.num_stages
    stage = loose.plan.predicted.stage_mem_bytes[0]
    # Memory just below what the loose plan needs on its first stage: only recomputation fits
    # that depth, at the price of recomputing (slower).
    tight = pipedream_2bw_search(db(stage - 1), num_devices=4, mini_batch=16, micro_batches=[4])
    fitting = [(d, again) for _, d, again, sps in tight.trace if sps is not None]
    assert (depth, False) not in fitting
    if tight.plan is not None and tight.plan.num_stages == depth:
        assert all(s.recompute for s in tight.plan.stages)
        assert tight.plan.predicted.samples_per_s < loose.plan.predicted.samples_per_s


def test_2bw_planner_prices_two_weight_versions_per_stage():
    names = [f"l{i}" for i in range(4)]
    db = chain(4, param_bytes={m: 100 for m in names}, hw=hardware(memory_bytes=1e9))
    plan = pipedream_2bw_search(db, num_devices=4, mini_batch=8, micro_batches=[2], recompute=False).plan
    for s, mem in zip(plan.stages, plan.predicted.stage_mem_bytes):
        params = 100 * len(s.layers)
        assert mem == pytest.approx(params + 2 * params)   # live weights and two stashed versions


# -- plans that run -----------------------------------------------------------------------------------

SKIP_LAYERS = [("l1", ["x"]), ("l2", ["l1"]), ("l3", ["l2"]), ("l4", ["l3"]), ("res", ["l4", "l1"]),
               ("head", ["res"])]


def skip_costs(memory_bytes: float):
    """Costs of ``tests/models.py``'s ``skip`` model (names and edges), heavy in the middle, on a
    link that makes an all-reduce cost something."""
    return synthetic_db(SKIP_LAYERS, model="skip", fwd={"l2": 2.0, "l3": 2.0, "l4": 2.0, "res": 0.1},
                        bwd={"l2": 4.0, "l3": 4.0, "l4": 4.0, "res": 0.2},
                        param_bytes={"l1": 100, "l2": 400, "l3": 400, "l4": 400, "head": 100},
                        stash_bytes={n: 8 for n, _ in SKIP_LAYERS}, out_bytes={n: 4 for n, _ in SKIP_LAYERS},
                        micro_batches=(1, 2, 4, 8, 16),
                        hw=hardware(memory_bytes=memory_bytes, link=CommFit(alpha_s=0.0, beta_s_per_byte=0.001)))


GOLDEN_PLANS = {
    # PipeDream's partitioner for its own schedule on 4 devices: the last stage replicated twice.
    "plan_skip_pipedream.json": lambda: pipedream_search(skip_costs(2500), num_devices=4, mini_batch=16,
                                                         micro_batches=[4], schedules=("pipedream", )).plan,
    # 2BW's planner where two versions and the stashed activations only fit recomputed.
    "plan_skip_2bw.json": lambda: pipedream_2bw_search(skip_costs(1700), num_devices=4, mini_batch=16,
                                                       micro_batches=[4]).plan,
}


@pytest.mark.parametrize("name", sorted(GOLDEN_PLANS))
def test_the_golden_async_plans_are_what_the_planners_write(name):
    """Regenerate with ``.venv/bin/python tests/test_async_planning.py``."""
    plan = GOLDEN_PLANS[name]()
    saved = Plan.from_json((GOLDEN / name).read_text())
    assert [(s.layers, s.devices, s.recompute) for s in plan.stages] == \
        [(s.layers, s.devices, s.recompute) for s in saved.stages]
    assert (plan.schedule, plan.micro_batch, plan.mini_batch, plan.pipeline) == \
        (saved.schedule, saved.micro_batch, saved.mini_batch, saved.pipeline)


def test_the_golden_plans_replicate_a_stage_and_recompute():
    pipedream = Plan.from_json((GOLDEN / "plan_skip_pipedream.json").read_text())
    assert pipedream.schedule == "pipedream" and max(s.devices for s in pipedream.stages) > 1
    twobw = Plan.from_json((GOLDEN / "plan_skip_2bw.json").read_text())
    assert twobw.schedule == "2bw" and any(s.recompute for s in twobw.stages)


def test_gpp_plan_with_an_asynchronous_schedule_writes_a_plan_for_it(tmp_path):
    costs = tmp_path / "skip.json"
    costs.write_text(skip_costs(1e9).to_json())
    out = tmp_path / "plan.json"
    assert main(["plan", str(costs), "--devices", "4", "--mini-batch", "16", "--micro-batches", "4", "--method",
                 "pipedream", "--schedules", "pipedream", "-o", str(out), "--quiet"]) == 0
    assert Plan.from_json(out.read_text()).schedule == "pipedream"
    assert main(["plan", str(costs), "--devices", "4", "--mini-batch", "16", "--micro-batches", "4", "--method",
                 "pipedream-2bw", "-o", str(out), "--quiet", "--json"]) == 0
    assert Plan.from_json(out.read_text()).schedule == "2bw"


if __name__ == "__main__":
    for name, make in GOLDEN_PLANS.items():
        plan = make()
        (GOLDEN / name).write_text(plan.to_json())
        print(f"wrote {GOLDEN / name}: {plan.describe()}")
