"""The ``gpp`` command: profile a model, plan it, simulate a plan and compare the planners.

Synopsis::

    gpp profile MODEL -o COSTS [--tiny] [--granularity layer|sublayer] [--analytic v100|a100|h100]
                      [--device cpu|cuda] [--no-link-measure] [--micro-batches 1,2,4] [--size KEY=VALUE ...]
    gpp plan COSTS --devices N --mini-batch B [--method METHOD] [--space full|runtime]
                   [--micro-batches 1,2,4] [--zero auto|0|1|2|3] [--fold K] [--tp auto|1,2,4] [--tp-across-nodes]
                   [-o PLAN]
    gpp simulate PLAN --costs COSTS
    gpp viz PLAN --costs COSTS [-o OUTDIR] [--format png|svg|both]
    gpp viz-run TRACE_DIR [--step N] [-o OUTDIR] [--format png|svg|both]
    gpp compare COSTS --devices N --mini-batch B [--methods graphpipe,pipedream,...] [--space full|runtime]
                      [--micro-batches 1,2,4] [--schedules 1f1b,zb1,zb2] [--fold K]

``plan`` and ``compare`` take ``--schedules``. GraphPipe searches under each listed training
schedule, pricing every candidate stage graph with the memory and the simulated time of that
schedule, so each schedule may get another partition; other planners' plans are priced under each.
``plan`` keeps the fastest plan whose memory fits (the plan JSON carries its schedule, and the
engine runs it unless the DeepSpeed config's ``graph_pipeline.schedule`` says otherwise);
``compare`` shows every method's best plan per schedule side by side. The asynchronous schedules (``pipedream``,
``2bw``, ``pipeoptim``) are priced in steady state: one batch with the pipeline full before and
after it (no warm-up, no flush), their stashed weight versions counted in memory.

``plan --fold K`` and ``compare --fold K`` also search folded plans: GraphPipe's stages, up to K a
rank, placed on the ranks and scheduled (``interleaved``, ``zbv``, ``dualpipev``) by
:func:`~gpp_deepspeed.planner.fold.fold_search`. ``plan`` keeps the folded plan where it fits and is
faster, and prints its fold and the ``graph_pipeline`` config that runs it; ``compare`` adds its row
and a table of the folded and unfolded plans side by side (step, bubble, memory per rank).

``plan --zero`` sets the ZeRO stage the plan is priced with (DeepSpeed's ``zero_optimization.stage``,
default 0): ZeRO-1, 2 and 3 partition a stage's optimizer state, then its gradients, then its
parameters over the stage's ranks, and 2 and 3 add collectives per micro-batch. ``--zero auto``
searches under each and keeps the lowest stage unless a higher one is faster, which happens only
where memory binds; the printed DeepSpeed config carries the stage chosen.

``plan --tp`` lets GraphPipe give each stage a tensor-parallel degree among those listed (``auto``:
the powers of two up to the devices of a node): a stage on ``n`` devices runs ``n / tp`` replicas
of ``tp`` ranks, its compute and weight state per rank divided by ``tp``, each layer's four
activation all-reduces priced on the node's link (``StageCostModel``). A stage gets the fastest
degree that fits; TP groups stay inside a node unless ``--tp-across-nodes``. The printed config
carries the choice as ``graph_pipeline.stage_tp``.

Every subcommand takes ``--json`` (machine-readable JSON on stdout instead of a table) and
``--quiet`` (no progress lines on stderr). Errors the package raises and missing files print
``gpp: error: <message>`` and exit with status 2, as argparse does for bad options.

Glossary
--------
costs
    A :class:`~gpp_deepspeed.planner.CostDB` JSON file, measured or analytic (its ``source`` says).
method
    A planner: ``graphpipe`` (GraphPipe's search, arXiv 2406.17145) or a baseline of
    :data:`~gpp_deepspeed.planner.baselines.BASELINES` (PipeDream, Piper, DeepSpeed's partitions).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from .errors import GPPConfigError, GPPError
from .models import BUILDERS, DEVICES, ModelDesc, analytic_costs, tiny
from .planner import CommFit, CostDB, Hardware, Plan, SearchResult, graphpipe_search, simulate_plan
from .planner.pipedream2bw import pipedream_2bw_search
from .planner.costs import ZERO_STAGES
from .planner.simulate import choose_schedule, choose_zero_stage, predict
from .schedule import get_schedule

__all__ = ["main"]

# With --no-link-measure: a loopback gloo link of the order measured on one machine; an assumption
# the summary states, to be replaced by a measurement (drop the flag) or profiler.with_links().
_ASSUMED_LINK = CommFit(alpha_s=50e-6, beta_s_per_byte=1 / 2e9)
_GIB = 2**30


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gpp`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:   # --help (0) and argparse's usage errors (2), as a return value
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.run(args) or 0
    except GPPError as e:
        print(f"gpp: error: {e}", file=sys.stderr)
    except BrokenPipeError:   # stdout closed early (gpp ... | head): quiet, as other tools are
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # so the exit-time flush cannot fail
        return 1
    except OSError as e:   # e.g. an -o path in a folder that does not exist
        print(f"gpp: error: {e}", file=sys.stderr)
    return 2


# -- subcommands --------------------------------------------------------------------------------

def _profile(args) -> None:
    """Price a paper model analytically or measure it here, and write its cost database."""
    desc = _model(args.model, tiny_size=args.tiny, granularity=args.granularity, sizes=args.size)
    if args.analytic:
        if args.device or args.no_link_measure:
            _warn("--device and --no-link-measure are ignored with --analytic (nothing is measured)")
        kw = {"micro_batches": args.micro_batches} if args.micro_batches else {}
        db = analytic_costs(desc, DEVICES[args.analytic], **kw)
    else:
        db = _measure(desc, args)
    db.save(args.output)
    summary = {"model": desc.name, "granularity": db.granularity, "layers": len(db.layers),
               "params": desc.num_params, "micro_batches": list(db.micro_batches), "source": db.source,
               "hardware": db.hardware.name, "memory_bytes": db.hardware.memory_bytes, "output": args.output}
    _emit(args, summary, "\n".join([
        f"profiled {desc.name} ({db.granularity} granularity): {len(db.layers)} layers, "
        f"{desc.num_params / 1e6:.2f} M parameters, micro-batches {list(db.micro_batches)}",
        f"  source: {db.source}",
        f"  hardware: {db.hardware.name}, {db.hardware.memory_bytes / _GIB:.1f} GiB per device",
        f"  wrote {args.output}"]))


def _measure(desc: ModelDesc, args) -> CostDB:
    """Time every layer of ``desc`` on this machine's device (torch is loaded only here)."""
    import torch

    from .models import build_layers, make_batch
    from .profiler import measure_hardware, profile_layers

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise GPPConfigError("--device cuda, but torch sees no GPU; use --device cpu or --analytic v100|a100|h100")
    if args.no_link_measure:
        hardware = _assumed_hardware(torch, device)
    else:
        _say(args, "profile: measuring the link with two gloo/nccl processes (about 10 s)")
        hardware = measure_hardware(device=device)
    _say(args, f"profile: timing {len(desc.layers)} layers of {desc.name} on {device}")
    kw = {"micro_batches": args.micro_batches} if args.micro_batches else {}
    db = profile_layers(build_layers(desc), input_names=desc.input_names, output=desc.output,
                        make_inputs=lambda b: make_batch(desc, b, seed=0)[0], device=device,
                        model_name=desc.name, hardware=hardware, **kw)
    # profile_layers knows layers, not the description they came from.
    return dataclasses.replace(db, granularity=desc.granularity)


