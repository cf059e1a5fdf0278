"""The baselines (PipeDream, Piper, DeepSpeed's partitions) against brute force and by hand."""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest

from costdbs import branches, chain, hardware, synthetic_db
from gpp_deepspeed.planner import ZERO_STAGES, CommFit, Hardware, StageCostModel
from gpp_deepspeed.planner.baselines import (BASELINES, deepspeed_partition, deepspeed_search, partition_balanced,
                                             partition_uniform, pipedream_search, piper_search)
from gpp_deepspeed.planner.pipedream import ChainCosts, pipedream_bottleneck
from gpp_deepspeed.planner.piper import enumerate_upsets, piper_bottlenecks

REL = 1e-9


def priced_hardware(memory_bytes: float, *, split: bool = False) -> Hardware:
    """Two devices per node, a slower link between nodes, Adam-like optimizer state; ``split``:
    the links keep each end busy for part of a message only (the rest in flight)."""
    return Hardware(name="test", memory_bytes=int(memory_bytes), devices_per_node=2,
                    intra=CommFit(alpha_s=0.01, beta_s_per_byte=0.002, overhead_s=0.003 if split else None),
                    inter=CommFit(alpha_s=0.05, beta_s_per_byte=0.01, overhead_s=0.004 if split else None),
                    optimizer_factor=1.0)


def random_db(layers, rng: random.Random, *, memory: float, split: bool = False):
    """Random costs; ``memory`` is the device memory as a fraction of all weights and optimizer state;
    ``split``: :func:`priced_hardware`'s."""
    names = [name for name, _ in layers]
    params = {n: rng.choice([0, 50, 400, 2000]) for n in names}
    return synthetic_db(
        layers, fwd={n: rng.uniform(0.5, 2.0) for n in names}, bwd={n: rng.uniform(1.0, 4.0) for n in names},
        param_bytes=params, out_bytes={n: rng.randint(1, 30) for n in names},
        stash_bytes={n: rng.randint(1, 20) for n in names},
        hw=priced_hardware(memory * 2 * sum(params.values()) + 100, split=split))


def random_chain_with_skips(n: int, rng: random.Random):
    """A list of layers, each reading its predecessor and sometimes an earlier layer too."""
    layers = []
    for i in range(n):
        ins = ["x"] if i == 0 else [f"l{i - 1}"]
        if i >= 2 and rng.random() < 0.5:
            ins.append(f"l{rng.randrange(i - 1)}")
        layers.append((f"l{i}", ins))
    return layers


# -- PipeDream ------------------------------------------------------------------------------------

def brute_force_pipedream(cm: StageCostModel, *, b: int, num_devices: int, replication: bool) -> float:
    """Least bottleneck over every cut of the list order and every replica count per stage."""
    names = cm.db.graph.list_topological_order()
    n, best = len(names), math.inf
    for num_cuts in range(n):
        for cuts in itertools.combinations(range(1, n), num_cuts):
            bounds = [0, *cuts, n]
            masks = [cm.mask_of(names[i:j]) for i, j in zip(bounds, bounds[1:])]
            choices = [r for r in range(1, num_devices + 1) if b % r == 0] if replication else [1]
            for reps in itertools.product(choices, repeat=len(masks)):
                if sum(reps) != num_devices:
                    continue
                worst = 0.0
                for k, (mask, r, bd) in enumerate(zip(masks, reps, cm.chain_boundaries(masks))):
                    if not cm.fits(mask, b, r, math.ceil(sum(reps[k:]) / r)):
                        worst = math.inf
                        break
                    worst = max(worst, cm.time_per_sample(mask, b, r, boundary=bd))
                best = min(best, worst)
    return best


