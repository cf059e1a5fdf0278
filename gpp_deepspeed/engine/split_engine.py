"""The engine's ``I`` and ``W`` handlers: a split backward inside DeepSpeed's pipeline engine.

:class:`SplitBackwardMixin` adds two instructions to :class:`GraphPipelineEngine`'s dispatch
table, for the zero-bubble schedules (:mod:`gpp_deepspeed.schedule.zero_bubble`):

``BackwardInputPass`` (action ``I``)
    Gradients of the stage's inputs only (:func:`.split_backward.backward_input`); the following
    ``SEND_B`` actions send them. On the output stage the loss is scaled exactly as
    ``DeepSpeedEngine.backward`` scales it (``1 / gradient_accumulation_steps``, ZeRO's loss scale).
``BackwardWeightPass`` (action ``W``)
    The parameter gradients the ``I`` of the same micro-batch left, accumulated into ``.grad``
    through autograd, as a fused backward does, followed by what DeepSpeed runs after a backward
    (bf16's high-precision accumulation; on the output stage, ``_backward_epilogue``).

A stage with no input that needs a gradient (it reads only the batch) has nothing to send: its
``I`` hands its ``W`` what a fused backward reads, and its ``W`` is the fused backward.

Neither handler frees a buffer: the schedule's releases do (``RELEASE_OUT`` after ``I``, once the
outputs and their gradients are used; ``RELEASE_W`` after ``W``), and what ``W`` needs lives in
the buffer ``weight_grad`` in between.

What the split backward needs of DeepSpeed's private side (the flag that tells its hooks the
engine runs a backward, the backward timers and epilogue, the backward-graph tracker that tells its
output hooks a loss was already scaled) is one named function each in :mod:`.compat`; the rest is
public: ``ZeROOptimizer.scale_if_loss``, ``torch_autocast_z0_gradscaler``, bf16's
``clear_lp_grads`` / ``update_hp_grads``.

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

from dataclasses import dataclass

import torch
from deepspeed.runtime.activation_checkpointing import checkpointing
from deepspeed.runtime.pipe import schedule as ds
from deepspeed.runtime.base_optimizer import ZeROOptimizer

from ..errors import GPPConfigError
from . import compat
from .flat import flatten
from ..nn.split_backward import backward_input

__all__ = ["BackwardInputPass", "BackwardWeightPass", "SplitBackwardMixin", "check_split_backward_supported",
           "recompute", "use_split_backward_recompute"]


@dataclass(frozen=True)
class _Fused:
    """What the ``W`` of a micro-batch without input gradients needs: a whole backward's inputs."""

    outputs: tuple
    grads: dict | None
    loss: object


class BackwardInputPass(ds.BufferOpInstruction):
    """Gradients of the stage's inputs for one micro-batch.

    Roughly::

        inputs.grad = autograd(outputs -> inputs, grads[buffer_id])   # weights untouched
        weight_grad[buffer_id] = what W needs
    """


class BackwardWeightPass(ds.BufferOpInstruction):
    """Gradients of the stage's parameters for the micro-batch whose ``I`` ran.

    Roughly::

        params.grad += autograd(boundary nodes -> params, recorded grads)
    """


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


class SplitBackwardMixin:
    """``I`` and ``W`` handlers for :class:`~gpp_deepspeed.engine.GraphPipelineEngine`."""

    def _exec_backward_input_pass(self, buffer_id):
        inputs = [t for t in self.pipe_buffers["inputs"][buffer_id] or () if t.requires_grad]
        outputs, grads = self.pipe_buffers["outputs"][buffer_id], self.pipe_buffers["grads"][buffer_id]
        loss = self.pipe_buffers["losses"][buffer_id]
        if not inputs:
            self.pipe_buffers["weight_grad"][buffer_id] = _Fused(outputs, grads, loss)
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        with compat.engine_backward(self):
            if self.is_last_stage():
                work = self._loss_backward_input(loss, inputs, params)
            else:
                pairs = output_gradient_pairs(outputs, grads)
                work = backward_input([t for t, _ in pairs], [g for _, g in pairs], inputs=inputs, params=params)
        compat.stop_started_backward_timers(self)
        self.pipe_buffers["weight_grad"][buffer_id] = work

    def _exec_backward_weight_pass(self, buffer_id):
        work = self.pipe_buffers["weight_grad"][buffer_id]
        if isinstance(work, _Fused):
            self._full_backward(buffer_id, work.outputs, work.grads, work.loss)
            return
        self._parameter_gradient_pass(work.run, output_stage=self.is_last_stage())
        self._reduce_micro_batch()  # ZeRO-2/3: this micro-batch's gradients into the partitions

    def _parameter_gradient_pass(self, run, *, output_stage: bool = False) -> None:
        """Run ``run``, an autograd pass writing parameter gradients, as ``DeepSpeedEngine.backward``
        brackets one: bf16's low-precision gradients cleared before. After it, on the output stage,
        the rest of ``DeepSpeedEngine.backward(loss)`` (its timers and epilogue); on any other stage
        the backward timers that DeepSpeed's output hooks started are stopped and bf16's gradients
        handed to its fp32 accumulation (the epilogue, which would do both, is skipped: the
        all-reduce belongs to ``REDUCE_GRAD``)."""
        if self.using_bf16_optimizer:
            self.optimizer.clear_lp_grads()
        with compat.engine_backward(self):
            run()
        if output_stage:
            compat.start_stopped_backward_timers(self)
            compat.backward_epilogue(self)
            return
        compat.stop_started_backward_timers(self)
        if compat.hp_grads_deferred(self):
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    def _reentrant_activation_checkpointing(self):
        """Whether loaded inputs must require grad for the checkpoint function: only for a
        reentrant one (DeepSpeed counts every function but its own non-reentrant one as such)."""
        return (self.module.activation_checkpoint_interval > 0
                and self.module.activation_checkpoint_func not in (checkpointing.non_reentrant_checkpoint, recompute))

    # -- DeepSpeed 0.19.8 internals ----------------------------------------------------------------

    def _loss_backward_input(self, loss, inputs, params):
        """``I`` on the output stage: the loss scaled as ``DeepSpeedEngine.backward`` scales it,
        with the graph registered as loss-scaled so the output hooks do not divide again."""
        loss = loss / self.gradient_accumulation_steps()
        if isinstance(self.optimizer, ZeROOptimizer):
            loss = self.optimizer.scale_if_loss(loss)
        elif self.torch_autocast_z0_gradscaler:
            loss = self.torch_autocast_z0_gradscaler.scale(loss)
        tracker = compat.backward_graph_tracker()
        state = tracker.new_state()
        hook = loss.register_hook(lambda grad: tracker.register_current_graph(grad, state))
        try:
            return backward_input([loss], [None], inputs=inputs, params=params)
        finally:
            hook.remove()
            tracker.unregister(state)

    _SPLIT_INSTRUCTIONS = {BackwardInputPass: _exec_backward_input_pass,
                           BackwardWeightPass: _exec_backward_weight_pass}
