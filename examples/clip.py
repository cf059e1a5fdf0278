"""Train Hugging Face's CLIP (two towers, one contrastive loss) as a DAG of pipeline stages.

Launch (the text and the image tower run at the same time on different ranks)::

    export OMP_NUM_THREADS=1   # on CPU: one thread per rank
    deepspeed --num_gpus 3 examples/clip.py --deepspeed_config configs/clip.json
    deepspeed --num_gpus 3 examples/clip.py --deepspeed_config configs/clip.json --frozen-vision
    deepspeed --num_gpus 8 examples/clip.py --deepspeed_config configs/clip.json --size base --stages 4

The model is ``transformers.CLIPModel`` itself, built from a config object (random weights, nothing
is downloaded), wrapped so that ``forward(input_ids, pixel_values)`` returns ``logits_per_image``.
``gpp_deepspeed.capture`` cuts it at the towers and projections: each tower's stage sends its
pooled vector (capture selects ``pooler_output`` on the tower's own stage), the head computes the
similarity matrix, and the loss is CLIP's symmetric cross-entropy over images and texts with the
matching pairs on the diagonal. ``--frozen-vision`` locks the image tower and its projection
(LiT-style fine-tuning): its stage runs forwards only and receives no gradients.

The data is synthetic and learnable: ``CONCEPTS`` fixed (caption, image prototype) pairs; each
sample is a concept's caption and its prototype plus noise, a micro-batch holds distinct concepts.
``--size tiny`` (default) trains in seconds on a CPU and rank 0 then trains the original module on
one process on the same micro-batches and checks the losses are EQUAL (exit status 1 if they
DIFFER); ``--size base`` is CLIP ViT-B/32 (``CLIPConfig()``'s defaults: 12-layer towers, 224 px
images, 77 tokens) for GPUs and skips that check. Set ``"bf16": {"enabled": true}`` in the config
for bf16 on GPUs (cast the pixel values in ``micro_batches``).
"""

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built from configs

import deepspeed  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from transformers import CLIPConfig, CLIPModel  # noqa: E402

import gpp_deepspeed  # noqa: E402
from gpp_deepspeed import GraphPipelineModule  # noqa: E402
from gpp_deepspeed.frontend import capture  # noqa: E402
from twin import check_against_single_device  # noqa: E402

SIZES = {  # tiny: seconds on a CPU; base: CLIP ViT-B/32
    "tiny": {"text": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=8),
             "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            image_size=16, patch_size=8),
             "projection_dim": 16, "concepts": 32},
    "base": {"text": {}, "vision": {}, "projection_dim": 512, "concepts": 4096},
}
LAYERS = ["clip.text_model", "clip.vision_model", "clip.visual_projection", "clip.text_projection"]


class CLIPLogits(nn.Module):
    """``CLIPModel`` returning ``logits_per_image`` ([images, texts]), the one tensor the loss reads."""

    def __init__(self, config: CLIPConfig):
        super().__init__()
        self.clip = CLIPModel(config)

    def forward(self, input_ids, pixel_values):
        return self.clip(input_ids=input_ids, pixel_values=pixel_values).logits_per_image


def contrastive_loss(logits_per_image, labels):
    """CLIP's loss: cross-entropy over the texts of each image and the images of each text."""
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_image.t(), labels)) / 2


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--size", choices=list(SIZES), default="tiny")
parser.add_argument("--steps", type=int, default=8, help="training steps (batches)")
parser.add_argument("--stages", type=int, default=None, help="pipeline stages (default: the world size)")
parser.add_argument("--frozen-vision", action="store_true", help="lock the image tower and its projection")
parser.add_argument("--local_rank", type=int, default=-1)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
config = gpp_deepspeed.load_config(args.deepspeed_config)  # the parsed JSON
size = SIZES[args.size]
clip_config = CLIPConfig(text_config=size["text"], vision_config=size["vision"], projection_dim=size["projection_dim"])
text, vision = clip_config.text_config, clip_config.vision_config
text.eos_token_id = text.vocab_size - 1  # each caption ends with it; the text tower pools there

# -- the model: the unmodified transformers module, captured -----------------------------------
torch.manual_seed(0)  # every rank builds the same weights, so every rank captures the same model
original = CLIPLogits(clip_config)
if args.frozen_vision:
    original.clip.vision_model.requires_grad_(False)
    original.clip.visual_projection.requires_grad_(False)
captured = capture(original, layers=LAYERS)
model = GraphPipelineModule(captured.layers, input_names=captured.input_names, output=captured.output,
                            num_stages=args.stages or world, loss_fn=contrastive_loss)
engine, _, _, _ = gpp_deepspeed.initialize(args=args, model=model,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
print(f"rank {rank}: stage {engine.stage_id} runs {list(model.local_layer_names())}", flush=True)

# -- data: distinct concepts per micro-batch, each a fixed caption and a noisy image prototype ---
gas, mbs = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
g = torch.Generator().manual_seed(0)
seq = text.max_position_embeddings
captions = torch.randint(0, text.vocab_size - 1, (size["concepts"], seq), generator=g)
captions[:, -1] = text.eos_token_id
prototypes = torch.randn(size["concepts"], 3, vision.image_size, vision.image_size, generator=g)


def micro_batches(step):
    g = torch.Generator().manual_seed(1000 + step)
    batches = []
    for _ in range(gas):
        concepts = torch.randperm(size["concepts"], generator=g)[:mbs]
        images = prototypes[concepts] + 0.5 * torch.randn(mbs, *prototypes.shape[1:], generator=g)
        batches.append(((captions[concepts], images), torch.arange(mbs)))  # pair i matches pair i
    return batches


losses, times = [], []
for step in range(args.steps):
    data = micro_batches(step)
    start = time.perf_counter()
    loss = engine.train_batch(data_iter=iter(data)).item()
    times.append(time.perf_counter() - start)
    losses.append(loss)
    if rank == 0:
        print(f"step {step}: loss {loss:.5f}  {engine.train_batch_size() / times[-1]:.1f} samples/s", flush=True)

# -- the check: the original module on one process, plain PyTorch, same micro-batches ----------
if rank == 0 and args.size == "tiny":
    check_against_single_device(original, contrastive_loss, micro_batches, losses, config)
if rank == 0:
    steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    print(f"median step time after warm-up: {steady * 1000:.1f} ms "
          f"({engine.train_batch_size() / steady:.1f} samples/s)", flush=True)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
