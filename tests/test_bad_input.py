"""Bad input fails with a clear ValueError naming the culprit, on every rank, without a hang."""

import json

import pytest

from dist import launch
from conftest import WORKERS

pytestmark = pytest.mark.dist

EXPECTED = {  # case -> words the message must contain
    "cycle": ["cycle", "a", "b", "c"],
    "unknown_input": ['"b"', '"nope"'],
    "duplicate_name": ["duplicate", '"a"'],
    "dangling_layer": ["lost", "output"],
    "mapping_misses_layer": ["misses", "c"],
    "mapping_stage_cycle": ["cycle between stages", "stage 0", "stage 1"],
    "more_stages_than_layers": ["2 stages", "1 layers"],
    "world_size_not_divisible": ["num_stages (3)", "world size (2)"],
    "unknown_partition_method": ["balanced", "uniform"],
    "unknown_config_key": ["graph_pipeline.scheduel"],
    "plan_wrong_stage_count": ["3 stages", "has 2", "num_stages=3"],
    "plan_file_missing": ['"no/such/plan.json"', "does not exist"],
    "resolved_for_another_model": ["resolved partition", "another layer graph", "['a', 'b']"],
    "degrees_do_not_divide_world": ["[2, 1]", "3 ranks", "world size (2)"],
    "plan_wrong_world_size": ["3 devices", "[1, 2]", "world size is 2"],
    "micro_batch_not_divisible_by_degree": ["stage 0 runs on 2 ranks", "3 samples"],
    "wrong_number_of_inputs": ["1 tensor(s)", "['x']", "tuple of 2"],
    "eval_too_few_micro_batches": ["ran out of micro-batches", "gradient_accumulation_steps=2", "num_micro_batches="],
    "split_schedule_with_reentrant_checkpointing": ['"zb1"', '"pipeline.use_reentrant": true', "1f1b"],
    "split_schedule_with_own_checkpoint_function": ['"zb2"', "activation_checkpoint_func='my_checkpoint'", "1f1b"],
    "async_with_clipping": ['"pipedream"', '"gradient_clipping" = 1.0', '"gradient_clipping": 0'],
    "async_with_zero": ['"pipedream"', '"zero_optimization.stage"', '"2bw"'],
    "2bw_with_zero2": ['"2bw"', '"zero_optimization.stage" 2', "use stage 1"],
    "zero3_checkpoint": ["save_checkpoint", '"zero_optimization.stage": 3', "use stage 2"],
    "zero3_with_split_backward": ['"zero_optimization.stage": 3', '"zb1"', '"1f1b"', "stage 2"],
    "pipeoptim_inplace_with_recomputation": ['"pipeoptim-inplace"', '"activation_checkpoint_interval"', '"pipeoptim"'],
    "pipeoptim_with_weight_decay": ['"pipeoptim"', '"weight_decay"'],
}


def test_a_stage_whose_peer_died_fails_after_the_p2p_timeout_naming_the_peer(errors):
    kind, message = errors[1]["dead_peer"][:2]
    assert kind == "GPPError", message
    assert "stage 1 waited for stage 0 (global rank 0)" in message and "p2p_timeout_s = 2 s" in message
    assert "Timed out" in message or "timed out" in message, message


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    out = tmp_path_factory.mktemp("bad_inputs")
    result = launch(2, WORKERS / "bad_inputs.py", str(out), timeout=240, log_dir=out / "logs")
    assert result.ok, result.report()
    return [json.loads((out / f"errors.rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_input_raises_a_value_error_naming_the_culprit_on_every_rank(errors, case):
    for rank, per_rank in enumerate(errors):
        kind, message, is_value_error = (per_rank[case] + [False])[:3]
        assert kind is not None, f"rank {rank}: {case} raised nothing"
        assert is_value_error, f"rank {rank}: {case} raised {kind}: {message}"
        for word in EXPECTED[case]:
            assert word in message, f"rank {rank}: {case}: {word!r} not in {message!r}"
