"""``save_pretrained``: a pipeline's weights as a Hugging Face directory, every stage its own shards.

The saving half of :mod:`gpp_deepspeed.frontend.pretrained`: collective (the ranks exchange the
names and sizes they wrote), so it lives beside the engine. The directory's format and the names of
its tensors are :mod:`gpp_deepspeed.frontend.hf`'s. ::

    save_pretrained(engine, out_path, captured)   # every rank calls it; stage leaders write
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import GPPConfigError
from ..frontend.hf import INDEX_FILE, checkpoint_name, local_state
from .module import GraphPipelineModule
from .tensor_parallel import gathered

__all__ = ["save_pretrained"]

_SHARD = "model-{idx:05d}-of-{num:05d}.safetensors"


def save_pretrained(engine_or_module, directory: str | os.PathLike, captured, *, max_shard_bytes: int = 5 * 2**30,
                    config: Any = None, peft: str | None = None) -> dict[str, Any]:
    """Write the pipeline's weights as a Hugging Face directory, every stage its own shards.

    Collective: every rank calls it. The first rank of each stage (of the first data-parallel
    replica; of a stage split over a TP group, after gathering each split tensor whole) writes that stage's tensors to shard files of at most ``max_shard_bytes`` straight from
    its parameters (no copy, no gathering); the ranks exchange only names and sizes, and rank 0
    writes ``model.safetensors.index.json`` and ``config.json`` (``config``, else the captured Hugging
    Face model's, with ``architectures`` set). A tied tensor is written once, under the name the
    model's ``_tied_weights_keys`` maps the others to, by the first stage that holds it, so
    ``AutoModelFor....from_pretrained(directory)`` loads the directory strictly and re-ties it.
    Returns ``{"files": this rank's files, "bytes": bytes it wrote, "seconds": its writing time}``.

    A capture of a PEFT model (``peft.get_peft_model``) says what to write with ``peft=``:
    ``"adapter"``, the adapters alone as ``PeftModel.save_pretrained`` writes them
    (``adapter_model.safetensors`` and ``adapter_config.json``, other adapters than ``"default"`` in a
    folder of their name), which ``PeftModel.from_pretrained(base, directory)`` loads; or
    ``"merged"``, the base model with each active adapter merged into its weight (what
    ``merge_and_unload()`` gives), which the base class's ``from_pretrained`` loads.
    """
    from safetensors.torch import save_file

    module = getattr(engine_or_module, "module", engine_or_module)
    if not isinstance(module, GraphPipelineModule):
        raise GPPConfigError(f"save_pretrained takes a GraphPipelineEngine or GraphPipelineModule, got "
                             f"{type(engine_or_module).__name__}")
    hf = captured.hf
    config = config if config is not None else (hf.config if hf is not None else None)
    if config is None:
        raise GPPConfigError("save_pretrained needs a Hugging Face config: the captured module holds no single "
                             "PreTrainedModel, so pass config=")
    if (hf is not None and hf.peft is not None) != (peft is not None) or peft not in (None, "adapter", "merged"):
        raise GPPConfigError(f"save_pretrained: peft={peft!r}; a capture of a PEFT model takes peft=\"adapter\" or "
                             f"\"merged\", any other capture none (this one {'has' if hf and hf.peft else 'has no'} "
                             "PEFT adapters)")
    start = time.perf_counter()
    directory = Path(directory)
    grid = module.mpu()   # the module's StageGrid (PipelineModule.mpu(), public)
    writes = grid.replica_id == 0 and grid.is_stage_leader()
    if peft == "adapter":
        return _save_adapters(module, directory, captured, writes, start)
    # A stage split over a TP group (tp > 1) writes whole tensors, so from_pretrained reads them:
    # the ranks of the first replica's TP group all-gather each split weight, its leader writes.
    tp_group = grid.get_slice_parallel_group() if grid.get_slice_parallel_world_size() > 1 else None
    with gathered(module) if tp_group is not None and grid.replica_id == 0 else contextlib.nullcontext():
        tensors = _stage_tensors(module, captured) if writes else {}
        if tp_group is not None:
            tensors = {n: t.clone() for n, t in tensors.items()}   # the shards come back on leaving
    shards = _shards(tensors, max_shard_bytes)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, len(shards))
    total = sum(counts)
    first = sum(counts[:dist.get_rank()])
    weight_map, files, written = {}, [], 0
    if writes:
        directory.mkdir(parents=True, exist_ok=True)
    for k, names in enumerate(shards):
        file = _SHARD.format(idx=first + k + 1, num=total)
        save_file({n: tensors[n] for n in names}, directory / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
        files.append(file)
        written += sum(tensors[n].numel() * tensors[n].element_size() for n in names)
    maps = [None] * dist.get_world_size()
    dist.all_gather_object(maps, (weight_map, written))
    if dist.get_rank() == 0:
        merged = {n: f for m, _ in maps for n, f in m.items()}
        directory.mkdir(parents=True, exist_ok=True)
        index = {"metadata": {"total_size": sum(b for _, b in maps)}, "weight_map": dict(sorted(merged.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        config = copy.deepcopy(config)
        if hf is not None:
            config.architectures = [hf.class_name]
        config.save_pretrained(directory)
    dist.barrier()
    return {"files": files, "bytes": written, "seconds": time.perf_counter() - start}


def _stage_tensors(module, captured) -> dict[str, torch.Tensor]:
    """This stage's tensors by checkpoint name: each tied tensor once under its canonical name, and
    not at all on a stage that holds a copy of another stage's tie (DeepSpeed's ``ds_pipe_replicated``)."""
    hf = captured.hf
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for spec, fn in zip((e.layer for e in module._local_entries), module.forward_funcs):
        key = getattr(spec, "key", None) if getattr(spec, "tied_weight_attr", None) is not None else None
        layer = module.tied_modules[key] if key is not None else fn
        if not isinstance(layer, nn.Module) or not hasattr(spec, "module_path"):
            continue
        merged = _merged_weights(layer) if hf is not None and hf.peft is not None else {}
        for local, t in local_state(layer, persistent_only=True).items():
            if id(t) in seen or getattr(t, "ds_pipe_replicated", False) or hf is not None and hf.is_adapter(
                    spec.module_path(local)):
                continue
            seen.add(id(t))
            t = merged.get(id(t), t)
            name = _canonical(captured, spec.module_path(local))
            if name is None:
                raise GPPConfigError(f'tensor "{spec.module_path(local)}" of layer "{spec.name}" is outside the '
                                     f"Hugging Face model (at \"{hf.prefix[:-1]}\"): a directory cannot hold it")
            out[name] = t.detach().contiguous()
    return out


def _merged_weights(layer: nn.Module) -> dict[int, torch.Tensor]:
    """``{id(base weight): base weight + its active adapters' deltas}`` for each LoRA layer of
    ``layer`` (PEFT's ``get_delta_weight``, what ``merge_and_unload()`` adds)."""
    out = {}
    with torch.no_grad():
        for sub in layer.modules():
            if callable(getattr(sub, "get_delta_weight", None)) and hasattr(sub, "base_layer"):
                weight = sub.base_layer.weight
                deltas = [sub.get_delta_weight(a) for a in sub.active_adapters if a in getattr(sub, "lora_A", {})]
                out[id(weight)] = weight + sum(deltas) if deltas else weight
    return out


def _save_adapters(module, directory: Path, captured, writes: bool, start: float) -> dict[str, Any]:
    """``PeftModel.save_pretrained`` for a pipeline: every stage leader sends its adapter tensors
    (small) to rank 0, which writes them by PEFT's own rules (``get_peft_model_state_dict``)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    hf = captured.hf
    mine = {}
    if writes:
        for spec, fn in zip((e.layer for e in module._local_entries), module.forward_funcs):
            if isinstance(fn, nn.Module) and hasattr(spec, "module_path"):
                for local, t in local_state(fn, persistent_only=True).items():
                    name = spec.module_path(local)
                    if hf.is_adapter(name):
                        mine[name[len(hf.peft_prefix):]] = t.detach().cpu().clone()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    files, written = [], 0
    if dist.get_rank() == 0:
        state = {k: v for part in gathered for k, v in part.items()}
        for adapter, peft_config in hf.peft.peft_config.items():
            folder = directory if adapter == "default" else directory / adapter
            folder.mkdir(parents=True, exist_ok=True)
            tensors = {k: v.contiguous() for k, v in get_peft_model_state_dict(
                hf.peft, state_dict=state, adapter_name=adapter).items()}
            save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
            peft_config = copy.deepcopy(peft_config)
            peft_config.inference_mode = True
            if peft_config.base_model_name_or_path is None:
                peft_config.base_model_name_or_path = getattr(hf.config, "name_or_path", None) or None
            peft_config.save_pretrained(folder)
            files.append(str((folder / "adapter_model.safetensors").relative_to(directory)))
            written += sum(t.numel() * t.element_size() for t in tensors.values())
    dist.barrier()
    return {"files": files, "bytes": written, "seconds": time.perf_counter() - start}


def _canonical(captured, name: str) -> str | None:
    """The checkpoint name a tied tensor is saved under: of its names, the first that the model's
    ``_tied_weights_keys`` does not map to another (Hugging Face's source of the tie)."""
    hf = captured.hf
    names = [c for c in (checkpoint_name(hf, n) for n in captured.aliases.get(name, (name, ))) if c is not None]
    if not names:
        return None
    targets = set(hf.tied) if hf is not None else set()
    return next((n for n in names if n not in targets), names[0])


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names in order, cut into consecutive groups of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = []
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if not shards or size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards
