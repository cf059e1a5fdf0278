"""Asynchronous pipelines on a DAG of stages: PipeDream, PipeDream-2BW and PipeOptim.

Each is 1F1B without a flush: stage ``s`` runs ``lag(s) = depth(s) - 1`` warm-up forwards once,
then alternates ``F(j + lag)`` and ``B(j)`` for ever, over a stream of micro-batches numbered from
the last time the pipeline was empty. ``train_batch`` number ``k`` runs the slice of that program
that forwards micro-batches ``k*M .. k*M + M - 1`` (``M`` = gradient accumulation steps); the
backwards in it are those that follow these forwards, ``B(k*M - lag) .. B(k*M + M - 1 - lag)``.
``engine.flush()`` runs the drain, the last ``lag`` backwards. Weight semantics (one line each):

``pipedream``
    Weight stashing (PipeDream, SOSP'19, Sec. 3.3): a backward uses the weights its forward used;
    the stage updates after every backward with that micro-batch's gradient, averaged over the
    stage's replicas first (PipeDream's hybrid parallelism, Sec. 3.1).
``2bw``
    Double-buffered weights (PipeDream-2BW, ICML'21, Sec. 3.1): every micro-batch of batch ``b``
    runs on ``W(b-1)``; the stage updates once per batch with the batch's mean gradient,
    ``W(b+1) = W(b) - lr * grad f(W(b-1))``; at most two stashed versions. The update made from
    batch ``b`` is the one synchronous step of batch ``b + 1``'s end (``RETIRE``, then DeepSpeed's
    ``REDUCE_TIED``, ``REDUCE_GRAD`` and ``STEP``): every stage has run batch ``b``'s backwards by
    then (``M >= depth - 1``) and the next version is stashed only after it, so clipping by the
    global norm, ZeRO-1, the lr scheduler and tied weights work as in a synchronous step.
``pipeoptim``
    Weight prediction (PipeOptim, arXiv 2312.00839, Sec. IV): the forward of micro-batch ``j`` runs
    on ``W - lr * s * dW``, the optimizer's own prediction of the weights ``s`` updates later, ``s``
    = the updates the stage makes between ``F(j)`` and ``B(j)`` (``D - rank - 1`` on a chain); the
    backward differentiates that forward (one version per micro-batch in flight); the stage
    updates after every backward, as PipeDream.
``pipeoptim-inplace``
    PipeOptim as the authors' code runs it: the prediction is written over the live weights for the
    forward and the live weights are restored right after it (``PREDICT_INPLACE``, ``F``,
    ``RESTORE``), so the backward runs on the live weights of its own time, which the prediction
    aimed at. Two weight versions: the live weights and the copy kept during a forward.

Weight versions are explicit actions whose micro-batch index names a version (the micro-batch
whose forward first runs on it): ``STASH v`` copies the stage's current weights into version
``v``, ``PREDICT v`` writes the prediction into it, ``PREDICT_INPLACE v`` writes it over the live
weights (version ``v`` then aliases them) until ``RESTORE v``, and ``RETIRE v`` hands the gradient
accumulated on version ``v`` to the live weights and frees it. ``UPDATE`` is one step of the
stage's own optimizer (after ``REDUCE_GRAD``, the average over the stage's replicas); ``STEP`` is
DeepSpeed's step of the whole pipeline, as in a synchronous batch. A forward runs on the version
made by the latest ``STASH``/``PREDICT``/``PREDICT_INPLACE`` before it; a backward on its
forward's version.

Messages never cross a ``train_batch`` boundary (``DeepSpeed`` aggregates the loss over the
pipeline between batches, a collective that a pending rendezvous send could block): a gradient
whose receiver runs its backward in a later batch than the sender is sent at the start of the
receiver's batch (the lowering pass :func:`~gpp_deepspeed.schedule.lowering.defer_sends`). That
loss aggregation also makes the stages meet once per batch, so a steady batch (the pipeline full
before and after it, :func:`steady_batch_idx`) costs about ``M * (T_F + T_B) + (D - 1) * T_F``:
the forward skew returns at every batch, the drain never.

This module gives the compute and weight actions of one segment (:func:`async_compute`); the
registry (:data:`gpp_deepspeed.schedule.SCHEDULES`) names each schedule's :class:`WeightRule`, and
:class:`~gpp_deepspeed.schedule.program.AsyncProgram` lowers the segments into programs.
"""

from __future__ import annotations

from enum import Enum

from ..errors import GPPConfigError
from ..graph.stages import StageGraph
from .ir import Action, ActionKind as K, Schedule, Segment

__all__ = ["WeightRule", "lag", "async_compute", "steps_at_end", "steady_batch_idx", "prediction_steps",
           "predicted_updates", "shift", "check_async_microbatches"]