def _assumed_hardware(torch, device: str) -> Hardware:
    """This machine's memory with :data:`_ASSUMED_LINK` for both links, saying so in its name."""
    if device == "cuda":
        memory, num = torch.cuda.get_device_properties(0).total_memory, torch.cuda.device_count()
        label = torch.cuda.get_device_name(0)
    else:
        memory, num = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), 1   # MemTotal on Linux
        label = f"cpu ({os.cpu_count()} cores)"
    link = (f"links not measured: assumed {_ASSUMED_LINK.alpha_s * 1e6:.0f} us + "
            f"{1 / _ASSUMED_LINK.beta_s_per_byte / 1e9:.0f} GB/s (--no-link-measure)")
    return Hardware(name=f"{label} x{num}; {link}", memory_bytes=int(memory), devices_per_node=num,
                    intra=_ASSUMED_LINK, inter=_ASSUMED_LINK)


def _plan(args) -> None:
    """Search one plan and optionally write it."""
    db = _load_costs(args.costs)
    if args.space is not None and args.method != "graphpipe":
        _warn(f"--space applies to graphpipe only; {args.method} ignores it")
    if args.zero not in (None, (0,)) and args.cluster:
        _warn("--zero does not apply with --cluster: the heterogeneous planner prices ZeRO stage 0")
    if args.tp is not None and (args.method != "graphpipe" or args.cluster):
        _warn("--tp applies to graphpipe's search only; this plan has tensor-parallel degree 1 everywhere")
    if args.cluster:
        result = _hetero(db, args)
    else:
        result = _search(args.method, db, args)
    plan = result.plan
    if plan is None:
        raise GPPError(f"{args.method} found no plan for {db.model} on {args.devices} devices, mini-batch "
                       f"{args.mini_batch}: {result.status}")
    if args.schedules and not result.alternatives:
        # GraphPipe searched under every schedule; another planner's plan is priced under each, and
        # the schedule becomes part of the plan: the fastest that fits memory.
        plan = choose_schedule(plan, db, schedules=args.schedules)
    if args.zero is not None and args.method != "graphpipe" and not args.cluster:
        # GraphPipe searched under every ZeRO stage; another planner's stage graph gets the lowest
        # that fits (a higher one only adds collectives to a fixed stage graph).
        plan = choose_zero_stage(plan, db, zero_stages=args.zero)
    if args.fold:
        plan = _keep_faster(plan, _folded(db, args))
    if args.topology:
        plan = _placed(plan, db, args)
    if args.output:
        plan.save(args.output)
    data = {"method": result.method, "status": result.status, "search_time_s": result.search_time_s,
            "states": result.states, "output": args.output, "num_stages": plan.num_stages,
            "num_devices": plan.num_devices, "micro_batch": plan.micro_batch, "zero_stage": plan.zero_stage,
            **dataclasses.asdict(plan.predicted), "plan": json.loads(plan.to_json())}
    lines = [plan.describe(), f"  search: {result.search_time_s:.2f} s, {result.states} states"]
    if args.output:
        lines.append(f"  wrote {args.output}")
    lines.append(_how_to_run(plan, args.output))
    _emit(args, data, "\n".join(lines))


def _folded(db: CostDB, args) -> SearchResult:
    """GraphPipe's folded plan (``--fold K``: up to K stages a rank) on the command line's inputs."""
    from .planner.fold import fold_search
    if (getattr(args, "cluster", None) or getattr(args, "topology", None)
            or getattr(args, "method", "graphpipe") != "graphpipe"):
        raise GPPConfigError("--fold folds GraphPipe's plans on one device kind: not with --cluster, --topology "
                             "or another --method")
    _say(args, f"graphpipe: searching folded plans, up to {args.fold} stages a rank")
    return fold_search(db, num_devices=args.devices, mini_batch=args.mini_batch, micro_batches=args.micro_batches,
                       stages_per_rank=args.fold, progress=None if args.quiet else _stderr)


def _keep_faster(plan: Plan, folded: SearchResult) -> Plan:
    """The folded plan where it fits and is faster than ``plan`` (or ``plan`` does not fit)."""
    f = folded.plan
    if f is None or not f.predicted.fits_memory:
        return plan
    if not plan.predicted.fits_memory or f.predicted.iteration_time_s < plan.predicted.iteration_time_s:
        return f
    return plan


def _hetero(db: CostDB, args) -> SearchResult:
    """EdgePipe-style planning over the device classes of ``--cluster``."""
    from .planner.hetero import Cluster, hetero_search
    cluster = Cluster.load(args.cluster)
    if args.devices != cluster.num_devices:
        raise GPPConfigError(f"--devices {args.devices} but cluster file {args.cluster} has {cluster.num_devices} "
                             f"devices ({', '.join(f'{c.count} {c.name}' for c in cluster.classes)})")
    _say(args, f"hetero: {args.objective} plan for {db.model} on {cluster.num_devices} devices of "
               f"{len(cluster.classes)} classes, mini-batch {args.mini_batch}")
    return hetero_search(db, cluster, mini_batch=args.mini_batch, objective=args.objective,
                         micro_batches=args.micro_batches)


def _placed(plan: Plan, db: CostDB, args) -> Plan:
    """``plan`` with its stages placed on the devices of ``--topology`` (a topology JSON, or a
    hostfile whose hosts get the cost database's intra- and inter-node links)."""
    from .planner.topology import Topology, contiguous, place, placement_time
    path = Path(args.topology)
    if path.suffix == ".json":
        topo = Topology.load(path)
    else:
        topo = Topology.from_hostfile(path, intra=db.hardware.intra, inter=db.hardware.inter)
    placement, t = place(plan, db, topo)
    before = placement_time(plan, db, topo, contiguous(plan))
    _say(args, f"placement on {path}: {t * 1e3:.2f} ms/iteration (contiguous: {before * 1e3:.2f} ms)")
    notes = {**plan.notes, "placement_iteration_s": t, "contiguous_iteration_s": before}
    return dataclasses.replace(plan, placement=placement, notes=notes)


