"""DeepSpeed pipe instructions for a stage program, and the PipeSchedule that yields them.

The engine dispatches instructions by exact type (DeepSpeed's ``_INSTRUCTION_MAP``). Every action
kind of the schedule's table :data:`~gpp_deepspeed.schedule.KINDS` has one instruction class here,
in one table, :data:`INSTRUCTION_OF`; what the instruction is given follows from the kind's
:class:`~gpp_deepspeed.schedule.ir.KindSpec`:

* every transfer, alone or grouped (``P2P``), layouts included, is one :class:`Transfers` holding
  ``(kind, slot, peer, stage, deferred)`` per message: one handler, one timing path (a group of a
  rank holding several stages may hold several stages' transfers); ``deferred`` marks a receive
  that the list waits for later (:func:`~gpp_deepspeed.schedule.ir.waited`), at a
  :class:`WaitReceives`;
* a hand-over between two stages of one rank is a :class:`HandOver` naming both and their slots;
* a release is a :class:`Release` naming its kind, whose handler frees what the table says it
  frees;
* a weight-version action is given the version (its micro-batch index names one);
* any other action on a micro-batch is given the micro-batch's buffer slot.

:class:`GraphPipeSchedule` maps each :class:`~gpp_deepspeed.schedule.Action` of the stage
one-to-one to an instruction, with the buffer slot the schedule gave its micro-batch
(:func:`~gpp_deepspeed.schedule.assign_buffers`): the engine runs exactly the list that was validated,
in its order. It compiles the list once per program into dispatches (:func:`compile_steps`): a
release runs in the dispatch of the action before it, and :meth:`GraphPipeSchedule.run` calls the
handlers directly, so an action costs its handler and little else.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from deepspeed.runtime.pipe import schedule as ds

from ..schedule.ir import Action, ActionKind as K, waited
from . import asynchronous as _async

__all__ = ["Transfers", "WaitReceives", "HandOver", "Release", "WaitSends", "BackwardInputPass", "BackwardWeightPass", "INSTRUCTION_OF",
           "GraphPipeSchedule", "Step", "compile_steps", "to_instruction"]


class Transfers(ds.PipeInstruction):
    """Post one or several transfers at once and wait for their receives (``batch_isend_irecv``)
    that are not ``deferred``.

    ``ops`` holds ``(kind, buffer_id, peer, stage, deferred)`` per transfer, ``kind`` an
    ``ActionKind`` transfer of ``stage`` (the rank's stage whose buffer it is).

    Roughly::

        batch_isend_irecv([send or recv of op for op in ops]); wait(receives not deferred)
    """

    def __init__(self, ops):
        super().__init__(ops=tuple(ops))


class WaitReceives(ds.PipeInstruction):
    """``WAIT_F`` / ``WAIT_B``: wait for the receives of ``stage``'s micro-batch in slot
    ``buffer_id`` that earlier transfers posted (``message``: ``"F"`` or ``"B"``) and store them.

    Roughly::

        wait(posted[stage, message, buffer_id]); store what they brought
    """

    def __init__(self, stage, message, buffer_id):
        super().__init__(stage=stage, message=message, buffer_id=buffer_id)


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
    K.HAND_F: HandOver, K.HAND_B: HandOver, K.WAIT_F: WaitReceives, K.WAIT_B: WaitReceives,
    K.WAIT_SENDS: WaitSends, K.REDUCE_TIED: ds.ReduceTiedGrads, K.REDUCE_GRAD: ds.ReduceGrads,
    K.STEP: ds.OptimizerStep,
    K.STASH: _async.StashWeights, K.PREDICT: _async.PredictWeights, K.PREDICT_INPLACE: _async.PredictInPlace,
    K.RESTORE: _async.RestoreWeights, K.RETIRE: _async.RetireVersion, K.UPDATE: _async.UpdateWeights,
}
"""The instruction class of every action kind (a test checks that none is missing)."""


def to_instruction(action: Action, slots: dict[int, dict[int, int]],
                   waited: frozenset = frozenset()) -> ds.PipeInstruction:
    """The DeepSpeed instruction that executes ``action``; ``slots[stage][mb]`` is the buffer
    slot of a micro-batch on a stage (:attr:`~gpp_deepspeed.schedule.Program.slots`); ``waited``:
    the receives its list completes at a wait (:func:`~gpp_deepspeed.schedule.ir.waited`)."""
    key = tuple(None if op.mb_idx is None or op.kind.spec.version else slots[op.stage_idx][op.mb_idx]
                for op in action.parts)
    if action.kind.spec.hand_over:
        key += (slots[action.peer][action.mb_idx], )
    deferred = tuple(op.completion in waited for op in action.parts) if action.kind.is_transfer else ()
    return _instruction(action, key, deferred)


@functools.lru_cache(maxsize=8192)
def _instruction(action: Action, slots: tuple, deferred: tuple = ()) -> ds.PipeInstruction:
    """The instruction of ``action`` whose parts' micro-batches sit in ``slots`` (a hand-over's
    peer slot last), a transfer's receives ``deferred`` or not: made once, then the same object
    every batch (handlers only read an instruction's arguments), which keeps building instructions
    out of the cost of an action."""
    cls = INSTRUCTION_OF[action.kind]
    if action.kind.is_transfer:
        return Transfers((op.kind, slot, op.peer, op.stage_idx, later)
                         for op, slot, later in zip(action.parts, slots, deferred))
    if action.kind.spec.completes:
        return WaitReceives(action.stage_idx, action.kind.spec.completes, slots[0])
    if action.kind.spec.hand_over:
        return HandOver(action.kind, action.stage_idx, slots[0], action.peer, slots[1])
    if not action.kind.has_mb or action.mb_idx is None:
        return cls()
    if action.kind.spec.version:   # weight versions are named by micro-batch, not buffer
        return cls(action.mb_idx)
    if action.kind.is_release:
        return Release(slots[0], action.kind)
    return cls(slots[0])


@dataclass(frozen=True, slots=True)
class Step:
    """One dispatch of the engine: the instruction of ``action``, then the releases the program puts
    right after it, each ``(release action, its instruction)``."""

    instruction: ds.PipeInstruction
    action: Action
    releases: tuple[tuple[Action, Release], ...] = ()


def compile_steps(actions: list[Action], slots: dict[int, dict[int, int]]) -> tuple[Step, ...]:
    """The dispatches that run ``actions``: one per action, save that a release runs inside the
    dispatch of the action before it (a release is a few buffer slots set to ``None``; dispatching
    it alone cost as much as the release). The order of execution is the program's, action for
    action; only the number of trips through the dispatch loop changes.

    >>> acts = [Action.parse(t) for t in "1F0 1RELEASE_OUT0 1RELEASE_IN0 1SEND_B0@0".split()]
    >>> [(s.action, [r for r, _ in s.releases]) for s in compile_steps(acts, {1: {0: 0}})]
    [(1F0, [1RELEASE_OUT0, 1RELEASE_IN0]), (1SEND_B0@0, [])]
    """
    steps: list[Step] = []
    later = waited(actions)
    for action in actions:
        if action.kind.is_release and steps:
            last = steps[-1]
            steps[-1] = Step(last.instruction, last.action,
                             last.releases + ((action, to_instruction(action, slots)), ))
        else:
            steps.append(Step(to_instruction(action, slots, later), action))
    return tuple(steps)


_COMPILED: dict[int, tuple[list[Action], dict, tuple[Step, ...]]] = {}
"""Compiled steps by the identity of a rank's action list (which the program factory keeps for
the run; the entry holds it, so an id is never reused while cached)."""


def _steps_of(actions: list[Action], slots: dict[int, dict[int, int]]) -> tuple[Step, ...]:
    hit = _COMPILED.get(id(actions))
    if hit is not None and hit[0] is actions and hit[1] is slots:
        return hit[2]
    if len(_COMPILED) >= 256:   # programs are few (one per shape); a bound keeps a pathological run small
        _COMPILED.clear()
    steps = compile_steps(actions, slots)
    _COMPILED[id(actions)] = (actions, slots, steps)
    return steps


class GraphPipeSchedule(ds.PipeSchedule):
    """One rank's actions as DeepSpeed instructions, compiled once per program
    (:func:`compile_steps`) and run by :meth:`run`.

    ``slots`` is the program's buffer slot of every micro-batch on every stage; ``enter(stage)``,
    if given, is called before each action (releases included) whose stage differs from the last
    one's (a rank holding several stages switches to that stage's buffers and layers) and
    ``enter(None)`` once the list is done. With ``record`` (a list), every action, releases
    included, is appended with its start and end time (``time.perf_counter``); a release's span
    starts where the action before it ended.
    """

    def __init__(self, actions: list[Action], *, micro_batches: int, stages: int, stage_id: int,
                 slots: dict[int, dict[int, int]], record: list | None = None, enter=None):
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.actions = actions
        self._steps = _steps_of(actions, slots)
        self._num_buffers = max((k for st in {a.stage_idx for a in actions} for k in slots[st].values()),
                                default=0) + 1
        self._record = record
        self._enter = enter

    def num_pipe_buffers(self) -> int:
        return self._num_buffers

    def steps(self):
        """What :meth:`run` executes, as DeepSpeed's instruction lists (one per dispatch)."""
        for step in self._steps:
            yield [step.instruction, *(instruction for _, instruction in step.releases)]

    def run(self, engine) -> None:
        """Execute every step on ``engine``: each instruction's handler from the engine's
        ``_INSTRUCTION_MAP``, called directly (DeepSpeed's loop makes a bound method and sets it on
        the engine, an ``nn.Module``, per instruction), then the step's releases (the engine's
        ``Release`` handler, looked up once), each in the stage its action names."""
        table = engine._INSTRUCTION_MAP
        free = table[Release]
        record = self._record if self._record is not None else []
        clock = time.perf_counter
        enter, current = self._enter, None
        for step in self._steps:
            handler = table.get(type(step.instruction))
            if handler is None:
                raise RuntimeError(f"{type(engine).__name__} does not understand instruction {step.instruction!r}")
            start = clock()
            if enter is not None and step.action.stage_idx != current:
                current = step.action.stage_idx
                enter(current)
            handler(engine, **step.instruction.kwargs)
            end = clock()
            record.append((step.action, start, end))
            for release, instruction in step.releases:
                if enter is not None and release.stage_idx != current:
                    current = release.stage_idx
                    enter(current)
                free(engine, **instruction.kwargs)
                start, end = end, clock()
                record.append((release, start, end))
        if enter is not None:
            enter(None)
