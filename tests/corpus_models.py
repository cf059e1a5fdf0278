"""The capture regression corpus: models people fine-tune, captured as they are (issue 30).

Each is unmodified: a diffusers U-Net whose forward asks ``torch.is_tensor(timesteps)``, one with
cross-attention to a text encoding, BLIP-2 (a learned query expanded to the batch feeding a Q-Former
that cannot run on meta tensors), and a ViT whose class token is expanded to the batch. Tiny and
randomly initialised; every case is trained pipelined on 4 gloo ranks (4 stages) by
``tests/workers/hf_cases.py`` and compared with :func:`hf_models.train_module`.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_models import GAS, IMAGE, MBS, PATCH, VOCAB, HFCase, NextTokenLoss, _tiny

UNET_LAYERS = ["unet.time_proj", "unet.time_embedding", "unet.conv_in", "unet.down_blocks.0", "unet.down_blocks.1",
               "unet.mid_block", "unet.up_blocks.0", "unet.up_blocks.1", "unet.conv_norm_out", "unet.conv_act",
               "unet.conv_out"]
TEXT, TEXT_DIM = 5, 12


def _unet_kwargs(**extra) -> dict:
    return dict(sample_size=IMAGE, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                norm_num_groups=4, attention_head_dim=4, **extra)


class Denoiser(nn.Module):
    """``diffusers.UNet2DModel``: predicts the noise of a sample at integer timesteps."""

    def __init__(self):
        super().__init__()
        from diffusers import UNet2DModel
        self.unet = UNet2DModel(**_unet_kwargs(down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                               up_block_types=("AttnUpBlock2D", "UpBlock2D")))

    def forward(self, sample, timesteps):
        return self.unet(sample, timesteps).sample


class TextDenoiser(nn.Module):
    """``diffusers.UNet2DConditionModel``: Stable Diffusion's U-Net, cross-attending to a text encoding."""

    def __init__(self):
        super().__init__()
        from diffusers import UNet2DConditionModel
        self.unet = UNet2DConditionModel(**_unet_kwargs(
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=TEXT_DIM))

    def forward(self, sample, timesteps, encoder_hidden_states):
        return self.unet(sample, timesteps, encoder_hidden_states).sample


def _denoise_batches(step: int, text: bool = False) -> list:
    g = torch.Generator().manual_seed(step)
    batches = []
    for _ in range(GAS):
        inputs = (torch.randn(MBS, 3, IMAGE, IMAGE, generator=g), torch.randint(0, 1000, (MBS, ), generator=g))
        if text:
            inputs += (torch.randn(MBS, TEXT, TEXT_DIM, generator=g), )
        batches.append((inputs, torch.randn(MBS, 3, IMAGE, IMAGE, generator=g)))
    return batches


QUERY_TOKENS, BLIP_SEQ = 2, 6
BLIP_IMAGE_TOKEN = VOCAB - 1
BLIP_LAYERS = ["blip.vision_model", "blip.qformer", "blip.language_projection"] + [
    f"blip.language_model.model.decoder.{n}" for n in ("embed_tokens", "embed_positions", "layers.0", "layers.1",
                                                        "final_layer_norm")] + ["blip.language_model.lm_head"]


class Blip2Logits(nn.Module):
    """``transformers.Blip2ForConditionalGeneration``: vision tower -> Q-Former (learned query tokens
    expanded to the batch) -> projection into the image tokens' places among an OPT decoder's embeddings."""

    def __init__(self):
        super().__init__()
        from transformers import Blip2Config, Blip2ForConditionalGeneration
        config = Blip2Config(
            vision_config=_tiny(image_size=IMAGE, patch_size=PATCH),
            qformer_config=_tiny(encoder_hidden_size=16, vocab_size=VOCAB, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0),
            text_config=dict(model_type="opt", hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2,
                             vocab_size=VOCAB, word_embed_proj_dim=16, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                             use_cache=False),
            num_query_tokens=QUERY_TOKENS, image_token_index=BLIP_IMAGE_TOKEN)
        self.blip = Blip2ForConditionalGeneration(config)

    def forward(self, pixel_values, input_ids):
        return self.blip(pixel_values=pixel_values, input_ids=input_ids).logits


def _blip_batches(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    batches = []
    for _ in range(GAS):
        text = torch.randint(0, BLIP_IMAGE_TOKEN, (MBS, BLIP_SEQ - QUERY_TOKENS), generator=g)
        ids = torch.cat([torch.full((MBS, QUERY_TOKENS), BLIP_IMAGE_TOKEN), text], dim=1)   # queries first
        labels = torch.cat([torch.full((MBS, QUERY_TOKENS), -100), text[:, 1:], torch.full((MBS, 1), -100)], dim=1)
        batches.append(((torch.randn(MBS, 3, IMAGE, IMAGE, generator=g), ids), labels))
    return batches


VIT_LAYERS = ["vit.vit.embeddings.patch_embeddings", "vit.vit.layers.0", "vit.vit.layers.1", "vit.vit.layernorm",
              "vit.classifier"]


class ViTClassifier(nn.Module):
    """``transformers.ViTForImageClassification``: a class token expanded to the batch before the patches."""

    def __init__(self):
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification
        self.vit = ViTForImageClassification(ViTConfig(**_tiny(num_hidden_layers=2, image_size=IMAGE, patch_size=PATCH,
                                                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                                num_labels=3)))

    def forward(self, pixel_values):
        return self.vit(pixel_values=pixel_values).logits


def _image_batches(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    return [((torch.randn(MBS, 3, IMAGE, IMAGE, generator=g), ), torch.randint(0, 3, (MBS, ), generator=g))
            for _ in range(GAS)]


# Every case on 4 stages, one rank each (4 gloo ranks), cut by parameter count.
CORPUS: dict[str, HFCase] = {
    "unet2d": HFCase(Denoiser, UNET_LAYERS, 4, _denoise_batches, nn.MSELoss(), shaped=True),
    "unet2d_cond": HFCase(TextDenoiser, UNET_LAYERS, 4, lambda step: _denoise_batches(step, text=True), nn.MSELoss(),
                          shaped=True),
    "blip2": HFCase(Blip2Logits, BLIP_LAYERS, 4, _blip_batches, NextTokenLoss(), shaped=True, masks_materialised=True),
    "vit_cls": HFCase(ViTClassifier, VIT_LAYERS, 4, _image_batches, nn.CrossEntropyLoss(), shaped=True),
}
