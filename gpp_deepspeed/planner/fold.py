"""Folded plans: GraphPipe's stage graph with several stages per pipeline rank (issue 28).

A folded plan cuts the model into ``k R`` single-device stages with GraphPipe's search (the same
DP and bottleneck bisection as an unfolded plan, Sec. 5, on ``k R`` virtual devices), then places
them on ``R`` ranks: which stages share a rank (a V pairing an early stage with a late one,
looped, or two branches of the DAG on one rank) and the schedule the ranks run
(:data:`~gpp_deepspeed.schedule.virtual.FOLDED_SCHEDULES`) are chosen by
:func:`~.fold_search.search_fold`, which prices every fold of a schedule with the simulator on
the stage costs of the cost model and keeps each rank's memory (its stages' weight state plus the
activations it holds at its peak) within the device's; of each schedule's best fold the plan keeps
the one whose whole program (transfers included) the simulator predicts fastest. The fold is a step after the DP rather than
inside it: the DP's value (a source stage's in-flight count under a per-stage bottleneck) does not
decompose over ranks that hold stages from different parts of the DAG, while for the small number of
stages a pipeline has the fold is a small combinatorial choice the simulator can price exactly.

Glossary
--------
fold
    ``Plan.fold[s]``: the pipeline rank of stage ``s``.
stages per rank
    ``k``: the most stages a rank holds (2 for a V).

Representative use::

    result = fold_search(db, num_devices=4, mini_batch=32)     # SearchResult, plan.fold set
    sim = simulate_plan(result.plan, db)                       # its rank-by-rank timeline (simulate_folded)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from ..errors import ScheduleError
from ..schedule.virtual import FOLDED_SCHEDULES, Fold
from .costs import CostDB, StageCostModel, micro_batch_sizes
from .fold_search import search_fold
from .plan import Plan, SearchResult
from .search import _REL_TOL, _plan, bottleneck_search
from .simulate import action_duration, priced_stages, simulate_folded
from .sp import sp_tree

__all__ = ["fold_plan", "fold_search"]


def fold_plan(plan: Plan, db: CostDB, *, num_ranks: int, schedules: Sequence[str] = tuple(FOLDED_SCHEDULES),
              max_stages_per_rank: int = 2) -> Plan:
    """``plan``'s single-device stages placed on ``num_ranks`` ranks: for each of ``schedules``
    the fold :func:`~.fold_search.search_fold` finds fastest within the device's memory on the
    stages' costs (their compute order, messages free), then of those the one whose whole program
    the simulator predicts fastest (:func:`~gpp_deepspeed.planner.simulate.simulate_folded`:
    transfers on the link, hand-overs, each rank's memory). Raises
    :class:`~gpp_deepspeed.errors.ScheduleError` when no fold fits."""
    start = dataclasses.replace(plan, fold=Fold.looped(num_stages=plan.num_stages, num_ranks=num_ranks).rank_of,
                                schedule=next(iter(schedules)), predicted=None)
    priced = priced_stages(start, db)
    duration = action_duration(priced.costs, priced.step_s)
    edges = tuple(sorted({(e.src, e.dst) for e in priced.stage_graph.edges}))
    activation = {s: c.stash_bytes for s, c in enumerate(priced.costs)}
    static = {s: c.memory(0) for s, c in enumerate(priced.costs)}
    times = tuple(c.times for c in priced.costs)
    found = []
    # One search per schedule: the compute order alone ranks folds well within a schedule, but
    # not across schedules whose transfers differ (on MMT the zbv that computes fastest runs 3%
    # slower than the DualPipeV just behind it, once its messages are priced).
    for name in schedules:
        try:
            choice = search_fold(priced.stage_graph, plan.num_microbatches, num_ranks=num_ranks, duration=duration,
                                 activation=activation, static=static, memory=db.hardware.memory_bytes,
                                 max_stages_per_rank=max_stages_per_rank, schedules=(name, ))
        except ScheduleError:
            continue
        # The times and caps the fold's orders were made with travel in the plan: the engine builds the same order.
        folded = dataclasses.replace(start, fold=choice.fold.rank_of, schedule=choice.schedule, stage_times=times,
                                     max_in_flight=choice.max_in_flight or ())
        found.append(folded.with_prediction(simulate_folded(folded, db).prediction, edges))
    best = min(found, key=lambda p: (not p.predicted.fits_memory, p.predicted.iteration_time_s), default=None)
    if best is None:
        raise ScheduleError(f"no fold of {plan.num_stages} stages onto {num_ranks} ranks, at most "
                            f"{max_stages_per_rank} a rank, under {', '.join(schedules)} keeps every rank's memory "
                            f"within {db.hardware.memory_bytes}")
    return best


def fold_search(db: CostDB, *, num_devices: int, mini_batch: int, micro_batches: Sequence[int] | None = None,
                stages_per_rank: int = 2, schedules: Sequence[str] = tuple(FOLDED_SCHEDULES),
                progress: Callable[[str], None] | None = None) -> SearchResult:
    """The fastest folded plan for ``db`` on ``num_devices`` ranks, each holding up to
    ``stages_per_rank`` stages, over the micro-batch sweep.

    For each micro-batch size GraphPipe's search (:func:`~gpp_deepspeed.planner.search.bottleneck_search`)
    cuts the model into ``stages_per_rank * num_devices`` single-device stages (priced per stage
    with 1F1B's stash, a necessary condition; each rank's memory is checked after folding), and
    :func:`fold_plan` folds them. ``alternatives`` holds each micro-batch size's folded plan (None
    where none fits)."""
    began = time.perf_counter()
    tree, added = sp_tree(db.graph)
    virtual = stages_per_rank * num_devices
    found: list[Plan | None] = []
    for b in micro_batch_sizes(mini_batch, micro_batches):
        cm = StageCostModel(db, mini_batch, p2p_devices=num_devices)
        tps, stages, _ = bottleneck_search(cm, tree, num_devices=virtual, micro_batch=b, stage_devices=[1],
                                           rel_tol=_REL_TOL)
        plan = None
        if stages is not None and len(stages) > num_devices:
            cut = _plan(db, cm, stages, b, mini_batch, tps, added, "runtime")
            try:
                plan = fold_plan(cut, db, num_ranks=num_devices, schedules=schedules,
                                 max_stages_per_rank=stages_per_rank)
            except ScheduleError:
                plan = None
        if progress is not None:
            progress(f"fold: micro-batch {b}: " + ("no folded plan fits" if plan is None else
                     f"{plan.num_stages} stages on {num_devices} ranks, {plan.schedule}, "
                     f"{plan.predicted.iteration_time_s * 1e3:.2f} ms"))
        found.append(plan)
    fits = [p for p in found if p is not None and p.predicted.fits_memory]
    elapsed = time.perf_counter() - began
    if not fits:
        return SearchResult(method="graphpipe-folded", plan=None, search_time_s=elapsed,
                            status=f"no folded plan ({stages_per_rank} stages a rank) fits on {num_devices} ranks",
                            alternatives=tuple(found))
    best = min(fits, key=lambda p: p.predicted.iteration_time_s)
    return SearchResult(method="graphpipe-folded", plan=best, search_time_s=elapsed, alternatives=tuple(found))
