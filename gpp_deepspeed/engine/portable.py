"""Saving and loading portable checkpoints from the engine (file layout: :mod:`gpp_deepspeed.checkpoint`).

``save_extras`` runs after DeepSpeed's ``save_checkpoint``: it adds each layer's optimizer state,
the layout and the engine's counters. ``load_checkpoint`` hands a checkpoint saved under this very
layout to DeepSpeed unchanged; under another layout (partition, stage count, stage degrees, ZeRO
stage, bf16, or a ``GraphModel`` export), it loads every local layer from its named file, the
optimizer state of every local parameter from its layer's optimizer file, and the counters and the
learning-rate scheduler. DeepSpeed's own ``mp_rank_*`` and ZeRO files are not read then: they hold
one stage's or one replica's flat buffers, which mean nothing under another layout.

Optimizer state per parameter, whatever holds it:

* a torch optimizer (ZeRO-0 in fp32) keeps it per parameter already. DeepSpeed's ``FusedAdam``
  (its ``"Adam"`` without ``torch_adam``) counts steps once per parameter group: each update adds
  one to the ``step`` of the group's last parameter with a gradient and applies that count to every
  parameter of the group, whose own ``step`` stays where it started. Saved as they are, the counts
  of all but one parameter were wrong, and a relayout that made another parameter last restarted
  Adam's bias correction (the next-but-one loss off by 4e-3 relative on ``four_branch``, 3.6e-5 on
  the issue's model); the group's count is written for each of its parameters, and on loading every
  parameter of a group gets the group's count;
* ZeRO-1/2 and DeepSpeed's bf16 optimizer keep fp32 master weights and state in one flat partition
  per group and data-parallel rank. Saving gathers each parameter's whole state
  (``safe_get_full_optimizer_state``, ``safe_get_full_fp32_param``: all-reduces over the stage's
  data-parallel group, so every rank of the stage takes part and its first rank writes); loading
  creates the flat state if the optimizer has not stepped yet and scatters each parameter's state
  into this rank's fragment (``safe_set_full_*``, local). The step count is the base optimizer's,
  one per group.
"""

from __future__ import annotations

import os
import shutil

import torch
from deepspeed import comm as dist
from deepspeed.ops.adam import FusedAdam
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param,
                             safe_set_full_optimizer_state)
from deepspeed.utils import logger

from ..checkpoint import (LR_SCHEDULER_FILE, MASTER_KEY, latest_tag, layer_optim_file, load_master_weights_by_name,
                          load_optimizer_state_by_name, optimizer_state_by_name, read_layout, step_value,
                          write_layout, commit_tag, staging_tag, write_latest)
from ..errors import GPPError
from . import elastic
from .background import BackgroundCheckpointEngine
from .compat import base_optimizer, base_optimizer_state, flat_optimizer_groups, link_fragment_state

__all__ = ["current_layout", "save_checkpoint", "save_extras", "load_checkpoint", "layer_optimizer_states",
           "local_layers"]


def current_layout(engine) -> dict:
    # The same on every rank: with per-stage degrees each stage has its own data-parallel size.
    placement = engine.module.placement
    degrees = placement.dp   # row shards per stage (TP ranks share theirs)
    data_parallel = placement.replicas if set(degrees) == {1} else [n * placement.replicas for n in degrees]
    return {"stage_of": dict(engine.module.partition.stage_of), "num_stages": engine.num_stages,
            "data_parallel": data_parallel, "tp": list(placement.tp), "zero_stage": engine.zero_optimization_stage(),
            "bf16": bool(engine.bfloat16_enabled())}


def _torch_optimizer(engine) -> torch.optim.Optimizer | None:
    """The optimizer if it is a torch optimizer over the module's own parameters (ZeRO-0 without
    bf16/fp16), else None."""
    opt = engine.optimizer
    if opt is None or engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled():
        return None
    return opt if isinstance(opt, torch.optim.Optimizer) else None


