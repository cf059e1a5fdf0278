"""capture(): an ordinary nn.Module traced into a layer list computes what the module computes.

The reference is always the original module itself: outputs and parameter gradients of
``captured.graph_model()`` must equal the module's exactly (same ops in the same order). One
``dist`` test trains the captured list with the real runtime on 2 gloo ranks
(``tests/workers/capture_worker.py``) and compares with the module trained on one process.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from dist import launch
from gpp_deepspeed.frontend import CapturedLayerSpec, CapturedTiedLayerSpec, capture
from gpp_deepspeed.errors import GPPConfigError, GraphError
from workers.capture_worker import GAS, LR, STEPS, TwoTower, batches, make_model


class Residual(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.f = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
        self.out = nn.Linear(dim, 2)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.f(h))


class SplitPair(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, 2 * dim)

    def forward(self, x):
        a, b = self.lin(x).chunk(2, dim=-1)
        return torch.tanh(a), b


class ThreeInputs(nn.Module):
    """Three inputs; a tuple-returning submodule whose two outputs are used separately."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 6), nn.Linear(5, 6), nn.Linear(2, 6)
        self.split = SplitPair(6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(12, 4)

    def forward(self, x, y, z):
        left, right = self.split(self.a(x) + self.b(y))
        return self.head(torch.cat([self.mix(left) * self.c(z), right], dim=-1))


class Glue(nn.Module):
    """Glue with cat, scaling by a parameter of the root, slicing by a computed size, a method."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.side = nn.Linear(4, 8)
        self.scale = nn.Parameter(torch.full((8, ), 0.7))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.enc(x)
        both = torch.cat([h, self.side(x) * self.scale], dim=-1)
        half = both[:, : both.shape[1] // 2] * 2.0 + both[:, both.size(1) // 2:].sigmoid()
        return self.head(half.relu())


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.other = nn.Linear(4, 4)

    def forward(self, x):
        h = self.inner(x)
        if h.sum() > 0:
            return self.other(h)
        return h


class WithGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gated()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.gate(x))


def _inputs(*dims, batch=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, d, generator=g) for d in dims)


CASES = {
    "two_tower": (TwoTower, (6, 10), None),
    "residual": (Residual, (4, ), None),
    "three_inputs": (ThreeInputs, (3, 5, 2), None),
    "glue": (Glue, (4, ), None),
    "two_tower_deeper": (TwoTower, (6, 10), ["text.proj", "text.out", "image"]),
}


def _assert_same_function(module: nn.Module, layers, dims):
    torch.manual_seed(0)
    module = module()
    captured = capture(module, layers=layers)
    model = captured.graph_model()
    inputs = _inputs(*dims)
    expected, got = module(*inputs), model(*inputs)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    expected.square().sum().backward()
    got.square().sum().backward()
    grads = captured.module_state_dict({n: p.grad for n, p in model.named_parameters()})
    assert set(grads) == {n for n, _ in module.named_parameters()}
    for name, p in module.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=0, msg=name)
    return captured


@pytest.mark.parametrize("case", CASES)
def test_capture_graph_model_equals_the_module_with_gradients(case):
    cls, dims, layers = CASES[case]
    _assert_same_function(cls, layers, dims)


def test_capture_keeps_each_top_level_child_whole_by_default():
    captured = capture(make_model())
    leaves = {s.name: s for s in captured.layers if captured.prefixes[s.name]}
    # The forward's arguments are named like the towers: a taken name gets a numeric suffix.
    assert set(leaves) == {"text_1", "image_1", "head"}
    assert captured.input_names == ("text", "image")
    assert captured.output == "head"
    assert leaves["text_1"].inputs == ("text", ) and leaves["image_1"].inputs == ("image", )
    assert captured.prefixes["text_1"] == "text."
    assert isinstance(leaves["text_1"].build(), type(make_model().text))


def test_capture_at_deeper_granularity_splits_only_the_named_ancestors():
    captured = capture(make_model(), layers=["text.proj", "text.out"])
    names = [s.name for s in captured.layers]
    assert {"text_proj", "text_out", "image_1", "head"} <= set(names)
    assert "text_1" not in names
    assert captured.layers[names.index("text_proj")].inputs == ("text", )


def test_capture_reads_tuple_outputs_as_indexed_refs():
    captured = _assert_same_function(ThreeInputs, None, (3, 5, 2))
    reads = {r for s in captured.layers for r in s.inputs}
    assert {"split:0", "split:1"} <= reads
    assert captured.input_names == ("x", "y", "z")


def test_capture_builds_copies_with_the_module_weights():
    module = make_model()
    layer = capture(module).layers[0]
    assert isinstance(layer, CapturedLayerSpec)
    built = layer.build()
    assert built is not layer.module
    for (_, a), (_, b) in zip(built.named_parameters(), layer.module.named_parameters()):
        assert a is not b and torch.equal(a, b)


def test_capture_data_dependent_if_names_the_submodule_and_the_fix():
    with pytest.raises(GraphError, match=r'submodule "gate".*if h.sum\(\) > 0.*layers=\[\.\.\., "gate"\]'):
        capture(WithGate(), layers=["gate.inner"])
    with pytest.raises(GraphError, match=r"Gated.forward.*move that code into a submodule"):
        capture(Gated())
    capture(WithGate())  # kept whole by default: traceable


def test_capture_advice_to_keep_a_submodule_whole_says_which_named_layers_it_merges():
    # Advice that would silently remove the pipeline (one layer where several were named) says so.
    with pytest.raises(GraphError, match=r'keep submodule "gate" whole.*that makes it one layer on one stage, so the '
                                         r"1 layers named inside it \(gate.inner\) can no longer be cut apart"):
        capture(WithGate(), layers=["gate.inner"])


class ConstantBranch(nn.Module):
    """A submodule called on a tensor that forward makes from no input."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.bias = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        c = self.bias(torch.ones(4))
        return self.b(self.a(x)) + c


def test_capture_refuses_a_layer_that_reads_no_tensor_naming_the_models_line():
    # The error quotes the model's own line, not torch/fx/proxy.py.
    with pytest.raises(GraphError, match=r'layer "bias" \(bias \(at [^()]*test_capture.py:\d+: c = self.bias\('
                                         r'torch.ones\(4\)\)\)\) reads no tensor from the inputs or other layers') as err:
        capture(ConstantBranch())
    assert "torch/fx" not in str(err.value)


def test_capture_rejects_unknown_layer_names_listing_close_ones():
    with pytest.raises(GPPConfigError, match=r'"text.poj".*close names:.*text.proj'):
        capture(make_model(), layers=["text.poj"])


def test_capture_rejects_a_forward_that_does_not_return_one_tensor():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)

        def forward(self, x):
            return {"out": self.a(x)}

    with pytest.raises(GraphError, match="forward returns a dict"):
        capture(Pair())


