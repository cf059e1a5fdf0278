"""The paper's models as descriptions, and their analytic costs: pure and fast (no torch).

Structure and parameter counts are checked against GraphPipe (arXiv 2406.17145) Appendix A.2 at
the paper's sizes, with hand-computed formulas; FLOPs, bytes and times against hand-computed
roofline values.
"""

from __future__ import annotations

import pytest

from gpp_deepspeed.errors import GPPConfigError
from gpp_deepspeed.models import (BUILDERS, TINY, V100_SUMMIT, H100_80GB, LayerDesc, analytic_costs, candle_uno, dlrm,
                                  layer_flops, layer_stash_bytes, layer_times, multimodal_transformer, param_count,
                                  sequential_transformer, tiny)
from gpp_deepspeed.planner import CostDB, StageCostModel
from test_import_boundaries import loaded_heavy_modules

H, F = 1024, 4096
TRANSFORMER_PARAMS = 12 * H * H + 13 * H  # 4h^2+4h attention, 2hf+f+h MLP, 4h layernorms, f = 4h


def _ff(i, o):
    return i * o + o


def test_mmt_is_four_branches_of_eight_transformer_layers_then_concat_and_head():
    m = multimodal_transformer()
    assert m.input_names == tuple(f"tokens{b}" for b in range(4))
    assert all(s.shape == (256, 1024) and s.dtype == "float32" for s in m.input_shapes)
    assert len(m.layers) == 4 * 8 + 2 and m.count("transformer") == 32
    for b in range(4):
        chain = [m.layer(f"b{b}_l{i}") for i in range(8)]
        assert chain[0].inputs == (f"tokens{b}", )
        assert all(nxt.inputs == (prev.name, ) for prev, nxt in zip(chain, chain[1:]))
    assert m.layer("concat").inputs == tuple(f"b{b}_l7" for b in range(4))
    assert m.layer("concat").dims["widths"] == (1024, ) * 4
    assert m.layer("head").inputs == ("concat", ) and m.output == "head"


def test_mmt_sublayer_granularity_has_residual_skip_edges():
    m = multimodal_transformer(granularity="sublayer")
    assert len(m.layers) == 4 * 8 * 4 + 2
    assert (m.count("layernorm"), m.count("attention"), m.count("mlp")) == (64, 32, 32)
    assert m.layer("b0_l0_attn").inputs == ("b0_l0_ln1", "tokens0")      # skip over the layernorm
    assert m.layer("b0_l1_ln1").inputs == ("b0_l0_mlp", )
    assert m.layer("b0_l1_attn").inputs == ("b0_l1_ln1", "b0_l0_mlp")
    assert m.layer("b2_l3_mlp").inputs == ("b2_l3_ln2", "b2_l3_attn")
    assert m.layer("concat").inputs == tuple(f"b{b}_l7_mlp" for b in range(4))


def test_sequential_transformer_is_one_chain_of_mmt_sized_layers():
    m = sequential_transformer()
    assert m.input_names == ("tokens", ) and len(m.layers) == 33
    assert all(layer.inputs == (prev.name, ) for prev, layer in zip(m.layers, m.layers[1:]))
    assert m.layer("l0").dims == multimodal_transformer().layer("b0_l0").dims


def test_dlrm_has_seven_dense_and_seven_embedding_branches():
    m = dlrm()
    assert len(m.input_names) == 14
    dense, sparse = m.input_shapes[:7], m.input_shapes[7:]
    assert all(s.shape == (4096, ) and s.dtype == "float32" for s in dense)
    assert all(s.shape == (100, ) and s.dtype == "int64" and s.high == 1_000_000 for s in sparse)
    assert (m.count("linear"), m.count("embedding_bag"), m.count("concat")) == (7 * 4 + 4, 7, 1)
    assert len(m.layers) == 7 * 4 + 7 + 1 + 4 + 1
    # Embeddings in a bag are concatenated (A.2): 100 x 64 per sample per table.
    assert m.layer("interaction").dims["widths"] == (4096, ) * 7 + (6400, ) * 7
    assert m.layer("top_fc0").dims["in"] == 7 * 4096 + 7 * 6400
    assert m.loss == "bce" and m.layer("head").dims["out"] == 1


