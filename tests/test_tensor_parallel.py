"""Tensor parallelism inside a stage (issue 29, points 1 and 2), on gloo ranks.

* A 3-stage DAG whose stages have (TP, DP) of (2, 1), (1, 2), (2, 1) on 6 ranks, with
  Megatron-style layers (``tests/tp_layers.py``) doing their own TP through the grid's slice group,
  trains like the single-device model (the same layers at TP 1): per-step losses and every
  parameter, whole, rtol 1e-5, under the strict transport (``GPP_STRICT_P2P=1``); 1F1B and ZB1
  (whose split backward must keep the column-parallel input gradient's all-reduce in its input
  pass), ZeRO-1 (and 2 and 3 under 1F1B), and gradient clipping (the norm over TP slices counted
  once, ZeRO-0 and ZeRO-1).
* DeepSpeed's ``PipeModelDataParallelTopology(2, 2, 2)`` on 8 ranks: DeepSpeed's own
  ``PipelineEngine`` and ours train the same chain (its first and last layers tied across the two
  stages, each TP rank's slice tied over its own group) to the same losses and parameters, and
  DeepSpeed's engine loads the checkpoint ours wrote (``layer_XX-model_YY`` names), and ours
  DeepSpeed's.
"""

import pytest
import torch
from torch import nn

from dist import launch
from tp_layers import TPMLP, Add, Dense
from workers.tp_cases import D, F, batches

pytestmark = pytest.mark.dist

WORKER = __import__("pathlib").Path(__file__).parent / "workers" / "tp_cases.py"
BASE = {"kind": "dag", "degrees": [2, 2, 2], "tp": [2, 1, 2], "mbs": 4, "gas": 4, "steps": 3, "lr": 0.1}
DAG = [dict(BASE, id="1f1b-z0", schedule="1f1b"), dict(BASE, id="zb1-z0", schedule="zb1"),
       dict(BASE, id="1f1b-z1", schedule="1f1b", zero=1), dict(BASE, id="zb1-z1-clip", schedule="zb1", zero=1,
                                                                  clip=0.05),
       dict(BASE, id="1f1b-z0-clip", schedule="1f1b", clip=0.05),
       dict(BASE, id="1f1b-z2", schedule="1f1b", zero=2), dict(BASE, id="1f1b-z3", schedule="1f1b", zero=3)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    done = {}

    def go(name, world, cases, env=None):
        if name not in done:
            out = tmp_path_factory.mktemp(name)
            (out / "cases.json").write_text(__import__("json").dumps(cases))
            result = launch(world, WORKER, str(out / "cases.json"), str(out), timeout=600, log_dir=out / "logs",
                            env=env)
            done[name] = (out, result)
        out, result = done[name]
        assert result.ok, result.report()
        return out
    return go


def reference(case):
    """The single-device model (the DAG's layers at TP 1), trained with the same micro-batches."""
    layers = {"a": TPMLP(D, F, seed=1), "b": Dense(D, seed=2), "add": Add(), "c": TPMLP(D, F, seed=3)}
    params = [p for layer in layers.values() for p in layer.parameters()]
    opt = torch.optim.SGD(params, lr=case["lr"])
    losses = []
    for step in range(case["steps"]):
        total = 0.0
        for x, y in batches(100 * step, gas=case["gas"], mbs=case["mbs"]):
            a = layers["a"](x)
            loss = nn.functional.mse_loss(layers["c"](layers["add"](a, layers["b"](a))), y) / case["gas"]
            loss.backward()
            total += loss.item()
        if case.get("clip"):
            norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params))
            coef = case["clip"] / (norm + 1e-6)
            if coef < 1:
                for p in params:
                    p.grad.mul_(coef)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    with torch.no_grad():
        evals = [nn.functional.mse_loss(layers["c"](layers["add"](a, layers["b"](a))), y).item()
                 for x, y in batches(999, gas=case["gas"], mbs=case["mbs"]) for a in [layers["a"](x)]]
    return losses, sum(evals) / len(evals), {f"{n}.{k}": v.detach() for n, layer in layers.items() for k, v in layer.named_parameters()}


@pytest.mark.parametrize("case", DAG, ids=[c["id"] for c in DAG])
def test_tp_dag_of_mixed_tp_and_dp_trains_like_the_single_device_model(run, case):
    out = run("tp_dag", 6, DAG, env={"GPP_STRICT_P2P": "1"})
    losses, eval_loss, params = reference(case)
    seen = set()
    for r in range(6):
        res = torch.load(out / f"{case['id']}.rank{r}.pt")
        assert res["losses"] == pytest.approx(losses, rel=1e-5), f"rank {r}"
        assert res["eval"] == pytest.approx(eval_loss, rel=1e-5), f"rank {r}"
        assert res["strict_p2p"] is not None, "ran under the strict transport"
        for name, value in res["params"].items():
            torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-6, msg=f"rank {r} {name}")
            seen.add(name)
        if case["schedule"] == "zb1" and res["stage"] != 0:
            assert {"I", "W"} <= set(res["ran"]), res["ran"]   # the backward really was split
        if res["stage"] == 2:   # TP 2 with a predecessor: the input gradient's all-reduce, in the input pass
            assert res["allreduce_passes"] == (["input"] if case["schedule"] == "zb1" else ["full"]), res
    assert seen == set(params)


def test_3d_topology_drop_in_matches_deepspeeds_pipeline_engine(run):
    case = {"kind": "3d", "id": "3d", "mbs": 4, "gas": 4, "steps": 3, "lr": 0.1}
    out = run("tp_3d", 8, [case])
    for r in range(8):
        res = torch.load(out / f"3d.rank{r}.pt")
        assert res["ds_partitioned"] == (True, True), "DeepSpeed ran its partitioned transfers"
        assert res["groups"]["dp"] == res["groups"]["ds_dp"] and res["groups"]["slice"] == res["groups"]["ds_slice"]
        assert res["losses"] == pytest.approx(res["ds_losses"], rel=1e-5), f"rank {r}"
        assert res["state"].keys() == res["ds_state"].keys()
        for k in res["state"]:
            torch.testing.assert_close(res["state"][k], res["ds_state"][k], rtol=1e-5, atol=1e-6, msg=f"rank {r} {k}")
            torch.testing.assert_close(res["ds_loaded_state"][k], res["state"][k], rtol=0, atol=0,
                                       msg=f"rank {r} {k}: DeepSpeed loaded our checkpoint")
            torch.testing.assert_close(res["loaded_ds_state"][k], res["ds_state"][k], rtol=0, atol=0,
                                       msg=f"rank {r} {k}: we loaded DeepSpeed's checkpoint")
    files = torch.load(out / "3d.rank0.pt")["files"]
    assert {f"layer_{i:02d}-model_{m:02d}-model_states.pt" for i in range(4) for m in range(2)} <= set(files), files
    assert any(k.startswith("tied_modules.mlp.") for k in res["state"]), "the tied copies were compared"
