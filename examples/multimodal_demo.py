"""Train a 4-branch multi-modal transformer as a DAG of pipeline stages, and check it exactly.

Launch (4 local CPU processes, gloo; ``make demo`` runs this)::

    deepspeed --num_gpus 4 examples/multimodal_demo.py --deepspeed_config configs/example.json

Each modality (text, image, audio, video) has its own branch: a projection and two transformer
encoder layers over a short sequence, mean-pooled. The branches are concatenated and classified.
With 4 stages the partitioner puts three branches on stages of their own and the fourth with the
fusion head, so the stage graph is ``{0, 1, 2} -> 3``: depth 2 instead of a 4-deep chain.

After training, rank 0 trains the single-device twin (``GraphModel``: same layers, same initial
weights) on the same micro-batches with plain PyTorch and prints whether the losses match.
Dropout is 0 so that both runs compute the same function.
"""

import argparse
import time

import torch
from torch import nn

import deepspeed
import gpp_deepspeed
from gpp_deepspeed import GraphLayerSpec, GraphModel, GraphPipelineModule

MODALITIES = {"text": 24, "image": 32, "audio": 16, "video": 40}  # input feature size per token
HIDDEN, SEQ, CLASSES, STEPS = 32, 8, 5, 8
SIGNAL = 1.5  # how strongly each modality carries the class (noise has standard deviation 1)


class Encoder(nn.Module):
    """A transformer encoder layer with dropout off."""

    def __init__(self, dim):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=2 * dim, dropout=0.0, batch_first=True)

    def forward(self, x):  # x: [batch, seq, dim]
        return self.layer(x)


class MeanPool(nn.Module):
    def forward(self, x):  # [batch, seq, dim] -> [batch, dim]
        return x.mean(dim=1)


class Concat(nn.Module):
    def forward(self, *xs):
        return torch.cat(xs, dim=-1)


def layers():
    specs = []
    for name, features in MODALITIES.items():
        specs += [
            GraphLayerSpec(f"{name}_proj", nn.Linear, features, HIDDEN, inputs=[name]),
            GraphLayerSpec(f"{name}_enc1", Encoder, HIDDEN, inputs=[f"{name}_proj"]),
            GraphLayerSpec(f"{name}_enc2", Encoder, HIDDEN, inputs=[f"{name}_enc1"]),
            GraphLayerSpec(f"{name}_pool", MeanPool, inputs=[f"{name}_enc2"]),
        ]
    specs += [
        GraphLayerSpec("fuse", Concat, inputs=[f"{name}_pool" for name in MODALITIES]),
        GraphLayerSpec("head", nn.Linear, HIDDEN * len(MODALITIES), CLASSES, inputs=["fuse"]),
    ]
    return specs


def micro_batches(step, count, size):
    """A learnable synthetic task, the same on every rank: each sample's class is drawn first and
    every modality carries a noisy copy of it (``SIGNAL`` added to the class's feature in every
    token), so the class is, but for the noise, the argmax of those features summed over
    modalities: a fixed function of the inputs that the model can learn, and its loss falls."""
    g = torch.Generator().manual_seed(step)
    batches = []
    for _ in range(count):
        labels = torch.randint(0, CLASSES, (size, ), generator=g)
        signal = SIGNAL * nn.functional.one_hot(labels, CLASSES)[:, None, :]   # [batch, 1, CLASSES]
        xs = []
        for features in MODALITIES.values():
            x = torch.randn(size, SEQ, features, generator=g)
            x[..., :CLASSES] += signal
            xs.append(x)
        batches.append((tuple(xs), labels))
    return batches


def single_device_losses(config, steps):
    """The reference: the same DAG on one process, trained with plain PyTorch."""
    model = GraphModel(layers(), input_names=list(MODALITIES))
    params = config["optimizer"]["params"]
    opt = torch.optim.Adam(model.parameters(), lr=params["lr"])
    gas = config["gradient_accumulation_steps"]
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for xs, y in micro_batches(step, gas, config["train_micro_batch_size_per_gpu"]):
            loss = nn.functional.cross_entropy(model(*xs), y)
            (loss / gas).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config["gradient_clipping"])
        opt.step()
        losses.append(total / gas)
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    config = gpp_deepspeed.load_config(args.deepspeed_config)  # parsed JSON
    rank = torch.distributed.get_rank()

    model = GraphPipelineModule(layers(), input_names=list(MODALITIES), num_stages=4,
                                loss_fn=nn.CrossEntropyLoss(), partition_method="parameters")
    engine, _, _, _ = gpp_deepspeed.initialize(args=args, model=model,
                                               model_parameters=[p for p in model.parameters() if p.requires_grad])
    if rank == 0:
        print(f"rank {rank}: stage {engine.stage_id} runs {list(model.local_layer_names())}", flush=True)

    batch = engine.train_batch_size()
    losses, times = [], []
    for step in range(STEPS):
        data = micro_batches(step, engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu())
        start = time.perf_counter()
        loss = engine.train_batch(data_iter=iter(data)).item()
        times.append(time.perf_counter() - start)
        losses.append(loss)
        if rank == 0:
            print(f"step {step}: loss {loss:.5f}  {batch / times[-1]:.1f} samples/s", flush=True)

    if rank == 0:
        reference = single_device_losses(config, STEPS)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        same = worst <= 1e-5
        print(f"single-device GraphModel losses: {[round(x, 5) for x in reference]}")
        print(f"pipelined losses {'EQUAL' if same else 'DIFFER FROM'} the single-device run "
              f"(max relative difference {worst:.2e})", flush=True)
        print(f"the task is learnt: loss {losses[0]:.3f} at step 0, {losses[-1]:.3f} at step {len(losses) - 1}")
        steady = sorted(times[1:])[len(times[1:]) // 2]
        print(f"median step time after warm-up: {steady * 1000:.1f} ms ({batch / steady:.1f} samples/s)")
        if not same:
            raise SystemExit(1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
