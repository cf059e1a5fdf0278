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
from gpp_deepspeed.frontend import CapturedTiedLayerSpec, capture  # noqa: E402
from gpp_deepspeed.graph import build_layer_graph  # noqa: E402
from gpp_deepspeed.graph.stages import derive_partition  # noqa: E402
from gpp_deepspeed.errors import GPPConfigError, GraphError  # noqa: E402
from gpp_deepspeed.graph.ir import TensorRef  # noqa: E402
from gpp_deepspeed.nn.dag import port_leaves  # noqa: E402
from gpp_deepspeed.spec import check_captured_rows, normalize_layers  # noqa: E402
from hf_models import CASES, train_module  # noqa: E402

WORKER = Path(__file__).resolve().parent / "workers" / "hf_cases.py"
WORLD_SIZE = 3
TRAINED = ["clip", "clip_frozen", "structured", "gpt2", "ved", "bert", "t5", "llama", "llava"]


def _captured_equals_module(name: str, cases=CASES):
    case = cases[name]
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
            rtol, atol = (1e-5, 1e-6) if case.masks_materialised else (1e-6 if n in captured.aliases else 0, 0)
            if n in captured.unused:
                assert p.grad is None, n
            else:
                torch.testing.assert_close(grads[n], p.grad, rtol=rtol, atol=atol, msg=n)
    return captured


@pytest.mark.parametrize("name", [*TRAINED, "hidden_sum"])
def test_hf_capture_graph_model_equals_the_module_with_gradients(name):
    _captured_equals_module(name)


def _stage_edges(name: str, captured) -> dict[tuple[int, int], list[str]]:
    graph = build_layer_graph(captured.input_names, [(s.name, s.inputs) for s in captured.layers],
                              output=captured.output)
    partition = derive_partition(graph, CASES[name].partition_method(captured), num_stages=CASES[name].stages)
    return partition, {(e.src, e.dst): [str(t) for t in e.tensors] for e in partition.stage_graph.edges}


def test_hf_capture_llama_sends_the_embedding_only_to_the_first_decoder_layer():
    # Every Llama decoder layer builds its mask and positions from inputs_embeds.device: the layers
    # read it from their own weights, so the embedding crosses to stage 1 only (not to stage 2).
    captured = _captured_equals_module("llama")
    _, edges = _stage_edges("llama", captured)
    assert edges == {(0, 1): ["llama_model_embed_tokens", "llama_model_rotary_emb"],
                     (0, 2): ["llama_model_rotary_emb"], (1, 2): ["llama_model_layers_0"]}
    layer = {s.name: s for s in captured.layers}["llama_model_layers_1"]
    assert layer.inputs == ("llama_model_layers_0", "llama_model_rotary_emb")


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_hf_capture_llama_runs_on_the_device_that_holds_its_weights(device):
    # Captured on the CPU; the layers build their masks and positions where their weights are
    # (the rank's device at run time), never on the capture device.
    case = CASES["llama"]
    module = case.model()
    model = case.capture(module).graph_model().to(device)
    ids = case.batches(0)[0][0].to(device)
    out = model(ids)
    assert out.device.type == device
    if device != "meta":
        torch.testing.assert_close(out, module.to(device)(ids), rtol=1e-5, atol=1e-6)


def test_hf_capture_llava_runs_its_vision_tower_beside_the_text_embedding():
    captured = _captured_equals_module("llava")
    partition, edges = _stage_edges("llava", captured)
    # Stages 0 (vision tower, projector) and 1 (token embedding) both feed stage 2 and not each other.
    assert edges == {(0, 2): ["llava_model_multi_modal_projector"], (1, 2): ["llava_model_language_model_embed_tokens"]}
    assert partition.stage_graph.depth(0) == partition.stage_graph.depth(1) and partition.stage_graph.pipeline_depth == 2
    # list(image_features) splits the batch dimension: rows are glue on the merging stage, and the
    # projector's output crosses as one tensor.
    assert {s.name: s.inputs for s in captured.layers}["masked_scatter"] == (
        "llava_model_multi_modal_projector", "llava_model_language_model_embed_tokens", "input_ids")


def test_hf_capture_llava_leaves_out_the_vision_layer_whose_output_it_does_not_read():
    case = CASES["llava"]
    with pytest.warns(UserWarning, match=r"leaves out the calls of submodules \['llava.model.vision_tower.encoder.layers.1', "
                                         r"'llava.model.vision_tower.post_layernorm'\]"):
        captured = case.capture(case.model())
    assert captured.unused[0] == "llava.model.vision_tower.encoder.layers.1.self_attn.k_proj.weight"
    assert {n.split(".")[3] for n in captured.unused} == {"encoder", "post_layernorm"}


