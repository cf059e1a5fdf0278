"""Worker: save a checkpoint under one layout, load it under another, keep training.

``python ckpt_cases.py SCENARIOS.json OUT_DIR``. Each scenario is ``{"id", "before": case,
"after": case, "via_graph_model": bool}`` (cases as in ``train_cases.py``): train steps 0-1 under
``before``, save, then (optionally: rank 0 loads the checkpoint into a ``GraphModel``, trains step 2
on one process and writes it back as a checkpoint) build ``after``, load, train the remaining steps
up to 3. Writes ``OUT_DIR/<id>.rank<r>.pt`` with the losses of both parts.
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


def run(scenario, out, rank, world_size):
    ckpt = str(out / f"ckpt_{scenario['id']}")
    before, after = scenario["before"], scenario["after"]
    _, _, engine = build(before, world_size)
    result = {"before": train(engine, MODELS[before["model"]](), before, range(2))}
    engine.save_checkpoint(ckpt, tag="t2")
    engine.destroy()
    resume = 2
    if scenario.get("via_graph_model"):
        if rank == 0:
            result["graph_model"] = single_device_step(ckpt, before, 2, world_size // before["stages"])
        torch.distributed.barrier()
        resume = 3
    mc, module, engine = build(after, world_size)
    engine.load_checkpoint(ckpt)
    result["global_steps"] = engine.global_steps
    result["after"] = train(engine, mc, after, range(resume, 4))
    result["stage"] = engine.stage_id
    engine.destroy()
    torch.save(result, out / f"{scenario['id']}.rank{rank}.pt")


def main():
    scenarios = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for scenario in scenarios:
        run(scenario, out, rank, world_size)
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
