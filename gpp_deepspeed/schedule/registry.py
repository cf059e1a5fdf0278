"""The schedules, registered once: each name's generator and properties.

Everything that depends on which schedule runs reads its :class:`ScheduleSpec` here: the program
builders (:mod:`.program`), the engine (whether the pipeline drains, whether the backward is
split, how weights are versioned), the planner, the command line and the config, whose accepted
names are :data:`SCHEDULES`' keys.

>>> get_schedule("ZB1").splits_backward, get_schedule("2bw").weights
(True, <WeightRule.DOUBLE_BUFFER: 'double_buffer'>)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import GPPConfigError
from ..graph.stages import StageGraph
from .asynchronous import WeightRule
from .generators import gpipe, one_f_one_b
from .ir import Schedule
from .virtual import FOLDED_SCHEDULES
from .zero_bubble import zb1, zb2

__all__ = ["ScheduleSpec", "FoldedSchedule", "SCHEDULES", "get_schedule", "is_async"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleSpec:
    """One registered schedule.

    A synchronous schedule has a ``generator``, the compute order of one batch, and ends every
    batch with one optimizer step. An asynchronous one never drains between batches: it has a
    ``weights`` rule instead, and its compute order is
    :func:`~gpp_deepspeed.schedule.asynchronous.async_compute` of that rule.
    """

    name: str
    summary: str
    """One line: what it is, after whom (the paper)."""
    stash: Callable[[int, int, int], int]
    """Micro-batches of activations a stage stashes at its peak, ``stash(depth, pipeline_depth,
    M)``: ``depth`` is the stage's (stages on its longest path to the output, itself included),
    ``pipeline_depth`` the stage graph's longest path, ``M`` the micro-batches per batch, all of one
    size. What the planner prices a stage's memory with; tests count the generators' own peaks
    against it (:func:`~gpp_deepspeed.schedule.zero_bubble.peak_in_flight`)."""
    generator: Callable[[StageGraph, int], Schedule] | None = None
    weights: WeightRule | None = None
    splits_backward: bool = False
    """The backward runs as ``I`` (input gradients) and ``W`` (weight gradients)."""
    stash_reads_pipeline_depth: bool = False
    """``stash`` depends on the stage graph's longest path, not only on the stage's own depth."""
    folded: "FoldedSchedule | None" = None
    """A schedule of several stages per rank (virtual stages): its fold and each rank's order."""

    def __post_init__(self):
        if self.folded is not None:   # a folded schedule's entry says once whether it splits the backward
            object.__setattr__(self, "splits_backward", self.folded.split_backward)

    @property
    def asynchronous(self) -> bool:
        """The pipeline never drains between batches; weights update inside it."""
        return self.weights is not None


@dataclass(frozen=True, slots=True)
class FoldedSchedule:
    """How a schedule of several stages per rank is made (:mod:`.virtual`): the fold it needs
    (``"looped"``: any fold, Megatron's looped placement by default; ``"v"``: the V placement, two
    stages per rank), the compute order of every rank, ``orders(stage_graph, M, fold)``, and
    whether the backward is split. Registering one more is one :class:`ScheduleSpec` line."""

    fold: str
    orders: Callable
    split_backward: bool = False


def _folded(name: str) -> FoldedSchedule:
    """The registry entry of a folded schedule of :data:`~.virtual.FOLDED_SCHEDULES` (the one table
    of their folds, orders and backward split, which the fold search reads too)."""
    fold, orders, split_backward = FOLDED_SCHEDULES[name]
    return FoldedSchedule(fold, orders, split_backward=split_backward)


def _own_depth(depth: int, pipeline_depth: int, m: int) -> int:
    """1F1B: a stage keeps one micro-batch per stage on its longest path to the output, at most
    ``M`` (GraphPipe Sec. 6)."""
    return min(depth, m)


def _every_micro_batch(depth: int, pipeline_depth: int, m: int) -> int:
    """GPipe: every forward runs before the first backward."""
    return m


def _zb_h1(depth: int, pipeline_depth: int, m: int) -> int:
    """ZB-H1: a stage defers ``D - depth`` weight gradients and a micro-batch stays until its
    ``W``: ``D`` on every stage (arXiv 2401.10241 Sec. 3.1)."""
    return min(pipeline_depth, m)