class WeightRule(str, Enum):
    """How an asynchronous schedule versions and updates a stage's weights (module docstring)."""

    STASH = "stash"                  # PipeDream: the forward's weights stashed for its backward
    DOUBLE_BUFFER = "double_buffer"  # PipeDream-2BW: one version per batch, one update per batch
    PREDICT = "predict"              # PipeOptim: the forward runs on the predicted weights
    PREDICT_INPLACE = "predict_inplace"  # PipeOptim's code: predicted in place, live weights restored

    @property
    def updates_per_batch(self) -> bool:
        """One update per batch with the batch's mean gradient, DeepSpeed's ``STEP`` (else one per
        micro-batch, the stage's own ``UPDATE``)."""
        return self is WeightRule.DOUBLE_BUFFER

    def stashed_versions(self, depth: int) -> int:
        """Copies of the weights a stage of ``depth`` (stages on its longest path to the output)
        holds at once besides its live weights, once the pipeline is full: one per micro-batch in
        flight (PipeDream, PipeOptim), two (2BW, Sec. 3.1), or the one an in-place prediction keeps
        during a forward (PipeOptim's code). :meth:`AsyncProgram.validate` counts them on the
        program; tests check that both agree.

        >>> [rule.stashed_versions(3) for rule in WeightRule]
        [3, 2, 3, 1]
        """
        return {WeightRule.DOUBLE_BUFFER: 2, WeightRule.PREDICT_INPLACE: 1}.get(self, depth)

    def deepest_pipeline(self, num_microbatches: int) -> int | None:
        """The deepest stage graph this rule runs with ``num_microbatches`` per batch, or None for
        no limit: 2BW keeps two weight versions only while ``M >= depth - 1`` (the paper's
        ``m >= d``; :func:`check_async_microbatches` refuses deeper ones).

        >>> WeightRule.DOUBLE_BUFFER.deepest_pipeline(3), WeightRule.STASH.deepest_pipeline(3)
        (4, None)
        """
        return num_microbatches + 1 if self is WeightRule.DOUBLE_BUFFER else None

    @property
    def predicts(self) -> bool:
        """The forward runs on the optimizer's prediction of the weights (PipeOptim)."""
        return self in (WeightRule.PREDICT, WeightRule.PREDICT_INPLACE)


def lag(stage_graph: StageGraph, stage_idx: int) -> int:
    """Warm-up forwards of a stage, and the backwards by which it trails its forwards: ``depth - 1``.

    >>> lag(StageGraph.chain(4), 0), lag(StageGraph.chain(4), 3)
    (3, 0)
    """
    return stage_graph.depth(stage_idx) - 1


def check_async_microbatches(stage_graph: StageGraph, num_microbatches: int, rule: WeightRule, *, name: str) -> None:
    """2BW needs every stage to finish a batch's backwards by the end of the next batch, where the
    batch's update is (at most two stashed versions): ``M >= depth - 1`` (the 2BW paper's ``m >= d``)."""
    need = max(lag(stage_graph, s) for s in range(stage_graph.num_stages))
    if rule is WeightRule.DOUBLE_BUFFER and num_microbatches < need:
        raise GPPConfigError(f'schedule "{name}" needs gradient_accumulation_steps >= {need} (the deepest stage\'s '
                             f"warm-up forwards), got {num_microbatches}")


def _forward(s: int, j: int, rule: WeightRule, m: int) -> list[Action]:
    f = Action(s, K.FORWARD, j)
    if rule is WeightRule.STASH:
        return [Action(s, K.STASH, j), f]
    if rule is WeightRule.PREDICT:
        return [Action(s, K.PREDICT, j), f]
    if rule is WeightRule.PREDICT_INPLACE:
        return [Action(s, K.PREDICT_INPLACE, j), f, Action(s, K.RESTORE, j)]
    # 2bw: one version per batch, taken before the batch's first forward, after the update the
    # previous batch's end made (from batch b - 2): the version of batch b is W(b - 1).
    return [Action(s, K.STASH, j), f] if j % m == 0 else [f]


def _backward(s: int, i: int, rule: WeightRule) -> list[Action]:
    if rule.updates_per_batch:
        return [Action(s, K.BACKWARD, i)]
    # The micro-batch's gradient, averaged over the stage's replicas, makes one update.
    return [Action(s, K.BACKWARD, i), Action(s, K.RETIRE, i), Action(s, K.REDUCE_GRAD), Action(s, K.UPDATE)]


def steps_at_end(segment: Segment, rule: WeightRule) -> bool:
    """The segment ends with DeepSpeed's synchronous step (``REDUCE_TIED``, ``REDUCE_GRAD``,
    ``STEP``) on every stage: 2BW's update with the previous batch's gradient, which every batch
    but the first, and every flush, makes.

    >>> steps_at_end(Segment(0, 4), WeightRule.DOUBLE_BUFFER), steps_at_end(Segment(1, 4), WeightRule.DOUBLE_BUFFER)
    (False, True)
    """
    return rule.updates_per_batch and (segment.flush or segment.batch_idx >= 1)


