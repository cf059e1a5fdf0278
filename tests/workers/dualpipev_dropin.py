"""Worker: train DeepSpeed's DualPipeVModule with DeepSpeed's DualPipeVEngine or with
gpp_deepspeed.initialize (the drop-in), or check its conversion in one process.

Run by ``tests/dist.py``: ``python dualpipev_dropin.py MODE OUT_DIR`` with MODE ``deepspeed``,
``ours`` (rank 0 writes ``OUT_DIR/<mode>.pt``: the per-step losses) or ``single`` (one rank:
``OUT_DIR/single.pt`` with the loss of DualPipeVModule's two phases and of the converted chain).
"""

import sys
from pathlib import Path

import torch
from torch import nn

import deepspeed
from deepspeed.pipe import LayerSpec
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

import gpp_deepspeed
from gpp_deepspeed.engine.dualpipev import convert_dualpipev

WIDTH, MICRO_BATCH, MICRO_BATCHES, STEPS, LR, BASE_SEED = 8, 2, 4, 3, 0.1, 1234


def layer_specs():
    """Eight layers: four Linear+Tanh pairs (what the test's single-device reference builds)."""
    return [spec for _ in range(4) for spec in (LayerSpec(nn.Linear, WIDTH, WIDTH), LayerSpec(nn.Tanh))]


def batches(step):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(MICRO_BATCH, WIDTH, generator=g), torch.randn(MICRO_BATCH, WIDTH, generator=g))
            for _ in range(MICRO_BATCHES)]


def config():
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": MICRO_BATCHES,
            "train_batch_size": MICRO_BATCH * MICRO_BATCHES, "gradient_clipping": 0.0, "steps_per_print": 10**6}


def build(num_ranks):
    return DualPipeVModule(layers=layer_specs(), num_stages=num_ranks, loss_fn=nn.MSELoss(), partition_method="uniform",
                           seed_layers=True, base_seed=BASE_SEED)


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def main():
    mode, out = sys.argv[1], Path(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = build(world)
    if mode == "single":
        conversion = convert_dualpipev(model)
        x, y = batches(0)[0]
        model.activate_phase(0)
        h = model(x)
        model.activate_phase(1)
        theirs = model.loss_fn(model(h), y)
        for layer in conversion.layers:
            x = layer(x)
        torch.save({"deepspeed": theirs.item(), "converted": conversion.module_kwargs["loss_fn"](x, y).item(),
                    "stage_of": conversion.stage_of,
                    "fold": conversion.fold, "graph_pipeline": conversion.graph_pipeline,
                    "built": [isinstance(layer, nn.Module) for layer in conversion.layers]}, out / "single.pt")
        return
    if mode == "deepspeed":
        engine, *_ = deepspeed.initialize(model=model, optimizer=sgd, config=config())
    else:
        engine, *_ = gpp_deepspeed.initialize(model=model, optimizer=sgd, config=config())
    losses = [engine.train_batch(iter(batches(step))).item() for step in range(STEPS)]
    if rank == 0:
        torch.save({"losses": losses, "engine": type(engine).__name__}, out / f"{mode}.pt")


if __name__ == "__main__":
    main()
