"""ZeRO-2 and ZeRO-3 inside a stage's data-parallel group train exactly like the single-device model.

DeepSpeed's ZeRO-2 optimizer partitions gradients and optimizer state over the ranks of each stage,
ZeRO-3 the parameters too (``gpp_deepspeed/engine/zero.py``): their hooks reduce every
micro-batch's gradients during the backward (``B``, or ``W`` under the split backward of zb1/zb2,
which ZeRO-3 refuses). Each case trains on real gloo processes
(``tests/workers/train_cases.py``, one launch for all) and must equal
:func:`reference.train_reference` (GraphModel + SGD on one process): per-step losses, the eval loss,
the logits and every parameter on every rank that holds it, fp32, ``rtol=1e-5``; bf16 tracks the
fp32 model as the other bf16 cases do.
"""

import pytest
import torch

from reference import assert_stage_parameters_match, train_reference

pytestmark = pytest.mark.dist

BASE = {"steps": 3, "gas": 4, "lr": 0.1, "mbs": 4}
SKIP3 = {"l1": 0, "l2": 1, "l3": 1, "l4": 2, "res": 2, "head": 2}           # l1 -> res skips stage 1
TIED3 = {"pa": 0, "layer1": 0, "pb": 1, "layer3": 1, "merge": 2, "head": 2}  # copies on stages 0 and 1


def case(model, *, zero=2, stages=None, degrees=None, schedule="1f1b", partition="uniform", tag="", **extra):
    shape = f"d{''.join(map(str, degrees))}" if degrees else f"s{stages}"
    return {"id": f"{model}-{shape}-z{zero}-{schedule}{tag}", "model": model,
            "stages": len(degrees) if degrees else stages, **({"degrees": list(degrees)} if degrees else {}),
            "zero": zero, "schedule": schedule, "partition": partition, **BASE, **extra}


WORLD = 4
OPTIMIZERS = {2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}


def _each_zero(*cases):
    """Each case under ZeRO-2 and, unless its schedule splits the backward (refused), ZeRO-3."""
    return [{**c, "zero": z, "id": c["id"].replace("-z2-", f"-z{z}-")} for z in (2, 3) for c in cases
            if z == 2 or c["schedule"] not in ("zb1", "zb2")]


CASES = _each_zero(
    # pipe 2 x data 2: each stage's optimizer partitions over the stage's 2 replicas
    case("four_branch", stages=2), case("four_branch", stages=2, schedule="zb1"),
    # per-stage degrees: the wide stage partitions over its 2 ranks; a skip edge; clipping by the
    # global norm (0.05 binds) summed over the partitions and the stages
    case("skip", degrees=[2, 1, 1], partition=SKIP3, clip=0.05, tag="-clip"),
    case("skip", degrees=[2, 1, 1], partition=SKIP3, schedule="zb1", clip=0.05, tag="-clip"),
    # tied copies on stages 0 and 1 (stage 1 of 2 ranks): the tied sum goes through the partitions
    case("tied", degrees=[1, 2, 1], partition=TIED3), case("tied", degrees=[1, 2, 1], partition=TIED3, schedule="zb1"),
    case("tied", degrees=[1, 2, 1], partition=TIED3, clip=0.05, tag="-clip"),   # the tied copy counted once
    # Adam's moments partitioned too
    case("four_branch", degrees=[2, 1, 1], optimizer="adam", lr=0.01, tag="-adam"),
    # the other synchronous schedules, and recomputation (DeepSpeed's reentrant checkpoint under
    # 1f1b: ZeRO's hooks fire in several phases of one backward; torch's non-reentrant one under zb2)
    case("fanout3", stages=2, schedule="gpipe"), case("skip", degrees=[1, 2, 1], partition=SKIP3, schedule="zb2"),
    case("four_branch", stages=2, ckpt_interval=1, tag="-recompute"),
    case("four_branch", degrees=[2, 1, 1], schedule="zb2", ckpt_interval=1, tag="-recompute"),
    # stages without parameters (glue), and a frozen first layer: optimizers whose hooks never fire
    case("glue", stages=4), case("skip_frozen", stages=2),
)
# Save after 2 steps, train 2 more; rebuild, load, train the same 2: both runs must agree. The
# partitioned Adam state moves to another layout too (degrees [1, 1, 2], ZeRO-1).
CKPT = [case("four_branch", degrees=[2, 1, 1], optimizer="adam", lr=0.01, tag="-ckpt", checkpoint=True),
        case("four_branch", degrees=[2, 1, 1], optimizer="adam", lr=0.01, tag="-ckpt-moved", checkpoint=True,
             resume_as={"degrees": [1, 1, 2], "zero": 1})]
BF16 = _each_zero(case("four_branch", degrees=[2, 1, 1], bf16=True, tag="-bf16"),
                  case("skip", stages=2, partition="uniform", schedule="zb1", bf16=True, tag="-bf16"))
ALL = CASES + BF16 + CKPT


def _replicas(c):
    return WORLD // (sum(c["degrees"]) if "degrees" in c else c["stages"])


def _ranks(run_cases, c):
    out = run_cases("zero_w4", WORLD, ALL)
    return [torch.load(out / f"{c['id']}.rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("c", CASES, ids=[c["id"] for c in CASES])
def test_zero_per_stage_group_trains_like_the_single_device_model(run_cases, c):
    ranks = _ranks(run_cases, c)
    ref = train_reference(c, dp=_replicas(c))
    for r, res in enumerate(ranks):
        assert res["schedule"] == c["schedule"]
        assert res["optimizer"] == OPTIMIZERS[c["zero"]], f"rank {r}"
        assert res["losses"] == pytest.approx(ref.losses, rel=1e-5), f"rank {r} (stage {res['stage']})"
        assert res["eval"] == pytest.approx(ref.eval_loss, rel=1e-5), f"rank {r} (stage {res['stage']})"
    assert_stage_parameters_match(ranks, ref)


@pytest.mark.parametrize("c", BF16, ids=[c["id"] for c in BF16])
def test_zero_with_bf16_tracks_the_fp32_single_device_model(run_cases, c):
    ranks = _ranks(run_cases, c)
    ref = train_reference(c, dp=_replicas(c))
    for r, res in enumerate(ranks):
        # bf16 keeps 8 mantissa bits: agreement to a few percent is what bf16 can promise.
        assert res["losses"] == pytest.approx(ref.losses, rel=3e-2), f"rank {r} (stage {res['stage']})"
        assert res["eval"] == pytest.approx(ref.eval_loss, rel=3e-2), f"rank {r} (stage {res['stage']})"


@pytest.mark.parametrize("c", CKPT, ids=[c["id"] for c in CKPT])
def test_a_zero2_checkpoint_resumes_like_an_uninterrupted_run(run_cases, c):
    ranks = _ranks(run_cases, c)
    ref = train_reference(c, dp=1, steps=range(4))
    for r, res in enumerate(ranks):
        assert res["trained"] == pytest.approx(ref.losses[:2], rel=1e-5), f"rank {r}"
        assert res["resumed"] == pytest.approx(ref.losses[2:], rel=1e-5), f"rank {r}"
        if "resume_as" not in c:
            assert res["resumed"] == res["uninterrupted"], f"rank {r}"
