"""What asynchrony costs in convergence and gains in step time: PipeDream, PipeDream-2BW and
PipeOptim beside 1F1B and ZB-H1, on a small GPT, with whole-pipeline replicas and bf16.

The task is learnable and not trivial: a sequence of 24 tokens whose second half copies its first
half (12 random tokens of 31); the model is trained on next-token prediction, scored on the second
half only, which needs attention 12 positions back (an induction pattern: a model that has not
learnt it stays near ln 31 = 3.4, one that has reaches 0; one process with one update per batch
learns it between batches 50 and 100). The model is a GPT: token and position
embeddings, 4 pre-LN transformer blocks (d = 64, 4 heads, MLP 4d), a final layer norm and the head,
in 4 stages (embeddings with block 0, blocks 1 and 2, block 3 with the head), replicated twice
(8 gloo ranks), in bf16 (DeepSpeed's bf16 optimizer, fp32 master weights), Adam (lr 1e-3), no
clipping; M = 4 micro-batches of 8 sequences per replica, the same batches for every schedule.
Every schedule trains one engine in one launch, one batch each in turn, so machine load falls on
all alike.

    python benchmarks/async_convergence.py   # a few minutes; writes docs/img/async_convergence.png,
                                             # benchmarks/results/async_convergence.{json,md}
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VOCAB, HALF, D, HEADS, BLOCKS = 32, 12, 64, 4, 4
MBS, M, STAGES, REPLICAS = 8, 4, 4, 2
SCHEDULES = ("1f1b", "zb1", "pipedream", "2bw", "pipeoptim")
OPTIMIZER = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False}}
STAGE_OF = {"embed": 0, "block0": 0, "block1": 1, "block2": 2, "block3": 3, "norm": 3, "head": 3}


def layers():
    import torch
    from torch import nn
    from gpp_deepspeed import GraphLayerSpec

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(2 * HALF, D)

        def forward(self, ids):  # [batch, seq] -> [batch, seq, D]
            return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))

    class Block(nn.Module):
        """Pre-LN causal self-attention and MLP (GPT-2's block)."""

        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

        def forward(self, x):  # [batch, seq, D]
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
            att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, D))
            return x + self.mlp(self.ln2(x))

    specs = [GraphLayerSpec("embed", Embed, inputs=["ids"])]
    for i in range(BLOCKS):
        specs.append(GraphLayerSpec(f"block{i}", Block, inputs=["embed" if i == 0 else f"block{i - 1}"]))
    return specs + [GraphLayerSpec("norm", nn.LayerNorm, D, inputs=[f"block{BLOCKS - 1}"]),
                    GraphLayerSpec("head", nn.Linear, D, VOCAB, inputs=["norm"])]


def loss_fn(logits, labels):
    """Next-token cross entropy over the second half (labels -100 elsewhere)."""
    import torch
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def batches(step: int, replica: int):
    """Batch ``step`` of one replica: ``M`` micro-batches of copy sequences, inputs and targets."""
    import torch

    g = torch.Generator().manual_seed(10_000 * step + replica)
    out = []
    for _ in range(M):
        first = torch.randint(1, VOCAB, (MBS, HALF), generator=g)
        seq = torch.cat([first, first], dim=1)              # [MBS, 2 * HALF]
        labels = seq[:, 1:].clone()
        labels[:, :HALF - 1] = -100                         # the first half is random: not scored
        out.append((seq[:, :-1], labels))
    return out


def worker(steps: int, out: str) -> None:
    import torch
    import deepspeed
    import gpp_deepspeed
    from gpp_deepspeed import GraphPipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    engines = {}
    for name in SCHEDULES:
        module = GraphPipelineModule(layers(), input_names=["ids"], num_stages=STAGES, loss_fn=loss_fn,
                                     partition_method=STAGE_OF)
        cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": M,
               "train_batch_size": MBS * M * REPLICAS, "steps_per_print": 10**6, "gradient_clipping": 0.0,
               "bf16": {"enabled": True}, "optimizer": OPTIMIZER,
               "graph_pipeline": {"schedule": name, "print_stage_graph": False}}
        engines[name], *_ = gpp_deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                                     config=cfg)
    replica = engines[SCHEDULES[0]].grid.replica_id
    losses = {key: [] for key in engines}
    seconds = {key: [] for key in engines}
    for step in range(steps):
        data = batches(step, replica)
        for key, engine in engines.items():
            start = time.perf_counter()
            losses[key].append(engine.train_batch(data_iter=iter(data)).item())
            seconds[key].append(time.perf_counter() - start)
    evals = {}
    for key, engine in engines.items():
        held_out = [batches(10**6 + k, replica) for k in range(4)]
        evals[key] = sum(engine.eval_batch(iter(mbs)).item() for mbs in held_out) / len(held_out)
    memory = {key: engine.weight_version_memory() for key, engine in engines.items()}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, {"stage": engines[SCHEDULES[0]].stage_id, "memory": memory})
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps({"losses": losses, "seconds": seconds, "eval": evals,
                                         "versions": gathered}))
    torch.distributed.destroy_process_group()


