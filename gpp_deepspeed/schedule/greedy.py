"""The greedy list schedule over a simulated clock: the compute order of every rank.

A rank runs one stage (``zb2``) or several (a *fold*, Megatron's virtual stages: see
:mod:`gpp_deepspeed.schedule.virtual`). At every moment a free rank runs, of its stages'
actions whose inputs have arrived, a backward first (``B``, or ``I`` when the backward is split:
it frees memory and unblocks the ranks before it), the oldest group of micro-batches first and the
later stage first; else a forward of its stages, oldest group first and earlier stage first, if the
rank's cap of micro-batches in flight allows; else (split backward) its oldest deferred ``W``.
Ranks deepest in the DAG act first at equal clocks. Every order it returns is one the simulation
ran, so it cannot deadlock with asynchronous sends.

Two rules, as the schedule asks (``by_microbatch``):

- *Megatron's* (interleaved 1F1B, Narayanan et al., SC'21, Sec. 2.2): micro-batches go in groups of
  ``R``, the number of ranks, and a micro-batch reserves, when it first reaches a stage of a rank,
  one unit for every stage of the rank it will pass through from there (each freed by that stage's
  backward), so its later forwards on the rank always go ahead.
- *ZB-V's* (Qi et al., arXiv 2405.15362, Sec. 3): micro-batch by micro-batch (a rank of a V runs
  ``F0`` of its early stage, then ``F0`` of its late one as soon as it can, then ``F1`` ...), and a
  micro-batch begins on a rank while the rank keeps room for one begun micro-batch to reach its
  later stages there (the *headroom*: its most stages on the rank, less one); a begun micro-batch
  may fill the cap. On a V over a chain that is ZB-V's warm-up, ``2p - 1`` forwards on the first
  rank under its cap of ``2p``, and its step (peers.py's chain: 1,030 ms simulated, as torch's
  ``ZBVZeroBubble`` order; Megatron's rule: 1,100). Where the simulated run stalls under it (it can
  when a micro-batch passes three or more of a rank's stages), the order falls back to Megatron's
  reservations.

Either way the rank never holds more than its cap (:func:`rank_in_flight` by default; ``zb2``
passes ZB-H2's ``2D - 1`` per stage). Where that could deadlock (a micro-batch entering one rank at
two stages of a DAG), the cap is relaxed for micro-batches already begun on the rank.

Glossary
--------
fold
    :class:`Fold`: ``rank_of[s]`` is the pipeline rank that runs stage ``s``; one stage per rank
    is the fold ``(0, 1, ..., S - 1)``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..errors import GPPConfigError, ScheduleError
from ..graph.stages import StageGraph
from .ir import Action, ActionKind as K

__all__ = ["Fold", "rank_orders", "rank_in_flight", "fold_in_flight", "check_in_flight", "unit_split_duration",
           "stage_duration", "check_stage_times"]


def unit_split_duration(kind: K) -> float:
    """``T_F = T_I = T_W = 1``: the zero-bubble paper's setting for the closed forms; ``B = I + W``."""
    return {K.FORWARD: 1.0, K.BACKWARD_INPUT: 1.0, K.BACKWARD_WEIGHT: 1.0, K.BACKWARD: 2.0}.get(kind, 0.0)


def check_stage_times(times, num_stages: int) -> tuple[tuple[float, float, float, float], ...]:
    """``times`` as a tuple of ``(F, B, I, W)`` per stage, refused unless it gives each of the
    ``num_stages`` stages four non-negative seconds (``graph_pipeline.stage_times``, a plan's)."""
    times = tuple(tuple(t) for t in times)
    if len(times) != num_stages or any(len(t) != 4 or min(t) < 0 for t in times):
        raise GPPConfigError(f"stage_times must give each of the {num_stages} stages four non-negative seconds "
                             f"[F, B, I, W]; got {[list(t) for t in times]}")
    return times


def stage_duration(times, num_stages: int) -> Callable[[Action], float]:
    """The price of a compute action of stage ``s`` from ``times[s]``, its ``(F, B, I, W)``
    seconds (a plan's ``stage_times``, ``graph_pipeline.stage_times``), one entry for each of the
    ``num_stages`` stages: what a schedule made on a simulated clock (:func:`rank_orders`,
    ``zbv``) and its transfers are ordered for. Any other action costs nothing.

    >>> stage_duration([(1.0, 2.0, 1.5, 0.5)], 1)(Action.parse("0I3"))
    1.5
    """
    times = check_stage_times(times, num_stages)
    column = {K.FORWARD: 0, K.BACKWARD: 1, K.BACKWARD_INPUT: 2, K.BACKWARD_WEIGHT: 3}

    def duration(a: Action) -> float:
        at = column.get(a.kind)
        return 0.0 if at is None else times[a.stage_idx][at]
    return duration


