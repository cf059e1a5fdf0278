"""Step time of the graph pipeline engine versus DeepSpeed's PipelineEngine, on real processes.

Layers whose forward and backward sleep for a set time stand in for device compute (they occupy a
rank without using a core), so 4-rank pipeline timings are meaningful on a 2-core machine. Each
configuration trains ``--steps`` batches on 4 gloo ranks; the table reports the median step time
after the first step, the makespan the schedule simulator predicts for the same sleeps, and ratios
measured side by side in this one run.

    python benchmarks/step_time.py            # writes benchmarks/results/step_time.json + docs table

Configurations (micro-batches M = 8, forward 10 ms and backward 20 ms per sleeping layer):

* ``chain/deepspeed``: 8 layers as a plain DeepSpeed list in ``PipelineModule`` + ``PipelineEngine``;
* ``chain/gpp``: the same list in ``GraphPipelineModule`` + ``GraphPipelineEngine`` (the overhead);
  both chains of identical layers are cut evenly, 2 layers per stage (DeepSpeed's "parameters" cut
  crashes with seed_layers=True in 0.19.8: numpy cut points reach random.seed);
* ``branches/sequential``: 4 branches x 2 layers, then a merge and a head, cut as a chain
  (``partition_method="sequential"``, the list interleaves the branches as a linearised model would);
* ``branches/gpp``: the same model with the default branch-aware ``"parameters"`` partition (stage
  graph of depth 2);
* ``towers/trained`` and ``towers/frozen``: an image tower of 4 layers (stages 0 and 1) and a text
  tower of 2 (stage 2) joined by a head (stage 3), trained whole, then with the image tower frozen
  (``requires_grad=False``, the common fine-tuning setup). The frozen run's image stages run no
  backward and exchange no gradient; the table beside counts, per stage, the backward passes and the
  gradient messages of one measured step (from the engine's own instruction timeline).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TF, TB, M, MBS, STAGES = 0.010, 0.020, 8, 4, 4
CONFIGS = ["chain/deepspeed", "chain/gpp", "branches/sequential", "branches/gpp", "towers/trained", "towers/frozen"]
TOWERS = {"v0": 0, "v1": 0, "v2": 1, "v3": 1, "t0": 2, "t1": 2, "merge": 3, "head": 3}  # explicit stages


def model_layers(kind, frozen=False):
    import torch
    from torch import nn
    from deepspeed.pipe import LayerSpec
    from gpp_deepspeed import GraphLayerSpec

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(TF)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(TB)
            return grad

    class SleepLinear(nn.Module):
        def __init__(self, dim, frozen=False):
            super().__init__()
            self.lin = nn.Linear(dim, dim).requires_grad_(not frozen)

        def forward(self, x):
            return Sleep.apply(self.lin(x))

    class Add(nn.Module):
        def forward(self, *xs):
            return sum(xs)

    if kind == "chain":
        return [LayerSpec(SleepLinear, 16) for _ in range(8)], None
    if kind == "towers":
        chain = lambda names, first, lock: [GraphLayerSpec(n, SleepLinear, 16, lock, inputs=[p])  # noqa: E731
                                            for n, p in zip(names, [first, *names[:-1]])]
        return [*chain(["v0", "v1", "v2", "v3"], "image", frozen), *chain(["t0", "t1"], "text", False),
                GraphLayerSpec("merge", Add, inputs=["v3", "t1"]), GraphLayerSpec("head", nn.Linear, 16, 16, inputs=["merge"])
                ], ["image", "text"]
    layers = []
    for step in range(2):  # interleaved, as a linearised multi-branch model lists its layers
        for b in range(4):
            layers.append(GraphLayerSpec(f"b{b}_{step}", SleepLinear, 16, inputs=[f"b{b}_0" if step else "x"]))
    layers += [GraphLayerSpec("merge", Add, inputs=[f"b{b}_1" for b in range(4)]),
               GraphLayerSpec("head", nn.Linear, 16, 16, inputs=["merge"])]
    return layers, ["x"]


def worker(config, steps, out):
    import torch
    from torch import nn
    import deepspeed
    import gpp_deepspeed
    from deepspeed.pipe import PipelineModule
    from gpp_deepspeed import GraphPipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    kind, method = config.split("/")
    layers, inputs = model_layers(kind, frozen=method == "frozen")
    if method == "deepspeed":
        module = PipelineModule(layers, num_stages=STAGES, loss_fn=nn.MSELoss(), partition_method="uniform",
                                seed_layers=True)
    else:
        partition = {"sequential": "sequential", "trained": TOWERS, "frozen": TOWERS}.get(method, "parameters")
        module = GraphPipelineModule(layers, input_names=inputs or ["input"], num_stages=STAGES, loss_fn=nn.MSELoss(),
                                     partition_method=partition)
    cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": M, "steps_per_print": 10**6,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "graph_pipeline": {"print_stage_graph": False}}
    init = deepspeed.initialize if method == "deepspeed" else gpp_deepspeed.initialize
    if method == "deepspeed":
        cfg.pop("graph_pipeline")
    engine, *_ = init(model=module, model_parameters=[p for p in module.parameters() if p.requires_grad], config=cfg)
    data = [((torch.randn(MBS, 16), ) * (len(inputs or [0])), torch.randn(MBS, 16)) for _ in range(M)]
    data = [(x[0] if len(x) == 1 else x, y) for x, y in data]
    times = []
    for _ in range(steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        engine.train_batch(data_iter=iter(data))
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
    counts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(counts, _backward_counts(engine))
    if torch.distributed.get_rank() == 0:
        depth = engine.stage_graph.pipeline_depth if hasattr(engine, "stage_graph") else STAGES
        Path(out).write_text(json.dumps({"times": times, "depth": depth, "predicted": predicted(engine),
                                         "backward": counts}))
    torch.distributed.destroy_process_group()


def _backward_counts(engine):
    """(backward passes, gradient messages sent or received) in the engine's last measured step."""
    if not hasattr(engine, "last_timeline"):
        return None
    ops = [op for a, _, _ in engine.last_timeline for op in (a.ops or (a, ))]
    return (sum(op.kind.value in ("B", "I") for op in ops), sum(op.kind.value in ("SEND_B", "RECV_B") for op in ops))


