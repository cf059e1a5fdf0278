"""The drop-in path: an unchanged DeepSpeed layer list of a GPT, trained by GraphPipelineModule.

Launch (4 local ranks; on CPU they use gloo, on GPUs nccl)::

    deepspeed --num_gpus 4 examples/gpt_dropin.py --deepspeed_config configs/gpt_dropin.json
    deepspeed --num_gpus 8 examples/gpt_dropin.py --deepspeed_config configs/gpt_dropin.json --size paper

``layers`` below is what a ``deepspeed.pipe.PipelineModule`` user already has: plain ``LayerSpec``
entries (token and position embedding, ``N`` pre-LN transformer blocks, final norm, LM head), each
taking the previous entry's output, with no names and no named inputs. ``GraphPipelineModule``
takes the same list with the same arguments (``num_stages``, ``loss_fn``, ``partition_method``):
each entry becomes a graph node ``layer<i>`` fed by ``layer<i-1>``, so the graph is a chain and
the stage graph is DeepSpeed's linear pipeline. Every entry is built under seed
``base_seed + i``, as ``PipelineModule(..., seed_layers=True)`` does.

After training at the tiny size, rank 0 trains the single-device twin (``GraphModel`` over the
same list: same initial weights) on the same micro-batches with plain PyTorch, prints whether
the losses are EQUAL, and exits with status 1 if they DIFFER. Dropout is 0 so both runs compute
the same function.
"""

import argparse
import time

import deepspeed
import torch
from deepspeed.pipe import LayerSpec
from torch import nn
from torch.nn import functional as F

import gpp_deepspeed
from twin import check_against_single_device
from gpp_deepspeed import GraphModel, GraphPipelineModule

SIZES = {  # tiny: seconds on a CPU; paper: GPT-2 medium's shape (24 layers, 1024 wide)
    "tiny": {"vocab": 64, "seq": 16, "dim": 32, "heads": 4, "blocks": 8},
    "paper": {"vocab": 50304, "seq": 1024, "dim": 1024, "heads": 16, "blocks": 24},
}


class Embedding(nn.Module):
    """Token plus learned position embedding: ids ``[batch, seq]`` int64 -> ``[batch, seq, dim]``."""

    def __init__(self, vocab, seq, dim):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    """A pre-LN GPT block with causal self-attention: ``[batch, seq, dim] -> [batch, seq, dim]``."""

    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=0.0, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        seq = x.shape[1]
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=x.device), diagonal=1)  # True: masked
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def lm_loss(logits, targets):  # logits [batch, seq, vocab], targets [batch, seq]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--size", choices=list(SIZES), default="tiny")
parser.add_argument("--steps", type=int, default=6, help="training steps (batches)")
parser.add_argument("--stages", type=int, default=None, help="pipeline stages (default: the world size)")
parser.add_argument("--partition", default="parameters",
                    help='partition_method: "parameters", "uniform", "type:Block", "graphpipe" or a plan .json')
parser.add_argument("--local_rank", type=int, default=-1)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
config = gpp_deepspeed.load_config(args.deepspeed_config)  # the parsed JSON
size = SIZES[args.size]

# -- the model: a plain DeepSpeed layer list, exactly as PipelineModule takes it --------------
layers = [
    LayerSpec(Embedding, size["vocab"], size["seq"], size["dim"]),
    *[LayerSpec(Block, size["dim"], size["heads"]) for _ in range(size["blocks"])],
    LayerSpec(nn.LayerNorm, size["dim"]),
    LayerSpec(nn.Linear, size["dim"], size["vocab"], bias=False),
]
model = GraphPipelineModule(layers, num_stages=args.stages or world, loss_fn=lm_loss,
                            partition_method=args.partition)
engine, _, _, _ = gpp_deepspeed.initialize(args=args, model=model,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
print(f"rank {rank}: stage {engine.stage_id} runs {list(model.local_layer_names())}", flush=True)

# -- training: (token ids, next-token targets) micro-batches, the same on every rank ----------
gas, mbs = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()


def micro_batches(step):
    g = torch.Generator().manual_seed(step)
    batches = []
    for _ in range(gas):
        tokens = torch.randint(0, size["vocab"], (mbs, size["seq"] + 1), generator=g)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


losses, times = [], []
for step in range(args.steps):
    data = micro_batches(step)
    start = time.perf_counter()
    loss = engine.train_batch(data_iter=iter(data)).item()
    times.append(time.perf_counter() - start)
    losses.append(loss)
    if rank == 0:
        print(f"step {step}: loss {loss:.5f}  {engine.train_batch_size() / times[-1]:.1f} samples/s", flush=True)

# -- the check: the same list on one process, plain PyTorch, same micro-batches ---------------
if rank == 0 and args.size == "tiny":
    check_against_single_device(GraphModel(layers), lm_loss, micro_batches, losses, config)
if rank == 0:
    steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    print(f"median step time after warm-up: {steady * 1000:.1f} ms "
          f"({engine.train_batch_size() / steady:.1f} samples/s)", flush=True)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
