"""Memory per stage: what each rank holds for its stage, measured, and whether a model can fit at all.

Glossary
--------
parameters
    The stage's parameters and buffers on this rank (tied copies included; under ZeRO-3 its
    partitions, and what is gathered at the moment; on a stage of tensor-parallel degree ``tp``
    this rank's shards of its split layers, ``1 / tp`` of them, beside the tensors every TP rank
    holds whole).
gradients
    One gradient per trainable parameter, the buffers backward fills (under ZeRO-2/3, this rank's
    share of them: the stage's gradients over its ranks).
optimizer state
    Tensors the optimizer keeps besides the parameters: momentum, Adam's moments, and the fp32
    master copies and flat partitions of DeepSpeed's bf16 and ZeRO optimizers; counted as
    allocated (a torch optimizer allocates its state at its first step).
activation peak
    The most bytes autograd held at once for backward passes still to run, over every micro-batch
    in flight (GraphPipe Sec. 3's stash), measured by saved-tensor hooks around the stage's forward;
    parameters saved for backward are not counted, a tensor saved twice counts once. Measured over
    the first ``graph_pipeline.activation_meter_steps`` training steps (one by default), since the
    hooks cost CPU time on every saved tensor.
process peak
    The rank's peak resident memory (``VmHWM``) on CPU, ``torch.cuda.max_memory_allocated`` on GPU:
    everything above, the runtime's own memory (torch, DeepSpeed, buffers) and transients.

:func:`memory_report` gathers one :class:`StageMemory` per rank; the engine prints it beneath the
stage graph at ``initialize`` and after the first step (``graph_pipeline.print_memory``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

from ..errors import InfeasiblePlanError
from .compat import zero3_stage_partitions

__all__ = ["StageMemory", "MemoryReport", "ActivationMeter", "memory_report", "process_peak_bytes",
           "check_fits_memory", "weight_memory"]

_MIB = 2**20


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMemory:
    """What one rank holds for its stage, in bytes (see the module glossary)."""

    stage_idx: int
    rank: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_peak_bytes: int
    process_peak_bytes: int
    tp: int = 1   # the stage's tensor-parallel degree: its split tensors are 1 / tp of the layer's
    activation_steps: int = 0
    """The training steps ``activation_peak_bytes`` was measured over: the first ones, up to
    ``graph_pipeline.activation_meter_steps`` (:class:`ActivationMeter`)."""
    stages: tuple[int, ...] = ()
    """Every stage the rank holds when it holds several (a fold): the numbers are their sum."""

    @property
    def model_bytes(self) -> int:
        """Parameters, gradients, optimizer state and the activation peak together."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_peak_bytes


@dataclass(frozen=True)
class MemoryReport:
    """One :class:`StageMemory` per rank, in rank order."""

    ranks: tuple[StageMemory, ...]

    def describe(self, when: str = "") -> str:
        """A table in MiB, one line per rank.

        >>> m = StageMemory(stage_idx=0, rank=0, param_bytes=2**20, grad_bytes=2**20, optimizer_bytes=0,
        ...                 activation_peak_bytes=2**19, process_peak_bytes=2**22)
        >>> v = StageMemory(stage_idx=1, rank=1, param_bytes=2**20, grad_bytes=2**20, optimizer_bytes=0,
        ...                 activation_peak_bytes=2**19, process_peak_bytes=2**22, stages=(1, 2))
        >>> print(MemoryReport((m, v)).describe())
        memory per rank (MiB): parameters, gradients, optimizer state, activation peak, their sum; process peak
          stage 0 (rank 0):      1.0      1.0      0.0      0.5      2.5;      4.0
          stages 1+2 (rank 1):      1.0      1.0      0.0      0.5      2.5;      4.0
        >>> one = StageMemory(stage_idx=0, rank=0, param_bytes=0, grad_bytes=0, optimizer_bytes=0,
        ...                   activation_peak_bytes=2**19, process_peak_bytes=2**22, activation_steps=1)
        >>> print(MemoryReport((one, )).describe("after step 5").splitlines()[0])
        memory per rank (MiB) after step 5: parameters, gradients, optimizer state, activation peak (of step 1), their sum; process peak
        """
        steps = max((m.activation_steps for m in self.ranks), default=0)
        peak = "activation peak" + (f" (of step{'s 1-' if steps > 1 else ' '}{steps})" if steps else "")
        lines = [f"memory per rank (MiB){' ' + when if when else ''}: parameters, gradients, optimizer state, "
                 f"{peak}, their sum; process peak"]
        for m in sorted(self.ranks, key=lambda m: (m.stage_idx, m.rank)):   # stage_idx: the pipeline rank
            cols = (m.param_bytes, m.grad_bytes, m.optimizer_bytes, m.activation_peak_bytes, m.model_bytes)
            what = f"stage {m.stage_idx}" if not m.stages else "stages " + "+".join(map(str, m.stages))
            where = f"rank {m.rank}" + (f", tp {m.tp}" if m.tp > 1 else "")
            lines.append(f"  {what} ({where}): " + " ".join(f"{b / _MIB:8.1f}" for b in cols)
                         + f"; {m.process_peak_bytes / _MIB:8.1f}")
        return "\n".join(lines)


