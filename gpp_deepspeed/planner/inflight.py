"""GraphPipe's in-flight rule: how many samples a stage keeps stashed under synchronous 1F1B.

A stage must have enough micro-batches in flight to keep every successor busy: one more
micro-batch than its busiest successor, enlarged when a successor's micro-batch is bigger than
its own (it then runs ``x = b_t / b_s`` forwards in a row to fill one successor micro-batch).
GraphPipe (arXiv 2406.17145, Sec. 6, Alg. 2 ``ComputeInFlight``; Table 2 is an image, the
rule here is reconstructed and reproduces both numbers of Fig. 5)::

    k_s = x_s * b_s                                  if s is the last stage
    k_s = max over successors t of k_t + max(x_s * b_s, b_t),   x_s = max(1, b_t / b_s)

With one micro-batch size ``b`` for all stages this is ``b`` times the stage's depth to the
sink: the chain's ``S - i + 1`` micro-batches (1-indexed), and a graph's shallower depth.

Other schedules keep other counts (:func:`schedule_memory`): the search prices every candidate
stage graph with the counts of the schedule it will run.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..schedule.registry import get_schedule

__all__ = ["in_flight", "stage_in_flight", "schedule_memory", "needs_pipeline_depth", "deepest_pipeline"]


def in_flight(micro_batch: int, successors: Sequence[tuple[int, int]]) -> int:
    """Samples in flight on a stage with micro-batch ``micro_batch``.

    ``successors`` are ``(k_t, b_t)`` pairs: each successor's in-flight samples and micro-batch.

    >>> in_flight(4, [])            # the last stage holds one micro-batch
    4
    >>> in_flight(2, [(4, 4)])      # Fig. 5: s2 with b=2 before s3 with b=4
    8
    """
    if not successors:
        return micro_batch
    return max(k_t + max(max(1, b_t // micro_batch) * micro_batch, b_t) for k_t, b_t in successors)


def stage_in_flight(succs: Mapping[int, Sequence[int]], micro_batches: Mapping[int, int]) -> dict[int, int]:
    """In-flight samples of every stage of a stage DAG, from the sinks backwards.

    ``succs[s]`` lists the successors of stage ``s``; ``micro_batches[s]`` its micro-batch size.

    >>> stage_in_flight({0: [1], 1: [2], 2: []}, {0: 4, 1: 4, 2: 4})      # Fig. 5, uniform
    {2: 4, 1: 8, 0: 12}
    >>> stage_in_flight({0: [1], 1: [2], 2: []}, {0: 1, 1: 2, 2: 4})      # Fig. 5, per stage
    {2: 4, 1: 8, 0: 10}
    """
    done: dict[int, int] = {}

    def visit(s: int) -> int:
        if s not in done:
            done[s] = in_flight(micro_batches[s], [(visit(t), micro_batches[t]) for t in succs[s]])
        return done[s]

    for s in sorted(succs, reverse=True):
        visit(s)
    return done


def schedule_memory(schedule: str, *, depth: int, pipeline_depth: int, num_microbatches: int) -> tuple[int, int]:
    """Micro-batches of activations and copies of the weights a stage of ``depth`` (stages on its
    longest path to the output, itself included) stashes at its peak under ``schedule``, in a
    stage graph whose longest path has ``pipeline_depth`` stages, with uniform micro-batches.

    Both counts are the schedule's own, registered with it
    (:class:`~gpp_deepspeed.schedule.ScheduleSpec`): ``stash`` gives the micro-batches (``1f1b``:
    ``min(depth, M)``, GraphPipe Sec. 6; ``gpipe``: ``M``; ``zb1``: ``min(D, M)`` on every stage;
    ``zb2``: ``min(2 D - 1, M)``; the asynchronous ones: ``depth`` whatever ``M``), and an
    asynchronous schedule's weight rule the copies
    (:meth:`~gpp_deepspeed.schedule.WeightRule.stashed_versions`).

    >>> [schedule_memory(s, depth=1, pipeline_depth=3, num_microbatches=8) for s in ("1f1b", "zb1", "zb2", "2bw")]
    [(1, 0), (3, 0), (5, 0), (1, 2)]
    """
    spec = get_schedule(schedule)
    versions = spec.weights.stashed_versions(depth) if spec.asynchronous else 0
    return spec.stash(depth, pipeline_depth, num_microbatches), versions


def needs_pipeline_depth(schedule: str) -> bool:
    """True when a stage's stash depends on the whole stage graph's depth, not only its own.

    >>> needs_pipeline_depth("zb1"), needs_pipeline_depth("1f1b")
    (True, False)
    """
    return get_schedule(schedule).stash_reads_pipeline_depth


def deepest_pipeline(schedule: str, num_microbatches: int) -> int | None:
    """The deepest stage graph ``schedule`` runs with ``num_microbatches`` per batch, or None for
    no limit (:meth:`~gpp_deepspeed.schedule.WeightRule.deepest_pipeline`: PipeDream-2BW's).

    >>> deepest_pipeline("2bw", 3), deepest_pipeline("1f1b", 3)
    (4, None)
    """
    weights = get_schedule(schedule).weights
    return None if weights is None else weights.deepest_pipeline(num_microbatches)