@pytest.mark.parametrize("branches", [2, 4, 8, 16])
def test_candle_uno_branch_count_is_configurable(branches):
    m = candle_uno(branches=branches)
    assert len(m.input_names) == branches
    assert m.count("linear") == 4 * branches + 4 and len(m.layers) == 4 * branches + 4 + 2
    assert m.layer("concat").inputs == tuple(f"branch{i}_fc3" for i in range(branches))
    assert m.layer("top_fc0").dims["in"] == branches * 4096


def test_parameter_counts_at_paper_size_match_hand_formulas():
    assert param_count(multimodal_transformer().layer("b0_l0")) == TRANSFORMER_PARAMS == 12_596_224
    assert multimodal_transformer().num_params == 32 * TRANSFORMER_PARAMS + _ff(4 * H, 1000)
    assert sequential_transformer().num_params == 32 * TRANSFORMER_PARAMS + _ff(H, 1000)
    assert dlrm().num_params == (7 * 4 * _ff(4096, 4096) + 7 * 1_000_000 * 64 + _ff(73472, 4096)
                                 + 3 * _ff(4096, 4096) + _ff(4096, 1))
    assert candle_uno().num_params == (7 * 4 * _ff(4096, 4096) + _ff(7 * 4096, 4096) + 3 * _ff(4096, 4096)
                                       + _ff(4096, 1))


@pytest.mark.parametrize("build", [multimodal_transformer, sequential_transformer])
def test_sublayers_add_up_to_their_transformer_layer(build):
    layer, sub = build(), build(granularity="sublayer")
    assert layer.num_params == sub.num_params
    for fn in (lambda x: layer_flops(x, 8), layer_stash_bytes, lambda x: layer_times(x, V100_SUMMIT, 8)[0]):
        assert sum(fn(x) for x in layer.layers) == pytest.approx(sum(fn(x) for x in sub.layers), rel=1e-12)


def test_feed_forward_models_are_the_same_dag_at_both_granularities():
    for build in (dlrm, candle_uno):
        assert build().layers == build(granularity="sublayer").layers


def test_linear_flops_bytes_and_time_are_the_roofline_by_hand():
    fc = dlrm().layer("dense0_fc1")  # 4096 -> 4096, ReLU
    assert layer_flops(fc, 8) == 2 * 8 * 4096 * 4096
    # b = 1 is memory-bound on the fp16 weights: (4096 + 4096^2 + 4096) * 2 bytes at 0.8 x 900 GB/s,
    # plus the ReLU (read + write 4096 fp16 values) and two 5 us launches.
    gemm = (4096 + 4096 * 4096 + 4096) * 2 / (0.8 * 900e9)
    relu = 2 * 4096 * 2 / (0.8 * 900e9)
    fwd, bwd = layer_times(fc, V100_SUMMIT, 1)
    assert fwd == pytest.approx(2 * 5e-6 + gemm + relu) and bwd == pytest.approx(2 * fwd)
    # b = 4096 is compute-bound: 2 * 4096^3 FLOPs at 0.7 x 125 TFLOPS.
    assert layer_times(fc, V100_SUMMIT, 4096)[0] > 2 * 4096**3 / (0.7 * 125e12)


def test_transformer_flops_and_activation_bytes_are_megatron_formulas():
    t = multimodal_transformer().layer("b0_l0")
    b, s, h, a = 4, 256, 1024, 16
    assert layer_flops(t, b) == 24 * b * s * h * h + 4 * b * s * s * h   # Narayanan et al. 2021
    assert layer_stash_bytes(t) == s * h * (34 + 5 * a * s / h)          # Korthikanti et al. 2022
    assert layer_stash_bytes(t, bytes_per_element=4) == 2 * layer_stash_bytes(t)


