"""Worker: train a tiny model and report this rank's DeepSpeed shm file along the way.

``python shm_worker.py OUT_DIR [--die-after-initialize RANK]``: writes ``OUT_DIR/rank<r>.json``
with whether the file existed after ``init_distributed`` and after ``gpp_deepspeed.initialize``,
then trains one batch. With ``--die-after-initialize R``, rank R kills itself (SIGKILL, so no
exit handler runs) right after initialize, while its peers go on training.
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

import deepspeed
import gpp_deepspeed
from gpp_deepspeed import GraphLayerSpec, GraphPipelineModule
from gpp_deepspeed.engine.shm import own_shm_path


def main():
    out = Path(sys.argv[1])
    die = int(sys.argv[3]) if len(sys.argv) > 3 else None
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    path = own_shm_path()
    seen = {"path": str(path), "after_init_distributed": path is not None and path.exists()}
    layers = [GraphLayerSpec("a", nn.Linear, 4, 4, inputs=["x"]), GraphLayerSpec("b", nn.Linear, 4, 2, inputs=["a"])]
    module = GraphPipelineModule(layers, input_names=["x"], num_stages=2, loss_fn=nn.CrossEntropyLoss())
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "graph_pipeline": {"print_stage_graph": False}}
    engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=config)
    seen["after_initialize"] = path is not None and path.exists()
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    if rank == die:
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 4, generator=g), torch.randint(0, 2, (2, ), generator=g)) for _ in range(2)]
    engine.train_batch(data_iter=iter(batches))   # with a dead peer: blocks until the launcher kills it
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
