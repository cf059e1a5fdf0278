"""The profiler: per-layer costs measured into a CostDB, affine link fits, a real gloo ping-pong."""

import time

import pytest
import torch
from torch import nn

from gpp_deepspeed import GPPConfigError, GPPError, GraphLayerSpec, GraphModel
from gpp_deepspeed.planner.costs import CommFit, CostDB, Hardware
from gpp_deepspeed.profiler import fit_affine, measure_p2p, profile_layers, with_links
from models import diamond, tied

LINK = CommFit(alpha_s=1e-5, beta_s_per_byte=1e-9)
HW = Hardware(name="test", memory_bytes=1 << 30, devices_per_node=1, intra=LINK, inter=LINK)
FAST = dict(micro_batches=(1, 2), warmup=1, repeats=2, hardware=HW)


class LinearReLU(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Sleep(nn.Module):
    """Sleeps a known time in forward; its backward is one multiply."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x * 2


def _inputs(dims):
    return lambda b: tuple(torch.randn(b, d) for d in dims)


def test_profile_layers_matches_hand_counts():
    layers = [GraphLayerSpec("block", LinearReLU, 8, 16, inputs=["x"]),
              GraphLayerSpec("head", nn.Linear, 16, 4, inputs=["block"])]
    db = profile_layers(layers, input_names=["x"], make_inputs=_inputs([8]), model_name="mlp", **FAST)
    block, head = db.by_name["block"], db.by_name["head"]
    assert [c.name for c in db.layers] == ["block", "head"]
    assert (db.model, db.input_names, db.output, db.micro_batches) == ("mlp", ("x", ), "head", (1, 2))
    assert block.inputs == ("x", ) and head.inputs == ("block", )
    assert block.param_bytes == (8 * 16 + 16) * 4 and head.param_bytes == (16 * 4 + 4) * 4
    assert block.out_bytes == 16 * 4 and head.out_bytes == 4 * 4
    # addmm saves its input x [b, 8] (the weight is a parameter, not counted), relu its output [b, 16].
    assert block.stash_bytes == (8 + 16) * 4
    assert all(t > 0 for c in db.layers for t in c.fwd_s + c.bwd_s)
    assert db.source.startswith("measured on cpu") and db.hardware == HW
    assert CostDB.from_json(db.to_json()) == db


class Counted(nn.Linear):
    """A linear layer that counts how many of its kind are alive at once."""

    alive = peak = 0

    def __init__(self, *args):
        super().__init__(*args)
        Counted.alive += 1
        Counted.peak = max(Counted.peak, Counted.alive)

    def __del__(self):
        Counted.alive -= 1


class Probe(nn.Module):
    """Adds its inputs and records what it was called with (outside autograd: the real values)."""

    seen: list = []

    def forward(self, *xs):
        if not torch.is_grad_enabled():
            Probe.seen.append(torch.stack(xs).detach().clone())
        return sum(xs)


def test_profile_layers_builds_one_layer_at_a_time_on_the_values_graph_model_computes():
    # Five linear layers and a skip (l0 read by l1 and by the probe): one layer alive at a time, an
    # output kept only until its last reader ran; the probe sees what it sees in the GraphModel
    # built from the same list (same build seeds, so the same weights).
    layers = [GraphLayerSpec("l0", Counted, 4, 4, inputs=["x"])] + [
        GraphLayerSpec(f"l{i}", Counted, 4, 4, inputs=[f"l{i - 1}"]) for i in range(1, 5)] + [
        GraphLayerSpec("probe", Probe, inputs=["l4", "l0"])]
    x = torch.linspace(-1, 1, 8).reshape(2, 4)
    Counted.alive = Counted.peak = 0
    Probe.seen = []
    db = profile_layers(layers, input_names=["x"], make_inputs=lambda b: x[:b], **FAST)
    assert Counted.peak == 1 and Counted.alive == 0
    assert [c.param_bytes for c in db.layers] == [(16 + 4) * 4] * 5 + [0]
    profiled = Probe.seen[-1]
    Probe.seen = []
    with torch.no_grad():
        GraphModel(layers, input_names=["x"])(x)
    torch.testing.assert_close(profiled, Probe.seen[-1], rtol=0, atol=0)


def test_profile_layers_names_and_tuple_outputs_on_the_diamond():
    case = diamond()
    db = profile_layers(case.layers, input_names=case.input_names, make_inputs=_inputs(case.input_dims), **FAST)
    assert [c.name for c in db.layers] == [spec.name for spec in case.layers]
    assert db.by_name["split"].out_bytes == 2 * 8 * 4  # a tuple of two [b, 8] tensors
    assert db.by_name["merge"].param_bytes == 0 and db.by_name["merge"].stash_bytes == 0  # an add saves nothing
    assert db.graph.output == "head"


def test_profile_layers_counts_tied_parameters_once():
    case = tied()
    db = profile_layers(case.layers, input_names=case.input_names, make_inputs=_inputs(case.input_dims), **FAST)
    assert db.by_name["layer1"].param_bytes == 8 * 8 * 4  # first entry of the key "shared"
    assert db.by_name["layer3"].param_bytes == 0
    assert db.by_name["layer3"].bwd_s[0] > 0  # the second copy still runs its backward


def test_profile_layers_measures_a_known_sleep():
    # A measurement check, not a performance assertion: a generous band around a 20 ms sleep.
    seconds = 0.02
    db = profile_layers([GraphLayerSpec("nap", Sleep, seconds, inputs=["x"])], input_names=["x"],
                        make_inputs=_inputs([4]), micro_batches=(1, ), warmup=1, repeats=3, hardware=HW)
    fwd = db.by_name["nap"].fwd_s[0]
    assert 0.8 * seconds <= fwd <= 3 * seconds, fwd
    assert db.by_name["nap"].bwd_s[0] < seconds


class _SleepInBackward(torch.autograd.Function):
    """Identity forward; the backward sleeps, then passes the gradient through."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SplitSleep(nn.Module):
    """Input gradient and weight gradient on separate paths, each sleeping its own time."""

    def __init__(self, input_grad_s, weight_grad_s):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4))
        self.times = (input_grad_s, weight_grad_s)

    def forward(self, x):
        return _SleepInBackward.apply(x, self.times[0]) + _SleepInBackward.apply(self.bias, self.times[1])


