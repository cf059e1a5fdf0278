"""ZeRO-2 inside a stage's data-parallel group: gradients and optimizer state partitioned.

DeepSpeed's ``PipelineEngine`` refuses ZeRO-2 (``assert zero stage < 2``) because it reduces
gradients once per batch (``REDUCE_GRAD``), while ZeRO-2 reduces them inside every backward. Here
DeepSpeed's own ZeRO-2 optimizer (``DeepSpeedZeroOptimizer``, ``partition_gradients=True``) runs as
it does under plain data parallelism with gradient accumulation:

* during each micro-batch's backward (``B``, or the ``W`` of a split backward: parameter gradients
  exist only there) its gradient hooks fill a bucket and reduce it over the stage's data-parallel
  group when full, each rank keeping the part of its partition;
* after that backward, :meth:`PartitionedGradientsMixin._reduce_micro_batch` runs the epilogue
  DeepSpeed runs after every ``engine.backward`` (the rest of the bucket; the micro-batch added into
  the partition; the full gradients freed);
* at ``REDUCE_TIED`` the accumulated partitions become the ones the step reads, and tied weights
  sum their gradients over the stages holding a copy (each rank of a stage rebuilds the whole
  gradient with DeepSpeed's ``safe_get_full_grad``, a collective over the stage's group, and writes
  the sum back into its partition with ``safe_set_full_grad``);
* ``REDUCE_GRAD`` has nothing left to do; the step (clipping by the norm over the pipeline
  included) is DeepSpeed's.

This is per micro-batch and needs every rank of a stage's group to run the same backwards in the same
order, which the stage program guarantees: the ranks of a stage run one action list. Per-stage
degrees need nothing more: the optimizer's group is the stage's (:class:`~.topology.StageGrid`).

ZeRO-3 is refused (:func:`check_zero_supported`), before any communication. Measured with the
refusal lifted (pipe 2 x data 2, 1f1b): every rank blocks in the first micro-batch's forward.
DeepSpeed's ZeRO-3 registers a forward pre-hook on the whole module that calls
``PartitionedParameterCoordinator.reset_step`` (meant once per forward + backward of a data-parallel
model); while its trace is incomplete that checks the module order with
``assert_ints_same_as_other_ranks``, a ``dist.broadcast`` from rank 0 over *all* ranks. A pipeline
stage runs its forwards at its own time between point-to-point transfers, and each stage holds other
modules, so rank 0 waits in the broadcast while the next stage waits for rank 0's activations.
Driving it would mean replacing ZeRO-3's coordinator (its trace, prefetch and release), not calling
it. Not tried past that point: the split backward's ``W`` would run after ZeRO-3's post-backward
hook (fired in ``I``) released the parameters.
"""

from __future__ import annotations

import torch
from deepspeed import comm as dist
from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

from ..errors import GPPConfigError
from . import compat

__all__ = ["PartitionedGradientsMixin", "check_zero_supported"]


def check_zero_supported(config_class) -> None:
    """Refuse, before any communication, a ZeRO stage the graph pipeline cannot drive."""
    stage = config_class.zero_optimization_stage if config_class is not None else 0
    if stage >= 3:
        raise GPPConfigError(
            '"zero_optimization.stage": 3 is not supported by the graph pipeline: DeepSpeed 0.19.8\'s ZeRO-3 '
            "restarts its parameter-fetch trace at the start of every forward of the stage module and, until a "
            "trace is complete, checks it against rank 0's with a broadcast over all ranks "
            "(PartitionedParameterCoordinator.reset_step), which the stages of a pipeline reach at different "
            "times with different modules, so the first micro-batch deadlocks; use stage 2 (gradients and "
            "optimizer state partitioned over each stage's ranks) or 1")


class PartitionedGradientsMixin:
    """ZeRO-2 handlers for :class:`~gpp_deepspeed.engine.GraphPipelineEngine`."""

    def zero_optimization_stage(self):
        return compat.pipeline_assert_stage(super().zero_optimization_stage())

    def _reduce_micro_batch(self) -> None:
        """After a backward that gave this stage's parameters gradients (``B`` or ``W``)."""
        if self.zero_optimization_partition_gradients():
            compat.reduce_micro_batch_gradients(self.optimizer)

    def _reduce_tied_partitioned(self) -> None:
        compat.finish_gradient_accumulation(self.optimizer)
        for weight, group in self.module.get_tied_weights_and_groups():
            # The partition holds the stage's data-parallel average: each rank of the stage adds
            # 1/degree of it, so the sum over the tie's ranks is the sum over its stages.
            full = safe_get_full_grad(weight)
            if full is None:
                continue
            full = full.to(torch.float32).div_(self.dp_world_size)
            dist.all_reduce(full, group=group)
            safe_set_full_grad(weight, full)

    def _exec_reduce_grads(self):
        if self.zero_optimization_partition_gradients():
            return  # reduced during each backward; REDUCE_TIED built the partitions
        super()._exec_reduce_grads()