def _how_to_run(plan: Plan, path: str | None) -> str:
    """The launch line and DeepSpeed config values that run ``plan`` as planned."""
    degrees = [s.replicas for s in plan.stages]   # data-parallel: a stage's TP ranks share each row
    bad = [i for i, n in enumerate(degrees) if plan.micro_batch % n]
    if bad:
        return (f"  not runnable as is: stage {bad[0]} runs on {degrees[bad[0]]} devices, which do not split the "
                f"micro-batch of {plan.micro_batch} into equal shards")
    # Stage s splits each micro-batch over its degrees[s] ranks (StageCostModel; the engine does
    # the same), so the DeepSpeed values describe the pipeline: the micro-batch of the plan.
    spread = ("one rank per stage" if not plan.fold else f"{plan.stages_per_rank} stages a rank at most") \
        if set(degrees) == {1} else f"ranks per stage {degrees}"
    text = (f'  to run it: GraphPipelineModule(layers, ..., partition_method="{path or "plan.json"}") on '
            f"{plan.num_devices} ranks ({spread}), e.g. deepspeed --num_gpus {plan.num_devices} train.py\n"
            f'  DeepSpeed config: "train_batch_size": {plan.mini_batch}, "train_micro_batch_size_per_gpu": '
            f'{plan.micro_batch}, "gradient_accumulation_steps": {plan.num_microbatches}, '
            f'"zero_optimization": {{"stage": {plan.zero_stage}}}'
            + (f', "graph_pipeline": {{"stage_tp": {[s.tp for s in plan.stages]}}}'
               if any(s.tp > 1 for s in plan.stages) else "") +
            f"{'' if set(degrees) == {1} else ' (each rank of stage s processes micro-batch / ranks of s rows)'}"
            + ("" if path else "\n  (write the plan with -o plan.json)"))
    if plan.fold:
        text += (f'\n  "graph_pipeline": {{"schedule": "{plan.schedule}", "stages_per_rank": {plan.stages_per_rank}, '
                 f'"fold": {list(plan.fold)}}}  (rank of each stage)')
    if plan.pipeline == "chain":
        text += "\n  (a chain plan: the engine runs it as a chain, relaying skip tensors through the stages between)"
    if plan.placement or any(s.device_class for s in plan.stages):
        text += ("\n  (stage s runs on the s-th block of ranks: launch so that those ranks sit on its devices"
                 + (f", rank order {list(_rank_order(plan))}" if plan.placement else " of its class")
                 + "; launch/README.md, 'Placing stages on devices')")
    return text


def _rank_order(plan: Plan) -> tuple[int, ...]:
    from .planner.topology import rank_order
    return rank_order(plan)


def _simulate(args) -> None:
    """Per-stage times, idle time, in-flight micro-batches and memory of a plan, and totals."""
    db = _load_costs(args.costs)
    plan = _load_plan(args.plan)
    sim = simulate_plan(plan, db)
    p = sim.prediction
    span = p.iteration_time_s
    stages = []
    for s, (stage, cost) in enumerate(zip(plan.stages, sim.stage_costs)):
        busy = p.stage_busy_s[s]
        stages.append({"stage": s, "devices": stage.devices, "layers": len(stage.layers), "fwd_s": cost.fwd_s,
                       "bwd_s": cost.bwd_s, "allreduce_s": cost.allreduce_s, "busy_s": busy, "idle_s": span - busy,
                       "bubble_fraction": (span - busy) / span if span > 0 else 0.0,
                       "in_flight": p.stage_in_flight[s], "mem_bytes": p.stage_mem_bytes[s]})
    data = {"plan": args.plan, "costs": args.costs, "source": db.source, "method": plan.method,
            "micro_batch": plan.micro_batch, "mini_batch": plan.mini_batch, "zero_stage": plan.zero_stage,
            "stages": stages,
            **dataclasses.asdict(p)}
    rows = [[str(r["stage"]), str(r["devices"]), str(r["layers"]), *map(_ms, (r["fwd_s"], r["bwd_s"],
             r["allreduce_s"], r["busy_s"], r["idle_s"])), f"{r['bubble_fraction']:.1%}", str(r["in_flight"]),
             f"{r['mem_bytes'] / _GIB:.2f}"] for r in stages]
    header = ["stage", "devices", "layers", "fwd ms", "bwd ms", "allreduce ms", "busy ms", "idle ms", "bubble",
              "in-flight", "GiB/device"]
    lines = [f"{plan.method} plan for {plan.model}: {plan.num_stages} stages on {plan.num_devices} devices, "
             f"micro-batch {plan.micro_batch} x {plan.num_microbatches} ({plan.pipeline} pipeline"
             + (f", ZeRO stage {plan.zero_stage})" if plan.zero_stage else ")"),
             f"costs: {db.source}"]
    if plan.source != db.source:
        lines.append(f"note: the plan was searched on other costs: {plan.source}")
    lines += ["", _table(header, rows, "r" * len(header)),
              "(fwd, bwd: per micro-batch; all-reduce: once per iteration; busy, idle: over the iteration)", "",
              f"iteration {_ms(span)} ms, {p.samples_per_s:.1f} samples/s, bubble {p.bubble_fraction:.1%} of "
              f"device time, peak {p.peak_mem_bytes / _GIB:.2f} GiB/device "
              f"({'fits' if p.fits_memory else 'does NOT fit'} {db.hardware.memory_bytes / _GIB:.1f} GiB)"]
    _emit(args, data, "\n".join(lines))


