"""Pictures of a plan and its schedule: layer DAG, stage DAG, Gantt chart and a Chrome trace.

Glossary
--------
layer DAG
    One node per layer (graph inputs in grey), coloured by stage, laid out left to right by
    longest-path depth from the graph inputs.
stage DAG
    One box per stage (index, devices, layers, first and last layer) and one arrow per stage
    edge, labelled with the bytes per sample the destination reads from the source.
Gantt chart
    A :class:`~gpp_deepspeed.schedule.validate.Timeline` drawn one row per stage: forward and
    backward bars with their micro-batch, gradient reduction and optimizer step, and ticks for
    sends and receives. The simulator's timeline and a run's recorded one have the same shape.
Chrome trace
    The same timeline as Trace Event Format JSON for chrome://tracing or ui.perfetto.dev.

Representative signatures::

    draw_layer_dag(db, plan.stage_of, "layer_dag.png")
    draw_stage_dag(plan, db, "stage_dag.svg")
    draw_gantt(simulate_plan(plan, db).timeline, "gantt.png")
    write_chrome_trace(timeline, "trace.json")

matplotlib is imported inside the functions, so importing this module costs nothing; figures
are built on a bare :class:`~matplotlib.figure.Figure` (no pyplot state, no display needed) and
the format follows the path's suffix (``.png``, ``.svg``, ...). SVGs keep text as text.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from .errors import GPPConfigError
from .graph.ir import LayerGraph
from .planner.costs import CostDB, edge_bytes
from .planner.plan import Plan
from .schedule.ir import Action, ActionKind as K
from .schedule.validate import Timeline

__all__ = ["draw_layer_dag", "draw_stage_dag", "draw_gantt", "write_chrome_trace", "stage_edge_bytes",
           "format_bytes", "timeline_from_traces"]

_DPI = 110
_LABEL_LIMIT = 80          # the layer DAG names its nodes up to this many layers
_RC = {"svg.fonttype": "none", "font.size": 8, "axes.titlesize": 10}
_COLORS = {K.FORWARD: "#4C72B0", K.BACKWARD: "#DD8452", K.BACKWARD_INPUT: "#DD8452", K.BACKWARD_WEIGHT: "#8172B3",
           "reduce": "#55A868", "comm": "#444444"}


def format_bytes(num_bytes: float) -> str:
    """Bytes in binary units, three significant digits.

    >>> format_bytes(512), format_bytes(1536), format_bytes(3 * 2**20), format_bytes(1000 * 2**10)
    ('512 B', '1.5 KiB', '3 MiB', '1000 KiB')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    return f"{num_bytes:.0f} B"


def stage_edge_bytes(plan: Plan, db: CostDB) -> dict[tuple[int, int], float]:
    """Bytes per sample on each stage edge ``(src, dst)``, as the engine sends them and the stage
    cost model prices them (:func:`~gpp_deepspeed.planner.costs.edge_bytes`): a chain plan relays
    every tensor that crosses a cut. Raises :class:`~gpp_deepspeed.errors.PartitionError` when the
    plan does not cover ``db``'s layers.
    """
    plan.partition(db.graph)  # the plan's layers are exactly the database's
    return edge_bytes(db, plan.stage_of, relay=plan.pipeline == "chain")


