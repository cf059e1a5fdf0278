"""Saving and loading portable checkpoints from the engine (file layout: :mod:`gpp_deepspeed.checkpoint`).

``save_extras`` runs after DeepSpeed's ``save_checkpoint``: it adds each layer's optimizer state
(when the optimizer is a torch optimizer over the module's parameters), the layout and the
engine's counters. ``load_checkpoint`` hands a checkpoint saved under this very layout to
DeepSpeed unchanged; under another layout (partition, stage count, data-parallel degree, or a
``GraphModel`` export), it loads every local layer from its named file, refreshes the optimizer's
fp32 copies from them, and restores the counters, the learning-rate scheduler and, where it was
saved per layer, the optimizer state. DeepSpeed's own ``mp_rank_*`` and ZeRO files are not read
then: they hold one stage's or one replica's flat buffers, which mean nothing under another layout.
"""

from __future__ import annotations

import os
import shutil

import torch
from deepspeed import comm as dist
from deepspeed.utils import logger

from ..checkpoint import (LR_SCHEDULER_FILE, commit_tag, latest_tag, layer_optim_file, load_optimizer_state_by_name,
                          optimizer_state_by_name, read_layout, staging_tag, write_latest, write_layout)

__all__ = ["current_layout", "save_checkpoint", "save_extras", "load_checkpoint", "per_layer_optimizer"]


def current_layout(engine) -> dict:
    # The same on every rank: with per-stage degrees each stage has its own data-parallel size.
    placement = engine.module.placement
    degrees = placement.degrees
    data_parallel = placement.replicas if set(degrees) == {1} else [n * placement.replicas for n in degrees]
    return {"stage_of": dict(engine.module.partition.stage_of), "num_stages": engine.num_stages,
            "data_parallel": data_parallel}


def per_layer_optimizer(engine) -> torch.optim.Optimizer | None:
    """The optimizer if it keeps state per parameter of the module (a torch optimizer: ZeRO-0
    without bf16/fp16), else None (ZeRO and DeepSpeed's bf16 optimizer keep flat buffers)."""
    opt = engine.optimizer
    if opt is None or engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled():
        return None
    return opt if isinstance(opt, torch.optim.Optimizer) else None


def _local_layers(engine):
    module = engine.module
    for entry, fn in zip(module._local_entries, module.forward_funcs):
        if isinstance(fn, torch.nn.Module):
            yield entry.name, fn


def save_checkpoint(engine, save_dir: str, tag: str, *, save_latest: bool, ds_save) -> bool:
    """Write a checkpoint so that a rank stopped mid-save loses nothing: every rank writes into
    ``<tag>.partial`` (``ds_save(staging_tag)``, DeepSpeed's save without its ``latest``, then
    :func:`save_extras`), and only once all have written (a barrier) is the folder renamed to
    ``<tag>`` and ``latest`` pointed at it. DeepSpeed 0.19.8 writes ``latest`` on global rank 0
    before its final barrier, so a rank that died or froze writing its files left ``latest`` naming a
    partial checkpoint; here ``latest`` keeps naming the last complete one.

    ``ds_save(tag)`` is DeepSpeed's ``save_checkpoint`` with ``save_latest=False``. A decoupled
    checkpoint engine (DeepSpeed's asynchronous saves) commits later, on its own: it is left to it.
    """
    if engine.checkpoint_engine.is_decoupled():
        logger.warning("save_checkpoint with a decoupled checkpoint engine: DeepSpeed commits it (and writes "
                       "'latest') itself, so a rank lost mid-save may leave 'latest' naming a partial checkpoint")
        out = ds_save(tag, save_latest)
        save_extras(engine, save_dir, tag)
        return out
    staging = staging_tag(tag)
    # The rank DeepSpeed lets create folders: one per node with node-local storage, else global rank 0.
    writer = (engine.local_rank if engine.use_node_local_storage() else engine.global_rank) == 0
    if writer:   # what a save stopped earlier left; DeepSpeed's first barrier follows before anyone writes
        shutil.rmtree(os.path.join(save_dir, staging), ignore_errors=True)
    out = ds_save(staging, False)
    save_extras(engine, save_dir, staging)   # ends with a barrier: every rank's files are written
    if writer:
        commit_tag(save_dir, tag)
    dist.barrier()
    if save_latest and engine.global_rank == 0:
        write_latest(save_dir, tag)
    dist.barrier()
    return out


