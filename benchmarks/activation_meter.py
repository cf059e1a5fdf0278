"""What the memory report's activation meter costs a step, and what measuring only until the steady
program saves (``graph_pipeline.activation_meter_steps``).

The meter (:class:`gpp_deepspeed.engine.memory.ActivationMeter`) wraps every tensor autograd
saves in a stage's forward in a handle, through saved-tensor hooks, and unwraps it in the backward:
Python work per saved tensor, on the rank's path. One launch of two gloo ranks trains each model
below as a 2-stage 1F1B pipeline (16 micro-batches of 4), one engine per model; round after round
the same engine runs one step with the meter on and one with it off, in turn (the order swapped
every round), so the load of a shared machine falls on both alike, under ``peers.py``'s
garbage-collection regime (the heap frozen, a collection before each step outside its timing).
Medians after the first two rounds.

* ``tiny chain``: four 8x8 linear layers (as ``overhead.py``);
* ``GPT-2, 2 layers``: ``transformers.GPT2LMHeadModel`` captured as the tests capture it (hidden 16,
  sequences of 6 tokens);
* ``GPT-2, 8 layers``: the same with 8 blocks of hidden 64 and sequences of 32 tokens.

"Saved tensors" is what the meter wraps per micro-batch on each rank (parameters saved for
backward pass through unwrapped, as before).

    python benchmarks/activation_meter.py            # writes benchmarks/results/activation_meter.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import peers

ROOT = Path(__file__).resolve().parent.parent
M, MBS = 16, 4
WARM_UP = 2
MODELS = ("tiny chain", "GPT-2, 2 layers", "GPT-2, 8 layers")


def build(model: str):
    """(GraphPipelineModule, loss function, micro-batches) of ``model``, seeded alike on every rank."""
    import torch
    from torch import nn
    from deepspeed.pipe import LayerSpec
    from gpp_deepspeed import GraphPipelineModule
    from gpp_deepspeed.frontend import capture

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if model == "tiny chain":
        module = GraphPipelineModule([LayerSpec(nn.Linear, 8, 8) for _ in range(4)], num_stages=2,
                                     loss_fn=nn.MSELoss(), partition_method="uniform")
        return module, [(torch.randn(MBS, 8, generator=gen), torch.randn(MBS, 8, generator=gen)) for _ in range(M)]
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, hidden, seq, vocab = (2, 16, 6, 40) if model == "GPT-2, 2 layers" else (8, 64, 32, 128)
    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = GPT2LMHeadModel(config)

        def forward(self, input_ids):
            return self.gpt(input_ids=input_ids).logits

    class NextToken(nn.Module):
        def forward(self, logits, labels):
            return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    names = ["gpt.transformer.wte", "gpt.transformer.wpe", *(f"gpt.transformer.h.{i}" for i in range(layers)),
             "gpt.transformer.ln_f", "gpt.lm_head"]
    data = []
    for _ in range(M):
        ids = torch.randint(0, vocab, (MBS, seq), generator=gen)
        data.append((ids, torch.roll(ids, -1, dims=1)))
    captured = capture(Logits(), layers=names, example_inputs=(data[0][0], ))
    module = GraphPipelineModule(captured.layers, input_names=captured.input_names, output=captured.output,
                                 num_stages=2, loss_fn=NextToken())
    return module, data


def worker(rounds: int, out: str) -> None:
    import torch
    import deepspeed
    import gpp_deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    results = {}
    for model in MODELS:
        module, data = build(model)
        cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": M, "steps_per_print": 10**6,
               "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
               "graph_pipeline": {"print_stage_graph": False, "print_memory": False, "print_idle_fractions": False}}
        engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
        meter = module.activations
        wrapped = [0]
        pack = meter._pack

        def counting(t, skip):
            held = pack(t, skip)
            wrapped[0] += held is not t
            return held

        meter._pack = counting
        engine.train_batch(iter(data))       # the meter's own first step (the default measures it)
        saved = wrapped[0] / M
        meter._pack = pack

        def metered(limit, engine=engine):
            def step():
                meter.limit = limit      # every step (None), or none after the meter's first (0)
                engine.train_batch(iter(data))
            return step

        cpu = {}
        times = peers.timed_rounds({"on": metered(None), "off": metered(0)}, rounds, cpu=cpu, alternate=True)
        cpu = {label: [main for main, _ in spent] for label, spent in cpu.items()}   # the main thread's
        mine = {"saved": saved, **{f"cpu_{k}": statistics.median(v[WARM_UP:]) for k, v in cpu.items()}}
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, mine)
        results[model] = {"step_s": {k: statistics.median(v[WARM_UP:]) for k, v in times.items()},
                          "per_round_ratio": statistics.median(a / b for a, b in zip(times["on"][WARM_UP:],
                                                                                   times["off"][WARM_UP:])),
                          "ranks": every}
        del engine
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description="the activation meter's cost per step")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.rounds, args.out)
    sys.path.insert(0, str(ROOT / "tests"))
    from dist import launch

    with tempfile.TemporaryDirectory(prefix="gpp_activation_meter_") as tmp:
        out = Path(tmp) / "meter.json"
        res = launch(2, Path(__file__), "--worker", "--rounds", str(args.rounds), "--out", str(out), timeout=1200,
                     log_dir=Path(tmp) / "logs")
        if not res.ok:
            raise SystemExit(res.report())
        results = json.loads(out.read_text())
    (ROOT / "benchmarks" / "results" / "activation_meter.json").write_text(json.dumps(results, indent=1))
    write_section(results, args.rounds)
    print((ROOT / "benchmarks" / "results" / "activation_meter.md").read_text())


def write_section(results: dict, rounds: int) -> None:
    """``benchmarks/results/activation_meter.md``, the section of docs/benchmarks.md (report.py)."""
    lines = ["## What the activation meter costs a step (activation_meter.py)", "",
             f"`python benchmarks/activation_meter.py` (issue 28, point 5). Two gloo ranks, each model a 2-stage "
             f"1F1B pipeline of {M} micro-batches of {MBS}; one engine per model runs a step with the memory "
             "report's activation meter on and one with it off, in turn (order swapped every round, a garbage "
             "collection before each step, outside its timing), for "
             f"{rounds} rounds; medians after the first {WARM_UP}. CPU: the main thread's CPU time in a step, "
             "each rank. Saved tensors: what the meter wraps per micro-batch on each rank. Since this change "
             "the meter measures until the steady program (one step for a synchronous schedule, "
             "`graph_pipeline.activation_meter_steps`) and every later step runs as the \"off\" column.", "",
             "| model | saved tensors per micro-batch (rank 0, 1) | step, meter on (ms) | step, off (ms) | on / off "
             "(per-round median) | CPU rank 0, on / off (ms) | CPU rank 1, on / off (ms) |",
             "|---|---|---|---|---|---|---|"]
    for model, r in results.items():
        ranks = r["ranks"]
        saved = ", ".join(f"{x['saved']:.0f}" for x in ranks)
        lines.append(f"| {model} | {saved} | {1e3 * r['step_s']['on']:.1f} | "
                     f"{1e3 * r['step_s']['off']:.1f} | {r['per_round_ratio']:.3f} | "
                     + " | ".join(f"{1e3 * x['cpu_on']:.1f} / {1e3 * x['cpu_off']:.1f}" for x in ranks) + " |")
    cpu = {m: [x["cpu_on"] / x["cpu_off"] for x in r["ranks"]] for m, r in results.items()}
    lines += ["", "With the meter on, a step took " + ", ".join(
        f"{r['per_round_ratio']:.3f}x ({m})" for m, r in results.items()) + " the step without it (per-round "
        "medians), and each rank's main thread spent " + ", ".join(
        f"{min(c):.2f}-{max(c):.2f}x" for c in cpu.values()) + " the CPU time: the Python work of wrapping and "
        "unwrapping every saved tensor, and of reading the storages of the stage's parameters at every forward, "
        "which grows with the layers a stage holds."]
    (ROOT / "benchmarks" / "results" / "activation_meter.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