def test_hf_capture_llava_without_example_inputs_says_to_pass_them():
    # The first thing a plain trace cannot answer is whether a vision layer's output is a tensor
    # (transformers' ModelOutput asks); list(image_features) over the batch would be next.
    case = CASES["llava"]
    with pytest.raises(GraphError, match=r"generic.py:\d+: return isinstance\(x, torch.Tensor\).*"
                                         r"cannot tell is a tensor.*pass example_inputs="):
        capture(case.model(), layers=case.layers)


def test_hf_capture_runs_the_hooks_that_collect_hidden_states_on_the_traced_layers():
    captured = _captured_equals_module("hidden_sum")
    # The sum reads the embedding and both layers' outputs, which the layers' hooks collected.
    glue = [s.inputs for s in captured.layers if s.name.startswith("getitem")][-1]   # stack, sum, [:, 0]
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
    assert spec.inputs == ("attention_mask", )   # it reads the embedding's device from the mask itself
    graph = build_layer_graph(captured.input_names, [(s.name, s.inputs) for s in captured.layers],
                              output=captured.output)
    edges = derive_partition(graph, case.partition_method(captured), num_stages=3).stage_graph.edges
    assert [(e.src, e.dst) for e in edges if "expand" in map(str, e.tensors)] == [(0, 1), (0, 2)]
    (_, mask), _ = case.batches(0)[0]
    assert not captured.graph_model().layers["expand"](mask).is_floating_point()   # it carries no gradient


def test_hf_capture_reads_dict_tuple_and_dataclass_leaves_by_path():
    captured = capture(CASES["structured"].model())
    assert {s.name: s.inputs for s in captured.layers}["cat"] == ("text_1.pair:0", "text_1.hidden", "image_1.pooled")


def test_a_structured_value_read_whole_by_another_stage_is_refused_naming_its_leaves():
    value = {"hidden": torch.zeros(2), "pair": (torch.ones(2), torch.ones(1))}
    with pytest.raises(GraphError, match=r"\"enc\" is read by another stage.*'enc.hidden', 'enc.pair:0', 'enc.pair:1'"):
        port_leaves(TensorRef("enc"), value)
    assert port_leaves(TensorRef("enc", "pair"), value["pair"]) is value["pair"]


def test_hf_capture_of_a_wrapper_with_default_settings_says_it_is_one_layer_and_what_to_name():
    with pytest.warns(UserWarning, match=r'each top-level child of LlamaLogits whole \(layers=None\), and it has '
                                         r'one, "llama": the captured model is one layer.*the 2 blocks of '
                                         r'"llama.model.layers" \("llama.model.layers.0"'):
        captured = capture(CASES["llama"].model())
    assert captured.paths == {"llama": "llama"}


def test_hf_capture_stage_map_places_layers_by_module_path_and_glue_beside_its_reader():
    case = CASES["llava"]
    captured = case.capture(case.model())
    stage_of = captured.stage_map({"llava.model.vision_tower": 0, "llava.model.multi_modal_projector": 0,
                                   "llava.model.language_model.embed_tokens": 1}, default=2)
    assert stage_of["llava_model_vision_tower_encoder_layers_0"] == 0
    assert stage_of["getitem_1"] == 0           # the vision features' slice, read by the projector
    assert stage_of["masked_scatter"] == 2      # the merge, read by the decoder
    assert captured.paths["llava_model_language_model_layers_1"] == "llava.model.language_model.layers.1"
    with pytest.raises(GPPConfigError, match=r'"llava.model.vision_towr" is neither.*close names: '
                                             r"\['llava.model.vision_tower'"):
        captured.stage_map({"llava.model.vision_towr": 0}, default=2)
    with pytest.raises(GPPConfigError, match=r"no stage for layers \['llava_model_language_model_embed_tokens'"):
        captured.stage_map({"llava.model.vision_tower": 0})


def test_hf_capture_clip_has_a_zero_dim_parameter():
    # What DeepSpeed 0.19.8's _broadcast_model cannot send; the trained CLIP case below covers it.
    assert CASES["clip"].model().clip.logit_scale.dim() == 0


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "t5", "ved"])
def test_hf_capture_keeps_the_batch_dimension_symbolic(name):
    # Captured at 4 rows, the captured layers compute the module's function at 2 and 3 rows: the
    # sizes the mask code read follow the rows of a tensor each layer holds.
    case = CASES[name]
    module = case.model()
    captured = case.capture(module)
    assert all(shape[0] is None for shape in captured.input_shapes.values()), captured.input_shapes
    model = captured.graph_model()
    inputs, _ = case.batches(0)[0]
    inputs = inputs if isinstance(inputs, tuple) else (inputs, )
    for rows in (2, 3):
        few = tuple(x[:rows] for x in inputs)
        torch.testing.assert_close(model(*few), module(*few), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["llava", "llama", "llama_eager", "t5", "bert"])