def _compare(args) -> None:
    """Every method on the same costs, devices, memory limit, mini-batch and micro-batch sweep."""
    db = _load_costs(args.costs)
    methods = args.methods or list(_methods())
    for method in methods:   # fail on a typo before the long searches, not after
        _method(method)
    results = []
    for method in methods:
        try:
            results.append(_search(method, db, args))
        except GPPError as e:   # one failing planner must not hide the others' rows
            results.append(SearchResult(method=method, plan=None, search_time_s=0.0, status=f"error: {e}"))
    if args.schedules:
        results = _per_schedule(results, db, args.schedules)
    if args.fold:
        results.append(_folded(db, args))
    found = [r for r in results if r.plan is not None]
    baselines = [r for r in found if r.method.split("/")[0] not in ("graphpipe", "graphpipe-folded")]
    ref = max(baselines or found, key=lambda r: r.plan.predicted.samples_per_s, default=None)
    ref_name = None if ref is None else ("best baseline " if baselines else "") + ref.method
    rows = [_compare_row(r, ref) for r in results]
    data = {"costs": args.costs, "model": db.model, "source": db.source, "hardware": db.hardware.name,
            "memory_bytes": db.hardware.memory_bytes, "devices": args.devices, "mini_batch": args.mini_batch,
            "micro_batches": list(args.micro_batches) if args.micro_batches else None, "speedup_vs": ref_name,
            "rows": rows}
    sweep = list(args.micro_batches) if args.micro_batches else "powers of two dividing it"
    lines = [f"{db.model} ({len(db.layers)} layers, {db.granularity} granularity) on {args.devices} devices, "
             f"mini-batch {args.mini_batch}, micro-batches {sweep}",
             f"costs: {db.source}",
             f"hardware: {db.hardware.name}, {db.hardware.memory_bytes / _GIB:.1f} GiB per device", ""]
    header = ["method", "iter ms", "samples/s", f"vs {ref.method if ref else '-'}", "GiB/device", "stages",
              "micro-batch", "search s", "status"]
    table = [[r["method"], *_compare_cells(r), f"{r['search_time_s']:.2f}", r["status"]] for r in rows]
    lines += [_table(header, table, "lrrrrrrrl"), ""]
    if ref_name:
        lines.append(f"speed-up: samples/s relative to {ref_name}")
    if args.fold:
        side = _fold_side_by_side(results)
        data["folded_vs_unfolded"] = side
        lines += ["", "GraphPipe folded and unfolded, side by side (peak memory per rank, GiB):",
                  _table(["plan", "step ms", "bubble", "ranks", "schedule", "GiB per rank"],
                         [[r["plan"], _ms(r["step_s"]), f"{r['bubble_fraction']:.1%}", str(r["ranks"]), r["schedule"],
                           " ".join(f"{m / _GIB:.2f}" for m in r["rank_mem_bytes"])] for r in side], "lrrrll")]
    _emit(args, data, "\n".join(lines))


def _fold_side_by_side(results: list[SearchResult]) -> list[dict]:
    """GraphPipe's fastest unfolded plan and its folded plan: step, bubble, memory per rank."""
    unfolded = [r.plan for r in results if r.plan is not None and r.method.split("/")[0] == "graphpipe"]
    folded = [r.plan for r in results if r.plan is not None and r.method == "graphpipe-folded"]
    rows = []
    for name, plans in (("unfolded", unfolded), ("folded", folded)):
        if not plans:
            continue
        p = min(plans, key=lambda x: x.predicted.iteration_time_s)
        per_rank = p.predicted.rank_mem_bytes or tuple(m for m, s in zip(p.predicted.stage_mem_bytes, p.stages)
                                                       for _ in range(s.devices))
        rows.append({"plan": name, "step_s": p.predicted.iteration_time_s,
                     "bubble_fraction": p.predicted.bubble_fraction, "ranks": p.num_devices, "schedule": p.schedule,
                     "fold": list(p.fold), "rank_mem_bytes": list(per_rank)})
    return rows


def _viz_run(args) -> None:
    """The Gantt chart of one step of a real run, from the engine's per-rank traces."""
    from . import viz

    timeline, step = viz.timeline_from_traces(args.trace_dir, step=args.step)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    suffixes = ("png", "svg") if args.format == "both" else (args.format,)
    title = f"measured schedule, step {step}, {len(timeline.spans)} stages, {_ms(timeline.makespan)} ms"
    files = [str(viz.draw_gantt(timeline, out / f"gantt_run.{s}", title=title)) for s in suffixes]
    _emit(args, {"trace_dir": args.trace_dir, "step": step, "files": files}, "\n".join(f"wrote {f}" for f in files))


