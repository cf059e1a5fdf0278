"""Our stage DAG against the best chain schedules of torch.distributed.pipelining and DeepSpeed.

Issue 28's benchmark. One launch of 8 gloo ranks per topology trains the same sleeping layers as

* ours: the stage DAG (one layer per stage, one stage per rank) with each synchronous schedule
  (``1f1b``, ``zb1``, ``zb2``) on :class:`GraphPipelineModule` + ``gpp_deepspeed.initialize``, and
  the folded schedules (``interleaved``, ``zbv``, ``dualpipev``) on the DAG of 16 half-layer stages,
  two per rank, on the fold GraphPipe's fold search picks for each
  (:func:`~gpp_deepspeed.planner.fold_search.search_fold`, priced with the same sleeps);
* torch 2.13: the layers as a chain of ``PipelineStage`` s for every schedule of
  ``torch.distributed.pipelining.schedules.get_schedule_class``. The single-stage ones
  (``GPipe``, ``1F1B``) get one layer per rank; the multi-stage ones (``Interleaved1F1B``,
  ``LoopedBFS``, ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``) two stages per rank,
  so the chain has 16 virtual stages of half a layer each (looped placement, or the V for ZB-V and
  DualPipeV);
* DeepSpeed 0.19.8: ``PipelineModule`` + ``PipelineEngine`` (1F1B, one layer per rank) and
  ``DualPipeVModule`` + ``DualPipeVEngine`` (16 half-layer stages in a V), both through
  ``deepspeed.initialize``.

A schedule that torch or DeepSpeed refuses for this setting is a row "refused: <why>", not a gap.

Each layer is the sleeping layer of ``benchmarks/schedules.py``: its forward, input gradient and
weight gradient each sleep their own time (20 ms here), the input-gradient sleep on the path to the
input and the weight-gradient sleep on the path to the weight, so a split backward (torch's
``I``/``W``, our ``zb1``/``zb2``) sleeps each in its own pass. A branch's first layer reads only the
batch and has no input gradient to compute, on the DAG and on the chain alike. On the chain the
activation is one tensor holding every branch side by side: a branch's layer works on its slice
and passes the others on, the merge layer sums the slices.

The engines train in turn, one step each, round after round, so the load of a shared machine falls
on all alike; each row is the median step over the rounds after the first two. Every engine runs
under one garbage-collection regime (:func:`timed_rounds`: the heap frozen, the automatic
collector off, a collection before each step outside its timing). "Peak in flight" is the
most micro-batch activations a rank holds at once (forward run, its ``B`` or ``W`` not yet run), in
units of one layer's activation (a half-layer stage counts a half): ours from the instructions the
engine executed (``engine.last_timeline``), torch's from its schedule's ``pipeline_order``,
DeepSpeed's from its instruction schedule. "Simulated" is our schedule simulator's step for our
programs and for torch's ``pipeline_order`` s, priced with the sleeps; "replayed" the same with each
compute action priced at what it took in the last step (ours from ``engine.last_timeline``,
torch's from its stages' compute calls, :func:`time_torch_compute`), so median over replayed is what
each runtime adds between compute.

    python benchmarks/peers.py            # writes benchmarks/results/peers.{json,md} + docs table
    python benchmarks/peers.py --quick    # 3 rounds: checks that every peer runs (minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from sleeping import sleep_grad

ROOT = Path(__file__).resolve().parent.parent
RANKS, M, DIM, MBS = 8, 16, 16, 2
T_F = T_I = T_W = 0.020
# name -> (layers of each branch, trunk layers); the trunk's first layer merges the branches. A chain
# is one branch into a one-layer trunk. Every topology has 8 layers, one per rank on the DAG.
TOPOLOGIES = {"two_branches": ((4, 2), 2), "four_branches": ((3, 1, 1, 1), 2), "chain": ((7, ), 1)}
TITLES = {"two_branches": "two branches", "four_branches": "four branches", "chain": "chain"}
OURS = ("1f1b", "zb1", "zb2")
OURS_FOLDED = ("interleaved", "zbv", "dualpipev")   # 16 half-layer stages, two per rank
# Also run with every receive completed in place ("early_receives": false), to show in the same
# launch what posting receives early (lowering.post_early) buys.
IN_PLACE = ("1f1b", "dualpipev")
WARM_UP = 2   # rounds left out of the medians: every engine's first steps (ours send every edge's layout)
IN_PLACE_SUFFIX = ", receives in place"
TORCH_V = ("ZBVZeroBubble", "DualPipeV")  # the schedules that place their stages in a V
DEEPSPEED = ("PipelineEngine", "DualPipeVEngine")


def layer_rows(topology: str) -> list[dict]:
    """The topology's layers in chain order: name, inputs (DAG), branch (None in the trunk), merge, source."""
    branches, trunk = TOPOLOGIES[topology]
    rows = []
    for b, length in enumerate(branches):
        rows += [dict(name=f"b{b}_{i}", inputs=[f"b{b}_{i - 1}" if i else f"x{b}"], branch=b, merge=False,
                      source=i == 0) for i in range(length)]
    tails = [f"b{b}_{length - 1}" for b, length in enumerate(branches)]
    rows += [dict(name=f"t{i}", inputs=tails if i == 0 else [f"t{i - 1}"], branch=None, merge=i == 0, source=False)
             for i in range(trunk)]
    return rows


