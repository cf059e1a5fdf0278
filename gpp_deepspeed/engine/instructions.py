"""DeepSpeed pipe instructions for DAG edges, and the PipeSchedule that yields a stage's actions.

The engine dispatches instructions by exact type, so each DAG transfer has its own class with the
peer stage as an argument, a grouped transfer (``P2P``) is a :class:`Transfers` holding its ops, and
every release is a :class:`Release` naming its kind, whose handler frees what the schedule's table
says it frees (:data:`~gpp_deepspeed.schedule.ir.KINDS`, through :data:`BUFFER_KEYS`). :class:`GraphPipeSchedule` maps each :class:`~gpp_deepspeed.schedule.Action`
of the stage one-to-one to an instruction, with the buffer slot the schedule gave its micro-batch
(:func:`~gpp_deepspeed.schedule.assign_buffers`): the engine runs exactly the list that was validated.
"""

from __future__ import annotations

import time

from deepspeed.runtime.pipe import schedule as ds

from ..schedule.ir import Action, ActionKind as K, Buffer
from .split_engine import BackwardInputPass, BackwardWeightPass
from .asynchronous import WEIGHT_INSTRUCTIONS

__all__ = ["SendActivationTo", "RecvActivationFrom", "SendGradTo", "RecvGradFrom", "Transfers", "Release", "WaitSends",
           "GraphPipeSchedule", "to_instruction", "BUFFER_KEYS"]

BUFFER_KEYS: dict[Buffer, tuple[str, ...]] = {
    Buffer.LOADED: ("loaded", ), Buffer.RECEIVED: ("received", ), Buffer.INPUTS: ("inputs", ),
    Buffer.OUTPUTS: ("outputs", "output_tensors"), Buffer.LABELS: ("labels", ), Buffer.LOSS: ("losses", ),
    Buffer.GRADS: ("grads", ), Buffer.WEIGHT_GRAD: ("weight_grad", )}
"""The engine's ``pipe_buffers`` keys that hold each of a micro-batch's buffers (DeepSpeed's
``PipelineEngine`` owns ``inputs``, ``labels``, ``outputs`` and ``output_tensors``)."""


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


class Release(ds.BufferOpInstruction):
    """Free what a release action frees of one buffer slot.

    Roughly::

        for buffer in kind.spec.frees: pipe_buffers[buffer][buffer_id] = None
    """

    def __init__(self, buffer_id, kind):
        super().__init__(buffer_id, kind=kind)


class WaitSends(ds.PipeInstruction):
    """Wait until every asynchronous send of this stage has completed."""


_SIMPLE = {K.WAIT_SENDS: WaitSends, K.REDUCE_TIED: ds.ReduceTiedGrads, K.REDUCE_GRAD: ds.ReduceGrads,
           K.STEP: ds.OptimizerStep}
_BUFFER = {K.LOAD: ds.LoadMicroBatch, K.FORWARD: ds.ForwardPass, K.BACKWARD: ds.BackwardPass,
           K.BACKWARD_INPUT: BackwardInputPass, K.BACKWARD_WEIGHT: BackwardWeightPass}
_EDGE = {K.SEND_F: SendActivationTo, K.RECV_F: RecvActivationFrom, K.SEND_B: SendGradTo, K.RECV_B: RecvGradFrom}


def to_instruction(action: Action, slot_of: dict[int, int]) -> ds.PipeInstruction:
    """The DeepSpeed instruction that executes ``action``; ``slot_of`` maps micro-batches to buffers."""
    if action.kind in _SIMPLE:
        return _SIMPLE[action.kind]()
    if action.kind in WEIGHT_INSTRUCTIONS:  # weight versions are named by micro-batch, not buffer
        cls = WEIGHT_INSTRUCTIONS[action.kind]
        return cls() if action.mb_idx is None else cls(action.mb_idx)
    if action.kind is K.P2P or action.kind.spec.layout:   # a layout alone is a group of one
        return Transfers((op.kind, slot_of[op.mb_idx], op.peer) for op in action.parts)
    buffer_id = slot_of[action.mb_idx]
    if action.kind.is_release:
        return Release(buffer_id, action.kind)
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
