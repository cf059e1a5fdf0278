"""DeepSpeed pipe instructions for a stage program, and the PipeSchedule that yields them.

The engine dispatches instructions by exact type (DeepSpeed's ``_INSTRUCTION_MAP``). Every action
kind of the schedule's table :data:`~gpp_deepspeed.schedule.KINDS` has one instruction class here,
in one table, :data:`INSTRUCTION_OF`; what the instruction is given follows from the kind's
:class:`~gpp_deepspeed.schedule.ir.KindSpec`:

* every transfer, alone or grouped (``P2P``), layouts included, is one :class:`Transfers` holding
  ``(kind, slot, peer)`` per message: one handler, one timing path;
* a release is a :class:`Release` naming its kind, whose handler frees what the table says it
  frees;
* a weight-version action is given the version (its micro-batch index names one);
* any other action on a micro-batch is given the micro-batch's buffer slot.

:class:`GraphPipeSchedule` maps each :class:`~gpp_deepspeed.schedule.Action` of the stage
one-to-one to an instruction, with the buffer slot the schedule gave its micro-batch
(:func:`~gpp_deepspeed.schedule.assign_buffers`): the engine runs exactly the list that was validated.
"""

from __future__ import annotations

import functools
import time

from deepspeed.runtime.pipe import schedule as ds

from ..schedule.ir import Action, ActionKind as K
from . import asynchronous as _async

__all__ = ["Transfers", "Release", "WaitSends", "BackwardInputPass", "BackwardWeightPass", "INSTRUCTION_OF",
           "GraphPipeSchedule", "to_instruction"]


class Transfers(ds.PipeInstruction):
    """Post one or several transfers at once and wait for their receives (``batch_isend_irecv``).

    ``ops`` holds ``(kind, buffer_id, peer)`` per transfer, ``kind`` an ``ActionKind`` transfer.

    Roughly::

        batch_isend_irecv([send or recv of op for op in ops]); wait(receives)
    """

    def __init__(self, ops):
        super().__init__(ops=tuple(ops))


class Release(ds.BufferOpInstruction):
    """Free what a release action frees of one buffer slot.

    Roughly::

        for buffer in kind.spec.frees: pipe_buffers[buffer][buffer_id] = None
    """

    def __init__(self, buffer_id, kind):
        super().__init__(buffer_id, kind=kind)


class WaitSends(ds.PipeInstruction):
    """Wait until every asynchronous send of this stage has completed."""


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


INSTRUCTION_OF: dict[K, type[ds.PipeInstruction]] = {
    K.LOAD: ds.LoadMicroBatch, K.FORWARD: ds.ForwardPass, K.BACKWARD: ds.BackwardPass,
    K.BACKWARD_INPUT: BackwardInputPass, K.BACKWARD_WEIGHT: BackwardWeightPass,
    **{k: Transfers for k in K if k.is_transfer},
    **{k: Release for k in K if k.is_release},
    K.WAIT_SENDS: WaitSends, K.REDUCE_TIED: ds.ReduceTiedGrads, K.REDUCE_GRAD: ds.ReduceGrads,
    K.STEP: ds.OptimizerStep,
    K.STASH: _async.StashWeights, K.PREDICT: _async.PredictWeights, K.PREDICT_INPLACE: _async.PredictInPlace,
    K.RESTORE: _async.RestoreWeights, K.RETIRE: _async.RetireVersion, K.UPDATE: _async.UpdateWeights,
}
"""The instruction class of every action kind (a test checks that none is missing)."""


def to_instruction(action: Action, slot_of: dict[int, int]) -> ds.PipeInstruction:
    """The DeepSpeed instruction that executes ``action``; ``slot_of`` maps micro-batches to buffers."""
    slots = tuple(slot_of[j] if not action.kind.spec.version else None for j in action.mb_idxs)
    return _instruction(action, slots)


@functools.lru_cache(maxsize=8192)
def _instruction(action: Action, slots: tuple) -> ds.PipeInstruction:
    """The instruction of ``action`` whose micro-batches (``action.mb_idxs``) sit in ``slots``: made
    once, then the same object every batch (handlers only read an instruction's arguments), which
    keeps building instructions out of the cost of an action."""
    slot_of = dict(zip(action.mb_idxs, slots))
    cls = INSTRUCTION_OF[action.kind]
    if action.kind.is_transfer:
        return Transfers((op.kind, slot_of[op.mb_idx], op.peer) for op in action.parts)
    if not action.kind.has_mb or action.mb_idx is None:
        return cls()
    if action.kind.spec.version:   # weight versions are named by micro-batch, not buffer
        return cls(action.mb_idx)
    if action.kind.is_release:
        return Release(slot_of[action.mb_idx], action.kind)
    return cls(slot_of[action.mb_idx])


class GraphPipeSchedule(ds.PipeSchedule):
    """Yields one stage's actions as DeepSpeed instructions, one step per action.

    With ``record`` (a list), every action is appended with its start and end time
    (``time.perf_counter``): the engine runs a step's instruction between yielding it and asking
    for the next one, so the generator itself can time it without touching the engine's loop.
    """

    def __init__(self, actions: list[Action], *, micro_batches: int, stages: int, stage_id: int,
                 slot_of: dict[int, int], record: list | None = None):
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.actions = actions
        self._slot_of = slot_of
        self._num_buffers = max(slot_of.values(), default=0) + 1
        self._record = record

    def num_pipe_buffers(self) -> int:
        return self._num_buffers

    def steps(self):
        for action in self.actions:
            start = time.perf_counter()
            yield [to_instruction(action, self._slot_of)]
            if self._record is not None:
                self._record.append((action, start, time.perf_counter()))
