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
    ``{param name in the layer: optimizer state}`` (``momentum_buffer``, ``exp_avg``, ``step``, ...),
    written when the optimizer is a torch optimizer over the module's own parameters (ZeRO-0 without
    bf16/fp16). ZeRO-1 and DeepSpeed's bf16 optimizer keep their state in flat buffers per
    data-parallel rank, not per layer: that state does not move to another layout;
``graph_layout.json``
    the layout it was saved under (``stage_of``, ``num_stages``, ``data_parallel``) and the
    engine's counters (``global_steps``, ``global_samples``, ``skipped_steps``);
``graph_lr_scheduler.pt``
    the learning-rate scheduler's state, if there is one.

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
           "save_graph_model", "load_graph_model", "staging_tag", "commit_tag", "write_latest"]

LAYOUT_FILE = "graph_layout.json"
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


def write_layout(ckpt_dir: str, *, stage_of: dict[str, int], num_stages: int, data_parallel: int,
                 counters: dict[str, int]) -> None:
    os.makedirs(ckpt_dir, exist_ok=True)
    with open(os.path.join(ckpt_dir, LAYOUT_FILE), "w") as f:
        json.dump({"stage_of": stage_of, "num_stages": num_stages, "data_parallel": data_parallel,
                   "counters": counters}, f, indent=1)


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


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict[str, dict]:
    """``{param name in module: a copy of optimizer.state[param]}`` for the params that have state."""
    out = {}
    for name, p in module.named_parameters():
        state = optimizer.state.get(p)
        if state:
            out[name] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}
    return out


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                                 states: dict[str, dict]) -> None:
    """Put ``states`` (from :func:`optimizer_state_by_name`) back on ``module``'s parameters."""
    params = dict(module.named_parameters())
    for name, state in states.items():
        p = params[name]
        optimizer.state[p] = {k: v.to(p.device) if torch.is_tensor(v) and v.dim() else v for k, v in state.items()}


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
        if optimizer is not None and os.path.isfile(optim):
            load_optimizer_state_by_name(optimizer, module, torch.load(optim, weights_only=False))
    layout = read_layout(ckpt_dir)
    return dict(layout.get("counters", {})) if layout else {}
