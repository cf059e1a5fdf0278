"""The engine side of the asynchronous schedules: which batch of the never-draining program runs
next, the flush, the weight-version instructions, and the options they cannot honour.

:class:`AsyncPipeline` keeps the count of batches trained since the pipeline was last empty and
hands :class:`~gpp_deepspeed.engine.GraphPipelineEngine` the program of the next batch, or of the
flush (:class:`gpp_deepspeed.schedule.AsyncProgram`). How weights are versioned and updated is the
schedule's :class:`~gpp_deepspeed.schedule.WeightRule` (its registry entry), never its name. What ``train_batch`` returns: the
mean loss of the batch's own micro-batches, each computed by its forward in that call (every
forward of a batch runs in its call; only backwards trail into the next call or the flush).
"""

from __future__ import annotations

import atexit
import weakref

import torch
from deepspeed.runtime.pipe import schedule as ds

from ..errors import GPPConfigError
from ..schedule import AsyncProgram, Program, WeightRule, predicted_updates
from ..schedule.ir import ActionKind as K
from .weights import WeightVersions, check_predictable

__all__ = ["AsyncPipeline", "StashWeights", "PredictWeights", "UpdateWeights", "check_async_options",
           "WEIGHT_INSTRUCTIONS"]


class StashWeights(ds.PipeInstruction):
    """Copy the live weights into a new version, which the next forwards run on.

    Roughly::

        versions[v] = [p.clone() for p in stage.parameters()]
    """

    def __init__(self, version):
        super().__init__(version=version)


class PredictWeights(ds.PipeInstruction):
    """Make version ``v`` the optimizer's prediction of the weights its backward will meet.

    Roughly::

        versions[v] = [p - lr * s * dW(p) for p in stage.parameters()]
    """

    def __init__(self, version):
        super().__init__(version=version)


class UpdateWeights(ds.PipeInstruction):
    """Step the optimizer with version ``v``'s gradient, then free the version.

    Roughly::

        p.grad = versions.pop(v).grad * scale; optimizer.step(); p.grad = None
    """

    def __init__(self, version):
        super().__init__(version=version)


WEIGHT_INSTRUCTIONS = {K.STASH: StashWeights, K.PREDICT: PredictWeights, K.UPDATE: UpdateWeights}


def check_async_options(engine) -> None:
    """Every option an asynchronous schedule cannot honour is an error that names it."""
    spec = engine.schedule_spec
    problems = []
    if engine.zero_optimization_stage() > 0:
        problems.append('"zero_optimization.stage" > 0 (ZeRO partitions the optimizer over data-parallel ranks, '
                        "which these schedules do not have; use stage 0)")
    if engine.bfloat16_enabled() or engine.fp16_enabled():
        problems.append('"bf16"/"fp16" (the weight versions are fp32 copies of the live weights; train in fp32)')
    if engine.gradient_clipping() > 0:
        problems.append(f'"gradient_clipping" = {engine.gradient_clipping()} (clipping by the global norm would '
                        "need every stage's gradient of each micro-batch at once, a pipeline-wide all-reduce per "
                        'update; set "gradient_clipping": 0)')
    if engine.grid.data_parallel_size > 1:
        problems.append(f"data parallelism ({engine.grid.data_parallel_size} replicas per stage; use a pipeline "
                        "of world size = number of stages)")
    if engine.module.activation_checkpoint_interval > 0:
        problems.append('"activation_checkpoint_interval" > 0 (recomputation would run on the live weights, not '
                        "the forward's version)")
    if engine.module.tied_comms:
        problems.append("tied layers across stages (each stage updates on its own clock)")
    graph = engine.stage_graph
    if graph.frozen or not all(e.grad for e in graph.edges):
        problems.append(f"frozen layers (stages {sorted(graph.frozen)} or edges without gradients; the "
                        "asynchronous schedules run a backward on every stage of every micro-batch)")
    if engine.lr_scheduler is not None:
        problems.append("an lr scheduler (updates happen per micro-batch inside the pipeline)")
    if problems:
        raise GPPConfigError(f'schedule "{spec.name}" cannot honour: ' + "; ".join(problems))
    if spec.weights is WeightRule.PREDICT:
        check_predictable(engine.optimizer)


class AsyncPipeline:
    """Which program of the asynchronous schedule a stage runs next (see module docstring)."""

    def __init__(self, engine):
        self.spec = engine.schedule_spec
        self.stage_graph = engine.stage_graph
        self.stage_idx = engine.stage_id
        self.versions = WeightVersions(engine.module)
        self.batches = 0                      # batches trained since the pipeline was last empty
        self.micro_batches: int | None = None
        self.validate = engine.gpp_config.validate_schedule
        self.report = None
        self.programs: AsyncProgram | None = None
        self.in_batch = False                 # a train_batch or flush started and has not returned
        atexit.register(_flush_at_exit, weakref.ref(engine))

    def program(self, micro_batches: int, *, flush: bool) -> Program:
        """The program of the next batch, or of the flush."""
        if micro_batches != self.micro_batches:
            if self.batches:
                raise GPPConfigError(f'schedule "{self.spec.name}": the number of micro-batches changed from '
                                     f"{self.micro_batches} to {micro_batches} while the pipeline is full; call "
                                     "engine.flush() first")
            self.programs = AsyncProgram(self.stage_graph, micro_batches, schedule=self.spec.name)
            if self.validate:
                self.report = self.programs.validate()
        self.micro_batches = micro_batches
        return self.programs.flush(self.batches) if flush else self.programs.batch(self.batches)

    def steps(self, version: int) -> int:
        """PipeOptim's ``s`` for a version (checked against the program by the validator)."""
        return predicted_updates(self.stage_graph, self.stage_idx, version)

    def update_scale(self) -> float:
        """DeepSpeed scales every micro-batch's loss by ``1/M``: an update per micro-batch
        (PipeDream, PipeOptim) steps with one micro-batch's gradient (times ``M``), an update per
        batch (2BW) with the batch's mean (as accumulated)."""
        return 1.0 if self.spec.weights.updates_per_batch else float(self.micro_batches)


def _flush_at_exit(engine_ref) -> None:
    """Drain the pipeline at interpreter exit, so the last micro-batches' updates are not lost; only
    while the process group lives and no batch was cut short by an error (a peer that died would
    leave this rank waiting until ``p2p_timeout_s``)."""
    engine = engine_ref()
    if engine is None or engine._async is None or engine._async.in_batch or not torch.distributed.is_initialized():
        return
    engine.flush()


def exec_stash(engine, version):
    engine._async.versions.stash(version)


def exec_predict(engine, version):
    engine._async.versions.predict(version, engine.optimizer, engine._async.steps(version))


def exec_update(engine, version):
    pipeline = engine._async
    pipeline.versions.update(version, engine.optimizer, scale=pipeline.update_scale(),
                             keep_grads=pipeline.spec.weights is WeightRule.PREDICT)
