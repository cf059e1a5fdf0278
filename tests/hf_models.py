"""Tiny, randomly initialised ``transformers`` models for the capture tests; nothing is downloaded.

Each :class:`HFCase` builds the unmodified ``transformers`` model (seeded, so every rank and the
reference build the same weights) inside a thin wrapper whose ``forward`` returns the one tensor
the loss reads, and says how ``capture`` cuts it. :func:`train_module` is the independent
reference: the wrapper trained on one process with plain PyTorch.

Dropout is 0 so that a pipelined run and the reference compute the same function.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

STEPS, GAS, MBS, LR = 3, 2, 4, 0.05
VOCAB, SEQ, IMAGE, PATCH = 40, 6, 8, 4


def _tiny(**extra) -> dict:
    return {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, **extra}


class ContrastiveLoss(nn.Module):
    """CLIP's symmetric loss: cross-entropy over images and over texts, matching pairs on the diagonal."""

    def forward(self, logits_per_image, labels):
        return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_image.t(), labels)) / 2


class CLIPLogits(nn.Module):
    """``transformers.CLIPModel`` returning ``logits_per_image``."""

    def __init__(self, frozen_vision: bool = False):
        super().__init__()
        from transformers import CLIPConfig, CLIPModel
        config = CLIPConfig(text_config=_tiny(vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0,
                                              eos_token_id=2, pad_token_id=1),
                            vision_config=_tiny(image_size=IMAGE, patch_size=PATCH), projection_dim=8)
        self.clip = CLIPModel(config)
        if frozen_vision:
            self.clip.vision_model.requires_grad_(False)
            self.clip.visual_projection.requires_grad_(False)

    def forward(self, input_ids, pixel_values):
        return self.clip(input_ids=input_ids, pixel_values=pixel_values).logits_per_image


def _clip_batches(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    return [((torch.randint(3, VOCAB, (MBS, SEQ), generator=g), torch.randn(MBS, 3, IMAGE, IMAGE, generator=g)),
             torch.arange(MBS)) for _ in range(GAS)]


class GPT2Logits(nn.Module):
    """``transformers.GPT2LMHeadModel`` (its output projection tied to the token embedding) returning logits."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
        self.gpt = GPT2LMHeadModel(config)

    def forward(self, input_ids):
        return self.gpt(input_ids=input_ids).logits


class NextTokenLoss(nn.Module):
    """Language-model loss: each position predicts the next token (labels -100 are ignored)."""

    def forward(self, logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _lm_batches(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    batches = []
    for _ in range(GAS):
        ids = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        batches.append((ids, torch.cat([ids[:, 1:], torch.full((MBS, 1), -100)], dim=1)))
    return batches


class ImageCaptioner(nn.Module):
    """``transformers.VisionEncoderDecoderModel``: a ViT encoder and a GPT-2 decoder whose every
    layer cross-attends to the image; returns the caption logits."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, ViTConfig, VisionEncoderDecoderConfig, VisionEncoderDecoderModel
        encoder = ViTConfig(**_tiny(image_size=IMAGE, patch_size=PATCH, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0))
        decoder = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
                             add_cross_attention=True, is_decoder=True)
        self.ved = VisionEncoderDecoderModel(config=VisionEncoderDecoderConfig.from_encoder_decoder_configs(
            encoder, decoder))

    def forward(self, pixel_values, decoder_input_ids):
        return self.ved(pixel_values=pixel_values, decoder_input_ids=decoder_input_ids).logits


