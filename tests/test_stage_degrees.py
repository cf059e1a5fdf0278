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
from reference import train_reference

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
    + [case("tied", [1, 2, 1], z, partition=TIED3) for z in (0, 1)],
    6: [case("four_branch", [2, 1], z) for z in (0, 1)],                  # [2, 1] replicated twice: 2 x 3 ranks
}
ALL = [(world, c) for world, cases in WORLDS.items() for c in cases]
# Save after 2 steps, train 2 more; rebuild, load, train the same 2: both runs must agree.
CKPT = [case("four_branch", [2, 1, 1], 1, tag="-ckpt", checkpoint=True),
        case("tied", [1, 2, 1], 0, partition=TIED3, tag="-ckpt", checkpoint=True)]
WORLDS[4] += CKPT


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
    seen = set()
    for r, res in enumerate(ranks):
        for name, value in res["state"].items():
            torch.testing.assert_close(value, ref.state[name], rtol=1e-5, atol=1e-6, msg=f"rank {r}: {name}")
            seen.add(name)
    assert seen == set(ref.state), "every parameter lives on the stages that own it"


@pytest.mark.parametrize("c", CKPT, ids=[c["id"] for c in CKPT])
def test_a_checkpoint_of_per_stage_degrees_resumes_exactly_like_an_uninterrupted_run(run_cases, c):
    out = run_cases("degrees_w4", 4, WORLDS[4])
    ranks = [torch.load(out / f"{c['id']}.rank{r}.pt") for r in range(4)]
    ref = train_reference(c, dp=1, steps=range(4))
    for r, res in enumerate(ranks):
        assert res["resumed"] == res["uninterrupted"], f"rank {r}"
        assert res["uninterrupted"] == pytest.approx(ref.losses[2:], rel=1e-5), f"rank {r}"
