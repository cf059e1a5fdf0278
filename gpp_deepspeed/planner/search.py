"""GraphPipe's stage-graph search (arXiv 2406.17145, Sec. 5, Alg. 1).

Three layers, as in the paper:

1. a sweep over micro-batch sizes (powers of two dividing the mini-batch, Sec. 5 and A.2), and
   in the ``"runtime"`` space over the uniform data-parallel degree;
2. a binary search on the bottleneck time per sample ``t_max`` (the objective, Eq. 1);
3. a feasibility DP over the series-parallel decomposition of the layer DAG whose value is the
   *least in-flight count of the subgraph's source stage* such that every stage in it meets
   ``TPS <= t_max`` and fits in memory under the in-flight rule (Sec. 5 "DP"; Sec. 6).

The DP itself, its tables and the stages it may form are in :mod:`._dp`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable, Sequence

from ..errors import GPPConfigError, InfeasiblePlanError
from ..schedule.registry import is_async
from ._dp import FeasibilityDP, flatten, narrow_bracket, work_fn
from ._polish import polish
from .costs import (NO_BOUNDARY, CommFit, CostDB, Hardware, LayerCost, StageCostModel, check_zero_stage,
                    micro_batch_sizes)
from .inflight import deepest_pipeline, needs_pipeline_depth, schedule_memory, stage_in_flight
from .plan import Plan, PlanStage, SearchResult
from .simulate import predict
from .sp import sp_tree

__all__ = ["graphpipe_search", "graphpipe_partition", "proxy_costs", "SPACES", "bottleneck_search",
           "schedule_bottleneck_search"]

SPACES = ("full", "runtime")
_REL_TOL = 1e-3
_RESHARD_ROUNDS = 2   # searches again per found plan whose resharding the DP under-priced


def bottleneck_search(cm: StageCostModel, tree, *, num_devices: int, micro_batch: int,
                      stage_devices: Sequence[int], rel_tol: float = _REL_TOL, floor: float = 0.0,
                      limit: float = math.inf, recompute: bool = False, schedule: str = "1f1b",
                      depth_cap: int | None = None, priced: dict | None = None, hint: float | None = None):
    """Binary search on ``tmax`` (Alg. 1, lines 1-9): the least feasible bottleneck time per
    sample within ``rel_tol``, its stages, and the DP states visited; ``(None, None, states)``
    when no ``tmax`` is feasible (memory or device counts). ``floor`` is a known lower bound on
    the answer (the optimum of a larger space), which narrows the first bracket; ``limit`` an
    upper one (a bottleneck above it is of no use to the caller), which ends a hopeless search
    after a few cheap DP runs: at a small ``tmax`` the device lower bounds prune nearly every state.

    Every stage must fit with what ``schedule`` stashes at its depth
    (:func:`~gpp_deepspeed.planner.inflight.schedule_memory`). Where that depends on the stage
    graph's depth (``zb1``, ``zb2``), ``depth_cap`` fixes it: every stage is priced as if the
    pipeline were that deep, and only plans at most that deep are found. ``priced`` caches stage
    prices at this micro-batch across calls; ``hint`` is a related search's answer (another
    micro-batch size's), where the bracketing starts."""
    if needs_pipeline_depth(schedule) and depth_cap is None:
        raise GPPConfigError(f'schedule "{schedule}" stashes by the pipeline\'s depth: give depth_cap')
    nodes = flatten(tree, cm)
    work = work_fn(cm, micro_batch / min(stage_devices))
    num_mb = cm.mini_batch // micro_batch
    deepest = deepest_pipeline(schedule, num_mb)
    stash_depth = depth_cap
    if deepest is not None:
        depth_cap = deepest if depth_cap is None else min(depth_cap, deepest)
    states = 0
    infeasible: dict = {}
    priced = {} if priced is None else priced
    stash = functools.lru_cache(maxsize=None)(
        lambda k: schedule_memory(schedule, depth=k, pipeline_depth=stash_depth or k, num_microbatches=num_mb))

    def attempt(tmax: float):
        nonlocal states
        dp = FeasibilityDP(cm, nodes, micro_batch, tmax, stage_devices, work, num_devices, infeasible, priced,
                           recompute, stash)
        r = dp.solve(len(nodes) - 1, num_devices, 0)
        states += dp.states
        if r is None or depth_cap is not None and r[0] > depth_cap:
            return None
        return dp.stages(len(nodes) - 1, num_devices, 0)

    def bottleneck(stages) -> float:
        # The plan found at tmax usually has a lower bottleneck than tmax: bisect from there.
        # (With recomputation a stage's time depends on its in-flight count: stay at tmax.)
        if recompute:
            return math.inf
        tps = _stage_tps(cm, stages, micro_batch, stash)
        return max(cm.time_per_sample(mask, micro_batch, n, tp=t) for (mask, n), t in zip(stages, tps))

    # A layer that fits on no stage, even alone with one micro-batch in flight, rules out every plan.
    limit = cm.db.hardware.memory_bytes
    if not all(any(cm.stage(1 << i, micro_batch, n, tp=t).memory(*stash(1)) <= limit
                   for n in stage_devices for t in cm.tp_options(n, micro_batch)) for i in range(cm.num_layers)):
        return None, None, states
    # No plan beats perfect balance, nor the stage that holds the slowest layer: its compute at
    # least, and the all-reduce of that layer's gradients at least, on the widest stage allowed.
    lo = max(floor, work(cm.full_mask) / num_devices, _slowest_layer(cm, micro_batch, stage_devices))
    # Every layer as its own single-device stage bounds any stage made of them from above.
    ceiling = 2 * max(lo, sum(cm.time_per_sample(1 << i, micro_batch, 1) for i in range(cm.num_layers)))
    if limit < ceiling:
        if lo >= limit:
            return None, None, states
        ceiling = limit
    hi, best = _bisect(attempt, bottleneck, lo, ceiling, hint=hint, rel_tol=rel_tol,
                       single_degree=len(stage_devices) == 1)
    return hi, best, states


