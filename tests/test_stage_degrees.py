"""Per-stage data-parallel degrees train exactly like the single-device model.

Stage ``s`` runs on ``n_s`` ranks, each on ``b / n_s`` rows of every micro-batch; edges between
stages of different degrees reshard rows. Every case trains on real gloo processes
(``tests/workers/train_cases.py``) and must equal :func:`reference.train_reference` (GraphModel + SGD
on one process, the same micro-batches of ``b`` samples per replica): per-step losses and the eval
loss on every rank, each output rank's logits for its rows, and every parameter on every rank
that holds it, fp32, ``rtol=1e-5``.
"""

import pytest
import torch

from gpp_deepspeed.graph.placement import shard_rows
from models import MODELS as MODEL_CASES, make_batches
from reference import assert_stage_parameters_match, train_reference

pytestmark = pytest.mark.dist

BASE = {"steps": 3, "gas": 4, "lr": 0.1}
SKIP3 = {"l1": 0, "l2": 1, "l3": 1, "l4": 2, "res": 2, "head": 2}           # l1 -> res skips stage 1
TIED3 = {"pa": 0, "layer1": 0, "pb": 1, "layer3": 1, "merge": 2, "head": 2}  # copies on stages 0 and 1


def case(model, degrees, zero, *, mbs=4, partition="uniform", tag="", **extra):
    name = f"{model}-d{''.join(map(str, degrees))}-z{zero}-b{mbs}{tag}"
    return {"id": name, "model": model, "stages": len(degrees), "degrees": list(degrees), "zero": zero, "mbs": mbs,
            "partition": partition, **BASE, **extra}


WORLDS = {
    4: [case("four_branch", [2, 1, 1], z) for z in (0, 1)]
    + [case("skip", [1, 2, 1], z, partition=SKIP3) for z in (0, 1)]       # the skip edge crosses the wide stage
    + [case("skip", [2, 1, 1], z, partition=SKIP3, tag="-clip", clip=0.05) for z in (0, 1)]
    + [case("three_input", [1, 3], z, mbs=6) for z in (0, 1)]             # 6 rows: shards of 2, resharded 6 -> 3 x 2
    + [case("tied", [1, 2, 1], z, partition=TIED3) for z in (0, 1)]
    # resolve_partition called before the module: the degrees reach it inside the resolved partition
    + [case("four_branch", [2, 1, 1], 1, partition="resolved:uniform", tag="-resolved")]
    # a heterogeneous plan (planner/hetero.py, two device classes): a stage DAG with a fan-in
    + [case("four_branch", [2, 1, 1], 0, partition="golden/plan_four_branch_hetero.json", tag="-hetero")],
    6: [case("four_branch", [2, 1], z) for z in (0, 1)],                  # [2, 1] replicated twice: 2 x 3 ranks
}
# training_data=: DeepSpeed's loader samples over the replicas; each rank of a wide loading stage keeps its rows.
DATA = {4: [case("four_branch", [2, 1, 1], 1, tag="-data", training_data=True)],
        6: [case("four_branch", [2, 1], 0, tag="-data", training_data=True)]}   # 2 replicas: disjoint shards
for world, cases in DATA.items():
    WORLDS[world] += cases
ALL = [(world, c) for world, cases in WORLDS.items() for c in cases]
# bf16 (DeepSpeed's bf16 optimizer, ZeRO-0 and ZeRO-1) on stages of several ranks: compared with the
# fp32 single-device model to what bf16 can promise, as test_runtime's one-rank-per-stage cases are.
BF16 = [case("four_branch", [2, 1, 1], 0, tag="-bf16", bf16=True),
        case("skip", [1, 2, 1], 1, partition=SKIP3, tag="-bf16", bf16=True)]
# Save after 2 steps, train 2 more; rebuild, load, train the same 2: both runs must agree.
CKPT = [case("four_branch", [2, 1, 1], 1, tag="-ckpt", checkpoint=True),
        case("tied", [1, 2, 1], 0, partition=TIED3, tag="-ckpt", checkpoint=True)]
WORLDS[4] += CKPT + BF16