def _viz(args) -> None:
    """Pictures of a plan: layer DAG, stage DAG, simulated Gantt chart, and a Chrome trace."""
    from . import viz

    db = _load_costs(args.costs)
    plan = _load_plan(args.plan)
    sim = simulate_plan(plan, db)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    suffixes = ("png", "svg") if args.format == "both" else (args.format,)
    title = (f"{plan.model}: simulated {plan.method} schedule, {plan.num_stages} stages, {plan.num_microbatches} "
             f"micro-batches of {plan.micro_batch}, {_ms(sim.prediction.iteration_time_s)} ms")
    written = []
    for suffix in suffixes:
        written.append(viz.draw_layer_dag(db, plan.stage_of, out / f"layer_dag.{suffix}"))
        written.append(viz.draw_stage_dag(plan, db, out / f"stage_dag.{suffix}"))
        written.append(viz.draw_gantt(sim.timeline, out / f"gantt.{suffix}", title=title))
    written.append(viz.write_chrome_trace(sim.timeline, out / "trace.json"))
    files = [str(p) for p in written]
    _emit(args, {"plan": args.plan, "costs": args.costs, "files": files},
          "\n".join(f"wrote {f}" for f in files) + "\n(open trace.json in chrome://tracing or ui.perfetto.dev)")


def _compare_cells(row: dict) -> list[str]:
    """The table cells from iteration time to micro-batch; dashes when there is no plan."""
    if row["iteration_time_s"] is None:
        return ["-"] * 6
    return [_ms(row["iteration_time_s"]), f"{row['samples_per_s']:.1f}", f"{row['speedup']:.2f}x",
            f"{row['peak_mem_bytes'] / _GIB:.2f}", str(row["stages"]), str(row["micro_batch"])]


def _compare_row(result: SearchResult, ref: SearchResult | None) -> dict:
    row = {"method": result.method, "iteration_time_s": None, "samples_per_s": None, "speedup": None,
           "peak_mem_bytes": None, "stages": None, "devices_used": None, "micro_batch": None,
           "search_time_s": result.search_time_s, "states": result.states, "status": result.status}
    if result.plan is not None:
        p = result.plan.predicted
        row.update(iteration_time_s=p.iteration_time_s, samples_per_s=p.samples_per_s,
                   speedup=p.samples_per_s / ref.plan.predicted.samples_per_s, peak_mem_bytes=p.peak_mem_bytes,
                   stages=result.plan.num_stages, devices_used=result.plan.num_devices,
                   micro_batch=result.plan.micro_batch)
    return row


# -- helpers ------------------------------------------------------------------------------------

def _methods() -> dict[str, Callable[..., SearchResult]]:
    """Planner name -> search function; the baselines when their module is installed."""
    methods = {"graphpipe": graphpipe_search}
    try:
        from .planner.baselines import BASELINES
    except ImportError:
        return methods
    return {**methods, **BASELINES}


def _method(name: str) -> Callable[..., SearchResult]:
    # PipeDream-2BW's planner plans for its own schedule only: not one of compare's default rows.
    methods = {**_methods(), "pipedream-2bw": pipedream_2bw_search}
    if name not in methods:
        raise GPPConfigError(f'unknown method "{name}"; valid: {", ".join(methods)}')
    return methods[name]


def _search(method: str, db: CostDB, args) -> SearchResult:
    """Run planner ``method`` with the command line's devices, mini-batch, sweep and space
    (GraphPipe searches under every schedule of ``--schedules``)."""
    search = _method(method)
    kw = {}
    if method == "graphpipe":
        kw = {"space": args.space or "full", "recompute": args.recompute, "schedules": args.schedules or ("1f1b",),
              "zero_stages": getattr(args, "zero", None) or (0,)}
        tp = getattr(args, "tp", None)
        if tp is not None:
            per_node = db.hardware.devices_per_node
            kw["tp_degrees"] = tuple(1 << i for i in range(per_node.bit_length()) if 1 << i <= per_node) \
                if tp == "auto" else tp
            kw["tp_across_nodes"] = args.tp_across_nodes
    elif method == "pipedream":   # PipeDream's DP plans for each schedule (weight versions in its memory)
        kw = {"schedules": args.schedules or ("1f1b",)}
    _say(args, f"{method}: searching {db.model} on {args.devices} devices, mini-batch {args.mini_batch}")
    return search(db, num_devices=args.devices, mini_batch=args.mini_batch,
                           micro_batches=args.micro_batches, progress=None if args.quiet else _stderr, **kw)


def _per_schedule(results: list[SearchResult], db: CostDB, schedules: Sequence[str]) -> list[SearchResult]:
    """One row per method and schedule: GraphPipe's best plan under each schedule (it searched
    under each), every other method's plan priced under each."""
    rows = []
    for r in results:
        for i, name in enumerate(schedules):
            if r.alternatives:
                plan = r.alternatives[i]
                status = r.status if plan is not None else f"no plan fits under {name}"
            else:
                plan = None if r.plan is None else predict(r.plan, db, schedule=name)
                status = r.status
            rows.append(dataclasses.replace(r, method=f"{r.method}/{name}", plan=plan, status=status))
    return rows


