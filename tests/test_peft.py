"""PEFT adapters on pretrained weights, end to end (issue 30): a base Llama directory, the model built
on the meta device and wrapped with LoRA, the base weights loaded, the adapter fine-tuned on 4 gloo
ranks and saved as PEFT saves it; ``PeftModel.from_pretrained`` on one process then gives the
pipeline's logits, and the merged directory loads into the base class.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft", reason="the [hf] extra (make test installs it)")

from gpp_deepspeed import load_pretrained  # noqa: E402
from gpp_deepspeed.errors import CheckpointError  # noqa: E402
from gpp_deepspeed.frontend import capture  # noqa: E402
from llama_tiny import LM, STAGES, batches, config, eval_batch, layer_names, save_llama  # noqa: E402
from workers.pretrained_cases import LORA  # noqa: E402


def _meta_lora(num_layers: int | None = None):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    cfg = config(**({} if num_layers is None else {"num_hidden_layers": num_layers}))
    with torch.device("meta"):
        model = LM(get_peft_model(LlamaForCausalLM(cfg), LoraConfig(**LORA)))
    layers = [n.replace("m.", "m.base_model.model.", 1) for n in layer_names(cfg.num_hidden_layers)]
    ids, _ = batches(0)[0]
    return capture(model, layers=layers, example_inputs=(ids, ))


def test_a_meta_lora_model_loads_its_base_weights_and_starts_equal_to_the_base(tmp_path):
    base = save_llama(tmp_path)
    model = load_pretrained(_meta_lora(), tmp_path).graph_model()
    state = dict(model.named_parameters())
    lora_b = [p for n, p in state.items() if ".lora_B." in n]
    lora_a = [p for n, p in state.items() if ".lora_A." in n]
    # PEFT's own rule on the meta device: B = 0 (not the base model's normal(0.02)), A not zero.
    assert lora_b and all((p == 0).all() for p in lora_b) and all(p.abs().sum() > 0 for p in lora_a)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in state if ".lora_" in n} == {"q_proj", "v_proj"}
    ids, _ = batches(0)[0]
    torch.testing.assert_close(model(ids), LM(base)(ids), rtol=0, atol=0)   # the wrapped q/v hold the base weights


def test_a_base_weight_a_directory_lacks_is_reported_under_strict_false_and_refused_under_strict(tmp_path):
    save_llama(tmp_path, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"missing: \['model.layers.3.self_attn.q_proj.weight'"):
        load_pretrained(_meta_lora(num_layers=4), tmp_path)
    with pytest.warns(UserWarning, match=r"lacks \d+ tensor\(s\) of the model.*'model.layers.3.self_attn.q_proj.weight'"):
        load_pretrained(_meta_lora(num_layers=4), tmp_path, strict=False)


@pytest.mark.dist
def test_lora_fine_tuned_pipelined_saves_an_adapter_peft_loads_to_the_same_logits(pretrained):
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    src, out = pretrained["plain"], pretrained["peft"]   # launched with test_large_models' runs (conftest.py)
    ranks = [torch.load(out / f"peft.rank{r}.pt") for r in range(STAGES)]
    logits = next(r["logits"] for r in ranks if r["logits"] is not None)
    assert all(".lora_" in n for r in ranks for n in r["trainable"])   # the base stays frozen
    files = sorted(p.name for p in (out / "adapter").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == LORA["r"]
    ids, _ = eval_batch()[-1]
    base = LlamaForCausalLM.from_pretrained(src)
    untrained = LM(base)(ids)
    tuned = LM(PeftModel.from_pretrained(base, out / "adapter"))(ids)
    torch.testing.assert_close(tuned, logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(tuned, untrained)   # the adapter learned something
    merged = LM(LlamaForCausalLM.from_pretrained(out / "merged"))(ids)
    torch.testing.assert_close(merged, logits, rtol=1e-5, atol=1e-5)
