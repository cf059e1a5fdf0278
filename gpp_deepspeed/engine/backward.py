"""A stage's backward: ``B``, the split backward's ``I`` and ``W``, and the bracket every
parameter-gradient pass runs in, in one room.

:class:`StageBackward` is owned by :class:`~.engine.GraphPipelineEngine` (``engine.backward``);
the engine's dispatch table hands it the three backward instructions:

``B`` (:meth:`StageBackward.full`)
    Input and parameter gradients in one autograd pass. On the output stage it is DeepSpeed's own
    ``backward(loss)`` (loss scaled by ``1 / gradient_accumulation_steps`` and ZeRO's loss scale,
    its timers and epilogue); elsewhere one pass from every output that received a gradient
    (summed over the stages that read it). An asynchronous schedule's backward runs on its
    forward's weight version.
``I`` (:meth:`StageBackward.input`)
    Gradients of the stage's inputs only (:func:`gpp_deepspeed.nn.split_backward.backward_input`), which the
    following ``SEND_B`` actions send; what ``W`` needs stays in the buffer ``weight_grad``. On the
    output stage the loss is scaled exactly as ``DeepSpeedEngine.backward`` scales it.
``W`` (:meth:`StageBackward.weight`)
    The parameter gradients ``I`` left, accumulated into ``.grad`` through autograd, as a fused
    backward does.

Every parameter-gradient pass (``B``, ``W``) ends in :meth:`StageBackward._gradients`, the one
place that calls ZeRO-2/3's per-micro-batch reduction (:meth:`.zero.StageZero.reduce_micro_batch`).
A stage with nothing to send back has no ``I``: the schedule's ``merge_backward`` pass gives it
one ``B`` where its ``W`` was (torch's ``_merge_bw``), so the simulator prices what runs.

Neither ``I`` nor ``W`` frees a buffer: the schedule's releases do (``RELEASE_OUT`` after ``I``,
once the outputs and their gradients are used; ``RELEASE_W`` after ``W``).

What the backward needs of DeepSpeed's private side (the flag that tells its hooks the engine runs
a backward, the backward timers and epilogue, the backward-graph tracker that tells its output
hooks a loss was already scaled, its pipeline backward) is one named function each in
:mod:`.compat`; the rest is public: ``ZeROOptimizer.scale_if_loss``,
``torch_autocast_z0_gradscaler``, bf16's ``clear_lp_grads`` / ``update_hp_grads``.

Activation checkpointing: DeepSpeed's default checkpoint is reentrant, and a reentrant checkpoint
refuses an autograd pass restricted to some inputs (``inputs=``), which is what ``I`` is; so does
DeepSpeed's ``non_reentrant_checkpoint`` (it checks ``torch.autograd._is_checkpoint_valid()``
before recomputing). Under a split schedule a stage that recomputes (``activation_checkpoint_interval
> 0``, or a plan's recompute mark) runs its chunks under torch's non-reentrant checkpoint
(:func:`recompute`): the forward keeps each chunk's inputs only, and the first saved tensor that
``I`` needs recomputes the chunk. ``W`` is another autograd pass and recomputes again, as far as
the tensors it reads (torch recomputes once per backward call): up to two recomputations of a
micro-batch instead of 1F1B's one, and between ``I`` and ``W`` nothing more than what ``W`` reads
stays alive. A configuration that asks for the reentrant function (``"pipeline": {"use_reentrant":
true}``) or a checkpoint function of its own is refused at construction.
"""

from __future__ import annotations

import contextlib

import torch
from deepspeed.runtime.activation_checkpointing import checkpointing
from deepspeed.runtime.base_optimizer import ZeROOptimizer

from ..errors import GPPConfigError, ScheduleError
from ..schedule.ir import Buffer
from . import compat
from .flat import flatten
from ..nn.split_backward import backward_input

__all__ = ["StageBackward", "check_split_backward_supported", "recompute", "use_split_backward_recompute",
           "reentrant_checkpointing"]