@pytest.mark.parametrize("world,c", ALL, ids=[f"w{w}-{c['id']}" for w, c in ALL])
def test_per_stage_degrees_train_like_the_single_device_model(run_cases, world, c):
    out = run_cases(f"degrees_w{world}", world, WORLDS[world])
    ranks = [torch.load(out / f"{c['id']}.rank{r}.pt") for r in range(world)]
    replicas = world // sum(c["degrees"])
    ref = train_reference(c, dp=replicas)
    for r, res in enumerate(ranks):
        assert res["losses"] == pytest.approx(ref.losses, rel=1e-5), f"rank {r} (stage {res['stage']})"
        assert res["eval"] == pytest.approx(ref.eval_loss, rel=1e-5), f"rank {r} (stage {res['stage']})"
    output_degree = c["degrees"][-1]
    seen_rows = set()
    for res in ranks:
        if res["logits"] is None:
            continue
        lo, hi = shard_rows(c["mbs"], output_degree, res["shard"])
        torch.testing.assert_close(res["logits"], ref.last_logits[res["dp"]][lo:hi], rtol=1e-5, atol=1e-6)
        seen_rows.add((res["dp"], lo, hi))
    assert len(seen_rows) == replicas * output_degree, "every output rank returns the logits of its own rows"
    assert_stage_parameters_match(ranks, ref)


@pytest.mark.parametrize("c", CKPT, ids=[c["id"] for c in CKPT])
def test_a_checkpoint_of_per_stage_degrees_resumes_exactly_like_an_uninterrupted_run(run_cases, c):
    out = run_cases("degrees_w4", 4, WORLDS[4])
    ranks = [torch.load(out / f"{c['id']}.rank{r}.pt") for r in range(4)]
    ref = train_reference(c, dp=1, steps=range(4))
    for r, res in enumerate(ranks):
        assert res["resumed"] == res["uninterrupted"], f"rank {r}"
        assert res["uninterrupted"] == pytest.approx(ref.losses[2:], rel=1e-5), f"rank {r}"


@pytest.mark.parametrize("world,c", [(w, c) for w, cases in DATA.items() for c in cases],
                         ids=[f"w{w}-{c['id']}" for w, cases in DATA.items() for c in cases])
def test_training_data_gives_every_rank_of_a_replica_that_replicas_micro_batches(run_cases, world, c):
    out = run_cases(f"degrees_w{world}", world, WORLDS[world])
    ranks = [torch.load(out / f"{c['id']}.rank{r}.pt") for r in range(world)]
    mc = MODEL_CASES[c["model"]]()
    for res in ranks:
        assert bool(res["seen"]) == res["reads_batch"], f"stage {res['stage']}"
        if not res["seen"]:
            continue
        # the whole micro-batch of the rank's replica, as make_batches gives it; the rank keeps its rows
        expected = [(list(x) if isinstance(x, tuple) else [x], y) for step in range(c["steps"])
                    for x, y in make_batches(mc, step=step, dp_rank=res["dp"], micro_batches=c["gas"],
                                             micro_batch_size=c["mbs"])]
        assert len(res["seen"]) == len(expected), f"stage {res['stage']}"
        for (xs, y), (ex, ey) in zip(res["seen"], expected):
            assert torch.equal(y, ey) and all(torch.equal(a, b) for a, b in zip(xs, ex)), f"stage {res['stage']}"
    assert any(res["seen"] and c["degrees"][res["stage"]] > 1 for res in ranks), "a stage of several ranks reads"


@pytest.mark.parametrize("c", BF16, ids=[c["id"] for c in BF16])
def test_bf16_on_stages_of_several_ranks_tracks_the_fp32_single_device_model(run_cases, c):
    out = run_cases("degrees_w4", 4, WORLDS[4])
    ref = train_reference(c, dp=1)
    for r in range(4):
        res = torch.load(out / f"{c['id']}.rank{r}.pt")
        # bf16 keeps 8 mantissa bits: agreement to a few percent is what bf16 can promise.
        assert res["losses"] == pytest.approx(ref.losses, rel=3e-2), f"rank {r} (stage {res['stage']})"
        assert res["eval"] == pytest.approx(ref.eval_loss, rel=3e-2), f"rank {r} (stage {res['stage']})"
