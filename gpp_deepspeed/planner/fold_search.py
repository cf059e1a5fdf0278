"""The choice of a fold: which stages of a stage DAG share a pipeline rank, and the folded schedule
its ranks run (issue 28, point 4), priced by the schedule simulator.

Pure like the graph and schedule code it reads (:mod:`gpp_deepspeed.schedule.virtual`: the folds,
each folded schedule's orders, :func:`~gpp_deepspeed.schedule.virtual.rank_makespan`);
:mod:`.fold` runs it after GraphPipe's search on the stage costs of a plan.

Representative use::

    best = search_fold(stage_graph, 16, num_ranks=4, duration=priced)   # FoldChoice: fold, schedule, makespan
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

from ..errors import GPPConfigError, ScheduleError
from ..graph.stages import StageGraph
from ..schedule.ir import Action
from ..schedule.virtual import FOLDED_SCHEDULES, IN_FLIGHT_CAPPED, Fold, rank_in_flight, rank_makespan, rank_peak

__all__ = ["FoldChoice", "search_fold"]


@dataclass(frozen=True, slots=True)
class FoldChoice:
    """A fold, the schedule its ranks run (a name of :data:`FOLDED_SCHEDULES`), its compute
    makespan and each rank's peak memory (its stages' ``static`` memory plus the most activation
    memory it holds at once: the sum of its stages' in-flight micro-batches, each weighted by the
    stage's activation size), and the caps of micro-batches in flight per rank its order was made
    under (``max_in_flight``; None: the schedule's own)."""

    fold: Fold
    schedule: str
    makespan: float
    peak: tuple[float, ...]
    max_in_flight: tuple[int, ...] | None = None


_BRUTE_FORCE_LIMIT = 400   # groupings priced one by one; above it, structured folds and local moves


def _better(c: FoldChoice) -> tuple[float, float]:
    """How choices compare: the shorter makespan, then (equally fast to 9 digits, as sums of the
    same durations in another order are) the lower peak memory of a rank."""
    return float(f"{c.makespan:.9g}"), max(c.peak)


def search_fold(stage_graph: StageGraph, num_microbatches: int, *, num_ranks: int,
                duration: Callable[[Action], float], activation: dict[int, float] | None = None,
                memory: float | None = None, max_stages_per_rank: int = 2, static: dict[int, float] | None = None,
                schedules: tuple[str, ...] = tuple(FOLDED_SCHEDULES)) -> FoldChoice:
    """The fastest fold of ``stage_graph`` onto ``num_ranks`` ranks and its schedule.

    Every way of grouping the stages into ``num_ranks`` non-empty groups of at most
    ``max_stages_per_rank`` (each grouping once: ranks are numbered by their first stage), each
    under every one of ``schedules`` that runs on it, priced by :func:`rank_makespan` with
    ``duration`` (the stages' compute), keeping each rank's peak memory (``static[s]`` for each of
    its stages, default 0, plus ``activation[s]`` per micro-batch in flight on stage ``s``, default
    1) within ``memory``. A schedule whose order is made under a cap of micro-batches in flight
    (``zbv``) is priced under its own caps (every rank the fold's largest bound) and under each
    rank's own bound (:func:`~gpp_deepspeed.schedule.greedy.rank_in_flight`: less memory on the
    ranks of shallow stages) and, where ``memory`` rules both out, under the largest cap on every
    rank that fits; a choice under caps other than its own carries them. Where there are more
    than a few hundred groupings, the looped and V folds and the fold pairing stages by depth (the
    deepest with the shallowest) are priced, and the best is improved by moving and swapping stages
    between ranks while that helps (a local search, not exhaustive). Raises :class:`ScheduleError`
    when no fold fits. Of equally fast choices the one whose fullest rank holds least wins, then
    the first in ``schedules`` order.

    >>> chain = StageGraph.chain(4)
    >>> unit = lambda a: {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}.get(a.kind.value, 0.0)
    >>> best = search_fold(chain, 8, num_ranks=2, duration=unit)
    >>> best.schedule, best.fold.stages_of(0), best.makespan     # the V: as fast as looped, holds less
    ('zbv', (0, 3), 49.0)
    """
    price = _FoldPricer(stage_graph, num_microbatches, duration, activation, memory, static, schedules)
    groupings = []
    for rank_of in _groupings(stage_graph.num_stages, num_ranks, max_stages_per_rank):
        groupings.append(rank_of)
        if len(groupings) > _BRUTE_FORCE_LIMIT:
            best = _local_search(price, stage_graph.num_stages, num_ranks, max_stages_per_rank)
            break
    else:
        best = min((c for c in map(price, groupings) if c is not None), key=_better, default=None)
    if best is None:
        raise ScheduleError(f"no fold of {stage_graph.num_stages} stages onto {num_ranks} ranks, at most "
                            f"{max_stages_per_rank} a rank, keeps every rank's memory within {memory}")
    return best


class _FoldPricer:
    """The fastest of ``schedules`` on one fold that fits ``memory`` (None: none does), cached."""

    def __init__(self, stage_graph, num_mb, duration, activation, memory, static, schedules):
        self.args = stage_graph, num_mb, duration
        self.activation, self.memory, self.static, self.schedules = activation, memory, static or {}, schedules
        self.cache: dict[tuple[int, ...], FoldChoice | None] = {}

    def __call__(self, rank_of: tuple[int, ...]) -> FoldChoice | None:
        if rank_of not in self.cache:
            self.cache[rank_of] = self._price(Fold(rank_of))
        return self.cache[rank_of]

    def _price(self, fold: Fold) -> FoldChoice | None:
        best = None
        own = tuple(rank_in_flight(self.args[0], fold, r) for r in range(fold.num_ranks))
        for name in self.schedules:
            # Equal bounds are the schedule's own caps: nothing more to price.
            caps = [None, own] if name in IN_FLIGHT_CAPPED and len(set(own)) > 1 else [None]
            fitted = False
            for cap in caps:
                choice = self._choice(fold, name, cap)
                fitted |= choice is not None
                if choice is not None and (best is None or _better(choice) < _better(best)):
                    best = choice
            if name in IN_FLIGHT_CAPPED and self.memory is not None and not fitted:
                # Neither fits: the largest cap below every rank's own that does (fewer in flight,
                # less memory, a longer step), down to what a micro-batch passing a rank's stages needs.
                for c in range(max(own) - 1, 0, -1):
                    try:
                        choice = self._choice(fold, name, (c, ) * fold.num_ranks)
                    except GPPConfigError:
                        break
                    if choice is not None:
                        best = choice if best is None or _better(choice) < _better(best) else best
                        break
        return best

    def _choice(self, fold: Fold, name: str, cap: tuple[int, ...] | None) -> FoldChoice | None:
        """Schedule ``name`` on ``fold`` under ``cap``, priced; None where it does not run there or
        does not fit the memory."""
        stage_graph, num_mb, duration = self.args
        try:
            orders = FOLDED_SCHEDULES[name][1](stage_graph, num_mb, fold, duration=duration, max_in_flight=cap)
        except ScheduleError:           # dualpipev: not two stages a rank, or too few micro-batches
            return None
        peak = tuple(sum(self.static.get(s, 0.0) for s in fold.stages_of(r))
                     + rank_peak(orders[r], self.activation) for r in sorted(orders))
        if self.memory is not None and max(peak) > self.memory:
            return None
        return FoldChoice(fold=fold, schedule=name, makespan=rank_makespan(orders, stage_graph, duration),
                          peak=peak, max_in_flight=cap)


def _local_search(price: _FoldPricer, num_stages: int, num_ranks: int, cap: int) -> FoldChoice | None:
    """The best of the structured folds, improved by single moves and swaps of stages between
    ranks (first improvement, until none helps)."""
    stage_graph = price.args[0]
    by_depth = sorted(range(num_stages), key=lambda s: (-stage_graph.depth(s), s))
    starts = [tuple(s % num_ranks for s in range(num_stages))]
    if num_stages == 2 * num_ranks:
        starts.append(Fold.v_shape(num_stages=num_stages).rank_of)
        paired = [0] * num_stages
        for r in range(num_ranks):
            paired[by_depth[r]], paired[by_depth[num_stages - 1 - r]] = r, r
        starts.append(tuple(paired))
    found = [c for c in (price(_renumbered(s)) for s in starts if max(Counter(s).values()) <= cap) if c is not None]
    best = min(found, key=_better, default=None)
    improved = best is not None
    while improved:
        improved = False
        current = list(best.fold.rank_of)
        for neighbour in _neighbours(current, num_ranks, cap):
            c = price(_renumbered(neighbour))
            if c is not None and _better(c) < _better(best):
                best, improved = c, True
                break
    return best


def _neighbours(rank_of: list[int], num_ranks: int, cap: int):
    """Folds one move (a stage to another rank with room, none left empty) or one swap away."""
    sizes = Counter(rank_of)
    for s, r in enumerate(rank_of):
        for t in range(num_ranks):
            if t != r and sizes[t] < cap and sizes[r] > 1:
                yield tuple(t if i == s else x for i, x in enumerate(rank_of))
    for s in range(len(rank_of)):
        for t in range(s + 1, len(rank_of)):
            if rank_of[s] != rank_of[t]:
                swapped = list(rank_of)
                swapped[s], swapped[t] = swapped[t], swapped[s]
                yield tuple(swapped)


def _renumbered(rank_of) -> tuple[int, ...]:
    """The same grouping with ranks numbered by their first stage (as :func:`_groupings` numbers them)."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(r, len(first)) for r in rank_of)


def _groupings(num_stages: int, num_ranks: int, cap: int):
    """Every map of stages to ranks ``0..R-1`` with every rank used and at most ``cap`` stages a
    rank, each grouping once (a restricted growth string: stage ``s`` opens rank ``max + 1`` or joins
    one already open)."""
    rank_of = [0] * num_stages
    sizes = [0] * num_ranks

    def grow(s: int, opened: int):
        if num_stages - s < num_ranks - opened:
            return
        if s == num_stages:
            yield tuple(rank_of)
            return
        for r in range(min(opened + 1, num_ranks)):
            if sizes[r] < cap:
                rank_of[s], sizes[r] = r, sizes[r] + 1
                yield from grow(s + 1, max(opened, r + 1))
                sizes[r] -= 1

    yield from grow(0, 0)
