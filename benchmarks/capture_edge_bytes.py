"""Bytes per micro-batch on each stage edge of a captured Llama-style model.

    .venv/bin/python benchmarks/capture_edge_bytes.py            # prints a markdown table

``transformers.LlamaForCausalLM`` at TinyLlama-1.1B's shape (22 decoder layers of width 2048,
grouped-query attention with 4 key/value heads), in bf16, one micro-batch of 1 x 2048 tokens, is
built on the meta device (no memory, nothing downloaded), captured at layer granularity with
``example_inputs`` and cut into 4 stages by the default ``partition_method="parameters"``.
:meth:`GraphModel.edge_bytes` runs the captured layers on meta tensors and adds up the tensors
each stage edge carries: exactly the sizes the engine sends (gradients return as many bytes).

Deterministic and single-process: no timing is involved. docs/capture.md keeps the table, with
the same figures taken before capture derived ``.device`` from the stage's own tensors.
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from gpp_deepspeed.frontend import capture  # noqa: E402
from gpp_deepspeed.graph import build_layer_graph  # noqa: E402
from gpp_deepspeed.partitioning import parse_partition_method, resolve_partition  # noqa: E402

NUM_LAYERS, HIDDEN, SEQ, MICRO_BATCH, NUM_STAGES = 22, 2048, 2048, 1, 4


class LlamaLogits(nn.Module):
    """The unmodified ``LlamaForCausalLM``, returning logits."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        self.llama = LlamaForCausalLM(LlamaConfig(
            vocab_size=32000, hidden_size=HIDDEN, intermediate_size=5632, num_hidden_layers=NUM_LAYERS,
            num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=SEQ, use_cache=False))

    def forward(self, input_ids):
        return self.llama(input_ids=input_ids).logits


def main() -> None:
    with torch.device("meta"):
        module = LlamaLogits().to(torch.bfloat16)
    ids = torch.zeros(MICRO_BATCH, SEQ, dtype=torch.long, device="meta")
    layers = ["llama.model.embed_tokens", "llama.model.rotary_emb",
              *(f"llama.model.layers.{i}" for i in range(NUM_LAYERS)), "llama.model.norm", "llama.lm_head"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(module, layers=layers, example_inputs=(ids, ))
    graph = build_layer_graph(captured.input_names, [(s.name, s.inputs) for s in captured.layers],
                              output=captured.output)
    model = captured.graph_model()
    counts = {s.name: sum(p.numel() for p in model.layers[s.name].parameters()) if s.name in model.layers else 0
              for s in captured.layers}
    partition = resolve_partition(graph, parse_partition_method("parameters"), num_stages=NUM_STAGES,
                                  param_count=counts).partition
    sizes = model.edge_bytes(partition, ids)
    print(f"Llama-style, {NUM_LAYERS} layers x {HIDDEN}, bf16, micro-batch {MICRO_BATCH} x {SEQ} tokens, "
          f"{NUM_STAGES} stages (partition_method='parameters')\n")
    print("| edge | tensors | MiB per micro-batch |")
    print("|---|---|---:|")
    for edge in partition.stage_graph.edges:
        names = ", ".join(f"`{t}`" for t in edge.tensors)
        print(f"| {edge.src} -> {edge.dst} | {names} | {sizes[(edge.src, edge.dst)] / 2**20:.2f} |")
    print(f"| total | | {sum(sizes.values()) / 2**20:.2f} |")


if __name__ == "__main__":
    main()