def draw_layer_dag(db_or_graph: CostDB | LayerGraph, stage_of: Mapping[str, int], path: str | Path, *,
                   title: str | None = None) -> Path:
    """Draw the layer DAG coloured by ``stage_of`` (layer name -> stage index) into ``path``.

    Node ``x`` is the longest path from a graph input, ``y`` spreads the nodes of one depth,
    ordered by the mean height of their inputs so that branches stay in rows. Above
    ``_LABEL_LIMIT`` layers the names are left out and the title says so.
    """
    graph = db_or_graph.graph if isinstance(db_or_graph, CostDB) else db_or_graph
    name = db_or_graph.model if isinstance(db_or_graph, CostDB) else "model"
    preds = {n.name: [r.node for r in n.inputs] for n in graph.nodes}
    depth = {i: 0 for i in graph.input_names}
    for layer in graph.list_topological_order():
        depth[layer] = 1 + max((depth[p] for p in preds[layer]), default=-1)
    by_depth: dict[int, list[str]] = defaultdict(list)
    for node in (*graph.input_names, *graph.names):
        by_depth[depth[node]].append(node)
    pos: dict[str, tuple[float, float]] = {}
    for d in sorted(by_depth):
        nodes = by_depth[d]
        key = {n: sum(pos[p][1] for p in preds.get(n, ())) / max(len(preds.get(n, ())), 1) for n in nodes}
        nodes = sorted(nodes, key=lambda n: -key[n]) if d else nodes   # y falls with the index
        for i, n in enumerate(nodes):
            pos[n] = (float(d), (len(nodes) - 1) / 2 - i)
    num_stages = max(stage_of.values(), default=-1) + 1
    labelled = len(graph.names) <= _LABEL_LIMIT
    title = title or f"{name}: {len(graph.names)} layers in {num_stages} stages"
    if not labelled:
        title += f" (layer names omitted above {_LABEL_LIMIT} layers)"
    width = max(len(by_depth[d]) for d in by_depth)
    mpl, Figure, FancyArrowPatch = _mpl()
    with mpl.rc_context(_RC):
        fig = Figure(figsize=(min(2.5 + 0.8 * len(by_depth), 30), min(1.8 + 0.55 * width, 18)))
        ax = fig.add_subplot()
        colors = _stage_colors(num_stages)
        for layer, inputs in preds.items():
            for p in inputs:
                ax.add_patch(FancyArrowPatch(pos[p], pos[layer], arrowstyle="-|>", mutation_scale=8, lw=0.6,
                                             color="#888888", shrinkA=5, shrinkB=5, zorder=1))
        for s in range(num_stages):
            members = [n for n in graph.names if stage_of.get(n) == s]
            ax.scatter([pos[n][0] for n in members], [pos[n][1] for n in members], s=60, color=colors[s],
                       edgecolors="black", linewidths=0.4, zorder=2, label=f"stage {s}")
        ax.scatter([pos[i][0] for i in graph.input_names], [pos[i][1] for i in graph.input_names], s=40,
                   marker="s", color="#CCCCCC", edgecolors="black", linewidths=0.4, zorder=2, label="graph input")
        if labelled:
            for n, (x, y) in pos.items():
                ax.annotate(n, (x, y), xytext=(0, 6), textcoords="offset points", ha="center", va="bottom",
                            fontsize=7, rotation=20 if len(n) > 8 else 0, zorder=3)
        ax.set_xlim(-0.6, max(by_depth) + 0.6)
        ax.set_ylim(-width / 2 - 0.1, width / 2 + 0.4)
        ax.set_axis_off()
        ax.set_title(title)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=7)
        return _save(fig, path)


