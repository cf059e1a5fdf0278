"""ZeRO-2 and ZeRO-3 inside a stage's data-parallel group.

DeepSpeed's ``PipelineEngine`` refuses ZeRO-2 and ZeRO-3 (``assert zero stage < 2``) because it
reduces gradients once per batch (``REDUCE_GRAD``), while they reduce them inside every backward.
Here DeepSpeed's own optimizers (``DeepSpeedZeroOptimizer`` with ``partition_gradients=True``,
``DeepSpeedZeroOptimizer_Stage3``) run as they do under plain data parallelism with gradient
accumulation, over the ranks of one stage:

* during each micro-batch's backward (``B``, or the ``W`` of a split backward: parameter gradients
  exist only there) their gradient hooks fill a bucket and reduce it over the stage's data-parallel
  group when full, each rank keeping its partition;
* after that backward, :meth:`StageZero.reduce_micro_batch` runs the epilogue
  DeepSpeed runs after every ``engine.backward`` (the rest of the bucket; the micro-batch added into
  the partition; the whole gradients freed);
* at ``REDUCE_TIED`` the accumulated partitions become the ones the step reads, and tied weights
  sum their gradients over the stages holding a copy (each rank of a stage rebuilds the whole
  gradient with DeepSpeed's ``safe_get_full_grad``, a collective over the stage's group, and writes
  the sum back into its partition with ``safe_set_full_grad``);
* ``REDUCE_GRAD`` has nothing left to do; the step (clipping by the norm over the pipeline included)
  is DeepSpeed's.

This needs every rank of a stage to run the same backwards in the same order, which the stage
program guarantees (the ranks of a stage run one action list). Per-stage degrees need nothing more:
the optimizer's group is the stage's (:class:`~.topology.StageGrid`).

ZeRO-3 also partitions the parameters: its module hooks gather a layer's parameters for each forward
and backward and free them after. Two things are adjusted (:mod:`.compat`): its trace check, a
broadcast over all ranks at every stage forward that would deadlock the pipeline, runs over the
stage's group (:func:`~.compat.zero3_trace_checked_within`); and it counts gradient norms on every
stage, not on model-parallel rank 0 only, and tied copies once (:func:`~.compat.count_each_stage_once`).
After each micro-batch's backward the engine also runs ZeRO-3's end-of-backward release
(``backward_epilogue``), as ``DeepSpeedEngine.backward`` does: ZeRO-3's post-backward hook counts a
layer's pending backwards from the layer's last forward, so with micro-batches in flight it misses
the last backwards of a batch and the stage would stay gathered.

Refused (:func:`check_zero_supported`, before any communication):

* ZeRO-3 with a split backward (``zb1``, ``zb2``). Measured: ``W`` runs a layer's backward after
  ZeRO-3's hooks released its parameters at ``I``, and DeepSpeed's ZeRO-3 linear function computes
  the input gradient there too, from the released weight ("size mismatch, got input (4), mat (4x8),
  vec (0)"). Two ways of driving it failed: gathering each parameter group around its ``W`` pass
  (``GatheredParameters``) fails on leaving it ("Cannot free a ZeRO-3 parameter while it is still
  active in submodules": ZeRO-3's module bookkeeping of that backward is still open); also running
  ZeRO-3's end-of-backward release inside it fails in a later pass ("active_backward_submodules is
  empty during backward pass"). ZeRO-3's per-module hooks assume one backward per forward of a
  module, start to end; ``I`` and ``W`` are two partial ones.
* Checkpoints under ZeRO-3 (``save_checkpoint`` / ``load_checkpoint``): the per-layer files would
  hold partitions; not done.
"""

from __future__ import annotations

import contextlib

import torch
from deepspeed import comm as dist
from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

from ..errors import GPPConfigError
from . import compat

__all__ = ["StageZero", "check_zero_supported"]