def chain_units(topology: str, per_layer: int) -> list[tuple]:
    """Constructor arguments of the chain's stages, ``per_layer`` stages (a fraction each) per layer."""
    num_branches = len(TOPOLOGIES[topology][0])
    return [(DIM, num_branches, row["branch"], row["merge"] and part == 0, 1 / per_layer, row["source"], True)
            for row in layer_rows(topology) for part in range(per_layer)]


def sleep_unit_class():
    """``SleepUnit(dim, branches, branch, merge, fraction, source, chain)``: ``fraction`` of a layer
    ``y = x + w`` sleeping ``T_F`` forward, ``T_I`` on the ``dx`` path (none for a source) and
    ``T_W`` on the ``dw`` path. On the DAG it sums its inputs; on the chain it reads and writes its
    branch's slice of the side-by-side activation (the merge sums the slices first)."""
    import torch
    from torch import nn

    SleepGrad = sleep_grad()

    class SleepUnit(nn.Module):
        def __init__(self, dim, branches, branch, merge, fraction, source, chain):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(dim))
            self.branches, self.branch, self.merge, self.chain = branches, branch, merge, chain
            self.t_f, self.t_i, self.t_w = T_F * fraction, 0.0 if source else T_I * fraction, T_W * fraction

        def layer(self, x):
            time.sleep(self.t_f)
            return SleepGrad.apply(x, self.t_i) + SleepGrad.apply(self.weight, self.t_w)

        def forward(self, *xs):
            if not self.chain:
                return self.layer(xs[0] if len(xs) == 1 else sum(xs))
            x, = xs
            if self.merge:
                return self.layer(sum(x.chunk(self.branches, dim=1)))
            if self.branch is None:
                return self.layer(x)
            parts = list(x.chunk(self.branches, dim=1))
            parts[self.branch] = self.layer(parts[self.branch])
            return torch.cat(parts, dim=1)

    return SleepUnit


# --------------------------------------------------------------------------------------------- ours

def half_layer_rows(topology: str) -> list[dict]:
    """The topology's layers cut in two half-layer stages each (as torch's 16 virtual stages): the
    first half reads the layer's inputs and merges, the second reads the first."""
    rows = []
    for r in layer_rows(topology):
        rows.append({**r, "name": r["name"] + "_a"})
        rows.append({**r, "name": r["name"] + "_b", "inputs": [r["name"] + "_a"], "merge": False})
    names = {r["name"][:-2] for r in rows}
    for r in rows:   # a layer's successors read its second half
        r["inputs"] = [x + "_b" if x in names and not r["name"].startswith(x + "_") else x for x in r["inputs"]]
    return rows


def half_stage_graph(topology: str):
    """The stage graph of :func:`half_layer_rows`, one half-layer per stage, in their order."""
    from gpp_deepspeed.graph.stages import StageEdge, StageGraph

    rows = half_layer_rows(topology)
    index = {r["name"]: i for i, r in enumerate(rows)}
    edges = tuple(StageEdge(index[x], i, ()) for i, r in enumerate(rows) for x in r["inputs"] if x in index)
    loading = frozenset(i for i, r in enumerate(rows) if any(x not in index for x in r["inputs"]))
    return StageGraph(num_stages=len(rows), edges=edges, output_stage=len(rows) - 1, loading=loading)


def layer_sleep(kind, fraction: float, source: bool) -> float:
    """What a sleeping unit of ``fraction`` of a layer sleeps in an action of ``kind``: its share of
    ``T_F``, ``T_I``, ``T_W`` (``B`` is ``I`` and ``W``), no input gradient on a ``source`` (any part
    of a branch's first layer, its second half too, so that a layer's parts add up to the layer);
    nothing for the other kinds."""
    from gpp_deepspeed.schedule import ActionKind as K

    t_i = 0.0 if source else T_I
    return {K.FORWARD: T_F, K.BACKWARD: t_i + T_W, K.BACKWARD_INPUT: t_i, K.BACKWARD_WEIGHT: T_W}.get(kind, 0.0) * fraction


def sleeps(topology: str, folded: bool):
    """Each action's sleep on the topology's stages (half-layer ones if ``folded``), as
    :func:`layer_sleep` says."""
    rows, fraction = (half_layer_rows(topology), 0.5) if folded else (layer_rows(topology), 1.0)
    return lambda a: layer_sleep(a.kind, fraction, rows[a.stage_idx]["source"])


def stage_times(topology: str, num_stages: int, folded: bool) -> list[list[float]]:
    """Each stage's ``[F, B, I, W]`` sleeps (``graph_pipeline.stage_times``)."""
    from gpp_deepspeed.schedule import Action, ActionKind as K

    duration = sleeps(topology, folded)
    return [[duration(Action(s, k, 0)) for k in (K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT)]
            for s in range(num_stages)]