class Twice(nn.Module):
    """A weighted submodule applied twice (shared weights, as ALBERT shares its layers)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.head = nn.Linear(2, 2)

    def forward(self, x):
        return self.head(self.a(torch.tanh(self.a(x))))


class SharedActivation(nn.Module):
    """One parameter-free submodule called on two branches (T5's encoder calls its dropout twice)."""

    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(3, 4), nn.Linear(3, 4)
        self.act = nn.GELU()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.act(self.left(x)) * self.act(self.right(x)))


def test_capture_copies_a_parameter_free_submodule_called_twice_one_layer_per_call():
    captured = _assert_same_function(SharedActivation, None, (3, ))
    inputs = {s.name: s.inputs for s in captured.layers}
    assert inputs["act"] == ("left", ) and inputs["act_1"] == ("right", )
    assert not any(isinstance(s, CapturedTiedLayerSpec) for s in captured.layers)


def test_capture_ties_the_layers_of_a_weighted_submodule_called_twice():
    captured = _assert_same_function(Twice, None, (2, ))
    tied = {s.name: s.key for s in captured.layers if isinstance(s, CapturedTiedLayerSpec)}
    assert tied == {"a": "tie_a", "a_1": "tie_a"}


def test_capture_refuses_a_submodule_with_buffers_called_twice_naming_both_lines():
    class TwiceNormed(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(2)

        def forward(self, x):
            return self.norm(self.norm(x))

    with pytest.raises(GraphError, match=r'"norm" is called more than once \(at .*test_capture.py:\d+: return '
                                         r"self.norm\(self.norm\(x\)\)\).*buffers \['running_mean'.*updated apart"):
        capture(TwiceNormed())


class ReadsDtype(nn.Module):
    """Glue that reads another layer's output only for its dtype and device."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        g = self.b(h)
        return self.c(g + torch.ones(g.shape[-1], dtype=h.dtype, device=h.device))


def test_capture_reads_dtype_and_device_from_a_tensor_the_layer_holds():
    module = ReadsDtype()
    x, = _inputs(4)
    # Without example inputs the dtype of "a" is unknown at capture: the glue keeps reading it.
    assert {s.name: s.inputs for s in capture(module).layers}["add"] == ("b", "a")
    # With them, "b" had the same dtype, so the glue reads b's dtype and device and "a" need not cross.
    captured = capture(module, example_inputs=(x, ))
    assert {s.name: s.inputs for s in captured.layers}["add"] == ("b", )
    # The rule holds at run time: cast as a whole (as DeepSpeed's bf16 does), the twin follows.
    model = captured.graph_model().double()
    torch.testing.assert_close(model(x.double()), module.double()(x.double()), rtol=0, atol=0)


def test_capture_concrete_args_fix_flags_and_drop_their_inputs():
    class Flag(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x, double=False):
            h = self.a(x)
            return h * 2 if double else h

    module = Flag()
    captured = capture(module, concrete_args={"double": True}, input_names=["features"])
    assert captured.input_names == ("features", )
    x, = _inputs(3)
    torch.testing.assert_close(captured.graph_model()(x), module(x, double=True), rtol=0, atol=0)


def _reference() -> list[float]:
    module = make_model()
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for inputs, labels in batches(step):
            loss = nn.functional.cross_entropy(module(*inputs), labels)
            (loss / GAS).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        losses.append(total / GAS)
    return losses, module.state_dict()


@pytest.mark.dist
def test_capture_layers_train_pipelined_like_the_module(tmp_path):
    worker = Path(__file__).resolve().parent / "workers" / "capture_worker.py"
    result = launch(2, worker, str(tmp_path), timeout=300, log_dir=tmp_path / "logs")  # a busy machine is slow
    assert result.ok, result.report()
    losses, state = _reference()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert sorted(r["stage"] for r in ranks) == [0, 1]
    seen = set()
    for res in ranks:
        assert res["losses"] == pytest.approx(losses, rel=1e-5)
        for name, value in res["state"].items():
            torch.testing.assert_close(value, state[name], rtol=1e-5, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == set(state)


class CastBetween(nn.Module):
    """The issue's two-line repro: the glue ``.to(torch.float32)`` becomes a layer named ``to``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        return self.b(self.a(x).to(torch.float32))


def test_capture_layers_named_like_module_attributes_build_save_and_load(tmp_path):
    from gpp_deepspeed import GraphLayerSpec, GraphModel
    module = CastBetween()
    captured = capture(module)
    assert [s.name for s in captured.layers] == ["a", "to", "b"]
    model = captured.graph_model()
    x, = _inputs(3)
    torch.testing.assert_close(model(x), module(x), rtol=0, atol=0)
    model.save_pipeline_checkpoint(str(tmp_path), "t")
    again = captured.graph_model()
    again.load_pipeline_checkpoint(str(tmp_path), "t")
    torch.testing.assert_close(again(x), module(x), rtol=0, atol=0)
    # Names a user gives: any attribute of nn.Module or ModuleDict is a layer name like another.
    names = ["train", "forward", "eval", "float", "keys", "update"]
    specs = [GraphLayerSpec(n, nn.Linear, 3, 3, inputs=[prev]) for prev, n in zip(["x", *names], names)]
    model = GraphModel(specs, input_names=["x"])
    assert sorted(model.state_dict()) == sorted(f"layers.{n}.{p}" for n in names for p in ("weight", "bias"))
    assert model(x).shape == (5, 3) and model.train() is model


class TimestepEmbedding(nn.Module):
    """diffusers' U-Net idiom: a number or a tensor of timesteps, told apart by torch.is_tensor."""

    def __init__(self):
        super().__init__()
        self.embed, self.body = nn.Linear(1, 4), nn.Linear(4, 4)

    def forward(self, x, t):
        if not torch.is_tensor(t):
            t = torch.tensor([t], dtype=torch.float32)
        if isinstance(x, torch.Tensor):
            x = x * 2
        return self.body(x + self.embed(t.float()[:, None]))


def test_capture_type_checks_on_traced_inputs_take_the_branch_of_real_tensors():
    module = TimestepEmbedding()
    captured = capture(module)
    assert "tensor" not in [s.name for s in captured.layers]   # the branch for a Python number
    x, t = torch.randn(5, 4), torch.arange(5)
    torch.testing.assert_close(captured.graph_model()(x, t), module(x, t), rtol=0, atol=0)


class AsksOfAnOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if isinstance(h, torch.Tensor):
            h = h * 2
        return self.b(h)


def test_capture_asks_for_example_inputs_where_a_plain_trace_cannot_tell_a_tensor():
    module = AsksOfAnOutput()
    with pytest.raises(GraphError, match=r"test_capture.py:\d+: if isinstance\(h, torch.Tensor\):.*cannot tell is a "
                                         r"tensor.*pass example_inputs="):
        capture(module)
    x, = _inputs(4)
    captured = capture(module, example_inputs=(x, ))   # the shaped trace knows h is a tensor
    torch.testing.assert_close(captured.graph_model()(x), module(x), rtol=0, atol=0)


class OnDevice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if h.device.type == "cpu":
            h = h + 1
        return self.b(h)


def test_capture_refuses_control_flow_on_a_device_naming_the_line():
    # The rank's device at run time is not the capture's (meta, in the shaped trace).
    for example in (None, _inputs(4)):
        with pytest.raises(GraphError, match=r'test_capture.py:\d+: if h.device.type == "cpu":.*device is the '
                                             r"rank's at run time"):
            capture(OnDevice(), example_inputs=example)


class Indexes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x, i):
        h = self.a(x)
        return self.b(h[i])


