"""Restarting on the ranks that are left: what a checkpoint carries besides weights and optimizer
state, so that a run started on another world picks up where the last complete checkpoint was.

Glossary:

* **world**: the ranks of one launch (under torch elastic, one rendezvous round); a restart after a
  lost node is a new world, usually smaller, with a new plan (``partition_method="graphpipe"``
  plans for the ranks present, :mod:`gpp_deepspeed.partitioning`);
* **data position**: ``engine.global_samples``, the samples of the data's global order consumed so
  far. Batches take consecutive samples of that order: a step of ``B = b x gas x replicas`` samples
  takes samples ``[k B, (k + 1) B)``, replica ``r`` of ``R`` those at ``r, r + R, ...`` (an
  unshuffled ``DistributedSampler``, DeepSpeed's and :func:`.data.stage_loader`'s). So whatever the
  world, the consumed samples are exactly the first ``global_samples``, and a new world resumes at
  the next one: ``training_data=`` by itself (:class:`~.data.ResumingSampler`), a data iterator of one's own
  by starting at ``engine.global_samples`` after ``load_checkpoint``;
* **RNG state**: each rank's generators (torch's CPU and current accelerator device, Python's
  ``random``, NumPy's), saved per rank under a key that names what the rank runs: its stage's
  layers, its replica and its index in its stage. A rank of the new layout with the same key
  (same layers, same replica, same index) gets that state; the others keep their own, as
  :func:`load_rng` says once.

Representative signatures::

    save_rng(engine, ckpt_dir)                   # every rank, after DeepSpeed's files
    restore(engine, ckpt_dir, counters, relaid)  # every rank, at load: RNG, loss scale, data position
    data.ResumingSampler(dataset_len, num_replicas=R, rank=r, start=k)   # in .data: the loader uses it
    check_elastic_launch(global_rank)            # at start-up: a torchrun launch that cannot restart
"""

from __future__ import annotations

import hashlib
import os
import random

import numpy as np
import torch
from deepspeed.utils import logger

from .data import stage_loader

__all__ = ["save_rng", "load_rng", "restore", "loss_scale", "rng_file", "check_elastic_launch"]


def check_elastic_launch(global_rank: int) -> None:
    """Warn (global rank 0) when torch elastic may restart this job on a store that a lost node
    took with it. With the store shared with the workers (torchrun's default), torch 2.13 rebuilds
    the workers' store address only on the agent that becomes group rank 0 of the next round; the
    others hand their new workers the old one, and if the node that served it is the one lost, they
    wait in ``init_process_group`` until its timeout."""
    env = os.environ
    if (global_rank == 0 and env.get("TORCHELASTIC_RUN_ID") and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
            and env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"):
        logger.warning("torchrun shares its rendezvous store with the workers: if the node serving it is lost, the "
                       "restarted workers of the other nodes wait for it in init_process_group (torch 2.13). Launch "
                       "torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/faults.md)")


def _rank_key(engine) -> str:
    """What this rank runs, in a file name: its stage's layers (hashed), replica and index."""
    layers = ",".join(sorted(engine.module.local_layer_names()))
    digest = hashlib.sha1(layers.encode()).hexdigest()[:16]
    tp_idx = getattr(engine.grid, "tp_idx", 0)   # TP ranks of one row shard hold their own RNG streams
    return f"{digest}_r{engine.grid.replica_id}_i{engine.grid.stage_idx}" + (f"_t{tp_idx}" if tp_idx else "")


def rng_file(ckpt_dir: str, key: str) -> str:
    return os.path.join(ckpt_dir, f"graph_rng_{key}.pt")


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_rng(engine, ckpt_dir: str) -> None:
    """Write this rank's generators (every rank writes its own file; no communication)."""
    torch.save(_rng_state(), rng_file(ckpt_dir, _rank_key(engine)))


def load_rng(engine, ckpt_dir: str) -> bool:
    """Set this rank's generators from the saved rank that ran the same layers at the same replica
    and index; False (generators left alone) when the saved layout had none."""
    path = rng_file(ckpt_dir, _rank_key(engine))
    if not os.path.isfile(path):
        return False
    state = torch.load(path, weights_only=False)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    return True


def loss_scale(engine) -> float | None:
    """The fp16 loss scale (None without fp16): it lives in the optimizer, whose state does not
    move between layouts, so the layout file carries it."""
    if not engine.fp16_enabled():
        return None
    scale = getattr(engine.optimizer, "cur_scale", None)
    return float(scale) if scale is not None else None


def restore(engine, ckpt_dir: str, counters: dict, *, relaid: bool) -> None:
    """After a checkpoint's weights and optimizer state are in: each rank's RNG, the loss scale
    (under another layout; DeepSpeed's loader restores it otherwise) and the data position of
    ``training_data=``. Collective: every rank says whether its RNG moved, and global rank 0 says
    once what did not."""
    moved = load_rng(engine, ckpt_dir)
    scale = counters.get("loss_scale")
    if relaid and scale is not None and engine.fp16_enabled() and hasattr(engine.optimizer, "cur_scale"):
        engine.optimizer.cur_scale = scale
    _resume_training_data(engine)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, moved)
    fresh = [r for r, ok in enumerate(everyone) if not ok]
    if fresh and engine.global_rank == 0:
        logger.warning(f"checkpoint {ckpt_dir}: global ranks {fresh[:8]}{'...' if len(fresh) > 8 else ''} run "
                       "layers, replicas or indices no rank of the saved layout ran, so they keep their own RNG "
                       "state (dropout and other random layers draw other numbers than an uninterrupted run)")


def _resume_training_data(engine) -> None:
    """``training_data=``: the loader of every rank that reads batches starts at the next unseen
    sample (``engine.global_samples`` in the data's global order, see the module docstring)."""
    if engine.training_data is None or not (engine.is_first_stage() or engine.is_last_stage()):
        return
    engine.set_dataloader(stage_loader(engine, engine.training_data, start=engine.global_samples))
