"""What asynchrony costs in convergence: PipeDream, PipeDream-2BW and PipeOptim beside 1F1B.

A small learnable task: a student DAG (a skip from the first stage to the last, which merges it)
learns a fixed random teacher's 4-way classification of 16-dimensional Gaussian inputs. Four
stages, one layer group each (lags 3, 2, 1, 0), M = 4 micro-batches of 16 samples per batch, the
same batches for every schedule. Each optimizer (SGD with momentum 0.9, Adam) trains one engine
per schedule in one launch of 4 gloo ranks, one step each in turn.

Besides the pipelines, the driver trains the same student on one process with the update rule
PipeDream and PipeOptim follow but without staleness (one update per micro-batch, on the newest
weights): the gap between that dashed line and theirs is what asynchrony costs. 1F1B and 2BW
update once per batch with the mean gradient (the same number of samples, a quarter of the
updates), so they learn per sample more slowly at the same learning rate, by design.

    python benchmarks/async_convergence.py   # about 2 minutes; writes docs/img/async_convergence.png,
                                             # benchmarks/results/async_convergence.{json,md}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIM, HIDDEN, CLASSES, MBS, M = 16, 32, 4, 16, 4
SCHEDULES = ("1f1b", "pipedream", "2bw", "pipeoptim")
OPTIMIZERS = {"sgd": {"type": "SGD", "params": {"lr": 0.02, "momentum": 0.9}},
              "adam": {"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True, "adam_w_mode": False}}}
STAGE_OF = {"l1": 0, "l2": 1, "l3": 2, "l4": 3, "res": 3, "head": 3}


def layers():
    import torch
    from torch import nn
    from gpp_deepspeed import GraphLayerSpec

    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.lin = nn.Linear(dim, dim)

        def forward(self, x):
            return x + torch.tanh(self.lin(x))

    class Add(nn.Module):
        def forward(self, a, b):
            return a + b

    return [GraphLayerSpec("l1", nn.Linear, DIM, HIDDEN, inputs=["x"]),
            GraphLayerSpec("l2", Block, HIDDEN, inputs=["l1"]),
            GraphLayerSpec("l3", Block, HIDDEN, inputs=["l2"]),
            GraphLayerSpec("l4", Block, HIDDEN, inputs=["l3"]),
            GraphLayerSpec("res", Add, inputs=["l4", "l1"]),
            GraphLayerSpec("head", nn.Linear, HIDDEN, CLASSES, inputs=["res"])]


def batches(step: int):
    """Batch ``step``: ``M`` micro-batches labelled by the fixed teacher."""
    import torch

    teacher = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(DIM, 64, generator=teacher), torch.randn(64, CLASSES, generator=teacher)
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(M):
        x = torch.randn(MBS, DIM, generator=g)
        out.append((x, (torch.tanh(x @ w1) @ w2).argmax(-1)))
    return out


def worker(steps: int, out: str) -> None:
    import torch
    from torch import nn
    import deepspeed
    import gpp_deepspeed
    from gpp_deepspeed import GraphPipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    engines = {}
    for opt, opt_cfg in OPTIMIZERS.items():
        for name in SCHEDULES:
            module = GraphPipelineModule(layers(), input_names=["x"], num_stages=4, loss_fn=nn.CrossEntropyLoss(),
                                         partition_method=STAGE_OF)
            cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": M,
                   "steps_per_print": 10**6, "gradient_clipping": 0.0, "optimizer": opt_cfg,
                   "graph_pipeline": {"schedule": name, "print_stage_graph": False, "print_idle_fractions": False}}
            engines[f"{opt}/{name}"], *_ = gpp_deepspeed.initialize(
                model=module, model_parameters=list(module.parameters()), config=cfg)
    losses = {key: [] for key in engines}
    seconds = {key: [] for key in engines}
    for step in range(steps):
        data = batches(step)
        for key, engine in engines.items():
            start = time.perf_counter()
            losses[key].append(engine.train_batch(data_iter=iter(data)).item())
            seconds[key].append(time.perf_counter() - start)
    held_out = [mb for k in range(4) for mb in batches(10**6 + k)]
    evals = {}
    for key, engine in engines.items():
        evals[key] = sum(engine.eval_batch(iter(held_out[i:i + M])).item() for i in range(0, len(held_out), M)) / 4
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps({"losses": losses, "seconds": seconds, "eval": evals}))
    torch.distributed.destroy_process_group()


def sequential(opt: str, steps: int) -> tuple[list[float], float]:
    """One process, one update per micro-batch on the newest weights (no pipeline, no staleness)."""
    import torch
    from torch import nn
    from gpp_deepspeed import GraphModel

    model = GraphModel(layers(), input_names=["x"])
    params = dict(OPTIMIZERS[opt]["params"])
    if opt == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=params["lr"], momentum=params["momentum"])
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=params["lr"])
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for step in range(steps):
        total = 0.0
        for x, y in batches(step):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item()
        losses.append(total / M)
    with torch.no_grad():
        held_out = [mb for k in range(4) for mb in batches(10**6 + k)]
        ev = sum(loss_fn(model(x), y).item() for x, y in held_out) / len(held_out)
    return losses, ev


def smooth(values: list[float], width: int = 10) -> list[float]:
    return [sum(values[max(0, i - width + 1):i + 1]) / len(values[max(0, i - width + 1):i + 1]) for i in range(len(values))]


def main() -> None:
    parser = argparse.ArgumentParser(description="loss curves of the asynchronous schedules beside 1F1B")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps, args.out)
    sys.path.insert(0, str(ROOT / "tests"))
    from dist import launch

    tmp = ROOT / "benchmarks" / "results" / "tmp"
    out = tmp / "async_convergence.json"
    res = launch(4, Path(__file__), "--worker", "--steps", str(args.steps), "--out", str(out), timeout=1200,
                 log_dir=tmp / "logs" / "async_convergence")
    if not res.ok:
        raise SystemExit(f"failed:\n{res.report()}")
    results = json.loads(out.read_text())
    for opt in OPTIMIZERS:
        losses, ev = sequential(opt, args.steps)
        results["losses"][f"{opt}/sequential"] = losses
        results["eval"][f"{opt}/sequential"] = ev
    (ROOT / "benchmarks" / "results" / "async_convergence.json").write_text(json.dumps(results, indent=1))
    picture(results, args.steps)
    table(results, args.steps)


def picture(results: dict, steps: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, opt in zip(axes, OPTIMIZERS):
        samples = [(i + 1) * M * MBS for i in range(steps)]
        for name in SCHEDULES:
            ax.plot(samples, smooth(results["losses"][f"{opt}/{name}"]), label=name)
        ax.plot(samples, smooth(results["losses"][f"{opt}/sequential"]), "k--", linewidth=1,
                label="one process, update per micro-batch")
        ax.set_title(f"{'SGD, momentum 0.9, lr 0.02' if opt == 'sgd' else 'Adam, lr 3e-3'}")
        ax.set_xlabel("training samples")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss (mean of 10 batches)")
    axes[1].legend(fontsize=8)
    fig.suptitle("4-stage DAG (a skip into the last stage), M = 4 micro-batches of 16: what asynchrony costs")
    fig.tight_layout()
    path = ROOT / "docs" / "img" / "async_convergence.png"
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def table(results: dict, steps: int) -> None:
    rows = ["| optimizer | schedule | updates per batch | loss, last 10 batches | held-out loss | median step (ms) |",
            "|---|---|---|---|---|---|"]
    for opt in OPTIMIZERS:
        for name in (*SCHEDULES, "sequential"):
            key = f"{opt}/{name}"
            last = results["losses"][key][-10:]
            per_batch = M if name in ("pipedream", "pipeoptim", "sequential") else 1
            ms = (f"{sorted(results['seconds'][key][1:])[len(results['seconds'][key][1:]) // 2] * 1e3:.1f}"
                  if key in results["seconds"] else "-")
            rows.append(f"| {opt} | `{name}` | {per_batch} | {sum(last) / len(last):.3f} | {results['eval'][key]:.3f} "
                        f"| {ms} |")
    text = ("## Asynchronous schedules: convergence (measured)\n\n"
            f"`python benchmarks/async_convergence.py`: {steps} batches of {M} micro-batches of {MBS} samples on a "
            "4-stage DAG (lags 3, 2, 1, 0), 4 gloo ranks on a shared 2-core CPU machine (step times are "
            "noisy and tiny-model overhead dominates them). `sequential` is one process applying one "
            "update per micro-batch on the newest weights: PipeDream's and PipeOptim's rule without "
            "staleness. Held-out loss after `eval_batch` (which flushes first).\n\n"
            "![loss curves](img/async_convergence.png)\n\n" + "\n".join(rows) + "\n")
    (ROOT / "benchmarks" / "results" / "async_convergence.md").write_text(text)
    import report
    report.main()


if __name__ == "__main__":
    main()
