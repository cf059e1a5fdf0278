"""Predicting a plan's iteration by running the engine's own instruction lists.

The plan's stage graph is lowered into a :class:`~gpp_deepspeed.schedule.Program`, the very
program :class:`~gpp_deepspeed.engine.GraphPipelineEngine` executes, and run through the
schedule simulator (:func:`~gpp_deepspeed.schedule.simulate`) with each action priced by the
shared stage cost model: ``F`` and ``B`` take the stage's forward and backward time (compute
plus the time its messages keep it busy), ``I`` and ``W`` (the zero-bubble schedules' split
backward) the input-gradient part with the messages and the weight-gradient part,
``REDUCE_GRAD`` the gradient all-reduce of its data-parallel group, ``STEP`` the hardware's
once-per-iteration ``step_s`` (the optimizer step and the engine's end-of-batch work); every
message is in flight the link's latency once both its ends are posted. Peak in-flight
micro-batches per stage are counted on the same timeline, so the memory a plan reports is what
its schedule stashes, not a formula beside it. An asynchronous schedule
(``pipedream``, ``2bw``, ``pipeoptim``) is priced in steady state, the batch the engine runs once
the pipeline is full (no warm-up, no flush), with its stashed weight versions in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import GPPConfigError, PartitionError, ScheduleError
from ..graph.stages import StageGraph
from ..schedule.ir import Action, ActionKind as K, Schedule
from ..schedule.greedy import stage_duration
from ..schedule.program import ProgramFactory
from ..schedule.registry import is_async
from ..schedule.validate import Timeline, simulate
from ..schedule.virtual import FOLDED_SCHEDULES, Fold, fold_program, rank_peak
from ..schedule.zero_bubble import peak_in_flight
from .costs import ZERO_STAGES, CommFit, CostDB, StageCost, StageCostModel
from .plan import Plan, Prediction

__all__ = ["SimulatedPlan", "PricedStages", "simulate_plan", "priced_stages", "action_duration", "simulate_folded",
           "predict", "choose_schedule", "choose_zero_stage"]


@dataclass(frozen=True)
class SimulatedPlan:
    """A plan's schedule, its priced stages and the simulated timeline."""

    schedule: Schedule
    stage_costs: tuple[StageCost, ...]
    timeline: Timeline
    prediction: Prediction


def simulate_plan(plan: Plan, db: CostDB, *, schedule: str | None = None, cluster=None,
                  train: bool = True, stage_costs: tuple[StageCost, ...] | None = None,
                  link: CommFit | None = None, early: bool = True) -> SimulatedPlan:
    """Simulate one iteration (one mini-batch) of ``plan`` priced by ``db``, under ``schedule``
    (default: the plan's own). With a :class:`~gpp_deepspeed.planner.hetero.Cluster`, each stage
    is priced for its ``device_class``; ``train=False`` runs forwards only (inference);
    ``stage_costs`` replaces the cost model's prices and ``link`` the links' time in flight (a
    placement on a topology prices its own links); ``early``: the program posts its receives early
    (``graph_pipeline.early_receives``, :func:`~gpp_deepspeed.schedule.posting.post_early`).

    A message keeps both its stages busy (:meth:`~gpp_deepspeed.planner.costs.CommFit.busy`, in
    their ``F``/``B`` prices, as the search prices them) and is in flight the link's
    :attr:`~gpp_deepspeed.planner.costs.CommFit.latency_s` once both ends have posted it (and its
    ``late_receive_s`` more when the receive came last), during which both go on with other work:
    a stage that receives ``k`` messages in one grouped action is busy ``k`` times and waits for
    the latency once. With a cluster, the slowest class's link."""
    schedule = schedule or plan.schedule
    if train and plan.zero_stage >= 2 and is_async(schedule):
        raise GPPConfigError(f'schedule "{schedule}" stashes whole weight versions, which ZeRO stage '
                             f"{plan.zero_stage} would have to gather and partition again for every micro-batch: "
                             "plan an asynchronous schedule with ZeRO stage 0 or 1, or a synchronous one")
    if plan.fold:
        return simulate_folded(plan, db, schedule=schedule, stage_costs=stage_costs, link=link)
    priced = priced_stages(plan, db, cluster=cluster, stage_costs=stage_costs, link=link)
    stage_graph, costs, step_s, link, models = (priced.stage_graph, priced.costs, priced.step_s, priced.link,
                                                priced.models)
    masks, bounds, b = priced.masks, priced.bounds, plan.micro_batch
    # The program the engine runs once the pipeline is full (an asynchronous schedule's steady batch).
    programs = ProgramFactory(stage_graph, schedule=schedule, early=early)
    lists = programs.program(plan.num_microbatches, train=train).actions

    duration = action_duration(costs, step_s)
    timeline = simulate(lists, duration=duration, latency=link.latency_s, late_receive=link.late_receive_s)
    versions, in_flight = [0] * plan.num_stages, tuple(peak_in_flight(lists[s]) for s in range(plan.num_stages))
    if train and is_async(schedule):
        # Per stage, its peak stashed weight versions and in-flight micro-batches over the whole program.
        report = programs.report(plan.num_microbatches)
        versions = [report.peak_versions[s] for s in range(plan.num_stages)]
        in_flight = tuple(report.peak_in_flight[s] for s in range(plan.num_stages))
    if train:
        # Each stashed weight version is a copy of the stage's parameters (not of their gradients
        # or optimizer state, which stay with the live weights).
        mem = tuple(c.memory(k, v) for c, k, v in zip(costs, in_flight, versions))
    else:
        mem = tuple(mdl.inference_memory(m, b, s.devices, s.tp) for mdl, m, s in zip(models, masks, plan.stages))
    limits = [mdl.db.hardware.memory_bytes for mdl in models]
    span = timeline.makespan
    busy = tuple(timeline.busy(s) for s in range(plan.num_stages))
    device_busy = sum(t * s.devices for t, s in zip(busy, plan.stages))
    tps = max(mdl.time_per_sample(m, b, s.devices, boundary=bd, tp=s.tp) if train
              else mdl.time_per_sample_inference(m, b, s.devices, boundary=bd, tp=s.tp)
              for mdl, m, s, bd in zip(models, masks, plan.stages, bounds))
    prediction = Prediction(
        iteration_time_s=span, samples_per_s=plan.mini_batch / span if span > 0 else float("inf"),
        bottleneck_tps_s=tps, peak_mem_bytes=max(mem), stage_mem_bytes=mem, stage_in_flight=in_flight,
        stage_busy_s=busy, bubble_fraction=1 - device_busy / (span * plan.num_devices) if span > 0 else 0.0,
        fits_memory=all(x <= limit for x, limit in zip(mem, limits)))
    return SimulatedPlan(lists, costs, timeline, prediction)