def _bisect(attempt: Callable, bottleneck: Callable, lo: float, ceiling: float, *, hint: float | None,
            rel_tol: float, single_degree: bool):
    """The least ``tmax`` in ``[lo, ceiling]`` at which ``attempt`` finds stages, within ``rel_tol``,
    and those stages; ``(None, None)`` when none does. ``bottleneck(stages)`` is a found plan's own
    bottleneck, at most the ``tmax`` that found it: the bracket closes from there."""
    best = None
    if hint is not None and lo < hint < ceiling:
        # A related search's optimum (the next micro-batch size's) is usually close: probe just
        # above and just below it, which brackets the optimum tightly with cheap DP runs.
        hi = min(hint * (1 + 4 * rel_tol), ceiling)
        best = attempt(hi)
        if best is None:
            lo = hi
        else:
            hi = min(hi, bottleneck(best))
            below = hint * (1 - 4 * rel_tol)
            if lo < below:
                found = attempt(below)
                if found is None:
                    lo = below
                else:
                    hi, best = min(below, bottleneck(found)), found
    # Otherwise bracket the optimum by growing from the lower bound in widening steps: a DP run at
    # a tmax below the optimum is cheap (the device lower bounds prune nearly every state), one
    # far above it is not (most states are feasible and are all solved). With one data-parallel
    # degree, where memory often rules out every plan, one cheap DP at the ceiling says so first.
    step, grown = 0.1, lo
    while best is None:
        grown = min(grown * (1 + step), ceiling)
        best = attempt(grown)
        if best is not None:
            hi = min(grown, bottleneck(best))
        elif grown >= ceiling or (step == 0.1 and single_degree and attempt(ceiling) is None):
            return None, None
        else:
            lo, step = grown, 2 * step
    return narrow_bracket(attempt, bottleneck, lo, hi, best, rel_tol=rel_tol)


def _slowest_layer(cm: StageCostModel, b: int, stage_devices: Sequence[int]) -> float:
    """A lower bound on any plan's bottleneck: every layer sits in some stage, which spends at
    least the layer's compute on its shard and all-reduces at least the layer's gradients."""
    bound = 0.0
    for i in range(cm.num_layers):
        least = math.inf
        for n in stage_devices:
            for t in cm.tp_options(n, b):
                c = cm.stage(1 << i, b, n, boundary=NO_BOUNDARY, tp=t)
                least = min(least, (c.fwd_s + c.bwd_s + c.allreduce_s * b / cm.mini_batch) / b)
        bound = max(bound, least)
    return bound


