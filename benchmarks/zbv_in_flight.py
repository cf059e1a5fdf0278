"""Before and after zbv let every rank hold what the fold's fullest rank may: zbv on peers.py's four
branches, torch's ZBV beside, one launch of 8 gloo ranks, medians of rounds 3..8.

* ``shared cap (now)``: the fold the search picks, every rank at the fold's largest bound
  (``fold_in_flight``, the default);
* ``own caps, same fold``: that fold, each rank at its own bound (``rank_in_flight``, set with
  ``graph_pipeline.max_in_flight``);
* ``own caps, their fold (before)``: what ran before, the fold the search picks when every rank has
  its own bound, under those caps;
* ``torch ZBVZeroBubble``: the same layers as a chain, a V of 16 half-layer stages.

Each row gives its simulated step too (our simulator, the layers' sleeps, messages free and at 1 ms).

    python benchmarks/zbv_in_flight.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
import peers  # noqa: E402

TOPO = "four_branches"
OUT = ROOT / "benchmarks" / "results" / "zbv_in_flight.json"


def variants() -> dict[str, tuple[list[int], list[int] | None]]:
    """Each of our rows: (fold, max_in_flight or None for the default)."""
    from gpp_deepspeed.schedule import virtual
    from gpp_deepspeed.schedule.greedy import rank_in_flight

    graph = peers.half_stage_graph(TOPO)
    own = lambda fold: [rank_in_flight(graph, fold, r) for r in range(fold.num_ranks)]  # noqa: E731
    now = peers.searched_fold(TOPO, "zbv")
    shared = virtual.fold_in_flight
    virtual.fold_in_flight = lambda g, f: {r: rank_in_flight(g, f, r) for r in range(f.num_ranks)}
    try:   # the search as it was: every fold's zbv priced with each rank at its own bound
        before = peers.searched_fold(TOPO, "zbv").fold
    finally:
        virtual.fold_in_flight = shared
    return {"zbv, shared cap (now)": (list(now.fold.rank_of), list(now.max_in_flight) if now.max_in_flight else None),
            "zbv, own caps, same fold": (list(now.fold.rank_of), own(now.fold)),
            "zbv, own caps, their fold (before)": (list(before.rank_of), own(before))}


def simulated(fold, caps) -> list[float]:
    """The row's step in our simulator (free messages, 1 ms a message), its program as the engine builds it."""
    from gpp_deepspeed.schedule import build_program, simulate
    from gpp_deepspeed.schedule.greedy import Fold

    graph, duration = peers.half_stage_graph(TOPO), peers.sleeps(TOPO, True)
    program = build_program(graph, peers.M, schedule="zbv", fold=Fold(tuple(fold)), duration=duration,
                            max_in_flight=caps)
    return [simulate(program.actions, duration=duration, latency=lat, rank_of=tuple(fold)).makespan
            for lat in (0.0, 0.001)]


def worker(out):
    import deepspeed
    import torch
    from torch import nn

    import gpp_deepspeed
    from gpp_deepspeed import GraphLayerSpec, GraphPipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    unit = peers.sleep_unit_class()
    dag, _, batch = peers.batches(4)
    rows = peers.half_layer_rows(TOPO)
    steps, meta = {}, {}
    for label, (fold, caps) in variants().items():
        layers = [GraphLayerSpec(r["name"], unit, peers.DIM, 4, r["branch"], r["merge"], 0.5, r["source"], False,
                                 inputs=r["inputs"]) for r in rows]
        module = GraphPipelineModule(layers, input_names=[f"x{b}" for b in range(4)], num_stages=len(rows),
                                     loss_fn=nn.MSELoss(), partition_method={r["name"]: i for i, r in enumerate(rows)},
                                     fold=fold)
        cfg = peers._ds_config() | {"graph_pipeline": {
            "schedule": "zbv", "print_stage_graph": False, "print_idle_fractions": False,
            "stage_times": peers.stage_times(TOPO, len(rows), True), **({"max_in_flight": caps} if caps else {})}}
        engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
        steps[label] = lambda engine=engine: engine.train_batch(data_iter=iter(dag))
        meta[label] = {"fold": fold, "max_in_flight": caps, "simulated": simulated(fold, caps)}
    steps["torch ZBVZeroBubble"] = peers.build_torch(TOPO, "ZBVZeroBubble", unit, batch)[0]
    times = peers.timed_rounds(steps, 8)
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps({"times": times, "meta": meta}, indent=1))


def table(result: dict) -> str:
    times, meta = result["times"], result["meta"]
    lines = ["| zbv on four branches | fold | caps | simulated: free / 1 ms a message (ms) | median step (ms) |",
             "|---|---|---|---|---|"]
    for label, steps in times.items():
        m = meta.get(label, {})
        sim = " / ".join(f"{x * 1e3:,.0f}" for x in m["simulated"]) if m else ""
        caps = "default" if m and not m["max_in_flight"] else str(m.get("max_in_flight", ""))
        lines.append(f"| {label} | {m.get('fold', '')} | {caps} | {sim} | {statistics.median(steps[2:]) * 1e3:,.0f} |")
    return "\n".join(lines)


def write_section() -> None:
    """``results/zbv_in_flight.md`` (the docs' section) from the last launch's JSON."""
    text = table(json.loads(OUT.read_text()))
    doc = " ".join(__doc__.split("\n\n")[0].split()).replace("``", "`")
    OUT.with_suffix(".md").write_text(f"## zbv's in-flight cap (zbv_in_flight.py)\n\n`python benchmarks/zbv_in_flight.py`: "
                                      f"{doc}\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        from dist import launch

        print("load", os.getloadavg()[0])
        launch(8, Path(__file__), "--worker", str(OUT), timeout=1200,
               log_dir=ROOT / "benchmarks" / "results" / "tmp" / "logs" / "zbv_in_flight")
        print("load", os.getloadavg()[0])
        write_section()
