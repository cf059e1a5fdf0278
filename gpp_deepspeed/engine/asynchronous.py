"""The engine side of the asynchronous schedules: which batch of the never-draining program runs
next, the flush, the weight-version instructions, and the options they cannot honour.

:class:`AsyncPipeline` keeps the count of batches trained since the pipeline was last empty, by
which :class:`~gpp_deepspeed.engine.GraphPipelineEngine` asks the schedule's
:class:`gpp_deepspeed.schedule.ProgramFactory` for the program of the next batch, or of the flush,
and what that program carries for the weight actions (PipeOptim's prediction counts). How weights
are versioned and updated is in that program (its weight actions) and the schedule's
:class:`~gpp_deepspeed.schedule.WeightRule` (its registry entry), never its name. What
``train_batch`` returns: the mean loss of the batch's own micro-batches, each computed by its
forward in that call (every forward of a batch runs in its call; only backwards trail into the next
call or the flush).

Replicas of a stage (per-stage degrees, whole-pipeline replicas) run the same program: a
``REDUCE_GRAD`` inside a batch (before each ``UPDATE``) is a collective over the stage's
data-parallel group that every one of its ranks reaches at the same point, so a program that
cannot deadlock on one pipeline cannot on its replicas (run them side by side, action by action).
2BW's ``STEP`` ends a batch on every stage, as in a synchronous schedule.
"""

from __future__ import annotations

import atexit
import os
import weakref

import torch
from deepspeed.runtime.pipe import schedule as ds

from ..errors import GPPConfigError
from ..schedule import Program
from ..checkpoint import layer_optim_file
from .portable import local_layers
from .weights import MasterWeights, WeightVersions