def _zb_h2(depth: int, pipeline_depth: int, m: int) -> int:
    """ZB-H2's bound, ``2 D - 1`` on every stage, which the greedy schedule reaches once ``M``
    allows (arXiv 2401.10241 Sec. 3)."""
    return min(2 * pipeline_depth - 1, m)


def _pipeline_full(depth: int, pipeline_depth: int, m: int) -> int:
    """The asynchronous schedules: as 1F1B's, whatever ``M``, since without a flush the pipeline
    stays full."""
    return depth


SCHEDULES: dict[str, ScheduleSpec] = {spec.name: spec for spec in (
    ScheduleSpec(name="1f1b", generator=one_f_one_b, stash=_own_depth,
                 summary="branch-aware 1F1B (GraphPipe arXiv 2406.17145 Sec. 6; PipeDream-Flush on a chain)"),
    ScheduleSpec(name="gpipe", generator=gpipe, stash=_every_micro_batch,
                 summary="all forwards, then all backwards (GPipe, NeurIPS'19)"),
    ScheduleSpec(name="zb1", generator=zb1, splits_backward=True, stash=_zb_h1, stash_reads_pipeline_depth=True,
                 summary="zero-bubble ZB-H1 on a DAG (Qi et al., arXiv 2401.10241 Sec. 3.1)"),
    ScheduleSpec(name="zb2", generator=zb2, splits_backward=True, stash=_zb_h2, stash_reads_pipeline_depth=True,
                 summary="ZB-H2-like greedy schedule (Qi et al., arXiv 2401.10241 Sec. 3)"),
    ScheduleSpec(name="interleaved", folded=_folded("interleaved"), stash=_own_depth,
                 summary="interleaved 1F1B, several stages per rank in looped placement (Narayanan et al., SC'21 "
                         "Sec. 2.2), on a DAG"),
    ScheduleSpec(name="zbv", folded=_folded("zbv"), stash=_own_depth,
                 summary="ZB-V: two stages per rank in a V, split backward (Qi et al., arXiv 2405.15362), on a DAG"),
    ScheduleSpec(name="dualpipev", folded=_folded("dualpipev"), stash=_own_depth,
                 summary="DualPipeV: a forward beside a backward of another micro-batch on a V's two stages "
                         "(DeepSeek-V3, arXiv 2412.19437; torch's ScheduleDualPipeV), on a DAG"),
    ScheduleSpec(name="pipedream", weights=WeightRule.STASH, stash=_pipeline_full,
                 summary="asynchronous 1F1B with weight stashing (PipeDream, SOSP'19 Sec. 3.3)"),
    ScheduleSpec(name="2bw", weights=WeightRule.DOUBLE_BUFFER, stash=_pipeline_full,
                 summary="asynchronous, double-buffered weights (PipeDream-2BW, ICML'21 Sec. 3.1)"),
    ScheduleSpec(name="pipeoptim", weights=WeightRule.PREDICT, stash=_pipeline_full,
                 summary="asynchronous with weight prediction, the backward differentiating the predicted "
                         "forward (PipeOptim, arXiv 2312.00839 Sec. IV)"),
    ScheduleSpec(name="pipeoptim-inplace", weights=WeightRule.PREDICT_INPLACE, stash=_pipeline_full,
                 summary="PipeOptim as its authors' code runs it: prediction in place, live weights restored "
                         "before the backward; two weight versions (arXiv 2312.00839)"),
)}
"""Every schedule by name; the config accepts exactly these names."""


def get_schedule(name: str) -> ScheduleSpec:
    """Look up a schedule by case-insensitive name; unknown names list the valid ones."""
    try:
        return SCHEDULES[name.lower()]
    except KeyError:
        raise GPPConfigError(f'unknown schedule "{name}"; valid: {sorted(SCHEDULES)}') from None


def is_async(name: str) -> bool:
    """True for the schedules that never drain between batches.

    >>> is_async("PipeDream"), is_async("1f1b")
    (True, False)
    """
    return get_schedule(name).asynchronous