def searched_fold(topology: str, name: str):
    """What GraphPipe's fold search picks for folded schedule ``name`` (same on every rank): a
    ``FoldChoice``, its fold and the caps of micro-batches in flight its order was made under."""
    from gpp_deepspeed.planner.fold_search import search_fold

    graph = half_stage_graph(topology)
    return search_fold(graph, M, num_ranks=RANKS, duration=sleeps(topology, True), schedules=(name, ),
                       activation={s: 0.5 for s in range(graph.num_stages)})


def build_ours(topology: str, unit, data, *, config: dict | None = None):
    """Our engine on the stage DAG, one engine per schedule: name -> (step, engine). The folded
    schedules run the DAG of half-layer stages on the fold the search picks. ``config`` adds to
    each engine's DeepSpeed config (its ``graph_pipeline`` keys to that section)."""
    from torch import nn
    import gpp_deepspeed
    from gpp_deepspeed import GraphLayerSpec, GraphPipelineModule

    num_branches = len(TOPOLOGIES[topology][0])
    built = {}
    for name in OURS + OURS_FOLDED + tuple(n + IN_PLACE_SUFFIX for n in IN_PLACE):
        schedule, early = variant(name)
        folded = schedule in OURS_FOLDED
        rows, fraction = (half_layer_rows(topology), 0.5) if folded else (layer_rows(topology), 1.0)
        layers = [GraphLayerSpec(r["name"], unit, DIM, num_branches, r["branch"], r["merge"], fraction, r["source"],
                                 False, inputs=r["inputs"]) for r in rows]
        choice = searched_fold(topology, schedule) if folded else None
        extra = {"fold": list(choice.fold.rank_of)} if folded else {}
        # The times and caps the fold's order is made for, as a plan brings them (``gpp plan``): the
        # layers' sleeps, the caps the search chose (when not the schedule's own).
        times = {"stage_times": stage_times(topology, len(rows), folded)} if folded else {}
        if folded and choice.max_in_flight:
            times["max_in_flight"] = list(choice.max_in_flight)
        module = GraphPipelineModule(layers, input_names=[f"x{b}" for b in range(num_branches)], num_stages=len(rows),
                                     loss_fn=nn.MSELoss(), partition_method={r["name"]: i for i, r in enumerate(rows)},
                                     **extra)
        added = dict(config or {})
        cfg = _ds_config() | added | {"graph_pipeline": {"schedule": schedule, "print_stage_graph": False,
                                                          "print_idle_fractions": False, "early_receives": early,
                                                          **times, **added.get("graph_pipeline", {})}}
        engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
        built[name] = (lambda engine=engine: engine.train_batch(data_iter=iter(data)), engine)
    return built


def variant(name: str) -> tuple[str, bool]:
    """The schedule a name of ours runs, and whether its receives are posted early."""
    return (name[:-len(IN_PLACE_SUFFIX)], False) if name.endswith(IN_PLACE_SUFFIX) else (name, True)


def ours_in_flight(engine) -> list[float]:
    """Every rank's peak in-flight micro-batches in the engine's last batch, in layers (a half-layer
    stage of a folded schedule counts a half)."""
    import torch
    from gpp_deepspeed.schedule import peak_in_flight

    timeline = [a for a, _, _ in engine.last_timeline]
    stages = sorted({a.stage_idx for a in timeline})
    weight = 0.5 if engine.placement.fold else 1.0
    peak = weight * peak_in_flight(timeline) if len(stages) == 1 else weight * _rank_peak(timeline)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, peak)
    return gathered


def _rank_peak(actions) -> float:
    from gpp_deepspeed.schedule.virtual import rank_peak

    return rank_peak([a for a in actions if a.kind.value in ("F", "B", "I", "W")], None)


def predicted(engine, name: str, topology: str) -> float:
    """Our simulator's makespan for the program the engine runs (a steady batch's) on ``topology``,
    priced with the sleeps its layers sleep; ``name`` is kept for the callers' symmetry."""
    return _simulated(engine, sleeps(topology, bool(engine.placement.fold)))


def replayed(engine, name: str) -> float:
    """Our simulator's makespan for the program the engine ran, each compute action priced at what
    it took in the engine's last batch (a sleep overshooting on a loaded machine, the layer's own
    Python), messages and everything else free: the step the runtime would give if it added nothing
    between compute. Measured over replayed is what the runtime itself adds."""
    import torch
    from gpp_deepspeed.schedule.ir import ActionKind

    took = {(a.stage_idx, a.kind.value, a.mb_idx): end - start for a, start, end in engine.last_timeline
            if a.kind is ActionKind.FORWARD or a.kind.spec.backward}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, took)
    took = {k: v for part in gathered for k, v in part.items()}
    return _simulated(engine, lambda a: took.get((a.stage_idx, a.kind.value, a.mb_idx), 0.0))