def save_extras(engine, save_dir: str, tag: str) -> None:
    """Write the per-layer optimizer state, the layout and the counters next to DeepSpeed's files."""
    ckpt_dir = os.path.join(save_dir, str(tag))
    opt = per_layer_optimizer(engine)
    if opt is not None and engine.grid.data_parallel_id == 0:
        for name, layer in _local_layers(engine):
            torch.save(optimizer_state_by_name(opt, layer), layer_optim_file(ckpt_dir, name))
    if engine.global_rank == 0:
        write_layout(ckpt_dir, **current_layout(engine),
                     counters={"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                               "skipped_steps": engine.skipped_steps})
        if engine.lr_scheduler is not None:
            torch.save(engine.lr_scheduler.state_dict(), os.path.join(ckpt_dir, LR_SCHEDULER_FILE))
    dist.barrier()


def load_checkpoint(engine, load_dir: str, tag: str | None, *, ds_load, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_strict: bool = True, **kwargs):
    """``engine.load_checkpoint``; ``ds_load`` is DeepSpeed's, used when the layout is unchanged."""
    tag = tag if tag is not None else latest_tag(load_dir)
    layout = read_layout(os.path.join(load_dir, str(tag))) if tag is not None else None
    if layout is None or {k: layout[k] for k in current_layout(engine)} == current_layout(engine):
        return ds_load(load_dir, tag, load_optimizer_states=load_optimizer_states,
                       load_lr_scheduler_states=load_lr_scheduler_states, load_module_strict=load_module_strict,
                       **kwargs)
    return _load_relaid(engine, os.path.join(load_dir, str(tag)), layout, load_optimizer_states=load_optimizer_states,
                        load_lr_scheduler_states=load_lr_scheduler_states, strict=load_module_strict)


def _load_relaid(engine, ckpt_dir: str, layout: dict, *, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                 strict: bool):
    engine.module.load_state_dir(ckpt_dir, checkpoint_engine=engine.checkpoint_engine, strict=strict)
    opt = engine.optimizer
    if opt is not None and hasattr(opt, "_restore_from_bit16_weights"):    # ZeRO: fp32 partitions from weights
        opt._restore_from_bit16_weights()
    elif opt is not None and hasattr(opt, "refresh_fp32_params"):          # bf16 optimizer
        opt.refresh_fp32_params()
    counters = layout.get("counters", {})
    engine.global_steps = counters.get("global_steps", 0)
    engine.global_samples = counters.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = counters.get("skipped_steps", 0)
    sched = os.path.join(ckpt_dir, LR_SCHEDULER_FILE)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and os.path.isfile(sched):
        engine.lr_scheduler.load_state_dict(torch.load(sched, weights_only=False))
    if load_optimizer_states:
        _load_layer_optimizer_states(engine, ckpt_dir)
    return ckpt_dir, {}


def _load_layer_optimizer_states(engine, ckpt_dir: str) -> None:
    opt = per_layer_optimizer(engine)
    missing = []
    for name, layer in _local_layers(engine):
        path = layer_optim_file(ckpt_dir, name)
        if opt is not None and os.path.isfile(path):
            load_optimizer_state_by_name(opt, layer, torch.load(path, weights_only=False))
        elif any(p.requires_grad for p in layer.parameters()):
            missing.append(name)
    if missing and engine.global_rank == engine.grid.stage_to_global(engine.stage_id, data=0):
        why = ("this run's optimizer keeps flat buffers (ZeRO or bf16), not per-layer state"
               if opt is None else "the checkpoint has no per-layer optimizer state for them")
        logger.warning(f"checkpoint {ckpt_dir} was saved under another layout; the optimizer state of layers "
                       f"{missing[:6]}{'...' if len(missing) > 6 else ''} starts fresh: {why}")