class ActivationMeter:
    """Bytes autograd holds for backward: live now and the peak so far, over the first ``steps``
    training steps (``None``: every step).

    :meth:`saving` installs saved-tensor hooks; each saved tensor is wrapped in a handle whose
    release (when autograd frees the graph after backward) gives its bytes back. Storages are
    counted once however often they are saved; the storages of ``parameters()`` are not counted.
    The hooks cost CPU time on every saved tensor of every forward and backward, so the meter
    stops after ``steps`` steps (:meth:`end_step`): a pipeline's steps run one program on
    micro-batches of one shape, and the peak of its first step is that of every step. Handles
    already made still give their bytes back after it stops.
    """

    def __init__(self, parameters, steps: int | None = None):
        self._parameters = parameters
        self._params: list | None = None         # the parameters, listed at the first forward
        self._refs: dict[int, list[int]] = {}   # storage address -> [handles, bytes]
        self.live = 0
        self.peak = 0
        self.limit = steps
        self.steps = 0   # training steps measured so far

    @property
    def on(self) -> bool:
        """Whether forwards are still measured."""
        return self.limit is None or self.steps < self.limit

    def end_step(self) -> None:
        """A training step ended: count it if it was measured (the meter stops after the last)."""
        if self.on:
            self.steps += 1

    @contextlib.contextmanager
    def saving(self):
        if not self.on:
            yield
            return
        # The stage's parameters are listed once (walking the module tree every forward cost
        # ~0.25 ms a micro-batch on a stage of 100 modules); their storages are read every time,
        # since ZeRO-3 and bf16 give a parameter new storage.
        if self._params is None:
            self._params = list(self._parameters())
        skip = {_storage_key(p) for p in self._params}
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, skip), _unpack):
            yield

    def _pack(self, t: torch.Tensor, skip: set):
        key = _storage_key(t)
        if key is None or key in skip:
            return t
        ref = self._refs.get(key)
        if ref is None:
            nbytes = t.untyped_storage().nbytes()
            self._refs[key] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            ref[0] += 1
        return _Held(t, key, self)

    def _release(self, key: int) -> None:
        ref = self._refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self._refs[key]


