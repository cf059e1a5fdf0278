"""DeepSpeed pipe instructions for DAG edges, and the PipeSchedule that yields a stage's actions.

The engine dispatches instructions by exact type, so each DAG transfer has its own class with the
peer stage as an argument, a grouped transfer (``P2P``) is a :class:`Transfers` holding its ops, and
each release its own class. :class:`GraphPipeSchedule` maps each :class:`~gpp_deepspeed.schedule.Action`
of the stage one-to-one to an instruction, with the buffer slot the schedule gave its micro-batch
(:func:`~gpp_deepspeed.schedule.assign_buffers`): the engine runs exactly the list that was validated.
"""

from __future__ import annotations

import time

from deepspeed.runtime.pipe import schedule as ds

from ..schedule.ir import Action, ActionKind as K
from .split_engine import BackwardInputPass, BackwardWeightPass
from .asynchronous import WEIGHT_INSTRUCTIONS

__all__ = ["SendActivationTo", "RecvActivationFrom", "SendGradTo", "RecvGradFrom", "Transfers", "ReleaseInputs",
           "ReleaseOutputs", "WaitSends", "GraphPipeSchedule", "to_instruction"]


class SendActivationTo(ds.BufferOpInstruction):
    """Post asynchronous sends of this stage's tensors on the edge to ``peer``.

    Roughly::

        isend(outputs[buffer_id][t] for t in edge(stage, peer).tensors)
    """

    def __init__(self, buffer_id, peer):
        super().__init__(buffer_id, peer=peer)


class RecvActivationFrom(ds.BufferOpInstruction):
    """Receive the tensors of the edge from ``peer`` (blocking).

    Roughly::

        received[buffer_id].update(recv(edge(peer, stage)))
    """

    def __init__(self, buffer_id, peer):
        super().__init__(buffer_id, peer=peer)


class SendGradTo(ds.BufferOpInstruction):
    """Post asynchronous sends of the gradients of the tensors received from ``peer``."""

    def __init__(self, buffer_id, peer):
        super().__init__(buffer_id, peer=peer)


class RecvGradFrom(ds.BufferOpInstruction):
    """Receive the gradients of the tensors sent to ``peer`` and add them to this buffer's
    output gradients (a tensor read by several stages gets the sum of their gradients)."""

    def __init__(self, buffer_id, peer):
        super().__init__(buffer_id, peer=peer)


class Transfers(ds.PipeInstruction):
    """Post several transfers at once and wait for their receives (``batch_isend_irecv``).

    ``ops`` holds ``(kind, buffer_id, peer)`` per transfer, ``kind`` an ``ActionKind`` transfer.

    Roughly::

        batch_isend_irecv([send or recv of op for op in ops]); wait(receives)
    """

    def __init__(self, ops):
        super().__init__(ops=tuple(ops))


class ReleaseInputs(ds.BufferOpInstruction):
    """Free a buffer's loaded and received tensors (and the stage's flat inputs)."""


class ReleaseOutputs(ds.BufferOpInstruction):
    """Free a buffer's outputs, output gradients, labels and loss."""


class WaitSends(ds.PipeInstruction):
    """Wait until every asynchronous send of this stage has completed."""


_SIMPLE = {K.WAIT_SENDS: WaitSends, K.REDUCE_TIED: ds.ReduceTiedGrads, K.REDUCE_GRAD: ds.ReduceGrads,
           K.STEP: ds.OptimizerStep}
_BUFFER = {K.LOAD: ds.LoadMicroBatch, K.FORWARD: ds.ForwardPass, K.BACKWARD: ds.BackwardPass,
           K.BACKWARD_INPUT: BackwardInputPass, K.BACKWARD_WEIGHT: BackwardWeightPass,
           K.RELEASE_IN: ReleaseInputs, K.RELEASE_OUT: ReleaseOutputs}
_EDGE = {K.SEND_F: SendActivationTo, K.RECV_F: RecvActivationFrom, K.SEND_B: SendGradTo, K.RECV_B: RecvGradFrom}


def to_instruction(action: Action, slot_of: dict[int, int]) -> ds.PipeInstruction:
    """The DeepSpeed instruction that executes ``action``; ``slot_of`` maps micro-batches to buffers."""
    if action.kind in _SIMPLE:
        return _SIMPLE[action.kind]()
    if action.kind in WEIGHT_INSTRUCTIONS:  # weight versions are named by micro-batch, not buffer
        return WEIGHT_INSTRUCTIONS[action.kind](action.mb_idx)
    if action.kind is K.P2P:
        return Transfers((op.kind, slot_of[op.mb_idx], op.peer) for op in action.ops)
    buffer_id = slot_of[action.mb_idx]
    if action.kind in _BUFFER:
        return _BUFFER[action.kind](buffer_id)
    return _EDGE[action.kind](buffer_id, action.peer)


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