def local_layers(engine):
    """``(name, layer module)`` of every layer this stage builds (glue without parameters included);
    a tied layer's module is its tie's, also where DeepSpeed's ``_build`` made the layer a function
    of it (a ``forward_fn``: a language model's head), so a rank that holds a tie through such a
    layer alone saves and loads the tie's optimizer state too."""
    module = engine.module
    for entry, fn in zip(module._local_entries, module.forward_funcs):
        layer = module.tied_modules[entry.tie_key] if entry.tie_key is not None else fn
        if isinstance(layer, torch.nn.Module):
            yield entry.name, layer


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
    background = _background_engine(engine)
    if background is not None:
        background.wait()   # one checkpoint in flight: this rank's writes of the previous one are done
    staging = staging_tag(tag)
    # The rank DeepSpeed lets create folders: one per node with node-local storage, else global rank 0.
    writer = (engine.local_rank if engine.use_node_local_storage() else engine.global_rank) == 0
    if writer:   # what a save stopped earlier left; DeepSpeed's first barrier follows before anyone writes
        shutil.rmtree(os.path.join(save_dir, staging), ignore_errors=True)
    out = ds_save(staging, False)
    save_extras(engine, save_dir, staging)   # ends with a barrier: every rank's files are written (or queued)
    if background is not None:   # each rank marks its files written; global rank 0 commits (background.py)
        background.finish(save_dir, tag, rank=engine.global_rank, world_size=dist.get_world_size(),
                          save_latest=save_latest)
        return out
    if writer:
        commit_tag(save_dir, tag)
    dist.barrier()
    if save_latest and engine.global_rank == 0:
        write_latest(save_dir, tag)
    dist.barrier()
    return out


def _background_engine(engine) -> BackgroundCheckpointEngine | None:
    """With ``graph_pipeline.checkpoint_in_background``, DeepSpeed's torch checkpoint engine wrapped
    to write on a thread (once; later saves reuse it); None otherwise, and with node-local storage
    (the commit reads every rank's marker from one file system)."""
    if isinstance(engine.checkpoint_engine, BackgroundCheckpointEngine):
        return engine.checkpoint_engine
    if not engine.gpp_config.checkpoint_in_background:
        return None
    if engine.use_node_local_storage() or not isinstance(engine.checkpoint_engine, TorchCheckpointEngine):
        if engine.global_rank == 0:
            logger.warning("graph_pipeline.checkpoint_in_background needs DeepSpeed's torch checkpoint engine on "
                           "storage every rank sees; checkpoints are written blocking")
        return None
    engine.checkpoint_engine = BackgroundCheckpointEngine(engine.checkpoint_engine)
    return engine.checkpoint_engine


def _group_steps(optimizer: torch.optim.Optimizer) -> dict[int, int] | None:
    """For an optimizer that counts steps per group (DeepSpeed's FusedAdam, see the module
    docstring): ``{id(param): its group's count}``; None for one that counts per parameter."""
    if not isinstance(optimizer, FusedAdam):
        return None
    steps = {}
    for group in optimizer.param_groups:
        counts = [int(optimizer.state[p]["step"]) for p in group["params"] if "step" in optimizer.state.get(p, {})]
        steps.update({id(p): max(counts, default=0) for p in group["params"]})
    return steps


