"""Train GraphPipe's CANDLE-Uno as a DAG of pipeline stages, and check it exactly.

Launch (4 local ranks; on CPU they use gloo, on GPUs nccl)::

    deepspeed --num_gpus 4 examples/candle_uno.py --deepspeed_config configs/candle_uno.json
    deepspeed --num_gpus 8 examples/candle_uno.py --deepspeed_config configs/candle_uno.json \\
        --size paper --branches 16

The model is ``gpp_deepspeed.models.candle_uno`` (GraphPipe, arXiv 2406.17145, A.2): one feature
input per branch, each through its own chain of feed-forward layers, concatenated, a top
feed-forward chain and a one-output regression head (mean squared error). ``--branches`` sets
the number of branches (A.2: 7; Fig. 7 sweeps 2, 4, 8, 16). ``--size tiny`` is the CPU preset
``tiny("candle_uno")`` (2 layers per branch, width 16); ``--size paper`` is A.2's 4 layers of 4096
per branch.

After training at the tiny size, rank 0 trains the single-device twin (``GraphModel``: same
layers, same initial weights) on the same micro-batches with plain PyTorch, prints whether the
losses are EQUAL, and exits with status 1 if they DIFFER.
"""

import argparse
import time

import deepspeed
import torch

import gpp_deepspeed
from twin import check_against_single_device
from gpp_deepspeed import GraphModel, GraphPipelineModule
from gpp_deepspeed.models import build_layers, candle_uno, loss_fn, make_batch, tiny

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--size", choices=["tiny", "paper"], default="tiny")
parser.add_argument("--branches", type=int, default=7, help="feature branches (A.2: 7)")
parser.add_argument("--steps", type=int, default=6, help="training steps (batches)")
parser.add_argument("--stages", type=int, default=None, help="pipeline stages (default: the world size)")
parser.add_argument("--partition", default="parameters",
                    help='partition_method: "parameters", "uniform", "sequential", "graphpipe" or a plan .json')
parser.add_argument("--cost_db", default=None, help='cost database JSON for --partition graphpipe ("gpp profile")')
parser.add_argument("--local_rank", type=int, default=-1)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
config = gpp_deepspeed.load_config(args.deepspeed_config)  # the parsed JSON

# -- the model: a description (sizes and edges), then the layer list the runtime trains -------
desc = tiny("candle_uno", branches=args.branches) if args.size == "tiny" else candle_uno(branches=args.branches)
model = GraphPipelineModule(build_layers(desc), input_names=desc.input_names, num_stages=args.stages or world,
                            loss_fn=loss_fn(desc), partition_method=args.partition, cost_db=args.cost_db)
engine, _, _, _ = gpp_deepspeed.initialize(args=args, model=model,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
print(f"rank {rank}: stage {engine.stage_id} runs {list(model.local_layer_names())}", flush=True)

# -- training: every rank draws the same micro-batches; each stage uses the inputs it owns ----
gas, mbs = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()


def micro_batches(step):
    return [make_batch(desc, mbs, seed=1000 * step + k) for k in range(gas)]


losses, times = [], []
for step in range(args.steps):
    data = micro_batches(step)
    start = time.perf_counter()
    loss = engine.train_batch(data_iter=iter(data)).item()
    times.append(time.perf_counter() - start)
    losses.append(loss)
    if rank == 0:
        print(f"step {step}: loss {loss:.5f}  {engine.train_batch_size() / times[-1]:.1f} samples/s", flush=True)

# -- the check: the same model on one process, plain PyTorch, same micro-batches --------------
if rank == 0 and args.size == "tiny":
    twin = GraphModel(build_layers(desc), input_names=desc.input_names)
    check_against_single_device(twin, loss_fn(desc), micro_batches, losses, config)
if rank == 0:
    steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    print(f"median step time after warm-up: {steady * 1000:.1f} ms "
          f"({engine.train_batch_size() / steady:.1f} samples/s)", flush=True)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