def _simulated(engine, duration) -> float:
    """Our simulator's makespan for the steady program the engine runs, priced by ``duration``."""
    from gpp_deepspeed.schedule import simulate

    fold = engine.placement.fold
    return simulate(engine.program(M, train=True).actions, duration=duration, rank_of=fold or None).makespan


# -------------------------------------------------------------------------------------------- torch

def torch_schedule_names() -> list[str]:
    """Every name torch 2.13's ``get_schedule_class`` knows."""
    from torch.distributed.pipelining import schedules

    try:
        schedules.get_schedule_class("?")
    except ValueError as e:  # the message lists the valid names
        return json.loads(str(e).split("options are ")[1].replace("'", '"'))
    raise AssertionError("get_schedule_class accepted '?'")


def build_torch(topology: str, name: str, unit, batch, *, took: dict | None = None):
    """One torch schedule over the chain, its stages mapped over the launch's ranks: (step,
    pipeline_order, layers per stage). With ``took`` (a dict, :func:`time_torch_compute`
    installed), each step leaves in it what each of its compute calls took on this rank."""
    import inspect
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    cls = schedules.get_schedule_class(name)
    if inspect.isabstract(cls) or cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        raise RefusedError(f"`{cls.__name__}` is a base class: it runs an action list the user writes "
                           "(no schedule of its own)")
    multi = issubclass(cls, schedules.PipelineScheduleMulti)
    units = chain_units(topology, 2 if multi else 1)
    mapping = generate_stage_to_rank_mapping(torch.distributed.get_world_size(), len(units),
                                             style="v" if name in TORCH_V else "loop")
    rank = torch.distributed.get_rank()
    mine = [s for s in range(len(units)) if mapping[s] == rank]
    stages = [PipelineStage(unit(*units[s]), s, len(units), torch.device("cpu")) for s in mine]
    schedule = cls(stages if multi else stages[0], M, loss_fn=nn.MSELoss())
    params = [p for st in stages for p in st.submod.parameters()]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    x, y = batch
    args = (x, ) if 0 in mine else ()
    target = y if len(units) - 1 in mine else None

    def step():
        _TORCH_CALLS.clear()
        schedule.step(*args, target=target)
        optimizer.step()
        optimizer.zero_grad()
        if took is not None:
            took.clear()
            took.update(((s, kind, mb), seconds) for s, kind, mb, seconds in _TORCH_CALLS)

    return step, schedule.pipeline_order, 1 / (2 if multi else 1)


_TORCH_CALLS: list[tuple[int, str, int, float]] = []   # this rank's torch compute calls since its last step began


def time_torch_compute() -> None:
    """Record in ``_TORCH_CALLS`` what every compute call of torch's pipeline stages takes, as our
    engine records its compute actions (``last_timeline``): ``forward_one_chunk`` (``F``, with the
    schedule's ``_maybe_compute_loss`` after it, which ours computes inside the last stage's
    forward), ``backward_one_chunk`` (``B``, or ``I`` with ``full_backward=False``) and
    ``backward_weight_one_chunk`` (``W``); a perf_counter pair each, as ours. Installed once per
    process, before the schedules run; the runtime around them (waits, sends, its bookkeeping) is
    what torch's replayed step leaves out."""
    from torch.distributed.pipelining import schedules, stage

    base = stage._PipelineStageBase
    if getattr(base, "_gpp_timed", False):
        return

    def timed(method, kind):
        def run(self, chunk, *args, **kwargs):
            start = time.perf_counter()
            out = method(self, chunk, *args, **kwargs)
            _TORCH_CALLS.append((self.stage_index, kind(args, kwargs), chunk, time.perf_counter() - start))
            return out
        return run

    # backward_one_chunk(chunk, loss=None, full_backward=True, last_backward=False)
    full = lambda args, kwargs: kwargs.get("full_backward", args[1] if len(args) > 1 else True)  # noqa: E731
    base.forward_one_chunk = timed(base.forward_one_chunk, lambda *_: "F")
    base.backward_one_chunk = timed(base.backward_one_chunk, lambda a, k: "B" if full(a, k) else "I")
    base.backward_weight_one_chunk = timed(base.backward_weight_one_chunk, lambda *_: "W")
    compute_loss = schedules._PipelineSchedule._maybe_compute_loss

    def with_loss(self, stage_, output, target_mbs, mb_index, *args, **kwargs):
        start = time.perf_counter()
        compute_loss(self, stage_, output, target_mbs, mb_index, *args, **kwargs)
        if _TORCH_CALLS and _TORCH_CALLS[-1][:3] == (stage_.stage_index, "F", mb_index):
            s, kind, mb, seconds = _TORCH_CALLS[-1]
            _TORCH_CALLS[-1] = (s, kind, mb, seconds + time.perf_counter() - start)

    schedules._PipelineSchedule._maybe_compute_loss = with_loss
    base._gpp_timed = True


