"""The paper's models train with the real runtime exactly as on one device.

The ``dist`` test trains the tiny preset of every paper model (``gpp_deepspeed.models.TINY``) on 4
gloo ranks, 4 stages cut by parameter count, in one launch (``tests/workers/paper_models.py``):
3 steps of 4 micro-batches of 2, SGD with momentum, DeepSpeed's default clipping at 1.0. Per-step
losses and every final parameter must equal a single-process ``GraphModel`` trained on the same
micro-batches. One more case profiles the tiny MMT on this machine first and lets every rank cut it
with GraphPipe's search on that profile. The other tests check the torch layers against their
descriptions, in-process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dist import launch
from gpp_deepspeed import GraphModel
from gpp_deepspeed.models import build_layers, loss_fn, make_batch, tiny
from gpp_deepspeed.planner import CommFit, Hardware
from gpp_deepspeed.profiler import profile_layers

WORKER = Path(__file__).resolve().parent / "workers" / "paper_models.py"
WORLD = 4
BASE = {"stages": 4, "partition": "parameters", "steps": 3, "gas": 4, "mbs": 2, "lr": 0.05, "momentum": 0.9,
        "clip": 1.0}
CASES = [{"id": f"{m}-{g}", "model": m, "granularity": g, **BASE}
         for m, g in [("mmt", "layer"), ("mmt", "sublayer"), ("dlrm", "layer"), ("candle_uno", "layer"),
                      ("sequential_transformer", "layer")]]
# The user's flow end to end: profile the model on this machine, then let GraphPipe's search cut it
# on every rank (partition_method="graphpipe", cost_db=<the profile>).
CASES.append({**CASES[0], "id": "mmt-layer-profiled-graphpipe", "partition": "graphpipe"})


def _reference(case: dict) -> tuple[list[float], dict]:
    """GraphModel + SGD on one process, on the micro-batches the worker feeds (same seeds)."""
    desc = tiny(case["model"], granularity=case["granularity"])
    model = GraphModel(build_layers(desc), input_names=desc.input_names)
    opt = torch.optim.SGD(model.parameters(), lr=case["lr"], momentum=case["momentum"])
    criterion = loss_fn(desc)
    losses = []
    for step in range(case["steps"]):
        opt.zero_grad()
        total = 0.0
        for k in range(case["gas"]):
            inputs, labels = make_batch(desc, case["mbs"], seed=1000 * step + k)
            loss = criterion(model(*inputs), labels)
            (loss / case["gas"]).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        opt.step()
        losses.append(total / case["gas"])
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("paper_models")
    desc = tiny("mmt")
    link = CommFit(alpha_s=50e-6, beta_s_per_byte=5e-10)
    hardware = Hardware(name="cpu (test)", memory_bytes=2**34, devices_per_node=4, intra=link, inter=link)
    db = profile_layers(build_layers(desc), input_names=desc.input_names, micro_batches=(1, 2), repeats=2,
                        make_inputs=lambda b: make_batch(desc, b, seed=0)[0], model_name="mmt", hardware=hardware)
    db.save(out / "mmt_costs.json")
    cases = [{**c, "cost_db": str(out / "mmt_costs.json")} if c["partition"] == "graphpipe" else c for c in CASES]
    (out / "cases.json").write_text(json.dumps(cases))
    result = launch(WORLD, WORKER, str(out / "cases.json"), str(out), timeout=240, log_dir=out / "logs")
    assert result.ok, result.report()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_paper_model_trains_like_the_single_device_model(trained, case):
    ranks = [torch.load(trained / f"{case['id']}.rank{r}.pt") for r in range(WORLD)]
    losses, state = _reference(case)
    seen = set()
    for r, res in enumerate(ranks):
        assert res["losses"] == pytest.approx(losses, rel=1e-5), f"rank {r} (stage {res['stage']})"
        for name, value in res["state"].items():
            torch.testing.assert_close(value, state[name], rtol=1e-5, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == set(state), "every parameter lives on exactly one stage"
    assert sorted(res["stage"] for res in ranks) == list(range(WORLD))
    if case["model"] != "sequential_transformer":  # branches run on parallel stages: not a chain
        edges = ranks[0]["stage_edges"]
        assert len(edges) >= WORLD - 1
        assert edges != [(s, s + 1) for s in range(WORLD - 1)], edges


@pytest.mark.parametrize("name", ["mmt", "dlrm", "candle_uno", "sequential_transformer"])
@pytest.mark.parametrize("granularity", ["layer", "sublayer"])
def test_torch_layers_match_their_descriptions(name, granularity):
    desc = tiny(name, granularity=granularity)
    model = GraphModel(build_layers(desc), input_names=desc.input_names)
    assert list(model.graph.names) == [layer.name for layer in desc.layers]
    assert sum(p.numel() for p in model.parameters()) == desc.num_params
    inputs, labels = make_batch(desc, 3, seed=0)
    for x, spec in zip(inputs, desc.input_shapes):
        assert tuple(x.shape) == (3, *spec.shape) and str(x.dtype) == f"torch.{spec.dtype}"
    loss = loss_fn(desc)(model(*inputs), labels)
    assert loss.ndim == 0 and torch.isfinite(loss)


@pytest.mark.parametrize("name", ["mmt", "sequential_transformer"])
def test_sublayer_granularity_computes_the_same_function_as_layer_granularity(name):
    layer_model = GraphModel(build_layers(tiny(name)), input_names=tiny(name).input_names)
    sub = tiny(name, granularity="sublayer")
    sub_model = GraphModel(build_layers(sub), input_names=sub.input_names)
    # layers.b0_l1.attn.attn.in_proj_weight -> layers.b0_l1_attn.attn.in_proj_weight
    renamed = {re.sub(r"^layers\.(\w+?)\.(ln1|attn|ln2|mlp)\.", r"layers.\1_\2.", k): v
               for k, v in layer_model.state_dict().items()}
    sub_model.load_state_dict(renamed)
    inputs, _ = make_batch(sub, 3, seed=1)
    torch.testing.assert_close(sub_model(*inputs), layer_model(*inputs))