def graphpipe_search(db: CostDB, *, num_devices: int, mini_batch: int, micro_batches: Sequence[int] | None = None,
                     space: str = "full", schedules: Sequence[str] = ("1f1b",), rel_tol: float = _REL_TOL,
                     recompute: bool = False, zero_stages: Sequence[int] = (0,),
                     progress: Callable[[str], None] | None = None, tp_degrees: Sequence[int] = (1, ),
                     tp_across_nodes: bool = False) -> SearchResult:
    """GraphPipe's plan for ``db`` on ``num_devices`` devices: the best predicted throughput over
    the micro-batch sweep of the least-bottleneck stage graphs, under each of ``schedules``.

    Each candidate stage graph is priced with the memory of the schedule it will run
    (:func:`~gpp_deepspeed.planner.inflight.schedule_memory`) and timed by the simulator under it,
    so a schedule that stashes more (``zb1``, ``zb2``, the asynchronous ones) or fills the
    pipeline's bubbles (the zero-bubble ones) can lead to another partition. The result's plan is
    the fastest that fits over every schedule (it carries its schedule); ``alternatives`` holds
    each schedule's best plan (None where nothing fits), in the order given.

    ``space="full"`` lets every stage have its own data-parallel degree (a power of two); the
    ``"runtime"`` space gives every stage the same degree. ``recompute=True`` lets a stage that
    would not fit recompute its activations in the backward (PipeDream-2BW's per-stage choice);
    the plan marks those stages.

    ``zero_stages`` are the ZeRO stages to search under, one for the whole plan (DeepSpeed's
    ``zero_optimization.stage``): each prices every stage's weight state
    (:func:`~gpp_deepspeed.planner.costs.weight_state_bytes`) and its group's collectives
    (:func:`~gpp_deepspeed.planner.costs.zero_collectives`). Searched lowest first, a higher
    stage's plan is kept only when it is faster than every lower stage's: a higher stage holds
    less memory but communicates as much or more, so it wins only where memory binds (it admits
    a stage graph, micro-batch or degree the lower one cannot fit). ``(0, 1, 2, 3)`` is ``gpp plan
    --zero auto``. Stages 2 and 3 are not searched under an asynchronous schedule.

    ``tp_degrees`` are the tensor-parallel degrees a stage may run (``gpp plan --tp``): a stage on
    ``n`` devices runs ``n / tp`` replicas of ``tp`` ranks
    (:meth:`~gpp_deepspeed.planner.costs.StageCostModel.tp_options`), and each stage of the plan
    gets the degree at which it is fastest and fits
    (:meth:`~gpp_deepspeed.planner.costs.StageCostModel.choose_tp`); a TP group stays within a
    node unless ``tp_across_nodes``.
    """
    if space not in SPACES:
        raise GPPConfigError(f'search space must be one of {SPACES}, got "{space}"')
    schedules = tuple(n.lower() for n in schedules) or ("1f1b",)
    for name in schedules:
        schedule_memory(name, depth=1, pipeline_depth=1, num_microbatches=1)   # an unknown name fails here
    zero_stages = sorted({check_zero_stage(z) for z in zero_stages}) or [0]
    for name in schedules:
        if is_async(name) and zero_stages[0] >= 2:
            raise GPPConfigError(f'schedule "{name}" stashes whole weight versions: plan it with ZeRO stage 0 or 1, '
                                 f"not {zero_stages}")
    start = time.perf_counter()
    tp_degrees = tuple(sorted({1, *tp_degrees}))
    if any(t < 1 for t in tp_degrees):
        raise GPPConfigError(f"tensor-parallel degrees must be positive, got {list(tp_degrees)}")
    sweeps = [_Sweep(db, num_devices=num_devices, mini_batch=mini_batch, space=space, rel_tol=rel_tol,
                     recompute=recompute, progress=progress, zero_stage=z, tp_degrees=tp_degrees,
                     tp_across_nodes=tp_across_nodes) for z in zero_stages]
    sizes = micro_batch_sizes(mini_batch, micro_batches)
    bests = []
    for name in schedules:
        best = None
        for sweep in sweeps:   # lowest ZeRO stage first: a higher one must be strictly faster to replace it
            if sweep.zero_stage < 2 or not is_async(name):
                best = sweep.run(name, sizes, best)
        bests.append(best)
    states = sum(sweep.states for sweep in sweeps)
    elapsed = time.perf_counter() - start - sum(sweep.predict_s for sweep in sweeps)
    found = [p for p in bests if p is not None]
    if not found:
        gib = db.hardware.memory_bytes / 2**30
        under = "" if zero_stages == [0] else f" under ZeRO stage {', '.join(map(str, zero_stages))}"
        return SearchResult(method="graphpipe", plan=None, search_time_s=elapsed, states=states,
                            status=f"no plan fits {gib:.1f} GiB per device on {num_devices} devices at any "
                                   f"micro-batch{under}", alternatives=tuple(bests))
    best = max(found, key=lambda p: p.predicted.samples_per_s)
    return SearchResult(method="graphpipe", plan=best, search_time_s=elapsed, states=states,
                        alternatives=tuple(bests))


