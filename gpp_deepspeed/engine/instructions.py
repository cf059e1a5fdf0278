"""DeepSpeed pipe instructions for a stage program, and the PipeSchedule that yields them.

The engine dispatches instructions by exact type (DeepSpeed's ``_INSTRUCTION_MAP``). Every action
kind of the schedule's table :data:`~gpp_deepspeed.schedule.KINDS` has one instruction class here,
in one table, :data:`INSTRUCTION_OF`; what the instruction is given follows from the kind's
:class:`~gpp_deepspeed.schedule.ir.KindSpec`:

* every transfer, alone or grouped (``P2P``), layouts included, is one :class:`Transfers` holding
  ``(kind, slot, peer, stage)`` per message: one handler, one timing path (a group of a rank
  holding several stages may hold several stages' transfers);
* a hand-over between two stages of one rank is a :class:`HandOver` naming both and their slots;
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

__all__ = ["Transfers", "HandOver", "Release", "WaitSends", "BackwardInputPass", "BackwardWeightPass", "INSTRUCTION_OF",
           "GraphPipeSchedule", "to_instruction"]


class Transfers(ds.PipeInstruction):
    """Post one or several transfers at once and wait for their receives (``batch_isend_irecv``).

    ``ops`` holds ``(kind, buffer_id, peer, stage)`` per transfer, ``kind`` an ``ActionKind``
    transfer of ``stage`` (the rank's stage whose buffer it is).

    Roughly::

        batch_isend_irecv([send or recv of op for op in ops]); wait(receives)
    """

    def __init__(self, ops):
        super().__init__(ops=tuple(ops))


class HandOver(ds.PipeInstruction):
    """``HAND_F`` or ``HAND_B`` (``kind``): ``stage`` (slot ``buffer_id``) takes from ``peer``
    (slot ``peer_buffer_id``), a stage of the same rank, what a receive would have brought.

    Roughly::

        HAND_F: received[stage] := detach(outputs[peer] on the edge)
        HAND_B: grads[stage] += input gradients of received[peer] on the edge
    """

    def __init__(self, kind, stage, buffer_id, peer, peer_buffer_id):
        super().__init__(kind=kind, stage=stage, buffer_id=buffer_id, peer=peer, peer_buffer_id=peer_buffer_id)


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
    K.HAND_F: HandOver, K.HAND_B: HandOver,
    K.WAIT_SENDS: WaitSends, K.REDUCE_TIED: ds.ReduceTiedGrads, K.REDUCE_GRAD: ds.ReduceGrads,
    K.STEP: ds.OptimizerStep,
    K.STASH: _async.StashWeights, K.PREDICT: _async.PredictWeights, K.PREDICT_INPLACE: _async.PredictInPlace,
    K.RESTORE: _async.RestoreWeights, K.RETIRE: _async.RetireVersion, K.UPDATE: _async.UpdateWeights,
}
"""The instruction class of every action kind (a test checks that none is missing)."""


def to_instruction(action: Action, slots: dict[int, dict[int, int]]) -> ds.PipeInstruction:
    """The DeepSpeed instruction that executes ``action``; ``slots[stage][mb]`` is the buffer
    slot of a micro-batch on a stage (:attr:`~gpp_deepspeed.schedule.Program.slots`)."""
    key = tuple(None if op.mb_idx is None or op.kind.spec.version else slots[op.stage_idx][op.mb_idx]
                for op in action.parts)
    if action.kind.spec.hand_over:
        key += (slots[action.peer][action.mb_idx], )
    return _instruction(action, key)


@functools.lru_cache(maxsize=8192)
def _instruction(action: Action, slots: tuple) -> ds.PipeInstruction:
    """The instruction of ``action`` whose parts' micro-batches sit in ``slots`` (a hand-over's
    peer slot last): made once, then the same object every batch (handlers only read an
    instruction's arguments), which keeps building instructions out of the cost of an action."""
    cls = INSTRUCTION_OF[action.kind]
    if action.kind.is_transfer:
        return Transfers((op.kind, slot, op.peer, op.stage_idx) for op, slot in zip(action.parts, slots))
    if action.kind.spec.hand_over:
        return HandOver(action.kind, action.stage_idx, slots[0], action.peer, slots[1])
    if not action.kind.has_mb or action.mb_idx is None:
        return cls()
    if action.kind.spec.version:   # weight versions are named by micro-batch, not buffer
        return cls(action.mb_idx)
    if action.kind.is_release:
        return Release(slots[0], action.kind)
    return cls(slots[0])


class GraphPipeSchedule(ds.PipeSchedule):
    """Yields one rank's actions as DeepSpeed instructions, one step per action.

    ``slots`` is the program's buffer slot of every micro-batch on every stage; ``enter(stage)``,
    if given, is called before each action with the stage it names (a rank holding several stages
    switches to that stage's buffers and layers) and ``enter(None)`` once the list is done. With
    ``record`` (a list), every action is appended with its start and end time
    (``time.perf_counter``): the engine runs a step's instruction between yielding it and asking
    for the next one, so the generator itself can time it without touching the engine's loop.
    """

    def __init__(self, actions: list[Action], *, micro_batches: int, stages: int, stage_id: int,
                 slots: dict[int, dict[int, int]], record: list | None = None, enter=None):
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.actions = actions
        self._slots = slots
        self._num_buffers = max((k for s in {a.stage_idx for a in actions} for k in slots[s].values()),
                                default=0) + 1
        self._record = record
        self._enter = enter

    def num_pipe_buffers(self) -> int:
        return self._num_buffers

    def steps(self):
        enter = self._enter
        for action in self.actions:
            start = time.perf_counter()
            if enter is not None:
                enter(action.stage_idx)
            yield [to_instruction(action, self._slots)]
            if self._record is not None:
                self._record.append((action, start, time.perf_counter()))
        if enter is not None:
            enter(None)
