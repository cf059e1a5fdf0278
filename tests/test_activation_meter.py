"""The memory report's activation meter, against the bytes autograd saves counted independently, and
its stop after the steps it measures (``graph_pipeline.activation_meter_steps``)."""

import torch
from torch import nn

from gpp_deepspeed.engine.memory import ActivationMeter


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _saved_bytes(model, x) -> int:
    """The bytes of the distinct non-parameter storages autograd saves for ``model(x)``'s backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return sum(seen.values())


def test_the_meters_peak_is_what_autograd_saves_and_its_bytes_come_back_after_backward():
    model, x = _model(), torch.randn(3, 8)
    meter = ActivationMeter(model.parameters)
    with meter.saving():
        loss = model(x).sum()
    assert meter.live == meter.peak == _saved_bytes(model, x) > 0
    loss.backward()
    assert meter.live == 0 and meter.peak == _saved_bytes(model, x)


def test_the_meter_stops_after_its_steps_and_what_it_wrapped_before_still_comes_back():
    model, x = _model(), torch.randn(3, 8)
    meter = ActivationMeter(model.parameters, steps=1)
    with meter.saving():
        held = model(x).sum()       # a backward still to run when the step ends (PipeDream's trail)
    meter.end_step()
    assert not meter.on and meter.steps == 1
    with meter.saving():
        later = model(torch.randn(30, 8)).sum()   # ten times the activations: not measured
    assert meter.live == meter.peak == _saved_bytes(model, x)
    held.backward()
    later.backward()
    assert meter.live == 0 and meter.peak == _saved_bytes(model, x)
    meter.end_step()
    assert meter.steps == 1


def test_a_meter_without_a_limit_measures_every_step():
    model = _model()
    meter = ActivationMeter(model.parameters)
    for rows in (3, 30):
        with meter.saving():
            model(torch.randn(rows, 8)).sum().backward()
        meter.end_step()
    assert meter.on and meter.steps == 2 and meter.peak == _saved_bytes(model, torch.randn(30, 8))