def torch_predicted(topology: str, order, per_layer: int) -> float | None:
    """Our simulator's step for a torch schedule's action lists (its ``pipeline_order``, overlapped
    pairs taken apart) on the chain of ``per_layer`` stages a layer, priced with the sleeps of
    those stages, messages free: the step torch's runtime would give if it added nothing."""
    units = chain_units(topology, per_layer)
    return _torch_simulated(order, len(units), lambda a: layer_sleep(a.kind, *units[a.stage_idx][4:6]))


def torch_replayed(topology: str, order, per_layer: int, took: dict) -> float | None:
    """:func:`torch_predicted` with each compute action priced at what it took in the schedule's
    last step (``took``: this rank's, from :func:`build_torch`; gathered over the ranks here, so
    every rank calls it), as :func:`replayed` prices ours: measured over it is what torch's runtime
    adds between compute."""
    import torch

    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, took)
    every = {k: v for part in gathered for k, v in part.items()}
    if not every:   # nothing timed (time_torch_compute not installed): no replayed step, not a zero one
        return None
    return _torch_simulated(order, len(chain_units(topology, per_layer)),
                            lambda a: every.get((a.stage_idx, a.kind.value, a.mb_idx), 0.0))


def _torch_simulated(order, num_stages: int, duration) -> float | None:
    """Our simulator's makespan for torch's ``order`` on a chain of ``num_stages`` stages, compute
    priced by ``duration``."""
    from gpp_deepspeed.errors import ScheduleError
    from gpp_deepspeed.graph.stages import StageGraph
    from gpp_deepspeed.schedule import Action, ActionKind as K
    from gpp_deepspeed.schedule.virtual import rank_makespan

    kind = {"F": K.FORWARD, "I": K.BACKWARD_INPUT, "W": K.BACKWARD_WEIGHT, "B": K.BACKWARD}
    orders = {rank: [Action(a.stage_index, kind[a.computation_type.value], a.microbatch_index)
                     for action in actions if action is not None for a in (action.sub_actions or (action, ))
                     if a.computation_type.value in kind]   # compute only (not REDUCE_GRAD, UNSHARD, ...)
              for rank, actions in order.items()}
    try:
        return rank_makespan(orders, StageGraph.chain(num_stages), duration)
    except ScheduleError:   # torch 2.13's Schedule1F1B.pipeline_order skips micro-batch 0 on the last rank
        return None         # (its IR only; the runtime runs it): no simulated step for that order


def torch_in_flight(order, fraction: float) -> list[float]:
    """Every rank's peak held activations in torch's action lists (``I`` keeps them for its ``W``)."""
    peaks = []
    for rank in sorted(order):
        live = peak = 0.0
        for action in order[rank]:
            for a in (action.sub_actions or (action, )) if action is not None else ():
                kind = a.computation_type.value
                live += fraction if kind == "F" else -fraction if kind in ("B", "W") else 0.0
                peak = max(peak, live)
        peaks.append(peak)
    return peaks


# ---------------------------------------------------------------------------------------- deepspeed

def build_deepspeed(topology: str, name: str, unit, data):
    """DeepSpeed's PipelineEngine (one layer per rank) or DualPipeVEngine (two half-layer stages per rank)."""
    from torch import nn
    import deepspeed
    from deepspeed.pipe import DualPipeVModule, LayerSpec, PipelineModule

    dual = name == "DualPipeVEngine"
    layers = [LayerSpec(unit, *args) for args in chain_units(topology, 2 if dual else 1)]
    module = (DualPipeVModule if dual else PipelineModule)(layers, num_stages=RANKS, loss_fn=nn.MSELoss(),
                                                           partition_method="uniform")
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=_ds_config())
    return lambda: engine.train_batch(data_iter=iter(data))


def deepspeed_in_flight(name: str) -> list[float]:
    """Every rank's peak held activations in DeepSpeed's instruction schedule (its backward is whole)."""
    from deepspeed.runtime.pipe import schedule as ds

    dual = name == "DualPipeVEngine"
    peaks = []
    for rank in range(RANKS):
        sched = (ds.DualPipeVSchedule if dual else ds.TrainSchedule)(micro_batches=M, stages=RANKS, stage_id=rank)
        live = peak = 0.0
        for cmd in (c for cmds in sched.steps() for c in cmds):
            step = isinstance(cmd, ds.ForwardPass) - isinstance(cmd, ds.BackwardPass)
            live += step * (0.5 if dual else 1.0)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def _ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": M, "steps_per_print": 10**6,
            "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}}


# ------------------------------------------------------------------------------------------- worker

class RefusedError(Exception):
    """A peer that does not apply to this setting (said as the reason in the table)."""


def _attempt(build):
    """``build()`` on every rank; (result, None) where all ranks built, else (None, the first rank's reason)."""
    import torch

    try:
        result, reason = build(), None
    except Exception as e:  # a peer's refusal: recorded in the table, not raised
        result, reason = None, str(e) if isinstance(e, RefusedError) else f"{type(e).__name__}: {e}".split("\n")[0]
        if not isinstance(e, RefusedError):
            traceback.print_exc()
    reasons = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(reasons, reason)
    reason = next((r for r in reasons if r is not None), None)
    return (None, reason) if reason is not None else (result, None)