def smooth(values: list[float], width: int = 10) -> list[float]:
    return [sum(values[max(0, i - width + 1):i + 1]) / len(values[max(0, i - width + 1):i + 1]) for i in range(len(values))]


def main() -> None:
    parser = argparse.ArgumentParser(description="loss curves of the asynchronous schedules beside 1F1B and zb1")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps, args.out)
    sys.path.insert(0, str(ROOT / "tests"))
    from dist import launch

    tmp = ROOT / "benchmarks" / "results" / "tmp"
    out = tmp / "async_convergence.json"
    start = time.perf_counter()
    res = launch(STAGES * REPLICAS, Path(__file__), "--worker", "--steps", str(args.steps), "--out", str(out),
                 timeout=1800, log_dir=tmp / "logs" / "async_convergence")
    if not res.ok:
        raise SystemExit(f"failed:\n{res.report()}")
    results = json.loads(out.read_text())
    results["wall_s"] = time.perf_counter() - start
    (ROOT / "benchmarks" / "results" / "async_convergence.json").write_text(json.dumps(results, indent=1))
    picture(results, args.steps)
    table(results, args.steps)


def _median_ms(seconds: list[float]) -> float:
    steady = sorted(seconds[5:])
    return steady[len(steady) // 2] * 1e3


def picture(results: dict, steps: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bars) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2.2, 1]})
    samples = [(i + 1) * M * MBS * REPLICAS for i in range(steps)]
    for name in SCHEDULES:
        ax.plot(samples, smooth(results["losses"][name]), label=name)
    ax.set_xlabel("training samples")
    ax.set_ylabel("training loss, second half (mean of 10 batches)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title("loss against samples")
    ms = [_median_ms(results["seconds"][name]) for name in SCHEDULES]
    bars.barh(list(SCHEDULES)[::-1], ms[::-1], color="#4C72B0")
    for y, v in enumerate(ms[::-1]):
        bars.text(v, y, f" {v:.0f}", va="center", fontsize=8)
    bars.set_xlabel("median step time (ms), same run")
    bars.set_title("step time")
    fig.suptitle(f"GPT ({BLOCKS} blocks, d={D}) on a copy task: {STAGES} stages x {REPLICAS} replicas, bf16, "
                 f"M = {M} micro-batches of {MBS} per replica")
    fig.tight_layout()
    path = ROOT / "docs" / "img" / "async_convergence.png"
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def table(results: dict, steps: int) -> None:
    per_stage = {}
    for rank in results["versions"]:
        for name, mem in rank["memory"].items():
            if mem is not None:
                per_stage.setdefault(name, {})[rank["stage"]] = mem["peak_versions"]
    rows = ["| schedule | updates per batch | loss, first 10 batches | loss, last 10 batches | held-out loss | "
            "median step (ms) | weight copies per stage |", "|---|---|---|---|---|---|---|"]
    for name in SCHEDULES:
        losses = results["losses"][name]
        per_batch = M if name in ("pipedream", "pipeoptim") else 1
        copies = per_stage.get(name)
        shown = " ".join(f"{copies[s]}" for s in sorted(copies)) if copies else "-"
        rows.append(f"| `{name}` | {per_batch} | {sum(losses[:10]) / 10:.3f} | {sum(losses[-10:]) / 10:.3f} | "
                    f"{results['eval'][name]:.3f} | {_median_ms(results['seconds'][name]):.0f} | {shown} |")
    text = ("## Asynchronous schedules: convergence and step time (measured)\n\n"
            f"`python benchmarks/async_convergence.py` (`make bench`): a GPT of {BLOCKS} pre-LN blocks (d = {D}, "
            f"{HEADS} heads) learning to copy the first half of a {2 * HALF}-token sequence into its second half "
            f"(scored on the second half; ln {VOCAB - 1} = {math.log(VOCAB - 1):.2f} is chance, 0 is learnt), in "
            f"{STAGES} stages x {REPLICAS} whole-pipeline replicas ({STAGES * REPLICAS} gloo ranks), bf16 with fp32 "
            f"master weights, Adam lr 1e-3, {steps} batches of {M} micro-batches of {MBS} sequences per replica, "
            "the same batches for every schedule, one batch of each schedule in turn. Run on a 2-core CPU "
            "machine shared with other engineers, whose "
            f"single-process work may have run beside it (the whole run took {results['wall_s']:.0f} s); step "
            "times are medians after the first 5 batches and are dominated by 8 processes sharing 2 cores, not "
            "by the tiny model's compute. PipeDream and PipeOptim update after every micro-batch (4 updates a "
            "batch, each on a micro-batch's gradient averaged over the replicas), 1F1B, zb1 and 2BW once a "
            "batch. Held-out loss after `eval_batch`, which flushes the asynchronous pipelines first. "
            "Weight copies: the most a stage's ranks stashed at once besides the live weights, stage 0 first.\n\n"
            "![loss curves and step times](img/async_convergence.png)\n\n" + "\n".join(rows) + "\n")
    (ROOT / "benchmarks" / "results" / "async_convergence.md").write_text(text)
    import report
    report.main()


if __name__ == "__main__":
    main()
