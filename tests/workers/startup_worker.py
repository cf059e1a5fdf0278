"""Worker: what a start does before training, checked on real processes.

``python startup_worker.py MODE OUT_DIR``:

``lock``
    ``deepspeed.init_distributed`` (which loads DeepSpeed's shm op) with a build lock already in
    ``TORCH_EXTENSIONS_DIR`` (the test points it at a temporary folder): writes the error it raised,
    and after how long, to ``OUT_DIR/lock.json``.
``rng``
    seeds torch, builds a ``GraphPipelineModule`` (``seed_layers`` off, then on) and an engine, and
    writes the draws that follow each next to the draws the same seed gives without building
    (``OUT_DIR/rng.rank<r>.pt``).
``file_store``
    runs on a ``file://`` process group (as DeepSpeed's own test harness does) while MASTER_ADDR and
    MASTER_PORT point at another job's store: two training steps, then writes what the watchdog
    talks to and the keys it left (``OUT_DIR/file_store.rank<r>.json``).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import deepspeed
import gpp_deepspeed
from gpp_deepspeed import GraphLayerSpec, GraphPipelineModule


def layers():
    return [GraphLayerSpec("a", nn.Linear, 4, 8, inputs=["x"]), GraphLayerSpec("b", nn.Dropout, 0.5, inputs=["a"]),
            GraphLayerSpec("c", nn.Linear, 8, 3, inputs=["b"])]


def config():
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "graph_pipeline": {"print_stage_graph": False, "heartbeat_s": 0.2}}


def lock(out: Path) -> None:
    start = time.monotonic()
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        result = {"error": None}
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["seconds"] = time.monotonic() - start
    (out / "lock.json").write_text(json.dumps(result))


def rng(out: Path) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    result = {}
    for seed_layers in (False, True):
        torch.manual_seed(7)
        module = GraphPipelineModule(layers(), input_names=["x"], num_stages=torch.distributed.get_world_size(),
                                     loss_fn=nn.CrossEntropyLoss(), partition_method="uniform", seed_layers=seed_layers)
        result[f"after_module_seed_layers_{seed_layers}"] = torch.rand(4)
        torch.manual_seed(8)
        gpp_deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=config())
        result[f"after_initialize_seed_layers_{seed_layers}"] = torch.rand(4)
    torch.manual_seed(7)
    result["seed_7"] = torch.rand(4)
    torch.manual_seed(8)
    result["seed_8"] = torch.rand(4)
    torch.save(result, out / f"rng.rank{rank}.pt")


def file_store(out: Path) -> None:
    deepspeed.init_distributed(dist_backend="gloo", init_method=f"file://{out / 'pg_file'}",
                               rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = torch.distributed.get_rank()
    module = GraphPipelineModule(layers(), input_names=["x"], num_stages=torch.distributed.get_world_size(),
                                 loss_fn=nn.CrossEntropyLoss(), partition_method="uniform")
    engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=config())
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        engine.train_batch(iter([(torch.randn(2, 4, generator=g), torch.randint(0, 3, (2, ), generator=g))
                                 for _ in range(2)]))
    time.sleep(1.0)   # several heartbeats
    watchdog = engine.watchdog
    client = watchdog._connect()
    result = {"where": watchdog.info.where, "job": watchdog.job,
              "beats": {r: client.get(f"beat/{r}").decode() for r in range(torch.distributed.get_world_size())}}
    (out / f"file_store.rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    {"lock": lock, "rng": rng, "file_store": file_store}[mode](out)
