"""Plans: what a search decides, as JSON every rank can load.

Glossary
--------
plan
    Stages (each a set of layers and a device count), one micro-batch size, the mini-batch it
    was planned for, and the predicted times. Stages are listed in a topological order of the
    stage graph, which :func:`~gpp_deepspeed.graph.stages.derive_partition` derives from the
    layer edges; the output stage is the unique sink.
search result
    A plan (or none), with the search's wall-clock time, the states it visited and a status:
    ``"ok"`` or why there is no plan.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..errors import GPPConfigError
from ..graph.ir import LayerGraph
from ..graph.stages import Partition, derive_partition
from .costs import check_zero_stage

__all__ = ["PlanStage", "Prediction", "Plan", "SearchResult"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanStage:
    """One stage: its layers, how many devices run it, its tensor-parallel degree ``tp`` (the
    devices are ``devices / tp`` data-parallel replicas of ``tp`` ranks; 1: data parallelism only)
    and whether it recomputes its activations in the backward (activation checkpointing on this
    stage only)."""

    layers: tuple[str, ...]
    devices: int = 1
    recompute: bool = False
    device_class: str | None = None   # a heterogeneous cluster's class its replicas belong to
    tp: int = 1

    def __post_init__(self):
        if self.tp < 1 or self.devices % self.tp:
            raise GPPConfigError(f"plan stage {list(self.layers)[:3]}: tensor-parallel degree {self.tp} must divide "
                                 f"its {self.devices} devices")

    @property
    def replicas(self) -> int:
        """The stage's data-parallel degree: ``devices / tp``."""
        return self.devices // self.tp


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """What the simulator predicts for a plan (see :mod:`gpp_deepspeed.planner.simulate`)."""

    iteration_time_s: float
    samples_per_s: float
    bottleneck_tps_s: float
    peak_mem_bytes: float                # the largest over devices
    stage_mem_bytes: tuple[float, ...]   # per stage, per device
    stage_in_flight: tuple[int, ...]     # peak micro-batches stashed, per stage
    stage_busy_s: tuple[float, ...]
    bubble_fraction: float               # idle share of all devices over the iteration
    fits_memory: bool
    rank_mem_bytes: tuple[float, ...] = ()   # a folded plan: per rank, its stages together (else per stage)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A stage DAG with devices per stage and a micro-batch size; ``gpp plan`` writes one.

    ``stage_edges`` lists the stage graph's edges ``(src, dst)`` (filled in with the prediction).
    ``pipeline`` is ``"graph"`` (stages exchange tensors along the stage DAG and run GraphPipe's
    branch-aware 1F1B, what :class:`~gpp_deepspeed.engine.GraphPipelineEngine` executes) or
    ``"chain"`` (stages form a linear pipeline in list order that relays every tensor, as
    DeepSpeed's ``PipelineEngine`` and PipeDream run the baselines' plans). ``schedule`` names the
    training schedule the plan was priced with (``"1f1b"``, ``"zb1"``, ``"zb2"``, ...); an engine
    loading the plan runs it unless its config's ``graph_pipeline.schedule`` names another.
    ``zero_stage`` is the ZeRO stage the plan's memory and collectives were priced with (0 to 3,
    DeepSpeed's ``zero_optimization.stage``; a file written before the field existed loads as 0).
    ``fold`` is the pipeline rank of each stage when ranks hold several stages (a folded plan,
    :mod:`gpp_deepspeed.planner.fold`; its ``schedule`` is one of
    :data:`~gpp_deepspeed.schedule.virtual.FOLDED_SCHEDULES` and every stage has one device), ``()``
    when each stage has ranks of its own (a file written before the field existed loads so).
    A stage's ``tp`` (its tensor-parallel degree) loads as 1 from a file written before it existed.
    ``stage_times`` is each stage's ``(F, B, I, W)`` seconds the plan's schedule was ordered and
    priced with (a folded plan's: ``zbv`` orders its actions on a simulated clock of them, so the
    engine builds the very order the planner priced; ``()``: none, unit times). ``max_in_flight``
    is each rank's cap of micro-batches in flight the folded schedule's order was made under
    (``zbv``'s, when the fold search chose caps other than the schedule's own; ``()``: its own).

    >>> p = Plan(model="m", method="manual", source="hand", micro_batch=2, mini_batch=8,
    ...          stages=(PlanStage(layers=("a",)), PlanStage(layers=("b", "c"))))
    >>> p.stage_of
    {'a': 0, 'b': 1, 'c': 1}
    >>> Plan.from_json(p.to_json()) == p
    True
    """

    model: str
    method: str
    source: str
    micro_batch: int
    mini_batch: int
    stages: tuple[PlanStage, ...]
    pipeline: str = "graph"
    schedule: str = "1f1b"
    zero_stage: int = 0
    stage_edges: tuple[tuple[int, int], ...] = ()
    predicted: Prediction | None = None
    notes: dict = field(default_factory=dict)
    # device ids per stage on a topology (planner/topology.py); () means contiguous rank order
    placement: tuple[tuple[int, ...], ...] = ()
    fold: tuple[int, ...] = ()
    stage_times: tuple[tuple[float, float, float, float], ...] = ()
    max_in_flight: tuple[int, ...] = ()

    @property
    def stages_per_rank(self) -> int:
        """The most stages a rank holds (1 unless folded)."""
        return max((self.fold.count(r) for r in set(self.fold)), default=1)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_devices(self) -> int:
        return max(self.fold) + 1 if self.fold else sum(s.devices for s in self.stages)

    @property
    def num_microbatches(self) -> int:
        return self.mini_batch // self.micro_batch

    @property
    def stage_of(self) -> dict[str, int]:
        return {name: i for i, s in enumerate(self.stages) for name in s.layers}

    @property
    def uniform_devices(self) -> int | None:
        """The common data-parallel degree, or None when stages differ."""
        degrees = {s.devices for s in self.stages}
        return degrees.pop() if len(degrees) == 1 else None

    def __post_init__(self):
        if self.pipeline not in ("graph", "chain"):
            raise GPPConfigError(f'plan "pipeline" must be "graph" or "chain", got {self.pipeline!r}')
        if self.micro_batch < 1 or self.mini_batch % self.micro_batch:
            raise GPPConfigError(f"plan micro-batch {self.micro_batch} must divide mini-batch {self.mini_batch}")
        check_zero_stage(self.zero_stage)
        if self.fold:
            self._check_fold()
        if self.stage_times:
            from ..schedule.greedy import check_stage_times
            check_stage_times(self.stage_times, self.num_stages)
        if self.max_in_flight:
            from ..schedule.virtual import schedule_in_flight
            if not self.fold:
                raise GPPConfigError(f"plan max_in_flight {list(self.max_in_flight)} caps a folded schedule's order; "
                                     "the plan has no fold")
            schedule_in_flight(self.schedule, self.max_in_flight, self.num_devices)

    def _check_fold(self) -> None:
        from ..schedule.virtual import FOLDED_SCHEDULES, Fold

        if len(self.fold) != self.num_stages:
            raise GPPConfigError(f"plan fold places {len(self.fold)} stages, the plan has {self.num_stages}")
        Fold(self.fold)   # every rank 0..R-1 holds a stage (ScheduleError otherwise)
        if self.schedule not in FOLDED_SCHEDULES:
            raise GPPConfigError(f'a folded plan runs a folded schedule ({", ".join(FOLDED_SCHEDULES)}), not '
                                 f'"{self.schedule}"')
        if any(s.devices != 1 for s in self.stages):
            raise GPPConfigError("a folded plan gives every stage one device; per-stage degrees are not folded")

    def partition(self, graph: LayerGraph) -> Partition:
        """The runtime's view of this plan: stage ports and the stage graph."""
        return derive_partition(graph, self.stage_of, num_stages=self.num_stages)

    def with_prediction(self, predicted: Prediction, stage_edges: tuple[tuple[int, int], ...] = ()) -> "Plan":
        return replace(self, predicted=predicted, stage_edges=stage_edges or self.stage_edges)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        try:
            stages = tuple(PlanStage(layers=tuple(s["layers"]), devices=s["devices"], tp=s.get("tp", 1),
                                     recompute=s.get("recompute", False), device_class=s.get("device_class"))
                           for s in d.pop("stages"))
            pred = d.pop("predicted", None)
            d["stage_edges"] = tuple(tuple(e) for e in d.get("stage_edges", ()))
            d["placement"] = tuple(tuple(p) for p in d.get("placement", ()))
            d["fold"] = tuple(d.get("fold", ()))
            d["stage_times"] = tuple(tuple(t) for t in d.get("stage_times", ()))
            d["max_in_flight"] = tuple(d.get("max_in_flight", ()))
            if pred is not None:
                pred = Prediction(**{k: tuple(v) if isinstance(v, list) else v for k, v in pred.items()})
            return cls(**d, stages=stages, predicted=pred)
        except (KeyError, TypeError) as e:
            raise GPPConfigError(f"not a gpp plan file: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(Path(path).read_text())

    def describe(self) -> str:
        lines = [f"{self.method} plan for {self.model}: {self.num_stages} stages on {self.num_devices} devices, "
                 f"micro-batch {self.micro_batch} of mini-batch {self.mini_batch}, schedule {self.schedule}"
                 + (f", ZeRO stage {self.zero_stage}" if self.zero_stage else "")]
        for i, s in enumerate(self.stages):
            shown = list(s.layers) if len(s.layers) <= 6 else [*s.layers[:3], "...", *s.layers[-2:]]
            lines.append(f"  stage {i} x{s.devices}" + (f" (tp {s.tp})" if s.tp > 1 else "")
                         + (f" {s.device_class}" if s.device_class else "")
                         + f": {len(s.layers)} layers {shown}" + (" (recompute)" if s.recompute else ""))
        if self.fold:
            lines.append(f"  folded: {self.num_devices} ranks, up to {self.stages_per_rank} stages each: "
                         + ", ".join(f"rank {r} {list(s for s, x in enumerate(self.fold) if x == r)}"
                                     for r in range(self.num_devices)))
        if self.predicted is not None:
            p = self.predicted
            lines.append(f"  predicted: {p.iteration_time_s * 1e3:.2f} ms/iteration, {p.samples_per_s:.1f} samples/s, "
                         f"peak {p.peak_mem_bytes / 2**30:.2f} GiB/device, bubble {p.bubble_fraction:.1%}")
        lines.append(f"  costs: {self.source}")
        return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """The outcome of one search: a plan or the reason there is none, and what it cost."""

    method: str
    plan: Plan | None
    search_time_s: float
    states: int = 0
    status: str = "ok"
    trace: tuple = ()
    alternatives: tuple = ()   # a search over several schedules: each one's best plan (or None), in order