def simulate_folded(plan: Plan, db: CostDB, *, schedule: str | None = None, stage_costs=None,
                    link=None) -> SimulatedPlan:
    """Simulate one iteration of a folded ``plan`` as its ranks run it: each rank's one list of
    actions across its stages (:func:`~gpp_deepspeed.schedule.virtual.fold_program` of the
    schedule's order), priced as :func:`~gpp_deepspeed.planner.simulate.simulate_plan` prices an
    unfolded plan, messages between ranks in flight the link's latency, hand-overs inside a rank
    free. The timeline's lists are per rank; ``rank_mem_bytes`` is each rank's weight state plus the
    most activation memory its order holds at once, ``peak_mem_bytes`` the largest of them."""
    schedule = schedule or plan.schedule
    if schedule not in FOLDED_SCHEDULES:
        raise ScheduleError(f'a folded plan runs one of {", ".join(FOLDED_SCHEDULES)}, not "{schedule}"')
    priced = priced_stages(plan, db, stage_costs=stage_costs, link=link)
    graph, costs, num_mb, fold = priced.stage_graph, priced.costs, plan.num_microbatches, Fold(plan.fold)
    duration = action_duration(costs, priced.step_s)
    orders = FOLDED_SCHEDULES[schedule][1](graph, num_mb, fold, duration=duration, max_in_flight=plan.max_in_flight or None)
    program = fold_program(graph, num_mb, fold, orders, duration=duration)
    timeline = simulate(program, duration=duration, latency=priced.link.latency_s,
                        late_receive=priced.link.late_receive_s)
    in_flight = tuple(peak_in_flight([op for op in orders[fold.rank_of[s]] if op.stage_idx == s])
                      for s in range(plan.num_stages))
    stash = {s: c.stash_bytes for s, c in enumerate(costs)}
    rank_mem = tuple(sum(costs[s].memory(0) for s in fold.stages_of(r)) + rank_peak(orders[r], stash)
                     for r in range(fold.num_ranks))
    span = timeline.makespan
    stage_busy = tuple(sum(e - b for a, b, e in timeline.spans[fold.rank_of[s]]
                           if a.stage_idx == s and (a.kind is K.FORWARD or a.kind.spec.backward))
                       for s in range(plan.num_stages))
    busy = sum(timeline.busy(r) for r in range(fold.num_ranks))
    cm = priced.models[0]
    prediction = Prediction(
        iteration_time_s=span, samples_per_s=plan.mini_batch / span if span > 0 else float("inf"),
        bottleneck_tps_s=max(cm.time_per_sample(m, plan.micro_batch, 1, boundary=bd)
                             for m, bd in zip(priced.masks, priced.bounds)),
        peak_mem_bytes=max(rank_mem), stage_mem_bytes=tuple(c.memory(k) for c, k in zip(costs, in_flight)),
        stage_in_flight=in_flight, stage_busy_s=stage_busy,
        bubble_fraction=1 - busy / (span * fold.num_ranks) if span > 0 else 0.0,
        fits_memory=max(rank_mem) <= db.hardware.memory_bytes, rank_mem_bytes=rank_mem)
    return SimulatedPlan(program, costs, timeline, prediction)


