"""The tiny Llama of the tensor-parallel tests: heads, KV heads, hidden and intermediate sizes that
a TP degree of 2 divides (``llama_tiny``'s has one KV head), two decoder layers."""

from __future__ import annotations

from llama_tiny import LR, STEPS, NextTokenLoss, batches, capture_llama

__all__ = ["LR", "STEPS", "TP_CONFIG", "capture_tp_llama", "loss_of", "step_batches"]

TP_CONFIG = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 2}


def capture_tp_llama(*, meta: bool, config_dir=None, **overrides):
    """The captured LM of ``llama_tiny`` with :data:`TP_CONFIG` (seeded on CPU, or on the meta device)."""
    return capture_llama(meta=meta, config_dir=config_dir, **{**TP_CONFIG, **overrides})


def loss_of(logits, labels):
    return NextTokenLoss()(logits, labels)


def step_batches(step: int):
    return batches(step)