def test_pipedream_without_replication_gives_equal_chains_equal_stages():
    db = chain(8)
    result = pipedream_search(db, num_devices=4, mini_batch=8, replication=False)
    assert result.status == "ok" and result.plan.pipeline == "chain" and result.method == "pipedream"
    assert [len(s.layers) for s in result.plan.stages] == [2, 2, 2, 2]
    assert [s.devices for s in result.plan.stages] == [1, 1, 1, 1]
    costs = ChainCosts.build(StageCostModel(db, 8, p2p_devices=4), db.graph.list_topological_order())
    for b in (1, 2, 4, 8):
        tps, stages, _ = pipedream_bottleneck(costs, micro_batch=b, num_devices=4, replication=False)
        assert [(i, j) for i, j, _ in stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]
        assert tps == pytest.approx(2 * 3.0)     # two layers of 1 s forward and 2 s backward per sample


@pytest.mark.parametrize("seed", range(10))
def test_pipedream_bottleneck_equals_brute_force_over_all_cuts_and_replicas(seed):
    rng = random.Random(seed)
    n, num_devices, b = rng.randint(3, 6), rng.randint(1, 4), rng.choice([2, 4])
    db = random_db(random_chain_with_skips(n, rng), rng, memory=rng.choice([1e9, 0.8, 0.5]), split=seed % 2 == 1)
    cm = StageCostModel(db, 8, p2p_devices=num_devices)
    costs = ChainCosts.build(cm, db.graph.list_topological_order())
    for replication in (True, False):
        expected = brute_force_pipedream(cm, b=b, num_devices=num_devices, replication=replication)
        tps, stages, _ = pipedream_bottleneck(costs, micro_batch=b, num_devices=num_devices, replication=replication)
        if expected == math.inf:
            assert tps is None
            continue
        assert tps == pytest.approx(expected, rel=REL)
        masks = [costs.mask(i, j) for i, j, _ in stages]
        worst = max(cm.time_per_sample(m, b, r, boundary=bd)
                    for m, (_, _, r), bd in zip(masks, stages, cm.chain_boundaries(masks)))
        assert worst == pytest.approx(tps, rel=REL)


@pytest.mark.parametrize("zero_stage", ZERO_STAGES)
@pytest.mark.parametrize("split", [False, True], ids=["blocking-link", "split-link"])
def test_pipedream_prices_ranges_exactly_as_the_cost_model_with_relayed_skip_tensors(split, zero_stage):
    rng = random.Random(7)
    db = random_db(random_chain_with_skips(7, rng), rng, memory=1e9, split=split)
    cm = StageCostModel(db, 16, p2p_devices=4, zero_stage=zero_stage)
    costs = ChainCosts.build(cm, db.graph.list_topological_order())
    for i, j in [(0, 3), (2, 5), (4, 7), (0, 7), (3, 4)]:
        masks = [m for m in (costs.mask(0, i), costs.mask(i, j), costs.mask(j, 7)) if m]
        boundary = cm.chain_boundaries(masks)[masks.index(costs.mask(i, j))]
        for b, r in [(4, 1), (4, 2), (8, 4)]:
            _, tps, weight, stash = costs.stage_row(i, b, r)
            assert tps[j] == pytest.approx(cm.time_per_sample(costs.mask(i, j), b, r, boundary=boundary), rel=REL)
            assert weight[j] + 3 * stash[j] == pytest.approx(cm.memory(costs.mask(i, j), b, r, 3), rel=REL)


# -- Piper ----------------------------------------------------------------------------------------