def layer_optimizer_states(engine) -> dict[str, dict[str, dict]] | None:
    """``{layer name: {param name: whole state}}`` of this stage's layers, in the portable form of
    :func:`gpp_deepspeed.checkpoint.optimizer_state_by_name`; None if the optimizer is of a kind
    whose state does not move (fp16's optimizers, ZeRO-3 for now). Collective over the stage's
    data-parallel group for ZeRO and bf16."""
    torch_opt = _torch_optimizer(engine)
    if torch_opt is not None:
        steps = _group_steps(torch_opt)
        step_of = (lambda p: steps[id(p)]) if steps is not None else None
        return {name: optimizer_state_by_name(torch_opt, layer, step_of=step_of) for name, layer in local_layers(engine)}
    groups = flat_optimizer_groups(engine.optimizer)
    if groups is None:
        return None
    group_of = {id(p): g for g, (params, _) in enumerate(groups) for p in params}
    out = {}
    for name, layer in local_layers(engine):
        states = {}
        for pname, p in layer.named_parameters():
            if id(p) not in group_of:
                continue  # not trained
            flat = groups[group_of[id(p)]][1]
            base = base_optimizer_state(engine.optimizer, flat)
            state = {key: safe_get_full_optimizer_state(p, key).detach().cpu().clone()
                     for key in sorted(k for k, v in base.items() if torch.is_tensor(v) and v.shape == flat.shape)}
            if "step" in base:
                state["step"] = int(base["step"])
            if p.dtype != torch.float32:
                state[MASTER_KEY] = safe_get_full_fp32_param(p).detach().cpu().clone()
            states[pname] = state
        out[name] = states
    return out


def save_extras(engine, save_dir: str, tag: str) -> None:
    """Write the per-layer optimizer state, the layout and the counters next to DeepSpeed's files."""
    ckpt_dir = os.path.join(save_dir, str(tag))
    states = layer_optimizer_states(engine)
    # Under TP the layer files hold slices; a TP checkpoint loads under its own layout only (below).
    if states is not None and engine.grid.data_parallel_id == 0 and not engine.placement.has_tp:
        # fresh CPU copies already: a background engine writes them without another snapshot
        save = getattr(engine.checkpoint_engine, "save_owned", engine.checkpoint_engine.save)
        for name, layer_states in states.items():
            save(layer_states, layer_optim_file(ckpt_dir, name))
    elastic.save_rng(engine, ckpt_dir)
    if engine.global_rank == 0:
        counters = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                    "skipped_steps": engine.skipped_steps}
        scale = elastic.loss_scale(engine)
        if scale is not None:
            counters["loss_scale"] = scale
        write_layout(ckpt_dir, **current_layout(engine), counters=counters)
        if engine.lr_scheduler is not None:
            torch.save(engine.lr_scheduler.state_dict(), os.path.join(ckpt_dir, LR_SCHEDULER_FILE))
    dist.barrier()


def _same_layout(saved: dict, current: dict) -> bool:
    # A key a checkpoint predates (zero_stage, bf16) counts as unchanged: DeepSpeed's loader decides.
    return all(saved.get(k, v) == v for k, v in current.items())


def load_checkpoint(engine, load_dir: str, tag: str | None, *, ds_load, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_strict: bool = True, **kwargs):
    """``engine.load_checkpoint``; ``ds_load`` is DeepSpeed's, used when the layout is unchanged."""
    if isinstance(engine.checkpoint_engine, BackgroundCheckpointEngine):
        engine.checkpoint_engine.wait()   # this process's last checkpoint is written and committed
    tag = tag if tag is not None else latest_tag(load_dir)
    layout = read_layout(os.path.join(load_dir, str(tag))) if tag is not None else None
    if layout is None or _same_layout(layout, current_layout(engine)):
        out = ds_load(load_dir, tag, load_optimizer_states=load_optimizer_states,
                      load_lr_scheduler_states=load_lr_scheduler_states, load_module_strict=load_module_strict,
                      **kwargs)
    else:
        if any(t > 1 for t in (*layout.get("tp", ()), *engine.placement.tp)):
            raise GPPError(f"checkpoint {load_dir} (tag {tag}) was saved under another layout ({layout}) than this "
                           f"engine's ({current_layout(engine)}); with tensor parallelism a checkpoint loads only "
                           "under the layout (partition, stage degrees, TP degrees) it was saved with: rebuild the "
                           "module with that layout")
        out = _load_relaid(engine, os.path.join(load_dir, str(tag)), layout,
                           load_optimizer_states=load_optimizer_states,
                           load_lr_scheduler_states=load_lr_scheduler_states, strict=load_module_strict)
    if layout is not None and out[0] is not None:
        elastic.restore(engine, os.path.join(load_dir, str(tag)), layout.get("counters", {}),
                        relaid=not _same_layout(layout, current_layout(engine)))
    return out