def test_hf_capture_in_float32_runs_in_bfloat16_exactly_like_the_module(name):
    # DeepSpeed's bf16 casts the captured layers as a whole: dtypes the model's code reads from
    # tensors follow (Llava casts its image features to inputs_embeds.dtype), not the capture's.
    case = CASES[name]
    module = case.model()
    model = case.capture(module).graph_model().to(torch.bfloat16)
    module = module.to(torch.bfloat16)
    inputs, _ = case.batches(0)[0]
    inputs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x
                   for x in (inputs if isinstance(inputs, tuple) else (inputs, )))
    out = model(*inputs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, module(*inputs), rtol=0, atol=0)


def test_hf_capture_llava_stays_specialised_to_its_rows_and_names_both_shapes():
    case = CASES["llava"]
    captured = case.capture(case.model())
    assert captured.input_shapes == {"input_ids": (4, 10), "pixel_values": (4, 3, 8, 8)}
    inputs, _ = case.batches(0)[0]
    with pytest.raises(GPPConfigError, match=r'input "pixel_values" has shape \(2, 3, 8, 8\), but layer '
                                             r'"llava_model_vision_tower_embeddings" was captured for \(4, 3, 8, 8\)'):
        captured.graph_model()(*(x[:2] for x in inputs))


def test_captured_rows_are_checked_against_every_stage_before_training():
    case = CASES["llava"]
    captured = case.capture(case.model())
    entries = normalize_layers(captured.layers, captured.input_names, base_seed=0)
    stage_of = case.partition_method(captured)
    check_captured_rows(entries, stage_of, [4, 4, 4])
    with pytest.raises(GPPConfigError, match=r"\(stage 0\) was captured for micro-batches of 4 rows, but a rank of "
                                             r"stage 0 runs 2 rows"):
        check_captured_rows(entries, stage_of, [2, 4, 4])
    symbolic = CASES["bert"].capture(CASES["bert"].model())
    entries = normalize_layers(symbolic.layers, symbolic.input_names, base_seed=0)
    check_captured_rows(entries, CASES["bert"].partition_method(symbolic), [2, 4, 4])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    result = launch(WORLD_SIZE, WORKER, str(out), *TRAINED, timeout=400, log_dir=out / "logs")
    assert result.ok, result.report()
    return out


@pytest.fixture(scope="module")
def trained_wide(tmp_path_factory):
    """The cases whose stage 0 has two ranks (stage degrees 2, 1, 1)."""
    out = tmp_path_factory.mktemp("hf_wide")
    result = launch(4, WORKER, str(out), "bert_wide", "llava_wide", timeout=400, log_dir=out / "logs")
    assert result.ok, result.report()
    return out


def _trained_like_the_module(out: Path, name: str, world_size: int, cases=CASES):
    losses, state = train_module(cases[name])
    unused = set(cases[name].capture(cases[name].model()).unused)   # never trained, in neither run
    ranks = [torch.load(out / f"{name}.rank{r}.pt") for r in range(world_size)]
    assert sorted({r["stage"] for r in ranks}) == list(range(cases[name].stages))
    seen = set()
    for res in ranks:
        assert res["losses"] == pytest.approx(losses, rel=1e-5)
        for key, value in res["state"].items():
            torch.testing.assert_close(value, state[key], rtol=1e-5, atol=1e-6, msg=key)
            seen.add(key)
    assert seen == set(state) - unused


@pytest.mark.dist
@pytest.mark.parametrize("name", TRAINED)
def test_hf_capture_trains_pipelined_like_the_module_on_one_process(trained, name):
    _trained_like_the_module(trained, name, WORLD_SIZE)


@pytest.mark.dist
def test_one_capture_serves_a_stage_whose_ranks_see_half_the_rows(trained_wide):
    # Captured at 4 rows; each rank of stage 0 runs 2 of every micro-batch's 4 rows.
    _trained_like_the_module(trained_wide, "bert_wide", 4)


@pytest.mark.dist
def test_a_capture_fixed_to_its_rows_is_refused_on_every_rank_before_training(trained_wide):
    ranks = [torch.load(trained_wide / f"llava_wide.rank{r}.pt") for r in range(4)]
    messages = {r["refused"] for r in ranks}
    assert len(messages) == 1 and "captured for micro-batches of 4 rows, but a rank of stage 0 runs 2" in messages.pop()


@pytest.mark.dist
@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_tied_weights_across_stages_train_without_autograd_warnings(trained, name):
    # GPT-2 ties its embedding (stage 0) to its head (stage 2); T5 ties it across all three stages.
    # DeepSpeed's broadcast of their initial values ran under autograd, and the first backward
    # warned "c10d::broadcast_: an autograd kernel was not registered".
    ranks = [torch.load(trained / f"{name}.rank{r}.pt") for r in range(WORLD_SIZE)]
    assert sum(bool(r["tied"]) for r in ranks) >= 2   # the tie spans stages
    for res in ranks:
        assert not [w for w in res["warnings"] if "autograd kernel" in w], res["warnings"]


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
