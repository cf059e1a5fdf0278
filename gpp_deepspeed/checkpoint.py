"""Portable checkpoints: one file per layer, keyed by the layer's name.

DeepSpeed's ``PipelineModule`` writes ``layer_<index>-model_states.pt`` per layer, numbered in list
order. The graph pipeline renumbers layers stage by stage, so those numbers depend on the
partition. Here a layer's file is named by the layer (``layer_<name>-model_states.pt``), so a
checkpoint written under one partition, stage count or data-parallel degree loads under another,
and into the single-device :class:`~gpp_deepspeed.GraphModel` (and back).

Files of a checkpoint ``<dir>/<tag>/``, besides DeepSpeed's own (``mp_rank_XX_model_states.pt``,
ZeRO's ``*_optim_states.pt``):

``layer_<name>-model_states.pt``
    the layer's ``state_dict()`` (DeepSpeed's per-layer format, written by DeepSpeed's
    ``save_state_dict``);
``layer_<name>-optim_states.pt``
    ``{param name in the layer: optimizer state}``, whatever optimizer wrote it (a torch
    optimizer, DeepSpeed's bf16 optimizer, ZeRO-1/2/3): each state tensor whole, in the
    parameter's shape (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``), ``step`` the number of
    updates the parameter has had (an int), and ``"fp32"`` the fp32 master weight when the model's
    weights are lower precision (bf16). ZeRO and the bf16 optimizer hold these in flat partitions
    per data-parallel rank; the engine gathers each parameter's whole state with DeepSpeed's
    tensor-fragment API to write them and scatters them back under the new layout
    (:mod:`gpp_deepspeed.engine.portable`);
``graph_layout.json``
    the layout it was saved under (``stage_of``, ``num_stages``, ``data_parallel``, ``zero_stage``,
    ``bf16``) and the engine's counters (``global_steps``, ``global_samples``, ``skipped_steps``,
    and ``loss_scale`` under fp16);
``graph_lr_scheduler.pt``
    the learning-rate scheduler's state, if there is one;
``graph_rng_<key>.pt``
    one rank's RNG states, ``<key>`` naming what it ran (its stage's layers, replica and index:
    :mod:`gpp_deepspeed.engine.elastic`).

A plain DeepSpeed layer list checkpointed by ``PipelineModule`` has numbered files only; a layer
without a named file is read from ``layer_<index>`` (its position in the list).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
from typing import Any

import torch

__all__ = ["LAYOUT_FILE", "LR_SCHEDULER_FILE", "layer_model_file", "layer_model_files", "layer_optim_file",
           "read_layout", "write_layout", "latest_tag", "optimizer_state_by_name", "load_optimizer_state_by_name",
           "load_master_weights_by_name", "step_value", "MASTER_KEY",
           "save_graph_model", "load_graph_model", "staging_tag", "commit_tag", "write_latest"]

LAYOUT_FILE = "graph_layout.json"
MASTER_KEY = "fp32"   # a parameter's fp32 master weight in its optimizer state file (DeepSpeed's universal name)
LR_SCHEDULER_FILE = "graph_lr_scheduler.pt"
STAGING_SUFFIX = ".partial"   # a checkpoint being written: never named by ``latest``
_REPLACED_SUFFIX = ".replaced"


def layer_model_file(ckpt_dir: str, name: str, rank_repr: str = "") -> str:
    """The model-state file of layer ``name`` (``rank_repr`` as DeepSpeed's tensor-parallel suffix).

    >>> layer_model_file("ck/t1", "text_proj")
    'ck/t1/layer_text_proj-model_states.pt'
    """
    _check_name(name)
    return os.path.join(ckpt_dir, f"layer_{name}" + (f"-{rank_repr}" if rank_repr else "") + "-model_states.pt")


def layer_model_files(ckpt_dir: str, name: str, *, index: int | None = None) -> list[str]:
    """Files holding layer ``name``'s state: its named file(s), else DeepSpeed's numbered
    ``layer_<index:02d>`` files (a checkpoint written by ``PipelineModule``)."""
    _check_name(name)
    pattern = re.compile(rf"layer_{re.escape(name)}(-[a-z]+_\d+)*-model_states\.pt")
    named = sorted(p for p in glob.glob(os.path.join(glob.escape(ckpt_dir), f"layer_{glob.escape(name)}-*"))
                   if pattern.fullmatch(os.path.basename(p)))
    if named or index is None:
        return named
    return sorted(glob.glob(os.path.join(glob.escape(ckpt_dir), f"layer_{index:02d}-*model_states.pt")))


def layer_optim_file(ckpt_dir: str, name: str) -> str:
    _check_name(name)
    return os.path.join(ckpt_dir, f"layer_{name}-optim_states.pt")


def _check_name(name: str) -> None:
    if os.sep in name or name in ("", ".", ".."):
        raise ValueError(f'layer name "{name}" cannot name a checkpoint file; rename the layer')


def write_layout(ckpt_dir: str, *, counters: dict[str, int], **layout: Any) -> None:
    """Write ``graph_layout.json``: the ``layout`` (``stage_of``, ``num_stages``, ...) and ``counters``."""
    os.makedirs(ckpt_dir, exist_ok=True)
    with open(os.path.join(ckpt_dir, LAYOUT_FILE), "w") as f:
        json.dump({**layout, "counters": counters}, f, indent=1)


def read_layout(ckpt_dir: str) -> dict[str, Any] | None:
    """The layout a checkpoint was written under, or None (a checkpoint DeepSpeed alone wrote)."""
    path = os.path.join(ckpt_dir, LAYOUT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def latest_tag(load_dir: str) -> str | None:
    """The tag DeepSpeed's ``latest`` file names, or None."""
    path = os.path.join(load_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def staging_tag(tag: str) -> str:
    """The folder name a checkpoint is written under until every rank has written its files.

    >>> staging_tag("global_step8")
    'global_step8.partial'
    """
    return f"{tag}{STAGING_SUFFIX}"


def commit_tag(save_dir: str, tag: str) -> str:
    """Move a fully written checkpoint from its staging folder to ``save_dir/tag`` (replacing an
    earlier checkpoint of the same tag); returns the folder. Two renames on one file system: a
    process stopped in between leaves the old or the new checkpoint under a name ``latest`` may
    name, never a partial one (at worst, re-saving the tag ``latest`` names, none under that tag)."""
    final = os.path.join(save_dir, str(tag))
    replaced = final + _REPLACED_SUFFIX
    shutil.rmtree(replaced, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, replaced)
    os.rename(os.path.join(save_dir, staging_tag(tag)), final)
    shutil.rmtree(replaced, ignore_errors=True)
    return final


def write_latest(save_dir: str, tag: str) -> None:
    """Point DeepSpeed's ``latest`` file at ``tag``, atomically (a reader sees the old or the new
    name, never a half-written one)."""
    path = os.path.join(save_dir, "latest")
    with open(path + ".tmp", "w") as f:
        f.write(str(tag))
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, module: torch.nn.Module, *,
                            step_of=None) -> dict[str, dict]:
    """``{param name in module: a copy of optimizer.state[param]}`` for the params that have state,
    in the portable form: tensors on the CPU, ``step`` a Python int (``step_of(param)`` instead of
    the parameter's own count where the optimizer counts steps per group)."""
    out = {}
    for name, p in module.named_parameters():
        state = optimizer.state.get(p)
        if state:
            copy = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in state.items()}
            if "step" in copy:
                copy["step"] = int(step_of(p) if step_of is not None else copy["step"])
            out[name] = copy
    return out


