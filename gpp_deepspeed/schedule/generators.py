"""Schedule generators: pure functions from a stage graph to a :data:`Schedule`.

A generator decides the order of compute (``F`` and ``B`` per micro-batch) on every stage; the
lowering passes then add data loading, the point-to-point transfers of every stage edge, group the
transfers that must progress together, place the release points (:mod:`.lowering`) and add the
end-of-batch reductions. Each pass is a small pure function on action lists.

Registered generators (:data:`SCHEDULES`):

``1f1b``
    Branch-aware synchronous 1F1B, GraphPipe's default (arXiv 2406.17145, Sec. 6): a stage runs
    ``min(depth - 1, M)`` warm-up forwards, where ``depth`` counts the stages on the longest path
    from it to the output stage, then alternates one forward and one backward, then drains its
    backwards. On a chain ``depth - 1 = S - 1 - i``, exactly DeepSpeed's ``TrainSchedule`` and
    PipeDream-Flush. A stage keeps at most ``depth`` micro-batches in flight.
``gpipe``
    All forwards, then all backwards (``M`` micro-batches in flight).
``zb1``, ``zb2``
    Zero-bubble schedules with the backward split into ``I`` and ``W`` (:mod:`.zero_bubble`).
"""

from __future__ import annotations

from typing import Callable

from ..errors import GPPConfigError
from ..graph.stages import StageGraph
from .ir import Action, ActionKind as K, Schedule
from .lowering import add_release, group_for_rendezvous
from .zero_bubble import zb1, zb2

__all__ = ["SCHEDULES", "get_schedule", "one_f_one_b", "gpipe", "forward_only", "warmup_forwards",
           "lower", "add_send_recv", "add_load", "add_epilogue", "build_schedule", "drop_frozen_backward"]


def warmup_forwards(stage_graph: StageGraph, stage_idx: int, num_microbatches: int) -> int:
    """Forwards a stage runs before its first backward in 1F1B: ``min(depth - 1, M)``.

    >>> warmup_forwards(StageGraph.chain(4), 0, 8)
    3
    """
    return min(stage_graph.depth(stage_idx) - 1, num_microbatches)


def one_f_one_b(stage_graph: StageGraph, num_microbatches: int) -> Schedule:
    """Compute order of the branch-aware synchronous 1F1B schedule (see module docstring).

    >>> one_f_one_b(StageGraph.chain(2), 3)
    {0: [0F0, 0F1, 0B0, 0F2, 0B1, 0B2], 1: [1F0, 1B0, 1F1, 1B1, 1F2, 1B2]}
    """
    schedule: Schedule = {}
    for s in range(stage_graph.num_stages):
        warmup = warmup_forwards(stage_graph, s, num_microbatches)
        order = [Action(s, K.FORWARD, j) for j in range(warmup)]
        for j in range(num_microbatches - warmup):
            order += [Action(s, K.FORWARD, warmup + j), Action(s, K.BACKWARD, j)]
        order += [Action(s, K.BACKWARD, j) for j in range(num_microbatches - warmup, num_microbatches)]
        schedule[s] = order
    return schedule