@dataclass(frozen=True, slots=True)
class Fold:
    """Stage ``s`` runs on pipeline rank ``rank_of[s]``; every rank ``0 .. R-1`` runs at least one.

    >>> Fold.looped(num_stages=6, num_ranks=3).stages_of(1)
    (1, 4)
    >>> Fold.v_shape(num_stages=6).stages_of(0)
    (0, 5)
    """

    rank_of: tuple[int, ...]

    def __post_init__(self):
        ranks = set(self.rank_of)
        if not self.rank_of or ranks != set(range(len(ranks))):
            raise ScheduleError(f"a fold must place its stages on ranks 0..R-1, each holding one or more; got "
                                f"{list(self.rank_of)}")

    @property
    def num_ranks(self) -> int:
        return max(self.rank_of) + 1

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.rank_of) if r == rank)

    @classmethod
    def looped(cls, *, num_stages: int, num_ranks: int) -> "Fold":
        """Stage ``s`` on rank ``s mod R`` (stages numbered in a topological order)."""
        return cls(tuple(s % num_ranks for s in range(num_stages)))

    @classmethod
    def v_shape(cls, *, num_stages: int) -> "Fold":
        """Rank ``r`` holds stages ``r`` and ``2R - 1 - r`` (``num_stages = 2R``)."""
        if num_stages % 2:
            raise ScheduleError(f"a V places two stages per rank: {num_stages} stages do not pair up")
        half = num_stages // 2
        return cls(tuple(s if s < half else num_stages - 1 - s for s in range(num_stages)))


def rank_orders(stage_graph: StageGraph, num_microbatches: int, fold: Fold, *, split_backward: bool,
                duration: Callable[[Action], float] | None = None,
                max_in_flight: dict[int, int] | None = None, by_microbatch: bool = False) -> dict[int, list[Action]]:
    """The compute order of every rank of ``fold`` (see the module docstring).

    ``duration`` prices compute actions (default: unit ``F``, ``I``, ``W``, ``B = I + W``);
    ``max_in_flight`` caps each rank's micro-batches in flight, counted once per stage that holds
    one (default :func:`rank_in_flight`); ``by_microbatch`` takes ZB-V's rule, else Megatron's.

    >>> orders = rank_orders(StageGraph.chain(4), 4, Fold.looped(num_stages=4, num_ranks=2), split_backward=False)
    >>> [str(a) for a in orders[0][:6]]
    ['0F0', '0F1', '2F0', '2B0', '2F1', '0F2']
    """
    if len(fold.rank_of) != stage_graph.num_stages:
        raise ScheduleError(f"the fold places {len(fold.rank_of)} stages, the stage graph has "
                            f"{stage_graph.num_stages}")
    dur = duration or (lambda a: unit_split_duration(a.kind))
    caps = {r: (max_in_flight or {}).get(r, rank_in_flight(stage_graph, fold, r)) for r in range(fold.num_ranks)}
    group = 1 if by_microbatch else fold.num_ranks
    state = _RankState(stage_graph, num_microbatches, fold, split_backward, group=group, strict=True)
    for r, cap in caps.items():
        # A micro-batch reserves, on reaching a stage of the rank, every stage of the rank it will pass.
        need = max(len(state.rank_reach[s]) for s in fold.stages_of(r))
        if cap < need:
            raise GPPConfigError(f"rank {r} may hold {cap} micro-batch(es) in flight, but a micro-batch passes {need} "
                                 f"of its stages {list(fold.stages_of(r))}, each holding it: give it at least {need} "
                                 "(max_in_flight)")
    if by_microbatch:
        try:
            return _greedy(_RankState(stage_graph, num_microbatches, fold, split_backward, group=group, strict=True,
                                      headroom=True), caps, dur)
        except ScheduleError:
            pass
    try:
        return _greedy(state, caps, dur)
    except ScheduleError:
        return _greedy(_RankState(stage_graph, num_microbatches, fold, split_backward, group=group, strict=False),
                       caps, dur)


def _greedy(state: "_RankState", caps: dict[int, int], dur: Callable[[Action], float]) -> dict[int, list[Action]]:
    while state.active():
        now = min(state.clock[r] for r in state.active())
        # Ranks deepest in the DAG first (zb2's order when every rank holds one stage).
        for r in sorted((t for t in state.active() if state.clock[t] == now), key=state.rank_depth):
            action = state.choose(r, caps)
            if action is not None:
                state.run(r, action, dur)
                break
        else:
            state.advance(now)
    return state.order


