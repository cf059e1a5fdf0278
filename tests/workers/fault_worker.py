"""Worker: train a 4-stage pipeline while one rank dies or freezes (and one is merely slow).

``python fault_worker.py OUT_DIR --victim R --how kill|stop --at-step K [--slow-rank Q --slow-step J]
[--save-at-step S] [--watchdog-timeout T] [--background]``

Every rank prints ``rank <r> step <k>`` after each step. At step ``K`` rank ``R`` writes the wall
time to ``OUT_DIR/failed_at`` and sends itself SIGKILL (dies) or SIGSTOP (freezes: the process
stays, its heartbeat thread too). Before that, rank ``Q``'s data iterator spends two watchdog
timeouts in a pure-Python loop at step ``J``: slow but alive, it must not be taken for dead. Run
under ``tests/dist.py``, the ``deepspeed`` launcher or ``mpiexec`` (ranks from the environment).

With ``--save-at-step S`` every rank saves a checkpoint ``OUT_DIR/ckpt`` (tag ``step<S>``) after
step ``S`` and writes its stage's parameters to ``OUT_DIR/state.rank<r>.pt``; at step ``K`` every
rank saves again (tag ``step<K>``), and the victim dies or freezes in the middle of that save, as it
writes its first file (with ``--background``, in the writer thread while the main thread trains on).
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

import deepspeed
import gpp_deepspeed
from gpp_deepspeed import GraphLayerSpec, GraphPipelineModule

WATCHDOG_TIMEOUT_S = 15.0   # generous: this shared test machine runs at load averages over 50
STEPS = 60


def slow_batches(batches, seconds):
    """The data loader of a slow rank: busy (holding the GIL between switches) before its batch."""
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1
    yield from batches


def layer_list():
    layers = [GraphLayerSpec("l0", nn.Linear, 8, 16, inputs=["x"])]
    layers += [GraphLayerSpec(f"l{i}", nn.Linear, 16, 16, inputs=[f"l{i - 1}"]) for i in range(1, 4)]
    return layers + [GraphLayerSpec("head", nn.Linear, 16, 3, inputs=["l3"])]


def stop_in_first_write(engine, out, sig):
    """Make this rank die or freeze as it writes the first file of its next checkpoint (in the
    background writer's thread, while training goes on, with ``checkpoint_in_background``)."""
    from gpp_deepspeed.engine import background

    owner, name = (background, "_write") if engine.gpp_config.checkpoint_in_background else \
        (engine.checkpoint_engine, "save")
    save = getattr(owner, name)

    def failing_save(*args, **kwargs):
        Path(out, "failed_at").write_text(repr(time.time()))
        os.kill(os.getpid(), sig)
        return save(*args, **kwargs)

    setattr(owner, name, failing_save)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--victim", type=int, required=True)
    parser.add_argument("--how", choices=["kill", "stop"], required=True)
    parser.add_argument("--at-step", type=int, default=4)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-step", type=int, default=1)
    parser.add_argument("--save-at-step", type=int, default=-1)
    parser.add_argument("--watchdog-timeout", type=float, default=WATCHDOG_TIMEOUT_S)
    parser.add_argument("--background", action="store_true", help="graph_pipeline.checkpoint_in_background")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    module = GraphPipelineModule(layer_list(), input_names=["x"], num_stages=4, loss_fn=nn.CrossEntropyLoss(),
                                 partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "steps_per_print": 10**6,
              "graph_pipeline": {"print_stage_graph": False, "watchdog_timeout_s": args.watchdog_timeout,
                                 "heartbeat_s": 0.5, "p2p_timeout_s": 900,
                                 "checkpoint_in_background": args.background}}
    engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=config)
    g = torch.Generator().manual_seed(0)
    fail = signal.SIGKILL if args.how == "kill" else signal.SIGSTOP
    for step in range(STEPS):
        if args.save_at_step >= 0 and step == args.at_step:
            if rank == args.victim:
                stop_in_first_write(engine, Path(args.out), fail)
            engine.save_checkpoint(str(Path(args.out, "ckpt")), tag=f"step{step}")
        elif rank == args.victim and step == args.at_step:
            Path(args.out, "failed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), fail)
        batches = [(torch.randn(2, 8, generator=g), torch.randint(0, 3, (2, ), generator=g)) for _ in range(4)]
        data = iter(batches)
        if rank == args.slow_rank and step == args.slow_step:
            data = slow_batches(batches, 2 * args.watchdog_timeout)
        engine.train_batch(data_iter=data)
        print(f"rank {rank} step {step}", flush=True)
        if step == args.save_at_step:
            engine.save_checkpoint(str(Path(args.out, "ckpt")), tag=f"step{step}")
            torch.save(module.graph_state_dict(), Path(args.out, f"state.rank{rank}.pt"))
        time.sleep(0.5)   # a run long enough that only the watchdog ends it in time
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
