"""PipeDream-2BW's planner (Narayanan et al., ICML'21, Sec. 4), priced by the program that runs.

2BW's planner chooses, for a model of repeated blocks, the pipeline depth ``d`` (stages of equal
cost), the width ``w`` (each stage replicated ``w`` times, ``w * d`` devices), the micro-batch size
``b`` and whether the stages recompute their activations (Sec. 3.3), under two constraints: the
memory of every stage, which holds two weight versions besides the optimizer's weights (Sec. 3.1),
and ``M >= d - 1`` micro-batches per batch for two versions to suffice (its ``m >= d``). Where the
paper prices a configuration with a closed-form throughput and memory model, each candidate here
is a :class:`~gpp_deepspeed.planner.plan.Plan` priced by the simulator on the ``2bw`` program the
engine runs (:func:`~gpp_deepspeed.planner.simulate.predict`): its steady batch's time, its
in-flight micro-batches, its weight versions, recomputation's working memory and the once-per-batch
all-reduce of a replicated stage.

Glossary
--------
depth ``d``, width ``w``
    Stages, and devices per stage (each runs ``b / w`` rows of every micro-batch, and the stage
    averages their gradients in its once-per-batch update).
equal stages
    The list order cut into ``d`` contiguous stages of balanced forward-plus-backward time at
    micro-batch ``b`` (:func:`~gpp_deepspeed.planner.baselines.partition_balanced`), 2BW's
    "equi-sized" stages of a model whose blocks differ.

Representative use::

    result = pipedream_2bw_search(db, num_devices=8, mini_batch=64)
    result.plan.schedule, [s.devices for s in result.plan.stages], result.plan.stages[0].recompute
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from ..errors import GPPConfigError
from .costs import NO_BOUNDARY, CostDB, StageCostModel, micro_batch_sizes
from .plan import Plan, PlanStage, SearchResult
from .simulate import predict

__all__ = ["pipedream_2bw_search"]

SCHEDULE = "2bw"


def pipedream_2bw_search(db: CostDB, *, num_devices: int, mini_batch: int, micro_batches: Sequence[int] | None = None,
                         recompute: bool | None = None,
                         progress: Callable[[str], None] | None = None) -> SearchResult:
    """The fastest ``2bw`` plan of equal stages that fits in memory: every depth ``d`` dividing
    ``num_devices``, every micro-batch size of the sweep that the width divides and that leaves
    ``M >= d - 1`` micro-batches, with and without recomputation (``recompute``: only that one).

    ``SearchResult.trace`` holds ``(micro-batch, depth, recompute, samples/s or None)`` per
    candidate priced (None: it does not fit).
    """
    from .baselines import partition_balanced

    if num_devices < 1 or mini_batch < 1:
        raise GPPConfigError(f"num_devices and mini_batch must be positive, got {num_devices} and {mini_batch}")
    start = time.perf_counter()
    order = db.graph.list_topological_order()
    cm = StageCostModel(db, mini_batch, p2p_devices=num_devices)
    choices = (False, True) if recompute is None else (recompute, )
    best: Plan | None = None
    trace = []
    for b in micro_batch_sizes(mini_batch, micro_batches):
        for depth in range(1, min(num_devices, len(order)) + 1):
            width = num_devices // depth
            if num_devices % depth or b % width or mini_batch // b < depth - 1:
                continue
            times = [cm.stage(cm.mask_of([name]), b, width, boundary=NO_BOUNDARY) for name in order]
            bounds = partition_balanced([c.fwd_s + c.bwd_s for c in times], depth)
            for again in choices:
                stages = tuple(PlanStage(layers=tuple(order[lo:hi]), devices=width, recompute=again)
                               for lo, hi in zip(bounds, bounds[1:]))
                plan = predict(Plan(model=db.model, method="pipedream-2bw", source=db.source, micro_batch=b,
                                    mini_batch=mini_batch, stages=stages, pipeline="graph", schedule=SCHEDULE,
                                    notes={"depth": depth, "width": width, "parts": bounds}), db, schedule=SCHEDULE)
                p = plan.predicted
                trace.append((b, depth, again, p.samples_per_s if p.fits_memory else None))
                if progress is not None:
                    progress(f"pipedream-2bw: micro-batch {b}, depth {depth} x width {width}"
                             f"{', recompute' if again else ''}: {p.samples_per_s:.4g} samples/s"
                             + ("" if p.fits_memory else " (does not fit)"))
                if p.fits_memory and (best is None or p.samples_per_s > best.predicted.samples_per_s):
                    best = plan
    elapsed = time.perf_counter() - start
    if best is None:
        status = ("no depth dividing the devices and micro-batch leaves M >= depth - 1 micro-batches"
                  if not trace else f"no plan fits {db.hardware.memory_bytes / 2**30:.1f} GiB per device")
        return SearchResult(method="pipedream-2bw", plan=None, search_time_s=elapsed, states=len(trace),
                            trace=tuple(trace), status=status)
    return SearchResult(method="pipedream-2bw", plan=best, search_time_s=elapsed, states=len(trace),
                        trace=tuple(trace))