def rank_in_flight(stage_graph: StageGraph, fold: Fold, rank: int) -> int:
    """Micro-batches of one stage that ``rank`` may hold at once, over its stages: the sum of its
    stages' depths less one per extra stage. One stage per rank: its depth, 1F1B's bound. Looped
    placement of ``v = 2`` chunks on a chain of ``p`` ranks: ``3p - 2r - 1``, Megatron's warm-up
    ``2(p - r - 1) + (v - 1)p`` plus one. V placement: ``2p`` on every rank, ZB-V's bound (the
    activations of ``p`` micro-batches of a whole rank's layers, as 1F1B's first stage holds).

    >>> [rank_in_flight(StageGraph.chain(8), Fold.looped(num_stages=8, num_ranks=4), r) for r in range(4)]
    [11, 9, 7, 5]
    >>> {rank_in_flight(StageGraph.chain(8), Fold.v_shape(num_stages=8), r) for r in range(4)}
    {8}
    """
    stages = fold.stages_of(rank)
    return sum(stage_graph.depth(s) for s in stages) - (len(stages) - 1)


def fold_in_flight(stage_graph: StageGraph, fold: Fold) -> dict[int, int]:
    """Every rank's cap in ``zbv``: the largest :func:`rank_in_flight` of the fold, on every rank.

    ZB-V bounds every rank alike, at ``2p`` half-stage micro-batches (Qi et al., arXiv 2405.15362,
    Sec. 3: the activations 1F1B's first stage holds), which is :func:`rank_in_flight` on every
    rank of a V on a chain. On a DAG the ranks' own bounds differ (a rank of shallow stages gets
    few), and holding a rank below the fullest one saves no memory a device must have: the largest
    bound is the fold's peak either way. Letting every rank hold that many lets the greedy order
    defer more weight gradients, which fills the gaps a DAG's uneven ranks leave (peers.py's four
    branches, on the fold the search picks: 840 against 950 ms simulated with each rank at its own
    bound, 900 against 1,027 with 1 ms a message).

    >>> chain = StageGraph.chain(8)
    >>> set(fold_in_flight(chain, Fold.v_shape(num_stages=8)).values()) == {rank_in_flight(chain, Fold.v_shape(num_stages=8), 0)}
    True
    """
    cap = max(rank_in_flight(stage_graph, fold, r) for r in range(fold.num_ranks))
    return {r: cap for r in range(fold.num_ranks)}


def check_in_flight(caps, num_ranks: int) -> tuple[int, ...]:
    """``caps`` as every rank's cap of micro-batches in flight (``graph_pipeline.max_in_flight``, a
    plan's): one positive int for every rank, or one for each of the ``num_ranks`` ranks; refused
    by name otherwise.

    >>> check_in_flight(4, 3), check_in_flight([4, 5, 6], 3)
    ((4, 4, 4), (4, 5, 6))
    """
    caps = tuple(caps) if isinstance(caps, (list, tuple)) else (caps, ) * num_ranks
    if len(caps) != num_ranks or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in caps):
        raise GPPConfigError(f"max_in_flight must be a positive int, or one for each of the {num_ranks} pipeline "
                             f"ranks; got {list(caps)}")
    return caps


def _descendants(stage_graph: StageGraph, s: int) -> set[int]:
    """Every stage after ``s`` on some path to the output."""
    seen, todo = set(), list(stage_graph.succs(s))
    while todo:
        t = todo.pop()
        if t not in seen:
            seen.add(t)
            todo += stage_graph.succs(t)
    return seen