def test_profile_layers_measures_input_and_weight_gradients_apart():
    # A measurement check with generous bands: 10 ms on the input path, 30 ms on the weight path.
    t_in, t_w = 0.01, 0.03
    db = profile_layers([GraphLayerSpec("nap", SplitSleep, t_in, t_w, inputs=["x"])], input_names=["x"],
                        make_inputs=_inputs([4]), micro_batches=(1, ), warmup=1, repeats=3, hardware=HW)
    nap = db.by_name["nap"]
    assert 0.8 * (t_in + t_w) <= nap.bwd_s[0] <= 3 * (t_in + t_w), nap.bwd_s
    assert 0.8 * t_in <= nap.bwd_input_s[0] <= 0.8 * t_w, nap.bwd_input_s
    assert 0.8 * t_w <= nap.bwd_weight_s[0] <= 3 * t_w, nap.bwd_weight_s
    assert nap.split_backward_times(1) == (nap.bwd_input_s[0], nap.bwd_weight_s[0])
    assert CostDB.from_json(db.to_json()) == db


def test_cost_database_without_split_times_reads_as_before_and_halves_the_backward():
    layers = [GraphLayerSpec("a", nn.Linear, 4, 4, inputs=["x"])]
    db = profile_layers(layers, input_names=["x"], make_inputs=_inputs([4]), **FAST)
    import json
    old = json.loads(db.to_json())
    for layer in old["layers"]:  # a database written before the split was measured
        del layer["bwd_input_s"], layer["bwd_weight_s"]
    read = CostDB.from_json(json.dumps(old))
    a = read.by_name["a"]
    assert a.bwd_input_s is None and a.split_backward_times(2) == (a.bwd_s[1] / 2, a.bwd_s[1] / 2)


def test_profile_layers_rejects_bad_micro_batches():
    layers = [GraphLayerSpec("a", nn.Linear, 4, 4, inputs=["x"])]
    with pytest.raises(GPPConfigError, match="micro_batches"):
        profile_layers(layers, input_names=["x"], make_inputs=_inputs([4]), micro_batches=(0, 2), hardware=HW)


def test_fit_affine_recovers_exact_data():
    alpha, beta = 5e-5, 2e-10
    sizes = [2**k for k in range(10, 25, 2)]
    seconds = [alpha + beta * s for s in sizes]
    for relative in (True, False):
        fit = fit_affine(sizes, seconds, relative=relative)
        assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
        assert fit.beta_s_per_byte == pytest.approx(beta, rel=1e-6)


def test_fit_affine_clamps_to_non_negative():
    through_origin = fit_affine([1000, 2000], [1e-6, 3e-6])  # the free fit's intercept is -1e-6
    assert through_origin.alpha_s == 0.0 and 1e-9 < through_origin.beta_s_per_byte < 1.5e-9
    assert fit_affine([1000, 2000], [3e-6, 1e-6]).beta_s_per_byte == 0.0
    with pytest.raises(GPPConfigError, match="two distinct sizes"):
        fit_affine([1000, 1000], [1e-6, 1e-6])


def test_with_links_substitutes_only_the_given_link():
    inter = CommFit(alpha_s=1e-4, beta_s_per_byte=1e-10)
    hw = with_links(HW, inter=inter)
    assert (hw.intra, hw.inter, hw.memory_bytes) == (LINK, inter, HW.memory_bytes)
    assert "inter substituted" in hw.name
    assert with_links(HW) is HW


@pytest.mark.dist
def test_measure_p2p_fits_a_real_gloo_ping_pong():
    # Up to 16 MiB, so the bandwidth term stands out of scheduling noise on a busy 2-core machine.
    fit = measure_p2p(sizes=(2**10, 2**16, 2**22, 2**24), warmup=1, repeats=5, timeout_s=60)
    assert fit.alpha_s > 0 and fit.beta_s_per_byte > 0


@pytest.mark.dist
def test_measure_p2p_kills_its_processes_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(GPPError, match="did not finish"):
        measure_p2p(sizes=(2**10, 2**12), repeats=1, timeout_s=0.5)
    assert time.monotonic() - start < 10


def test_profile_layers_runs_a_plain_list_with_an_in_place_layer():
    # Profiled inputs are clones of autograd leaves, so an in-place layer does not hit
    # "a leaf Variable that requires grad is being used in an in-place operation".
    layers = [nn.Linear(4, 6), nn.ReLU(inplace=True)]
    db = profile_layers(layers, input_names=["input"], make_inputs=_inputs([4]), **FAST)
    assert [c.name for c in db.layers] == ["layer0", "layer1"]
    assert db.by_name["layer1"].inputs == ("layer0", ) and db.by_name["layer1"].out_bytes == 6 * 4
    assert db.by_name["layer1"].bwd_s[0] > 0