def _model(name: str, *, tiny_size: bool, granularity: str, sizes: Sequence[tuple[str, int]]) -> ModelDesc:
    """The paper model ``name`` (a registry name or an unambiguous prefix of one) at the asked size."""
    key = name.lower().replace("-", "_")
    matches = [n for n in BUILDERS if n == key] or [n for n in BUILDERS if n.startswith(key)]
    if len(matches) != 1:
        raise GPPConfigError(f'unknown model "{name}"; valid: {", ".join(sorted(BUILDERS))}')
    builder, overrides = BUILDERS[matches[0]], dict(sizes)
    valid = [p for p in inspect.signature(builder).parameters if p != "granularity"]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise GPPConfigError(f"--size {', '.join(unknown)}: not a size of {matches[0]}; valid: {', '.join(valid)}")
    if tiny_size:
        return tiny(matches[0], granularity=granularity, **overrides)
    return builder(**overrides, granularity=granularity)


def _load_costs(path: str) -> CostDB:
    if not Path(path).is_file():
        raise GPPConfigError(f'cost database "{path}" does not exist; write one with "gpp profile MODEL -o {path}"')
    try:
        return CostDB.load(path)
    except (ValueError, TypeError, KeyError) as e:
        raise GPPConfigError(f'"{path}" is not a gpp cost database ({type(e).__name__}: {e})') from None