def draw_stage_dag(plan: Plan, db: CostDB, path: str | Path, *, title: str | None = None) -> Path:
    """Draw one box per stage and the stage edges, labelled with bytes per sample, into ``path``."""
    nbytes = stage_edge_bytes(plan, db)
    depth = [0] * plan.num_stages
    for _ in range(plan.num_stages):   # longest path from a source; stage DAGs are tiny
        for (u, v) in nbytes:
            depth[v] = max(depth[v], depth[u] + 1)
    columns: dict[int, list[int]] = defaultdict(list)
    for s in range(plan.num_stages):
        columns[depth[s]].append(s)
    pos = {s: (float(d), (len(col) - 1) / 2 - i) for d, col in columns.items() for i, s in enumerate(col)}
    rows = max(len(c) for c in columns.values())
    texts = []
    for s, stage in enumerate(plan.stages):
        first, last = _short(stage.layers[0]), _short(stage.layers[-1])
        names = first if len(stage.layers) == 1 else f"{first} .. {last}"
        texts.append(f"stage {s}  x{stage.devices}\n{len(stage.layers)} layers\n{names}")
    # Boxes as wide as their longest line at 8 pt; 1.4 in between columns for the edge labels.
    box_in = max(1.2, 0.3 + 0.075 * max(len(line) for t in texts for line in t.split("\n")))
    col_in = box_in + 1.4
    box_w, box_h = box_in / col_in, 0.7
    mpl, Figure, FancyArrowPatch = _mpl()
    with mpl.rc_context(_RC):
        fig = Figure(figsize=(min(col_in * len(columns) / 0.96, 40), min(0.6 + 1.15 * rows, 18)))
        ax = fig.add_axes((0.02, 0.02, 0.96, 0.9))   # one x unit is one column of col_in inches
        colors = _stage_colors(plan.num_stages)
        for s, text in enumerate(texts):
            x, y = pos[s]
            ax.add_patch(mpl.patches.FancyBboxPatch((x - box_w / 2, y - box_h / 2), box_w, box_h,
                                                    boxstyle="round,pad=0.02", fc=colors[s], alpha=0.35,
                                                    ec="black", lw=0.8))
            ax.text(x, y, text, ha="center", va="center", fontsize=8)
        for (u, v), b in nbytes.items():
            (x0, y0), (x1, y1) = pos[u], pos[v]
            ax.add_patch(FancyArrowPatch((x0 + box_w / 2 + 0.02, y0), (x1 - box_w / 2 - 0.02, y1),
                                         arrowstyle="-|>", mutation_scale=12, lw=1.0, color="#333333"))
            # Just above the arrow's middle: clear of both boxes, converging edges stay apart.
            mx, my = (x0 + x1) / 2, (y0 + y1) / 2
            ax.annotate(f"{format_bytes(b)}/sample", (mx, my), xytext=(0, 3), textcoords="offset points",
                        ha="center", va="bottom", fontsize=7,
                        bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})
        ax.set_xlim(-0.5, max(columns) + 0.5)
        ax.set_ylim(-rows / 2, rows / 2)
        ax.set_axis_off()
        ax.set_title(title or f"{plan.model}: {plan.method} plan, {plan.num_stages} stages on {plan.num_devices} "
                     f"devices, micro-batch {plan.micro_batch} of {plan.mini_batch}")
        return _save(fig, path)


def draw_gantt(timeline: Timeline, path: str | Path, *, title: str | None = None) -> Path:
    """Draw ``timeline`` as a Gantt chart, one row per stage, time in ms, into ``path``.

    F and B bars carry their micro-batch when wide enough; REDUCE_GRAD, REDUCE_TIED and STEP are a
    third colour (a zero-length one is a thin line); sends are ticks above a row, receives below.
    """
    stages = sorted(timeline.spans)
    span_ms = timeline.makespan * 1e3 or 1.0
    fig_w = 11.0
    axis_in = fig_w * 0.8
    mpl, Figure, _ = _mpl()
    with mpl.rc_context(_RC):
        fig = Figure(figsize=(fig_w, 1.3 + 0.55 * len(stages)))
        ax = fig.add_subplot()
        sends, recvs = [], []
        for row, s in enumerate(stages):
            bars = defaultdict(list)
            for a, start, end in timeline.spans[s]:
                t0, dur = start * 1e3, (end - start) * 1e3
                if a.kind is K.FORWARD or a.kind.spec.backward:
                    bars[a.kind].append((t0, dur))
                    text = str(a.mb_idx)
                    if dur / span_ms * axis_in >= 0.06 + 0.07 * len(text):
                        ax.text(t0 + dur / 2, row, text, ha="center", va="center", fontsize=6.5, color="white")
                elif a.kind.spec.collective:
                    bars["reduce"].append((t0, max(dur, span_ms * 1e-3)))
                for op in a.transfers:  # a grouped transfer marks each of its sends and receives
                    if op.kind.spec.send and not op.kind.spec.layout:
                        sends.append((t0, row - 0.38))
                    else:
                        recvs.append((t0, row + 0.38))
            for kind, ranges in bars.items():
                ax.broken_barh(ranges, (row - 0.3, 0.6), facecolors=_COLORS[kind], edgecolor="white",
                               linewidth=0.3)
        for pts, label, marker in ((sends, "send", "v"), (recvs, "recv", "^")):
            if pts:
                ax.scatter(*zip(*pts), marker=marker, s=7, color=_COLORS["comm"], linewidths=0, label=label)
        shown = {a.kind for spans in timeline.spans.values() for a, _, _ in spans}
        legend = [(K.FORWARD, "forward"), (K.BACKWARD, "backward")]
        if K.BACKWARD_WEIGHT in shown:  # a split backward: I in the backward colour, W apart
            legend = [(K.FORWARD, "forward"), (K.BACKWARD_INPUT, "input grad (I)"), (K.BACKWARD_WEIGHT, "weight grad (W)")]
        handles = [mpl.patches.Patch(color=_COLORS[k], label=lbl) for k, lbl in legend + [("reduce", "reduce/step")]]
        ax.legend(handles=handles + ax.get_legend_handles_labels()[0], loc="upper left",
                  bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=7)
        ax.set_yticks(range(len(stages)), [f"stage {s}" for s in stages])
        ax.set_ylim(len(stages) - 0.5, -0.5)
        ax.set_xlim(0, span_ms * 1.01)
        ax.set_xlabel("time (ms)")
        ax.grid(axis="x", lw=0.3, alpha=0.5)
        num_mb = len({a.mb_idx for spans in timeline.spans.values() for a, _, _ in spans if a.kind is K.FORWARD})
        ax.set_title(title or f"schedule: {len(stages)} stages, {num_mb} micro-batches, "
                     f"{timeline.makespan * 1e3:.2f} ms")
        return _save(fig, path)


