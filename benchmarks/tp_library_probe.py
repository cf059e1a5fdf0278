"""Which TP library composes with ZeRO-1/2 inside a stage and with meta-device layers (issue 29, point 3).

One Llama decoder layer, sharded over a TP group of 2 gloo ranks, two ways:

- ``deepspeed``: DeepSpeed's AutoTP training layers (``LinearLayer`` column-parallel,
  ``LinearAllreduce`` row-parallel) placed by the model's own ``base_model_tp_plan``;
- ``dtensor``: torch's ``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel``) on a
  ``DeviceMesh.from_group`` of the same group.

For each: build on the meta device (then materialise) or on the CPU, shard, then ``deepspeed.initialize`` with ZeRO stage
1 and 2 (an ``mpu`` naming the TP group, data-parallel size 1) and one training step. Prints one
line per (library, step): ``ok`` or the exception. Run with 2 ranks:

    python tests/dist.py-style launch: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29531 \\
        python benchmarks/tp_library_probe.py
"""

from __future__ import annotations

import os
import traceback

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class _TPOnlyMpu:
    """An ``mpu`` whose model-parallel group is the whole world and whose data-parallel group is one rank."""

    def __init__(self, group, rank_group):
        self.group, self.rank_group = group, rank_group

    def get_model_parallel_group(self): return self.group
    def get_model_parallel_rank(self): return torch.distributed.get_rank(self.group)
    def get_model_parallel_world_size(self): return torch.distributed.get_world_size(self.group)
    def get_data_parallel_group(self): return self.rank_group
    def get_data_parallel_rank(self): return 0
    def get_data_parallel_world_size(self): return 1


def layer(meta: bool):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=64)
    if meta:
        with torch.device("meta"):
            return cfg, LlamaDecoderLayer(cfg, 0)
    torch.manual_seed(0)
    return cfg, LlamaDecoderLayer(cfg, 0)


def shard_deepspeed(cfg, module, group):
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, set_autotp_mode
    from deepspeed.module_inject.tp_shard import AutoTPMeta
    set_autotp_mode(training=True)
    meta = AutoTPMeta.from_model_config(cfg)
    for path, style in cfg.base_model_tp_plan.items():
        name = path.split(".*.")[1]
        parent, child = name.rsplit(".", 1)
        sub = module.get_submodule(parent)
        cls = LinearLayer if style == "colwise" else LinearAllreduce
        setattr(sub, child, cls(getattr(sub, child), group, name=name, tp_meta=meta))
    return module


def shard_dtensor(cfg, module, group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = DeviceMesh.from_group(group, "cpu")
    plan = {p.split(".*.")[1]: ColwiseParallel() if s == "colwise" else RowwiseParallel()
            for p, s in cfg.base_model_tp_plan.items()}
    return parallelize_module(module, mesh, plan)


def materialize(module):
    module.to_empty(device="cpu")
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.02) if p.dim() > 1 else p.fill_(1.0)
    return module


def step(module, stage: int, mpu):
    import deepspeed
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    class Wrap(torch.nn.Module):
        def __init__(self, inner, cfg):
            super().__init__()
            self.inner, self.rope = inner, LlamaRotaryEmbedding(cfg)

        def forward(self, x):
            pos = torch.arange(x.shape[1])[None]
            return self.inner(x, position_embeddings=self.rope(x, pos))

    model = Wrap(module, layer(meta=False)[0])
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                      config=config, mpu=mpu)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    out = engine(x)
    out = out[0] if isinstance(out, tuple) else out
    engine.backward(out.float().pow(2).mean())
    engine.step()
    return type(next(model.inner.parameters())).__name__


def main() -> None:
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    group = torch.distributed.new_group([0, 1])
    singles = [torch.distributed.new_group([r]) for r in range(2)]
    mpu = _TPOnlyMpu(group, singles[rank])
    for name, shard in (("deepspeed", shard_deepspeed), ("dtensor", shard_dtensor)):
        for meta, stage in ((True, 1), (True, 2), (False, 1), (False, 2)):
            where = "meta" if meta else "cpu"
            try:
                cfg, module = layer(meta=meta)
                module = shard(cfg, module, group)
                module = materialize(module) if meta else module
                kind = step(module, stage, mpu)
                print(f"PROBE {name} built on {where} zero{stage}: ok (param type {kind})", flush=True)
            except Exception as e:   # the evidence is the exception itself
                last = [l.strip() for l in traceback.format_exc().splitlines() if "File" in l and ("deepspeed/" in l or "probe" in l)][-2:]
                print(f"PROBE {name} built on {where} zero{stage}: {type(e).__name__}: {str(e)[:300]} | {' / '.join(last)[:400]}",
                      flush=True)
            torch.distributed.barrier()


if __name__ == "__main__":
    main()