def check_zero_supported(config_class, schedule_spec) -> None:
    """Refuse, before any communication, what the graph pipeline cannot drive with the configured
    ZeRO stage (``schedule_spec``: the schedule's registry entry)."""
    stage = config_class.zero_optimization_stage if config_class is not None else 0
    if stage == 3 and schedule_spec.splits_backward:
        raise GPPConfigError(
            f'"zero_optimization.stage": 3 cannot run graph_pipeline.schedule "{schedule_spec.name}": its split '
            "backward computes weight gradients (W) after ZeRO-3's hooks released the layer's parameters at the "
            'input-gradient pass (I); use schedule "1f1b" or "gpipe" with stage 3, or stage 2 (gradients and '
            "optimizer state partitioned) with any synchronous schedule")


class StageZero:
    """What ZeRO-2/3 add to one rank's stage (module docstring); owned by
    :class:`~gpp_deepspeed.engine.GraphPipelineEngine` as ``engine.zero``."""

    def __init__(self, engine):
        self.engine = engine
        self.partitions_gradients = engine.zero_optimization_partition_gradients()
        self.partitions_weights = engine.zero_optimization_partition_weights()

    def forward(self):
        """The context a stage's forward runs in: ZeRO-3's trace check over the stage's group."""
        if not self.partitions_weights:
            return contextlib.nullcontext()
        return compat.zero3_trace_checked_within(self.engine.grid.get_data_parallel_group())

    def reduce_micro_batch(self) -> None:
        """After a backward that gave this stage's parameters gradients (``B`` or ``W``)."""
        engine = self.engine
        if self.partitions_gradients:
            compat.reduce_micro_batch_gradients(engine.optimizer)
        if self.partitions_weights and not engine.is_last_stage():
            # What DeepSpeedEngine.backward runs last (the output stage's backward is DeepSpeed's):
            # ZeRO-3 frees the layers whose post-backward hook did not fire. Its hook counts a
            # layer's pending backwards from the layer's last forward, so with several micro-batches
            # in flight the last backwards of a batch do not fire it; without this the whole stage
            # stayed gathered after them (benchmarks/zero_memory.py measured 4P/n + 4P).
            engine.optimizer.backward_epilogue()

    def reduce_tied(self) -> None:
        """``REDUCE_TIED`` under ZeRO-2/3: the accumulated partitions become the ones the step
        reads, and tied weights sum their gradients over the stages holding a copy."""
        engine = self.engine
        compat.finish_gradient_accumulation(engine.optimizer)
        for weight, group in engine.module.get_tied_weights_and_groups():
            # The partition holds the stage's data-parallel average: each rank of the stage adds
            # 1/degree of it, so the sum over the tie's ranks is the sum over its stages.
            full = safe_get_full_grad(weight)
            if full is None:
                continue
            full = full.to(torch.float32).div_(engine.dp_world_size)
            dist.all_reduce(full, group=group)
            safe_set_full_grad(weight, full)

    def skips_reduce_grads(self) -> bool:
        """Whether ``REDUCE_GRAD`` has nothing to do: ZeRO-2/3 reduced during each backward, and a
        ZeRO-0 stage of one rank has nothing to average (DeepSpeed's all-reduce would first copy
        every gradient into flat buckets of up to 500 M elements: one more copy of the stage's
        gradients at the peak, measured on the 1.5 B benchmark). ZeRO-1 moves gradients into its
        partitions there, so it always runs."""
        engine = self.engine
        return self.partitions_gradients or (engine.zero_optimization_stage() == 0 and engine.dp_world_size == 1)

    def refuse_checkpoint(self, what: str) -> None:
        if self.partitions_weights:
            raise GPPConfigError(f"{what} is not supported with \"zero_optimization.stage\": 3 in the graph pipeline "
                                 "(its per-layer files would hold this rank's parameter partitions); use stage 2")

    def gathered_parameters(self):
        """A context in which this stage's parameters are whole on every rank of the stage (ZeRO-3
        gathers them over the stage's group; a no-op otherwise). Collective over the stage."""
        if not self.partitions_weights:
            return contextlib.nullcontext()
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters
        return GatheredParameters(list(self.engine.module.parameters()))