def write_chrome_trace(timeline: Timeline, path: str | Path) -> Path:
    """Write ``timeline`` as Trace Event Format JSON (chrome://tracing, ui.perfetto.dev).

    One complete event (``"ph": "X"``) per span, ``ts`` and ``dur`` in microseconds, ``pid`` 0
    and ``tid`` the stage; ``"M"`` events name the threads ``stage N``.
    """
    events: list[dict] = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}}
                          for s in sorted(timeline.spans)]
    for s in sorted(timeline.spans):
        for a, start, end in timeline.spans[s]:
            args = {k: v for k, v in (("mb_idx", a.mb_idx), ("peer", a.peer)) if v is not None}
            events.append({"name": str(a), "cat": a.kind.value, "ph": "X", "ts": start * 1e6,
                           "dur": (end - start) * 1e6, "pid": 0, "tid": s, "args": args})
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def timeline_from_traces(folder: str | Path, *, step: int | None = None) -> tuple[Timeline, int]:
    """One training step of a real run as a :class:`Timeline`, from the ``rank<r>.json`` traces
    the engine writes with ``graph_pipeline.trace_dir``; ``step`` defaults to the last one
    recorded. Times are seconds from the step's first instruction on any rank (the ranks of one
    machine share ``perf_counter``'s clock; traces from several machines are not aligned)."""
    files = sorted(Path(folder).glob("rank*.json"))
    if not files:
        raise GPPConfigError(f'no rank*.json trace files in "{folder}"; train with graph_pipeline.trace_dir set')
    events = [e for f in files for e in json.loads(f.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = sorted({e["args"]["step"] for e in events})
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise GPPConfigError(f"step {step} is not in the traces of {folder}; recorded steps: {steps}")
    mine = [e for e in events if e["args"]["step"] == chosen]
    t0 = min(e["ts"] for e in mine)
    spans: dict[int, list] = {}
    for e in sorted(mine, key=lambda e: e["ts"]):
        start = (e["ts"] - t0) / 1e6
        spans.setdefault(e["tid"], []).append((Action.parse(e["name"]), start, start + e["dur"] / 1e6))
    return Timeline(dict(sorted(spans.items()))), chosen


def _mpl():
    """matplotlib, Figure and FancyArrowPatch, loaded on first use."""
    import matplotlib
    import matplotlib.patches
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch

    return matplotlib, Figure, FancyArrowPatch


def _stage_colors(num_stages: int) -> list:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if num_stages <= 10 else "tab20"]
    return [cmap(s % cmap.N) for s in range(num_stages)]


def _short(name: str, limit: int = 18) -> str:
    return name if len(name) <= limit else name[: limit - 2] + ".."


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")
    return path
