"""The Hugging Face side of a captured module: the model inside it and the names its directory uses.

A Hugging Face model directory holds ``config.json`` and the weights as safetensors: one
``model.safetensors`` (:data:`WEIGHTS_FILE`), or shards with an index ``model.safetensors.index.json``
(:data:`INDEX_FILE`) whose ``weight_map`` names the shard of every tensor. Loading reads it
(:mod:`gpp_deepspeed.frontend.pretrained`), saving writes it (:mod:`gpp_deepspeed.engine.pretrained`);
both name tensors by their *checkpoint name*: the name in the Hugging Face model
(``model.layers.0.mlp.up_proj.weight``), that is the name in the captured module without the path
of the Hugging Face model inside it (a wrapper's ``"m."``).

PEFT adapters (``peft.get_peft_model``) wrap the model: a wrapped layer keeps its base weight as
``q_proj.base_layer.weight`` beside the adapter's ``q_proj.lora_A.default.weight``. The base weight's
checkpoint name is PEFT's own mapping back to the base model (``q_proj.weight``, what
``merge_and_unload()`` names it); the adapter's tensors are in no base directory (they have no
checkpoint name) and are saved apart, as PEFT does (:func:`~gpp_deepspeed.save_pretrained`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["HFModelInfo", "checkpoint_name", "local_state", "INDEX_FILE", "WEIGHTS_FILE"]

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class HFModelInfo:
    """The Hugging Face model inside a captured module.

    ``prefix`` is its path there (``""`` when the captured module is the model, ``"m."`` in a
    wrapper whose ``self.m`` it is); ``tied`` is its expanded ``_tied_weights_keys``,
    ``{target name: source name}`` in checkpoint names.
    """

    prefix: str
    class_name: str
    config: Any
    tied: dict[str, str]
    peft: Any = None         # the peft.PeftModel around the model, if adapters wrap it
    peft_prefix: str = ""    # its path in the captured module ("" or ending with a dot)

    @classmethod
    def find(cls, module: nn.Module) -> "HFModelInfo | None":
        """The outermost ``PreTrainedModel`` in ``module``, if there is exactly one."""
        import sys
        modeling = sys.modules.get("transformers.modeling_utils")
        if modeling is None:
            return None
        found = [(n, m) for n, m in module.named_modules() if isinstance(m, modeling.PreTrainedModel)]
        outer = [(n, m) for n, m in found if not any(o != n and (o == "" or n.startswith(o + ".")) for o, _ in found)]
        if len(outer) != 1:
            return None
        name, model = outer[0]
        peft = sys.modules.get("peft.peft_model")
        wrappers = [(n, m) for n, m in module.named_modules() if peft is not None and isinstance(m, peft.PeftModel)]
        peft_name, peft_model = wrappers[0] if wrappers else ("", None)
        return cls(prefix=f"{name}." if name else "", class_name=type(model).__name__, config=model.config,
                   tied=dict(model.get_expanded_tied_weights_keys(all_submodels=True)), peft=peft_model,
                   peft_prefix=f"{peft_name}." if peft_name else "")

    def checkpoint_name(self, name: str) -> str | None:
        """``name`` (in the captured module) in the directory, or None when it is outside the model
        or a PEFT adapter's tensor."""
        if not name.startswith(self.prefix) or self.is_adapter(name):
            return None
        name = name[len(self.prefix):]
        return name.replace(".base_layer.", ".") if self.peft is not None else name

    def is_adapter(self, name: str) -> bool:
        """Whether ``name`` is a PEFT adapter's tensor (a path step starting with the tuner's
        prefix, ``lora_`` for LoRA)."""
        if self.peft is None:
            return False
        prefix = getattr(self.peft.base_model, "prefix", "lora_")
        return any(step.startswith(prefix) for step in name.split("."))


def checkpoint_name(hf: HFModelInfo | None, name: str) -> str | None:
    """``name`` (in the captured module) in the directory: itself without a Hugging Face model, else
    :meth:`HFModelInfo.checkpoint_name`."""
    return name if hf is None else hf.checkpoint_name(name)


def local_state(module: nn.Module, *, persistent_only: bool) -> dict[str, torch.Tensor]:
    """``{name in module: tensor}`` for every parameter and (persistent) buffer, shared ones under each
    of their names."""
    out = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for key, t in sub._parameters.items():
            if t is not None:
                out[dot + key] = t
        for key, t in sub._buffers.items():
            if t is not None and not (persistent_only and key in sub._non_persistent_buffers_set):
                out[dot + key] = t
    return out
