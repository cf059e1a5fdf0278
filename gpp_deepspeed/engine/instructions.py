"""DeepSpeed pipe instructions for DAG edges, and the PipeSchedule that yields a stage's actions.

The engine dispatches instructions by exact type, so each DAG transfer has its own class with the
peer stage as an argument. :class:`GraphPipeSchedule` maps each :class:`~gpp_deepspeed.schedule.Action`
of the stage one-to-one to an instruction: the engine runs exactly the list that was validated.
"""

from __future__ import annotations

import time

from deepspeed.runtime.pipe import schedule as ds

from ..schedule.ir import Action, ActionKind as K
from .split_engine import BackwardInputPass, BackwardWeightPass
from .asynchronous import WEIGHT_INSTRUCTIONS

__all__ = ["SendActivationTo", "RecvActivationFrom", "SendGradTo", "RecvGradFrom", "WaitSends",
           "GraphPipeSchedule", "to_instruction"]


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


class WaitSends(ds.PipeInstruction):
    """Wait until every asynchronous send of this stage has completed."""


_SIMPLE = {K.WAIT_SENDS: WaitSends, K.REDUCE_TIED: ds.ReduceTiedGrads, K.REDUCE_GRAD: ds.ReduceGrads,
           K.STEP: ds.OptimizerStep}
_BUFFER = {K.LOAD: ds.LoadMicroBatch, K.FORWARD: ds.ForwardPass, K.BACKWARD: ds.BackwardPass,
           K.BACKWARD_INPUT: BackwardInputPass, K.BACKWARD_WEIGHT: BackwardWeightPass}
_EDGE = {K.SEND_F: SendActivationTo, K.RECV_F: RecvActivationFrom, K.SEND_B: SendGradTo, K.RECV_B: RecvGradFrom}


def to_instruction(action: Action, num_buffers: int) -> ds.PipeInstruction:
    """The DeepSpeed instruction that executes ``action``."""
    if action.kind in _SIMPLE:
        return _SIMPLE[action.kind]()
    if action.kind in WEIGHT_INSTRUCTIONS:  # weight versions are named by micro-batch, not buffer
        return WEIGHT_INSTRUCTIONS[action.kind](action.mb_idx)
    buffer_id = action.mb_idx % num_buffers
    if action.kind in _BUFFER:
        return _BUFFER[action.kind](buffer_id)
    return _EDGE[action.kind](buffer_id, action.peer)


class GraphPipeSchedule(ds.PipeSchedule):
    """Yields one stage's actions as DeepSpeed instructions, one step per action.

    With ``record`` (a list), every action is appended with its start and end time
    (``time.perf_counter``): the engine runs a step's instruction between yielding it and asking
    for the next one, so the generator itself can time it without touching the engine's loop.
    """

    def __init__(self, actions: list[Action], *, micro_batches: int, stages: int, stage_id: int, num_buffers: int,
                 record: list | None = None):
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.actions = actions
        self._num_buffers = num_buffers
        self._record = record

    def num_pipe_buffers(self) -> int:
        return self._num_buffers

    def steps(self):
        for action in self.actions:
            start = time.perf_counter()
            yield [to_instruction(action, self._num_buffers)]
            if self._record is not None:
                self._record.append((action, start, time.perf_counter()))
