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
"""

from __future__ import annotations

from typing import Mapping, Sequence

__all__ = ["in_flight", "stage_in_flight"]


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