def recompute(function, *args):
    """Torch's non-reentrant activation checkpoint, with the signature of DeepSpeed's
    ``activation_checkpoint_func``: the one a split backward can run (see the module docstring)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def check_split_backward_supported(spec, module, pipeline_config: dict | None = None) -> None:
    """Refuse, before any communication, what a split backward cannot run (``spec``: the
    schedule's :class:`~gpp_deepspeed.schedule.ScheduleSpec`): activation checkpointing with a
    reentrant or user-supplied checkpoint function."""
    pipeline_config = pipeline_config or {}
    interval = max(getattr(module, "activation_checkpoint_interval", 0),
                   pipeline_config.get("activation_checkpoint_interval", 0) or 0)
    if not spec.splits_backward or interval <= 0:
        return
    if pipeline_config.get("use_reentrant") is True:
        raise GPPConfigError(
            f'graph_pipeline.schedule "{spec.name}" splits the backward into input and weight gradients, which a '
            'reentrant activation checkpoint cannot do; drop "pipeline.use_reentrant": true (the stage then '
            f"recomputes with torch's non-reentrant checkpoint) or use schedule \"1f1b\"")
    func = getattr(module, "activation_checkpoint_func", checkpointing.checkpoint)
    if func not in (checkpointing.checkpoint, checkpointing.non_reentrant_checkpoint, recompute):
        raise GPPConfigError(
            f'graph_pipeline.schedule "{spec.name}" recomputes activations with torch\'s non-reentrant checkpoint '
            f"(the only kind an input-gradient-only backward can run), not with activation_checkpoint_func="
            f"{getattr(func, '__qualname__', func)!r}; leave activation_checkpoint_func at its default or use "
            'schedule "1f1b"')


def output_gradient_pairs(outputs, grads) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output, gradient) for every output of a stage that received a gradient (``grads`` maps a
    flat output index to its gradient, summed over readers) and takes part in autograd."""
    flat, _ = flatten(outputs)
    return [(flat[i], g) for i, g in sorted((grads or {}).items()) if flat[i].requires_grad]


def use_split_backward_recompute(engine) -> None:
    """Make a stage that recomputes under a split schedule use :func:`recompute` (once the
    parent constructor has set the module's interval and function from the config)."""
    module = engine.module
    if engine.schedule_spec.splits_backward and module.activation_checkpoint_interval > 0:
        module.activation_checkpoint_func = recompute
        compat.precompute_checkpointable_values(module)


def reentrant_checkpointing(module) -> bool:
    """Whether ``module`` recomputes with a reentrant checkpoint function, whose loaded inputs must
    require grad (DeepSpeed counts every function but its own non-reentrant one as such)."""
    return (module.activation_checkpoint_interval > 0
            and module.activation_checkpoint_func not in (checkpointing.non_reentrant_checkpoint, recompute))


def fp16_scaled(engine, loss):
    """``loss`` times the fp16 optimizer's loss scale under fp16 without ZeRO, else ``loss``.

    DeepSpeed 0.19.8's ``engine.backward`` scales the loss for its ZeRO optimizers and torch
    autocast only; with fp16 and ZeRO stage 0 (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``) it
    calls ``loss.backward()`` on the unscaled loss while the optimizer's ``step`` still divides the
    gradients by its loss scale: every update is ``1 / loss_scale`` of what it should be, silently
    (deepspeedai/DeepSpeed#8393, open). The output stage's backward scales it here by the
    optimizer's public ``loss_scale``, as that optimizer's own ``backward(loss)`` does; the other
    stages' gradients arrive scaled."""
    scale = getattr(engine.optimizer, "loss_scale", None) if engine.fp16_enabled() else None
    if scale is None or isinstance(engine.optimizer, ZeROOptimizer) or engine.torch_autocast_z0_gradscaler:
        return loss
    return loss * scale


class StageBackward:
    """``B``, ``I`` and ``W`` of one rank's stage, run on ``engine``'s buffers (module docstring)."""

    def __init__(self, engine):
        self.engine = engine

    def full(self, slot: int) -> None:
        """``B``: input and parameter gradients of one micro-batch in one autograd pass."""
        engine, buffers = self.engine, self.engine.pipe_buffers
        # An asynchronous schedule's backward runs on its forward's weight version (a recomputed
        # forward included).
        versions = (engine._async.versions.on_version_of(slot) if engine._async is not None
                    else contextlib.nullcontext())
        with versions:
            if engine.is_last_stage():
                engine.loss = fp16_scaled(engine, buffers[Buffer.LOSS, slot])
                self._gradients(lambda: compat.pipeline_backward_pass(engine, slot), deepspeed=True)
                return
            pairs = output_gradient_pairs(buffers[Buffer.OUTPUTS, slot], buffers[Buffer.GRADS, slot])
            self._gradients((lambda: torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs]))
                            if pairs else None)

    def input(self, slot: int) -> None:
        """``I``: gradients of the stage's inputs only; what ``W`` needs goes to ``weight_grad``."""
        engine, buffers = self.engine, self.engine.pipe_buffers
        inputs = [t for t in buffers[Buffer.INPUTS, slot] or () if t.requires_grad]
        if not inputs:
            raise ScheduleError(f"stage {engine.stage} runs an input-gradient pass (I) but none of its inputs "
                                "needs a gradient; a program for such a stage runs B (lower it with merge_backward)")
        params = [p for p in engine.module.stage_parameters(engine.stage) if p.requires_grad]
        with compat.engine_backward(engine):
            if engine.is_last_stage():
                work = self._loss_backward_input(buffers[Buffer.LOSS, slot], inputs, params)
            else:
                pairs = output_gradient_pairs(buffers[Buffer.OUTPUTS, slot], buffers[Buffer.GRADS, slot])
                work = backward_input([t for t, _ in pairs], [g for _, g in pairs], inputs=inputs, params=params)
        compat.stop_started_backward_timers(engine)
        buffers[Buffer.WEIGHT_GRAD, slot] = work

    def weight(self, slot: int) -> None:
        """``W``: the parameter gradients that the micro-batch's ``I`` left."""
        self._gradients(self.engine.pipe_buffers[Buffer.WEIGHT_GRAD, slot].run)

    def _gradients(self, run, *, deepspeed: bool = False) -> None:
        """Every parameter-gradient pass of the stage: ``run`` (``None``: no output received a
        gradient) in the bracket ``DeepSpeedEngine.backward`` puts a backward in (``deepspeed``:
        ``run`` is DeepSpeed's own backward, which brackets itself), then ZeRO-2/3's reduction of
        the micro-batch's gradients into the partitions."""
        if deepspeed:
            run()
        elif run is not None:
            self._bracketed(run)
        self.engine.zero.reduce_micro_batch()

    def _bracketed(self, run) -> None:
        """Run ``run``, an autograd pass writing parameter gradients, as ``DeepSpeedEngine.backward``
        brackets one: bf16's low-precision gradients cleared before. After it, on the output stage,
        the rest of ``DeepSpeedEngine.backward(loss)`` (its timers and epilogue); on any other stage
        the backward timers that DeepSpeed's output hooks started are stopped and bf16's gradients
        handed to its fp32 accumulation (the epilogue, which would do both, is skipped: the
        all-reduce belongs to ``REDUCE_GRAD``)."""
        engine = self.engine
        if engine.using_bf16_optimizer:
            engine.optimizer.clear_lp_grads()
        with compat.engine_backward(engine):
            run()
        if engine.is_last_stage():
            compat.start_stopped_backward_timers(engine)
            compat.backward_epilogue(engine)
            return
        compat.stop_started_backward_timers(engine)
        if compat.hp_grads_deferred(engine):
            engine.optimizer.update_hp_grads(clear_lp_grads=False)

    def _loss_backward_input(self, loss, inputs, params):
        """``I`` on the output stage: the loss scaled as ``DeepSpeedEngine.backward`` scales it,
        with the graph registered as loss-scaled so the output hooks do not divide again."""
        engine = self.engine
        loss = loss / engine.gradient_accumulation_steps()
        if isinstance(engine.optimizer, ZeROOptimizer):
            loss = engine.optimizer.scale_if_loss(loss)
        elif engine.torch_autocast_z0_gradscaler:
            loss = engine.torch_autocast_z0_gradscaler.scale(loss)
        else:
            loss = fp16_scaled(engine, loss)
        tracker = compat.backward_graph_tracker()
        state = tracker.new_state()
        hook = loss.register_hook(lambda grad: tracker.register_current_graph(grad, state))
        try:
            return backward_input([loss], [None], inputs=inputs, params=params)
        finally:
            hook.remove()
            tracker.unregister(state)