class _Held:
    """A saved tensor; dropping it (autograd freed the graph) releases its bytes in the meter."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter._release(self.key)


def _unpack(saved):
    return saved.tensor if isinstance(saved, _Held) else saved


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return None


def process_peak_bytes(device: torch.device | None = None) -> int:
    """This process's peak memory: ``torch.cuda.max_memory_allocated`` on a GPU, else ``VmHWM``."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _unique_bytes(tensors: Iterable[torch.Tensor], skip: set) -> int:
    seen, total = set(skip), 0
    for t in tensors:
        key = _storage_key(t)
        if key is not None and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _optimizer_tensors(optimizer) -> Iterable[torch.Tensor]:
    """State and parameters of ``optimizer`` and the optimizers it wraps (DeepSpeed's wrappers keep
    the torch optimizer in ``.optimizer``, over flat fp32 partitions)."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        for state in getattr(optimizer, "state", {}).values():
            if isinstance(state, dict):
                yield from (v for v in state.values() if torch.is_tensor(v))
        for group in getattr(optimizer, "param_groups", ()):
            yield from (p for p in group.get("params", ()) if torch.is_tensor(p))
        optimizer = getattr(optimizer, "optimizer", None)


def weight_memory(module: nn.Module, optimizer, *, grad_partitions: int = 1) -> tuple[int, int, int]:
    """Bytes of parameters (and buffers), gradients and optimizer state this rank holds for
    ``module`` under ``optimizer``: what it holds, so a tensor-parallel shard counts as its shard
    (``1 / tp``) and a ZeRO-3 parameter as its partition. ``grad_partitions``: the ranks that
    share each gradient (ZeRO-2/3: the data-parallel degree). No communication."""
    params = list(module.parameters())
    held = [*params, *zero3_stage_partitions(params)]   # ZeRO-3: this rank's partitions
    own = {_storage_key(p) for p in held}
    param_bytes = _unique_bytes([*held, *module.buffers()], set())
    grad_bytes = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params if p.requires_grad)
    return param_bytes, grad_bytes // grad_partitions, _unique_bytes(_optimizer_tensors(optimizer), own)


def stage_memory(engine) -> StageMemory:
    """This rank's :class:`StageMemory` (no communication)."""
    module: nn.Module = engine.module
    # ZeRO-2/3 keep this rank's partition of the stage's gradients.
    partitions = engine.dp_world_size if engine.zero_optimization_partition_gradients() else 1
    param_bytes, grad_bytes, optimizer_bytes = weight_memory(module, engine.optimizer, grad_partitions=partitions)
    meter = getattr(module, "activations", None)
    grid = module.mpu() if hasattr(module, "mpu") else None
    return StageMemory(stage_idx=engine.stage_id, rank=engine.global_rank, param_bytes=param_bytes,
                       grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes,
                       activation_peak_bytes=meter.peak if meter is not None else 0,
                       activation_steps=meter.steps if meter is not None else 0,
                       process_peak_bytes=process_peak_bytes(engine.device),
                       tp=grid.get_slice_parallel_world_size() if grid is not None else 1,
                       stages=tuple(module.stages) if len(module.stages) > 1 else ())


def memory_report(engine) -> MemoryReport:
    """Every rank's :class:`StageMemory`; collective (every rank calls it)."""
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, stage_memory(engine))
    return MemoryReport(tuple(gathered))


def check_fits_memory(stage_bytes: Sequence[int], rank_stage: Sequence[int], *, local_size: int,
                      node_bytes: int, what: str) -> None:
    """Refuse a layout whose stages cannot fit, before anything is allocated or communicated.

    ``stage_bytes[s]`` is the least memory stage ``s`` needs per rank (``what`` says of what);
    ``rank_stage[r]`` is rank ``r``'s stage; ranks ``k * local_size ...`` share a node of
    ``node_bytes`` (CPU ranks share its memory). Raises :class:`InfeasiblePlanError` naming the
    node and its stages.

    >>> check_fits_memory([3, 3], [0, 1], local_size=2, node_bytes=8, what="parameters")
    >>> check_fits_memory([3, 6], [0, 1], local_size=2, node_bytes=8, what="parameters")
    Traceback (most recent call last):
    ...
    gpp_deepspeed.errors.InfeasiblePlanError: node 0 (ranks 0-1) cannot hold its stages: they need 0.0 GiB of parameters (stage 0: 0.0 GiB, stage 1: 0.0 GiB) but the node has 0.0 GiB; use more nodes or stages, bf16, or freeze layers
    """
    for node, first in enumerate(range(0, len(rank_stage), local_size)):
        ranks = range(first, min(first + local_size, len(rank_stage)))
        need = sum(stage_bytes[rank_stage[r]] for r in ranks)
        if need > node_bytes:
            gib = 2**30
            parts = ", ".join(f"stage {rank_stage[r]}: {stage_bytes[rank_stage[r]] / gib:.1f} GiB" for r in ranks)
            raise InfeasiblePlanError(
                f"node {node} (ranks {ranks[0]}-{ranks[-1]}) cannot hold its stages: they need {need / gib:.1f} GiB of "
                f"{what} ({parts}) but the node has {node_bytes / gib:.1f} GiB; use more nodes or stages, bf16, or "
                "freeze layers")


def node_memory_bytes() -> int:
    """This machine's memory (``MemTotal``): what all its CPU ranks share."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
