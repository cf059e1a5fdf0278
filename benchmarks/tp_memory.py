"""Tensor parallelism inside a stage: each rank's parameters, gradients and optimizer state at TP 1, 2, 4.

    python benchmarks/tp_memory.py        # writes benchmarks/results/tp_memory.{json,md}

One stage, a captured Llama (``LAYERS`` decoder layers of hidden size ``HIDDEN``, MLP ``FFN``, 8
heads and 4 KV heads; a 64-token vocabulary so that the embedding and head are small), its decoder
layers split over ``tp`` gloo ranks by the model's own ``base_model_tp_plan`` with DeepSpeed's AutoTP
layers (:mod:`gpp_deepspeed.engine.tensor_parallel`), trained ``STEPS`` steps by DeepSpeed's engine
with torch's Adam in fp32 (ZeRO-0; the TP group is DeepSpeed's model-parallel group through an
``mpu``, data-parallel degree 1). After the last step every rank counts, with the memory report's own
function (:func:`gpp_deepspeed.engine.memory.weight_memory`), the distinct storages it holds: all of
the stage, and the decoder layers alone (their parameters, ``.grad`` between the backward and the
step, and Adam's moments). Beside it
the planner's formula for the decoder layers
(:func:`gpp_deepspeed.planner.costs.weight_state_bytes` of ``1 / tp`` of their parameter bytes,
the one the search prices with; fp32 Adam: ``optimizer_factor`` 3) and the rank's peak resident
memory (``VmHWM``: everything, the runtime included).

Not the pipeline engine: it lands with issue 29's per-stage TP groups; this measures what those
ranks hold, built and trained by the same code.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 512, 2048, 4, 8, 4
DEGREES, STEPS = (1, 2, 4), 2


class _Mpu:
    """DeepSpeed's ``mpu`` for a TP group that is the whole world (data-parallel degree 1)."""

    def __init__(self):
        import torch.distributed as dist
        self.dist = dist
        self.single = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]

    def get_model_parallel_group(self): return self.dist.group.WORLD
    def get_model_parallel_rank(self): return self.dist.get_rank()
    def get_model_parallel_world_size(self): return self.dist.get_world_size()
    def get_data_parallel_group(self): return self.single
    def get_data_parallel_rank(self): return 0
    def get_data_parallel_world_size(self): return 1


def worker(out: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch import nn
    from gpp_deepspeed.engine.memory import process_peak_bytes, weight_memory
    from gpp_deepspeed.engine.tensor_parallel import sharding_specs
    from llama_tiny import NextTokenLoss, batches, capture_llama

    deepspeed.init_distributed(dist_backend="gloo")
    tp = dist.get_world_size()
    captured = capture_llama(meta=True, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    decoders = [s for s in captured.layers if ".layers." in s.name.replace("_", ".")]
    with sharding_specs(decoders, dist.group.WORLD if tp > 1 else None):
        model = captured.graph_model()

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, labels):
            return NextTokenLoss()(self.model(ids), labels)

    wrapped = WithLoss()
    params = list(wrapped.parameters())
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=wrapped, optimizer=torch.optim.Adam(params, lr=1e-4),
                                      model_parameters=params, config=config, mpu=_Mpu())
    layer_params = [p for n, p in wrapped.named_parameters() if ".layers." in n]
    for step in range(STEPS):
        ids, labels = batches(step)[0]
        engine.backward(engine(ids, labels))
        # The gradients live from the backward to the step (DeepSpeed frees them after it).
        grads = sum(p.grad.numel() * p.grad.element_size() for p in layer_params if p.grad is not None)
        engine.step()
    whole = weight_memory(wrapped, engine.optimizer)
    state = engine.optimizer.state
    layers = (sum(p.numel() * p.element_size() for p in layer_params), grads,
              sum(t.numel() * t.element_size() for p in layer_params for t in state.get(p, {}).values()
                  if torch.is_tensor(t) and t.dim() > 0))
    full = sum(p.numel() for s in decoders for p in s.module.parameters()) * 4   # fp32, unsplit
    Path(f"{out}.rank{dist.get_rank()}").write_text(json.dumps({
        "tp": tp, "rank": dist.get_rank(), "whole": whole, "layers": layers, "layer_bytes_unsplit": full,
        "process_peak": process_peak_bytes()}))


def measure() -> list[dict]:
    from dist import launch
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in DEGREES:
            prefix = Path(tmp) / f"tp{tp}"
            result = launch(tp, Path(__file__), "--worker", str(prefix), timeout=900, log_dir=Path(tmp) / f"logs{tp}")
            if not result.ok:
                raise RuntimeError(result.report())
            rows += [json.loads(Path(f"{prefix}.rank{r}").read_text()) for r in range(tp)]
    return rows


def write(rows: list[dict]) -> None:
    from gpp_deepspeed.planner.costs import weight_state_bytes
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tp_memory.json").write_text(json.dumps(rows, indent=1))
    full = rows[0]["layer_bytes_unsplit"]
    lines = ["## Tensor parallelism inside a stage: memory per rank at TP 1, 2, 4 (measured)", "",
             f"One stage: a captured Llama's {LAYERS} decoder layers (hidden {HIDDEN}, MLP {FFN}, {HEADS} heads, "
             f"{KV_HEADS} KV heads; {full / 4 / 1e6:.2f} M parameters) split over tp gloo ranks by the model's "
             "`base_model_tp_plan` with DeepSpeed's AutoTP layers, a 64-token embedding and head whole on every rank; "
             f"DeepSpeed's engine, torch's Adam in fp32, {STEPS} steps. MiB per rank (the largest over the TP "
             "group) after the last step (gradients: before it), counted by the memory report's `weight_memory`: the decoder layers' "
             "parameters, gradients and Adam state, then their sum beside the planner's formula "
             "(`weight_state_bytes` of 1/tp of the parameters), then everything the rank holds for the stage "
             "and its peak resident memory (`VmHWM`, the runtime included). `benchmarks/tp_memory.py`.", "",
             "| tp | parameters | gradients | optimizer state | sum | planner | sum vs tp 1 | stage, all tensors | "
             "process peak |", "|---|---|---|---|---|---|---|---|---|"]
    base = None
    for tp in DEGREES:
        mine = [r for r in rows if r["tp"] == tp]
        layers = [max(r["layers"][i] for r in mine) for i in range(3)]
        total = sum(layers)
        base = base or total
        planner = weight_state_bytes(full / tp, optimizer_factor=3.0, num_devices=1)
        stage = max(sum(r["whole"]) for r in mine)
        peak = max(r["process_peak"] for r in mine)
        lines.append(f"| {tp} | " + " | ".join(f"{b / MIB:.1f}" for b in layers)
                     + f" | {total / MIB:.1f} | {planner / MIB:.1f} | {total / base:.3f} | {stage / MIB:.1f} | "
                     f"{peak / MIB:.0f} |")
    (RESULTS / "tp_memory.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    write(measure())
    print((RESULTS / "tp_memory.md").read_text())


if __name__ == "__main__":
    main()
