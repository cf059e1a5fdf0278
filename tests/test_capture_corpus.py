"""The capture regression corpus (issue 30): diffusers U-Nets, BLIP-2 and a ViT with a class token,
captured from the unmodified modules (``tests/corpus_models.py``).

Each captured ``GraphModel`` equals its module (outputs and gradients), and each case trains on 4
gloo ranks (4 stages) to the losses and parameters of the module trained on one process (rtol 1e-5).
One launch trains every case in turn (``tests/workers/hf_cases.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers", reason="the [hf] extra (make test installs it)")

from dist import launch  # noqa: E402
from corpus_models import CORPUS  # noqa: E402
from test_hf_capture import _captured_equals_module, _trained_like_the_module  # noqa: E402

WORKER = Path(__file__).resolve().parent / "workers" / "hf_cases.py"
WORLD_SIZE = 4


@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_graph_model_equals_the_module_with_gradients(name):
    _captured_equals_module(name, CORPUS)


def test_corpus_unet_takes_the_tensor_branch_of_its_timesteps_check():
    # UNet2DModel: `if not torch.is_tensor(timesteps): timesteps = torch.tensor([timesteps], ...)`.
    # A traced value is no tensor, and capture used to record that branch as a layer "tensor".
    captured = _captured_equals_module("unet2d", CORPUS)
    names = [s.name for s in captured.layers]
    assert "tensor" not in names and "to" in names   # `t_emb.to(dtype)`: a layer named like Module.to


def test_corpus_blip2_keeps_its_query_tokens_in_a_layer_that_reads_the_batch():
    captured = _captured_equals_module("blip2", CORPUS)
    layers = {s.name: s for s in captured.layers}
    assert layers["expand"].inputs == ("pixel_values", )
    assert [n for n, _ in layers["expand"].module.named_parameters()] == ["blip.query_tokens"]
    assert layers["blip_qformer"].inputs[0] == "expand"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    result = launch(WORLD_SIZE, WORKER, str(out), *CORPUS, timeout=500, log_dir=out / "logs")
    assert result.ok, result.report()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_trains_pipelined_like_the_module_on_one_process(trained, name):
    _trained_like_the_module(trained, name, WORLD_SIZE, CORPUS)