def _load_plan(path: str) -> Plan:
    if not Path(path).is_file():
        raise GPPConfigError(f'plan "{path}" does not exist; write one with "gpp plan COSTS ... -o {path}"')
    try:
        return Plan.load(path)
    except ValueError as e:   # Plan's own GPPConfigError, or json's decode error
        raise GPPConfigError(f'"{path}": {e if isinstance(e, GPPError) else f"not a gpp plan file: {e}"}') from None


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> str:
    """Rows of strings as aligned columns; ``align`` has one ``l`` or ``r`` per column."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(row):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _emit(args, data: dict, text: str) -> None:
    print(json.dumps(data, indent=1) if args.json else text)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _say(args, message: str) -> None:
    if not args.quiet:
        _stderr(message)


def _warn(message: str) -> None:
    _stderr(f"gpp: warning: {message}")


# -- argument parsing ---------------------------------------------------------------------------

def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(_positive(t) for t in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be positive integers separated by commas, got {text!r}") from None


def _size(text: str) -> tuple[str, int]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE, e.g. branches=16, got {text!r}")
    return key.strip(), _positive(value)


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _zero_stages(text: str) -> tuple[int, ...]:
    """``auto`` (every ZeRO stage) or one stage, 0 to 3."""
    if text.strip().lower() == "auto":
        return ZERO_STAGES
    if text.strip() in tuple(map(str, ZERO_STAGES)):
        return (int(text),)
    raise argparse.ArgumentTypeError(f'must be "auto" or a ZeRO stage {", ".join(map(str, ZERO_STAGES))}, got "{text}"')


def _tp_degrees(text: str) -> tuple[int, ...] | str:
    """``auto`` (powers of two up to a node's devices, resolved against the cost database) or
    comma-separated positive degrees."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        degrees = tuple(int(t) for t in _names(text))
    except ValueError:
        degrees = ()
    if not degrees or any(d < 1 for d in degrees):
        raise argparse.ArgumentTypeError(f'must be "auto" or positive tensor-parallel degrees like 1,2,4, got "{text}"')
    return degrees


def _schedule_names(text: str) -> tuple[str, ...]:
    names = tuple(n.lower() for n in _names(text))
    for n in names:
        try:
            get_schedule(n)
        except GPPConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpp", description="Profile, plan, simulate and compare graph pipeline "
                                     "parallel training (GraphPipe, arXiv 2406.17145).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON on stdout instead of a table")
    common.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    sweep = argparse.ArgumentParser(add_help=False)
    sweep.add_argument("--micro-batches", type=_int_list, metavar="1,2,4",
                       help="micro-batch sizes (default: all measured / powers of two)")
    search = argparse.ArgumentParser(add_help=False, parents=[sweep])
    search.add_argument("costs", metavar="COSTS", help="cost database written by gpp profile")
    search.add_argument("--devices", type=_positive, required=True, metavar="N", help="devices to plan for")
    search.add_argument("--mini-batch", type=_positive, required=True, metavar="B", help="samples per iteration")
    search.add_argument("--space", choices=("full", "runtime"), help="graphpipe: per-stage degrees (full, "
                        "the default) or one degree for all stages (runtime); the engine runs both")
    search.add_argument("--recompute", action="store_true", help="graphpipe: a stage that would not fit "
                        "may recompute its activations in the backward (the plan marks it; the engine checkpoints it)")
    search.add_argument("--schedules", type=_schedule_names, metavar="1f1b,zb1,zb2",
                        help="training schedules (default: 1f1b): graphpipe searches under each, other "
                        "methods' plans are priced under each; plan keeps the fastest that fits memory, compare "
                        "shows one row per method and schedule")
    search.add_argument("--fold", type=_positive, metavar="K", help="graphpipe: also search folded plans, each rank "
                        "holding up to K stages (interleaved, zbv or dualpipev; the fold and schedule priced by the "
                        "simulator); plan keeps the faster that fits, compare shows both side by side")

    p = sub.add_parser("profile", parents=[common, sweep], help="write a model's cost database")
    p.add_argument("model", metavar="MODEL", help=f"one of {', '.join(sorted(BUILDERS))}")
    p.add_argument("-o", "--output", required=True, metavar="COSTS", help="cost database JSON to write")
    p.add_argument("--tiny", action="store_true", help="the CPU-sized twin (models.TINY)")
    p.add_argument("--granularity", choices=("layer", "sublayer"), default="layer")
    p.add_argument("--analytic", choices=sorted(DEVICES), help="price from FLOPs on this device; measure nothing")
    p.add_argument("--device", choices=("cpu", "cuda"), help="where to measure (default: cuda if present)")
    p.add_argument("--no-link-measure", action="store_true", help="assume a link fit instead of measuring it")
    p.add_argument("--size", type=_size, action="append", default=[], metavar="KEY=VALUE",
                   help="override a builder argument, e.g. branches=16 (repeatable)")
    p.set_defaults(run=_profile)

    p = sub.add_parser("plan", parents=[common, search], help="search a plan")
    p.add_argument("--cluster", metavar="FILE", help="heterogeneous devices: a cluster file of device classes "
                   "(docs/planner.md); plans a chain of stages, each on devices of one class")
    p.add_argument("--topology", metavar="FILE", help="place the stages on concrete devices: a topology JSON "
                   "(per-pair links) or a hostfile (the cost database's links inside and across hosts)")
    p.add_argument("--objective", choices=("train", "inference"), default="train",
                   help="with --cluster: training throughput, or forward-only pipeline throughput (EdgePipe)")
    p.add_argument("--method", default="graphpipe", help="graphpipe (default), pipedream, piper, ds-uniform, "
                   "ds-parameters, pipedream-2bw (PipeDream-2BW's planner, for the 2bw schedule)")
    p.add_argument("--zero", type=_zero_stages, metavar="auto|0|1|2|3",
                   help="ZeRO stage to price the plan with (DeepSpeed's zero_optimization.stage; default 0); auto: "
                   "the lowest stage unless a higher one is faster because memory binds")
    p.add_argument("--tp", type=_tp_degrees, metavar="auto|1,2,4",
                   help="graphpipe: tensor-parallel degrees a stage may run (default 1); auto: powers of two up "
                   "to a node's devices. The printed config carries the choice (graph_pipeline.stage_tp)")
    p.add_argument("--tp-across-nodes", action="store_true", help="with --tp: let a TP group span nodes")
    p.add_argument("-o", "--output", metavar="PLAN", help="plan JSON to write")
    p.set_defaults(run=_plan)

    p = sub.add_parser("simulate", parents=[common], help="per-stage timeline of a plan")
    p.add_argument("plan", metavar="PLAN", help="plan written by gpp plan")
    p.add_argument("--costs", required=True, help="cost database to price it with")
    p.set_defaults(run=_simulate)

    p = sub.add_parser("compare", parents=[common, search], help="every planner on the same inputs")
    p.add_argument("--methods", type=_names, metavar="A,B", help="default: graphpipe and every baseline")
    p.set_defaults(run=_compare)

    pictures = argparse.ArgumentParser(add_help=False)
    pictures.add_argument("-o", "--output-dir", default=".", metavar="OUTDIR", help="folder to write into (default: .)")
    pictures.add_argument("--format", choices=("png", "svg", "both"), default="png",
                          help="picture format (default: png)")

    p = sub.add_parser("viz", parents=[common, pictures], help="draw a plan's DAGs and simulated schedule")
    p.add_argument("plan", metavar="PLAN", help="plan written by gpp plan")
    p.add_argument("--costs", required=True, help="cost database to price it with")
    p.set_defaults(run=_viz)

    p = sub.add_parser("viz-run", parents=[common, pictures], help="draw a real run's schedule from its traces")
    p.add_argument("trace_dir", metavar="TRACE_DIR", help="the run's graph_pipeline.trace_dir")
    p.add_argument("--step", type=int, help="training step to draw (default: the last one traced)")
    p.set_defaults(run=_viz_run)
    return parser