def test_embedding_bag_is_memory_bound():
    emb = dlrm().layer("emb0")
    assert layer_flops(emb, 32) == 0
    moved = 32 * 100 * (8 + 2 * 64 * 2)  # indices, rows read, output written
    assert layer_times(emb, V100_SUMMIT, 32)[0] == pytest.approx(5e-6 + moved / (0.8 * 900e9))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_analytic_times_grow_with_the_micro_batch(name):
    db = analytic_costs(BUILDERS[name](granularity="sublayer"), H100_80GB)
    assert db.micro_batches == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    for c in db.layers:
        assert all(x < y for x, y in zip(c.fwd_s, c.fwd_s[1:])), c.name
        assert c.bwd_s == tuple(2 * f for f in c.fwd_s)


def test_cost_db_carries_bytes_hardware_and_an_analytic_source():
    model = multimodal_transformer()
    db = analytic_costs(model, V100_SUMMIT, micro_batches=(4, 1, 2))
    assert db.source == "analytic: V100-SXM2-16GB (Summit) (FLOPs x efficiency; not measured)"
    assert db.model == "mmt" and db.granularity == "layer" and db.micro_batches == (1, 2, 4)
    assert [c.name for c in db.layers] == [layer.name for layer in model.layers]
    c = db.by_name["b0_l0"]
    assert (c.param_bytes, c.out_bytes, c.inputs) == (2 * TRANSFORMER_PARAMS, 2 * 256 * 1024, ("tokens0", ))
    assert db.by_name["concat"].out_bytes == 2 * 256 * 4096 and db.by_name["concat"].stash_bytes == 0
    hw = db.hardware
    assert (hw.memory_bytes, hw.devices_per_node, hw.optimizer_factor) == (16 * 2**30, 4, 7.0)
    assert hw.intra.beta_s_per_byte == pytest.approx(1 / 50e9) and hw.inter.beta_s_per_byte == pytest.approx(1 / 12.5e9)
    assert CostDB.from_json(db.to_json()) == db


def test_cost_db_is_priced_by_the_stage_cost_model():
    db = analytic_costs(dlrm(), V100_SUMMIT)
    model = StageCostModel(db, mini_batch=256)
    everything = model.full_mask
    one_device = model.stage(everything, 8, 1)
    assert one_device.weight_bytes == pytest.approx(8 * 2 * dlrm().num_params)  # 16 bytes per parameter
    assert not model.fits(everything, 8, 1, in_flight=1)  # 1.27 G parameters x 16 B > 16 GB
    assert model.time_per_sample(everything, 8, 1) > 0


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_presets_keep_the_branch_structure(name):
    small, full = tiny(name), BUILDERS[name]()
    assert len(small.input_names) == len(full.input_names)
    assert [layer.kind for layer in small.layers if layer.kind in ("concat", "head")] == \
        [layer.kind for layer in full.layers if layer.kind in ("concat", "head")]
    assert small.num_params < 50_000
    analytic_costs(small, V100_SUMMIT).graph  # a valid layer graph


def test_bad_sizes_and_kinds_are_rejected_with_the_culprit_named():
    with pytest.raises(GPPConfigError, match="granularity"):
        multimodal_transformer(granularity="op")
    with pytest.raises(GPPConfigError, match="divisible by heads"):
        multimodal_transformer(hidden=100, heads=16)
    with pytest.raises(GPPConfigError, match="branches must be a positive integer"):
        candle_uno(branches=0)
    with pytest.raises(GPPConfigError, match='"x".*unknown kind "conv"'):
        LayerDesc("x", "conv", ("a", ), {})
    with pytest.raises(GPPConfigError, match=r"lacks dims \['out'\]"):
        LayerDesc("fc", "linear", ("a", ), {"in": 3, "activation": "relu"})


def test_importing_gpp_deepspeed_models_imports_no_torch():
    assert loaded_heavy_modules("import gpp_deepspeed.models; gpp_deepspeed.models.analytic_costs") == []