def gpipe(stage_graph: StageGraph, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards in the same order."""
    return {s: [Action(s, K.FORWARD, j) for j in range(num_microbatches)]
            + [Action(s, K.BACKWARD, j) for j in range(num_microbatches)] for s in range(stage_graph.num_stages)}


def forward_only(stage_graph: StageGraph, num_microbatches: int) -> Schedule:
    """Forwards only, for evaluation."""
    return {s: [Action(s, K.FORWARD, j) for j in range(num_microbatches)] for s in range(stage_graph.num_stages)}


SCHEDULES: dict[str, Callable[[StageGraph, int], Schedule]] = {"1f1b": one_f_one_b, "gpipe": gpipe, "zb1": zb1,
                                                              "zb2": zb2}


def get_schedule(name: str) -> Callable[[StageGraph, int], Schedule]:
    """Look up a generator by case-insensitive name; unknown names list the valid ones."""
    try:
        return SCHEDULES[name.lower()]
    except KeyError:
        raise GPPConfigError(f'unknown schedule "{name}"; valid: {sorted(SCHEDULES)}') from None


def add_load(schedule: Schedule, *, loading_stages: set[int]) -> Schedule:
    """Put a ``LOAD`` before each forward on the stages that read the batch."""
    out: Schedule = {}
    for s, actions in schedule.items():
        out[s] = []
        for a in actions:
            if a.kind is K.FORWARD and s in loading_stages:
                out[s].append(Action(s, K.LOAD, a.mb_idx))
            out[s].append(a)
    return out


def add_send_recv(schedule: Schedule, stage_graph: StageGraph) -> Schedule:
    """Surround compute with the transfers of every stage edge.

    ``F`` is preceded by a ``RECV_F`` from each predecessor and followed by a ``SEND_F`` to each
    successor; ``B`` (or ``I``, the input-gradient half of a split backward) is preceded by a
    ``RECV_B`` from each successor and followed by a ``SEND_B`` to each predecessor, on the edges
    that carry gradients (``StageEdge.grad``); ``W`` talks
    to no one. Sends are asynchronous, receives block, so the order of receives is
    what the validator checks.

    >>> from gpp_deepspeed.graph import StageGraph
    >>> add_send_recv({0: [Action(0, K.FORWARD, 0)], 1: [Action(1, K.FORWARD, 0)]}, StageGraph.chain(2))
    {0: [0F0, 0SEND_F0@1], 1: [1RECV_F0@0, 1F0]}
    """
    out: Schedule = {}
    for s, actions in schedule.items():
        preds, succs = stage_graph.preds(s), stage_graph.succs(s)
        lowered: list[Action] = []
        for a in actions:
            if a.kind is K.FORWARD:
                lowered += [Action(s, K.RECV_F, a.mb_idx, peer=p) for p in preds]
                lowered.append(a)
                lowered += [Action(s, K.SEND_F, a.mb_idx, peer=t) for t in succs]
            elif a.kind in (K.BACKWARD, K.BACKWARD_INPUT):  # W needs nothing from other stages
                # Only edges that carry gradients (not a frozen tower's output) exchange them.
                lowered += [Action(s, K.RECV_B, a.mb_idx, peer=t) for t in stage_graph.grad_succs(s)]
                lowered.append(a)
                lowered += [Action(s, K.SEND_B, a.mb_idx, peer=p) for p in stage_graph.grad_preds(s)]
            else:
                lowered.append(a)
        out[s] = lowered
    return out


def drop_frozen_backward(schedule: Schedule, stage_graph: StageGraph) -> Schedule:
    """Remove the backward (``B``, ``I``, ``W``) of the frozen stages, which have nothing to
    differentiate (``StageGraph.frozen``): they run forwards only.

    >>> from dataclasses import replace
    >>> from gpp_deepspeed.graph import StageGraph
    >>> drop_frozen_backward(one_f_one_b(StageGraph.chain(2), 2), replace(StageGraph.chain(2), frozen=frozenset({0})))
    {0: [0F0, 0F1], 1: [1F0, 1B0, 1F1, 1B1]}
    """
    backward = (K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT)
    return {s: [a for a in actions if not (s in stage_graph.frozen and a.kind in backward)]
            for s, actions in schedule.items()}


def add_epilogue(schedule: Schedule, *, train: bool) -> Schedule:
    """End every stage's list with ``WAIT_SENDS`` and, when training, the gradient reductions and
    the optimizer step (one step per batch: synchronous, no weight staleness)."""
    tail = [K.WAIT_SENDS] + ([K.REDUCE_TIED, K.REDUCE_GRAD, K.STEP] if train else [])
    return {s: actions + [Action(s, k) for k in tail] for s, actions in schedule.items()}


def lower(compute: Schedule, stage_graph: StageGraph, *, loading_stages: set[int], train: bool,
          duration: Callable[[Action], float] | None = None) -> Schedule:
    """Apply every lowering pass to a compute-only schedule (``duration``: the compute times it was
    made for, which order the transfers when they must be reordered, see ``group_for_rendezvous``)."""
    compute = drop_frozen_backward(compute, stage_graph)
    transfers = add_send_recv(add_load(compute, loading_stages=loading_stages), stage_graph)
    return add_epilogue(add_release(group_for_rendezvous(transfers, duration=duration)), train=train)


def build_schedule(stage_graph: StageGraph, num_microbatches: int, *, name: str = "1f1b", train: bool = True,
                   loading_stages: set[int] | None = None) -> Schedule:
    """The full schedule the engine runs for one batch.

    ``loading_stages`` defaults to the stages without predecessors plus the output stage.
    """
    if num_microbatches < 1:
        raise GPPConfigError(f"need at least one micro-batch, got {num_microbatches}")
    if loading_stages is None:
        loading_stages = {s for s in range(stage_graph.num_stages) if not stage_graph.preds(s)}
        loading_stages.add(stage_graph.output_stage)
    compute = get_schedule(name)(stage_graph, num_microbatches) if train else forward_only(stage_graph, num_microbatches)
    return lower(compute, stage_graph, loading_stages=loading_stages, train=train)
