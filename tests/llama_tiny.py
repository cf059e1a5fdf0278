"""A tiny, randomly initialised Llama for the large-model tests (meta device, pretrained directories).

Its output projection is tied to the token embedding (``tie_word_embeddings=True``) so that the
tie crosses the pipeline (stage 0 to the last stage). Nothing is downloaded: directories are
written by the tests with ``save_pretrained``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

STEPS, GAS, MBS, LR, STAGES = 3, 2, 2, 0.1, 4
VOCAB, SEQ, LAYERS = 64, 8, 4


def config(**overrides):
    from transformers import LlamaConfig
    return LlamaConfig(**{"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": LAYERS,
                          "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32,
                          "use_cache": False, "tie_word_embeddings": True, **overrides})


class LM(nn.Module):
    """A causal LM returning its logits (the one tensor the loss reads)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.m = model

    def forward(self, input_ids):
        return self.m(input_ids=input_ids).logits


class NextTokenLoss(nn.Module):
    def forward(self, logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def layer_names(num_layers: int = LAYERS) -> list[str]:
    return ["m.model.embed_tokens", *(f"m.model.layers.{i}" for i in range(num_layers)), "m.model.norm", "m.lm_head"]


def _batch(g: torch.Generator):
    ids = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def batches(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    return [_batch(g) for _ in range(GAS)]


def eval_batch():
    """``GAS`` evaluation micro-batches; ``eval_batch(return_logits=True)`` returns the last one's logits."""
    return batches(100)


def save_llama(directory, *, shard: str | None = None, seed: int = 0, **overrides) -> nn.Module:
    """A seeded tiny Llama (``config(**overrides)``), saved to ``directory`` by ``save_pretrained``
    (in shards of at most ``shard``, e.g. ``"20KB"``, when given); returns the model."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config(**overrides))
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return model


def capture_llama(*, meta: bool, config_dir=None, **overrides):
    """The captured LM: built on the meta device (nothing allocated) or seeded on CPU; its config
    from ``config_dir`` (a Hugging Face directory) when given."""
    from transformers import AutoConfig, LlamaForCausalLM
    from gpp_deepspeed.frontend import capture
    if config_dir is not None:
        cfg = AutoConfig.from_pretrained(config_dir)
        cfg.use_cache = False
    else:
        cfg = config(**overrides)
    if meta:
        with torch.device("meta"):
            module = LM(LlamaForCausalLM(cfg))
    else:
        torch.manual_seed(0)
        module = LM(LlamaForCausalLM(cfg))
    ids, _ = batches(0)[0]
    return capture(module, layers=layer_names(cfg.num_hidden_layers), example_inputs=(ids, ))


def train_reference(directory, steps: int = STEPS):
    """The reference: the model ``from_pretrained(directory)`` trained on one process with plain PyTorch
    (SGD, the mean loss over micro-batches); returns the losses and the trained model."""
    from transformers import LlamaForCausalLM
    model = LM(LlamaForCausalLM.from_pretrained(directory))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for ids, labels in batches(step):
            loss = NextTokenLoss()(model(ids), labels)
            (loss / GAS).backward()
            total += loss.item()
        opt.step()
        losses.append(total / GAS)
    return losses, model