def step_value(optimizer: torch.optim.Optimizer, step: int):
    """``step`` as ``optimizer`` keeps it: a float32 0-dim tensor for torch's optimizers (what
    ``torch.optim.Optimizer.load_state_dict`` makes of it; Adam increments it in place), else an int.

    >>> step_value(torch.optim.Adam([torch.zeros(1, requires_grad=True)]), 3)
    tensor(3.)
    """
    if type(optimizer).__module__.startswith("torch.optim"):
        return torch.tensor(float(step), dtype=torch.float32)
    return int(step)


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                                 states: dict[str, dict]) -> None:
    """Put ``states`` (from :func:`optimizer_state_by_name`) back on ``module``'s parameters.

    A saved fp32 master weight (``"fp32"``, see :data:`MASTER_KEY`) is not optimizer state: see
    :func:`load_master_weights_by_name`."""
    params = dict(module.named_parameters())
    for name, state in states.items():
        p = params[name]
        optimizer.state[p] = {k: step_value(optimizer, v) if k == "step" else v.to(p.device) if torch.is_tensor(v) else v
                              for k, v in state.items() if k != MASTER_KEY}


def load_master_weights_by_name(module: torch.nn.Module, states: dict[str, dict]) -> None:
    """Copy the saved fp32 master weights into ``module``'s fp32 parameters (a run in bf16 saved
    them; its model files hold the weights rounded to bf16)."""
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, state in states.items():
            if MASTER_KEY in state and params[name].dtype == torch.float32:
                params[name].copy_(state[MASTER_KEY].view_as(params[name]))


