"""Worker of tests/test_device_profile.py: the start-up profile's links on 4 gloo ranks that
``LOCAL_SIZE=2`` makes two nodes of two; writes the cost database this rank assembled."""

import sys

import torch
import torch.distributed as dist
from torch import nn

from gpp_deepspeed import GraphLayerSpec
from gpp_deepspeed.partitioning import DeviceProfile
from gpp_deepspeed.profiler import profile_on_ranks


def main(out: str) -> None:
    dist.init_process_group("gloo")
    layers = [GraphLayerSpec("a", nn.Linear, 4, 4, inputs=["x"]), GraphLayerSpec("b", nn.Linear, 4, 4, inputs=["a"])]
    profile = DeviceProfile(make_inputs=lambda b: torch.randn(b, 4), micro_batches=(1,), repeats=1)
    db = profile_on_ranks(layers, input_names=["x"], profile=profile, device="cpu")
    with open(f"{out}.rank{dist.get_rank()}", "w") as f:
        f.write(db.to_json())
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
