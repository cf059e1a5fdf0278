"""Worker: save a checkpoint under one layout, load it under another, keep training.

``python ckpt_cases.py SCENARIOS.json OUT_DIR``. Each scenario is ``{"id", "before": case,
"after": case, "via_graph_model": bool, "resave": bool, "world_before": n, "world_after": n}``
(cases as in ``train_cases.py``; worlds default to 4). A launch of ``w`` ranks runs, for each
scenario, the parts that run on ``w`` ranks:

* before (``world_before == w``): train steps 0-1 under ``before``, save; writes
  ``OUT_DIR/<id>.before.rank<r>.pt`` (the losses). With ``via_graph_model``, rank 0 then loads the
  checkpoint into a ``GraphModel``, trains step 2 on one process and writes it back;
* after (``world_after == w``): build ``after``, load, (with ``resave``: save again at once, under
  the new layout, as tag ``t2_resaved``), train the remaining steps up to 3; writes
  ``OUT_DIR/<id>.after.rank<r>.pt``.

So a scenario whose layouts need different world sizes runs in two launches, before then after.
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn

from gpp_deepspeed import GraphModel
from models import MODELS, make_batches
from train_cases import build, train

import deepspeed


def single_device_step(ckpt, case, step, dp):
    """Rank 0: GraphModel + torch optimizer from the pipeline checkpoint, one step, written back."""
    mc = MODELS[case["model"]]()
    model = GraphModel(mc.layers, input_names=mc.input_names)
    opt = torch.optim.SGD(model.parameters(), lr=case["lr"], momentum=case.get("momentum", 0.9))
    counters = model.load_pipeline_checkpoint(ckpt, optimizer=opt)
    opt.zero_grad()
    total, m = 0.0, case["gas"]
    for r in range(dp):
        for x, y in make_batches(mc, step=step, dp_rank=r, micro_batches=m, micro_batch_size=case["mbs"]):
            loss = nn.CrossEntropyLoss()(model(*(x if isinstance(x, tuple) else (x, ))), y)
            (loss / (m * dp)).backward()
            total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), case.get("clip", 1.0))
    opt.step()
    model.save_pipeline_checkpoint(ckpt, "from_graph_model", optimizer=opt,
                                   global_steps=counters.get("global_steps", 0) + 1)
    return total / (m * dp)


def replicas(case, world_size):
    return world_size // sum(case.get("degrees") or [1] * case["stages"])


def run_before(scenario, out, rank, world_size):
    ckpt = str(out / f"ckpt_{scenario['id']}")
    before = scenario["before"]
    _, _, engine = build(before, world_size)
    result = {"before": train(engine, MODELS[before["model"]](), before, range(2))}
    engine.save_checkpoint(ckpt, tag="t2")
    engine.destroy()
    if scenario.get("via_graph_model"):
        if rank == 0:
            result["graph_model"] = single_device_step(ckpt, before, 2, replicas(before, world_size))
        torch.distributed.barrier()
    torch.save(result, out / f"{scenario['id']}.before.rank{rank}.pt")


def run_after(scenario, out, rank, world_size):
    ckpt = str(out / f"ckpt_{scenario['id']}")
    after = scenario["after"]
    mc, module, engine = build(after, world_size)
    engine.load_checkpoint(ckpt, tag="from_graph_model" if scenario.get("via_graph_model") else "t2")
    result = {"global_steps": engine.global_steps, "stage": engine.stage_id}
    if scenario.get("resave"):
        engine.save_checkpoint(ckpt, tag="t2_resaved")
    result["after"] = train(engine, mc, after, range(3 if scenario.get("via_graph_model") else 2, 4))
    engine.destroy()
    torch.save(result, out / f"{scenario['id']}.after.rank{rank}.pt")


def main():
    scenarios = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for scenario in scenarios:
        for part, world in ((run_before, scenario.get("world_before", 4)), (run_after, scenario.get("world_after", 4))):
            if world == world_size:
                part(scenario, out, rank, world_size)
                torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