def _graph_model_layers(model):
    """``(list index, name, module)`` of a GraphModel's layers that hold state, in list order."""
    for i, entry in enumerate(model.entries):
        key = entry.tie_key
        module = model.tied[key] if key is not None else model.layers[entry.name] if entry.name in model.layers else None
        if module is not None:
            yield i, entry.name, module


def save_graph_model(model, save_dir: str, tag: str, *, optimizer: torch.optim.Optimizer | None = None,
                     global_steps: int = 0) -> str:
    """Write ``model`` (a GraphModel) as a pipeline checkpoint ``save_dir/tag`` that
    ``engine.load_checkpoint`` reads under any partition; returns the checkpoint folder."""
    ckpt_dir = os.path.join(save_dir, str(tag))
    os.makedirs(ckpt_dir, exist_ok=True)
    for _, name, module in _graph_model_layers(model):
        torch.save(module.state_dict(), layer_model_file(ckpt_dir, name))
        if optimizer is not None:
            torch.save(optimizer_state_by_name(optimizer, module), layer_optim_file(ckpt_dir, name))
    write_layout(ckpt_dir, stage_of={e.name: 0 for e in model.entries}, num_stages=1, data_parallel=1,
                 counters={"global_steps": global_steps})
    write_latest(save_dir, str(tag))
    return ckpt_dir


def load_graph_model(model, load_dir: str, tag: str | None = None, *,
                     optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Load a pipeline checkpoint (any layout, or DeepSpeed's numbered layer files) into ``model``
    (a GraphModel), and the per-layer optimizer state into ``optimizer`` where it was saved;
    returns the engine's counters (``global_steps``, ...) when the checkpoint has them."""
    tag = tag if tag is not None else latest_tag(load_dir)
    if tag is None:
        raise FileNotFoundError(f"{load_dir} has no 'latest' file: pass tag=")
    ckpt_dir = os.path.join(load_dir, str(tag))
    for index, name, module in _graph_model_layers(model):
        files = layer_model_files(ckpt_dir, name, index=index)
        if not files:
            raise FileNotFoundError(f'checkpoint {ckpt_dir} has no file for layer "{name}"')
        if len(files) > 1:
            raise ValueError(f'layer "{name}" is split over {len(files)} tensor-parallel files in {ckpt_dir}; '
                             "GraphModel reads unsplit layers only")
        module.load_state_dict(torch.load(files[0], map_location="cpu", weights_only=False))
        optim = layer_optim_file(ckpt_dir, name)
        if os.path.isfile(optim):
            states = torch.load(optim, weights_only=False)
            load_master_weights_by_name(module, states)
            if optimizer is not None:
                load_optimizer_state_by_name(optimizer, module, states)
    layout = read_layout(ckpt_dir)
    return dict(layout.get("counters", {})) if layout else {}
