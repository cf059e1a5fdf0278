"""Issue 29 acceptance: a captured Llama-style model with its decoder stages at TP 2 and its embedding
stage at TP 1, loaded from a ``save_pretrained`` directory, trained against one process, saved and
read back by ``from_pretrained`` (6 gloo ranks, ``tests/workers/tp_hf_pipeline.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra (make test installs it)")

from dist import launch  # noqa: E402
from llama_tiny import LM, config, eval_batch, train_reference  # noqa: E402
from tp_llama import TP_CONFIG  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "tp_hf_pipeline.py"

@pytest.mark.dist
def test_a_pretrained_llama_with_tp2_decoder_stages_trains_saves_and_loads_like_one_process(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    src, out = tmp_path / "src", tmp_path / "out"
    torch.manual_seed(0)
    LlamaForCausalLM(config(**TP_CONFIG)).save_pretrained(src, safe_serialization=True, max_shard_size="20KB")
    result = launch(6, WORKER, str(src), str(out), timeout=600, log_dir=tmp_path / "logs")
    assert result.ok, result.report()
    ranks = [torch.load(out / f"tp.rank{r}.pt", weights_only=False) for r in range(6)]
    losses, trained = train_reference(src)
    for res in ranks:
        assert res["losses"] == pytest.approx(losses, rel=1e-5)
        assert res["tp"] == [1, 2, 2, 2, 2, 1]
        assert bool(res["split"]) == (res["stage"] in (1, 2))   # only the decoder stages hold split weights
    loaded, info = AutoModelForCausalLM.from_pretrained(out / "saved", output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    for name, value in trained.m.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    logits = [res["logits"] for res in ranks if res["logits"] is not None]
    ids, _ = eval_batch()[-1]
    with torch.no_grad():
        torch.testing.assert_close(LM(loaded)(ids), logits[0], rtol=1e-5, atol=1e-6)
