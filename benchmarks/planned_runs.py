"""Planned runs: GraphPipe's full-space plan and the best sequential baseline, run for real on 16 ranks.

For each of the paper's multi-branch models (analytic costs of V100s on Summit, 16 devices,
mini-batch 16 x 16 = 256), GraphPipe's plan (``--space full``: per-stage degrees) and the best plan
of the sequential baselines (PipeDream, Piper, DeepSpeed's partitions; the one the simulator
predicts fastest) are each trained on 16 gloo ranks, loaded exactly as a user would
(``partition_method="plan.json"``, the plan's devices per stage).

Layers are sleep-emulated: each layer of the model is a small linear layer whose forward and
backward sleep for the layer's analytic time on the rank's shard (``b / n_s`` samples), every time
scaled by one factor so that GraphPipe's simulated step takes about one second. Sleeping occupies a
rank without a core, so 16 ranks on a 2-core machine keep the plan's timing. The simulator times
the same plans on the same scaled layer times with free links (the emulated tensors are a few
bytes), so "measured / simulated" is what the engine adds over the schedule (transfers, Python,
the shared CPU) and the two speed-ups compare like with like.

    python benchmarks/planned_runs.py      # writes benchmarks/results/planned_runs.json + docs section

DLRM is built with 8 dense and 8 sparse branches, so GraphPipe's plan has a stage with a fan-in of 8.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

WORLD, PER_DEVICE, TARGET_S, DIM = 16, 16, 1.0, 8
BASELINE_NAMES = ("pipedream", "piper", "ds-uniform", "ds-parameters")


def models():
    from gpp_deepspeed.models import candle_uno, dlrm, multimodal_transformer
    return {"mmt": multimodal_transformer(), "dlrm (8+8 branches)": dlrm(dense_branches=8, sparse_branches=8),
            "candle_uno": candle_uno()}


def emulated_db(db, scale):
    """``db`` with every layer time multiplied by ``scale`` and free links."""
    from gpp_deepspeed.planner import CommFit
    free = CommFit(alpha_s=0.0, beta_s_per_byte=0.0)
    layers = tuple(dataclasses.replace(c, fwd_s=tuple(t * scale for t in c.fwd_s), bwd_s=tuple(t * scale for t in c.bwd_s))
                   for c in db.layers)
    hw = dataclasses.replace(db.hardware, intra=free, inter=free, memory_bytes=10**18)
    return dataclasses.replace(db, layers=layers, hardware=hw, source=f"{db.source}; x{scale:.4g}, free links")


def plan_model(name, desc):
    """GraphPipe's plan, the best sequential baseline's, and the emulation's cost database."""
    from gpp_deepspeed.models import V100_SUMMIT, analytic_costs
    from gpp_deepspeed.planner.baselines import BASELINES
    from gpp_deepspeed.planner.search import graphpipe_search
    from gpp_deepspeed.planner.simulate import predict

    db = analytic_costs(desc, V100_SUMMIT)
    mini_batch = PER_DEVICE * WORLD
    gpp = graphpipe_search(db, num_devices=WORLD, mini_batch=mini_batch).plan
    found = [BASELINES[m](db, num_devices=WORLD, mini_batch=mini_batch) for m in BASELINE_NAMES]
    spp = min((r.plan for r in found if r.plan is not None), key=lambda p: p.predicted.iteration_time_s)
    unit = predict(gpp, emulated_db(db, 1.0)).predicted.iteration_time_s
    emu = emulated_db(db, TARGET_S / unit)
    return emu, {"graphpipe": predict(gpp, emu), "sequential": predict(spp, emu)}


def fan_in(plan) -> int:
    counts = collections.Counter(dst for _, dst in plan.stage_edges)
    return max(counts.values(), default=0)


# -- the worker: one plan on 16 ranks -------------------------------------------------------------