class _Sweep:
    """:func:`graphpipe_search`'s sweep for one cost database and ZeRO stage: per schedule,
    micro-batch and data-parallel option, the least-bottleneck stage graphs, each simulated."""

    def __init__(self, db: CostDB, *, num_devices: int, mini_batch: int, space: str, rel_tol: float,
                 recompute: bool, progress: Callable[[str], None] | None, zero_stage: int = 0,
                 tp_degrees: tuple[int, ...] = (1, ), tp_across_nodes: bool = False):
        self.db, self.num_devices, self.mini_batch = db, num_devices, mini_batch
        self.space, self.rel_tol, self.recompute, self.progress = space, rel_tol, recompute, progress
        self.zero_stage = zero_stage
        self.tree, self.added = sp_tree(db.graph)
        self.cm = StageCostModel(db, mini_batch, p2p_devices=num_devices, zero_stage=zero_stage,
                                 tp_degrees=tp_degrees, tp_across_nodes=tp_across_nodes)
        self.states = 0
        self.predict_s = 0.0
        self._priced: dict[int, dict] = {}   # per micro-batch: stage prices shared by every bisection

    def run(self, schedule: str, sizes: Sequence[int], best: Plan | None = None) -> Plan | None:
        """The fastest plan that fits under ``schedule``, or None; ``best`` (another sweep's plan)
        is kept unless a plan here is strictly faster, and prunes what cannot be."""
        cm, mini_batch, num_devices = self.cm, self.mini_batch, self.num_devices
        best_time = math.inf if best is None else best.predicted.iteration_time_s
        hints: dict = {}
        full_space: list = []   # per micro-batch: its fastest simulated plan, stage devices and plans
        for b in sorted(sizes, reverse=True):
            # The DP minimises the bottleneck (the paper's objective, Eq. 1), which ignores pipeline
            # fill and drain; with few micro-batches a shallower plan on one uniform data-parallel
            # degree can finish sooner. So the full space also tries every uniform degree, and the
            # simulator picks among the least-bottleneck plans, as it does among micro-batch sizes.
            uniform = [d for d in _divisors(num_devices) if b % d == 0]
            options = uniform if self.space == "runtime" else [None] + uniform
            # A stage's devices: replicas that divide the micro-batch, times a TP degree.
            full_devices = sorted({d * t for d in _powers_of_two(b) for t in cm.tp_degrees if d * t <= num_devices})
            full_tps = None   # the full space's least bottleneck at this b: a floor for its subsets
            for d in options:
                hint = hints.get(d)
                # The bottleneck stage alone is busy mini_batch * TPS >= mini_batch * work / devices,
                # so an option whose perfect balance cannot beat the best plan so far is skipped.
                if mini_batch * work_fn(cm, b / (d or 1))(cm.full_mask) / num_devices >= best_time:
                    continue
                floor = 0.0
                if d is not None and self.space == "full" and d in full_devices:
                    if full_tps is None:
                        continue      # the full space had no plan at this b; neither has its subset
                    floor = full_tps * (1 - self.rel_tol)
                    if mini_batch * floor >= best_time:
                        continue
                stage_devices = [d] if d is not None else full_devices
                found = self._least_bottleneck(schedule, b, stage_devices, floor, best_time, hint)
                least = min((tps for tps, _ in found), default=None)
                if least is not None:
                    hints[d] = least    # where the next micro-batch size's search starts
                if d is None:
                    full_tps = least
                if self.progress is not None:
                    what = (f"micro-batch {b}" + (f", degree {d}" if d else "") + f", {schedule}"
                            + (f", ZeRO stage {self.zero_stage}" if self.zero_stage else ""))
                    self.progress(f"graphpipe: {what}: " + ("no feasible plan that can beat the best so far"
                                  if not found else ", ".join(f"{len(st)} stages, bottleneck {tps:.4g} s/sample"
                                                               for tps, st in found)))
                best, best_time, fastest = self._keep_fastest(found, b, schedule, best, best_time)
                if d is None and fastest < math.inf:
                    full_space.append((fastest, b, stage_devices, found))
        # Last, the full space's plans at the micro-batch whose plan simulated fastest are searched
        # again where the DP under-priced their resharding (one micro-batch only: each repricing is
        # a search of its own, and a large mini-batch has fifteen sizes or more).
        for _, b, stage_devices, found in sorted(full_space, key=lambda x: x[0])[:1]:
            more = self._repriced(schedule, b, stage_devices, found, best_time)
            if self.progress is not None and more:
                self.progress(f"graphpipe: micro-batch {b}, {schedule}, repriced for resharding: "
                              + ", ".join(f"{len(st)} stages, bottleneck {tps:.4g} s/sample" for tps, st, _ in more))
            best, best_time, _ = self._keep_fastest(more, b, schedule, best, best_time)
        return best

    def _keep_fastest(self, found: list, b: int, schedule: str, best: Plan | None, best_time: float):
        """``best`` and its iteration time, or a plan of ``found`` the simulator finds faster that
        fits; and the fastest fitting iteration time among ``found``."""
        fastest = math.inf
        for tps, stages, *repriced in found:
            t0 = time.perf_counter()
            plan = predict(self._plan(stages, b, tps, schedule, bool(repriced)), self.db, schedule=schedule)
            self.predict_s += time.perf_counter() - t0
            if plan.predicted.fits_memory:
                fastest = min(fastest, plan.predicted.iteration_time_s)
                if plan.predicted.iteration_time_s < best_time:
                    best, best_time = plan, plan.predicted.iteration_time_s
        return best, best_time, fastest

    def _least_bottleneck(self, schedule: str, b: int, stage_devices: list[int], floor: float,
                          best_time: float, hint: float | None) -> list[tuple[float, list[tuple[int, int]]]]:
        # A plan runs B / b micro-batches through its bottleneck stage, so its iteration takes
        # at least B * TPS: a bottleneck above best_time / B cannot beat the best plan so far.
        found, visited = schedule_bottleneck_search(
            self.cm, self.tree, schedule=schedule, num_devices=self.num_devices, micro_batch=b,
            stage_devices=stage_devices, rel_tol=self.rel_tol, floor=floor, limit=best_time / self.mini_batch,
            recompute=self.recompute, priced=self._priced.setdefault(b, {}), hint=hint)
        self.states += visited
        return found

    def _repriced(self, schedule: str, b: int, stage_devices: list[int], found: list, best_time: float) -> list:
        """More candidates where the DP under-priced a found plan's resharding.

        The DP prices a stage before its neighbours are placed, as if they ran on its own degree;
        the engine sends an edge between stages of different degrees as one message per peer rank
        that holds a rank's rows (``costs.reshard_messages``), which the plan's exact bottleneck
        (``StageCostModel.plan_bottleneck``) and the simulator price. Where that is above the
        DP's bottleneck by more than the tolerance, the search runs again with every stage priced
        against its neighbours' degrees in that plan (``StageCostModel.with_degrees``), and again
        against the new plan's, up to ``_RESHARD_ROUNDS`` times; the best of these plans is then
        polished by small changes priced exactly (:func:`._polish.polish`). ``(tps, stages, True)``
        per plan, for the simulator to rank beside the others."""
        more = []
        if self.recompute:   # a recomputed stage's time depends on its in-flight count: no exact bottleneck
            return more
        exact = functools.partial(self.cm.plan_bottleneck, b=b)
        for tps, stages in found:
            if exact(stages) <= tps * (1 + self.rel_tol):
                continue
            # Repriced, a stage costs at least what the DP priced it (every edge at least one
            # message), so the DP's optimum is a floor; a found plan, priced against its own
            # degrees, meets its exact bottleneck, where the bracketing starts.
            floor, tried = tps * (1 - self.rel_tol), [stages]
            for _ in range(_RESHARD_ROUNDS):
                again, visited = schedule_bottleneck_search(
                    self.cm.with_degrees(stages), self.tree, schedule=schedule, num_devices=self.num_devices,
                    micro_batch=b, stage_devices=stage_devices, rel_tol=self.rel_tol, floor=floor,
                    limit=best_time / self.mini_batch, recompute=self.recompute, hint=exact(stages))
                self.states += visited
                if not again:
                    break
                tps, stages = min(again, key=lambda found_: exact(found_[1]))
                more.append((tps, stages, True))
                tried.append(stages)
                if exact(stages) <= tps * (1 + self.rel_tol):
                    break
            start = min(tried, key=exact)
            polished = polish(self.cm, start, b, stage_devices, lambda st: _fits(self.cm, st, b, schedule, self.recompute))
            if sorted(polished) != sorted(start):
                more.append((exact(polished), polished, True))
        return more

    def _plan(self, stages: list[tuple[int, int]], b: int, tps: float, schedule: str, repriced: bool = False) -> Plan:
        plan = _plan(self.db, self.cm, stages, b, self.mini_batch, tps, self.added, self.space, self.recompute,
                     schedule, self.zero_stage)
        if repriced:
            plan = dataclasses.replace(plan, notes={**plan.notes, "repriced_for_resharding": True})
        return plan


