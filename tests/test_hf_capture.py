"""Hugging Face ``transformers`` models captured as they are and trained pipelined.

The reference is always the unmodified module: its outputs and gradients on one process equal the
captured ``GraphModel``'s exactly, and the same module trained on one process with plain PyTorch
gives the pipelined run's losses and parameters (rtol 1e-5). Models are tiny and built from config
objects (nothing is downloaded; ``HF_HUB_OFFLINE=1``). One launch trains every case in turn
(``tests/workers/hf_cases.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra (make test installs it)")

from dist import launch  # noqa: E402
from gpp_deepspeed.capture import CapturedTiedLayerSpec, capture  # noqa: E402
from gpp_deepspeed.graph import build_layer_graph  # noqa: E402
from gpp_deepspeed.graph.stages import derive_partition  # noqa: E402
from gpp_deepspeed.errors import GraphError  # noqa: E402
from gpp_deepspeed.graph.ir import TensorRef  # noqa: E402
from gpp_deepspeed.spec import port_leaves  # noqa: E402
from hf_models import CASES, train_module  # noqa: E402

WORKER = Path(__file__).resolve().parent / "workers" / "hf_cases.py"
WORLD_SIZE = 3
TRAINED = ["clip", "clip_frozen", "structured", "gpt2", "ved", "bert", "t5"]


def _captured_equals_module(name: str):
    case = CASES[name]
    module = case.model()
    captured = case.capture(module)
    model = captured.graph_model()
    inputs, _ = case.batches(0)[0]
    inputs = inputs if isinstance(inputs, tuple) else (inputs, )
    expected, got = module(*inputs), model(*inputs)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    expected.square().sum().backward()
    got.square().sum().backward()
    grads = captured.module_state_dict({n: p.grad for n, p in model.named_parameters()})
    for n, p in module.named_parameters():
        if p.requires_grad:
            # A weight read in several places (T5's embedding: both stacks and the head) sums its
            # gradient contributions in autograd's order, which may differ in the last bit.
            exact = 0 if n not in captured.aliases else 1e-6
            torch.testing.assert_close(grads[n], p.grad, rtol=exact, atol=0, msg=n)
    return captured


@pytest.mark.parametrize("name", [*TRAINED, "hidden_sum"])
def test_hf_capture_graph_model_equals_the_module_with_gradients(name):
    _captured_equals_module(name)


def test_hf_capture_runs_the_hooks_that_collect_hidden_states_on_the_traced_layers():
    captured = _captured_equals_module("hidden_sum")
    # The sum reads the embedding and both layers' outputs, which the layers' hooks collected.
    glue = {s.name: s.inputs for s in captured.layers}["getitem_2"]   # stack, sum, [:, 0]
    assert glue == ("bert_embeddings", "bert_encoder_layer_0", "bert_encoder_layer_1")


def test_hf_capture_names_hooks_that_cannot_run_inside_a_whole_layer():
    module = CASES["hidden_sum"].model()
    with pytest.raises(GraphError, match=r"at .*hf_models.py:\d+: return self.head\(torch.stack\(hidden\).*"
                                         r"Forward hooks of \['bert.encoder.layer.0', 'bert.encoder.layer.1'\] did "
                                         r"not run while tracing.*name the hooked submodules in layers="):
        capture(module, layers=["bert.embeddings", "bert.encoder", "head"])


def test_hf_capture_clip_towers_send_their_pooled_vector_not_their_output_object():
    captured = _captured_equals_module("clip")
    inputs = {s.name: s.inputs for s in captured.layers}
    assert inputs["clip_visual_projection"] == ("clip_vision_model.pooler_output", )
    assert inputs["clip_text_projection"] == ("clip_text_model.pooler_output", )
    # Cut between each tower and its projection: the edge carries the selected leaf only.
    graph = build_layer_graph(captured.input_names, [(s.name, s.inputs) for s in captured.layers],
                              output=captured.output)
    stage_of = {n: 2 for n in graph.names} | {"clip_vision_model": 0, "clip_text_model": 1}
    edges = {(e.src, e.dst): [str(t) for t in e.tensors]
             for e in derive_partition(graph, stage_of, num_stages=3).stage_graph.edges}
    assert edges == {(0, 2): ["clip_vision_model.pooler_output"], (1, 2): ["clip_text_model.pooler_output"]}


def test_hf_capture_image_captioner_sends_the_image_encoding_to_every_cross_attending_stage():
    case = CASES["ved"]
    captured = case.capture(case.model())
    graph = build_layer_graph(captured.input_names, [(s.name, s.inputs) for s in captured.layers],
                              output=captured.output)
    edges = derive_partition(graph, case.partition_method(captured), num_stages=3).stage_graph.edges
    assert [(e.src, e.dst) for e in edges if "ved_encoder:0" in map(str, e.tensors)] == [(0, 1), (0, 2)]


def test_hf_capture_bert_sends_its_boolean_attention_mask_to_both_encoder_stages():
    case = CASES["bert"]
    captured = case.capture(case.model())
    spec = {s.name: s for s in captured.layers}["expand"]
    assert spec.inputs == ("attention_mask", "bert_bert_embeddings")
    graph = build_layer_graph(captured.input_names, [(s.name, s.inputs) for s in captured.layers],
                              output=captured.output)
    edges = derive_partition(graph, case.partition_method(captured), num_stages=3).stage_graph.edges
    assert [(e.src, e.dst) for e in edges if "expand" in map(str, e.tensors)] == [(0, 1), (0, 2)]
    model = captured.graph_model()
    (ids, mask), _ = case.batches(0)[0]
    embedded = model.layers["bert_bert_embeddings"](ids)
    assert not model.layers["expand"](mask, embedded).is_floating_point()   # it carries no gradient


def test_hf_capture_reads_dict_tuple_and_dataclass_leaves_by_path():
    captured = capture(CASES["structured"].model())
    assert {s.name: s.inputs for s in captured.layers}["cat"] == ("text_1.pair:0", "text_1.hidden", "image_1.pooled")


def test_a_structured_value_read_whole_by_another_stage_is_refused_naming_its_leaves():
    value = {"hidden": torch.zeros(2), "pair": (torch.ones(2), torch.ones(1))}
    with pytest.raises(GraphError, match=r"\"enc\" is read by another stage.*'enc.hidden', 'enc.pair:0', 'enc.pair:1'"):
        port_leaves(TensorRef("enc"), value)
    assert port_leaves(TensorRef("enc", "pair"), value["pair"]) is value["pair"]


def test_hf_capture_clip_has_a_zero_dim_parameter():
    # What DeepSpeed 0.19.8's _broadcast_model cannot send; the trained CLIP case below covers it.
    assert CASES["clip"].model().clip.logit_scale.dim() == 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    result = launch(WORLD_SIZE, WORKER, str(out), *TRAINED, timeout=400, log_dir=out / "logs")
    assert result.ok, result.report()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("name", TRAINED)
def test_hf_capture_trains_pipelined_like_the_module_on_one_process(trained, name):
    losses, state = train_module(CASES[name])
    ranks = [torch.load(trained / f"{name}.rank{r}.pt") for r in range(WORLD_SIZE)]
    assert sorted(r["stage"] for r in ranks) == list(range(WORLD_SIZE))
    seen = set()
    for res in ranks:
        assert res["losses"] == pytest.approx(losses, rel=1e-5)
        for key, value in res["state"].items():
            torch.testing.assert_close(value, state[key], rtol=1e-5, atol=1e-6, msg=key)
            seen.add(key)
    assert seen == set(state)


def test_hf_capture_gpt2_ties_the_embedding_and_the_output_projection_across_layers():
    captured = CASES["gpt2"].capture(CASES["gpt2"].model())
    tied = {s.name: s.key for s in captured.layers if isinstance(s, CapturedTiedLayerSpec)}
    assert tied == {"gpt_transformer_wte": "tie_gpt_transformer_wte", "gpt_lm_head": "tie_gpt_transformer_wte"}
    holder = captured.layers[[s.name for s in captured.layers].index("gpt_lm_head")].build()
    assert holder["gpt_lm_head"].weight is holder["gpt_transformer_wte"].weight


def test_hf_capture_gpt2_needs_example_shapes_and_says_so():
    module = CASES["gpt2"].model()
    with pytest.raises(GraphError, match=r"masking_utils.py.*shape.*pass example_inputs"):
        capture(module, layers=CASES["gpt2"].layers)


def test_capture_with_example_shapes_still_refuses_control_flow_on_values():
    from test_capture import WithGate
    with pytest.raises(GraphError, match=r"neither torch.fx nor shape-specialised tracing can capture WithGate.*"
                                         r"if h.sum\(\) > 0"):
        capture(WithGate(), layers=["gate.inner"], example_inputs=(torch.randn(2, 4), ))


@pytest.mark.dist
def test_a_frozen_tower_runs_forwards_only_and_exchanges_no_gradient(trained):
    ranks = {r["stage"]: r for r in (torch.load(trained / f"clip_frozen.rank{k}.pt") for k in range(WORLD_SIZE))}
    assert ranks[0]["frozen"] == [0] and ranks[0]["layers"] == ["clip_vision_model", "clip_visual_projection"]
    assert "F" in ranks[0]["ran"] and not {"B", "I", "W", "RECV_B@2"} & set(ranks[0]["ran"])
    assert "SEND_B@0" not in ranks[2]["ran"] and "SEND_B@1" in ranks[2]["ran"]   # the text tower still learns
    assert "B" in ranks[1]["ran"] and "RECV_B@2" in ranks[1]["ran"]
    # The unfrozen CLIP: the image tower's stage runs backwards and receives gradients.
    unfrozen = {r["stage"]: r for r in (torch.load(trained / f"clip.rank{k}.pt") for k in range(WORLD_SIZE))}
    assert unfrozen[0]["frozen"] == [] and {"B", "RECV_B@2"} <= set(unfrozen[0]["ran"])
