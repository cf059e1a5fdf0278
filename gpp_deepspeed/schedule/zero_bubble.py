"""Zero-bubble schedules on a DAG of stages: the backward split into ``I`` and ``W``.

LayerPipe (one of GraphPipe's seeds) and the zero-bubble schedules (Qi et al., "Zero Bubble
Pipeline Parallelism", arXiv 2401.10241) split a stage's backward into the gradient with respect to
its inputs (``I``: what the predecessors wait for) and the gradient with respect to its weights
(``W``: needed only by the optimizer step at the end of the batch). Sending ``I``'s result at once
shortens the backward critical path from ``F + B`` to ``F + I`` per hop, and the ``W``'s fill the
bubbles that are left.

Glossary
--------
depth
    ``StageGraph.depth(s)``: stages on the longest path from ``s`` to the output stage.
pipeline depth ``D``
    The largest depth; a chain of ``p`` stages has ``D = p``.
in flight
    A micro-batch whose ``F`` has run on a stage and whose ``W`` (or ``B``) has not: the stage
    holds its activations. :func:`peak_in_flight` counts them; 1F1B's peak is ``min(depth, M)`` on
    each stage, ``min(D, M)`` on the busiest one.

Generators (registered in :data:`gpp_deepspeed.schedule.SCHEDULES`):

``zb1``
    Branch-aware ZB-H1. Each stage runs 1F1B's warm-up forwards (``depth - 1``), then pairs ``F``
    with ``I`` as 1F1B pairs ``F`` with ``B``, and defers ``D - depth`` of its ``W``'s, running the
    oldest deferred ``W`` after each ``I`` (the ZB-H1 rule of the paper's Sec. 3.1, which torch's
    ZB1P implements on chains with ``rank`` deferred ``W``'s; on a DAG the deferral is the stage's
    distance from the deepest source, ``D - depth``). Every stage holds at most ``D`` micro-batches
    in flight: the paper's ZB-H1 memory bound (``p M_B``), the same as 1F1B's busiest stage. On a
    chain with ``T_F = T_I = T_W`` its bubble is ``(p - 1)(T_F + T_I - T_W)``, a third of 1F1B's
    ``(p - 1)(T_F + T_B)``.
``zb2``
    ZB-H2-like: a greedy list schedule over the simulated clock. A free stage runs, in this
    order of preference, an ``I`` whose gradients have arrived, a forward whose inputs have arrived
    if fewer than ``2 D - 1`` micro-batches are in flight (the paper's ZB-H2 bound), else its
    oldest deferred ``W``; otherwise it waits. More warm-up forwards and ``W``'s moved into every
    gap give a near-zero bubble when ``T_F``, ``T_I`` and ``T_W`` are close, at up to ``2 D - 1``
    micro-batches of activation memory.

Both only reorder compute, so every micro-batch's gradients are the ones 1F1B computes; ``I`` takes
``B``'s place in the communication (it receives the output gradients and its result is sent), ``W``
talks to no one, and the lowering passes (:mod:`.lowering`) order and group the transfers as for
any schedule, so the validator's rendezvous mode (NCCL semantics) accepts them.

The zero-bubble paper counts memory in micro-batches of activations (``M_B``); so does this module,
and a micro-batch stays counted until its ``W`` has run (the engine keeps the part of its autograd
graph that the weight gradients read until then). Under that count ``zb1``'s bound is on the
busiest stage: stages near the output hold more than under 1F1B, up to the same ``D``.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from ..graph.stages import StageGraph
from .greedy import Fold, rank_orders, unit_split_duration
from .ir import Action, ActionKind as K, Schedule

__all__ = ["zb1", "zb2", "peak_in_flight", "unit_split_duration"]


def _pipeline_depth(stage_graph: StageGraph) -> int:
    return max(stage_graph.depth(s) for s in range(stage_graph.num_stages))


def zb1(stage_graph: StageGraph, num_microbatches: int) -> Schedule:
    """Compute order of branch-aware ZB-H1 (see the module docstring).

    >>> zb1(StageGraph.chain(2), 3)
    {0: [0F0, 0F1, 0I0, 0W0, 0F2, 0I1, 0W1, 0I2, 0W2], 1: [1F0, 1I0, 1F1, 1I1, 1W0, 1F2, 1I2, 1W1, 1W2]}
    """
    num_mb = num_microbatches
    top = _pipeline_depth(stage_graph)
    schedule: Schedule = {}
    for s in range(stage_graph.num_stages):
        depth = stage_graph.depth(s)
        warmup = min(depth - 1, num_mb)
        deferred = top - depth
        order = [Action(s, K.FORWARD, j) for j in range(warmup)]
        pending: deque[int] = deque()

        def input_grad(j: int) -> None:
            order.append(Action(s, K.BACKWARD_INPUT, j))
            pending.append(j)
            if len(pending) > deferred:
                order.append(Action(s, K.BACKWARD_WEIGHT, pending.popleft()))

        for j in range(num_mb - warmup):
            order.append(Action(s, K.FORWARD, warmup + j))
            input_grad(j)
        for j in range(num_mb - warmup, num_mb):
            input_grad(j)
        order += [Action(s, K.BACKWARD_WEIGHT, j) for j in pending]
        schedule[s] = order
    return schedule


def zb2(stage_graph: StageGraph, num_microbatches: int, *,
        duration: Callable[[Action], float] | None = None, max_in_flight: dict[int, int] | None = None) -> Schedule:
    """Compute order of the ZB-H2-like greedy schedule (see the module docstring).

    ``duration`` prices compute actions (default :func:`unit_split_duration` of the kind);
    ``max_in_flight`` caps each stage's in-flight micro-batches (default ``2 D - 1``, ZB-H2's).

    >>> zb2(StageGraph.chain(2), 3)[0]
    [0F0, 0F1, 0F2, 0I0, 0W0, 0I1, 0W1, 0I2, 0W2]
    """
    top = _pipeline_depth(stage_graph)
    num_stages = stage_graph.num_stages
    caps = {s: max(1, (max_in_flight or {}).get(s, 2 * top - 1)) for s in range(num_stages)}
    # One stage per rank: the greedy list schedule of schedule/greedy.py, each stage its own rank.
    return rank_orders(stage_graph, num_microbatches, Fold(tuple(range(num_stages))), split_backward=True,
                       duration=duration, max_in_flight=caps)


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches a stage holds at once: forward run, backward (``B``, or ``W`` when the
    backward is split) not yet run. The activation memory a schedule asks of the stage, in
    micro-batches.

    >>> from gpp_deepspeed.schedule import one_f_one_b
    >>> peak_in_flight(one_f_one_b(StageGraph.chain(3), 8)[0]), peak_in_flight(zb1(StageGraph.chain(3), 8)[2])
    (3, 3)
    """
    live = peak = 0
    for a in actions:
        if a.kind is K.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind.spec.ends_backward:
            live -= 1
    return peak

