"""Several stages per rank (issue 28): the folded schedules train exactly like one device.

Every case trains on real gloo ranks (``tests/workers/train_cases.py``) under the strict transport
(``GPP_STRICT_P2P=1``: NCCL's rendezvous semantics, tests/strict_p2p.py), with each rank holding
several stages of the module (``GraphPipelineModule(..., stages_per_rank=2)`` or ``fold=...``),
and is compared with :func:`reference.train_reference` (GraphModel + SGD on one process, same
micro-batches) to ``rtol=1e-5`` in fp32: per-step losses, the eval loss, the logits and every
final parameter, each parameter living on exactly one rank of each replica.

Schedules: ``"interleaved"`` (Megatron's interleaved 1F1B, looped placement, fused backward) and
``"zbv"`` (ZB-V: the V placement, split backward), on a chain and on DAGs (a skip edge, a fan-out
into a fan-in), with data-parallel replicas (pipe 2 x data 2).
"""

import pytest
import torch

from gpp_deepspeed.graph.placement import shard_rows
from reference import train_reference
from test_equivalence import case as eq_case
from workers.train_cases import pipeline_ranks

pytestmark = pytest.mark.dist

STRICT = {"GPP_STRICT_P2P": "1", "GPP_STRICT_P2P_HANG_S": "30"}
SHORT = {"steps": 2}   # the first batch sends layouts, the second does not (static shapes)


def case(model, stages, zero, schedule, *, tag="", **extra):
    c = eq_case(model, stages, zero, schedule=schedule, **SHORT, **extra)
    return {**c, "id": "fold-" + c["id"] + tag}


# Chains: 4 stages on 2 ranks (interleaved: stages 0, 2 | 1, 3; zbv: 0, 3 | 1, 2), alone and in
# pipe 2 x data 2.
CHAINS = [case("chain", 4, 0, "interleaved", stages_per_rank=2),
          case("chain", 4, 1, "zbv", fold="v")]
# DAGs: a skip edge (l1 -> res), a fan-out into a fan-in (four_branch), the V and looped folds,
# and a fold where two parallel branches share a rank.
DAGS = [case("skip", 4, 0, "zbv", fold="v"),
        case("four_branch", 4, 1, "interleaved", stages_per_rank=2),
        case("fanout3", 4, 0, "interleaved", fold=[0, 1, 1, 0], tag="-branches")]
W2 = CHAINS + DAGS
W4 = [case("chain", 4, 1, "interleaved", stages_per_rank=2, tag="-dp2"),
      case("skip", 4, 0, "zbv", fold="v", tag="-dp2"),
      # ZeRO-2: each rank's optimizer partitions all its stages' gradients over its 2 replicas
      case("chain", 4, 2, "interleaved", stages_per_rank=2, tag="-dp2"),
      case("four_branch", 4, 2, "zbv", fold="v", tag="-dp2")]
# Per-stage degrees: the stages of a rank share its ranks (V: stages 0 and 3 on 2 ranks, 1 and 2
# on one; looped: stages 0 and 2 on 2 ranks); rows reshard between ranks of different degrees.
W3 = [case("chain", 4, 0, "zbv", fold="v", degrees=[2, 1, 1, 2]),
      case("skip", 4, 1, "interleaved", stages_per_rank=2, degrees=[2, 1, 2, 1])]
# bf16 (DeepSpeed's bf16 optimizer): tracks the fp32 model as the other bf16 cases do.
BF16 = [case("chain", 4, 0, "zbv", fold="v", bf16=True, tag="-bf16"),
        case("four_branch", 4, 1, "interleaved", stages_per_rank=2, bf16=True, tag="-bf16")]


def _check(out, c, world, *, rel=1e-5):
    ranks = [torch.load(out / f"{c['id']}.rank{r}.pt") for r in range(world)]
    dp = world // pipeline_ranks(c)
    ref = train_reference(c, dp=dp)
    for r, res in enumerate(ranks):
        assert res["schedule"] == c["schedule"]
        assert res["losses"] == pytest.approx(ref.losses, rel=rel), f"rank {r}"
        assert res["eval"] == pytest.approx(ref.eval_loss, rel=rel), f"rank {r}"
        if c["zero"] == 2:
            assert res["partitions_grads"], f"rank {r}: ZeRO-2 partitions the gradients"
        if rel > 1e-5:
            continue
        assert res["strict_p2p"] is not None and res["strict_p2p"]["single_ops"] == 0, f"rank {r}: strict transport"
    output_degree = c.get("degrees", [1] * c["stages"])[-1]   # the output stage is the last one here
    rows = set()
    for res in ranks:
        if res["logits"] is None:
            continue
        lo, hi = shard_rows(c["mbs"], output_degree, res["shard"])
        if rel == 1e-5:
            torch.testing.assert_close(res["logits"], ref.last_logits[res["dp"]][lo:hi], rtol=1e-5, atol=1e-6)
        rows.add((res["dp"], lo, hi))
    assert len(rows) == dp * output_degree, "the ranks holding the output stage return the logits of their rows"
    if rel > 1e-5:
        return
    per_replica: dict[tuple, set] = {}
    for res in ranks:
        names = set(res["state"])
        where = (res["dp"], res["shard"])   # a replica, and a rank's row shard under per-stage degrees
        assert not names & per_replica.get(where, set()), "a parameter lives on one rank of a replica"
        per_replica.setdefault(where, set()).update(names)
        for name, value in res["state"].items():
            torch.testing.assert_close(value, ref.state[name], rtol=1e-5, atol=1e-6, msg=name)
    for d in range(dp):
        seen = set().union(*(names for (k, _), names in per_replica.items() if k == d))
        assert seen == set(ref.state), "every parameter is trained in every replica"


@pytest.mark.parametrize("c", W2, ids=[c["id"] for c in W2])
def test_a_folded_schedule_on_two_ranks_trains_like_one_device_under_the_strict_transport(run_cases, c):
    _check(run_cases("fold_w2", 2, W2, timeout=900, env=STRICT), c, 2)


@pytest.mark.parametrize("c", W4, ids=[c["id"] for c in W4])
def test_a_folded_schedule_with_data_parallel_replicas_and_zero_trains_like_one_device(run_cases, c):
    _check(run_cases("fold_w4", 4, W4, timeout=900, env=STRICT), c, 4)


@pytest.mark.parametrize("c", W3, ids=[c["id"] for c in W3])
def test_a_folded_schedule_with_per_stage_degrees_trains_like_one_device(run_cases, c):
    _check(run_cases("fold_w3", 3, W3, timeout=900, env=STRICT), c, 3)


@pytest.mark.parametrize("c", BF16, ids=[c["id"] for c in BF16])
def test_a_folded_schedule_in_bf16_tracks_the_fp32_single_device_model(run_cases, c):
    # bf16 keeps 8 mantissa bits: agreement to a few percent is what bf16 can promise.
    _check(run_cases("fold_bf16_w2", 2, BF16, timeout=900, env=STRICT), c, 2, rel=3e-2)
