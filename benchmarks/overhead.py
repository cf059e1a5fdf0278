"""The engine's cost per action, against DeepSpeed's PipelineEngine and torch's pipelining runtime.

Two gloo ranks train the same 2-stage chain in one launch, round after round, one step of each
engine per round (so a shared machine's load falls on all alike):

* ``gpp``: ``GraphPipelineModule`` + ``GraphPipelineEngine`` (1F1B);
* ``deepspeed``: the same layers in DeepSpeed's ``PipelineModule`` + ``PipelineEngine``;
* ``torch-runtime``: torch.distributed.pipelining's ``ScheduleInterleaved1F1B`` with one stage per
  rank, which runs on its action-list runtime (``_PipelineScheduleRuntime``);
* ``torch-1f1b``: torch's ``Schedule1F1B`` (its single-stage loop).

Two models: ``tiny`` (four 8x8 linear layers, micro-batches of 2 rows: nearly no compute, so a
step is the runtimes' own work and the messages) and ``sleep`` (layers whose forward sleeps 5 ms
and backward 10 ms: the ratio a user sees). The table gives the median step, the actions each
runtime ran on rank 0 in a step (its instructions), and the step divided by them: the cost per
action on the tiny model, its overhead (including the two ranks' message latency).

    python benchmarks/overhead.py            # writes benchmarks/results/overhead.json + docs table
    python benchmarks/overhead.py --ab DIR   # the before/after table of DIR/{before,after}_<i>.json
                                             # (overhead.json of alternating launches of two commits)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
M, MBS, DIM = 32, 2, 8
ENGINES = ("gpp", "deepspeed", "torch-runtime", "torch-1f1b")
MODELS = {"tiny": (0.0, 0.0), "sleep": (0.005, 0.010)}


def layers(kind):
    import torch
    from torch import nn

    tf, tb = MODELS[kind]

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(tf)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            time.sleep(tb)
            return grad

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(DIM, DIM)

        def forward(self, x):
            y = self.lin(x)
            return Sleep.apply(y) if tf or tb else y

    return Layer


def build(name, kind, rank):
    """(step function, actions rank 0 runs per step) of one engine."""
    import torch
    from torch import nn
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    Layer = layers(kind)
    torch.manual_seed(0)
    data = [(torch.randn(MBS, DIM), torch.randn(MBS, DIM)) for _ in range(M)]
    cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": M, "steps_per_print": 10**6,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}}
    specs = [LayerSpec(Layer) for _ in range(4)]
    if name == "gpp":
        import gpp_deepspeed
        module = gpp_deepspeed.GraphPipelineModule(specs, num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
        engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                              config={**cfg, "graph_pipeline": {"print_stage_graph": False}})
        for _ in range(2):   # the first batch also sends every edge's layout
            engine.train_batch(iter(data))
        return (lambda: engine.train_batch(iter(data))), len(engine.last_timeline)
    if name == "deepspeed":
        module = PipelineModule(specs, num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
        engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)
        actions = sum(len(cmds) for cmds in TrainSchedule(M, 2, 0).steps())
        return (lambda: engine.train_batch(iter(data))), actions
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    stage_module = nn.Sequential(Layer(), Layer())
    opt = torch.optim.SGD(stage_module.parameters(), lr=1e-3)
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    loss = nn.MSELoss()
    if name == "torch-runtime":
        schedule = ScheduleInterleaved1F1B([stage], n_microbatches=M, loss_fn=loss)
        actions = len(schedule.pipeline_order_with_comms[0])
    else:
        schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=loss)
        actions = sum(a is not None for a in schedule.pipeline_order[0]) if hasattr(schedule, "pipeline_order") else None
    x = torch.cat([d[0] for d in data])
    y = torch.cat([d[1] for d in data])

    def step():
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()

    step()
    return step, actions


def worker(kind, rounds, out):
    import torch
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    engines = {name: build(name, kind, rank) for name in ENGINES}
    times = {name: [] for name in ENGINES}
    cpu = {name: [] for name in ENGINES}
    for _ in range(rounds):
        for name, (step, _) in engines.items():
            torch.distributed.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            # This process's CPU time in the step (every thread: gloo's too), before the barrier:
            # the runtime's own work, which a loaded machine stretches in wall time but not here.
            cpu[name].append(time.process_time() - start_cpu)
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - start)
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, cpu)
    if rank == 0:
        Path(out).write_text(json.dumps({name: {"times": times[name], "actions": engines[name][1],
                                                "cpu": [c[name] for c in every]} for name in ENGINES}))
    torch.distributed.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description="cost per action: ours, DeepSpeed's and torch's runtimes")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ab", help="print the before/after table of the launches in this folder")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.rounds, args.out)
    if args.ab:
        return print(ab_table(Path(args.ab)))
    sys.path.insert(0, str(ROOT / "tests"))
    from dist import launch

    results = {}
    with tempfile.TemporaryDirectory(prefix="gpp_overhead_") as tmp:
        for kind in MODELS:
            out = Path(tmp) / f"{kind}.json"
            res = launch(2, Path(__file__), "--worker", kind, "--rounds", str(args.rounds), "--out", str(out),
                         timeout=600, log_dir=Path(tmp) / "logs" / kind)
            if not res.ok:
                raise SystemExit(f"{kind} failed:\n{res.report()}")
            data = json.loads(out.read_text())
            for name, d in data.items():
                d["median_ms"] = 1e3 * statistics.median(d["times"][1:])
                # Per round, this engine's step over DeepSpeed's in the same round: the figure least
                # disturbed by a loaded machine (both ran within seconds of each other).
                d["per_round_ratio"] = statistics.median(
                    t / ds for t, ds in zip(d["times"][1:], data["deepspeed"]["times"][1:]))
                d["cpu_ms"] = 1e3 * sum(statistics.median(c[1:]) for c in d["cpu"])   # both ranks
                d["per_action_us"] = 1e3 * d["median_ms"] / d["actions"] if d["actions"] else None
                print(f"{kind:6s} {name:14s} median {d['median_ms']:8.2f} ms  actions {d['actions']}"
                      + (f"  {d['per_action_us']:7.1f} us/action" if d["per_action_us"] else "")
                      + f"  per-round / DeepSpeed's {d['per_round_ratio']:.3f}  CPU {d['cpu_ms']:.1f} ms", flush=True)
            results[kind] = data
    (ROOT / "benchmarks" / "results" / "overhead.json").write_text(json.dumps(results, indent=1))
    write_section(results, args.rounds)


def ab_table(folder: Path) -> str:
    """Before against after: ``folder/{before,after}_<i>.json`` are the ``overhead.json`` of
    alternating launches of two commits; every figure is a ratio to DeepSpeed's engine in the same
    launch, the median over launches (a single launch of the tiny model moves by tens of percent)."""
    lines = ["| model | engine | code | launches | step / DeepSpeed's (median of launches) | range | "
             "per-round median / DeepSpeed's | CPU / DeepSpeed's | steps (ms): ours, DeepSpeed's per launch |",
             "|---|---|---|---|---|---|---|---|---|"]
    for kind in MODELS:
        for name in ("gpp", "torch-runtime"):
            for code in ("before", "after"):
                runs = [json.loads(f.read_text())[kind] for f in sorted(folder.glob(f"{code}_*.json"))]
                steps = [r[name]["median_ms"] / r["deepspeed"]["median_ms"] for r in runs]
                per_round = [r[name]["per_round_ratio"] for r in runs]
                cpu = [r[name]["cpu_ms"] / r["deepspeed"]["cpu_ms"] for r in runs]
                each = ", ".join(f"{r[name]['median_ms']:.1f}/{r['deepspeed']['median_ms']:.1f}" for r in runs)
                lines.append(f"| {kind} | {name} | {code} | {len(runs)} | {statistics.median(steps):.3f} | "
                             f"{min(steps):.3f}-{max(steps):.3f} | {statistics.median(per_round):.3f} | "
                             f"{statistics.median(cpu):.3f} | {each} |")
    return "\n".join(lines)


def write_section(results, rounds):
    """``benchmarks/results/overhead.md``, the section of docs/benchmarks.md (benchmarks/report.py)."""
    lines = ["## Cost per action: ours, DeepSpeed's and torch's pipeline runtimes (overhead.py)", "",
             f"`python benchmarks/overhead.py` (issue 28, point 5). Two gloo ranks, a 2-stage chain of four 8x8 "
             f"linear layers, {M} micro-batches of {MBS} rows, every engine in one launch, one step each per round, "
             f"{rounds} rounds; medians after the first round. `tiny`: no compute (a step is the runtime's own "
             "work and the messages); `sleep`: each layer's forward sleeps 5 ms and its backward 10 ms. Actions: "
             "the instructions rank 0 ran in a steady step (ours counts loads and releases, and since issue 28 "
             "runs a release in the dispatch of the action before it; torch's runtime counts its communication "
             "actions). CPU: the processes' CPU time in a step (every thread, gloo's included), median over "
             "rounds, summed over the two ranks: the runtimes' own work, which a loaded machine stretches in wall "
             "time but not in CPU time.", "",
             "| model | engine | median step (ms) | actions on rank 0 | step / actions (us) | step / DeepSpeed's "
             "| per-round median of step / DeepSpeed's | CPU per step, both ranks (ms) | CPU / DeepSpeed's |",
             "|---|---|---|---|---|---|---|---|---|"]
    for kind, data in results.items():
        ds = data["deepspeed"]["median_ms"]
        for name in ENGINES:
            d = data[name]
            per = f"{d['per_action_us']:.0f}" if d["per_action_us"] else ""
            lines.append(f"| {kind} | {name} | {d['median_ms']:.1f} | {d['actions'] or ''} | {per} | "
                         f"{d['median_ms'] / ds:.3f} | {d['per_round_ratio']:.3f} | {d['cpu_ms']:.1f} | "
                         f"{d['cpu_ms'] / data['deepspeed']['cpu_ms']:.3f} |")
    (ROOT / "benchmarks" / "results" / "overhead.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
