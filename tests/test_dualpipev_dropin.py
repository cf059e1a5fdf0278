"""DeepSpeed's DualPipeV users as a drop-in (issue 28, point 3): a ``DualPipeVModule`` given to
``gpp_deepspeed.initialize`` becomes the chain of its 2R stages folded in a V under
``"schedule": "dualpipev"`` (gpp_deepspeed.engine.dualpipev).

References: DeepSpeed's own DualPipeVEngine's losses, themselves checked against single-device
training of the same layers (plain SGD, gradient accumulation); the conversion against the
partition DeepSpeed made; the converted chain's loss against the DualPipeVModule's two phases.

END-TO-END (for the lead, after merging the engine that runs folded programs):
``test_our_engine_trains_a_dualpipev_module_with_deepspeeds_losses`` compares our engine's losses
with DualPipeVEngine's (rtol 1e-5). It skips, naming the refusal, only while the engine's config
refuses the folded schedule (``graph_pipeline.schedule = "dualpipev"``, ``stages_per_rank``,
``fold``); once the engine accepts them it runs and must pass.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepspeed.pipe import LayerSpec, TiedLayerSpec
from dist import launch
from gpp_deepspeed.engine.dualpipev import dualpipev_conversion
from gpp_deepspeed.errors import GPPConfigError

import workers.dualpipev_dropin as worker

WORKER = worker.__file__


def test_the_conversion_keeps_deepspeeds_partition_folded_in_a_v():
    layers = worker.layer_specs()
    # DeepSpeed's uniform cut of 8 layers into 2R = 4 stages on R = 2 ranks.
    conversion = dualpipev_conversion(layers, [0, 2, 4, 6, 8], num_ranks=2, module_kwargs={"loss_fn": nn.MSELoss()})
    assert conversion.stage_of == {f"layer{i}": i // 2 for i in range(8)}
    assert conversion.fold == (0, 1, 1, 0) and conversion.num_stages == 4
    assert conversion.graph_pipeline == {"schedule": "dualpipev", "stages_per_rank": 2, "fold": [0, 1, 1, 0]}
    assert conversion.config({"train_batch_size": 8, "graph_pipeline": {"trace_dir": "t"}}) == {
        "train_batch_size": 8, "graph_pipeline": {"trace_dir": "t", **conversion.graph_pipeline}}


def test_what_does_not_convert_is_refused_by_name():
    layers = worker.layer_specs()
    with pytest.raises(GPPConfigError, match="do not"):
        dualpipev_conversion(layers, [0, 4, 8], num_ranks=2)
    with pytest.raises(GPPConfigError, match="stage 1 holds no layer"):
        dualpipev_conversion(layers, [0, 2, 2, 6, 8], num_ranks=2)
    tied = [TiedLayerSpec("emb", nn.Linear, 8, 8), *layers[1:]]
    with pytest.raises(GPPConfigError, match="layer 0 is a TiedLayerSpec \\(key 'emb'\\)"):
        dualpipev_conversion(tied, [0, 2, 4, 6, 8], num_ranks=2)
    conversion = dualpipev_conversion(layers, [0, 2, 4, 6, 8], num_ranks=2)
    with pytest.raises(GPPConfigError, match="graph_pipeline.schedule = 'dualpipev'; the config says '1f1b'"):
        conversion.config({"graph_pipeline": {"schedule": "1f1b"}})


def _single_device_losses():
    """The worker's model trained on one device: the same layers (each built under its seed, as
    DeepSpeed's seed_layers builds them), the mean loss of the micro-batches, plain SGD."""
    built = []
    for i, spec in enumerate(worker.layer_specs()):
        torch.manual_seed(worker.BASE_SEED + i)
        built.append(spec.build())
    model = nn.Sequential(*built)
    opt = torch.optim.SGD(model.parameters(), lr=worker.LR)
    losses = []
    for step in range(worker.STEPS):
        opt.zero_grad()
        total = 0.0
        for x, y in worker.batches(step):
            loss = nn.functional.mse_loss(model(x), y) / worker.MICRO_BATCHES
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``run(mode, world)``: the folder the worker wrote ``<mode>.pt`` to, each mode launched once
    per module (DeepSpeed's run serves two tests)."""
    out, done = tmp_path_factory.mktemp("dualpipev"), {}

    def go(mode, world):
        if mode not in done:
            done[mode] = launch(world, WORKER, mode, str(out), timeout=240, log_dir=out / f"logs_{mode}")
        assert done[mode].ok, done[mode].report()
        return out
    return go


def test_deepspeeds_dualpipev_engine_trains_like_one_device(run):
    theirs = torch.load(run("deepspeed", 2) / "deepspeed.pt")
    assert theirs["engine"] == "DualPipeVEngine"
    torch.testing.assert_close(theirs["losses"], _single_device_losses(), rtol=1e-5, atol=0)


def test_the_converted_chain_computes_the_loss_of_the_dualpipev_modules_two_phases(run):
    # One rank: DeepSpeed builds both stages there; the conversion hands over its built layers.
    single = torch.load(run("single", 1) / "single.pt")
    assert single["converted"] == single["deepspeed"]
    assert single["fold"] == (0, 0) and set(single["stage_of"].values()) == {0, 1} and all(single["built"])


def test_our_engine_trains_a_dualpipev_module_with_deepspeeds_losses(run):
    ours, theirs = torch.load(run("ours", 2) / "ours.pt"), torch.load(run("deepspeed", 2) / "deepspeed.pt")
    assert ours["engine"] == "GraphPipelineEngine"
    torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=1e-5, atol=0)