def _load_relaid(engine, ckpt_dir: str, layout: dict, *, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                 strict: bool):
    engine.module.load_state_dir(ckpt_dir, checkpoint_engine=engine.checkpoint_engine, strict=strict)
    opt = engine.optimizer
    if opt is not None and hasattr(opt, "refresh_fp32_params"):   # ZeRO-1/2, bf16: fp32 partitions from weights
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
    layers = list(local_layers(engine))
    states = {name: torch.load(layer_optim_file(ckpt_dir, name), weights_only=False)
              for name, _ in layers if os.path.isfile(layer_optim_file(ckpt_dir, name))}
    missing = [name for name, layer in layers if name not in states and any(p.requires_grad for p in layer.parameters())]
    torch_opt = _torch_optimizer(engine)
    groups = flat_optimizer_groups(engine.optimizer)
    if torch_opt is not None:
        for name, layer in layers:
            if name in states:
                load_master_weights_by_name(layer, states[name])
                load_optimizer_state_by_name(torch_opt, layer, states[name])
        steps = _group_steps(torch_opt)
        if steps is not None:  # every parameter of a FusedAdam group carries the group's count
            for group in torch_opt.param_groups:
                for p in group["params"]:
                    if "step" in torch_opt.state.get(p, {}):
                        torch_opt.state[p]["step"] = steps[id(p)]
    elif groups is not None:
        _scatter_flat_states(engine.optimizer, groups, layers, states)
    else:
        missing = [name for name, layer in layers if any(p.requires_grad for p in layer.parameters())]
    # Said once, on global rank 0, for every stage (a collective: every rank loads).
    why = ("this run's optimizer keeps state that does not move between layouts"
           if torch_opt is None and groups is None else "the checkpoint has no optimizer state for them")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(missing), why))
    fresh = sorted({name for names, _ in everyone for name in names})
    if fresh and engine.global_rank == 0:
        reasons = sorted({reason for names, reason in everyone if names})
        logger.warning(f"checkpoint {ckpt_dir} was saved under another layout; the optimizer state of layers "
                       f"{fresh[:6]}{'...' if len(fresh) > 6 else ''} starts fresh: {'; '.join(reasons)}")


def _scatter_flat_states(optimizer, groups, layers, states) -> None:
    """Put each parameter's saved state into this rank's fragment of its group's flat state."""
    group_of = {id(p): g for g, (params, _) in enumerate(groups) for p in params}
    saved: list[list[tuple[torch.Tensor, dict]]] = [[] for _ in groups]
    for name, layer in layers:
        for pname, p in layer.named_parameters():
            if id(p) in group_of and pname in states.get(name, {}):
                saved[group_of[id(p)]].append((p, states[name][pname]))
    linked = False
    for (_, flat), entries in zip(groups, saved):
        keys = sorted({k for _, st in entries for k, v in st.items() if torch.is_tensor(v) and k != MASTER_KEY})
        base = base_optimizer_state(optimizer, flat)
        for key in keys:
            if key not in base:   # the optimizer has not stepped yet: make the state it would make
                base[key] = torch.zeros_like(flat)
        steps = {st["step"] for _, st in entries if "step" in st}
        if steps:
            base["step"] = step_value(base_optimizer(optimizer), max(steps))
        linked = linked or bool(keys)
    if linked:
        link_fragment_state(optimizer)
    for entries in saved:
        for p, st in entries:
            for key, value in st.items():
                if key == MASTER_KEY:
                    safe_set_full_fp32_param(p, value.to(p.device))
                elif torch.is_tensor(value):
                    safe_set_full_optimizer_state(p, value.to(p.device), key)