def brute_force_piper(cm: StageCostModel, *, b: int, num_devices: int) -> float:
    """Least bottleneck over every sequence of stages whose prefixes are closed under producers,
    with every data-parallel degree per stage (at most ``num_devices`` devices in all), each
    stage priced with the boundaries of the chain pipeline that runs it (skip tensors relayed)."""
    everything = cm.full_mask

    def closed(mask: int) -> bool:
        return all(cm.producers[i] & ~mask == 0 for i in range(cm.num_layers) if mask >> i & 1)

    def sequences(done: int):
        if done == everything:
            yield []
            return
        rest = everything & ~done
        sub = rest
        while sub:
            if closed(done | sub):
                for tail in sequences(done | sub):
                    yield [sub, *tail]
            sub = (sub - 1) & rest

    degrees = [d for d in range(1, num_devices + 1) if b % d == 0]
    best = math.inf
    for stages in sequences(0):
        for ds in itertools.product(degrees, repeat=len(stages)):
            if sum(ds) > num_devices:
                continue
            worst = 0.0
            for k, (mask, d, bd) in enumerate(zip(stages, ds, cm.chain_boundaries(stages))):
                if not cm.fits(mask, b, d, math.ceil(sum(ds[k:]) / d)):
                    worst = math.inf
                    break
                worst = max(worst, cm.time_per_sample(mask, b, d, boundary=bd))
            best = min(best, worst)
    return best


DIAMOND = [("a", ["x"]), ("b", ["a"]), ("c", ["a"]), ("d", ["b", "c"])]
TWO_BRANCHES = [("a1", ["x"]), ("a2", ["a1"]), ("b1", ["x"]), ("b2", ["b1"]), ("b3", ["b2"]),
                ("cat", ["a2", "b3"]), ("head", ["cat", "a1"])]


@pytest.mark.parametrize("shape, seed", [pytest.param(DIAMOND, s, id=f"diamond-{s}") for s in (0, 1, 3, 5)]
                         + [pytest.param(TWO_BRANCHES, s, id=f"two-branches-{s}") for s in (0, 1, 6, 7)])
@pytest.mark.parametrize("num_devices", [2, 3])
@pytest.mark.parametrize("zero_stage", ZERO_STAGES)
def test_piper_bottleneck_equals_brute_force_over_convex_partitions(shape, seed, num_devices, zero_stage):
    rng = random.Random(seed)
    db = random_db(shape, rng, memory=rng.choice([1e9, 0.8, 0.5]), split=seed % 2 == 1)
    cm = StageCostModel(db, 8, p2p_devices=num_devices, zero_stage=zero_stage)
    found, _, _ = piper_bottlenecks(cm, enumerate_upsets(cm, limit=10**6), micro_batches=[2, 4],
                                    num_devices=num_devices)
    for b in (2, 4):
        expected = brute_force_piper(cm, b=b, num_devices=num_devices)
        if expected == math.inf:
            assert found[b] is None
            continue
        tps, stages = found[b]
        assert tps == pytest.approx(expected, rel=REL)
        bounds = cm.chain_boundaries([m for m, _ in stages])
        assert max(cm.time_per_sample(m, b, d, boundary=bd) for (m, d), bd in zip(stages, bounds)) == \
            pytest.approx(tps, rel=REL)
        assert sum(d for _, d in stages) <= num_devices


def test_the_downsets_of_b_chains_of_n_layers_and_a_join_number_n_plus_1_to_the_b_plus_1():
    cm = StageCostModel(branches(3, 2), 8)
    upsets = enumerate_upsets(cm, limit=10**6)
    assert len(upsets) == 3**3 + 1 and upsets[0] == 0 and upsets[-1] == cm.full_mask


@pytest.mark.timeout(60)
def test_piper_stops_at_its_state_limit_on_sixteen_branches():
    result = piper_search(branches(16, 4), num_devices=8, mini_batch=64)
    assert result.plan is None
    assert "state limit" in result.status and "40000 downsets" in result.status


def test_piper_lists_the_stages_of_a_diamond_in_a_topological_order():
    result = piper_search(synthetic_db(DIAMOND), num_devices=2, mini_batch=4)
    plan = result.plan
    assert result.status == "ok" and plan.pipeline == "chain" and plan.predicted is not None
    stage_of = plan.stage_of
    assert all(stage_of[src] <= stage_of[name] for name, inputs in DIAMOND for src in inputs if src != "x")


# -- DeepSpeed's partitions -----------------------------------------------------------------------

