"""The cost database every planner reads, and the stage cost model they all share.

Glossary
--------
cost database
    A :class:`CostDB`: the layer DAG with, per layer, forward and backward seconds at several
    micro-batch sizes, parameter bytes, output bytes and stashed-activation bytes per sample; the
    device's memory and the links' affine fits. Profiles (measured) and the analytic model
    (FLOPs against a device spec) both produce one; ``source`` says which. JSON, no torch.
stage time
    Seconds one device of a stage spends per micro-batch: forward and backward of its layers on
    its shard of the micro-batch, the activations it receives and the gradients it sends back,
    and its share of the once-per-mini-batch gradient all-reduce (GraphPipe, arXiv 2406.17145,
    Sec. 5 "EstimateTPS": profiled operator times, affine communication).
time per sample (TPS)
    Stage time divided by the micro-batch size; the planners minimise the largest one (Eq. 1).
in flight
    Micro-batches whose forward ran on a stage and whose backward has not: their activations
    are stashed. Under synchronous 1F1B it is the stage's depth to the sink (Sec. 6).
tensor parallelism (TP)
    A stage's devices form ``n / tp`` data-parallel replicas of ``tp`` ranks each, which split
    every layer's matrices (Megatron-LM, Shoeybi et al., arXiv 1909.08053, Sec. 3): compute,
    parameters, gradients and optimizer state per rank fall as ``1 / tp``, and every layer with
    parameters all-reduces its output activations twice in the forward and twice in the backward
    (:func:`tensor_parallel_time`).
ZeRO stage
    How a stage's data-parallel group of ``n`` ranks shares its weight state (Rajbhandari et
    al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020): 0
    replicates everything, 1 partitions the optimizer state over the ``n`` ranks, 2 the gradients
    too, 3 the parameters too (:func:`weight_state_bytes`, :func:`zero_collectives`).

Every planner (GraphPipe, PipeDream, Piper, DeepSpeed's partitions) prices stages with
:class:`StageCostModel`, and every plan is timed by the same simulator, so comparisons differ
only in the search.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
from dataclasses import asdict, dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from ..errors import GPPConfigError
from ..graph.ir import LayerGraph, build_layer_graph
from ..graph.stages import derive_partition

__all__ = ["CommFit", "LayerCost", "Hardware", "CostDB", "Boundary", "StageCost", "StageCostModel", "edge_bytes",
           "plan_boundaries", "allreduce_time", "allreduce_coefficients", "allgather_coefficients", "micro_batch_sizes",
           "reshard_messages", "ZERO_STAGES", "weight_state_bytes", "zero_collectives", "check_zero_stage",
           "tensor_parallel_time", "TP_ALLREDUCES_PER_PASS"]

ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True, slots=True, kw_only=True)
class CommFit:
    """A link's message model: the affine fit of GraphPipe (Sec. 5), ``alpha_s + beta_s_per_byte * x``
    seconds for a message of ``x`` bytes, optionally split as LogP splits a message (Culler et al.,
    "LogP: towards a realistic model of parallel computation", PPoPP 1993) into the time each end
    is *busy* with it and the time it is *in flight*, when both ends can do other work.

    ``overhead_s`` is what each end spends on one message besides its bytes (posting, packing,
    completing: LogP's ``o``). Given, a message keeps each end busy ``overhead_s + beta * x`` and
    is in flight :attr:`latency_s` ``= alpha_s - 2 * overhead_s`` (``alpha_s`` being an isolated
    message's end-to-end time, ``o + L + o``); the simulator lets that latency overlap other work,
    so a group of messages posted together pays it once. ``None`` (the default, and the paper's
    stage time) counts the whole ``alpha_s`` as busy at both ends and nothing in flight.
    ``late_receive_s`` is what a message whose receive is posted after its send waits on top of the
    latency: gloo's TCP pair answers a send nobody is receiving yet with a "receive ready" notice
    and only then gets the data, one exchange more than when the receive came first (NCCL: 0).

    >>> round(CommFit(alpha_s=1e-5, beta_s_per_byte=1e-9).time(1000), 12)
    1.1e-05
    >>> link = CommFit(alpha_s=1.0, beta_s_per_byte=0.01, overhead_s=0.25)
    >>> link.busy(10.0), link.latency_s, CommFit(alpha_s=1.0, beta_s_per_byte=0.01).busy(10.0)
    (0.35, 0.5, 1.1)
    """

    alpha_s: float
    beta_s_per_byte: float
    overhead_s: float | None = None
    late_receive_s: float = 0.0

    def __post_init__(self):
        if self.overhead_s is not None and not 0 <= 2 * self.overhead_s <= self.alpha_s:
            raise GPPConfigError(f"link overhead_s = {self.overhead_s:g} s must be between 0 and half of alpha_s = "
                                 f"{self.alpha_s:g} s (an isolated message takes alpha_s = overhead + latency + "
                                 "overhead end to end)")
        if self.late_receive_s < 0:
            raise GPPConfigError(f"link late_receive_s = {self.late_receive_s:g} s must not be negative")

    def time(self, nbytes: float) -> float:
        """An isolated message's end-to-end seconds (the affine fit)."""
        return 0.0 if nbytes <= 0 else self.alpha_s + self.beta_s_per_byte * nbytes

    @property
    def busy_s(self) -> float:
        """Seconds each end is busy per message besides its bytes."""
        return self.alpha_s if self.overhead_s is None else self.overhead_s

    @property
    def latency_s(self) -> float:
        """Seconds a message is in flight once both ends have posted it (overlapping other work)."""
        return 0.0 if self.overhead_s is None else self.alpha_s - 2 * self.overhead_s

    def busy(self, nbytes: float) -> float:
        """Seconds one end is busy with one message of ``nbytes`` (none without bytes)."""
        return 0.0 if nbytes <= 0 else self.busy_s + self.beta_s_per_byte * nbytes


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCost:
    """One layer's measured or modelled costs.

    ``micro_batches`` are the sizes at which ``fwd_s`` and ``bwd_s`` (seconds per micro-batch)
    were measured, ascending. Byte counts are per layer (parameters) or per sample (the rest).
    ``bwd_input_s`` and ``bwd_weight_s``, when present, are the two halves of a split backward
    measured apart (input gradients, then weight gradients; the zero-bubble schedules' ``I`` and
    ``W``); a database without them (older JSON) splits ``bwd_s`` evenly, the zero-bubble paper's
    ``T_I = T_W`` for matrix-multiply layers (arXiv 2401.10241, Sec. 2).
    """

    name: str
    inputs: tuple[str, ...]
    micro_batches: tuple[int, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    param_bytes: int
    out_bytes: int
    stash_bytes: int
    bwd_input_s: tuple[float, ...] | None = None
    bwd_weight_s: tuple[float, ...] | None = None

    def __post_init__(self):
        n = len(self.micro_batches)
        if n == 0 or len(self.fwd_s) != n or len(self.bwd_s) != n:
            raise GPPConfigError(f'layer "{self.name}": micro_batches, fwd_s and bwd_s need the same '
                                 f"non-zero length, got {n}, {len(self.fwd_s)}, {len(self.bwd_s)}")
        if (self.bwd_input_s is None) != (self.bwd_weight_s is None) or \
                self.bwd_input_s is not None and not len(self.bwd_input_s) == len(self.bwd_weight_s) == n:
            raise GPPConfigError(f'layer "{self.name}": give both bwd_input_s and bwd_weight_s, one value per '
                                 "micro-batch size, or neither")
        if list(self.micro_batches) != sorted(set(self.micro_batches)) or self.micro_batches[0] <= 0:
            raise GPPConfigError(f'layer "{self.name}": micro_batches must be positive and strictly '
                                 f"ascending, got {list(self.micro_batches)}")

    def times(self, b: float) -> tuple[float, float]:
        """Forward and backward seconds for a micro-batch of ``b`` samples.

        Piecewise linear between measured sizes; outside them proportional to ``b`` from the
        nearest measured size (a smaller shard runs no faster per sample than the smallest
        measured one, a larger one no slower than the largest).

        >>> c = LayerCost(name="l", inputs=("x",), micro_batches=(1, 4), fwd_s=(1.0, 2.5),
        ...               bwd_s=(2.0, 5.0), param_bytes=0, out_bytes=0, stash_bytes=0)
        >>> c.times(2), c.times(8), c.times(0.5)
        ((1.5, 3.0), (5.0, 10.0), (0.5, 1.0))
        """
        return self._at(self.fwd_s, b), self._at(self.bwd_s, b)

    def split_backward_times(self, b: float) -> tuple[float, float]:
        """Input-gradient and weight-gradient seconds for a micro-batch of ``b`` samples
        (``bwd_s`` halved when they were not measured apart).

        >>> c = LayerCost(name="l", inputs=("x",), micro_batches=(1,), fwd_s=(1.0,), bwd_s=(2.0,),
        ...               param_bytes=0, out_bytes=0, stash_bytes=0)
        >>> c.split_backward_times(2)
        (2.0, 2.0)
        """
        if self.bwd_input_s is None:
            half = self._at(self.bwd_s, b) / 2
            return half, half
        return self._at(self.bwd_input_s, b), self._at(self.bwd_weight_s, b)

    def _at(self, values: tuple[float, ...], b: float) -> float:
        mbs = self.micro_batches
        if b <= mbs[0]:
            return values[0] * b / mbs[0]
        if b >= mbs[-1]:
            return values[-1] * b / mbs[-1]
        i = bisect.bisect_right(mbs, b)
        lo, hi = mbs[i - 1], mbs[i]
        return values[i - 1] + (b - lo) / (hi - lo) * (values[i] - values[i - 1])


_TUPLE_FIELDS = ("inputs", "micro_batches", "fwd_s", "bwd_s", "bwd_input_s", "bwd_weight_s")


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """The devices a plan runs on: memory per device, devices per node and the two link fits.

    ``optimizer_factor`` is the bytes of gradients and optimizer state per parameter byte
    (fp32 Adam: one gradient and two moments, 3.0), so a stage holds
    ``param_bytes * (1 + optimizer_factor)`` of weight state per device. ``collective`` is the
    cost of one step of a ring all-reduce when it differs from a point-to-point message (gloo's
    collectives on one machine cost more per step than its messages), by default the link's.
    ``step_s`` is what a rank spends once per iteration outside the pipeline's actions: the
    optimizer step and the engine's end-of-batch work (loss aggregation, bookkeeping).
    """

    name: str
    memory_bytes: int
    devices_per_node: int
    intra: CommFit
    inter: CommFit
    optimizer_factor: float = 3.0
    collective: CommFit | None = None
    step_s: float = 0.0

    def link(self, num_devices: int) -> CommFit:
        """The link a group of ``num_devices`` devices talks over (packed into as few nodes as fit)."""
        return self.intra if num_devices <= self.devices_per_node else self.inter

    def ring(self, num_devices: int) -> CommFit:
        """The cost of one step of a ring all-reduce among ``num_devices`` devices."""
        return self.collective or self.link(num_devices)


@dataclass(frozen=True, kw_only=True)
class CostDB:
    """A layer DAG priced for one kind of device; what ``gpp profile`` writes and ``gpp plan`` reads.

    ``layers`` are in a topological order (the model's list order). ``source`` says how the
    numbers were obtained, e.g. ``"measured on cpu (2 cores), torch 2.13"`` or
    ``"analytic: H100 ..."``, and travels into every plan made from it.
    """

    model: str
    source: str
    input_names: tuple[str, ...]
    output: str
    layers: tuple[LayerCost, ...]
    hardware: Hardware
    granularity: str = "layer"

    @cached_property
    def graph(self) -> LayerGraph:
        return build_layer_graph(self.input_names, [(c.name, c.inputs) for c in self.layers],
                                 output=self.output)

    @cached_property
    def by_name(self) -> dict[str, LayerCost]:
        return {c.name: c for c in self.layers}

    @property
    def micro_batches(self) -> tuple[int, ...]:
        """Micro-batch sizes measured for every layer."""
        common = set(self.layers[0].micro_batches)
        for c in self.layers[1:]:
            common &= set(c.micro_batches)
        return tuple(sorted(common))

    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "CostDB":
        d = json.loads(text)
        hw = d.pop("hardware")
        collective = hw.get("collective")
        hardware = Hardware(**{**hw, "intra": CommFit(**hw["intra"]), "inter": CommFit(**hw["inter"]),
                               "collective": None if collective is None else CommFit(**collective)})
        layers = tuple(LayerCost(**{**c, **{k: tuple(c[k]) for k in _TUPLE_FIELDS if c.get(k) is not None}})
                       for c in d.pop("layers"))
        return cls(**{**d, "input_names": tuple(d["input_names"]), "layers": layers, "hardware": hardware})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "CostDB":
        return cls.from_json(Path(path).read_text())


@dataclass(frozen=True, slots=True)
class Boundary:
    """What one rank of a stage exchanges with other stages per micro-batch, each way.

    Bytes per sample it receives and sends (activations forward; their gradients backward cross
    the same edges the other way), and the messages they travel in: the engine sends one message
    per stage edge and peer rank (``engine/p2p.py``: an edge's tensors are packed into one
    buffer), so a fan-in stage receives one message per in-edge, a tensor read by several stages
    is sent once to each, and an edge between stages of different degrees costs the narrower
    side's ranks one message per peer that holds their rows (:func:`reshard_messages`).
    """

    in_bytes: float = 0.0
    out_bytes: float = 0.0
    in_messages: int = 0
    out_messages: int = 0

    @classmethod
    def chain(cls, in_bytes: float, out_bytes: float) -> "Boundary":
        """A stage of a linear pipeline: one message from its predecessor, one to its successor.

        >>> Boundary.chain(8.0, 0.0)
        Boundary(in_bytes=8.0, out_bytes=0.0, in_messages=1, out_messages=0)
        """
        return cls(in_bytes, out_bytes, int(in_bytes > 0), int(out_bytes > 0))


NO_BOUNDARY = Boundary()


@dataclass(frozen=True, slots=True)
class StageCost:
    """The priced parts of one stage at one micro-batch size and data-parallel degree."""

    fwd_s: float          # forward compute plus receiving activations, per micro-batch
    bwd_s: float          # backward compute plus sending input gradients back, per micro-batch
    allreduce_s: float    # the group's once-per-mini-batch collective (zero_collectives): the gradient
                          # all-reduce; under ZeRO-2 the parameter all-gather; none under ZeRO-3
    weight_bytes: float   # parameters, gradients and optimizer state per device (weight_state_bytes)
    stash_bytes: float    # activations stashed per in-flight micro-batch per device
    bwd_input_s: float = 0.0   # split backward: input gradients plus the gradient transfers (I)
    bwd_weight_s: float = 0.0  # split backward: weight gradients (W)
    working_bytes: float = 0.0  # recomputed stage: one micro-batch's activations during its backward
    param_bytes: float = 0.0    # one copy of the parameters (an asynchronous schedule stashes versions)
    gathered_bytes: float = 0.0  # ZeRO-3: the largest layer's parameters, gathered whole while it computes

    @property
    def times(self) -> tuple[float, float, float, float]:
        """Its ``(F, B, I, W)`` seconds per micro-batch: what a schedule made on a simulated clock is
        ordered for (:func:`~gpp_deepspeed.schedule.greedy.stage_duration`, a plan's ``stage_times``)."""
        return self.fwd_s, self.bwd_s, self.bwd_input_s, self.bwd_weight_s

    def memory(self, in_flight: int, versions: int = 0) -> float:
        """Peak bytes per device with ``in_flight`` micro-batches and ``versions`` extra copies of
        the weights stashed (GraphPipe Sec. 3, Eq. 2; a recomputed stage stashes only its inputs
        and rebuilds one micro-batch's activations at a time, PipeDream-2BW Sec. 3.3; the stash
        counts of each schedule: :func:`~gpp_deepspeed.planner.inflight.schedule_memory`; ZeRO-3
        holds one layer's parameters gathered at a time on top of its partitions)."""
        return (self.weight_bytes + in_flight * self.stash_bytes + self.working_bytes + versions * self.param_bytes
                + self.gathered_bytes)


@dataclass
class StageCostModel:
    """Prices sets of layers as stages, for one cost database and mini-batch size.

    Layers are referred to by their index in ``db.layers``; a stage is an ``int`` bitmask of
    layer indices. ``p2p_devices`` is the plan's total device count: when it exceeds one node,
    stage-to-stage traffic is priced on the inter-node link.

    Per micro-batch of ``b`` samples on a stage with ``n`` devices (each device gets ``b / n``):

    * compute: ``sum_l fwd_l(b/n) + bwd_l(b/n)`` (profiled or analytic times);
    * communication: every message entering or leaving the stage keeps it busy
      :meth:`CommFit.busy` (``alpha + beta * bytes`` with the paper's affine fit, GraphPipe Sec. 5;
      the overhead and the bytes when the link splits off a latency in flight, which overlaps
      other work and is priced by the simulator) forward (activations) and again backward (their
      gradients): the stage's :class:`Boundary`, its bytes at ``b / n`` samples per rank. A plan's
      boundaries are exact (:func:`plan_boundaries`); a layer set priced before its neighbours
      are placed gets :meth:`boundary`'s estimate of the messages;
    * all-reduce: ring, ``2 (n-1)/n * param_bytes`` per device plus ``2 (n-1)`` latencies, once
      per mini-batch (:func:`allreduce_time`); its share per micro-batch is ``b / B`` of it.
      Under ``zero_stage`` 2 and 3 the group's collectives move into the micro-batches
      (:func:`zero_collectives`);
    * weight state: :func:`weight_state_bytes` of the stage's parameters under ``zero_stage``;
    * tensor parallelism (``tp``, one of :meth:`tp_options`): the ``n`` devices are ``n / tp``
      replicas of ``tp`` ranks; each replica gets ``b / (n / tp)`` samples, compute and weight
      state per rank are divided by ``tp`` and every layer with parameters adds
      :func:`tensor_parallel_time` of its output bytes on the replica's shard to the forward and to
      the backward (before the input gradients leave: ``I``). The stashed activations are not
      divided (a conservative bound: without sequence parallelism Megatron keeps each layer's
      input and output whole on every TP rank; Korthikanti et al., arXiv 2205.05198, Sec. 4.1).
      ``tp_degrees`` are the degrees a search may choose; a TP group spans nodes only with
      ``tp_across_nodes``.

    ``layer_degrees`` (per layer, the data-parallel degree of the stage that holds it in a known
    plan, :meth:`with_degrees`) prices a stage's messages with its neighbours' degrees: an edge to
    or from a stage of another degree costs the narrower side one message per peer rank that
    holds its rows (:func:`reshard_messages`), as the engine reshards. Without it a stage's
    neighbours are taken to run on its own degree, which is exact when every stage has one degree.
    """

    db: CostDB
    mini_batch: int
    p2p_devices: int = 1
    zero_stage: int = 0
    layer_degrees: tuple[int, ...] | None = None
    tp_degrees: tuple[int, ...] = (1, )
    tp_across_nodes: bool = False
    _cache: dict = field(default_factory=dict, repr=False)
    _shared: dict = field(default_factory=dict, repr=False)   # what does not depend on layer_degrees

    def __post_init__(self):
        check_zero_stage(self.zero_stage)
        layers = self.db.layers
        index = {c.name: i for i, c in enumerate(layers)}
        self.num_layers = len(layers)
        self.full_mask = (1 << len(layers)) - 1
        self.producers = []     # per layer: bitmask of layers it reads
        self.consumers = [0] * len(layers)
        for i, c in enumerate(layers):
            mask = 0
            for ref in c.inputs:
                src = ref.split(":")[0]
                if src in index:
                    mask |= 1 << index[src]
                    self.consumers[index[src]] |= 1 << i
            self.producers.append(mask)
        self.index = index
        self.link = self.db.hardware.link(self.p2p_devices)
        # Bitmasks of every layer's ancestors and descendants (db.layers is a topological order).
        self.ancestors = [0] * len(layers)
        for i in range(len(layers)):
            for j in self._members(self.producers[i]):
                self.ancestors[i] |= self.ancestors[j] | 1 << j
        self.descendants = [0] * len(layers)
        for i in reversed(range(len(layers))):
            for j in self._members(self.consumers[i]):
                self.descendants[i] |= self.descendants[j] | 1 << j

    def mask_of(self, names: Iterable[str]) -> int:
        m = 0
        for n in names:
            m |= 1 << self.index[n]
        return m

    def names_of(self, mask: int) -> tuple[str, ...]:
        return tuple(c.name for i, c in enumerate(self.db.layers) if mask >> i & 1)

    @staticmethod
    def _members(mask: int) -> list[int]:
        low = mask & -mask
        if mask and not mask & (mask + low):   # one run of ones: a range of layers, the usual stage
            return list(range(low.bit_length() - 1, mask.bit_length()))
        out = []
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return out

    def layer_times(self, shard: float) -> list[tuple[float, float]]:
        """Every layer's forward and backward seconds on a shard of ``shard`` samples (cached)."""
        key = ("times", shard)
        hit = self._shared.get(key)
        if hit is None:
            hit = self._shared[key] = [c.times(shard) for c in self.db.layers]
        return hit

    def _layer_rows(self, shard: float) -> list[tuple]:
        """Per layer on a shard: forward, backward, its two split halves, parameter and stash
        bytes (cached: the searches price many stages at few shard sizes)."""
        key = ("rows", shard)
        hit = self._shared.get(key)
        if hit is None:
            hit = self._shared[key] = [(*t, *c.split_backward_times(shard), c.param_bytes, c.stash_bytes)
                                      for t, c in zip(self.layer_times(shard), self.db.layers)]
        return hit

    def with_degrees(self, stages: Sequence[tuple[int, int]]) -> "StageCostModel":
        """This model with the neighbours' degrees of a plan's ``stages`` (layer masks and degrees):
        every stage is then priced with the resharding its edges to them cost."""
        degrees = [1] * self.num_layers
        for mask, n in stages:
            for i in self._members(mask):
                degrees[i] = n
        return StageCostModel(self.db, self.mini_batch, p2p_devices=self.p2p_devices, zero_stage=self.zero_stage,
                              layer_degrees=tuple(degrees), tp_degrees=self.tp_degrees,
                              tp_across_nodes=self.tp_across_nodes, _shared=self._shared)

    def tp_options(self, n: int, b: int) -> list[int]:
        """The TP degrees of ``tp_degrees`` a stage of ``n`` devices at micro-batch ``b`` may run:
        ``tp`` divides ``n``, the ``n / tp`` replicas divide ``b``, and the group fits a node
        unless ``tp_across_nodes``.

        >>> from gpp_deepspeed.planner.costs import CommFit, CostDB, Hardware, LayerCost
        >>> link = CommFit(alpha_s=0.0, beta_s_per_byte=0.0)
        >>> hw = Hardware(name="h", memory_bytes=1, devices_per_node=4, intra=link, inter=link)
        >>> db = CostDB(model="m", source="hand", input_names=("x",), output="l", hardware=hw,
        ...             layers=(LayerCost(name="l", inputs=("x",), micro_batches=(1,), fwd_s=(1.0,), bwd_s=(1.0,),
        ...                               param_bytes=0, out_bytes=0, stash_bytes=0),))
        >>> StageCostModel(db, 4, tp_degrees=(1, 2, 4, 8)).tp_options(8, 2)
        [4]
        """
        per_node = self.db.hardware.devices_per_node
        return [t for t in self.tp_degrees if n % t == 0 and b % (n // t) == 0
                and (t <= per_node or self.tp_across_nodes)]

    def choose_tp(self, mask: int, b: int, n: int, stashed: tuple[int, int], *,
                  recompute: bool = False) -> int | None:
        """The TP degree of :meth:`tp_options` at which layer set ``mask`` on ``n`` devices is
        fastest and fits with ``stashed`` (micro-batches, weight versions) held; None if none fits.
        Ties go to the smaller degree (fewer collectives to go wrong)."""
        limit = self.db.hardware.memory_bytes
        fitting = [(self.time_per_sample(mask, b, n, recompute=recompute, tp=t), t) for t in self.tp_options(n, b)
                   if self.stage(mask, b, n, recompute=recompute, tp=t).memory(*stashed) <= limit]
        return min(fitting)[1] if fitting else None

    def stage_successors(self, masks: Sequence[int]) -> dict[int, set[int]]:
        """The stage graph of layer sets ``masks`` (each layer in one of them): per stage, an index
        into ``masks``, the stages that read one of its layers' outputs."""
        stage_of = {i: s for s, mask in enumerate(masks) for i in self._members(mask)}
        return {s: {stage_of[c] for i in self._members(mask) for c in self._members(self.consumers[i])} - {s}
                for s, mask in enumerate(masks)}

    def stage_order(self, masks: Sequence[int]) -> list[int]:
        """A topological order of the stage graph of ``masks`` (:meth:`stage_successors`), ties
        going to the stage whose first layer comes first in the model: how plans number stages.

        >>> from gpp_deepspeed.planner.costs import CommFit, CostDB, Hardware, LayerCost
        >>> link = CommFit(alpha_s=0.0, beta_s_per_byte=0.0)
        >>> hw = Hardware(name="h", memory_bytes=1, devices_per_node=1, intra=link, inter=link)
        >>> layer = lambda name, inputs: LayerCost(name=name, inputs=inputs, micro_batches=(1,), fwd_s=(1.0,),
        ...                                        bwd_s=(1.0,), param_bytes=0, out_bytes=1, stash_bytes=0)
        >>> db = CostDB(model="m", source="hand", input_names=("x",), output="c", hardware=hw,
        ...             layers=(layer("a", ("x",)), layer("b", ("x",)), layer("c", ("a", "b"))))
        >>> StageCostModel(db, 1).stage_order([0b100, 0b010, 0b001])      # c reads b and a
        [2, 1, 0]
        """
        succs = self.stage_successors(masks)
        waiting = {s: 0 for s in succs}
        for s in succs:
            for t in succs[s]:
                waiting[t] += 1
        ready = [(masks[s] & -masks[s], s) for s in succs if not waiting[s]]
        heapq.heapify(ready)
        order = []
        while ready:
            _, s = heapq.heappop(ready)
            order.append(s)
            for t in succs[s]:
                waiting[t] -= 1
                if not waiting[t]:
                    heapq.heappush(ready, (masks[t] & -masks[t], t))
        return order

    def plan_bottleneck(self, stages: Sequence[tuple[int, int]], b: int) -> float:
        """The exact bottleneck time per sample of a plan's ``stages`` (layer masks and degrees) at
        micro-batch ``b``: every stage priced with its own messages, resharding included
        (:meth:`stage_boundaries`), as the simulator prices them."""
        masks, degrees = [m for m, _ in stages], [n for _, n in stages]
        return max(self.time_per_sample(m, b, n, boundary=bd)
                   for m, n, bd in zip(masks, degrees, self.stage_boundaries(masks, degrees)))

    def boundary(self, mask: int, n: int | None = None) -> Boundary:
        """The :class:`Boundary` of layer set ``mask`` as one stage of a stage DAG on ``n`` ranks,
        before its neighbours are placed.

        Bytes received are exact: each outside producer's output once. How many stages send them
        and how many read the stage's outputs depend on how the neighbours are cut, which a search
        does not know yet. The estimate takes neighbours in series (a path between them) to share a
        stage and neighbours in parallel (none) to have stages of their own: one message from each
        outside producer that no other outside producer follows, one to each outside reader that no
        other precedes, and each output sent once to each of its own such readers. That is exact
        for a stage inside a chain, a fork into branches that are stages of their own and a merge
        of them; :func:`plan_boundaries` prices a plan's stages exactly. With ``layer_degrees`` and
        ``n``, each such message is the messages of an edge between the two degrees
        (:func:`reshard_messages`).
        """
        degrees = self.layer_degrees if n is not None else None
        key = ("bnd", mask, n if degrees is not None else None)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        in_b, out_b, senders, receivers = self._neighbours(mask)
        if degrees is None:
            in_m, out_m = len(senders), len(receivers)
        else:
            in_m = sum(reshard_messages(degrees[j], n)[1] for j in senders)
            out_m = sum(reshard_messages(n, degrees[j])[0] for j in receivers)
        hit = self._cache[key] = Boundary(in_b, out_b, in_m if in_b > 0 else 0, out_m if out_b > 0 else 0)
        return hit

    def _neighbours(self, mask: int) -> tuple[float, float, list[int], list[int]]:
        """:meth:`boundary`'s bytes in and out of layer set ``mask``, and the outside layers it
        counts one message from (senders) and to (receivers)."""
        key = ("nbr", mask)
        hit = self._shared.get(key)
        if hit is not None:
            return hit
        layers = self.db.layers
        producers = readers = 0
        out_b = 0.0
        for i in self._members(mask):
            producers |= self.producers[i] & ~mask
            outside = self.consumers[i] & ~mask
            if outside:
                readers |= outside
                out_b += layers[i].out_bytes * len(self._first(outside, self.ancestors))
        in_b = float(sum(layers[j].out_bytes for j in self._members(producers)))
        hit = self._shared[key] = (in_b, out_b, self._first(producers, self.descendants),
                                  self._first(readers, self.ancestors))
        return hit

    def _first(self, group: int, before: list[int]) -> list[int]:
        """Members of ``group`` with no other member in ``before[member]`` (no other member precedes
        it, for ``before = ancestors``; none follows it, for ``descendants``)."""
        return [i for i in self._members(group) if not before[i] & group]

    def chain_boundaries(self, masks: Sequence[int]) -> list[Boundary]:
        """Bytes per sample into and out of each stage of a *chain* pipeline.

        In a linear pipeline (DeepSpeed's ``PipelineEngine``, PipeDream) a tensor that skips
        stages is relayed through every stage in between, so the boundary after stage ``k``
        carries every tensor produced at or before ``k`` and read after it
        (:meth:`cut_bytes` at the stage boundaries).
        """
        order = [i for mask in masks for i in self._members(mask)]
        cut = self.cut_bytes(order)
        at = [0]
        for mask in masks:
            at.append(at[-1] + mask.bit_count())
        return [Boundary.chain(cut[at[k]], cut[at[k + 1]]) for k in range(len(masks))]

    def stage_boundaries(self, masks: Sequence[int], degrees: Sequence[int], *, relay: bool = False) -> list[Boundary]:
        """The exact :class:`Boundary` of every stage of a plan (layer sets ``masks`` on
        ``degrees`` ranks): :func:`plan_boundaries` of the plan's :func:`edge_bytes`, on bitmasks
        (tests hold the two equal). ``relay``: the stages form a chain in list order that relays
        skip tensors (:meth:`chain_boundaries`)."""
        if relay:
            cuts = self.chain_boundaries(masks)
            edges = {(k, k + 1): cuts[k].out_bytes for k in range(len(masks) - 1)}
        else:
            stage_of = {}
            for s, mask in enumerate(masks):
                for i in self._members(mask):
                    stage_of[i] = s
            edges = {}
            for i, s in stage_of.items():
                readers = {stage_of[c] for c in self._members(self.consumers[i])} - {s}
                for t in readers:    # a layer's output is sent once to each stage that reads it
                    edges[(s, t)] = edges.get((s, t), 0.0) + self.db.layers[i].out_bytes
        return plan_boundaries(edges, degrees)

    def cut_bytes(self, order: Sequence[int]) -> list[float]:
        """Bytes per sample crossing each boundary of a linear order of layers (indices into
        ``db.layers``, producers before readers): ``cut[k]`` is what a chain cut before position
        ``k`` relays, every tensor produced before ``k`` and read at or after it, each once
        (``cut[0] = cut[n] = 0``). The one chain kernel: :meth:`chain_boundaries`, PipeDream's
        prefix sums and Piper's relayed boundaries all price these cuts.

        >>> from gpp_deepspeed.planner.costs import CommFit, CostDB, Hardware, LayerCost
        >>> link = CommFit(alpha_s=0.0, beta_s_per_byte=0.0)
        >>> hw = Hardware(name="h", memory_bytes=1, devices_per_node=1, intra=link, inter=link)
        >>> layer = lambda name, inputs, nbytes: LayerCost(name=name, inputs=inputs, micro_batches=(1,), fwd_s=(1.0,),
        ...                                                bwd_s=(1.0,), param_bytes=0, out_bytes=nbytes, stash_bytes=0)
        >>> db = CostDB(model="m", source="hand", input_names=("x",), output="res", hardware=hw,
        ...             layers=(layer("l1", ("x",), 100), layer("l2", ("l1",), 10), layer("res", ("l2", "l1"), 1)))
        >>> StageCostModel(db, 1).cut_bytes([0, 1, 2])
        [0.0, 100.0, 110.0, 0.0]
        """
        pos = {layer: k for k, layer in enumerate(order)}
        # A tensor produced at position p and last read at position q crosses boundaries p+1..q.
        delta = [0.0] * (len(order) + 2)
        for p, layer in enumerate(order):
            readers = [pos[c] for c in self._members(self.consumers[layer]) if c in pos]
            if readers:
                nbytes = self.db.layers[layer].out_bytes
                delta[p + 1] += nbytes
                delta[max(readers) + 1] -= nbytes
        cut, running = [], 0.0
        for k in range(len(order) + 1):
            running += delta[k]
            cut.append(running)
        return cut

    def stage(self, mask: int, b: int, n: int, *, boundary: Boundary | None = None,
              recompute: bool = False, tp: int = 1) -> StageCost:
        """Price layer set ``mask`` as one stage with micro-batch ``b`` on ``n`` devices.

        ``boundary`` gives the stage's messages when its neighbours are known (a plan's,
        :func:`plan_boundaries`; a chain's, :meth:`chain_boundaries`); by default the estimate
        of :meth:`boundary`. ``recompute``: the stage checkpoints its activations, PipeDream-2BW's
        per-stage choice (arXiv 2006.09503, Sec. 3.3): the backward runs the forward again first,
        and a micro-batch in flight stashes only the stage's inputs. ``tp``: the stage's tensor-
        parallel degree (the class docstring), which divides ``n``.
        """
        key = (mask, b, n, boundary, recompute, tp)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        hw = self.db.hardware
        if n % tp:
            raise GPPConfigError(f"a stage on {n} devices cannot run tensor-parallel degree {tp}: it must divide them")
        n //= tp   # from here on, the data-parallel degree
        shard = b / n
        fwd = bwd = grad_in = grad_w = 0.0
        params = stash = largest = split = 0.0
        rows = self._layer_rows(shard)
        for i in self._members(mask):
            f, bw, gi, gw, p, st = rows[i]
            fwd += f / tp
            bwd += bw / tp
            grad_in += gi / tp
            grad_w += gw / tp
            params += p / tp
            stash += st
            largest = max(largest, p / tp)
            if tp > 1 and p > 0:
                split += tensor_parallel_time(hw.ring(tp), tp, self.db.layers[i].out_bytes * shard)
        fwd, bwd, grad_in = fwd + split, bwd + split, grad_in + split
        bd = self.boundary(mask, n) if boundary is None else boundary
        # Activations arrive before the forward and leave after it; gradients mirror them
        # (with a split backward, around I: W talks to no one). Each message keeps the stage busy
        # (CommFit.busy); its time in flight overlaps other work and is the simulator's.
        comm = ((bd.in_messages + bd.out_messages) * self.link.busy_s
                + (bd.in_bytes + bd.out_bytes) * shard * self.link.beta_s_per_byte)
        # The data-parallel group's collectives: once per mini-batch, and under ZeRO-2/3 per
        # micro-batch (the parameter all-gather before F and before I, the gradient reduce-scatter
        # after W; with an unsplit backward B does both of the latter).
        allreduce, ag_fwd, ag_bwd, rs_bwd = (_affine(c, params) for c in zero_collectives(hw.ring(n * tp), n,
                                                                                          zero_stage=self.zero_stage))
        fwd += comm + ag_fwd
        bwd += comm + ag_bwd + rs_bwd
        grad_in += comm + ag_bwd
        grad_w += rs_bwd
        working = 0.0
        if recompute:
            again = sum(rows[i][0] for i in self._members(mask))
            bwd += again
            grad_in += again
            working, stash = stash, bd.in_bytes
        cost = StageCost(fwd_s=fwd, bwd_s=bwd, allreduce_s=allreduce,
                         weight_bytes=weight_state_bytes(params, optimizer_factor=hw.optimizer_factor, num_devices=n,
                                                         zero_stage=self.zero_stage),
                         stash_bytes=stash * shard, bwd_input_s=grad_in, bwd_weight_s=grad_w,
                         working_bytes=working * shard, param_bytes=params,
                         gathered_bytes=largest if self.zero_stage == 3 and n > 1 else 0.0)
        self._cache[key] = cost
        return cost

    def time_per_sample(self, mask: int, b: int, n: int, *, boundary: Boundary | None = None,
                        recompute: bool = False, tp: int = 1) -> float:
        """The stage's seconds per sample: GraphPipe's TPS (Sec. 5, Eq. 1)."""
        c = self.stage(mask, b, n, boundary=boundary, recompute=recompute, tp=tp)
        return (c.fwd_s + c.bwd_s + c.allreduce_s * b / self.mini_batch) / b

    def memory(self, mask: int, b: int, n: int, in_flight: int, *, recompute: bool = False, tp: int = 1) -> float:
        """Peak bytes per device with ``in_flight`` micro-batches stashed (GraphPipe Sec. 3, Eq. 2)."""
        return self.stage(mask, b, n, recompute=recompute, tp=tp).memory(in_flight)

    def fits(self, mask: int, b: int, n: int, in_flight: int, *, recompute: bool = False) -> bool:
        return self.memory(mask, b, n, in_flight, recompute=recompute) <= self.db.hardware.memory_bytes

    def time_per_sample_inference(self, mask: int, b: int, n: int, *, boundary: Boundary | None = None,
                                  tp: int = 1) -> float:
        """A forward-only stage's seconds per sample (EdgePipe's objective, arXiv 2110.14895):
        its forward with the activations in and out; no backward, no all-reduce."""
        return self.stage(mask, b, n, boundary=boundary, tp=tp).fwd_s / b

    def inference_memory(self, mask: int, b: int, n: int, tp: int = 1) -> float:
        """Bytes per device of a forward-only stage: the parameters (no gradients, no optimizer
        state; partitioned under ZeRO-3, which gathers one layer at a time) and one micro-batch's
        activations."""
        c = self.stage(mask, b, n, tp=tp)
        params = weight_state_bytes(c.param_bytes, optimizer_factor=0.0, num_devices=n // tp,
                                    zero_stage=self.zero_stage)
        return params + c.gathered_bytes + c.stash_bytes


def edge_bytes(db: CostDB, stage_of: dict[str, int], *, relay: bool) -> dict[tuple[int, int], float]:
    """Bytes per sample the engine sends on each stage edge ``(src, dst)`` of one micro-batch's
    forward (its gradients return the same bytes).

    The edges are the runtime's own (:func:`~gpp_deepspeed.graph.stages.derive_partition`): along
    the stage DAG each edge carries the outputs of ``src``'s layers that ``dst`` reads; with
    ``relay`` (a chain, as DeepSpeed's ``PipelineEngine`` runs one) edge ``k -> k+1`` carries every
    tensor produced up to stage ``k`` and read after it, relayed tensors included. A layer's
    output counts once per edge it crosses, whichever of its elements are read.
    :meth:`StageCostModel.chain_boundaries` is the bitmask kernel of the ``relay`` case that the
    planners run in their inner loops; tests hold the two equal.

    >>> from gpp_deepspeed.planner.costs import CommFit, CostDB, Hardware, LayerCost
    >>> link = CommFit(alpha_s=0.0, beta_s_per_byte=0.0)
    >>> hw = Hardware(name="h", memory_bytes=1, devices_per_node=1, intra=link, inter=link)
    >>> layer = lambda name, inputs, nbytes: LayerCost(name=name, inputs=inputs, micro_batches=(1,), fwd_s=(1.0,),
    ...                                                bwd_s=(1.0,), param_bytes=0, out_bytes=nbytes, stash_bytes=0)
    >>> db = CostDB(model="m", source="hand", input_names=("x",), output="res", hardware=hw,
    ...             layers=(layer("l1", ("x",), 100), layer("l2", ("l1",), 10), layer("res", ("l2", "l1"), 1)))
    >>> edge_bytes(db, {"l1": 0, "l2": 1, "res": 2}, relay=False)
    {(0, 1): 100.0, (0, 2): 100.0, (1, 2): 10.0}
    >>> edge_bytes(db, {"l1": 0, "l2": 1, "res": 2}, relay=True)
    {(0, 1): 100.0, (1, 2): 110.0}
    """
    partition = derive_partition(db.graph, stage_of, num_stages=max(stage_of.values()) + 1, relay=relay)
    return {(e.src, e.dst): float(sum(db.by_name[n].out_bytes for n in dict.fromkeys(t.node for t in e.tensors)))
            for e in partition.stage_graph.edges}


def allreduce_coefficients(link: CommFit, num_devices: int) -> tuple[float, float]:
    """Latency seconds and seconds per byte of a ring all-reduce among ``num_devices`` devices
    over ``link``: ``2 (n - 1)`` steps, each moving ``1 / n`` of the bytes (a reduce-scatter and an
    all-gather; Patarasuk and Yuan, JPDC 2009, the ring NCCL and gloo run). Vectorised planners
    (PipeDream, Piper) take the coefficients; everything else calls :func:`allreduce_time`.

    >>> allreduce_coefficients(CommFit(alpha_s=1.0, beta_s_per_byte=1.0), 4)
    (6.0, 1.5)
    """
    n = num_devices
    if n < 2:
        return 0.0, 0.0
    return 2 * (n - 1) * link.alpha_s, 2 * (n - 1) / n * link.beta_s_per_byte


def allreduce_time(link: CommFit, num_devices: int, nbytes: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` among ``num_devices`` devices over ``link``
    (:func:`allreduce_coefficients`); nothing to do with one device or no bytes.

    >>> allreduce_time(CommFit(alpha_s=1.0, beta_s_per_byte=1.0), 4, 8.0), allreduce_time(CommFit(alpha_s=1.0, beta_s_per_byte=1.0), 1, 8.0)
    (18.0, 0.0)
    """
    if num_devices < 2 or nbytes <= 0:
        return 0.0
    latency, per_byte = allreduce_coefficients(link, num_devices)
    return latency + per_byte * nbytes


def allgather_coefficients(link: CommFit, num_devices: int) -> tuple[float, float]:
    """Latency seconds and seconds per byte of a ring all-gather of ``nbytes`` in all among
    ``num_devices`` devices over ``link``, and of a ring reduce-scatter (the same steps, the other
    way): ``n - 1`` steps, each moving ``1 / n`` of the bytes (Thakur, Rabenseifner and Gropp,
    "Optimization of Collective Communication Operations in MPICH", IJHPCA 2005, Sec. 4). A ring
    all-reduce is one of each (:func:`allreduce_coefficients`).

    >>> allgather_coefficients(CommFit(alpha_s=1.0, beta_s_per_byte=1.0), 4)
    (3.0, 0.75)
    """
    n = num_devices
    if n < 2:
        return 0.0, 0.0
    return (n - 1) * link.alpha_s, (n - 1) / n * link.beta_s_per_byte


# Megatron's transformer layer all-reduces its activations twice per pass: after the attention's
# row-parallel output projection and after the MLP's (the g operators of Shoeybi et al., Fig. 3);
# the backward mirrors them at the column-parallel inputs (the f operators).
TP_ALLREDUCES_PER_PASS = 2


def tensor_parallel_time(link: CommFit, tp: int, activation_bytes: float) -> float:
    """Seconds one pass (forward, or backward) of one layer spends in its TP group's all-reduces:
    :data:`TP_ALLREDUCES_PER_PASS` ring all-reduces (:func:`allreduce_time`) of the layer's
    activations, ``activation_bytes`` per rank (Megatron-LM, arXiv 1909.08053, Sec. 3; priced from
    the profile's links, as Piper prices a stage's tensor parallelism: Tarnawski et al., NeurIPS 2021,
    Sec. 3, "TMPC" communication). Nothing at ``tp`` 1.

    >>> tensor_parallel_time(CommFit(alpha_s=1.0, beta_s_per_byte=1.0), 2, 8.0)   # 2 * (2 * 1 + 1 * 8)
    20.0
    """
    return TP_ALLREDUCES_PER_PASS * allreduce_time(link, tp, activation_bytes)


def check_zero_stage(zero_stage: int) -> int:
    """``zero_stage`` if it is one of :data:`ZERO_STAGES`; else a :class:`GPPConfigError`."""
    if zero_stage not in ZERO_STAGES:
        raise GPPConfigError(f"ZeRO stage must be one of {list(ZERO_STAGES)} (DeepSpeed's "
                             f'"zero_optimization": {{"stage": ...}}), got {zero_stage!r}')
    return zero_stage


def weight_state_bytes(param_bytes, *, optimizer_factor: float, num_devices, zero_stage: int = 0):
    """Bytes of parameters, gradients and optimizer state that one rank of a stage holds, the
    stage's parameters being ``param_bytes`` in all and its data-parallel group ``num_devices``
    ranks sharing them under ZeRO stage ``zero_stage``. The one memory formula every planner calls;
    numpy arrays broadcast through it.

    ZeRO (Rajbhandari et al., SC 2020, Sec. 5 and Fig. 1) with ``Psi`` parameters, mixed
    precision (2-byte parameters and gradients, ``K = 12`` bytes of fp32 master weights and Adam
    moments per parameter) and ``N_d`` ranks::

        stage 0 (baseline)  (2 + 2 + K) Psi
        stage 1 (P_os)      2 Psi + 2 Psi + K Psi / N_d
        stage 2 (P_os+g)    2 Psi + (2 + K) Psi / N_d
        stage 3 (P_os+g+p)  (2 + 2 + K) Psi / N_d

    Here ``param_bytes`` is ``2 Psi`` (or ``4 Psi`` in fp32) and ``optimizer_factor`` ``f`` is the
    gradient and optimizer bytes per parameter byte (:class:`Hardware`): the gradient is one
    parameter's bytes (``2 Psi``) and the optimizer state the other ``f - 1`` (``K Psi = 6 * 2 Psi``
    mixed, ``f = 7``; fp32 Adam's two moments ``2 * 4 Psi``, ``f = 3``). An optimizer without state
    (``f <= 1``) keeps the gradient only.

    The paper's worked example, 7.5B parameters on ``N_d = 64``: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.

    >>> psi = 7.5e9
    >>> [round(weight_state_bytes(2 * psi, optimizer_factor=7.0, num_devices=64, zero_stage=z) / 1e9, 1)
    ...  for z in ZERO_STAGES]
    [120.0, 31.4, 16.6, 1.9]
    """
    check_zero_stage(zero_stage)
    if zero_stage == 0:
        return param_bytes * (1 + optimizer_factor)
    if zero_stage == 1:
        grads = min(optimizer_factor, 1.0) * param_bytes
        return param_bytes + grads + (param_bytes * optimizer_factor - grads) / num_devices
    if zero_stage == 2:
        return param_bytes + param_bytes * optimizer_factor / num_devices
    return param_bytes * (1 + optimizer_factor) / num_devices


_NO_COLLECTIVE = (0.0, 0.0)


def zero_collectives(link: CommFit, num_devices: int, *, zero_stage: int = 0) -> tuple[tuple[float, float], ...]:
    """The collectives of a stage's data-parallel group of ``num_devices`` ranks under ZeRO stage
    ``zero_stage``, as (latency seconds, seconds per parameter byte) of four parts: once per
    mini-batch, then per micro-batch with its forward, with its backward before the input
    gradients (``I``) and with its backward after the weight gradients (``W``).

    * stages 0 and 1: one ring all-reduce of the gradients per mini-batch (ZeRO-1's reduce-scatter
      of the gradients and all-gather of the updated parameters move the same bytes, ZeRO Sec.
      7.2.1);
    * stage 2: a rank keeps only its partition of the gradients between micro-batches, so each
      micro-batch's gradients are reduce-scattered as its backward makes them (ZeRO Sec. 5.2;
      DeepSpeed's ``DeepSpeedEngine.allreduce_gradients``: "ZeRO stage >= 2 communicates during
      non gradient accumulation boundaries as well", stage 1 only at the boundary), and the
      updated parameters are all-gathered once per mini-batch;
    * stage 3: the parameters are all-gathered before each micro-batch's forward and again before
      its backward, and the gradients reduce-scattered after it (ZeRO Sec. 7.2.2: 1.5 times the
      all-reduce's bytes for one micro-batch); nothing per mini-batch.

    Each all-gather and reduce-scatter costs :func:`allgather_coefficients`, half an all-reduce.

    >>> link = CommFit(alpha_s=1.0, beta_s_per_byte=1.0)
    >>> for z in (1, 2, 3):
    ...     print(zero_collectives(link, 4, zero_stage=z))
    ((6.0, 1.5), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0))
    ((3.0, 0.75), (0.0, 0.0), (0.0, 0.0), (3.0, 0.75))
    ((0.0, 0.0), (3.0, 0.75), (3.0, 0.75), (3.0, 0.75))
    """
    check_zero_stage(zero_stage)
    if zero_stage <= 1:
        return allreduce_coefficients(link, num_devices), _NO_COLLECTIVE, _NO_COLLECTIVE, _NO_COLLECTIVE
    half = allgather_coefficients(link, num_devices)
    if zero_stage == 2:
        return half, _NO_COLLECTIVE, _NO_COLLECTIVE, half
    return _NO_COLLECTIVE, half, half, half


def _affine(coefficients: tuple[float, float], nbytes: float) -> float:
    """Seconds of a collective of ``nbytes`` with these (latency, per byte); nothing without bytes."""
    return 0.0 if nbytes <= 0 else coefficients[0] + coefficients[1] * nbytes


def micro_batch_sizes(mini_batch: int, candidates: Sequence[int] | None = None) -> list[int]:
    """Micro-batch sizes to sweep: powers of two dividing the mini-batch (GraphPipe Sec. 5).

    >>> micro_batch_sizes(48)
    [1, 2, 4, 8, 16]
    """
    if candidates is not None:
        return sorted(b for b in candidates if mini_batch % b == 0)
    return [1 << i for i in range(int(math.log2(mini_batch)) + 1) if mini_batch % (1 << i) == 0]


@lru_cache(maxsize=None)
def reshard_messages(num_src: int, num_dst: int) -> tuple[int, int]:
    """Messages per micro-batch on one edge from a stage of ``num_src`` ranks to one of
    ``num_dst``: the most any producer rank sends and the most any consumer rank receives
    (:func:`~gpp_deepspeed.graph.placement.reshard`, what the engine exchanges).

    >>> reshard_messages(2, 3), reshard_messages(1, 4), reshard_messages(2, 2)
    ((2, 2), (4, 1), (1, 1))
    """
    # Over lcm rows, producer i holds the block [i p, (i + 1) p) and consumer j [j q, (j + 1) q):
    # a block meets every block of the other side that it overlaps, one message each.
    rows = math.lcm(num_src, num_dst)
    p, q = rows // num_src, rows // num_dst
    sends = max(((i + 1) * p - 1) // q - i * p // q + 1 for i in range(num_src))
    recvs = max(((j + 1) * q - 1) // p - j * q // p + 1 for j in range(num_dst))
    return sends, recvs


def plan_boundaries(edges: Mapping[tuple[int, int], float], degrees: Sequence[int]) -> list[Boundary]:
    """Every stage's :class:`Boundary` in a plan: ``edges`` maps each stage edge ``(src, dst)`` to its
    bytes per sample (:func:`edge_bytes`), ``degrees`` gives each stage's ranks. An edge is one
    message per peer rank that holds a rank's rows (:func:`reshard_messages`).

    >>> plan_boundaries({(0, 2): 4.0, (1, 2): 4.0}, [1, 1, 2])   # a fan-in of 2 into a stage of 2 ranks
    [Boundary(in_bytes=0.0, out_bytes=4.0, in_messages=0, out_messages=2), Boundary(in_bytes=0.0, out_bytes=4.0, in_messages=0, out_messages=2), Boundary(in_bytes=8.0, out_bytes=0.0, in_messages=2, out_messages=0)]
    """
    in_b, out_b = [0.0] * len(degrees), [0.0] * len(degrees)
    in_m, out_m = [0] * len(degrees), [0] * len(degrees)
    for (src, dst), nbytes in edges.items():
        if nbytes <= 0:
            continue
        sends, recvs = reshard_messages(degrees[src], degrees[dst])
        out_b[src] += nbytes
        out_m[src] += sends
        in_b[dst] += nbytes
        in_m[dst] += recvs
    return [Boundary(*x) for x in zip(in_b, out_b, in_m, out_m)]
