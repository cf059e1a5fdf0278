"""Capture an ordinary two-branch nn.Module with torch.fx and train it as a DAG of pipeline stages.

Launch (2 local CPU processes, gloo)::

    deepspeed --num_gpus 2 examples/captured_model.py --deepspeed_config configs/example.json

``TwoBranch`` below is written as any PyTorch model is: submodules in ``__init__`` and glue in
``forward`` (``torch.cat``, a learned scale, slicing). ``capture`` turns it into a layer list: each
top-level child becomes a layer (a deep copy with the same weights) and the glue becomes small
function layers. With 2 stages the partitioner puts one branch on stage 0 and the other with the
fusion glue and head on stage 1, so the two branches run concurrently.

After training, rank 0 trains the original module (not the captured copy) on one process on the
same micro-batches with plain PyTorch, and prints whether the losses match.
"""

import argparse
import time

import torch
from torch import nn

import deepspeed
import gpp_deepspeed
from gpp_deepspeed import GraphPipelineModule
from gpp_deepspeed.frontend import capture

TEXT, IMAGE, HIDDEN, SEQ, CLASSES, STEPS = 24, 32, 32, 8, 5, 8


class Branch(nn.Module):
    """Projection, a transformer encoder layer (dropout off) and mean pooling over the sequence."""

    def __init__(self, features):
        super().__init__()
        self.proj = nn.Linear(features, HIDDEN)
        self.encoder = nn.TransformerEncoderLayer(HIDDEN, nhead=4, dim_feedforward=2 * HIDDEN, dropout=0.0,
                                                  batch_first=True)

    def forward(self, x):  # [batch, seq, features] -> [batch, HIDDEN]
        return self.encoder(self.proj(x)).mean(dim=1)


class TwoBranch(nn.Module):
    """A text and an image branch, fused by glue code in forward, then classified."""

    def __init__(self):
        super().__init__()
        self.text_branch = Branch(TEXT)
        self.image_branch = Branch(IMAGE)
        self.image_scale = nn.Parameter(torch.ones(HIDDEN))
        self.head = nn.Sequential(nn.Linear(2 * HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES))

    def forward(self, text, image):
        t, i = self.text_branch(text), self.image_branch(image) * self.image_scale
        return self.head(torch.cat([t, i], dim=-1))


def micro_batches(step, count, size):
    """Synthetic data whose label depends on both branches, the same on every rank."""
    g = torch.Generator().manual_seed(step)
    batches = []
    for _ in range(count):
        text, image = torch.randn(size, SEQ, TEXT, generator=g), torch.randn(size, SEQ, IMAGE, generator=g)
        score = text[..., :CLASSES].mean(dim=1) + image[..., :CLASSES].mean(dim=1)
        batches.append(((text, image), score.argmax(dim=-1)))
    return batches


def single_device_losses(model, config, steps):
    """The reference: the original module on one process, trained with plain PyTorch."""
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

    torch.manual_seed(0)  # every rank builds the same weights, so every rank captures the same model
    original = TwoBranch()
    captured = capture(original)
    if rank == 0:
        for spec in captured.layers:
            print(f"layer {spec.name:<14} <- {', '.join(spec.inputs):<28} {type(spec.module).__name__}")
    model = GraphPipelineModule(captured.layers, input_names=captured.input_names, output=captured.output,
                                num_stages=2, loss_fn=nn.CrossEntropyLoss(), partition_method="parameters")
    engine, _, _, _ = gpp_deepspeed.initialize(args=args, model=model,
                                               model_parameters=[p for p in model.parameters() if p.requires_grad])
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
        reference = single_device_losses(original, config, STEPS)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        same = worst <= 1e-5
        print(f"original module losses on one device: {[round(x, 5) for x in reference]}")
        print(f"pipelined losses {'EQUAL' if same else 'DIFFER FROM'} the original module's "
              f"(max relative difference {worst:.2e})", flush=True)
        steady = sorted(times[1:])[len(times[1:]) // 2]
        print(f"median step time after warm-up: {steady * 1000:.1f} ms ({batch / steady:.1f} samples/s)")
        if not same:
            raise SystemExit(1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
