"""Tensor parallelism for captured Hugging Face layers: the model's own plan, DeepSpeed's AutoTP layers.

A stage with ``tp > 1`` runs every captured layer split over its TP group (Megatron-LM's column-
and row-parallel linears, Shoeybi et al., arXiv 1909.08053, Sec. 3): the model's own
tensor-parallel plan (``config.base_model_tp_plan``, e.g. Llama's ``"layers.*.self_attn.q_proj":
"colwise"``, ``"layers.*.self_attn.o_proj": "rowwise"``) is read by DeepSpeed's
``TPPlanConverter``, and each planned linear is replaced by DeepSpeed's AutoTP training layer:
``LinearLayer`` (column-parallel: the output features split, the input gradient all-reduced in
backward) or ``LinearAllreduce`` (row-parallel: the input features split, the output all-reduced
in forward). Attention needs no change: a Hugging Face attention reshapes by ``head_dim`` and so
runs on the heads of its shard.

Why DeepSpeed's layers and not torch's ``parallelize_module``: their parameters are plain
``torch.nn.Parameter`` shards, which DeepSpeed's ZeRO-1/2 optimizers flatten like any other, and
they shard a meta module without allocating. ``benchmarks/tp_library_probe.py`` (its output in
``benchmarks/results/tp_library_probe.txt``): DeepSpeed's layers train under ZeRO-1 and ZeRO-2,
built on the meta device or on the CPU; ``parallelize_module``'s DTensor parameters fail in
``deepspeed.initialize`` either way (``_configure_distributed_model`` moves the module with
``Module._apply``: "Couldn't swap Linear.weight"), before any optimizer sees them.

Glossary
--------
TP group
    The ranks that hold the shards of one copy of a stage (DeepSpeed's slice-parallel group).
shard
    A rank's part of a planned linear's weight: rows ``[i * out / tp, (i + 1) * out / tp)`` of a
    column-parallel one (and of its bias), columns of a row-parallel one (its bias is whole).
replicated
    A tensor every rank of the TP group holds whole: norms' weights, a row-parallel bias, buffers.
    Its input is the same on every TP rank (after the row-parallel all-reduce), so its gradient is
    too: nothing to reduce. A layer is refused at ``tp > 1`` if it holds a matrix (a ``Linear`` or
    ``Embedding`` weight) that the plan does not cover: replicating it silently would keep its
    memory whole, which is not what ``tp`` promises.

Representative calls (the engine's build hook, :func:`sharding_specs`, does them per stage)::

    sharding = HFTensorParallel(group)            # this rank's TP group
    sharding.check(spec)                          # before any communication
    module = sharding.apply(spec, module)         # planned linears replaced, meta or real
    sharding.slices(module)                       # {tensor name: (dim, start, stop)} to read
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..errors import GPPConfigError

__all__ = ["HFTensorParallel", "check_tp_degree", "check_tp_layers", "sharding_specs", "tp_plan", "tp_styles",
           "gathered", "DIVIDED_FIELDS"]

# The config fields a TP degree must divide (Megatron's rule: whole heads per rank; DeepSpeed's
# AutoTP splits a dimension it cannot divide unevenly or, with one KV head, not at all).
DIVIDED_FIELDS = ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size")


def tp_plan(config: Any) -> dict[str, str]:
    """The model's tensor-parallel plan: ``config.base_model_tp_plan`` (of the text config in a
    multimodal one), ``{}`` when it has none."""
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan and getattr(config, "text_config", None) is not None:
        plan = getattr(config.text_config, "base_model_tp_plan", None)
    return dict(plan or {})


def check_tp_degree(config: Any, tp: int, *, where: str = "") -> None:
    """Raise :class:`GPPConfigError` naming the config field when ``tp`` does not divide it."""
    cfg = getattr(config, "text_config", None) or config
    for name in DIVIDED_FIELDS:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value % tp:
            raise GPPConfigError(f"{where}tensor-parallel degree {tp} does not divide config.{name} = {value} "
                                 f"of {type(config).__name__}; use a TP degree that divides it")


def tp_styles(spec, tp: int) -> dict[str, Any]:
    """``{submodule path in the layer: DeepSpeed TPLayerSpec}`` for the planned linears of captured
    layer ``spec`` split ``tp`` ways; raises :class:`GPPConfigError` for a layer outside a Hugging
    Face model, an indivisible degree or a matrix the plan does not cover. No communication."""
    from deepspeed.module_inject.autotp_config import AutoTPConfig, PartitionType
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    hf, name = getattr(spec, "hf", None), spec.name
    if hf is None:
        raise GPPConfigError(f'layer "{name}" is on a stage with tensor-parallel degree {tp} but is not '
                             "part of a captured Hugging Face model: only those carry a tensor-parallel plan")
    check_tp_degree(hf.config, tp, where=f'layer "{name}": ')
    plan = tp_plan(hf.config)
    try:
        config = AutoTPConfig(tp_size=tp, layer_specs=TPPlanConverter.convert(plan) or [],
                              use_default_specs=False)
    except ValueError as e:
        raise GPPConfigError(f'layer "{name}": {hf.class_name}.config.base_model_tp_plan: {e}') from None
    out, unplanned = {}, []
    for path, sub in spec.module.named_modules():
        weight = sub._parameters.get("weight")
        if weight is None or weight.dim() != 2:
            continue   # norms, biases, buffers: replicated (see the module glossary)
        full = hf.checkpoint_name(spec.module_path(path)) or spec.module_path(path)
        found = config.find_matching_spec(f"{full}.weight")
        if found is None:
            unplanned.append(f"{full} ({type(sub).__name__} {list(weight.shape)})")
        elif found.partition_type != PartitionType.SKIP:
            if not isinstance(sub, nn.Linear) or found.shape is not None:
                raise GPPConfigError(f'layer "{name}": {full} is planned "{found.partition_type.value}" but is '
                                     f"a {type(sub).__name__}; only plain nn.Linear layers are split here")
            out[path] = found
    if unplanned:
        raise GPPConfigError(
            f'layer "{name}" is on a stage with tensor-parallel degree {tp} but '
            f"{hf.class_name}.config.base_model_tp_plan covers none of: {unplanned[:4]}. Put the layer on a "
            "stage of tensor-parallel degree 1 (embeddings and output heads usually), or add it to the plan")
    return out


def check_tp_layers(specs: Sequence[Any], tp: int) -> None:
    """Every error that splitting the captured layers of ``specs`` ``tp`` ways would raise, raised
    now: what every rank runs for every stage of TP degree above 1 before any communication."""
    if tp > 1:
        for spec in specs:
            if isinstance(getattr(spec, "module", None), nn.Module) and hasattr(spec, "sharding"):
                tp_styles(spec, tp)


@dataclass(frozen=True)
class HFTensorParallel:
    """How one stage's captured Hugging Face layers are split over its TP group ``group``.

    ``apply`` works on meta modules (DeepSpeed's layers slice meta tensors to meta shards), so a
    layer read from a directory (:mod:`gpp_deepspeed.frontend.pretrained`) reads only its shards."""

    group: Any

    @property
    def size(self) -> int:
        return torch.distributed.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank(self.group)

    def styles(self, spec) -> dict[str, Any]:
        """``{submodule path in the layer: DeepSpeed TPLayerSpec}`` for the planned linears of
        captured layer ``spec`` (:func:`tp_styles` at this group's size)."""
        return tp_styles(spec, self.size)

    def check(self, spec) -> None:
        """Every error :meth:`apply` would raise, raised now, before any communication."""
        self.styles(spec)

    def apply(self, spec, module: nn.Module) -> nn.Module:
        """``module`` (a build of ``spec``, meta or real) with its planned linears replaced by
        DeepSpeed's AutoTP training layers holding this rank's shards."""
        from deepspeed.module_inject.autotp_config import PartitionType
        from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, set_autotp_mode
        from deepspeed.module_inject.tp_shard import AutoTPMeta
        set_autotp_mode(training=True)   # the layers' forward reads it: autograd-safe all-reduces
        meta = AutoTPMeta.from_model_config(spec.hf.config)
        for path, found in self.styles(spec).items():
            parent_path, _, child = path.rpartition(".")
            parent = module.get_submodule(parent_path)
            linear = getattr(parent, child)
            if found.partition_type == PartitionType.ROW:
                layer = LinearAllreduce(linear, self.group, name=path, tp_meta=meta)
            else:
                layer = LinearLayer(linear, self.group, name=path, gather_output=found.gather_output, tp_meta=meta)
            setattr(parent, child, layer)
        return module

    def slices(self, module: nn.Module) -> dict[str, tuple[int, int, int]]:
        """``{tensor name in module: (dim, start, stop)}`` of every split tensor: what this rank
        reads of the whole tensor (from DeepSpeed's own record of the split on the parameter)."""
        from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
        out = {}
        for name, p in module.named_parameters():
            meta = getattr(p, DS_AUTOTP_UC_META, None)
            if meta is None or meta.get("replicated") or meta.get("partition_dim") is None:
                continue
            sizes, dim = meta["partition_sizes"], meta["partition_dim"]
            start = sum(sizes[:self.rank])
            out[name] = (dim, start, start + sizes[self.rank])
        return out


@contextlib.contextmanager
def sharding_specs(specs: Sequence[Any], group) -> Iterator[None]:
    """While active, every captured layer of ``specs`` builds split over TP group ``group`` (a
    group of one: nothing changes). The engine's build hook: specs are the user's objects, so
    the attribute goes when the build is done."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        yield
        return
    sharding = HFTensorParallel(group)
    captured = [s for s in specs if isinstance(getattr(s, "module", None), nn.Module) and hasattr(s, "sharding")]
    for spec in captured:
        sharding.check(spec)
    try:
        for spec in captured:
            spec.sharding = sharding
        yield
    finally:
        for spec in captured:
            spec.sharding = None


@contextlib.contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """While active, every AutoTP layer of ``module`` holds its whole weights (DeepSpeed's
    ``GatherReplacedLayerParams``, an all-gather in the TP group: collective); split again after."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams, TensorParallel_Layer
    with contextlib.ExitStack() as stack:
        for sub in module.modules():
            if isinstance(sub, TensorParallel_Layer):
                params = [sub.weight, sub.bias]
                stack.enter_context(GatherReplacedLayerParams(params, sub, enabled=True))
        yield