def _caption_batches(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    batches = []
    for _ in range(GAS):
        ids = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        labels = torch.cat([ids[:, 1:], torch.full((MBS, 1), -100)], dim=1)
        batches.append(((torch.randn(MBS, 3, IMAGE, IMAGE, generator=g), ids), labels))
    return batches


class BertClassifier(nn.Module):
    """``transformers.BertForSequenceClassification`` taking token ids and a padding mask."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification
        self.bert = BertForSequenceClassification(BertConfig(
            vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            num_labels=3, **_tiny(num_hidden_layers=2)))

    def forward(self, input_ids, attention_mask):
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).logits


def _bert_batches(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    batches = []
    for _ in range(GAS):
        lengths = torch.randint(2, SEQ + 1, (MBS, 1), generator=g)
        mask = (torch.arange(SEQ) < lengths).long()                    # [batch, seq] int64, 0 = padding
        batches.append(((torch.randint(0, VOCAB, (MBS, SEQ), generator=g), mask),
                        torch.randint(0, 3, (MBS, ), generator=g)))
    return batches


class T5Logits(nn.Module):
    """``transformers.T5ForConditionalGeneration`` as it is: its encoder calls one dropout module
    twice, and the token embedding (``shared``, both stacks' ``embed_tokens``) is tied to the output
    projection."""

    def __init__(self):
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration
        self.t5 = T5ForConditionalGeneration(T5Config(
            vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, use_cache=False))

    def forward(self, input_ids, decoder_input_ids):
        return self.t5(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits


def _t5_batches(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    batches = []
    for _ in range(GAS):
        source, target = torch.randint(2, VOCAB, (MBS, SEQ), generator=g), torch.randint(2, VOCAB, (MBS, SEQ), generator=g)
        decoder_input_ids = torch.cat([torch.zeros(MBS, 1, dtype=torch.long), target[:, :-1]], dim=1)
        batches.append(((source, decoder_input_ids), target))
    return batches


class LlamaLogits(nn.Module):
    """``transformers.LlamaForCausalLM`` as it is: every decoder layer's mask and positions are
    built from ``inputs_embeds.device``, which capture reads on the layer's own stage instead."""

    def __init__(self, attention: str = "sdpa"):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        self.llama = LlamaForCausalLM(LlamaConfig(**_tiny(num_hidden_layers=2, vocab_size=VOCAB, num_key_value_heads=1,
                                                          max_position_embeddings=SEQ, use_cache=False),
                                                  attn_implementation=attention))

    def forward(self, input_ids):
        return self.llama(input_ids=input_ids).logits


IMAGE_TOKEN = VOCAB - 1
IMAGE_TOKENS = (IMAGE // PATCH)**2              # one per patch


class LlavaLogits(nn.Module):
    """``transformers.LlavaForConditionalGeneration`` as it is: a CLIP vision tower whose
    second-to-last hidden state (collected by forward hooks) is projected into the image tokens'
    places among a Llama decoder's token embeddings (``list(image_features)`` splits the batch)."""

    def __init__(self):
        super().__init__()
        from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
        vision = CLIPVisionConfig(**_tiny(num_hidden_layers=2, image_size=IMAGE, patch_size=PATCH))
        text = LlamaConfig(**_tiny(num_hidden_layers=2, vocab_size=VOCAB, num_key_value_heads=1,
                                   max_position_embeddings=4 * SEQ, use_cache=False))
        self.llava = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text,
                                                               image_token_id=IMAGE_TOKEN))

    def forward(self, input_ids, pixel_values):
        return self.llava(input_ids=input_ids, pixel_values=pixel_values).logits


def _llava_batches(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    batches = []
    for _ in range(GAS):
        text = torch.randint(0, IMAGE_TOKEN, (MBS, SEQ), generator=g)
        ids = torch.cat([torch.full((MBS, IMAGE_TOKENS), IMAGE_TOKEN), text], dim=1)   # image first, then text
        labels = torch.cat([torch.full((MBS, IMAGE_TOKENS), -100), text[:, 1:], torch.full((MBS, 1), -100)], dim=1)
        batches.append(((ids, torch.randn(MBS, 3, IMAGE, IMAGE, generator=g)), labels))
    return batches


class HiddenStateSum(nn.Module):
    """A classifier over the sum of every hidden state of ``transformers.BertModel`` (as speech models
    weigh their layers): transformers 5 collects ``hidden_states`` with forward hooks on the layers."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertModel
        self.bert = BertModel(BertConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, **_tiny(num_hidden_layers=2)),
                              add_pooling_layer=False)
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids):
        hidden = self.bert(input_ids=input_ids, output_hidden_states=True).hidden_states
        return self.head(torch.stack(hidden).sum(dim=0)[:, 0])


def _classify_batches(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    return [(torch.randint(0, VOCAB, (MBS, SEQ), generator=g), torch.randint(0, 3, (MBS, ), generator=g))
            for _ in range(GAS)]


@dataclass
class Encoded:
    """A layer output that is a dataclass."""

    tokens: torch.Tensor
    pooled: torch.Tensor


class DictTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(6, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.proj(x))
        return {"hidden": h, "pair": (self.out(h), h.mean(dim=-1, keepdim=True))}


class DataclassTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(10, 8)

    def forward(self, x):
        h = self.proj(x)
        return Encoded(tokens=h, pooled=torch.sigmoid(h))


class StructuredTwoTower(nn.Module):
    """Towers returning a dict of a tensor and a tuple, and a dataclass; the head reads some leaves."""

    def __init__(self):
        super().__init__()
        self.text, self.image = DictTower(), DataclassTower()
        self.head = nn.Linear(16, 3)

    def forward(self, text, image):
        t, i = self.text(text), self.image(image)
        return self.head(torch.cat([t["pair"][0] + t["hidden"], i.pooled], dim=-1))


def _structured_batches(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    return [((torch.randn(MBS, 6, generator=g), torch.randn(MBS, 10, generator=g)),
             torch.randint(0, 3, (MBS, ), generator=g)) for _ in range(GAS)]


@dataclass
class HFCase:
    """A transformers model, how capture cuts it into stages, its data and its loss."""

    build: Callable[[], nn.Module]
    layers: list[str] | None
    stages: int
    batches: Callable[[int], list]           # step -> [((inputs...), labels)] per micro-batch
    loss_fn: nn.Module
    partition: Any = "parameters"
    shaped: bool = False                     # trace on meta tensors of the first batch's shapes
    # Traced, transformers materialises the causal mask of a Llama-style decoder where the module
    # lets sdpa apply it (is_causal=True): the same function through another kernel, whose
    # gradients may differ in the last bits. The forward stays exact.
    masks_materialised: bool = False
    stage_degrees: tuple[int, ...] | None = None     # ranks per stage (default one each)

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return self.build()

    def partition_method(self, captured) -> Any:
        """``partition``, or what it returns for the captured model when it is a function."""
        return self.partition(captured) if callable(self.partition) else self.partition

    def capture(self, module: nn.Module):
        from gpp_deepspeed.frontend import capture
        inputs = self.batches(0)[0][0]
        example = (inputs if isinstance(inputs, tuple) else (inputs, )) if self.shaped else None
        return capture(module, layers=self.layers, example_inputs=example)


CLIP_LAYERS = ["clip.text_model", "clip.vision_model", "clip.visual_projection", "clip.text_projection"]

GPT2_LAYERS = ["gpt.transformer.wte", "gpt.transformer.wpe", "gpt.transformer.h.0", "gpt.transformer.h.1",
               "gpt.transformer.ln_f", "gpt.lm_head"]

VED_LAYERS = ["ved.encoder", *(f"ved.decoder.transformer.{n}" for n in ("wte", "wpe", "h.0", "h.1", "ln_f")),
              "ved.decoder.lm_head"]
# Stage 0: the image encoder; stage 1: caption embeddings and the first decoder layer, in parallel
# with stage 0; stage 2: the second decoder layer and the head. Both decoder stages read the image.
VED_STAGES = {"ved.encoder": 0, "ved.decoder.transformer.h.1": 2, "ved.decoder.transformer.ln_f": 2,
              "ved.decoder.lm_head": 2}

BERT_LAYERS = ["bert.bert.embeddings", "bert.bert.encoder.layer.0", "bert.bert.encoder.layer.1", "bert.bert.pooler",
               "bert.classifier"]
# The attention mask, built from the padding mask on stage 0 (the glue layer "expand", named so it
# does not follow its first reader to stage 1), is read by the layers of stages 1 and 2.
BERT_STAGES = {"bert.bert.embeddings": 0, "expand": 0, "bert.bert.encoder.layer.0": 1}

T5_LAYERS = [f"t5.{stack}.block.{i}" for stack in ("encoder", "decoder") for i in range(2)] + [
    "t5.encoder.final_layer_norm", "t5.decoder.final_layer_norm", "t5.lm_head"]
# Stage 0: the encoder; stage 1: the target embedding and the first decoder layer; stage 2: the
# second decoder layer and the head. The embedding is tied to the head across all three stages.
# The decoder calls its dropout twice: the first call, a layer of its own, goes with the embedding.
T5_STAGES = {"t5.encoder": 0, "t5.decoder.embed_tokens": 1, "t5_decoder_dropout": 1, "t5.decoder.block.0": 1}

LLAMA_LAYERS = ["llama.model.embed_tokens", "llama.model.rotary_emb", "llama.model.layers.0", "llama.model.layers.1",
                "llama.model.norm", "llama.lm_head"]
# Stage 0: the embedding and the rotary tables; stage 1: the first decoder layer; stage 2: the rest.
LLAMA_STAGES = {"llama.model.embed_tokens": 0, "llama.model.rotary_emb": 0, "llama.model.layers.0": 1}

LLAVA_VISION = "llava.model.vision_tower"
LLAVA_TEXT = "llava.model.language_model"
LLAVA_LAYERS = [f"{LLAVA_VISION}.{n}" for n in ("embeddings", "pre_layrnorm", "encoder.layers.0", "encoder.layers.1")] + [
    "llava.model.multi_modal_projector", f"{LLAVA_TEXT}.embed_tokens", f"{LLAVA_TEXT}.layers.0", f"{LLAVA_TEXT}.layers.1",
    f"{LLAVA_TEXT}.norm", "llava.lm_head"]
# Stage 0: the vision tower and the projector; stage 1: the token embedding, concurrently; stage 2:
# the merge (the glue layer "masked_scatter"), the decoder and the head.
LLAVA_STAGES = {LLAVA_VISION: 0, "llava.model.multi_modal_projector": 0, f"{LLAVA_TEXT}.embed_tokens": 1}

HIDDEN_SUM_LAYERS = ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "head"]


def _stages(stages: dict[str, int], default: int) -> Callable:
    return lambda captured: captured.stage_map(stages, default=default)


CASES: dict[str, HFCase] = {
    "clip": HFCase(CLIPLogits, CLIP_LAYERS, 3, _clip_batches, ContrastiveLoss()),
    # LiT-style: the image tower and its projection are locked; stage 0 runs forwards only.
    "clip_frozen": HFCase(lambda: CLIPLogits(frozen_vision=True), CLIP_LAYERS, 3, _clip_batches, ContrastiveLoss()),
    "structured": HFCase(StructuredTwoTower, None, 3, _structured_batches, nn.CrossEntropyLoss(),
                         partition={"text_1": 0, "image_1": 1, "cat": 2, "head": 2}),
    # The token embedding (stage 0) and the output projection (stage 2) share one weight.
    "gpt2": HFCase(GPT2Logits, GPT2_LAYERS, 3, _lm_batches, NextTokenLoss(), shaped=True),
    "bert": HFCase(BertClassifier, BERT_LAYERS, 3, _bert_batches, nn.CrossEntropyLoss(), shaped=True,
                   partition=_stages(BERT_STAGES, 2)),
    # Captured at the pipeline's 4 rows; a rank of the 2-rank stage 0 runs 2 of them (the mask
    # code's sizes follow the rows).
    "bert_wide": HFCase(BertClassifier, BERT_LAYERS, 3, _bert_batches, nn.CrossEntropyLoss(), shaped=True,
                        partition=_stages(BERT_STAGES, 2), stage_degrees=(2, 1, 1)),
    "ved": HFCase(ImageCaptioner, VED_LAYERS, 3, _caption_batches, NextTokenLoss(), shaped=True,
                  partition=_stages(VED_STAGES, 1)),
    "llama": HFCase(LlamaLogits, LLAMA_LAYERS, 3, _lm_batches, NextTokenLoss(), shaped=True, masks_materialised=True,
                    partition=_stages(LLAMA_STAGES, 2)),
    # Eager attention: the mask is filled with torch.finfo(dtype).min of the embedding's dtype.
    "llama_eager": HFCase(lambda: LlamaLogits("eager"), LLAMA_LAYERS, 3, _lm_batches, NextTokenLoss(), shaped=True,
                          partition=_stages(LLAMA_STAGES, 2)),
    "llava": HFCase(LlavaLogits, LLAVA_LAYERS, 3, _llava_batches, NextTokenLoss(), shaped=True, partition=_stages(LLAVA_STAGES, 2),
                    masks_materialised=True),
    # Llava's capture unrolls over the rows, so it fits 4 rows only: refused with 2 on stage 0.
    "llava_wide": HFCase(LlavaLogits, LLAVA_LAYERS, 3, _llava_batches, NextTokenLoss(), shaped=True,
                         partition=_stages(LLAVA_STAGES, 2), masks_materialised=True, stage_degrees=(2, 1, 1)),
    # Its ModelOutput asks torch.is_tensor of a layer's output, which only the shaped trace can answer.
    "hidden_sum": HFCase(HiddenStateSum, HIDDEN_SUM_LAYERS, 3, _classify_batches, nn.CrossEntropyLoss(), shaped=True),
    "t5": HFCase(T5Logits, T5_LAYERS, 3, _t5_batches, NextTokenLoss(), shaped=True,
                 partition=_stages(T5_STAGES, 2)),
}


def train_module(case: HFCase, steps: int = STEPS) -> tuple[list[float], dict]:
    """The reference: the unmodified module trained on one process (SGD, mean over micro-batches,
    gradients clipped at 1.0 by global norm as DeepSpeed does by default)."""
    module = case.model()
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        batches = case.batches(step)
        for inputs, labels in batches:
            loss = case.loss_fn(module(*inputs) if isinstance(inputs, tuple) else module(inputs), labels)
            (loss / len(batches)).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(total / len(batches))
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}
