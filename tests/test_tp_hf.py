"""Tensor parallelism for captured Hugging Face layers (issue 29, point 3), without the pipeline engine.

Two gloo ranks form one TP group; a tiny Llama's decoder layers are built split by the model's own
``base_model_tp_plan`` with DeepSpeed's AutoTP layers
(:class:`~gpp_deepspeed.engine.tensor_parallel.HFTensorParallel`). The reference is the same model
on one process, unsplit: same logits, loss and gradients (split ones gathered); DeepSpeed's engine
under ZeRO-1 over the split model trains to the same parameters as plain SGD on one process; a
``save_pretrained`` directory loads on the meta device reading only each rank's slices.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra (make test installs it)")

from dist import launch  # noqa: E402
from tp_llama import LR, STEPS, capture_tp_llama, loss_of, step_batches  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "tp_hf_cases.py"
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Every case of the worker on 2 ranks, in one launch: ``(folder, the directory "load" read, the
    model saved there)``."""
    from transformers import LlamaForCausalLM
    from llama_tiny import config
    from tp_llama import TP_CONFIG
    out = tmp_path_factory.mktemp("tp_hf")
    torch.manual_seed(3)
    hf = LlamaForCausalLM(config(**TP_CONFIG))
    src = out / "src"
    hf.save_pretrained(src, safe_serialization=True)
    result = launch(2, WORKER, "grads", str(out), "+", "zero1", str(out), "+", "load", str(src), str(out),
                    timeout=400, log_dir=out / "logs")
    assert result.ok, result.report()
    return out, src, hf


def _ranks(ran, case: str) -> list[dict]:
    return [torch.load(ran[0] / f"{case}.rank{r}.pt", weights_only=False) for r in range(2)]


def _reference():
    model = capture_tp_llama(meta=False).graph_model()
    ids, labels = step_batches(0)[0]
    logits = model(ids)
    loss = loss_of(logits, labels)
    loss.backward()
    return model, logits.detach(), loss.item()


def test_split_decoder_layers_give_the_unsplit_models_logits_loss_and_gradients(ran):
    ranks = _ranks(ran, "grads")
    model, logits, loss = _reference()
    whole = dict(model.named_parameters())
    for got in ranks:
        torch.testing.assert_close(got["logits"], logits, rtol=RTOL, atol=ATOL)
        assert got["loss"] == pytest.approx(loss, rel=RTOL)
        assert set(got["grads"]) == set(whole)
        for name, p in whole.items():
            torch.testing.assert_close(got["grads"][name], p.grad, rtol=RTOL, atol=ATOL, msg=name)
    shapes = ranks[0]["shapes"]
    q = next(n for n in shapes if n.endswith("self_attn.q_proj.weight"))
    o = next(n for n in shapes if n.endswith("self_attn.o_proj.weight"))
    norm = next(n for n in shapes if n.endswith("input_layernorm.weight"))
    assert shapes[q] == (whole[q].shape[0] // 2, whole[q].shape[1])       # column-parallel: rows split
    assert shapes[o] == (whole[o].shape[0], whole[o].shape[1] // 2)       # row-parallel: columns split
    assert shapes[norm] == tuple(whole[norm].shape)                       # replicated


def test_deepspeed_zero1_over_split_layers_trains_like_sgd_on_one_process(ran):
    ranks = _ranks(ran, "zero1")
    model = capture_tp_llama(meta=False).graph_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        ids, labels = step_batches(step)[0]
        opt.zero_grad()
        loss = loss_of(model(ids), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for got in ranks:
        assert "ZeroOptimizer" in got["optimizer"]   # DeepSpeed flattened the split parameters
        assert got["losses"] == pytest.approx(losses, rel=RTOL)
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["params"][name], p.detach(), rtol=RTOL, atol=ATOL, msg=name)


def test_a_pretrained_directory_loads_split_each_rank_reading_only_its_slices(ran):
    from transformers import LlamaForCausalLM
    _, src, hf = ran
    ranks = _ranks(ran, "load")
    ids, _ = step_batches(0)[0]
    from llama_tiny import LM
    reference = LM(LlamaForCausalLM.from_pretrained(src))(ids).detach()
    full = {n: tuple(t.shape) for n, t in hf.state_dict().items()}
    for got in ranks:
        assert got["meta_left"] == []
        torch.testing.assert_close(got["logits"], reference, rtol=RTOL, atol=ATOL)
        read = dict(got["read"])
        for name, shape in read.items():
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
                assert shape == (full[name][0] // 2, full[name][1]), name
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                assert shape == (full[name][0], full[name][1] // 2), name
            else:
                assert shape == full[name], name
        assert any(n.endswith("q_proj.weight") for n in read)
        assert got["marked"] and all(".mlp." in n or ".self_attn." in n for n in got["marked"])
        # Gathered in the TP group (what save_pretrained writes), every tensor is the directory's whole one,
        # and the shards come back after.
        state, compared = hf.state_dict(), set()
        for name, t in got["whole"].items():   # GraphModel names: layers.<layer>.m.<name in the HF model>
            path = name.split(".", 2)[2]
            if path.startswith("m.") and path[2:] in state:
                torch.testing.assert_close(t, state[path[2:]], rtol=0, atol=0, msg=name)
                compared.add(path[2:])
        assert {n for n in state if n.endswith(("_proj.weight", "layernorm.weight"))} <= compared
        assert got["split_again"]


@pytest.mark.parametrize("overrides, field", [
    (dict(num_attention_heads=3, num_key_value_heads=3, hidden_size=24), "num_attention_heads = 3"),
    (dict(num_key_value_heads=1), "num_key_value_heads = 1"),
    (dict(intermediate_size=63), "intermediate_size = 63"),
])
def test_a_tp_degree_that_does_not_divide_the_config_is_refused_naming_the_field(overrides, field):
    from gpp_deepspeed.engine.tensor_parallel import check_tp_layers
    from gpp_deepspeed.errors import GPPConfigError
    decoder = next(s for s in capture_tp_llama(meta=True, **overrides).layers if "layers" in s.name)
    check_tp_layers([decoder], 1)   # TP 1: nothing to divide
    with pytest.raises(GPPConfigError, match=f"tensor-parallel degree 2 does not divide config.{field}"):
        check_tp_layers([decoder], 2)


def test_a_layer_the_tp_plan_does_not_cover_is_refused_by_name_and_norms_are_replicated():
    from gpp_deepspeed.engine.tensor_parallel import check_tp_layers, tp_styles
    from gpp_deepspeed.errors import GPPConfigError
    captured = capture_tp_llama(meta=True)
    embed = next(s for s in captured.layers if "embed" in s.name)
    with pytest.raises(GPPConfigError, match=r"embed_tokens \(Embedding \[64, 32\]\).*tensor-parallel degree 1"):
        check_tp_layers([embed], 2)
    norm = next(s for s in captured.layers if s.name.endswith("norm"))
    assert tp_styles(norm, 2) == {}   # a norm holds no matrix: replicated on every TP rank
    decoder = next(s for s in captured.layers if "layers" in s.name)
    assert sorted(p.split("layers.0.")[-1] for p in tp_styles(decoder, 2)) == ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj",
                                            "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
