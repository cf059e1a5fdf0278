"""Before and after zbv took ZB-V's rule for its order (7beaf17): zbv on each of peers.py's
topologies, torch's ZBV beside, one launch of 8 gloo ranks per topology, medians of rounds 3..8.

* ``ZB-V's rule (now)``: micro-batch by micro-batch, a micro-batch beginning on a rank while the
  rank keeps room for one begun there; the fold the search picks;
* ``zbv in a V, ZB-V's rhythm (now)``: on the DAGs, the V of the stages in order, where zbv runs
  ZB-V's rhythm (7789478; on the chain the search's fold is that V);
* ``zbv in a V, the greedy order (7beaf17)``: the same V under the greedy order (ZB-V's rule);
* ``Megatron's rule (before)``: groups of 8 micro-batches, each reserving on a rank every stage it
  will pass there, no ZB-V's own order; the fold the search picks so (with today's tie-break and
  caps);
* ``torch ZBVZeroBubble``: the same layers as a chain, a V of 16 half-layer stages.

Each of our rows gives its simulated step too (our simulator, the layers' sleeps, messages free
and at 1 ms) and its peak in flight (the most micro-batch activations a rank holds, in layers).

    python benchmarks/zbv_order.py [--topologies four_branches,two_branches,chain]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
import peers  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "zbv_order.json"
NOW, V_RHYTHM, GREEDY, BEFORE, TORCH = (
    "zbv, ZB-V's rule (now)", "zbv in a V, ZB-V's rhythm (now)", "zbv in a V, the greedy order (7beaf17)",
    "zbv, Megatron's rule (before)", "torch ZBVZeroBubble")
ROUNDS = 8


@contextlib.contextmanager
def greedy_only(megatron: bool):
    """zbv's orders without ZB-V's rhythm (as at 7beaf17), and with Megatron's rule in the greedy
    order too if ``megatron`` (as before 7beaf17)."""
    from gpp_deepspeed.errors import ScheduleError
    from gpp_deepspeed.schedule import virtual

    def no_rhythm(*args):
        raise ScheduleError("the greedy order only")

    rank_orders, rhythm = virtual.rank_orders, virtual.zbv_rhythm
    virtual.zbv_rhythm = no_rhythm
    if megatron:
        virtual.rank_orders = lambda *a, **k: rank_orders(*a, **{**k, "by_microbatch": False})
    try:
        yield
    finally:
        virtual.rank_orders, virtual.zbv_rhythm = rank_orders, rhythm


def simulated(topology: str, fold, caps) -> list[float]:
    """The row's step in our simulator (free messages, 1 ms a message), its program as the engine
    builds it (under the rule in force)."""
    from gpp_deepspeed.schedule import build_program, simulate
    from gpp_deepspeed.schedule.greedy import Fold

    graph, duration = peers.half_stage_graph(topology), peers.sleeps(topology, True)
    program = build_program(graph, peers.M, schedule="zbv", fold=Fold(tuple(fold)), duration=duration,
                            max_in_flight=caps)
    return [simulate(program.actions, duration=duration, latency=lat, rank_of=tuple(fold)).makespan
            for lat in (0.0, 0.001)]


def build(topology: str, unit, dag, label: str):
    """Our engine for row ``label``: (step, metadata)."""
    from torch import nn

    import gpp_deepspeed
    from gpp_deepspeed import GraphLayerSpec, GraphPipelineModule
    from gpp_deepspeed.schedule.greedy import Fold

    num_branches = len(peers.TOPOLOGIES[topology][0])
    rows = peers.half_layer_rows(topology)
    rule = greedy_only(label == BEFORE) if label in (GREEDY, BEFORE) else contextlib.nullcontext()
    with rule:
        if label in (V_RHYTHM, GREEDY):
            fold, caps = list(Fold.v_shape(num_stages=len(rows)).rank_of), None
        else:
            choice = peers.searched_fold(topology, "zbv")
            fold, caps = list(choice.fold.rank_of), list(choice.max_in_flight) if choice.max_in_flight else None
        layers = [GraphLayerSpec(r["name"], unit, peers.DIM, num_branches, r["branch"], r["merge"], 0.5, r["source"],
                                 False, inputs=r["inputs"]) for r in rows]
        module = GraphPipelineModule(layers, input_names=[f"x{b}" for b in range(num_branches)],
                                     num_stages=len(rows), loss_fn=nn.MSELoss(),
                                     partition_method={r["name"]: i for i, r in enumerate(rows)}, fold=fold)
        cfg = peers._ds_config() | {"graph_pipeline": {
            "schedule": "zbv", "print_stage_graph": False, "print_idle_fractions": False,
            "stage_times": peers.stage_times(topology, len(rows), True), **({"max_in_flight": caps} if caps else {})}}
        engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
        meta = {"fold": fold, "max_in_flight": caps, "simulated": simulated(topology, fold, caps)}
    return engine, meta


def worker(topology: str, out: str) -> None:
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    unit = peers.sleep_unit_class()
    dag, _, batch = peers.batches(len(peers.TOPOLOGIES[topology][0]))
    steps, meta, engines = {}, {}, {}
    # On the chain the search's fold is the V, where zbv runs ZB-V's rhythm.
    for label in (NOW, GREEDY, BEFORE) if topology == "chain" else (NOW, V_RHYTHM, GREEDY, BEFORE):
        engines[label], meta[label] = build(topology, unit, dag, label)
        steps[label] = lambda engine=engines[label]: engine.train_batch(data_iter=iter(dag))
    steps[TORCH] = peers.build_torch(topology, "ZBVZeroBubble", unit, batch)[0]
    times = peers.timed_rounds(steps, ROUNDS)
    for label, engine in engines.items():   # from the instructions its last batch ran
        meta[label]["peak"] = max(peers.ours_in_flight(engine))
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps({"times": times, "meta": meta}, indent=1))


def table(results: dict) -> str:
    lines = ["| model | engine | fold | simulated: free / 1 ms a message (ms) | peak in flight | median step (ms) "
             "| step / torch's |", "|---|---|---|---|---|---|---|"]
    for topology, result in results.items():
        if topology == "load_average":
            continue
        times, meta = result["times"], result["meta"]
        med = {label: statistics.median(steps[2:]) for label, steps in times.items()}
        for label in times:
            m = meta.get(label)
            sim = " / ".join(f"{x * 1e3:,.0f}" for x in m["simulated"]) if m else ""
            lines.append(f"| {peers.TITLES[topology]} | {label} | {m['fold'] if m else 'V'} | {sim} | "
                         f"{m['peak'] if m else 8} | {med[label] * 1e3:,.0f} | {med[label] / med[TORCH]:.3f} |")
    return "\n".join(lines)


READING = """**Reading it** (every launch at 765a007). ZB-V's rule makes `zbv`'s greedy order shorter on
both DAGs (simulated 810 against 840 ms on four branches, 990 against 1,020 on two): on four
branches the search's fold runs 3.6% faster than before (1,068 against 1,108 ms), 1.10x faster
than torch's `ZBVZeroBubble` (1,173) at 7.5 layers' micro-batches a rank against 8; on two branches
1.5% (1,282 against 1,301). In a V, ZB-V's rhythm (each `I` with its `W` right after it, counts
from the stage depths) computes as fast as the greedy order and is less exposed to message
latency (simulated at 1 ms a message: 1,059 against 1,110 ms on two branches, 1,050 against 1,090
on four, 1,077 against 1,122 on the chain), and runs 2-4% faster: 1,255 against 1,303 ms on two
branches, 1,259 against 1,285 on four, 1,306 against 1,346 on the chain (1.045x torch's V, where
the looped fold before ran 1.088x). On two branches the V under the rhythm (1,010 ms simulated)
beats the fold the search picks (990 simulated, 1,282 measured): the search prices messages as
free, which favours the greedy order's tighter fold. `zbv_in_flight.py`'s table above predates
these changes."""


def write_section() -> None:
    """``results/zbv_order.md`` (the docs' section) from the last launches' JSON."""
    results = json.loads(OUT.read_text())
    first, bullets, rows = __doc__.replace("``", "`").split("\n\n")[:3]
    doc = " ".join(first.split()) + "\n\n" + bullets + "\n\n" + " ".join(rows.split())
    loads = ", ".join(f"{peers.TITLES[t]} {a:.1f} to {b:.1f}" for t, (a, b) in results["load_average"].items())
    OUT.with_suffix(".md").write_text(
        f"## zbv's order: ZB-V's rule against Megatron's (zbv_order.py)\n\n`python benchmarks/zbv_order.py`: {doc} "
        f"Torch's peak in flight is ZB-V's `2p` half-stage micro-batches (8 layers'). One-minute load average at "
        f"the start and end of each launch: {loads}.\n\n{table(results)}\n\n{READING}\n")
    print(table(results))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        from dist import launch

        parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        parser.add_argument("--topologies", default=",".join(peers.TOPOLOGIES))
        args = parser.parse_args()
        # Topologies not run this time keep their last launch's results.
        results = json.loads(OUT.read_text()) if OUT.exists() else {}
        loads = results.pop("load_average", {})
        for topology in args.topologies.split(","):
            part = OUT.with_name(f"zbv_order_{topology}.json")
            start = os.getloadavg()[0]
            launch(8, Path(__file__), "--worker", topology, str(part), timeout=1800,
                   log_dir=ROOT / "benchmarks" / "results" / "tmp" / "logs" / "zbv_order")
            results[topology], loads[topology] = json.loads(part.read_text()), (start, os.getloadavg()[0])
            part.unlink()
        OUT.write_text(json.dumps({**results, "load_average": loads}, indent=1))
        write_section()
