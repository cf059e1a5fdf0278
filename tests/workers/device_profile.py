"""Worker of tests/test_device_profile.py: GraphPipelineModule(partition_method="graphpipe") with a
DeviceProfile on every rank (mode ``profiled``) or priced by parameters (``proxy``); writes the
partition and the measured costs of this rank to ``OUT_DIR/<mode>.rank<r>``.

    python device_profile.py OUT_DIR MODE [MODE ...]   # each mode in turn, in one launch
"""

import json
import sys
import time

import deepspeed
import torch
from torch import nn

from gpp_deepspeed import GraphLayerSpec, GraphPipelineModule
from gpp_deepspeed.partitioning import DeviceProfile

SLEEP_S = 0.02


class Slow(nn.Module):
    """Few parameters, much time: a linear layer whose forward sleeps."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(SLEEP_S)
        return self.lin(x)


class Add(nn.Module):
    def forward(self, *xs):
        return sum(xs)


LAYERS = [GraphLayerSpec("slow", Slow, inputs=["x"]),
          GraphLayerSpec("p", nn.Linear, 4, 4, inputs=["x"]),            # 20 parameters, fast
          GraphLayerSpec("q1", nn.Linear, 4, 256, inputs=["x"]),         # many parameters, fast
          GraphLayerSpec("q2", nn.Linear, 256, 4, inputs=["q1"]),
          GraphLayerSpec("head", Add, inputs=["slow", "p", "q2"])]


def run(out: str, profiled: bool) -> None:
    cost_db = DeviceProfile(make_inputs=lambda b: torch.randn(b, 4), micro_batches=(1, 2), repeats=2) if profiled else None
    module = GraphPipelineModule(LAYERS, input_names=("x",), num_stages=2, loss_fn=nn.MSELoss(),
                                 partition_method="graphpipe", cost_db=cost_db)
    rank = torch.distributed.get_rank()
    db = module.measured_costs
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump({"stage_of": dict(module.partition.stage_of), "costs": None if db is None else db.to_json()}, f)


def main(out_dir: str, modes: list[str]) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    for mode in modes:
        run(f"{out_dir}/{mode}", mode == "profiled")
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