class _RankState:
    """Book-keeping of :func:`rank_orders`'s simulated run: what each rank and stage has done."""

    def __init__(self, stage_graph: StageGraph, num_mb: int, fold: Fold, split: bool, *, group: int, strict: bool,
                 headroom: bool = False):
        self.graph, self.num_mb, self.fold, self.split, self.strict = stage_graph, num_mb, fold, split, strict
        self.group = group
        stages = range(stage_graph.num_stages)
        self.clock = {r: 0.0 for r in range(fold.num_ranks)}
        self.next_f = {s: 0 for s in stages}
        self.next_b = {s: 0 for s in stages}
        self.in_flight: dict[int, int] = {s: 0 for s in stages}
        self.deferred: dict[int, deque[int]] = {s: deque() for s in stages}
        self.f_end: dict[tuple[int, int], float] = {}
        self.b_end: dict[tuple[int, int], float] = {}
        self.order: dict[int, list[Action]] = {r: [] for r in range(fold.num_ranks)}
        # The stages of its own rank a micro-batch passes through from each stage on (itself included).
        reach = {s: {s} | _descendants(stage_graph, s) for s in stages}
        self.rank_reach = {s: frozenset(t for t in reach[s] if fold.rank_of[t] == fold.rank_of[s]) for s in stages}
        # Units of each rank's cap taken: every stage a begun micro-batch will pass on the rank
        # (Megatron's rule), or only those it holds (ZB-V's: ``headroom`` keeps room to go on).
        self.reserved = {r: 0 for r in range(fold.num_ranks)}
        self.headroom = {r: max(len(self.rank_reach[s]) for s in fold.stages_of(r)) - 1 if headroom else None
                         for r in range(fold.num_ranks)}
        self.covered: dict[tuple[int, int], set[int]] = {}    # (rank, micro-batch) -> stages reserved
        self.rank_depth = lambda r: -max(stage_graph.depth(s) for s in fold.stages_of(r))
        # Later stages first: a rank that can feed the output does so before starting new work.
        self.preference = {r: sorted(fold.stages_of(r), key=lambda s: stage_graph.depth(s))
                           for r in range(fold.num_ranks)}

    def active(self) -> list[int]:
        return [r for r in self.order if any(self.next_b[s] < self.num_mb or self.deferred[s]
                                             for s in self.fold.stages_of(r))]

    def forward_ready(self, s: int) -> float | None:
        j = self.next_f[s]
        if j >= self.num_mb:
            return None
        times = [self.f_end.get((p, j)) for p in self.graph.preds(s)]
        return None if None in times else max(times, default=0.0)

    def backward_ready(self, s: int) -> float | None:
        j = self.next_b[s]
        if j >= self.next_f[s]:
            return None
        succs = self.graph.succs(s)
        times = [self.b_end.get((t, j)) for t in succs] if succs else [self.f_end[(s, j)]]
        return None if None in times else max(times)

    def choose(self, r: int, caps: dict[int, int]) -> Action | None:
        now = self.clock[r]
        back = K.BACKWARD_INPUT if self.split else K.BACKWARD
        group = self.group
        ready = [(self.next_b[s] // group, i, self.next_b[s], s) for i, s in enumerate(self.preference[r])
                 if (t := self.backward_ready(s)) is not None and t <= now]
        if ready:
            *_, s = min(ready)
            return Action(s, back, self.next_b[s])
        # What a forward takes of the rank's cap: see _needs. Where that deadlocks (two stages
        # of one rank that a micro-batch enters apart, on a DAG), ``strict`` is off: a micro-batch
        # begun on the rank goes ahead on any of its stages.
        ready = [(self.next_f[s] // group, -i, self.next_f[s], s) for i, s in enumerate(self.preference[r])
                 if (self.reserved[r] + self._needs(r, s) <= caps[r]
                     or not self.strict and (r, self.next_f[s]) in self.covered)
                 and (t := self.forward_ready(s)) is not None and t <= now]
        if ready:
            *_, s = min(ready)
            return Action(s, K.FORWARD, self.next_f[s])
        waiting = [(self.deferred[s][0], s) for s in self.preference[r] if self.deferred[s]]
        if waiting:
            j, s = min(waiting)
            return Action(s, K.BACKWARD_WEIGHT, j)
        return None

    def _needs(self, r: int, s: int) -> int:
        """Units of rank ``r``'s cap that stage ``s``'s next forward needs free. Megatron's rule: the
        stages of the rank it newly reserves (those its micro-batch will pass from here, the first
        time it reaches the rank). ZB-V's: the one it holds, plus the headroom when its micro-batch
        begins on the rank here."""
        begun = (r, self.next_f[s]) in self.covered
        if self.headroom[r] is not None:
            return 1 if begun else 1 + self.headroom[r]
        return len(self.rank_reach[s] - self.covered.get((r, self.next_f[s]), set()))

    def _takes(self, r: int, s: int) -> int:
        """Units of rank ``r``'s cap that stage ``s``'s next forward takes (and its stages' backwards free)."""
        return 1 if self.headroom[r] is not None else self._needs(r, s)

    def run(self, r: int, action: Action, dur: Callable[[Action], float]) -> None:
        end = self.clock[r] + dur(action)
        s, j = action.stage_idx, action.mb_idx
        if action.kind is K.FORWARD:
            self.reserved[r] += self._takes(r, s)
            self.covered.setdefault((r, j), set()).update(self.rank_reach[s])
            self.f_end[(s, j)] = end
            self.next_f[s] += 1
            self.in_flight[s] += 1
        elif action.kind is K.BACKWARD_WEIGHT:
            self.deferred[s].popleft()
            self.in_flight[s] -= 1
            self.reserved[r] -= 1
        else:
            self.b_end[(s, j)] = end
            self.next_b[s] += 1
            if self.split:
                self.deferred[s].append(j)
            else:
                self.in_flight[s] -= 1
                self.reserved[r] -= 1
        self.order[r].append(action)
        self.clock[r] = end

    def advance(self, now: float) -> None:
        later = [t for r in self.active() for s in self.fold.stages_of(r)
                 for t in (self.clock[r], self.backward_ready(s), self.forward_ready(s)) if t is not None and t > now]
        if not later:
            raise ScheduleError(f"the folded schedule cannot make progress at time {now}: every rank waits")
        for r in self.active():
            self.clock[r] = max(self.clock[r], min(later))


