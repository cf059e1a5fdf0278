"""Partition strategies as values, and the one pure function that resolves them.

A *partition option* says how the layers are to be cut into stages; :func:`resolve_partition`
turns one into a :class:`ResolvedPartition` (layers on stages, the stage graph, the ranks per stage
and what a plan adds), which :class:`~gpp_deepspeed.engine.GraphPipelineModule` runs. The engine
never decides a partition and imports nothing from :mod:`gpp_deepspeed.planner`; the planner is
called from here. Nothing in this module imports torch, torch.distributed or deepspeed.

Glossary
--------
option
    One of :class:`BranchBalanced`, :class:`TypeBalanced`, :class:`SequentialChain`,
    :class:`GraphPipeSearch`, :class:`FromPlan`, :class:`Manual` (frozen dataclasses).
partition method
    What a DeepSpeed user writes as ``partition_method``: a name of :data:`PARTITION_ALIASES`
    (``"parameters"``, ``"uniform"``, ``"sequential"``, ``"graphpipe"``), ``"type:<regex>"``, the
    path of a plan file, a :class:`~gpp_deepspeed.planner.Plan`, a ``{layer_name: stage_idx}``
    mapping, or an option. :func:`parse_partition_method` maps it to an option.
branch-aware cut
    :func:`~gpp_deepspeed.graph.balanced_partition`: the branch-contiguous layer order cut into
    stages of balanced weight, ending stages where branches start or merge, so that independent
    branches land on different stages. This is what ``"parameters"`` and ``"uniform"`` do; it is not
    DeepSpeed's rule of the same names, which cuts the list order (:class:`SequentialChain`).
chain
    Stages run ``0 -> 1 -> ... -> S-1`` and a tensor that skips stages is relayed through every
    stage in between, as DeepSpeed's ``PipelineEngine`` carries it.

Representative signatures::

    option = parse_partition_method("parameters")          # BranchBalanced(weight='parameters', ...)
    resolved = resolve_partition(graph, option, num_stages=4, param_count=counts)
    resolved.partition.stage_graph, resolved.stage_degrees  # -> StageGraph, (1, 1, 1, 1)
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence, Union

from .errors import PartitionError
from .graph.ir import LayerGraph
from .graph.partition import balanced_partition, sequential_partition
from .graph.placement import Placement
from .graph.stages import Partition, derive_partition
from .planner.costs import CostDB
from .planner.plan import Plan
from .planner.search import graphpipe_partition, graphpipe_search, proxy_costs

__all__ = ["BranchBalanced", "TypeBalanced", "SequentialChain", "GraphPipeSearch", "DeviceProfile", "FromPlan", "Manual",
           "PartitionOption", "ResolvedPartition", "PARTITION_ALIASES", "PARTITION_METHODS", "BRANCH_SLACK",
           "parse_partition_method", "resolve_partition"]

# How much heavier than the least possible heaviest stage a balanced cut may be when that keeps
# branches apart (a shallower stage graph); GraphPipe's planner replaces this rule of thumb.
BRANCH_SLACK = 0.1

Weight = Literal["parameters", "layers"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BranchBalanced:
    """The branch-aware cut (see the glossary) of layers weighted by trainable parameters or
    counted one each (``weight="layers"``).

    A cut may make the heaviest stage up to ``slack`` (a fraction) heavier than the least possible
    one when that keeps branches on separate stages.
    """

    weight: Weight = "parameters"
    slack: float = BRANCH_SLACK


@dataclass(frozen=True, slots=True, kw_only=True)
class TypeBalanced:
    """The branch-aware cut counting only layers whose class name matches ``pattern`` (a regular
    expression, case-insensitive): DeepSpeed's ``"type:<regex>"`` weights, cut the branch-aware way."""

    pattern: str
    slack: float = BRANCH_SLACK


