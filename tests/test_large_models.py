"""Models of the size people pipeline: built on the meta device, materialised per stage, loaded from and
saved to Hugging Face directories.

References: the single-device ``GraphModel`` twin (initial weights), the Hugging Face model loaded
with ``from_pretrained`` and trained on one process with plain PyTorch (losses, logits), and
``from_pretrained`` itself (the saved directory loads strictly). Models are tiny and random;
directories are written here with ``save_pretrained`` (no hub).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="the [hf] extra (make test installs it)")

from dist import launch  # noqa: E402
from gpp_deepspeed import load_pretrained  # noqa: E402
from gpp_deepspeed.frontend import capture  # noqa: E402
from gpp_deepspeed.errors import CheckpointError, GPPConfigError, GraphError  # noqa: E402
from gpp_deepspeed.frontend.meta import is_meta  # noqa: E402
from llama_tiny import LM, STAGES, batches, capture_llama, config, eval_batch, save_llama, train_reference  # noqa: E402


# -- the meta device ----------------------------------------------------------------------------


def test_a_meta_model_is_captured_without_memory_and_its_twin_is_built_the_same_every_time():
    captured = capture_llama(meta=True)
    tensors = [t for s in captured.layers for t in s.module.state_dict(keep_vars=True).values()]
    assert tensors and all(t.is_meta for t in tensors)
    first, second = captured.graph_model().state_dict(), captured.graph_model().state_dict()
    assert list(first) == list(second)
    for name in first:
        assert not first[name].is_meta
        torch.testing.assert_close(first[name], second[name], rtol=0, atol=0, msg=name)


def test_meta_layers_are_materialised_by_the_hugging_face_models_own_init():
    from transformers import LlamaForCausalLM
    twin = capture_llama(meta=True).graph_model()
    state = {k.split(".", 2)[2]: v for k, v in twin.state_dict().items()}   # names in the captured module
    std = config().initializer_range
    assert state["m.model.layers.0.mlp.up_proj.weight"].std().item() == pytest.approx(std, rel=0.15)
    assert torch.equal(state["m.model.layers.0.input_layernorm.weight"], torch.ones(16))   # RMSNorm: ones
    # The non-persistent rotary frequencies are recomputed, as a model built off the meta device has them.
    rotary = twin.layers["m_model_rotary_emb"].get_buffer("m.model.rotary_emb.inv_freq")
    torch.testing.assert_close(rotary, LlamaForCausalLM(config()).model.rotary_emb.inv_freq, rtol=0, atol=0)


def test_building_a_captured_layer_under_the_meta_device_allocates_nothing():
    captured = capture_llama(meta=False)
    with torch.device("meta"):
        built = [s.build() for s in captured.layers]
    assert all(is_meta(m) for m in built if isinstance(m, nn.Module) and list(m.parameters()))


def test_a_materialised_layer_holds_only_its_own_tensors():
    captured = capture_llama(meta=True)
    spec = {s.name: s for s in captured.layers}["m_model_layers_1"]   # a function layer: glue and the decoder layer
    names = [n for n, _ in spec.build().named_parameters()]
    assert names and all(n.startswith("m.model.layers.1.") for n in names)


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.gain


class WithScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.scale, self.b = nn.Linear(4, 4), Scale(), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.scale(self.a(x)))


def test_a_meta_layer_that_nothing_initialises_is_refused_naming_its_tensor():
    with torch.device("meta"):
        module = WithScale()
    captured = capture(module)
    with pytest.raises(GPPConfigError, match=r'layer "scale" is on the meta device and nothing initialises '
                                             r"\['scale.gain'\].*init_fn"):
        captured.layers[1].check_buildable()
    with pytest.raises(GPPConfigError, match="scale.gain"):
        captured.graph_model()
    captured.layers[0].check_buildable()   # nn.Linear has reset_parameters()


def test_init_fn_initialises_meta_layers_and_plain_torch_layers_use_reset_parameters():
    with torch.device("meta"):
        module = WithScale()
    twin = capture(module, init_fn=lambda m: [nn.init.constant_(p, 0.5) for p in m.parameters(recurse=False)]
                   ).graph_model()
    assert torch.equal(twin.layers["scale"].gain, torch.full((4, ), 0.5))
    assert torch.equal(twin.layers["a"].weight, torch.full((4, 4), 0.5))
    # Without init_fn, torch layers get their reset_parameters() under the layer's seed: a CPU-built
    # layer under the same seed is the same.
    twin = capture(module, layers=["a", "b"], init_fn=None)
    built = {s.name: s for s in twin.layers}["a"]
    from gpp_deepspeed.spec import layer_seed
    torch.manual_seed(layer_seed(1234, "a"))
    reference = nn.Linear(4, 4)
    torch.manual_seed(layer_seed(1234, "a"))
    assert torch.equal(built.build().weight, reference.weight)


def test_capture_refuses_a_key_value_cache_argument_saying_use_cache_false():
    with pytest.raises(GraphError, match=r'submodule "m.model.layers.0" is called with a DynamicCache '
                                         r"\(past_key_values=\).*use_cache=False"):
        capture_llama(meta=True, use_cache=True)


# -- names and tied copies -------------------------------------------------------------------------


class T5Encoding(nn.Module):
    """``transformers.T5EncoderModel`` with a classifier: ``shared.weight`` is also
    ``encoder.embed_tokens.weight``, and forward reads only the latter."""

    def __init__(self):
        super().__init__()
        from transformers import T5Config, T5EncoderModel
        self.t5 = T5EncoderModel(T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                          dropout_rate=0.0, use_cache=False))
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids):
        return self.head(self.t5(input_ids=input_ids).last_hidden_state[:, 0])


def test_module_state_dict_has_every_name_of_a_tied_tensor_so_t5_loads_strictly():
    torch.manual_seed(0)
    module = T5Encoding()
    captured = capture(module, layers=["t5.encoder"], example_inputs=(torch.randint(0, 40, (2, 6)), ))
    state = captured.module_state_dict(captured.graph_model().state_dict())
    assert "t5.shared.weight" in state and "t5.encoder.embed_tokens.weight" in state
    T5Encoding().load_state_dict(state, strict=True)


# -- pretrained weights in -------------------------------------------------------------------------


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_a_meta_model_loaded_from_a_directory_computes_what_from_pretrained_computes(tmp_path, shard):
    from transformers import LlamaForCausalLM
    save_llama(tmp_path, shard=shard)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard is not None)
    captured = load_pretrained(capture_llama(meta=True, config_dir=tmp_path), tmp_path)
    twin = captured.graph_model()
    reference = LM(LlamaForCausalLM.from_pretrained(tmp_path))
    ids, _ = batches(0)[0]
    torch.testing.assert_close(twin(ids), reference(ids), rtol=0, atol=0)
    # Tied: one tensor in the directory, one parameter in the twin, read by both ends of the model.
    tie = [s for s in captured.layers if getattr(s, "key", None)][0].key
    assert twin.tied[tie]["m_lm_head"].weight is twin.tied[tie]["m_model_embed_tokens"].weight
    reference.load_state_dict(captured.module_state_dict(twin.state_dict()), strict=True)


def test_loaded_weights_are_the_processs_own_so_overwriting_the_directory_leaves_them_alone(tmp_path):
    # safetensors hands out views of the file's mapping; a parameter never written (a frozen one)
    # would keep reading the file, and save_pretrained to the same path rewrites it.
    from safetensors.torch import load_file, save_file
    save_llama(tmp_path)
    twin = load_pretrained(capture_llama(meta=True, config_dir=tmp_path), tmp_path).graph_model()
    before = {k: v.clone() for k, v in twin.state_dict().items()}
    file = tmp_path / "model.safetensors"
    save_file({k: torch.full_like(v, 7.0) for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
    for name, value in twin.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)


def test_a_directory_whose_names_or_shapes_differ_is_refused_naming_the_first_few(tmp_path):
    save_llama(tmp_path / "wide", hidden_size=24, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(CheckpointError, match=r"other shapes: \['m.model.embed_tokens.weight: checkpoint "
                                              r"\[64, 24\], model \[64, 16\]'"):
        load_pretrained(capture_llama(meta=True), tmp_path / "wide")
    save_llama(tmp_path / "deep", num_hidden_layers=5)
    with pytest.raises(CheckpointError, match=r"9 tensor\(s\) the model does not have: \['model.layers.4.*strict=False"):
        load_pretrained(capture_llama(meta=True), tmp_path / "deep")
    save_llama(tmp_path / "shallow", num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"9 tensor\(s\) of the model missing: \['model.layers.3.self_attn"):
        load_pretrained(capture_llama(meta=True), tmp_path / "shallow")
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        load_pretrained(capture_llama(meta=True), tmp_path)


def test_strict_false_initialises_what_the_directory_lacks_and_ignores_the_rest(tmp_path):
    from transformers import LlamaForCausalLM
    saved = save_llama(tmp_path, num_hidden_layers=3)
    captured = load_pretrained(capture_llama(meta=True), tmp_path, strict=False)
    state = {k.split(".", 2)[2]: v for k, v in captured.graph_model().state_dict().items()}
    torch.testing.assert_close(state["m.model.layers.2.mlp.up_proj.weight"], saved.model.layers[2].mlp.up_proj.weight)
    assert state["m.model.layers.3.mlp.up_proj.weight"].std().item() == pytest.approx(0.02, rel=0.2)
    assert isinstance(saved, LlamaForCausalLM)


# -- on 4 gloo ranks --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def initialised(pretrained):
    return [torch.load(pretrained["init"] / f"init.rank{r}.pt") for r in range(STAGES)]


@pytest.mark.dist
def test_each_rank_materialises_its_stage_as_the_single_device_twin_has_it(initialised):
    twin = capture_llama(meta=True)
    expected = twin.module_state_dict(twin.graph_model().state_dict())
    seen = set()
    for res in initialised:
        assert res["meta_left"] == []
        for name, value in res["state"].items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
            seen.add(name)
    assert seen == set(expected)
    # Each rank holds its stage and nothing else; the tied embedding is on the first and the last
    # stage, as it is under both of its names in the module.
    assert sorted(r["stage"] for r in initialised) == list(range(STAGES))
    assert sum(r["param_bytes"] for r in initialised) == sum(v.numel() * v.element_size() for v in expected.values())


@pytest.fixture(scope="module")
def roundtrip(pretrained):
    out = pretrained["roundtrip"]
    return pretrained["sharded"], out, [torch.load(out / f"roundtrip.rank{r}.pt") for r in range(STAGES)]


@pytest.mark.dist
def test_every_rank_reads_only_its_stages_tensors_from_a_sharded_directory(roundtrip):
    src, _, ranks = roundtrip
    captured = capture_llama(meta=True, config_dir=src)
    by_layer = {}
    for spec in captured.layers:
        module = spec.module
        if isinstance(module, nn.Module):
            names = {spec.module_path(n) for n in module.state_dict()}
            by_layer[spec.name] = {n[len("m."):] for n in names}
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    read_by_all = set()
    for res in ranks:
        wanted = {n for layer in res["layers"] for n in by_layer.get(layer, ())}
        wanted = {n if n in weight_map else "model.embed_tokens.weight" for n in wanted}   # the tied head
        assert sorted(res["read"]) == sorted(wanted), f"stage {res['stage']}"
        read_by_all |= set(res["read"])
    assert read_by_all == set(weight_map)


@pytest.mark.dist
def test_pretrained_to_pipeline_to_directory_round_trip_equals_one_process(roundtrip):
    from transformers import AutoModelForCausalLM
    src, out, ranks = roundtrip
    losses, trained = train_reference(src)
    for res in ranks:
        assert res["losses"] == pytest.approx(losses, rel=1e-5)
    saved = out / "saved"
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    files = sorted(f for res in ranks for f in res["files"])
    assert sorted(set(index["weight_map"].values())) == files and len(files) > STAGES   # every stage wrote its own
    assert "lm_head.weight" not in index["weight_map"]   # the tie is written once, under its source name
    loaded, info = AutoModelForCausalLM.from_pretrained(saved, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for name, value in trained.m.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    logits = [res["logits"] for res in ranks if res["logits"] is not None]
    assert len(logits) == 1
    ids, _ = eval_batch()[-1]
    with torch.no_grad():
        torch.testing.assert_close(LM(loaded)(ids), logits[0], rtol=1e-5, atol=1e-6)


@pytest.mark.dist
def test_the_memory_report_counts_each_ranks_stage_and_is_printed_beneath_the_stage_graph(roundtrip, pretrained):
    _, out, ranks = roundtrip
    for res in ranks:
        report = res["memory"]   # gathered: every rank's entry, the same on every rank
        assert report == ranks[0]["memory"] and [m["rank"] for m in report] == list(range(STAGES))
        mine = report[res["rank"]]
        assert mine["stage_idx"] == res["stage"]
        assert mine["param_bytes"] == res["counted"]["tensors"]      # parameters and buffers, tied copies included
        assert mine["grad_bytes"] == res["counted"]["trainable"] > 0
        assert mine["optimizer_bytes"] == 0                           # plain SGD keeps no state
        assert mine["activation_peak_bytes"] > 0
        assert mine["process_peak_bytes"] > mine["param_bytes"] + mine["grad_bytes"] + mine["activation_peak_bytes"]
    log = (pretrained["logs"] / "rank0.log").read_text()
    graph, at_init, after_step = (log.find(s) for s in ("stage graph:", "memory per rank (MiB) at initialize",
                                                        "memory per rank (MiB) after step 1"))
    assert 0 <= graph < at_init < after_step, log[-2000:]
    assert len(re.findall(r"^  stage \d+ \(rank \d+\): ", log[at_init:after_step], re.M)) == STAGES


@pytest.mark.dist
def test_models_that_cannot_be_built_fail_on_every_rank_before_any_communication(pretrained):
    # 2 stages on 4 ranks of one node; the launch goes on to its other runs, so nothing blocked
    for r in range(STAGES):
        errors = json.loads((pretrained["bad"] / f"bad.rank{r}.json").read_text())
        kind, message = errors["meta_without_init"]
        assert kind == "GPPConfigError" and "nothing initialises ['scale.gain']" in message
        kind, message = errors["does_not_fit"]
        assert kind == "InfeasiblePlanError" and "node 0 (ranks 0-3) cannot hold its stages" in message



# -- memory: each rank holds its stage, not the model ------------------------------------------------

MEMORY_WORKER = Path(__file__).resolve().parent / "workers" / "memory_worker.py"
SIZES = {"small": (1024, 2816, 4), "large": (1024, 2816, 14)}   # hidden, intermediate, layers; 98 M and 246 M parameters
SLOPE, FIXED_MIB = 1.3, 100   # the acceptance: peak above imports <= 1.3 x stage parameters + a fixed cost


def _peaks(kind: str, tmp_path: Path) -> dict[str, list[dict]]:
    out = {}
    for size, (hidden, intermediate, layers) in SIZES.items():
        prefix = tmp_path / f"{kind}_{size}"
        result = launch(4, MEMORY_WORKER, kind, str(hidden), str(intermediate), str(layers), str(prefix), timeout=600,
                        log_dir=tmp_path / f"logs_{kind}_{size}")
        assert result.ok, result.report()
        out[size] = sorted((json.loads(Path(f"{prefix}.rank{r}").read_text()) for r in range(4)),
                           key=lambda d: d["stage"])
    return out


def _assert_stage_sized(peaks: dict[str, list[dict]]) -> None:
    mib = 2**20
    for small, large in zip(peaks["small"], peaks["large"]):
        above = {s: d["peak"] - d["imports"] for s, d in (("small", small), ("large", large))}
        slope = (above["large"] - above["small"]) / (large["stage_param_bytes"] - small["stage_param_bytes"])
        fixed = above["small"] - slope * small["stage_param_bytes"]
        print(f"stage {small['stage']}: {small['stage_param_bytes'] / mib:.0f} -> {large['stage_param_bytes'] / mib:.0f} "
              f"MiB of parameters, peak above imports {above['small'] / mib:.0f} -> {above['large'] / mib:.0f} MiB: "
              f"slope {slope:.2f}, fixed {fixed / mib:.0f} MiB")
        assert slope <= SLOPE, f"stage {small['stage']}: memory grows {slope:.2f}x as fast as the stage's parameters"
        for d, a in ((small, above["small"]), (large, above["large"])):
            assert a <= SLOPE * d["stage_param_bytes"] + FIXED_MIB * mib, (d, a / mib)


@pytest.mark.dist
def test_a_meta_built_captured_llama_initialises_in_its_stages_memory_on_every_rank(tmp_path):
    _assert_stage_sized(_peaks("meta", tmp_path))


@pytest.mark.dist
def test_a_graph_layer_spec_model_builds_only_its_stages_layers_on_every_rank(tmp_path):
    _assert_stage_sized(_peaks("specs", tmp_path))