def schedule_bottleneck_search(cm: StageCostModel, tree, *, schedule: str, num_devices: int, micro_batch: int,
                               stage_devices: Sequence[int], rel_tol: float = _REL_TOL, floor: float = 0.0,
                               limit: float = math.inf, recompute: bool = False, priced: dict | None = None,
                               hint: float | None = None) -> tuple[list[tuple[float, list[tuple[int, int]]]], int]:
    """:func:`bottleneck_search` with every stage priced with what ``schedule`` stashes: the
    least-bottleneck ``(tps, stages)`` found (several for the zero-bubble schedules: one per
    pipeline depth searched; none when nothing fits) and the DP states visited.

    A zero-bubble schedule stashes by the pipeline's depth ``D`` on every stage, at least what
    1F1B stashes, so 1F1B's least bottleneck is a floor for it and, when 1F1B's plan also fits
    under it, its optimum. Otherwise every depth ``D`` is searched with each stage priced at
    ``D`` (a deeper pipeline splits the layers finer but stashes more on every stage)."""
    kw = dict(num_devices=num_devices, micro_batch=micro_batch, stage_devices=stage_devices, rel_tol=rel_tol,
              limit=limit, recompute=recompute, priced={} if priced is None else priced)
    first = "1f1b" if needs_pipeline_depth(schedule) else schedule
    tps, stages, states = bottleneck_search(cm, tree, floor=floor, schedule=first, hint=hint, **kw)
    if stages is None or first == schedule or _fits(cm, stages, micro_batch, schedule, recompute):
        return ([] if stages is None else [(tps, stages)]), states
    found = []
    deepest = min(flatten(tree, cm)[-1].depth, num_devices // min(stage_devices))
    for cap in range(1, deepest + 1):
        t, st, visited = bottleneck_search(cm, tree, floor=tps * (1 - rel_tol), schedule=schedule, depth_cap=cap, **kw)
        states += visited
        if st is not None:
            found.append((t, st))
    return found, states


def _fits(cm: StageCostModel, stages: list[tuple[int, int]], b: int, schedule: str, recompute: bool) -> bool:
    """Every stage fits with what ``schedule`` stashes in this stage graph (recomputing where the
    search may)."""
    depth = _depths(cm, stages)
    top, num_mb = max(depth), cm.mini_batch // b
    limit = cm.db.hardware.memory_bytes
    for (mask, n), k in zip(stages, depth):
        stash = schedule_memory(schedule, depth=k, pipeline_depth=top, num_microbatches=num_mb)
        if cm.choose_tp(mask, b, n, stash) is None and not (
                recompute and cm.choose_tp(mask, b, n, stash, recompute=True) is not None):
            return False
    return True


def _stage_tps(cm: StageCostModel, stages: list[tuple[int, int]], b: int, stash: Callable) -> list[int]:
    """Each stage's TP degree (:meth:`StageCostModel.choose_tp`) at its depth ``k`` in the stage
    graph of ``stages``, holding ``stash(k)``; the fastest degree where none fits."""
    out = []
    for (mask, n), k in zip(stages, _depths(cm, stages)):
        chosen = cm.choose_tp(mask, b, n, stash(k))
        out.append(chosen if chosen is not None else min(cm.tp_options(n, b) or [1],
                                                         key=lambda t: cm.time_per_sample(mask, b, n, tp=t)))
    return out


def _depths(cm: StageCostModel, stages: list[tuple[int, int]]) -> list[int]:
    """Each stage's depth (stages on its longest path to the output) in the stage graph of
    ``stages`` (layer masks and degrees, in any order)."""
    succs = cm.stage_successors([mask for mask, _ in stages])
    return [stage_in_flight(succs, {s: 1 for s in succs})[s] for s in range(len(stages))]


def _plan(db: CostDB, cm: StageCostModel, stages: list[tuple[int, int]], b: int, mini_batch: int, tps: float,
          added: tuple, space: str, recompute: bool = False, schedule: str = "1f1b", zero_stage: int = 0) -> Plan:
    """Stages as a :class:`Plan` for ``schedule``, numbered in a topological order of the stage graph."""
    masks = [mask for mask, _ in stages]
    order = cm.stage_order(masks)
    # A stage recomputes exactly when it would not fit with what the schedule stashes at its
    # depth otherwise, which is the choice the DP's feasibility test made.
    succs = cm.stage_successors(masks)
    depth = stage_in_flight(succs, {s: 1 for s in succs})
    top = max(depth.values())

    def choice(s: int) -> tuple[int, bool]:
        """Stage ``s``'s TP degree and whether it recomputes: the fastest degree that fits as it
        is, else (where the search may) recomputed."""
        stash = schedule_memory(schedule, depth=depth[s], pipeline_depth=top, num_microbatches=mini_batch // b)
        tp = cm.choose_tp(stages[s][0], b, stages[s][1], stash)
        if tp is None and recompute:
            return cm.choose_tp(stages[s][0], b, stages[s][1], stash, recompute=True) or 1, True
        return tp or 1, False

    chosen = {s: choice(s) for s in order}
    plan_stages = tuple(PlanStage(layers=cm.names_of(stages[s][0]), devices=stages[s][1], tp=chosen[s][0],
                                  recompute=chosen[s][1]) for s in order)
    notes = {"bottleneck_tps_s": tps, "space": space,
             "sp_added_edges": [list(e) for e in added]}
    return Plan(model=db.model, method="graphpipe", source=db.source, micro_batch=b, mini_batch=mini_batch,
                stages=plan_stages, notes=notes, schedule=schedule, zero_stage=zero_stage)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(b: int) -> list[int]:
    return [1 << i for i in range(b.bit_length()) if b % (1 << i) == 0]


def graphpipe_partition(db: CostDB, *, num_stages: int, micro_batch: int = 1,
                        rel_tol: float = _REL_TOL) -> dict[str, int]:
    """GraphPipe's least-bottleneck stage graph with exactly ``num_stages`` single-rank stages.

    This is what ``GraphPipelineModule(partition_method="graphpipe")`` runs on every rank: the
    pipeline's stage count is fixed by the topology, so the search only decides which layers go
    together. It is deterministic, so every rank computes the same partition.
    """
    cm = StageCostModel(db, micro_batch, p2p_devices=num_stages)
    tree, _ = sp_tree(db.graph)
    tps, stages, _ = bottleneck_search(cm, tree, num_devices=num_stages, micro_batch=micro_batch,
                                       stage_devices=[1], rel_tol=rel_tol)
    if stages is None:
        raise InfeasiblePlanError(f"GraphPipe found no partition of {db.model} into {num_stages} stages that fits "
                                  f"{db.hardware.memory_bytes / 2**30:.1f} GiB per device; use more stages")
    plan = _plan(db, cm, stages, micro_batch, micro_batch, tps, (), "runtime")
    return plan.stage_of


def proxy_costs(graph, param_counts: Sequence[int], *, model: str = "model") -> CostDB:
    """A cost database from parameter counts alone (time proportional to parameters, free links,
    unlimited memory): what ``partition_method="graphpipe"`` plans with when no profile is given."""
    free = CommFit(alpha_s=0.0, beta_s_per_byte=0.0)
    layers = tuple(LayerCost(name=node.name, inputs=tuple(str(r) for r in node.inputs), micro_batches=(1,),
                             fwd_s=(float(p),), bwd_s=(2.0 * p,), param_bytes=0, out_bytes=0, stash_bytes=0)
                   for node, p in zip(graph.nodes, param_counts))
    hw = Hardware(name="proxy", memory_bytes=2**62, devices_per_node=2**20, intra=free, inter=free)
    return CostDB(model=model, source="proxy: time proportional to parameter count", input_names=graph.input_names,
                  output=graph.output, layers=layers, hardware=hw)