def async_compute(stage_graph: StageGraph, segment: Segment, *, rule: WeightRule) -> Schedule:
    """Every stage's compute and weight actions of one segment (a batch, or the flush after
    ``segment.batch_idx`` batches) of the never-draining 1F1B program. 2BW's segments that end
    with a step (:func:`steps_at_end`) end with ``RETIRE`` of the previous batch's version; the
    lowering adds the step itself (:func:`~gpp_deepspeed.schedule.lowering.add_epilogue`).
    Frozen stages (``stage_graph.frozen``) lose their backwards and weight actions in the
    lowering (:func:`~gpp_deepspeed.schedule.lowering.drop_frozen_backward`).

    >>> async_compute(StageGraph.chain(2), Segment(1, num_microbatches=1), rule=WeightRule.STASH)[0]
    [0STASH1, 0F1, 0B0, 0RETIRE0, 0REDUCE_GRAD, 0UPDATE]
    >>> async_compute(StageGraph.chain(2), Segment(1, num_microbatches=2), rule=WeightRule.DOUBLE_BUFFER)[1]
    [1STASH2, 1F2, 1B2, 1F3, 1B3, 1RETIRE0]
    """
    m, k = segment.num_microbatches, segment.batch_idx
    schedule: Schedule = {}
    for s in range(stage_graph.num_stages):
        w = lag(stage_graph, s)
        order: list[Action] = []
        if segment.flush:
            for i in range(max(k * m - w, 0), k * m):
                order += _backward(s, i, rule)
        else:
            for j in range(k * m, (k + 1) * m):
                order += _forward(s, j, rule, m)
                if j - w >= 0:
                    order += _backward(s, j - w, rule)
        if steps_at_end(segment, rule):
            order.append(Action(s, K.RETIRE, (k - 1) * m))
        schedule[s] = order
    return schedule


def steady_batch_idx(stage_graph: StageGraph, num_microbatches: int) -> int:
    """A batch number from which every batch is the previous one shifted by ``M`` micro-batches
    (no warm-up forward and no deferred send from the warm-up left in it)."""
    deepest = max(lag(stage_graph, s) for s in range(stage_graph.num_stages))
    return -(-deepest // num_microbatches) + 1


def predicted_updates(stage_graph: StageGraph, stage_idx: int, mb_idx: int) -> int:
    """PipeOptim's ``s`` for micro-batch ``mb_idx`` on a stage: the updates the stage makes between
    its forward and its backward in 1F1B without flush, ``min(j, lag)`` (``D - rank - 1`` on a chain
    once the pipeline is full; :func:`validate_async` checks it against the program).

    >>> predicted_updates(StageGraph.chain(4), 0, 10), predicted_updates(StageGraph.chain(4), 0, 1)
    (3, 1)
    """
    return min(mb_idx, lag(stage_graph, stage_idx))


def shift(actions: list[Action], delta: int) -> list[Action]:
    """The same actions ``delta`` micro-batches later: batch ``k + d`` of a steady pipeline is batch
    ``k`` shifted by ``d * M`` (for ``k >= steady_batch_idx``; tested), and so is its flush.

    >>> shift([Action.parse("0F2"), Action.parse("0WAIT_SENDS")], 4)
    [0F6, 0WAIT_SENDS]
    """
    def moved(a: Action) -> Action:
        if a.kind is K.P2P:
            return Action.group(moved(op) for op in a.ops)
        return a if a.mb_idx is None else Action(a.stage_idx, a.kind, a.mb_idx + delta, a.peer)
    return [moved(a) for a in actions]


def prediction_steps(actions: list[Action]) -> dict[int, int]:
    """For each ``PREDICT v`` (or ``PREDICT_INPLACE v``) of a stage's program: the updates
    (``UPDATE``, ``STEP``) between the forward that runs on version ``v`` and that forward's
    backward (PipeOptim's weight version difference ``s``).

    >>> from gpp_deepspeed.schedule.ir import Action as A
    >>> prediction_steps([A.parse(x) for x in "0PREDICT0 0F0 0PREDICT1 0F1 0B0 0UPDATE 0B1 0UPDATE".split()])
    {0: 0, 1: 1}
    """
    version: dict[int, int] = {}
    current = None
    updates = 0
    at_forward: dict[int, int] = {}
    steps: dict[int, int] = {}
    for a in actions:
        if a.kind.spec.predicts:
            current = a.mb_idx
        elif a.kind is K.FORWARD:
            version[a.mb_idx] = current
            at_forward[a.mb_idx] = updates
        elif a.kind is K.BACKWARD and version.get(a.mb_idx) is not None:
            steps[version[a.mb_idx]] = updates - at_forward[a.mb_idx]
        elif a.kind.spec.updates:
            updates += 1
    return steps
