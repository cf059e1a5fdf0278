"""The baselines GraphPipe is compared with: PipeDream, Piper and DeepSpeed's own partitions.

Every baseline takes the same inputs as :func:`~gpp_deepspeed.planner.search.graphpipe_search`,
prices stages with the same :class:`~gpp_deepspeed.planner.costs.StageCostModel`, sweeps the same
micro-batch sizes and returns a plan that the same simulator has timed
(:func:`~gpp_deepspeed.planner.simulate.predict`), so methods differ only in their search
(GraphPipe, arXiv 2406.17145, Sec. 7.1-7.2; reference notes Sec. 5.4).

Glossary
--------
chain plan
    ``Plan(pipeline="chain")``: the stages form one linear pipeline in list order that relays
    every tensor, run with synchronous 1F1B (PipeDream-Flush), as DeepSpeed's ``PipelineEngine``
    runs a ``PipelineModule``.
sweep
    For each micro-batch size ``b`` (powers of two dividing the mini-batch), the method's search
    at ``b``; every plan found is predicted and the one with the most samples per second among
    those that fit in memory wins.
search time
    Wall-clock seconds of the searches themselves, excluding the predictions.
trace
    ``SearchResult.trace``: one ``(micro-batch, stages, samples/s)`` per plan the searches found,
    ``samples/s`` None when it does not fit when simulated, ``stages`` None when nothing fit.
states
    DP cells filled (PipeDream: ``(i, m)``; Piper: ``(U, s)``), summed over the sweep; DeepSpeed's
    partitions count one per candidate plan.

Methods (``BASELINES``)::

    pipedream      PipeDream's DP over the linearised model with per-stage replication (SOSP'19)
    piper          Piper's DP over downsets with data-parallel stages (NeurIPS'21), t = 1
    ds-uniform     DeepSpeed partition_method="uniform": equal layer counts, d devices per stage
    ds-parameters  DeepSpeed partition_method="parameters": balanced parameter bytes
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Iterator, Sequence

from ..errors import GPPConfigError, SearchLimitError
from ..schedule.registry import get_schedule
from .costs import CostDB, StageCostModel, micro_batch_sizes
from .inflight import deepest_pipeline
from .pipedream import ChainCosts, pipedream_bottleneck
from .piper import enumerate_upsets, piper_bottlenecks
from .plan import Plan, PlanStage, SearchResult
from .simulate import predict

__all__ = ["pipedream_search", "piper_search", "deepspeed_search", "deepspeed_partition", "partition_uniform",
           "partition_balanced", "BASELINES"]

Progress = Callable[[str], None] | None
# What a method's search yields per candidate: micro-batch, (layer mask, devices) stages in
# pipeline order (None: nothing fits), bottleneck TPS, DP cells, and notes for the plan.
_Found = tuple[int, list[tuple[int, int]] | None, float | None, int, dict]


def pipedream_search(db: CostDB, *, num_devices: int, mini_batch: int, micro_batches: Sequence[int] | None = None,
                     replication: bool = True, schedules: Sequence[str] = ("1f1b", ),
                     progress: Progress = None) -> SearchResult:
    """PipeDream's plan: its partitioner on the list order, per micro-batch size and schedule.

    ``replication=False`` gives PipeDream's straight pipeline: ``num_devices`` stages of one
    device each. ``schedules``: the training schedules planned for and priced with, each on its
    own; an asynchronous one's weight versions count in the DP's memory (``"pipedream"``:
    PipeDream's own weight stashing). The fastest plan that fits over all of them wins;
    ``alternatives`` holds each schedule's. See :mod:`~gpp_deepspeed.planner.pipedream` for the DP.
    """
    _check(db, num_devices, mini_batch)
    results = [_pipedream_search(db, num_devices=num_devices, mini_batch=mini_batch, micro_batches=micro_batches,
                                 replication=replication, schedule=name, progress=progress) for name in schedules]
    if len(results) == 1:
        return results[0]
    found = [r for r in results if r.plan is not None]
    best = max(found, key=lambda r: r.plan.predicted.samples_per_s, default=results[0])
    return SearchResult(method="pipedream", plan=best.plan, search_time_s=sum(r.search_time_s for r in results),
                        states=sum(r.states for r in results), status=best.status,
                        trace=tuple(t for r in results for t in r.trace),
                        alternatives=tuple(r.plan for r in results))


def _pipedream_search(db: CostDB, *, num_devices: int, mini_batch: int, micro_batches: Sequence[int] | None,
                      replication: bool, schedule: str, progress: Progress) -> SearchResult:
    weights = get_schedule(schedule).weights

    def search(cm: StageCostModel) -> Iterator[_Found]:
        costs = ChainCosts.build(cm, db.graph.list_topological_order())
        for b in micro_batch_sizes(mini_batch, micro_batches):
            max_rep = max(r for r in range(1, num_devices + 1) if b % r == 0) if replication else 1
            if costs.num_layers * max_rep < num_devices:
                continue    # too few layers to use every device, whatever the memory
            tps, ranges, cells = pipedream_bottleneck(costs, micro_batch=b, num_devices=num_devices,
                                                      replication=replication, weights=weights)
            stages = None if ranges is None else [(costs.mask(i, j), r) for i, j, r in ranges]
            yield b, stages, tps, cells, {"replication": replication}

    return _sweep(db, "pipedream", search, num_devices=num_devices, mini_batch=mini_batch,
                  micro_batches=micro_batches, progress=progress, schedule=schedule)


def piper_search(db: CostDB, *, num_devices: int, mini_batch: int, micro_batches: Sequence[int] | None = None,
                 state_limit: int = 40_000, progress: Progress = None) -> SearchResult:
    """Piper's plan: its DP over the downsets of the layer DAG, per micro-batch size.

    Stops with ``plan=None`` and a status naming the limit as soon as the DAG shows more than
    ``state_limit`` downsets (Piper's ``IDEALS_LIMIT``). Piper may leave devices idle when that
    is faster; see :mod:`~gpp_deepspeed.planner.piper` for the DP.
    """
    _check(db, num_devices, mini_batch)

    def search(cm: StageCostModel) -> Iterator[_Found]:
        upsets = enumerate_upsets(cm, limit=state_limit)
        sizes = micro_batch_sizes(mini_batch, micro_batches)
        if not sizes:
            return
        found, cells, priced = piper_bottlenecks(cm, upsets, micro_batches=sizes, num_devices=num_devices)
        for b in sizes:
            tps, stages = found[b] if found[b] is not None else (None, None)
            yield b, stages, tps, cells // len(sizes), {"downsets": len(upsets), "pairs": priced}

    return _sweep(db, "piper", search, num_devices=num_devices, mini_batch=mini_batch,
                  micro_batches=micro_batches, progress=progress)


def deepspeed_search(db: CostDB, *, num_devices: int, mini_batch: int, micro_batches: Sequence[int] | None = None,
                     method: str = "uniform", progress: Progress = None) -> SearchResult:
    """DeepSpeed's ``PipelineModule`` partitions run as chain 1F1B, the best over the sweep.

    For every data-parallel degree ``d`` dividing ``num_devices`` (and the micro-batch), the list
    order is cut into ``num_devices / d`` contiguous stages of ``d`` devices each:
    ``method="uniform"`` balances layer counts (:func:`partition_uniform`), ``"parameters"``
    balances parameter bytes (:func:`partition_balanced`).
    """
    if method not in ("uniform", "parameters"):
        raise GPPConfigError(f'DeepSpeed partition method must be "uniform" or "parameters", got "{method}"')
    _check(db, num_devices, mini_batch)
    order = db.graph.list_topological_order()

    def search(cm: StageCostModel) -> Iterator[_Found]:
        partitions: dict[int, list[int]] = {}
        for b in micro_batch_sizes(mini_batch, micro_batches):
            for d in range(1, num_devices + 1):
                num_stages = num_devices // d
                if num_devices % d or b % d or num_stages > len(order):
                    continue
                if num_stages not in partitions:
                    partitions[num_stages] = deepspeed_partition(db, num_stages=num_stages, method=method)
                bounds = partitions[num_stages]
                stages = [(cm.mask_of(order[lo:hi]), d) for lo, hi in zip(bounds, bounds[1:])]
                yield b, stages, None, 1, {"partition_method": method, "parts": bounds}

    return _sweep(db, f"ds-{method}", search, num_devices=num_devices, mini_batch=mini_batch,
                  micro_batches=micro_batches, progress=progress)


def deepspeed_partition(db: CostDB, *, num_stages: int, method: str) -> list[int]:
    """Stage boundaries over the list order, as ``PipelineModule._partition_layers`` computes them."""
    if method == "uniform":
        return partition_uniform(len(db.layers), num_stages)
    weights = [db.by_name[name].param_bytes for name in db.graph.list_topological_order()]
    return partition_balanced(weights, num_stages)


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts whose sizes differ by at most one, the larger
    ones first (DeepSpeed's ``ds_utils.partition_uniform``).

    >>> partition_uniform(10, 4)
    [0, 3, 6, 8, 10]
    >>> partition_uniform(2, 3)
    [0, 1, 2, 2]
    """
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, extra = divmod(num_items, num_parts)
    return [p * chunk + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous non-empty parts, as DeepSpeed's
    ``ds_utils.partition_balanced`` chooses them.

    DeepSpeed's DP keeps, per prefix and part count, the split whose heaviest minus lightest part
    is least given the parts chosen for the shorter prefix, preferring the latest cut on ties.
    That is a heuristic for "balanced", not an optimum, and it is reproduced here as is.

    >>> partition_balanced([1, 1, 1, 1, 4], 2)
    [0, 4, 5]
    >>> partition_balanced([0, 0, 0, 0], 2)
    [0, 3, 4]
    """
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[i][j] = (spread, heaviest, lightest, cut): the first i items in j parts, last part [cut, i).
    best = [[(inf, inf, inf, 0)] * (num_parts + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0.0, inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                _, heavy, light, _ = best[k][j - 1]
                heavy, light = max(heavy, part), min(light, part)
                if heavy - light <= best[i][j][0]:
                    best[i][j] = (heavy - light, heavy, light, k)
    bounds = [n]
    for j in range(num_parts, 0, -1):
        bounds.append(best[bounds[-1]][j][3])
    return bounds[::-1]


BASELINES: dict[str, Callable[..., SearchResult]] = {
    "pipedream": pipedream_search,
    "piper": piper_search,
    "ds-uniform": functools.partial(deepspeed_search, method="uniform"),
    "ds-parameters": functools.partial(deepspeed_search, method="parameters"),
}


def _check(db: CostDB, num_devices: int, mini_batch: int) -> None:
    if num_devices < 1 or mini_batch < 1:
        raise GPPConfigError(f"num_devices and mini_batch must be positive, got {num_devices} and {mini_batch}")


def _sweep(db: CostDB, method: str, search: Callable[[StageCostModel], Iterator[_Found]], *, num_devices: int,
           mini_batch: int, micro_batches: Sequence[int] | None, progress: Progress,
           schedule: str = "1f1b") -> SearchResult:
    """Run ``search`` over the sweep, predict every plan it finds under ``schedule``, keep the
    fastest that fits."""
    start = time.perf_counter()
    predict_s = 0.0
    cm = StageCostModel(db, mini_batch, p2p_devices=num_devices)
    best: Plan | None = None
    states = 0
    trace = []
    try:
        for b, stages, tps, cells, notes in search(cm):
            states += cells
            if stages is None:
                trace.append((b, None, None))
                _say(progress, f"{method}: micro-batch {b}: no partition fits")
                continue
            deepest = deepest_pipeline(schedule, mini_batch // b)
            if deepest is not None and len(stages) > deepest:   # a chain: as deep as it has stages
                trace.append((b, len(stages), None))
                _say(progress, f"{method}: micro-batch {b}: {len(stages)} stages, deeper than {schedule} runs with "
                               f"{mini_batch // b} micro-batches")
                continue
            t0 = time.perf_counter()
            plan = predict(_plan(db, cm, method, stages, b, mini_batch, tps, notes), db, schedule=schedule)
            predict_s += time.perf_counter() - t0
            p = plan.predicted
            trace.append((b, len(stages), p.samples_per_s if p.fits_memory else None))
            _say(progress, f"{method}: micro-batch {b}: {len(stages)} stages, {p.samples_per_s:.4g} samples/s"
                           + ("" if p.fits_memory else " (does not fit when simulated)"))
            if p.fits_memory and (best is None or p.samples_per_s > best.predicted.samples_per_s):
                best = plan
    except SearchLimitError as e:
        return SearchResult(method=method, plan=None, search_time_s=time.perf_counter() - start - predict_s,
                            states=states, trace=tuple(trace), status=str(e))
    elapsed = time.perf_counter() - start - predict_s
    if not trace:
        sizes = micro_batch_sizes(mini_batch, micro_batches)
        return SearchResult(method=method, plan=None, search_time_s=elapsed, states=states,
                            status=f"{method}: no partition of {len(db.layers)} layers uses {num_devices} devices "
                                   f"at micro-batch sizes {sizes} (a stage's devices must divide its micro-batch)")
    if best is None:
        gib = db.hardware.memory_bytes / 2**30
        return SearchResult(method=method, plan=None, search_time_s=elapsed, states=states, trace=tuple(trace),
                            status=f"no plan fits {gib:.1f} GiB per device on {num_devices} devices "
                                   f"at any micro-batch")
    return SearchResult(method=method, plan=best, search_time_s=elapsed, states=states, trace=tuple(trace))


def _plan(db: CostDB, cm: StageCostModel, method: str, stages: list[tuple[int, int]], b: int, mini_batch: int,
          tps: float | None, notes: dict) -> Plan:
    if tps is None:
        bounds = cm.chain_boundaries([mask for mask, _ in stages])
        tps = max(cm.time_per_sample(mask, b, d, boundary=bd) for (mask, d), bd in zip(stages, bounds))
    return Plan(model=db.model, method=method, source=db.source, micro_batch=b, mini_batch=mini_batch,
                stages=tuple(PlanStage(layers=cm.names_of(mask), devices=d) for mask, d in stages),
                pipeline="chain", notes={"bottleneck_tps_s": tps, **notes})


def _say(progress: Progress, message: str) -> None:
    if progress is not None:
        progress(message)