def predicted(engine):
    """Simulated makespan of the schedule with the same sleeps (the chain formula for DeepSpeed)."""
    from gpp_deepspeed.graph import StageGraph
    from gpp_deepspeed.schedule import ActionKind, build_schedule, simulate

    if not hasattr(engine, "stage_graph"):
        sg, per_stage = StageGraph.chain(STAGES), [2] * STAGES
    else:
        sg = engine.stage_graph
        per_stage = [sum(1 for n in spec.layers if not n.startswith(("merge", "head")))
                     for spec in engine.module.partition.stages]
    sched = build_schedule(sg, M)

    def duration(a):
        k = per_stage[a.stage_idx]
        return {ActionKind.FORWARD: TF * k, ActionKind.BACKWARD: TB * k}.get(a.kind, 0.0)

    return simulate(sched, duration=duration).makespan


def main():
    parser = argparse.ArgumentParser(description="graph pipeline vs DeepSpeed pipeline step time")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.out)

    sys.path.insert(0, str(ROOT / "tests"))
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpp_step_time_") as tmp_dir:   # removed, whatever happens
        for config in CONFIGS:
            results[config] = run_config(config, args.steps, Path(tmp_dir))
    ratios = {
        "gpp / deepspeed on the chain (overhead)": results["chain/gpp"]["median_s"] / results["chain/deepspeed"]["median_s"],
        "sequential / gpp on 4 branches (speed-up)": results["branches/sequential"]["median_s"] / results["branches/gpp"]["median_s"],
        "trained / frozen image tower (speed-up)": results["towers/trained"]["median_s"] / results["towers/frozen"]["median_s"],
    }
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}")
    (ROOT / "benchmarks" / "results" / "step_time.json").write_text(json.dumps({"results": results, "ratios": ratios}, indent=1))
    write_table(results, ratios)


def run_config(config, steps, tmp):
    """Launch one configuration on STAGES gloo ranks; its timings (median after the first step)."""
    from dist import launch

    out = tmp / (config.replace("/", "_") + ".json")
    res = launch(STAGES, Path(__file__), "--worker", config, "--steps", str(steps), "--out", str(out),
                 timeout=300, log_dir=tmp / "logs" / config.replace("/", "_"))
    if not res.ok:
        raise SystemExit(f"{config} failed:\n{res.report()}")
    data = json.loads(out.read_text())
    data["median_s"] = statistics.median(data["times"][1:])
    print(f"{config:22s} median step {data['median_s'] * 1e3:7.1f} ms  predicted {data['predicted'] * 1e3:7.1f} ms"
          f"  depth {data['depth']}", flush=True)
    return data


def write_table(results, ratios):
    rows = ["| configuration | stage-graph depth | median step (ms) | simulated (ms) | measured / simulated |",
            "|---|---|---|---|---|"]
    for name, r in results.items():
        rows.append(f"| `{name}` | {r['depth']} | {r['median_s'] * 1e3:.1f} | {r['predicted'] * 1e3:.1f} | "
                    f"{r['median_s'] / r['predicted']:.3f} |")
    rows += ["", "| ratio (same run) | value |", "|---|---|"] + [f"| {k} | {v:.3f} |" for k, v in ratios.items()]
    rows += ["", "Frozen image tower: per stage, backward passes / gradient messages (sent or received) in one step "
             "(stages 0-1 image tower, 2 text tower, 3 head):", "",
             "| configuration | " + " | ".join(f"stage {s}" for s in range(STAGES)) + " |", "|---" * (STAGES + 1) + "|"]
    for name in ("towers/trained", "towers/frozen"):
        rows.append(f"| `{name}` | " + " | ".join(f"{b} / {g}" for b, g in results[name]["backward"]) + " |")
    (ROOT / "benchmarks" / "results" / "step_time.md").write_text(
        "## Step time: graph pipeline vs DeepSpeed's PipelineEngine (measured)\n\n"
        f"`python benchmarks/step_time.py`. 4 gloo ranks on CPU, M = {M} micro-batches, sleeping layers "
        f"(forward {TF * 1e3:.0f} ms, backward {TB * 1e3:.0f} ms each) stand in for device compute. Medians over "
        "steps 2..N of one run; ratios are from the same run.\n\n" + "\n".join(rows) + "\n")
    import report
    report.main()


if __name__ == "__main__":
    main()
