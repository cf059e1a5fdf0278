"""Schedule generators: pure functions from a stage graph to the compute order of every stage.

A generator decides the order of compute (``F`` and ``B`` per micro-batch) on every stage; the
lowering passes (:mod:`.lowering`) then add data loading, the point-to-point transfers of every
stage edge, group the transfers that must progress together, place the release points and add
the end-of-batch reductions. The registry of schedules is :data:`gpp_deepspeed.schedule.SCHEDULES`.

``1f1b``
    Branch-aware synchronous 1F1B, GraphPipe's default (arXiv 2406.17145, Sec. 6): a stage runs
    ``min(depth - 1, M)`` warm-up forwards, where ``depth`` counts the stages on the longest path
    from it to the output stage, then alternates one forward and one backward, then drains its
    backwards. On a chain ``depth - 1 = S - 1 - i``, exactly DeepSpeed's ``TrainSchedule`` and
    PipeDream-Flush (Narayanan et al., ICML'21). A stage keeps at most ``depth`` micro-batches in
    flight.
``gpipe``
    All forwards, then all backwards (GPipe, Huang et al., NeurIPS'19; ``M`` micro-batches in
    flight).
``forward_only``
    Forwards only, for evaluation.
"""

from __future__ import annotations

from ..graph.stages import StageGraph
from .ir import Action, ActionKind as K, Schedule

__all__ = ["one_f_one_b", "gpipe", "forward_only", "warmup_forwards"]


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