@dataclass(frozen=True, slots=True, kw_only=True)
class SequentialChain:
    """The chain baseline: the list order cut into contiguous stages of balanced weight, as
    DeepSpeed's ``PipelineModule`` cuts it, and run as a chain (skip tensors relayed)."""

    weight: Weight = "parameters"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProfile:
    """Time the model's layers on the ranks' own devices at start-up and plan from that: no
    separate ``gpp profile`` step (:func:`~gpp_deepspeed.profiler.profile_on_ranks` measures).

    ``make_inputs(b)`` returns the graph inputs (a tensor, or a tuple in ``input_names`` order) of
    a micro-batch of ``b`` samples; every layer is timed forward and backward, the backward also
    split into input and weight gradients, at each of ``micro_batches`` (the same sizes on every
    rank), the median of ``repeats`` runs after ``warmup``. The search prices stages at
    ``micro_batch`` (default: the largest size timed). Each rank times its share of the layers and
    the ranks exchange what they measured, so every rank plans from the same numbers.
    """

    make_inputs: Callable[[int], Any] = field(hash=False, compare=False)
    micro_batches: tuple[int, ...] = (1, 2, 4)
    micro_batch: int | None = None
    warmup: int = 1
    repeats: int = 3

    def __post_init__(self):
        object.__setattr__(self, "micro_batches", tuple(sorted(set(int(b) for b in self.micro_batches))))
        if not self.micro_batches or self.micro_batches[0] < 1 or self.warmup < 0 or self.repeats < 1:
            raise PartitionError(f"DeviceProfile needs positive micro_batches, warmup >= 0 and repeats >= 1, got "
                                 f"{list(self.micro_batches)}, {self.warmup}, {self.repeats}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise PartitionError(f"DeviceProfile.micro_batch must be positive, got {self.micro_batch}")


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphPipeSearch:
    """GraphPipe's search for the least-bottleneck stage graph with one rank per stage (arXiv
    2406.17145, Sec. 5), priced by ``cost_db`` (what ``gpp profile`` writes), or by ``profile``,
    layers timed on the ranks' devices at start-up (which the module measures into ``cost_db``
    before resolving); without either, a layer's time is taken as proportional to its parameters
    (:func:`~gpp_deepspeed.planner.search.proxy_costs`)."""

    cost_db: CostDB | None = None
    profile: DeviceProfile | None = None
    micro_batch: int = 1    # the micro-batch size the search prices stages at
    # Without num_stages or stage_degrees: the mini-batch GraphPipe's whole search (stage count,
    # devices per stage) plans for the ranks present; None is micro_batch x the world size.
    mini_batch: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FromPlan:
    """The stages of a plan (``gpp plan`` writes one): its layers, its devices per stage, the
    schedule it was priced with and the stages it recomputes. A plan priced as a chain
    (``"pipeline": "chain"``) runs as a chain."""

    plan: Plan


@dataclass(frozen=True, slots=True, kw_only=True)
class Manual:
    """An explicit ``{layer_name: stage_idx}`` assignment of every layer."""

    stage_of: Mapping[str, int] = field(hash=False)

    def __post_init__(self):
        object.__setattr__(self, "stage_of", dict(self.stage_of))


PartitionOption = Union[BranchBalanced, TypeBalanced, SequentialChain, GraphPipeSearch, FromPlan, Manual]

# The user-facing names (``partition_method="..."``, matched case-insensitively) and what they are.
PARTITION_ALIASES: dict[str, PartitionOption] = {
    "parameters": BranchBalanced(weight="parameters"),
    "uniform": BranchBalanced(weight="layers"),
    "sequential": SequentialChain(weight="parameters"),
    "graphpipe": GraphPipeSearch(),
}
PARTITION_METHODS = (*PARTITION_ALIASES, "type:<regex>", "<plan.json>", "{layer_name: stage_idx}")
_OPTIONS = (BranchBalanced, TypeBalanced, SequentialChain, GraphPipeSearch, FromPlan, Manual)


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvedPartition:
    """A partition ready to run: every layer on a stage, the stage graph, and the ranks per stage.

    ``stage_degrees[s]`` is how many ranks run stage ``s`` in one copy of the stage DAG (a plan's
    devices, the ``stage_degrees`` asked for, or one each). ``schedule`` is the training schedule a
    plan was priced with (None: no plan), ``stage_times`` the compute times its schedule was ordered
    with (``()``: none), ``max_in_flight`` the caps it was ordered under (``()``: the schedule's
    own). ``recompute`` holds the stages a plan runs with activation checkpointing.
    ``keep_stage_order``: the plan was mapped onto a device topology assuming stage blocks in stage
    order, so ranks must not be reordered to fit nodes.
    ``source`` says where the partition came from, for messages.
    """

    partition: Partition
    stage_degrees: tuple[int, ...]
    schedule: str | None = None
    recompute: frozenset[int] = frozenset()
    keep_stage_order: bool = False
    source: str = ""
    stage_tp: tuple[int, ...] | None = None   # a plan's tensor-parallel degree per stage (None: 1 each)
    stage_times: tuple[tuple[float, float, float, float], ...] = ()   # a plan's (F, B, I, W) per stage
    max_in_flight: tuple[int, ...] = ()   # a folded plan's caps of micro-batches in flight per rank (): its own

    @property
    def num_stages(self) -> int:
        return self.partition.num_stages


def parse_partition_method(method: Any, *, cost_db: Any = None) -> PartitionOption | ResolvedPartition:
    """The option a user's ``partition_method`` names (see the glossary); ``cost_db`` (a
    :class:`~gpp_deepspeed.planner.CostDB`, the path of one, or a :class:`DeviceProfile`: time
    the layers on the ranks' devices at start-up) prices ``"graphpipe"``.

    Plan and cost-database files are read here; :func:`resolve_partition` reads no file.

    >>> parse_partition_method("uniform")
    BranchBalanced(weight='layers', slack=0.1)
    >>> parse_partition_method("type:Block")
    TypeBalanced(pattern='Block', slack=0.1)
    >>> parse_partition_method({"a": 0, "b": 1})
    Manual(stage_of={'a': 0, 'b': 1})
    >>> parse_partition_method("balanced")
    Traceback (most recent call last):
    ...
    gpp_deepspeed.errors.PartitionError: unknown partition_method "balanced"; valid: ('parameters', ...)
    """
    option = _parse(method)
    if cost_db is not None and not isinstance(option, GraphPipeSearch):
        what = "already resolved" if isinstance(option, ResolvedPartition) else _describe(option)
        warnings.warn(f'cost_db is ignored: only partition_method="graphpipe" prices layers with it, and the '
                      f"partition here is {what}", stacklevel=2)
    elif cost_db is not None:
        if option.cost_db is not None or option.profile is not None:
            raise PartitionError("the cost database is given twice (cost_db= and GraphPipeSearch(cost_db=... or "
                                 "profile=...)); give it once")
        if isinstance(cost_db, DeviceProfile):
            option = replace(option, profile=cost_db)
        else:
            option = replace(option, cost_db=cost_db if isinstance(cost_db, CostDB) else CostDB.load(cost_db))
    return option


def _parse(method: Any) -> PartitionOption | ResolvedPartition:
    if isinstance(method, (*_OPTIONS, ResolvedPartition)):
        return method
    if isinstance(method, Plan):
        return FromPlan(plan=method)
    if isinstance(method, os.PathLike) or isinstance(method, str) and method.endswith(".json"):
        path = Path(method)
        if not path.is_file():
            raise PartitionError(f'partition_method names plan file "{method}", which does not exist')
        return FromPlan(plan=Plan.load(path))
    if isinstance(method, Mapping):
        return Manual(stage_of=method)
    if not isinstance(method, str):
        raise PartitionError(f"partition_method must be one of {PARTITION_METHODS} or a partition option "
                             f"({', '.join(c.__name__ for c in _OPTIONS)}), got {method!r}")
    name = method.lower()
    if name.startswith("type:"):
        return TypeBalanced(pattern=method.split(":", 1)[1])
    if name not in PARTITION_ALIASES:
        raise PartitionError(f'unknown partition_method "{method}"; valid: {PARTITION_METHODS}')
    return PARTITION_ALIASES[name]


def resolve_partition(graph: LayerGraph, option: PartitionOption | ResolvedPartition, *,
                      num_stages: int | None = None, stage_degrees: Sequence[int] | None = None,
                      world_size: int | None = None,
                      param_count: Mapping[str, int] | Callable[[str], int] | None = None,
                      layer_type: Mapping[str, str] | Callable[[str], str] | None = None) -> ResolvedPartition:
    """Cut ``graph`` into stages as ``option`` says, and decide the ranks per stage.

    The stage count is ``num_stages``, else ``len(stage_degrees)``, else the plan's; the ranks
    per stage are a plan's devices, else ``stage_degrees``, else one each. With ``world_size`` the
    ranks per copy of the stage DAG must divide it. ``param_count`` (trainable parameters of a
    layer, by name) is read only by options weighted by parameters and ``layer_type`` (a layer's
    class name) only by :class:`TypeBalanced`: callers may pass lazy functions. Every count is
    checked before any layer is cut. A :class:`ResolvedPartition` is returned as it is, once
    checked against ``graph`` and the counts. Pure and deterministic: every rank computes the same
    result.

    Raises :class:`~gpp_deepspeed.errors.PartitionError` (a ``ValueError``) naming the numbers.

    Examples
    --------
    >>> from gpp_deepspeed.graph import build_layer_graph
    >>> g = build_layer_graph(["x"], [("a", ["x"]), ("b", ["x"]), ("c", ["a", "b"])])
    >>> r = resolve_partition(g, BranchBalanced(weight="layers"), num_stages=3)
    >>> r.partition.stage_of, [(e.src, e.dst) for e in r.partition.stage_graph.edges], r.stage_degrees
    ({'a': 0, 'b': 1, 'c': 2}, [(0, 2), (1, 2)], (1, 1, 1))
    >>> chain = resolve_partition(g, SequentialChain(weight="layers"), stage_degrees=[2, 1, 1])
    >>> [(e.src, e.dst) for e in chain.partition.stage_graph.edges], chain.stage_degrees
    ([(0, 1), (1, 2)], (2, 1, 1))
    """
    if isinstance(option, ResolvedPartition):
        return _check_resolved(graph, option, num_stages=num_stages, stage_degrees=stage_degrees,
                               world_size=world_size)
    if isinstance(option, FromPlan):
        return _from_plan(graph, option.plan, num_stages=num_stages, stage_degrees=stage_degrees,
                          world_size=world_size)
    if isinstance(option, GraphPipeSearch) and num_stages is None and stage_degrees is None and world_size:
        return _planned_for_world(graph, option, world_size, _lookup(param_count, "param_count"))
    degrees = _degrees(num_stages, stage_degrees, world_size)
    stage_of = _cut(graph, option, len(degrees), _lookup(param_count, "param_count"),
                    _lookup(layer_type, "layer_type"))
    partition = derive_partition(graph, stage_of, num_stages=len(degrees), relay=isinstance(option, SequentialChain))
    return ResolvedPartition(partition=partition, stage_degrees=degrees, source=_describe(option))


def _planned_for_world(graph: LayerGraph, option: GraphPipeSearch, world_size: int, param_count) -> ResolvedPartition:
    """GraphPipe's whole search (stage graph, devices per stage, one degree for all stages) on the
    ``world_size`` ranks present: what a restart on fewer devices runs (issue 31)."""
    _check_measured(option)
    mini_batch = option.mini_batch or option.micro_batch * world_size
    plan = graphpipe_search(_cost_db(graph, option.cost_db, param_count), num_devices=world_size,
                            mini_batch=mini_batch, space="runtime").plan
    if plan is None:
        raise PartitionError(f"GraphPipe's search found no plan for {world_size} ranks at mini-batch {mini_batch} "
                             "that fits memory; give num_stages, or a larger world")
    resolved = _from_plan(graph, plan, num_stages=None, stage_degrees=None, world_size=world_size)
    return replace(resolved, source=f"GraphPipe's plan for the {world_size} ranks present")


def _check_measured(option: GraphPipeSearch) -> None:
    if option.cost_db is None and option.profile is not None:
        raise PartitionError("GraphPipeSearch(profile=...) must be measured before it is resolved: "
                             "gpp_deepspeed.profiler.profile_on_ranks (GraphPipelineModule does it)")


def _cut(graph: LayerGraph, option: PartitionOption, num_stages: int, param_count, layer_type) -> dict[str, int]:
    """``{layer_name: stage_idx}`` for every option but a plan."""
    if isinstance(option, Manual):
        return dict(option.stage_of)
    if isinstance(option, GraphPipeSearch):
        _check_measured(option)
        return graphpipe_partition(_cost_db(graph, option.cost_db, param_count), num_stages=num_stages,
                                   micro_batch=option.micro_batch)
    if isinstance(option, TypeBalanced):
        pattern = re.compile(option.pattern, re.IGNORECASE)
        weights = [int(bool(pattern.search(layer_type(n)))) for n in graph.names]
        if not any(weights):
            raise PartitionError(f'partition_method "type:{option.pattern}" matches no layer class')
        return balanced_partition(graph, num_stages, weights=weights, slack=option.slack)
    if isinstance(option, (BranchBalanced, SequentialChain)):
        weights = [param_count(n) for n in graph.names] if option.weight == "parameters" else [1] * len(graph.names)
        if isinstance(option, SequentialChain):
            return sequential_partition(graph, num_stages, weights=weights)
        return balanced_partition(graph, num_stages, weights=weights, slack=option.slack)
    raise PartitionError(f"partition_method must be one of {PARTITION_METHODS}, got {option!r}")


def _degrees(num_stages: int | None, stage_degrees: Sequence[int] | None, world_size: int | None) -> tuple[int, ...]:
    """Ranks per stage from ``stage_degrees`` or ``num_stages`` (one each), checked."""
    if stage_degrees is not None:
        degrees = tuple(stage_degrees)
        if num_stages is not None and len(degrees) != num_stages:
            raise PartitionError(f"stage_degrees={list(degrees)} gives {len(degrees)} stages but num_stages is "
                                 f"{num_stages}")
        if world_size is not None:
            Placement.build(degrees, world_size=world_size)  # raises, naming the degrees and the world size
        return degrees
    if num_stages is None:
        raise PartitionError("give num_stages, stage_degrees, a plan or topology")
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise PartitionError(f"num_stages must be a positive integer, got {num_stages!r}")
    if world_size is not None and world_size % num_stages:
        raise PartitionError(f"num_stages ({num_stages}) must divide the world size ({world_size}): each "
                             "pipeline replica needs one rank per stage")
    return (1, ) * num_stages


def _from_plan(graph: LayerGraph, plan: Plan, *, num_stages: int | None, stage_degrees: Sequence[int] | None,
               world_size: int | None) -> ResolvedPartition:
    source = f"plan {plan.method} for {plan.model}"
    if num_stages is not None and plan.num_stages != num_stages:
        raise PartitionError(f"{source} has {plan.num_stages} stages but the pipeline has {num_stages}; launch "
                             f"with {plan.num_stages} pipeline stages (num_stages={plan.num_stages})")
    devices = tuple(s.devices for s in plan.stages)
    if stage_degrees is not None and tuple(stage_degrees) != devices:
        raise PartitionError(f"stage_degrees={list(stage_degrees)} disagrees with the plan's devices per stage "
                             f"{list(devices)}; drop stage_degrees to run the plan as planned")
    if world_size is not None and world_size % plan.num_devices:
        raise PartitionError(f"{source} places its {plan.num_stages} stages on {plan.num_devices} devices "
                             f"{list(devices)}, but the world size is {world_size}; launch {plan.num_devices} "
                             "ranks (or a multiple for data-parallel replicas)")
    partition = derive_partition(graph, plan.stage_of, num_stages=plan.num_stages, relay=plan.pipeline == "chain")
    return ResolvedPartition(partition=partition, stage_degrees=devices, schedule=plan.schedule,
                             recompute=frozenset(i for i, s in enumerate(plan.stages) if s.recompute),
                             keep_stage_order=bool(plan.placement), source=source,
                             stage_tp=tuple(s.tp for s in plan.stages) if any(s.tp > 1 for s in plan.stages) else None,
                             stage_times=plan.stage_times, max_in_flight=plan.max_in_flight)


def _check_resolved(graph: LayerGraph, resolved: ResolvedPartition, *, num_stages: int | None,
                    stage_degrees: Sequence[int] | None, world_size: int | None) -> ResolvedPartition:
    if resolved.partition.graph != graph:
        raise PartitionError(f"the resolved partition ({resolved.source}) was made for another layer graph "
                             f"(layers {list(resolved.partition.graph.names)[:5]}...); resolve it for this model")
    if num_stages is not None and resolved.num_stages != num_stages:
        raise PartitionError(f"the resolved partition ({resolved.source}) has {resolved.num_stages} stages but "
                             f"the pipeline has {num_stages}")
    if stage_degrees is not None and tuple(stage_degrees) != resolved.stage_degrees:
        raise PartitionError(f"stage_degrees={list(stage_degrees)} disagrees with the resolved partition's "
                             f"{list(resolved.stage_degrees)}; drop stage_degrees")
    if world_size is not None:
        Placement.build(resolved.stage_degrees, world_size=world_size)
    return resolved


def _cost_db(graph: LayerGraph, cost_db: CostDB | None, param_count) -> CostDB:
    if cost_db is None:
        return proxy_costs(graph, [param_count(n) for n in graph.names])
    if set(cost_db.by_name) != set(graph.names):
        missing = sorted(set(graph.names) - set(cost_db.by_name))
        extra = sorted(set(cost_db.by_name) - set(graph.names))
        raise PartitionError(f"cost_db {cost_db.model} does not describe this model's layers: missing {missing[:5]}, "
                             f"unknown {extra[:5]}")
    return cost_db


def _lookup(values, what: str) -> Callable[[str], Any]:
    """A function of the layer name from a mapping or a function; a missing one fails when read."""
    if values is None:
        def missing(name: str):
            raise PartitionError(f"this partition option needs {what} (per layer), and none was given")
        return missing
    return values.__getitem__ if isinstance(values, Mapping) else values


def _describe(option: PartitionOption) -> str:
    for name, alias in PARTITION_ALIASES.items():
        if option == alias:
            return f'partition_method "{name}"'
    if isinstance(option, TypeBalanced):
        return f'partition_method "type:{option.pattern}"'
    return type(option).__name__