def predict(plan: Plan, db: CostDB, *, schedule: str | None = None, cluster=None, train: bool = True) -> Plan:
    """``plan`` with its :class:`Prediction` filled in, priced under ``schedule`` (default: the
    plan's own), which the returned plan carries (``cluster``, ``train``: as :func:`simulate_plan`)."""
    sim = simulate_plan(plan, db, schedule=schedule, cluster=cluster, train=train)
    # (a folded program sends nothing on an edge inside a rank: its plan keeps the edges it has)
    edges = plan.stage_edges if plan.fold else tuple(sorted(
        {(op.stage_idx, op.peer) for actions in sim.schedule.values() for a in actions
         for op in a.transfers if op.kind is K.SEND_F}))
    return replace(plan, schedule=schedule or plan.schedule).with_prediction(sim.prediction, edges)


def choose_schedule(plan: Plan, db: CostDB, *, schedules: tuple[str, ...] = ("1f1b", "zb1", "zb2")) -> Plan:
    """The plan under the fastest of ``schedules`` whose memory fits, predicted (the first one
    if none fits; among equally fast ones, the one holding the least memory). The zero-bubble schedules count a micro-batch's activations until its weight
    gradient has run, so ``zb2``'s extra in-flight micro-batches are priced, not ignored.

    >>> from gpp_deepspeed.planner.costs import CommFit, CostDB, Hardware, LayerCost
    >>> link = CommFit(alpha_s=0.0, beta_s_per_byte=0.0)
    >>> layers = tuple(LayerCost(name=f"l{i}", inputs=(f"l{i - 1}" if i else "x",), micro_batches=(1,),
    ...                          fwd_s=(1.0,), bwd_s=(2.0,), param_bytes=4, out_bytes=4, stash_bytes=4)
    ...                for i in range(4))
    >>> db = CostDB(model="m", source="hand", input_names=("x",), output="l3", layers=layers,
    ...             hardware=Hardware(name="h", memory_bytes=2**30, devices_per_node=8, intra=link, inter=link))
    >>> from gpp_deepspeed.planner.plan import PlanStage
    >>> plan = Plan(model="m", method="manual", source="hand", micro_batch=1, mini_batch=8,
    ...             stages=tuple(PlanStage(layers=(f"l{i}",)) for i in range(4)))
    >>> best = choose_schedule(plan, db)
    >>> best.schedule, best.predicted.iteration_time_s
    ('zb1', 27.0)
    """
    priced = [predict(plan, db, schedule=name) for name in schedules]
    fitting = [p for p in priced if p.predicted.fits_memory] or priced[:1]
    fastest = min(p.predicted.iteration_time_s for p in fitting)
    # Within rounding of the fastest, the one holding the least memory.
    close = [p for p in fitting if p.predicted.iteration_time_s <= fastest * (1 + 1e-9)]
    return min(close, key=lambda p: p.predicted.peak_mem_bytes)



