"""Worker: train the paper's models (tiny presets) with the real runtime, one case after another.

Run by ``tests/test_models_train.py`` on every rank: ``python paper_models.py CASES.json OUT_DIR``.
Each case names a model of ``gpp_deepspeed.models.TINY``, a granularity, a stage count and a
partition method; every rank writes ``OUT_DIR/<id>.rank<r>.pt`` with its stage, per-step losses
and this stage's parameters (named as in GraphModel).
"""

import json
import sys
from pathlib import Path

import torch

import deepspeed
import gpp_deepspeed
from gpp_deepspeed import GraphPipelineModule
from gpp_deepspeed.models import build_layers, loss_fn, make_batch, tiny


def batches(desc, case, step):
    """The micro-batches of one step (one pipeline replica): seeded by step and index."""
    return [make_batch(desc, case["mbs"], seed=1000 * step + k) for k in range(case["gas"])]


def run_case(case, out, rank):
    desc = tiny(case["model"], granularity=case["granularity"])
    module = GraphPipelineModule(build_layers(desc), input_names=desc.input_names, num_stages=case["stages"],
                                 loss_fn=loss_fn(desc), partition_method=case["partition"],
                                 cost_db=case.get("cost_db"))
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=case["lr"], momentum=case["momentum"])
    config = {"train_micro_batch_size_per_gpu": case["mbs"], "gradient_accumulation_steps": case["gas"],
              "train_batch_size": case["mbs"] * case["gas"], "gradient_clipping": case["clip"],
              "steps_per_print": 10**6, "graph_pipeline": {"print_stage_graph": False}}
    engine, _, _, _ = gpp_deepspeed.initialize(model=module, optimizer=opt, model_parameters=params, config=config)
    losses = [engine.train_batch(data_iter=iter(batches(desc, case, step))).item() for step in range(case["steps"])]
    state = {k: v.detach().clone() for k, v in module.graph_state_dict().items()}
    edges = sorted((e.src, e.dst) for e in module.partition.stage_graph.edges)
    torch.save({"stage": engine.stage_id, "losses": losses, "state": state, "layers": module.local_layer_names(),
                "stage_edges": edges}, out / f"{case['id']}.rank{rank}.pt")


def main():
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    for case in cases:
        run_case(case, out, rank)
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