def batches(num_branches: int):
    """The launch's data, seeded alike on every rank: ``M`` DAG micro-batches (one input per branch,
    a target), the same as chain micro-batches (the inputs side by side) and as one chain batch
    (torch's schedules split it)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    sample = lambda: torch.randn(MBS, DIM, generator=gen)  # noqa: E731
    dag = [(tuple(sample() for _ in range(num_branches)), sample()) for _ in range(M)]
    chain = [(torch.cat(x, dim=1), y) for x, y in dag]
    return dag, chain, (torch.cat([x for x, _ in chain]), torch.cat([y for _, y in chain]))


def build_all(topology: str):
    """Every configuration of the launch: label -> (step or None, metadata with in-flight or the refusal)."""
    unit = sleep_unit_class()
    dag_data, chain_data, batch = batches(len(TOPOLOGIES[topology][0]))
    configs = {}
    for name, (step, engine) in build_ours(topology, unit, dag_data).items():
        configs[f"ours/{name}"] = (step, {"engine": engine})
    time_torch_compute()
    for name in torch_schedule_names():
        took = {}
        built, reason = _attempt(lambda: build_torch(topology, name, unit, batch, took=took))
        meta = {"refused": reason} if reason else {"in_flight": torch_in_flight(built[1], built[2]),
                                                   "predicted": torch_predicted(topology, built[1], round(1 / built[2])),
                                                   "replay": (built[1], round(1 / built[2]), took)}
        configs[f"torch/{name}"] = (built and built[0], meta)
    for name in DEEPSPEED:
        step, reason = _attempt(lambda: build_deepspeed(topology, name, unit, chain_data))
        meta = {"refused": reason} if reason else {"in_flight": deepspeed_in_flight(name)}
        configs[f"deepspeed/{name}"] = (step, meta)
    return configs


def timed_rounds(steps: dict, rounds: int, *, report: bool = False, cpu: dict | None = None,
                 alternate: bool = False) -> dict[str, list[float]]:
    """Each of ``steps`` (label -> a step on every rank) once per round, in turn, for ``rounds``
    rounds: label -> each round's step in seconds, fenced by barriers so every rank starts
    together and the slowest one's finish ends it. ``alternate``: every other round runs them in
    the reverse order (an A/B of two steps, so neither always follows the other). ``report``: rank
    0 prints each round. ``cpu``
    (a dict): filled with label -> each round's CPU seconds on this rank inside the step, as
    ``(main thread, whole process)`` (the process's also counts gloo's and the watchdog's threads).

    Every engine runs under one garbage-collection regime, as a torchtitan or Megatron-LM user
    runs theirs: the heap built so far frozen (``gc.freeze()``), the automatic collector off, and a
    collection on every rank before each step, outside the timed span. Left to Python, a full
    collection (0.2-0.3 s here) falls inside some engine's step on one rank, where all its ranks
    wait for it, in whichever rounds the allocations cross its threshold
    (``gpp_deepspeed.engine.collector``): a timing of where the collector ran, not of the runtime."""
    import gc
    import torch

    times = {label: [] for label in steps}
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        for r in range(rounds):
            for label, step in (reversed(steps.items()) if alternate and r % 2 else steps.items()):
                gc.collect()
                torch.distributed.barrier()
                start, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
                step()
                spent = (time.thread_time() - thread, time.process_time() - process)
                torch.distributed.barrier()
                times[label].append(time.perf_counter() - start)
                if cpu is not None:
                    cpu.setdefault(label, []).append(spent)
            if report and torch.distributed.get_rank() == 0:
                print(f"round {r}: " + " ".join(f"{k}={v[-1] * 1e3:.0f}" for k, v in times.items()), flush=True)
    finally:
        gc.enable()
    return times


def worker(topology: str, rounds: int, out: str) -> None:
    import torch
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    configs = build_all(topology)
    spent = {}
    times = timed_rounds({label: step for label, (step, _) in configs.items() if step is not None}, rounds,
                         report=True, cpu=spent)
    # Each rank's median CPU a step, main thread and whole process, over the rounds the medians use.
    mine = {label: [statistics.median(x[i] for x in per_round[WARM_UP:] or per_round) for i in (0, 1)]
            for label, per_round in spent.items()}
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    results = {}
    for label, (step, meta) in configs.items():
        engine = meta.pop("engine", None)
        if engine is not None:  # ours: from the instructions it ran, and the simulator
            meta["in_flight"] = ours_in_flight(engine)
            meta["predicted"] = predicted(engine, label.split("/")[1], topology)
            meta["replayed"] = replayed(engine, label.split("/")[1])
            meta["fold"] = list(engine.placement.fold)
            meta["depth"] = engine.stage_graph.pipeline_depth
        if "replay" in meta:  # torch's: its last step's compute calls, priced on its own order
            order, per_layer, took = meta.pop("replay")
            meta["replayed"] = torch_replayed(topology, order, per_layer, took)
        if label in mine:
            meta["cpu_s"] = [rank_cpu[label] for rank_cpu in every]
        results[label] = {**meta, "times": times.get(label)}
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description="our stage DAG against torch's and DeepSpeed's chain schedules")
    parser.add_argument("--rounds", type=int, default=8, help="rounds (one step of every engine each)")
    parser.add_argument("--quick", action="store_true", help="3 rounds: a check that every peer runs")
    parser.add_argument("--topologies", default=",".join(TOPOLOGIES))
    parser.add_argument("--table-only", action="store_true", help="rewrite the table from results/peers.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    if args.worker:
        return worker(args.worker, rounds, args.out)
    path = ROOT / "benchmarks" / "results" / "peers.json"
    if args.table_only:
        saved = json.loads(path.read_text())
        return write_table(saved["results"], saved["rounds"], saved.get("load_average", {}))
    sys.path.insert(0, str(ROOT / "tests"))
    from dist import launch

    tmp = ROOT / "benchmarks" / "results" / "tmp"
    results, loads = {}, {}
    for topology in args.topologies.split(","):
        out = tmp / f"peers_{topology}.json"
        start, load = time.monotonic(), os.getloadavg()[0]
        # A round is ~12 steps of 2-4 s; starting 8 ranks and building 12 engines takes minutes on 2 cores.
        res = launch(RANKS, Path(__file__), "--worker", topology, "--rounds", str(rounds), "--out", str(out),
                     timeout=900 + 120 * rounds, log_dir=tmp / "logs" / f"peers_{topology}")
        if not res.ok:
            raise SystemExit(f"{topology} failed:\n{res.report()}")
        results[topology] = json.loads(out.read_text())
        loads[topology] = (load, os.getloadavg()[0])
        for label, r in results[topology].items():
            if r.get("times"):
                r["median_s"] = statistics.median(r["times"][WARM_UP:] or r["times"])
            print(f"{topology:14s} {label:32s} " + (f"refused: {r['refused']}" if "refused" in r else
                  f"median {r['median_s'] * 1e3:7.1f} ms  peak in flight {max(r['in_flight'])}"), flush=True)
        print(f"{topology}: {time.monotonic() - start:.0f} s", flush=True)
    path.write_text(json.dumps({"rounds": rounds, "load_average": loads, "results": results}, indent=1))
    write_table(results, rounds, loads)


def _fmt(x: float) -> str:
    return f"{x:g}" if x != int(x) else str(int(x))


def _best(by_label: dict, system: str) -> tuple[str, dict] | None:
    ran = [(label, r) for label, r in by_label.items() if label.startswith(system + "/") and "median_s" in r]
    return min(ran, key=lambda lr: lr[1]["median_s"]) if ran else None


def summary_rows(results: dict) -> list[str]:
    """Per topology: each system's best, and our best over the best peer (below 1: we are faster)."""
    rows = ["| model | DAG depth (chain) | ours: best | torch: best chain schedule | DeepSpeed: best "
            "| our best / best peer | ours at <= the best peer's peak in flight / best peer |",
            "|---|---|---|---|---|---|---|"]
    for topology, by_label in results.items():
        best = {s: _best(by_label, s) for s in ("ours", "torch", "deepspeed")}
        cell = {s: f"`{b[0].split('/')[1]}` {b[1]['median_s'] * 1e3:,.0f} ms (peak {_fmt(max(b[1]['in_flight']))})"
                if b else "none ran" for s, b in best.items()}
        peers = [b for s, b in best.items() if s != "ours" and b]
        ratio = lean = "n/a"
        if best["ours"] and peers:
            peer = min(peers, key=lambda lr: lr[1]["median_s"])
            ratio = f"{best['ours'][1]['median_s'] / peer[1]['median_s']:.3f}"
            cap = max(peer[1]["in_flight"])
            within = [r for label, r in by_label.items()
                      if label.startswith("ours/") and "median_s" in r and max(r["in_flight"]) <= cap]
            lean = f"{min(r['median_s'] for r in within) / peer[1]['median_s']:.3f}" if within else "none within"
        depth = next(r["depth"] for label, r in by_label.items() if label.startswith("ours/") and "depth" in r)
        rows.append(f"| {TITLES.get(topology, topology)} | {depth} ({RANKS}) | {cell['ours']} | {cell['torch']} "
                    f"| {cell['deepspeed']} | {ratio} | {lean} |")
    return rows


def detail_rows(results: dict) -> list[str]:
    rows = ["| model | system | schedule | stages per rank | median step (ms) | best step (ms) | simulated (ms) "
            "| median / simulated | replayed (ms) | median / replayed | peak in flight, max over ranks | per rank "
            "| CPU a step, main thread (ms) | CPU a step, process (ms) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    multi = {"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "DualPipeVEngine",
             *OURS_FOLDED}
    for topology, by_label in results.items():
        for label, r in by_label.items():
            system, name = label.split("/")
            per_rank = "-" if "refused" in r else 2 if variant(name)[0] in multi else 1
            head = f"| {TITLES.get(topology, topology)} | {system} | `{name}` | {per_rank} |"
            if "refused" in r:
                rows.append(f"{head} refused: {r['refused'].replace('|', '/')} | | | | | | | | | |")
                continue
            sim = r.get("predicted")
            simulated = f"{sim * 1e3:,.0f} | {r['median_s'] / sim:.3f}" if sim else " | "
            rep = r.get("replayed")
            simulated += f" | {rep * 1e3:,.0f} | {r['median_s'] / rep:.3f}" if rep else " | | "
            rows.append(f"{head} {r['median_s'] * 1e3:,.0f} | {min(r['times'][WARM_UP:] or r['times']) * 1e3:,.0f} | "
                        f"{simulated} | "
                        f"{_fmt(max(r['in_flight']))} | {' '.join(map(_fmt, r['in_flight']))} | {_cpu(r, 0)} | {_cpu(r, 1)} |")
    return rows


def _cpu(r: dict, which: int) -> str:
    """A row's CPU a step (``which`` 0: main thread, 1: whole process), the mean over ranks in ms
    (blank for a run from before the column)."""
    per_rank = [c[which] for c in r.get("cpu_s", [])]
    return f"{statistics.mean(per_rank) * 1e3:,.0f}" if per_rank else ""


def write_table(results: dict, rounds: int, loads: dict) -> None:
    short = rounds < 6
    load = "; ".join(f"{TITLES.get(t, t)} {a:.1f} and {b:.1f}" for t, (a, b) in loads.items())
    load = f" One-minute load average at the start and end of each launch: {load}." if loads else ""
    text = ("## Against the best chain schedules (peers.py)\n\n"
            "`python benchmarks/peers.py` (issue 28). " +
            (f"**Noisy machine, short run ({rounds} rounds, other jobs running beside it): the numbers only "
             "show that every peer runs; the quiet-machine run (`python benchmarks/peers.py`) replaces them.** "
             if short else "") +
            f"{RANKS} gloo ranks, {M} micro-batches, sleeping layers (forward, input gradient and weight gradient "
            f"{T_F * 1e3:.0f} ms each; a branch's first layer has no input gradient). One launch per model trains "
            "every configuration in turn, one step each, round after round; each figure is the median step of "
            f"rounds {WARM_UP + 1}..{rounds} (the first two warm every engine up: ours send every edge's layout "
            "in their first batch). Every engine runs under one garbage-collection regime, as torchtitan's and "
            "Megatron-LM's users run theirs: the start-up heap frozen, Python's automatic collector off, a "
            "collection on every rank before each step, outside its timing (a full collection inside a "
            "step costs 0.2-0.3 s on one rank, which all its ranks wait for). Ours runs the stage DAG (one layer per stage and rank); torch "
            "(`torch.distributed.pipelining`, 2.13) and DeepSpeed (0.19.8) run the same layers as a chain: one "
            "layer per rank for single-stage schedules, two half-layer stages per rank for the multi-stage ones "
            "(looped placement, a V for `ZBVZeroBubble` and both DualPipeVs). \"Peak in flight\" is the most "
            "micro-batch activations a rank holds at once, in units of one layer's (a half-layer stage counts "
            "a half): ours from the instructions the engine ran, torch's from its schedule's `pipeline_order`, "
            "DeepSpeed's from its instruction schedule. \"Simulated\" is our schedule simulator's step for the "
            "same sleeps, for torch's schedules of their `pipeline_order` (free messages, each rank's own "
            "stages handing over locally), so median over simulated compares the two runtimes; \"replayed\" is the same simulation with each compute action priced at what it took in "
            "the run (its sleep overshooting on a loaded machine, the layer's own Python), messages free: median "
            "over replayed is what the runtime adds beyond compute (torch's: each stage's `forward_one_chunk` "
            "with the loss after it, `backward_one_chunk` and `backward_weight_one_chunk` timed as ours times "
            "its compute actions, on the schedule's `pipeline_order`). \"CPU a step\" is the CPU time a rank spends "
            "inside the step (the sleeps spend none), the mean over ranks of each rank's median: the main "
            "thread's (the runtime's Python, the layers' own, posting messages) and the whole process's (gloo's "
            "threads and the watchdog's too). Ours also runs `1f1b` and `dualpipev` with "
            "every receive completed in place (`early_receives` false, the transport before issue 28's early "
            f"receives), in the same launch. A ratio below 1 means ours is faster.{load}\n\n"
            + "\n".join(summary_rows(results)) + "\n\n" + "\n".join(detail_rows(results)) + "\n")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report

    if report.notes("peers"):
        text += "\n" + report.notes("peers")
    (ROOT / "benchmarks" / "results" / "peers.md").write_text(text)
    report.main()


if __name__ == "__main__":
    main()