def test_ds_uniform_cuts_eight_equal_layers_into_four_stages_of_two():
    db = chain(8)
    assert deepspeed_partition(db, num_stages=4, method="uniform") == [0, 2, 4, 6, 8]
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    result = deepspeed_search(db, num_devices=4, mini_batch=8, method="uniform")
    assert result.status == "ok" and result.method == "ds-uniform"
    assert result.plan.uniform_devices is not None


def test_ds_parameters_puts_a_parameter_heavy_layer_alone():
    db = chain(8, param_bytes={"l3": 1000, **{f"l{i}": 10 for i in (0, 1, 2, 4, 5, 6, 7)}})
    bounds = deepspeed_partition(db, num_stages=3, method="parameters")
    assert (3, 4) in list(zip(bounds, bounds[1:]))


def test_partition_balanced_matches_deepspeeds_own():
    utils = pytest.importorskip("deepspeed.runtime.utils")
    rng = random.Random(0)
    for _ in range(30):
        weights = [rng.choice([0, 1, 2, 5, 100]) for _ in range(rng.randint(1, 9))]
        parts = rng.randint(1, 5)
        assert partition_balanced(weights, parts) == list(utils.partition_balanced(weights, parts)), (weights, parts)


# -- memory and the sweep -------------------------------------------------------------------------

def weighty_chain(memory_bytes: float):
    """Four layers of 100 parameter bytes and 1 stashed byte per sample each."""
    names = [f"l{i}" for i in range(4)]
    return chain(4, param_bytes={n: 100 for n in names}, stash_bytes={n: 1 for n in names},
                 hw=hardware(memory_bytes=memory_bytes))


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_a_memory_limit_for_one_layer_and_four_samples_forces_a_straight_pipeline_at_micro_batch_1(name):
    free = BASELINES[name](weighty_chain(1e9), num_devices=4, mini_batch=8)
    assert any(b == 8 and samples_per_s for b, _, samples_per_s in free.trace)
    # Every device may hold one layer (100 bytes) and four samples of one layer's activations:
    # the first of four single-device stages keeps four micro-batches of one sample in flight.
    tight = BASELINES[name](weighty_chain(104), num_devices=4, mini_batch=8)
    plan = tight.plan
    assert tight.status == "ok" and plan.micro_batch == 1
    assert [(len(s.layers), s.devices) for s in plan.stages] == [(1, 1)] * 4
    assert plan.predicted.fits_memory and plan.predicted.peak_mem_bytes <= 104
    assert all(samples_per_s is None for b, _, samples_per_s in tight.trace if b > 1)


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_a_memory_limit_below_one_layer_explains_that_no_plan_fits(name):
    result = BASELINES[name](weighty_chain(99), num_devices=4, mini_batch=8)
    assert result.plan is None and "no plan fits" in result.status and "GiB per device" in result.status


def test_a_straight_pipeline_with_fewer_layers_than_devices_says_so():
    result = pipedream_search(chain(3), num_devices=4, mini_batch=8, replication=False)
    assert result.plan is None and "no partition of 3 layers uses 4 devices" in result.status


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_every_baseline_returns_a_predicted_chain_plan_with_its_search_cost(name):
    messages = []
    start = time.perf_counter()
    result = BASELINES[name](branches(2, 3), num_devices=4, mini_batch=16, micro_batches=[2, 4],
                             progress=messages.append)
    wall = time.perf_counter() - start
    plan = result.plan
    assert len(messages) >= 2 and all(m.startswith(name) for m in messages)
    assert result.status == "ok" and plan.pipeline == "chain" and plan.method == result.method == name
    assert plan.predicted is not None and plan.predicted.fits_memory and plan.micro_batch in (2, 4)
    assert plan.num_devices <= 4 and result.states > 0
    assert 0 < result.search_time_s <= wall, (result.search_time_s, wall)  # measured, simulation excluded
    assert sorted(n for s in plan.stages for n in s.layers) == sorted(c.name for c in branches(2, 3).layers)
