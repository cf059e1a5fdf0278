"""Worker: how much memory a rank takes to build its stage of a Llama-style model and initialise.

Run by ``tests/test_large_models.py`` and ``benchmarks/large_models.py`` through ``tests/dist.py``::

    python memory_worker.py KIND HIDDEN INTERMEDIATE LAYERS OUT_JSON

``KIND`` is ``meta`` (a ``transformers`` ``LlamaForCausalLM`` built on the meta device and captured),
``real`` (the same model built on CPU on every rank and captured: what the README showed before
deferred materialisation) or ``specs`` (the same shapes as a ``GraphLayerSpec`` list, each layer
built by DeepSpeed on its stage only). Every rank imports everything first, reads its resident
memory, builds ``GraphPipelineModule`` (4 stages, ``partition_method="parameters"``) and
``gpp_deepspeed.initialize`` with SGD, then reads its peak resident memory (``VmHWM``) and writes
``OUT_JSON.rank<r>``: ``{"imports": bytes, "peak": bytes, "stage_param_bytes": bytes, ...}``.
"""

import json
import os
import sys
import time

import torch
from torch import nn

import deepspeed  # noqa: F401  (imported before the first reading: part of the fixed cost)
from transformers import LlamaConfig, LlamaForCausalLM
import gpp_deepspeed
from gpp_deepspeed import GraphLayerSpec, GraphPipelineModule
from gpp_deepspeed.frontend import capture
from gpp_deepspeed.engine.memory import process_peak_bytes

VOCAB, HEADS, STAGES = 32000, 16, 4


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class NextTokenLoss(nn.Module):
    def forward(self, logits, labels):
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class LM(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, input_ids):
        return self.m(input_ids=input_ids).logits


class Block(nn.Module):
    """A decoder block's parameters (attention projections, gated MLP, norms) as plain torch layers."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(hidden, intermediate, bias=False), nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.o(self.v(h) + self.q(h) * self.k(h).sigmoid())
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def llama_layers(kind: str, hidden: int, intermediate: int, layers: int):
    if kind == "specs":
        specs = [GraphLayerSpec("embed", nn.Embedding, VOCAB, hidden, inputs=["input_ids"])]
        for i in range(layers):
            specs.append(GraphLayerSpec(f"block{i}", Block, hidden, intermediate, inputs=[specs[-1].name]))
        specs += [GraphLayerSpec("norm", nn.RMSNorm, hidden, inputs=[f"block{layers - 1}"]),
                  GraphLayerSpec("head", nn.Linear, hidden, VOCAB, bias=False, inputs=["norm"])]
        return specs, ("input_ids", ), "head"
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=HEADS, use_cache=False)
    torch.manual_seed(0)
    if kind == "meta":
        with torch.device("meta"):
            model = LM(LlamaForCausalLM(config))
    else:
        model = LM(LlamaForCausalLM(config))
    names = ["m.model.embed_tokens", *(f"m.model.layers.{i}" for i in range(layers)), "m.model.norm", "m.lm_head"]
    captured = capture(model, layers=names, example_inputs=(torch.zeros(2, 16, dtype=torch.long), ))
    return captured.layers, captured.input_names, captured.output


def main():
    kind, hidden, intermediate, layers, out = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    imports = resident_bytes()
    start = time.perf_counter()
    specs, input_names, output = llama_layers(kind, hidden, intermediate, layers)
    module = GraphPipelineModule(specs, input_names=input_names, output=output, num_stages=STAGES,
                                 loss_fn=NextTokenLoss(), partition_method="parameters")
    params = [p for p in module.parameters() if p.requires_grad]
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
              "steps_per_print": 10**6, "graph_pipeline": {"print_stage_graph": False, "print_memory": False}}
    engine, *_ = gpp_deepspeed.initialize(model=module, optimizer=torch.optim.SGD(params, lr=1e-3),
                                          model_parameters=params, config=config)
    seconds = time.perf_counter() - start
    stage_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump({"rank": rank, "stage": engine.stage_id, "kind": kind, "imports": imports,
                   "peak": process_peak_bytes(), "stage_param_bytes": stage_bytes, "seconds": seconds}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
