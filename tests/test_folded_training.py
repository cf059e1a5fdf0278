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

from reference import train_reference
from test_equivalence import case as eq_case

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
      case("skip", 4, 0, "zbv", fold="v", tag="-dp2")]


def _ranks_of(c) -> int:
    fold = c.get("fold")
    if isinstance(fold, list):
        return max(fold) + 1
    return c["stages"] // (2 if fold == "v" else c.get("stages_per_rank", 1))


def _check(out, c, world):
    ranks = [torch.load(out / f"{c['id']}.rank{r}.pt") for r in range(world)]
    dp = world // _ranks_of(c)
    ref = train_reference(c, dp=dp)
    for r, res in enumerate(ranks):
        assert res["schedule"] == c["schedule"]
        assert res["losses"] == pytest.approx(ref.losses, rel=1e-5), f"rank {r}"
        assert res["eval"] == pytest.approx(ref.eval_loss, rel=1e-5), f"rank {r}"
        assert res["strict_p2p"] is not None and res["strict_p2p"]["single_ops"] == 0, f"rank {r}: strict transport"
    logits = {res["dp"]: res["logits"] for res in ranks if res["logits"] is not None}
    assert sorted(logits) == list(range(dp)), "the rank holding the output stage of every replica returns logits"
    for d, value in logits.items():
        torch.testing.assert_close(value, ref.last_logits[d], rtol=1e-5, atol=1e-6)
    per_replica: dict[int, set] = {}
    for res in ranks:
        names = set(res["state"])
        assert not names & per_replica.get(res["dp"], set()), "a parameter lives on one rank of a replica"
        per_replica.setdefault(res["dp"], set()).update(names)
        for name, value in res["state"].items():
            torch.testing.assert_close(value, ref.state[name], rtol=1e-5, atol=1e-6, msg=name)
    assert all(seen == set(ref.state) for seen in per_replica.values()), "every parameter is trained"


@pytest.mark.parametrize("c", W2, ids=[c["id"] for c in W2])
def test_a_folded_schedule_on_two_ranks_trains_like_one_device_under_the_strict_transport(run_cases, c):
    _check(run_cases("fold_w2", 2, W2, timeout=900, env=STRICT), c, 2)


@pytest.mark.parametrize("c", W4, ids=[c["id"] for c in W4])
def test_a_folded_schedule_with_data_parallel_replicas_trains_like_one_device(run_cases, c):
    _check(run_cases("fold_w4", 4, W4, timeout=900, env=STRICT), c, 4)
