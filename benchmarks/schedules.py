"""Step time of 1F1B, ZB-H1 (``zb1``), ZB-H2-like (``zb2``) and the asynchronous schedules
(``pipedream``, ``2bw``, ``pipeoptim``) on real processes, beside the simulator.

Each stage is one sleeping layer whose forward, input gradient and weight gradient each sleep
their own time (a sleep occupies a rank without using a core, so 8- and 16-rank pipelines can be
timed on a 2-core machine). The input-gradient sleep sits on the path from the layer's output to
its input and the weight-gradient sleep on the path to its weight, so the engine's ``I`` sleeps
the first and its ``W`` the second, as a real layer's split backward computes ``dx`` and ``dW``
(a first stage of a branch reads only the batch: it has no input gradient to compute).

    python benchmarks/schedules.py     # writes benchmarks/results/schedules.{json,md} + docs table

Topologies (every stage one layer; ``T_F = T_I = T_W``, the zero-bubble paper's setting):

* ``chain8`` / ``chain16``: 8 / 16 stages in a line;
* ``dag8``: branches of four and two stages into a trunk of two (pipeline depth 6);
* ``dag16``: branches of five, five and three stages into a trunk of three (pipeline depth 8).

M = 2 x the pipeline depth micro-batches. For every topology one launch builds the three engines (same
ranks, same data) and trains them in turn, one step each, round after round, so that the load of
a shared machine falls on all three alike; it records the median step time over the rounds after
the first, the makespan the schedule simulator predicts for the
same sleeps, and the peak micro-batches each stage held in flight (forward run, ``B`` or ``W``
not yet run), read from the instructions the engine executed: the activation memory each stage
needed, in micro-batches of one layer's activations.

The asynchronous schedules never drain: after the first round each step is a steady-state batch
(pipeline full before and after it, no warm-up, no flush), which is what the median measures and
what the simulator prices (:class:`gpp_deepspeed.schedule.AsyncProgram`'s steady batch). Their
in-flight count adds the micro-batches a stage carries into the batch (its lag, ``depth - 1``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from sleeping import sleep_grad

ROOT = Path(__file__).resolve().parent.parent
T_F = T_I = T_W = 0.025
DIM, MBS = 16, 2
SCHEDULES = ("1f1b", "zb1", "zb2", "pipedream", "2bw", "pipeoptim")
ASYNC = ("pipedream", "2bw", "pipeoptim")
# name -> (stages of each branch, trunk stages, micro-batches); a chain is one branch into a one-stage
# trunk. M = 2 x the pipeline depth everywhere (a common rule of thumb: the bubble is then a minor part).
TOPOLOGIES = {"chain8": ((7, ), 1, 16), "dag8": ((4, 2), 2, 12), "chain16": ((15, ), 1, 32), "dag16": ((5, 5, 3), 3, 16)}


def model_layers(branch_stages: tuple[int, ...], trunk: int):
    """Layer specs of a topology: branch ``b`` is ``b{b}_{i}``; the trunk starts with a merge."""
    import torch
    from torch import nn
    from gpp_deepspeed import GraphLayerSpec

    SleepGrad = sleep_grad()

    class SleepLayer(nn.Module):
        """``y = x + w`` with a ``T_F`` sleep forward, ``T_I`` on the ``dx`` path, ``T_W`` on ``dw``."""

        def __init__(self, dim: int, merge: int = 1):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(dim))

        def forward(self, *xs):
            time.sleep(T_F)
            x = xs[0] if len(xs) == 1 else sum(xs)
            return SleepGrad.apply(x, T_I) + SleepGrad.apply(self.weight, T_W)

    layers = []
    for b, length in enumerate(branch_stages):
        for i in range(length):
            layers.append(GraphLayerSpec(f"b{b}_{i}", SleepLayer, DIM, inputs=[f"b{b}_{i - 1}" if i else f"x{b}"]))
    tails = [f"b{b}_{length - 1}" for b, length in enumerate(branch_stages)]
    for i in range(trunk):
        layers.append(GraphLayerSpec(f"t{i}", SleepLayer, DIM, inputs=tails if i == 0 else [f"t{i - 1}"]))
    return layers, [f"x{b}" for b in range(len(branch_stages))]


def worker(topology: str, steps: int, out: str) -> None:
    import torch
    from torch import nn
    import deepspeed
    import gpp_deepspeed
    from gpp_deepspeed import GraphPipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    branch_stages, trunk, num_mb = TOPOLOGIES[topology]
    layers, inputs = model_layers(branch_stages, trunk)
    stages = sum(branch_stages) + trunk
    mapping = {spec.name: i for i, spec in enumerate(layers)}  # one layer per stage
    data = [(tuple(torch.randn(MBS, DIM) for _ in inputs), torch.randn(MBS, DIM)) for _ in range(num_mb)]
    engines = {}
    for name in SCHEDULES:
        module = GraphPipelineModule(layers, input_names=inputs, num_stages=stages, loss_fn=nn.MSELoss(),
                                     partition_method=mapping)
        cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": num_mb, "steps_per_print": 10**6,
               "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
               # Per-micro-batch updates cannot clip by the global norm (refused); the others keep DeepSpeed's default.
               **({"gradient_clipping": 0.0} if name in ASYNC else {}),
               "graph_pipeline": {"schedule": name, "print_stage_graph": False, "print_idle_fractions": False}}
        engines[name], *_ = gpp_deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                                     config=cfg)
    times = {name: [] for name in SCHEDULES}
    for _ in range(steps):
        for name, engine in engines.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            engine.train_batch(data_iter=iter(data))
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - start)
    results = {name: {"times": times[name], **_last_batch(engine, stages)} for name, engine in engines.items()}
    for name in ASYNC:  # micro-batches carried into a steady batch
        results[name]["in_flight"] = [k + engines[name].stage_graph.depth(s) - 1
                                      for s, k in enumerate(results[name]["in_flight"])]
    if torch.distributed.get_rank() == 0:
        for name, engine in engines.items():
            results[name]["predicted"] = predicted(engine.stage_graph, name, num_mb)
            results[name]["depth"] = max(engine.stage_graph.depth(s) for s in range(stages))
        Path(out).write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def _last_batch(engine, stages: int) -> dict:
    """Every stage's peak in-flight micro-batches and compute seconds in the engine's last batch."""
    import torch
    from gpp_deepspeed.schedule import peak_in_flight

    spans = engine.last_timeline
    compute = sum(end - start for a, start, end in spans if a.kind.value in ("F", "B", "I", "W"))
    gathered = [None] * stages
    torch.distributed.all_gather_object(gathered, (peak_in_flight([a for a, _, _ in spans]), compute))
    return {"in_flight": [g[0] for g in gathered], "compute_s": [g[1] for g in gathered]}


def predicted(stage_graph, name: str, num_mb: int) -> float:
    """Simulated makespan of the schedule the engine runs, priced with the same sleeps."""
    from gpp_deepspeed.schedule import (ActionKind as K, AsyncProgram, build_program, get_schedule, simulate,
                                        steady_batch_idx)

    times = {K.FORWARD: T_F, K.BACKWARD: T_I + T_W, K.BACKWARD_INPUT: T_I, K.BACKWARD_WEIGHT: T_W}
    # A stage that reads only the batch has no input gradient to compute (its input needs none).
    sources = {s for s in range(stage_graph.num_stages) if not stage_graph.preds(s)}

    def duration(a):
        if a.stage_idx in sources and a.kind in (K.BACKWARD, K.BACKWARD_INPUT):
            return times[a.kind] - T_I
        return times.get(a.kind, 0.0)

    if get_schedule(name).asynchronous:
        lists = AsyncProgram(stage_graph, num_mb, schedule=name).batch(steady_batch_idx(stage_graph, num_mb)).actions
    else:
        lists = build_program(stage_graph, num_mb, schedule=name).actions
    return simulate(lists, duration=duration).makespan


def main() -> None:
    parser = argparse.ArgumentParser(description="1F1B vs zero-bubble schedules, measured and simulated")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--topologies", default=",".join(TOPOLOGIES))
    parser.add_argument("--table-only", action="store_true", help="rewrite the table from results/schedules.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.out)

    if args.table_only:
        return write_table(json.loads((ROOT / "benchmarks" / "results" / "schedules.json").read_text()), args.steps)
    sys.path.insert(0, str(ROOT / "tests"))
    from dist import launch

    tmp = ROOT / "benchmarks" / "results" / "tmp"
    results = {}
    for topology in args.topologies.split(","):
        branch_stages, trunk, _ = TOPOLOGIES[topology]
        out = tmp / f"schedules_{topology}.json"
        res = launch(sum(branch_stages) + trunk, Path(__file__), "--worker", topology, "--steps", str(args.steps),
                     "--out", str(out), timeout=900, log_dir=tmp / "logs" / f"schedules_{topology}")
        if not res.ok:
            raise SystemExit(f"{topology} failed:\n{res.report()}")
        results[topology] = json.loads(out.read_text())
        for name, r in results[topology].items():
            r["median_s"] = statistics.median(r["times"][1:])
            print(f"{topology:8s} {name:9s} median step {r['median_s'] * 1e3:7.1f} ms  simulated "
                  f"{r['predicted'] * 1e3:7.1f} ms  peak in flight {max(r['in_flight'])}", flush=True)
    (ROOT / "benchmarks" / "results" / "schedules.json").write_text(json.dumps(results, indent=1))
    write_table(results, args.steps)


def write_table(results: dict, steps: int) -> None:
    rows = ["| topology | ranks | depth | M | schedule | median step (ms) | best step (ms) | simulated (ms) "
            "| median / simulated | speed-up vs 1f1b: median | per-round median | simulated "
            "| peak in flight, max over stages | per stage |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for topology, by_name in results.items():
        branch_stages, trunk, num_mb = TOPOLOGIES[topology]
        base = by_name["1f1b"]
        for name, r in by_name.items():
            rounds = statistics.median(b / t for b, t in zip(base["times"][1:], r["times"][1:]))
            rows.append(f"| `{topology}` | {sum(branch_stages) + trunk} | {r['depth']} | {num_mb} | `{name}` | "
                        f"{r['median_s'] * 1e3:.0f} | {min(r['times'][1:]) * 1e3:.0f} | {r['predicted'] * 1e3:.0f} | "
                        f"{r['median_s'] / r['predicted']:.3f} | {base['median_s'] / r['median_s']:.3f} | {rounds:.3f} | "
                        f"{base['predicted'] / r['predicted']:.3f} | {max(r['in_flight'])} | "
                        f"{' '.join(map(str, r['in_flight']))} |")
    text = ("## Schedules: 1F1B, zero-bubble `zb1` / `zb2` and asynchronous `pipedream` / `2bw` / `pipeoptim` "
            "(measured)\n\n"
            "`python benchmarks/schedules.py`. gloo ranks on a shared 2-core CPU machine, with other "
            "engineers' jobs running beside it (load averages of 20 to 70 during the run): single steps "
            "were sometimes several times slower than their neighbours. So each schedule's step time is the "
            f"median (and the best) of rounds 2..{steps}, where a round trains one step of each schedule in "
            "turn on the same ranks; \"per-round median\" is the median over rounds of 1F1B's step divided "
            "by this schedule's step in the same round, the figure least disturbed by the load. Every stage is "
            f"one sleeping layer: forward {T_F * 1e3:.0f} ms, input gradient {T_I * 1e3:.0f} ms, weight "
            f"gradient {T_W * 1e3:.0f} ms (`T_F = T_I = T_W`, where the zero-bubble paper puts ZB-H1's bubble "
            "at a third of 1F1B's; a branch's first stage has no input gradient). \"Simulated\" is the "
            "schedule simulator's makespan for the same sleeps. \"Peak in flight\" counts the micro-batches "
            "a stage held (forward run, weight gradient not yet run) in the instructions the engine executed: "
            "its activation memory in micro-batches of one layer. `zb1` holds on every stage what 1F1B holds on "
            "its busiest stage (the pipeline depth), `zb2` up to twice that. "
            "The asynchronous schedules never drain: their step is a steady-state batch (no warm-up, no flush; "
            "simulated the same way), their in-flight count includes the micro-batches carried in from the "
            "previous batch, and each of them also stashes weight versions (one per micro-batch in flight for "
            "`pipedream` and `pipeoptim`, two for `2bw`); rows appear for the schedules the last run measured.\n\n"
            + "\n".join(rows) + "\n")
    (ROOT / "benchmarks" / "results" / "schedules.md").write_text(text)
    import report
    report.main()


if __name__ == "__main__":
    main()
