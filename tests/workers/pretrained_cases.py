"""Worker: a Llama built on the meta device, pipelined, from and to Hugging Face directories.

Run by ``tests/test_large_models.py`` through ``tests/dist.py``:

    python pretrained_cases.py init OUT_DIR              # materialised by the model's own init
    python pretrained_cases.py roundtrip IN_DIR OUT_DIR  # loaded from IN_DIR, trained, saved to OUT_DIR/saved
    python pretrained_cases.py bad OUT_DIR               # models that cannot be built: the error of each
    python pretrained_cases.py peft IN_DIR OUT_DIR       # LoRA on IN_DIR's weights, trained, adapter saved
    python pretrained_cases.py init OUT_A + roundtrip IN_DIR OUT_B + ...   # several, in order, in one launch

Several modes joined by ``+`` run one after the other in the same processes (a barrier between),
so the tests pay one start of torch, DeepSpeed and transformers per rank for all of them.

``init`` writes ``OUT_DIR/init.rank<r>.pt`` (this stage's initial weights by module name, and its
parameter bytes). ``roundtrip`` records every tensor this rank read from IN_DIR (by wrapping
``safetensors.safe_open``), trains ``STEPS`` batches, gathers the memory report, saves the pipeline
as a directory and writes ``OUT_DIR/roundtrip.rank<r>.pt`` (losses, tensors read, every rank's
memory report beside this rank's own count of its tensors, eval logits on the output stage).
``bad`` writes ``OUT_DIR/bad.rank<r>.json``: ``{case: [exception type, message]}``. ``peft`` builds
the Llama on the meta device, wraps it with a LoRA adapter (``peft.get_peft_model``), loads the base
weights from IN_DIR, fine-tunes the adapter pipelined, saves it to ``OUT_DIR/adapter`` (and the merged
model to ``OUT_DIR/merged``) and writes ``OUT_DIR/peft.rank<r>.pt`` (losses, eval logits on the
output stage, trainable parameter names).
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch import nn

from llama_tiny import GAS, LR, MBS, STAGES, STEPS, NextTokenLoss, batches, capture_llama, eval_batch


def pipeline(captured, stages=STAGES):
    from gpp_deepspeed import GraphPipelineModule
    return GraphPipelineModule(captured.layers, input_names=captured.input_names, output=captured.output,
                               num_stages=stages, loss_fn=NextTokenLoss(), partition_method="parameters")


def engine_of(module, rank):
    import gpp_deepspeed
    params = [p for p in module.parameters() if p.requires_grad]
    config = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": GAS, "train_batch_size": MBS * GAS,
              "steps_per_print": 10**6, "gradient_clipping": 0.0,
              "graph_pipeline": {"print_stage_graph": rank == 0}}
    engine, *_ = gpp_deepspeed.initialize(model=module, optimizer=torch.optim.SGD(params, lr=LR),
                                          model_parameters=params, config=config)
    return engine


def run_init(out: Path, rank: int) -> None:
    captured = capture_llama(meta=True)
    module = pipeline(captured)
    state = {k: v.detach().clone() for k, v in module.graph_state_dict().items()}
    torch.save({"stage": module.stage_id, "state": captured.module_state_dict(state),
                "meta_left": [n for n, p in module.named_parameters() if p.is_meta],
                "param_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
                "layers": list(module.local_layer_names())}, out / f"init.rank{rank}.pt")


def run_roundtrip(src: Path, out: Path, rank: int) -> None:
    import safetensors
    from gpp_deepspeed import load_pretrained, save_pretrained

    read: list[str] = []
    real_open = safetensors.safe_open

    class Recorded:
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self.file.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self.file, name)

    safetensors.safe_open = Recorded
    captured = load_pretrained(capture_llama(meta=True, config_dir=src), src)
    module = pipeline(captured)
    safetensors.safe_open = real_open
    engine = engine_of(module, rank)
    losses = [engine.train_batch(data_iter=iter(batches(step))).item() for step in range(STEPS)]
    report = engine.memory_report()   # collective: every rank's StageMemory
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    counted = {"tensors": sum(t.numel() * t.element_size() for t in tensors.values()),
               "trainable": sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)}
    saved = save_pretrained(engine, out / "saved", captured, max_shard_bytes=8 * 1024)
    logits = engine.eval_batch(data_iter=iter(eval_batch()), return_logits=True)
    torch.save({"stage": engine.stage_id, "rank": rank, "losses": losses, "read": read, "files": saved["files"],
                "memory": [dataclasses.asdict(m) for m in report.ranks], "counted": counted,
                "layers": list(module.local_layer_names()),
                "logits": logits[1] if isinstance(logits, tuple) else None}, out / f"roundtrip.rank{rank}.pt")


LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def run_peft(src: Path, out: Path, rank: int) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, LlamaForCausalLM
    from gpp_deepspeed import load_pretrained, save_pretrained
    from gpp_deepspeed.frontend import capture
    from llama_tiny import LM, layer_names
    cfg = AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(**LORA))
    ids, _ = batches(0)[0]
    layers = [n.replace("m.", "m.base_model.model.", 1) for n in layer_names(cfg.num_hidden_layers)]
    captured = load_pretrained(capture(LM(model), layers=layers, example_inputs=(ids, )), src)
    module = pipeline(captured)
    engine = engine_of(module, rank)
    losses = [engine.train_batch(data_iter=iter(batches(step))).item() for step in range(STEPS)]
    save_pretrained(engine, out / "adapter", captured, peft="adapter")
    save_pretrained(engine, out / "merged", captured, peft="merged")
    logits = engine.eval_batch(data_iter=iter(eval_batch()), return_logits=True)
    torch.save({"stage": engine.stage_id, "losses": losses, "logits": logits[1] if isinstance(logits, tuple) else None,
                "trainable": [n for n, p in module.named_parameters() if p.requires_grad]}, out / f"peft.rank{rank}.pt")


class Scale(nn.Module):
    """A module with a parameter and no reset_parameters(): nothing initialises it on the meta device."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(16))

    def forward(self, x):
        return x * self.gain


class ScaledLM(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m, self.scale = model, Scale()

    def forward(self, input_ids):
        return self.scale(self.m(input_ids=input_ids).logits[..., :16])


def _meta_without_init():
    from transformers import LlamaForCausalLM
    from gpp_deepspeed.frontend import capture
    from llama_tiny import config, layer_names
    with torch.device("meta"):
        module = ScaledLM(LlamaForCausalLM(config()))
    ids, _ = batches(0)[0]
    captured = capture(module, layers=[*layer_names(), "scale"], example_inputs=(ids, ))
    return pipeline(captured, stages=2)


def _too_large():
    # About 19 B parameters (78 GB in fp32) on the meta device: far more than any stage here can hold.
    return pipeline(capture_llama(meta=True, vocab_size=128000, hidden_size=16384, intermediate_size=65536,
                                  num_attention_heads=128, num_key_value_heads=8), stages=2)


BAD = {"meta_without_init": _meta_without_init, "does_not_fit": _too_large}


def run_bad(out: Path, rank: int) -> None:
    errors = {}
    for name, build in BAD.items():
        try:
            build()
            errors[name] = ["none", ""]
        except Exception as exc:   # every rank records what it raised
            errors[name] = [type(exc).__name__, str(exc)]
    (out / f"bad.rank{rank}.json").write_text(json.dumps(errors))


def main():
    import deepspeed
    from dist import runs
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    modes = {"init": run_init, "bad": run_bad, "peft": run_peft, "roundtrip": run_roundtrip}
    for mode, *paths in runs(sys.argv[1:]):
        modes[mode](*map(Path, paths), rank)
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
