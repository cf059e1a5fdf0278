"""Worker: train a DAG model on whatever world it finds, from the last checkpoint if there is one.

``python elastic_worker.py OUT --steps T --save-at S [--training-data] [--scheduler] [--load DIR]``

Every incarnation (a torch elastic restart, or a launch by hand) plans for the ranks present
(``partition_method="graphpipe"``), loads ``DIR`` (default ``OUT/ckpt``) if it has a ``latest``,
and trains until global step ``T``. The run that starts from nothing saves ``OUT/ckpt`` after step
``S``, writes ``OUT/saved``, and then trains slowly (a second per step): the test kills an agent
there. Written to ``OUT`` (``W`` the world size, JSON lines, appended):

* ``losses.jsonl``: ``{"world": W, "step": global step after the batch, "loss": ..., "t": wall time}``
  (global rank 0);
* ``seen.jsonl``: ``{"world": W, "step": global step of the batch, "idx": [sample indices]}``, from one
  rank per replica of the output stage: with ``--training-data`` the samples of the batches the
  engine's loader gave, else those of the batch this worker built from ``engine.global_samples``;
* ``who.jsonl``: ``{"world": W, "rank": r, "pid": ..., "agent": parent pid, "output": bool}``, each rank;
* ``lr.jsonl``: ``{"world": W, "step": ..., "lr": ...}`` with ``--scheduler`` (global rank 0).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import deepspeed
import gpp_deepspeed
from gpp_deepspeed import GraphPipelineModule

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from models import four_branch  # noqa: E402

# The micro-batch must be divisible by every stage degree a plan may choose (GPP_ELASTIC_MICRO_BATCH:
# 24 for the 12-rank benchmark, benchmarks/elastic_recovery.py); the epoch is 12 batches.
MICRO_BATCH, ACCUMULATION = int(os.environ.get("GPP_ELASTIC_MICRO_BATCH", "4")), 2
NUM_SAMPLES = 12 * MICRO_BATCH * ACCUMULATION


class Samples(torch.utils.data.Dataset):
    """Sample ``i`` is the same on every rank and in every world (its random features name it)."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(NUM_SAMPLES, 6, generator=g)
        self.y = torch.randint(0, 3, (NUM_SAMPLES, ), generator=g)
        self.index = {tuple(row.tolist()): i for i, row in enumerate(self.x)}

    def __len__(self):
        return NUM_SAMPLES

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def recording(batches, data, read):
    """The engine's data iterator, appending the indices of the samples of every batch to ``read``
    (the loader may read ahead in worker processes, so the batches are what counts)."""
    for x, y in batches:
        read.extend(data.index[tuple(row.tolist())] for row in x)
        yield x, y


def append(out, name, **record):
    with open(Path(out, name), "a") as f:
        f.write(json.dumps(record) + "\n")


def my_batches(engine, data):
    """This replica's micro-batches of the next step, from the data position ``global_samples``:
    the step takes samples ``[g, g + B)`` of the global order, replica ``r`` of ``R`` those at
    ``g + r + R j`` (as an unshuffled DistributedSampler deals them)."""
    start, replicas, r = engine.global_samples, engine.module.placement.replicas, engine.grid.replica_id
    idx = [(start + r + replicas * j) % NUM_SAMPLES for j in range(MICRO_BATCH * ACCUMULATION)]
    micro = [idx[k:k + MICRO_BATCH] for k in range(0, len(idx), MICRO_BATCH)]
    return idx, iter([(data.x[m], data.y[m]) for m in micro])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-at", type=int, required=True)
    parser.add_argument("--training-data", action="store_true")
    parser.add_argument("--scheduler", action="store_true")
    parser.add_argument("--load", default=None)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    case = four_branch()
    module = GraphPipelineModule(case.layers, input_names=case.input_names, loss_fn=nn.CrossEntropyLoss(),
                                 partition_method="graphpipe")
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": ACCUMULATION,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}, "steps_per_print": 10**6,
              "graph_pipeline": {"print_stage_graph": False, "watchdog_timeout_s": 4, "heartbeat_s": 0.5}}
    if args.scheduler:
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                              "warmup_num_steps": 10,
                                                              "warmup_type": "linear"}}
    data = Samples()
    engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=config,
                                          training_data=data if args.training_data else None)
    ckpt = Path(args.load or Path(args.out, "ckpt"))
    resumed = (ckpt / "latest").is_file()
    if resumed:
        engine.load_checkpoint(str(ckpt))
    logs = engine.is_last_stage() and engine.grid.stage_idx == 0
    read = []
    if args.training_data and logs:
        engine.data_iterator = recording(engine.data_iterator, data, read)
    append(args.out, "who.jsonl", world=world, rank=rank, pid=os.getpid(), agent=os.getppid(),
           output=engine.is_last_stage())
    while engine.global_steps < args.steps:
        step = engine.global_steps
        if args.training_data:
            read.clear()
            loss = engine.train_batch()
            idx = list(read)
        else:
            idx, batches = my_batches(engine, data)
            loss = engine.train_batch(data_iter=batches)
        if logs:
            append(args.out, "seen.jsonl", world=world, step=step, idx=idx)
        if rank == 0:
            append(args.out, "losses.jsonl", world=world, step=engine.global_steps, loss=float(loss), t=time.time())
            if args.scheduler:
                append(args.out, "lr.jsonl", world=world, step=engine.global_steps, lr=engine.get_lr()[0])
        if not resumed and engine.global_steps == args.save_at:
            engine.save_checkpoint(str(ckpt), tag=f"step{args.save_at}")
            if rank == 0:
                Path(args.out, "saved").write_text(repr(time.time()))
        if not resumed and engine.global_steps >= args.save_at:
            time.sleep(1.0)   # the test kills an agent now
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