def build_layers(db, plan):
    import torch
    from torch import nn
    from gpp_deepspeed import GraphLayerSpec

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, fwd_s, bwd_s):
            ctx.bwd_s = bwd_s
            time.sleep(fwd_s)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(ctx.bwd_s)
            return grad, None, None

    class Emulated(nn.Module):
        """A linear layer over the sum of its inputs that sleeps for the layer's time."""

        def __init__(self, fwd_s, bwd_s):
            super().__init__()
            self.lin = nn.Linear(DIM, DIM)
            self.fwd_s, self.bwd_s = fwd_s, bwd_s

        def forward(self, *xs):
            return Sleep.apply(self.lin(sum(xs)), self.fwd_s, self.bwd_s)

    stage_of = plan.stage_of
    layers = []
    for c in db.layers:
        shard = plan.micro_batch / plan.stages[stage_of[c.name]].devices
        fwd_s, bwd_s = c.times(shard)
        inputs = list(dict.fromkeys(ref.split(":")[0].split(".")[0] for ref in c.inputs))
        layers.append(GraphLayerSpec(c.name, Emulated, fwd_s, bwd_s, inputs=inputs))
    return layers


def worker(plan_path, costs_path, steps, out):
    import torch
    from torch import nn
    import deepspeed
    import gpp_deepspeed
    from gpp_deepspeed import GraphPipelineModule
    from gpp_deepspeed.planner import CostDB, Plan

    deepspeed.init_distributed(dist_backend="gloo")
    db, plan = CostDB.load(costs_path), Plan.load(plan_path)
    module = GraphPipelineModule(build_layers(db, plan), input_names=db.input_names, output=db.output,
                                 loss_fn=nn.MSELoss(), partition_method=plan_path)
    cfg = {"train_micro_batch_size_per_gpu": plan.micro_batch, "gradient_accumulation_steps": plan.num_microbatches,
           "steps_per_print": 10**6, "zero_optimization": {"stage": 0}, "zero_allow_untested_optimizer": True,
           "graph_pipeline": {"print_stage_graph": False, "print_idle_fractions": False}}
    params = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = gpp_deepspeed.initialize(model=module, optimizer=torch.optim.SGD(params, lr=1e-3),
                                          model_parameters=params, config=cfg)
    g = torch.Generator().manual_seed(0)
    data = [(tuple(torch.randn(plan.micro_batch, DIM, generator=g) for _ in db.input_names),
             torch.randn(plan.micro_batch, DIM, generator=g)) for _ in range(plan.num_microbatches)]
    data = [(x[0] if len(x) == 1 else x, y) for x, y in data]
    times = []
    for _ in range(steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        engine.train_batch(data_iter=iter(data))
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
    if torch.distributed.get_rank() == 0:
        edges = {(e.src, e.dst) for e in engine.stage_graph.edges}
        chain = edges == {(s, s + 1) for s in range(plan.num_stages - 1)}
        Path(out).write_text(json.dumps({"times": times, "ran_as_chain": chain}))
    torch.distributed.destroy_process_group()


# -- the driver -----------------------------------------------------------------------------------

def run_plan(plan, emu, steps, tmp: Path, tag: str) -> dict:
    from dist import launch

    plan_path, costs_path, out = tmp / f"{tag}.plan.json", tmp / f"{tag}.costs.json", tmp / f"{tag}.out.json"
    plan.save(plan_path)
    emu.save(costs_path)
    res = launch(WORLD, Path(__file__), "--worker", str(plan_path), "--costs", str(costs_path), "--steps", str(steps),
                 "--out", str(out), timeout=900, log_dir=tmp / "logs" / tag)
    if not res.ok:
        raise SystemExit(f"{tag} failed:\n{res.report()}")
    data = json.loads(out.read_text())
    data["median_s"] = statistics.median(data["times"][1:])
    return data


def main():
    parser = argparse.ArgumentParser(description="GraphPipe and sequential plans, measured on 16 ranks")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--models", default=None, help="comma-separated subset of the models")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--costs", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.costs, args.steps, args.out)
    chosen = models() if args.models is None else {k: v for k, v in models().items() if k in args.models.split(",")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpp_planned_runs_") as tmp_dir:
        for name, desc in chosen.items():
            emu, plans = plan_model(name, desc)
            for kind, plan in plans.items():
                tag = f"{name.split()[0]}_{kind}"
                data = run_plan(plan, emu, args.steps, Path(tmp_dir), tag)
                row = {"model": name, "kind": kind, "method": plan.method, "pipeline": plan.pipeline,
                       "ran_as_chain": data["ran_as_chain"], "degrees": [s.devices for s in plan.stages],
                       "micro_batch": plan.micro_batch, "micro_batches": plan.num_microbatches,
                       "fan_in": fan_in(plan), "measured_s": data["median_s"], "times_s": data["times"],
                       "simulated_s": plan.predicted.iteration_time_s}
                rows.append(row)
                print(f"{name:20s} {kind:10s} {plan.method:14s} measured {row['measured_s']:.3f} s  simulated "
                      f"{row['simulated_s']:.3f} s  ratio {row['measured_s'] / row['simulated_s']:.3f}", flush=True)
    out = ROOT / "benchmarks" / "results" / "planned_runs.json"
    if args.models is not None and out.exists():  # a subset rerun keeps the other models' rows
        rows = [r for r in json.loads(out.read_text()) if r["model"] not in chosen] + rows
    out.write_text(json.dumps(rows, indent=1))
    write_section(rows)


def write_section(rows):
    by_model = collections.defaultdict(dict)
    for r in rows:
        by_model[r["model"]][r["kind"]] = r
    table = ["| model | plan | stages (ranks each) | fan-in | b x M | ran as | measured (s) | simulated (s) | "
             "measured / simulated |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = "chain" if r["ran_as_chain"] else "stage DAG"
        table.append(f"| {r['model']} | {r['kind']} ({r['method']}, {r['pipeline']}) | {len(r['degrees'])} "
                     f"({r['degrees']}) | {r['fan_in']} | {r['micro_batch']} x {r['micro_batches']} | {shape} | "
                     f"{r['measured_s']:.3f} | {r['simulated_s']:.3f} | {r['measured_s'] / r['simulated_s']:.3f} |")
    speed = ["| model | GPP / SPP measured | GPP / SPP predicted | measured / predicted |", "|---|---|---|---|"]
    for model, kinds in by_model.items():
        if {"graphpipe", "sequential"} <= set(kinds):
            g, s = kinds["graphpipe"], kinds["sequential"]
            measured, predicted = s["measured_s"] / g["measured_s"], s["simulated_s"] / g["simulated_s"]
            speed.append(f"| {model} | {measured:.3f} | {predicted:.3f} | {measured / predicted:.3f} |")
    chains = [r for r in rows if r["pipeline"] == "chain"]
    note = ""
    if any(not r["ran_as_chain"] for r in chains):
        note = ("\nThe sequential plans are priced as chains (every skip tensor relayed through the stages in "
                "between) but this engine ran them as their stage DAG (no relays): true chains were not in the "
                "engine when these figures were taken, so the sequential runs are a stage DAG over the baseline's "
                "stages, not the chain the simulator times.\n")
    text = ("## Planned runs: GraphPipe vs the best sequential plan, measured on 16 ranks\n\n"
            f"`python benchmarks/planned_runs.py`. {WORLD} gloo ranks on a shared 2-core CPU machine, plans "
            f"from the analytic V100 cost database (mini-batch {PER_DEVICE * WORLD}), loaded as plan files and run "
            "with their devices per stage; layers sleep for their analytic time on the rank's shard, scaled so "
            f"GraphPipe's simulated step is about {TARGET_S:g} s. Medians over steps 2..N of one run; the simulator "
            "times the same plans on the same sleeps with free links. Goals (issue 8): measured / simulated at "
            "most 1.05, measured speed-up within 10% of the predicted one. Run on the quiet machine (nothing "
            "else running; `--steps 6`): the gap is largest on MMT, whose stages have 4 ranks each; its cause "
            "(data-parallel all-reduce, resharding messages, or 16 processes on 2 cores) is not yet separated.\n\n"
            + "\n".join(table) + "\n\n"
            + "\n".join(speed) + "\n" + note)
    (ROOT / "benchmarks" / "results" / "planned_runs.md").write_text(text)
    import report
    report.main()


if __name__ == "__main__":
    main()
