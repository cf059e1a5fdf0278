"""Worker of tests/test_tp_hf_pipeline.py (issue 29 acceptance).

A captured Llama-style model (``tp_llama.TP_CONFIG``: 2 decoder layers, 4 heads, 2 KV heads, its head
tied to the embedding) on 6 gloo ranks, four stages: the embedding (and the rotary glue) at TP 1,
each decoder layer at TP 2, the norm and head at TP 1. Loaded on the meta device from a
``save_pretrained`` directory (each rank reading its slices), trained ``STEPS`` batches, saved with
``save_pretrained`` (whole tensors, gathered in each TP group) and evaluated:

    python tp_hf_pipeline.py IN_DIR OUT_DIR     # writes OUT_DIR/saved and OUT_DIR/tp.rank<r>.pt
"""

import sys
from pathlib import Path

import torch

from llama_tiny import GAS, LR, MBS, STEPS, NextTokenLoss, batches, eval_batch
from tp_llama import capture_tp_llama

STAGE_OF = {"m.model.embed_tokens": 0, "m.model.layers.0": 1, "m.model.layers.1": 2, "m.model.norm": 3, "m.lm_head": 3}
STAGE_TP = [1, 2, 2, 1]   # 6 ranks: 1 + 2 + 2 + 1


def pipeline_with_tp(captured):
    """The pipeline: ranks per stage by ``stage_degrees``, their TP degree by ``stage_tp`` (the
    module builds the TP groups; the config's ``graph_pipeline.stage_tp`` must agree)."""
    from gpp_deepspeed import GraphPipelineModule
    module = GraphPipelineModule(captured.layers, input_names=captured.input_names, output=captured.output,
                                 num_stages=len(STAGE_TP), loss_fn=NextTokenLoss(),
                                 partition_method=captured.stage_map(STAGE_OF, default=0), stage_degrees=STAGE_TP,
                                 stage_tp=STAGE_TP)
    config = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": GAS,
              "train_batch_size": MBS * GAS, "steps_per_print": 10**6, "gradient_clipping": 0.0,
              "graph_pipeline": {"stage_tp": STAGE_TP}}
    return module, config


def main(src: Path, out: Path) -> None:
    import gpp_deepspeed
    import torch.distributed as dist
    from gpp_deepspeed import load_pretrained, save_pretrained
    captured = load_pretrained(capture_tp_llama(meta=True, config_dir=src), src)
    module, config = pipeline_with_tp(captured)
    params = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = gpp_deepspeed.initialize(model=module, optimizer=torch.optim.SGD(params, lr=LR),
                                          model_parameters=params, config=config)
    losses = [engine.train_batch(data_iter=iter(batches(step))).item() for step in range(STEPS)]
    report = engine.memory_report()
    save_pretrained(engine, out / "saved", captured, max_shard_bytes=8 * 1024)
    logits = engine.eval_batch(data_iter=iter(eval_batch()), return_logits=True)
    torch.save({"stage": engine.stage_id, "losses": losses, "tp": [m.tp for m in report.ranks],
                "split": sorted(n for n, p in module.named_parameters() if getattr(p, "tensor_model_parallel", False)),
                "logits": logits[1] if isinstance(logits, tuple) else None}, out / f"tp.rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