def choose_zero_stage(plan: Plan, db: CostDB, *, zero_stages: tuple[int, ...] = ZERO_STAGES) -> Plan:
    """The plan under the lowest ZeRO stage of ``zero_stages`` that is as fast as any whose memory
    fits, predicted (the lowest one if none fits). For one stage graph a higher ZeRO stage holds
    less memory per rank but never takes less time (:func:`~gpp_deepspeed.planner.costs.zero_collectives`),
    so this is the lowest stage that fits unless a higher one is faster (it never is here, where
    the stage graph is fixed). Stages 2 and 3 are skipped under an asynchronous schedule.

    >>> from gpp_deepspeed.planner.costs import CommFit, CostDB, Hardware, LayerCost
    >>> from gpp_deepspeed.planner.plan import PlanStage
    >>> link = CommFit(alpha_s=0.0, beta_s_per_byte=1e-9)
    >>> layers = tuple(LayerCost(name=f"l{i}", inputs=(f"l{i - 1}" if i else "x",), micro_batches=(1,),
    ...                          fwd_s=(1.0,), bwd_s=(2.0,), param_bytes=100, out_bytes=4, stash_bytes=4)
    ...                for i in range(2))
    >>> db = CostDB(model="m", source="hand", input_names=("x",), output="l1", layers=layers,
    ...             hardware=Hardware(name="h", memory_bytes=300, devices_per_node=8, intra=link, inter=link))
    >>> plan = Plan(model="m", method="manual", source="hand", micro_batch=4, mini_batch=8,
    ...             stages=(PlanStage(layers=("l0",), devices=4), PlanStage(layers=("l1",), devices=4)))
    >>> [choose_zero_stage(plan, db, zero_stages=(z,)).predicted.peak_mem_bytes for z in ZERO_STAGES]
    [408.0, 258.0, 183.0, 208.0]
    >>> choose_zero_stage(plan, db).zero_stage
    1
    """
    allowed = [z for z in zero_stages if z < 2 or not is_async(plan.schedule)] or [min(zero_stages)]
    priced = [predict(replace(plan, zero_stage=z), db) for z in sorted(allowed)]
    fitting = [p for p in priced if p.predicted.fits_memory] or priced[:1]
    fastest = min(p.predicted.iteration_time_s for p in fitting)
    return next(p for p in fitting if p.predicted.iteration_time_s <= fastest * (1 + 1e-9))


def action_duration(costs: tuple[StageCost, ...], step_s: list[float]):
    """The price of an action of stage ``s``: its stage's ``F``, ``B``, ``I``, ``W`` and all-reduce
    times, the hardware's ``step_s`` for ``STEP``, nothing for the rest (transfers are priced by
    the link in the simulator)."""
    compute = stage_duration([c.times for c in costs], len(costs))

    def duration(a: Action) -> float:
        if a.kind is K.REDUCE_GRAD:
            return costs[a.stage_idx].allreduce_s
        if a.kind is K.STEP:
            return step_s[a.stage_idx]
        return compute(a)
    return duration


@dataclass(frozen=True)
class PricedStages:
    """A plan's stage graph and each stage priced by the cost model: what every simulation of the
    plan runs on, folded or not."""

    stage_graph: StageGraph
    costs: tuple[StageCost, ...]
    step_s: list[float]
    link: CommFit
    models: list
    masks: list[int]
    bounds: list


def priced_stages(plan: Plan, db: CostDB, *, cluster=None, stage_costs: tuple[StageCost, ...] | None = None,
                  link: CommFit | None = None) -> PricedStages:
    """``plan``'s stage graph and stage prices under ``db`` (``cluster``, ``stage_costs``,
    ``link``: as :func:`simulate_plan`)."""
    names = set(db.by_name)
    planned = [n for s in plan.stages for n in s.layers]
    if set(planned) != names or len(planned) != len(names):
        missing, extra = sorted(names - set(planned)), sorted(set(planned) - names)
        raise PartitionError(f"plan for {plan.model} does not cover the cost database's layers exactly: "
                             f"missing {missing[:5]}, unknown {extra[:5]}")
    model = StageCostModel(db, plan.mini_batch, p2p_devices=plan.num_devices, zero_stage=plan.zero_stage)
    masks = [model.mask_of(s.layers) for s in plan.stages]
    stage_graph = plan.partition(db.graph).stage_graph
    if plan.pipeline == "chain":
        # The stages that read the batch are the layers' (a chain relays tensors, not the batch).
        stage_graph = replace(StageGraph.chain(plan.num_stages), loading=stage_graph.loading)
    # Every message the engine sends: one per stage edge and peer rank, fan-in, fan-out and
    # resharding included (a chain relays skip tensors instead).
    bounds = model.stage_boundaries(masks, [s.replicas for s in plan.stages], relay=plan.pipeline == "chain")
    models = [model if cluster is None else cluster.stage_model(db, s.device_class, plan.mini_batch, plan.num_devices,
                                                                zero_stage=plan.zero_stage)
              for s in plan.stages]
    costs = tuple(stage_costs) if stage_costs is not None else tuple(
        mdl.stage(m, plan.micro_batch, s.devices, boundary=bd, recompute=s.recompute, tp=s.tp)
        for mdl, m, s, bd in zip(models, masks, plan.stages, bounds))
    if link is None:
        link = max((mdl.link for mdl in models), key=lambda x: (x.latency_s, x.late_receive_s))
    return PricedStages(stage_graph=stage_graph, costs=costs, step_s=[mdl.db.hardware.step_s for mdl in models],
                        link=link, models=models, masks=masks, bounds=bounds)