def test_capture_errors_in_generated_code_name_the_layer_and_the_models_line():
    model = capture(Indexes()).graph_model()
    with pytest.raises(IndexError) as err:
        model(torch.randn(4, 3), torch.tensor([0.5, 1.5]))
    assert re.fullmatch(r'in captured layer "getitem", traced from .*test_capture.py:\d+: return self.b\(h\[i\]\)',
                        err.value.__notes__[0])


class QueryTokens(nn.Module):
    """BLIP-2's bridge: learned query tokens expanded to the batch, read by a submodule."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.query = nn.Parameter(torch.randn(1, 2, 4))
        self.cross = nn.Bilinear(4, 4, 4)

    def forward(self, x):
        h = self.encoder(x)                          # [b, 3, 4]
        if h.shape[1] < 2:                           # needs the shaped trace: the expand reads no layer
            raise ValueError("too few tokens")
        q = self.query.expand(h.shape[0], -1, -1)    # [b, 2, 4]
        return self.cross(q, h[:, :2])


def test_capture_keeps_a_parameter_expanded_to_the_batch_as_a_layer_holding_it():
    module = QueryTokens()
    x = torch.randn(5, 3, 4)
    captured = capture(module, example_inputs=(x, ))
    torch.testing.assert_close(captured.graph_model()(x), module(x), rtol=0, atol=0)
    torch.testing.assert_close(captured.graph_model()(x[:2]), module(x[:2]), rtol=0, atol=0)
    # Shape-specialised, the expand reads no layer's output: it reads the input for its rows.
    expand = {s.name: s for s in captured.layers}["expand"]
    assert expand.inputs == ("x", ) and [n for n, _ in expand.module.named_parameters()] == ["query"]


class ItemInside(nn.Module):
    """A leaf that cannot run on meta tensors (``.item()``, as transformers' padding checks), whose
    output's dtype the glue after it branches on."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[1] == 3:                   # needs the shaped trace
            x = x * 2
        h = self.a(x)
        if h.dtype == torch.float16:
            h = h.float()
        return self.b(h)


class NeedsItem(nn.Module):
    def __init__(self, fails=False):
        super().__init__()
        self.lin, self.fails = nn.Linear(4, 4), fails

    def forward(self, x):
        if self.fails and x.sum().item() > -1e9:
            raise RuntimeError("needs real data")
        return self.lin(x) if bool(x.abs().sum().item() >= 0) else x


def test_capture_sizes_a_leaf_that_cannot_run_on_meta_on_tiny_cpu_inputs():
    module = ItemInside()
    module.a = NeedsItem()
    x = torch.randn(5, 3, 4)
    captured = capture(module, example_inputs=(x, ))
    torch.testing.assert_close(captured.graph_model()(x), module(x), rtol=0, atol=0)
    module.a = NeedsItem(fails=True)
    with pytest.raises(GraphError, match=r'test_capture.py:\d+: if h.dtype == torch.float16:.*output of submodule '
                                         r'"a", which could be run neither on meta tensors nor on tiny CPU inputs'):
        capture(module, example_inputs=(x, ))


class UnusedSecondCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        self.a(h)            # computed and never read
        return self.b(h)


def test_capture_warning_about_unused_calls_names_the_unused_call_not_a_used_module():
    with pytest.warns(UserWarning, match=r"leaves out the calls of submodules \['a \(its call \(at .*test_capture.py:"
                                         r"\d+: self.a\(h\)"):
        captured = capture(UnusedSecondCall())
    assert captured.unused == ()   # a's weights are read by its first call