__all__ = ["AsyncPipeline", "StashWeights", "PredictWeights", "PredictInPlace", "RestoreWeights", "RetireVersion",
           "UpdateWeights", "check_async_options", "save_state", "load_state"]


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

        versions[v] = [master(p) - lr * s * dW(p) for p in stage.parameters()]
    """

    def __init__(self, version):
        super().__init__(version=version)


class PredictInPlace(ds.PipeInstruction):
    """Write the prediction over the live weights, keeping a copy of them (PipeOptim's code).

    Roughly::

        saved = [p.clone() for p in params]; p.data = master(p) - lr * s * dW(p); versions[v] = p.data
    """

    def __init__(self, version):
        super().__init__(version=version)


class RestoreWeights(ds.PipeInstruction):
    """Write back the live weights an in-place prediction covered.

    Roughly::

        p.data = saved
    """

    def __init__(self, version):
        super().__init__(version=version)


class RetireVersion(ds.PipeInstruction):
    """Hand version ``v``'s gradient to the live weights, then free the version.

    Roughly::

        p.grad = versions.pop(v).grad * scale; master_grad(p) += p.grad
    """

    def __init__(self, version):
        super().__init__(version=version)


class UpdateWeights(ds.PipeInstruction):
    """One step of this stage's own optimizer with the live (reduced) gradient.

    Roughly::

        optimizer.step(); optimizer.zero_grad()
    """



def check_async_options(engine) -> None:
    """Every option an asynchronous schedule cannot honour is an error that names it.

    A schedule that updates once per batch (2BW) does so in DeepSpeed's own step at the end of a
    batch, where ZeRO-1, clipping by the global norm, the lr scheduler, fp16's loss scale and tied
    weights work as in a synchronous schedule. The ones that update after every micro-batch do so
    on each stage at its own time, which nothing spanning the pipeline can meet.
    """
    spec = engine.schedule_spec
    rule = spec.weights
    problems = []
    per_micro_batch = not rule.updates_per_batch
    if per_micro_batch and engine.zero_optimization_stage() > 0:
        problems.append('"zero_optimization.stage" > 0 (ZeRO\'s step sums the gradient norm over the whole pipeline, '
                        "which stages updating after every micro-batch at their own times never meet; use stage 0 "
                        "(bf16 keeps fp32 master weights, partitioned over the stage's replicas, all the same) or "
                        '"2bw")')
    if not per_micro_batch and engine.zero_optimization_partition_gradients():
        problems.append(f'"zero_optimization.stage" {engine.zero_optimization_stage()} (ZeRO-2/3 take gradients from '
                        "their hooks during a backward, while 2BW hands a retired micro-batch's gradient to the "
                        "optimizer outside any backward, and ZeRO-3's parameters are partitions 2BW cannot stash; "
                        'use stage 1, or a synchronous schedule)')
    if per_micro_batch and engine.fp16_enabled():
        problems.append('"fp16" (the output stage scales a micro-batch\'s loss when it runs its backward, every other '
                        "stage unscales at its own update, micro-batches later, and a dynamic loss scale is moved by "
                        'overflow checks over the whole pipeline; use "bf16", or "2bw")')
    if per_micro_batch and engine.gradient_clipping() > 0:
        problems.append(f'"gradient_clipping" = {engine.gradient_clipping()} (the global norm of one micro-batch\'s '
                        "gradient needs every stage's part of it, but the last stage updates with it before the "
                        'first has computed its own; set "gradient_clipping": 0, or use "2bw")')
    if engine.fp16_enabled() and engine.zero_optimization_stage() == 0:
        problems.append('"fp16" with "zero_optimization.stage" 0 (DeepSpeed 0.19.8\'s engine.backward scales the loss '
                        "only for its ZeRO optimizers, while its stage-0 fp16 optimizers still divide every gradient by "
                        'the loss scale; use stage 1, or "bf16")')
    if rule is rule.PREDICT_INPLACE and engine.module.activation_checkpoint_interval > 0:
        problems.append('"activation_checkpoint_interval" > 0 (the recomputed forward would run on the live weights, '
                        'not on the prediction written over them for the forward; use "pipeoptim")')
    if per_micro_batch and engine.module.tied_comms:
        problems.append("tied layers across stages (each stage updates its copy after every micro-batch at its own "
                        'time, so the copies would drift apart; use "2bw")')
    if per_micro_batch and engine.lr_scheduler is not None:
        problems.append("an lr scheduler (updates happen after every micro-batch, at a different time on each stage; "
                        'use "2bw", whose one update per batch is DeepSpeed\'s step)')
    if problems:
        raise GPPConfigError(f'schedule "{spec.name}" cannot honour: ' + "; ".join(problems))
    if rule.predicts and engine.optimizer is not None:
        MasterWeights(engine.optimizer, []).check_predictable(spec.name)


class AsyncPipeline:
    """Which program of the asynchronous schedule a stage runs next (see module docstring), and
    the stage's weight versions and master weights."""

    def __init__(self, engine):
        self.spec = engine.schedule_spec
        self.stage_idx = engine.stage_id
        self.versions = WeightVersions(engine.module)
        self.masters = MasterWeights(engine.optimizer, self.versions.params)
        self.batches = 0                      # batches trained since the pipeline was last empty
        self.micro_batches: int | None = None
        self.predictions: dict[int, int] = {}  # PipeOptim's s per weight version, from the program
        self.in_batch = False                 # a train_batch or flush started and has not returned
        atexit.register(_flush_at_exit, weakref.ref(engine))

    @property
    def counts_batches(self) -> bool:
        """A batch counts as one of DeepSpeed's steps (``global_steps``) when the schedule's
        updates are the stages' own; 2BW's are DeepSpeed's ``STEP``, which counts itself."""
        return not self.spec.weights.updates_per_batch

    def runs(self, program: Program) -> None:
        """Take the program of the batch (or flush) about to run: its micro-batches and this stage's
        prediction counts."""
        self.micro_batches = program.num_microbatches
        self.predictions = program.predictions.get(self.stage_idx, {})

    def steps(self, version: int) -> int:
        """PipeOptim's ``s`` for a version, as the program carries it (the validator counts it on
        the program)."""
        return self.predictions[version]

    def update_scale(self, version: int, optimizer) -> float:
        """What a retired gradient is multiplied by. DeepSpeed scales every micro-batch's loss by
        ``1/M``: an update per micro-batch (PipeDream, PipeOptim) steps with one micro-batch's
        gradient (times ``M``), an update per batch (2BW) with the batch's mean (as accumulated).
        Under fp16 the loss was scaled by the loss scale of the version's batch, which DeepSpeed's
        step (between that batch and this update) may have moved: the gradient is brought to the
        scale the optimizer will divide by."""
        scale = 1.0 if self.spec.weights.updates_per_batch else float(self.micro_batches)
        return scale * loss_scale(optimizer) / self.versions.loss_scale_of[version]


def loss_scale(optimizer) -> float:
    """The loss scale DeepSpeed's fp16 optimizers multiply the loss by (their public
    ``loss_scale``), 1 for any other optimizer."""
    return float(getattr(optimizer, "loss_scale", 1.0))


def _state_file(ckpt_dir: str, layer: str) -> str:
    return layer_optim_file(ckpt_dir, layer).replace("-optim_states.pt", "-async_states.pt")


def save_state(engine, ckpt_dir: str) -> None:
    """Write what the asynchronous schedule keeps besides the optimizer's state (PipeOptim's newest
    gradient), one file per layer by parameter name, like the layers' optimizer state, so that it
    loads under any layout (the first rank of each stage's data-parallel group writes)."""
    grads = engine._async.versions.newest_grads()
    if not grads or engine.grid.data_parallel_id != 0:
        return
    for name, layer in local_layers(engine):
        state = {pname: grads[id(p)].detach().cpu() for pname, p in layer.named_parameters() if id(p) in grads}
        if state:
            torch.save(state, _state_file(ckpt_dir, name))


def load_state(engine, ckpt_dir: str) -> None:
    """Read what :func:`save_state` wrote for this stage's layers, whatever layout wrote it."""
    grads = {}
    for name, layer in local_layers(engine):
        path = _state_file(ckpt_dir, name)
        if os.path.isfile(path):
            state = torch.load(path, weights_only=True)
            grads.update({id(p): state[pname] for pname, p in layer.named_parameters() if pname in state})
    engine._async.versions.set_newest_grads(grads)


def _flush_at_exit(engine_ref) -> None:
    """Drain the pipeline at interpreter exit, so the last micro-batches' updates are not lost; only
    while the process group lives and no batch was cut short by an error (a peer that died would
    leave this rank waiting until ``p2p_timeout_s``)."""
    engine = engine_ref()
    if engine is None or engine._async is None or engine._async.in_batch or not torch.distributed.is_initialized():
        return
    engine.flush()


def exec_stash(engine, version):
    engine._async.versions.stash(version, loss_scale=loss_scale(engine.optimizer))


def exec_predict(engine, version):
    pipeline = engine._async
    pipeline.versions.predict(version, pipeline.masters, pipeline.steps(version))


def exec_predict_inplace(engine, version):
    pipeline = engine._async
    pipeline.versions.predict_inplace(version, pipeline.masters, pipeline.steps(version))


def exec_restore(engine, version):
    engine._async.versions.restore(version)


def exec_retire(engine, version):
    pipeline = engine._async
    pipeline.versions.retire(version, scale=pipeline.update_scale(version, engine.optimizer))
    pipeline.masters.take_grads()


def exec_update(engine):
    pipeline = engine._async
    if pipeline.spec.weights.predicts and pipeline.masters.reads_newest_grad:   # the newest (reduced) gradient
        pipeline.versions.keep_newest_grads(pipeline.masters)
    pipeline.masters.step()
