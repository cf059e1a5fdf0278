"""Hugging Face model directories into a pipeline, one stage per rank, never the whole model.

A Hugging Face model directory holds ``config.json`` and the weights as safetensors (the format:
:mod:`gpp_deepspeed.frontend.hf`). ::

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    captured = load_pretrained(capture(LM(model), layers=[...], example_inputs=(ids, )), path)
    module = GraphPipelineModule(captured.layers, ...)      # each rank reads its stage's tensors only
    engine, *_ = gpp_deepspeed.initialize(model=module, ...)
    ...
    save_pretrained(engine, out_path, captured)             # each stage writes its own shards

Saving is collective, so :func:`~gpp_deepspeed.save_pretrained` lives beside the engine
(:mod:`gpp_deepspeed.engine.pretrained`).

Glossary
--------
checkpoint name
    A tensor's name in the directory (:func:`~gpp_deepspeed.frontend.hf.checkpoint_name`).
tied tensor
    One tensor under several names (an output projection tied to the token embedding). A directory
    holds it once, under the name the model's ``_tied_weights_keys`` maps the others to, and
    ``from_pretrained`` ties the others to it; every layer that holds it reads that one entry.
lazy read
    ``safetensors.safe_open`` maps a file and reads one tensor on ``get_tensor(name)``; a rank opens
    only the shards that hold its layers' tensors, one layer at a time.

Every rank checks the whole directory against the whole captured model (names, shapes) from the
safetensors headers alone, before any communication, so a mismatch fails on every rank with the
first few culprits named.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError, GPPConfigError
from .capture import CapturedModel
from .hf import INDEX_FILE, WEIGHTS_FILE, HFModelInfo, checkpoint_name, local_state
from .meta import is_meta, materialize, meta_copy

__all__ = ["PretrainedWeights", "load_pretrained"]


@dataclass(frozen=True)
class PretrainedWeights:
    """A checked Hugging Face directory that captured layers read their tensors from when built.

    ``files`` maps each checkpoint name to its shard file, ``shapes`` to its shape; ``aliases`` are
    the captured module's (:attr:`CapturedModel.aliases`).
    """

    directory: Path
    files: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    hf: HFModelInfo | None
    aliases: dict[str, tuple[str, ...]]

    @classmethod
    def open(cls, directory: str | os.PathLike, *, hf: HFModelInfo | None = None,
             aliases: dict[str, tuple[str, ...]] | None = None) -> "PretrainedWeights":
        """Read the index (or the single file's header) and every shard's header; no tensor data."""
        from safetensors import safe_open
        directory = Path(directory)
        index = directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (directory / WEIGHTS_FILE).is_file():
            with safe_open(directory / WEIGHTS_FILE, framework="pt") as f:
                weight_map = {name: WEIGHTS_FILE for name in f.keys()}
        else:
            raise CheckpointError(f"{directory} holds neither {INDEX_FILE} nor {WEIGHTS_FILE}: not a Hugging Face "
                                  "safetensors directory (save it with save_pretrained(..., safe_serialization=True))")
        shapes = {}
        for file in sorted(set(weight_map.values())):
            with safe_open(directory / file, framework="pt") as f:
                for name in f.keys():
                    if weight_map.get(name) == file:
                        shapes[name] = tuple(f.get_slice(name).get_shape())
        lost = [n for n in weight_map if n not in shapes]
        if lost:
            raise CheckpointError(f"{index} lists {lost[:4]} in files that do not hold them")
        return cls(directory=directory, files=dict(weight_map), shapes=shapes, hf=hf, aliases=dict(aliases or {}))

    def source_of(self, name: str) -> str | None:
        """The checkpoint name that holds the captured module's tensor ``name`` (itself or a tied alias)."""
        for candidate in (name, *self.aliases.get(name, ())):
            ckpt = checkpoint_name(self.hf, candidate)
            if ckpt is not None and ckpt in self.files:
                return ckpt
        return None

    def check(self, layers, *, strict: bool) -> None:
        """Every tensor of ``layers`` (captured specs) against the directory, before any communication:
        missing and (with ``strict``) unexpected names, and shapes, naming the first few of each."""
        needed: dict[str, tuple[int, ...]] = {}
        for spec in _unique_specs(layers):
            for local, t in local_state(spec.module, persistent_only=True).items():
                if self.hf is None or not self.hf.is_adapter(spec.module_path(local)):   # adapters: PEFT's init
                    needed[spec.module_path(local)] = tuple(t.shape)
        missing = [n for n in needed if self.source_of(n) is None]
        wrong = [f"{n}: checkpoint {list(self.shapes[self.source_of(n)])}, model {list(s)}"
                 for n, s in needed.items() if self.source_of(n) is not None and self.shapes[self.source_of(n)] != s]
        read = {self.source_of(n) for n in needed}
        unexpected = [n for n in self.files if n not in read]
        problems = []
        if wrong:
            problems.append(f"{len(wrong)} tensor(s) of other shapes: {wrong[:4]}")
        if missing and strict:
            named = [(checkpoint_name(self.hf, n) or n) for n in missing]
            problems.append(f"{len(missing)} tensor(s) of the model missing: {named[:4]}")
        if unexpected and strict:
            problems.append(f"{len(unexpected)} tensor(s) the model does not have: {unexpected[:4]}")
        if missing and not strict:
            named = [(checkpoint_name(self.hf, n) or n) for n in missing]
            warnings.warn(f"{self.directory} lacks {len(missing)} tensor(s) of the model, which the model's own "
                          f"initialisation fills (strict=False): {named[:8]}", stacklevel=3)
        if problems:
            what = f"{self.hf.class_name} " if self.hf is not None else ""
            raise CheckpointError(f"{self.directory} does not match the captured {what}model: " + "; ".join(problems)
                                  + (". Build the model from this directory's config.json" if wrong else "")
                                  + (" (load_pretrained(..., strict=False) initialises missing tensors and "
                                     "ignores unexpected ones)" if strict and not wrong else ""))

    def build(self, spec) -> nn.Module:
        """Build captured layer ``spec`` with its tensors read from the directory; on the meta
        device, the tensors the directory lacks (non-persistent buffers such as rotary frequencies,
        a new head under ``strict=False``) are initialised by the model's own initialisation.

        With ``spec.sharding`` (a stage of tensor-parallel degree above 1) a meta layer is split
        first, on the meta device, and each split tensor is read as this rank's slice only
        (``get_slice``); a real layer is read whole and split after."""
        sharding = getattr(spec, "sharding", None)
        if not is_meta(spec.module):   # a real module: its copy, overwritten with the directory's values
            module = copy.deepcopy(spec.module)
            state = local_state(module, persistent_only=True)
            sources = {n: self.source_of(spec.module_path(n)) for n in state}
            values = self._read({(s, None) for s in sources.values() if s is not None})
            with torch.no_grad():
                for n, src in sources.items():
                    if src is not None:
                        state[n].copy_(values[src, None])
            return module if sharding is None else sharding.apply(spec, module)
        module = meta_copy(spec.module)
        cuts = {}
        if sharding is not None:
            module = sharding.apply(spec, module)
            cuts = sharding.slices(module)
        sources: dict[int, tuple[tuple, torch.Tensor]] = {}
        for local, t in local_state(module, persistent_only=True).items():
            src = self.source_of(spec.module_path(local))
            if src is not None:
                sources.setdefault(id(t), ((src, cuts.get(local)), t))
        values = self._read({key for key, _ in sources.values()})
        fresh, source_of = {}, {}
        for tid, (key, t) in sources.items():
            value = values[key].to(t.dtype)
            fresh[tid] = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value
            if sharding is not None and isinstance(t, nn.Parameter):
                fresh[tid].__dict__.update(t.__dict__)   # DeepSpeed's marks on a split parameter
            source_of[id(fresh[tid])] = key
        _assign(module, fresh)
        mixed = [sub for sub in module.modules() if any(t.is_meta for t in _own(sub))]
        if mixed:
            # Initialised whole (an initialiser fills a submodule at once), then the submodule's
            # tensors that the directory has are read again.
            materialize(module, init=spec.init, path_of=spec.module_path)
            again = {t: source_of[id(t)] for sub in mixed for t in _own(sub) if id(t) in source_of}
            if again:
                values = self._read(set(again.values()))
                with torch.no_grad():
                    for t, key in again.items():
                        t.copy_(values[key])
        return module

    def _read(self, keys: set[tuple[str, tuple[int, int, int] | None]]) -> dict[tuple, torch.Tensor]:
        """The tensors ``keys`` (``(name, cut)``: the whole tensor for cut None, else its part
        ``(dim, start, stop)``, read alone with ``get_slice``), each file opened once and closed
        before returning.

        ``safe_open`` hands out tensors backed by the file's memory mapping; each is copied, so the
        mapping goes with the file: a parameter never written (a frozen one) would otherwise read
        the file for as long as it lives, and change (or fault) when the directory is overwritten,
        by ``save_pretrained`` to the same path for one."""
        from safetensors import safe_open
        out = {}
        by_file: dict[str, list[tuple]] = {}
        for key in sorted(keys, key=lambda k: (k[0], k[1] or ())):
            by_file.setdefault(self.files[key[0]], []).append(key)
        for file, group in by_file.items():
            with safe_open(self.directory / file, framework="pt", device="cpu") as f:
                for name, cut in group:
                    if cut is None:
                        out[name, cut] = f.get_tensor(name).clone()
                    else:
                        dim, start, stop = cut
                        index = (slice(None), ) * dim + (slice(start, stop), )
                        out[name, cut] = f.get_slice(name)[index].clone()
        return out


def _own(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


def _assign(module: nn.Module, values: dict[int, torch.Tensor]) -> None:
    """Put ``values[id(old)]`` in every slot of ``module`` that holds ``old`` (ties stay tied)."""
    for sub in module.modules():
        for slots in (sub._parameters, sub._buffers):
            for key, t in slots.items():
                if t is not None and id(t) in values:
                    slots[key] = values[id(t)]


def _unique_specs(layers):
    """The captured specs of ``layers``, each tie's holder once."""
    seen = set()
    for spec in layers:
        if isinstance(getattr(spec, "module", None), nn.Module) and id(spec.module) not in seen:
            seen.add(id(spec.module))
            yield spec


def load_pretrained(captured, directory: str | os.PathLike, *, strict: bool = True):
    """``captured`` (a :class:`~gpp_deepspeed.frontend.CapturedModel`) with every layer reading its
    tensors from the Hugging Face directory ``directory`` when built.

    Nothing is read now but the index and the safetensors headers, which are checked against every
    layer (raises :class:`~gpp_deepspeed.errors.CheckpointError` naming the first mismatches).
    A :class:`~gpp_deepspeed.GraphPipelineModule` built from the returned layers reads, on each
    rank, only the tensors of that rank's stage; its :class:`~gpp_deepspeed.GraphModel` twin reads
    them all. With ``strict=False``, tensors the directory lacks are initialised by the model's own
    initialisation (the captured module must then be on the meta device) and tensors it has but the
    model does not are ignored, as ``from_pretrained`` does with a warning.
    """
    if not isinstance(captured, CapturedModel):
        raise GPPConfigError(f"load_pretrained takes the CapturedModel that capture() returns, got "
                             f"{type(captured).__name__}")
    weights = PretrainedWeights.open(directory, hf=captured.hf, aliases=captured.aliases)
    weights.check(captured.layers, strict=strict)
    layers = []
    for spec in captured.layers:
        if isinstance(getattr(spec, "module", None), nn.Module) and hasattr(spec, "weights"):
            spec = copy.copy(spec)
            spec.weights = weights
        layers.append(spec)
    return dataclasses.replace(captured, layers=layers)


