"""Worker: bad tensor-parallel input on every rank; records the error each raises.

Every rank must raise the same clear error before any rank waits on another (the module builds
its groups only after its checks). Writes ``OUT_DIR/errors.rank<r>.json``: ``{case: [type,
message, is ValueError]}``. Run on 4 ranks by ``tests/test_tensor_parallel_errors.py``.
"""

import os

from torch import nn

import gpp_deepspeed
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from gpp_deepspeed import GraphLayerSpec, GraphPipelineModule


def lin(name, *inputs, d=4):
    return GraphLayerSpec(name, nn.Linear, d, d, inputs=list(inputs))


GOOD = [lin("a", "x"), lin("b", "a"), lin("c", "b")]
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**6}


def module(**kw):
    return GraphPipelineModule(GOOD, input_names=["x"], loss_fn=nn.MSELoss(), **kw)


def tp_module():
    return module(stage_degrees=[2, 2], stage_tp=[2, 1])


class OtherMpu:
    """A Megatron-style mpu set up for another layout (TP 4) than the module's."""

    def get_tensor_model_parallel_world_size(self):
        return 4

    def get_tensor_model_parallel_rank(self):
        return 0


def on_one_rank_nodes():
    """LOCAL_SIZE=1: every rank its own node, so a TP group of 2 spans two nodes."""
    old = os.environ.get("LOCAL_SIZE")
    os.environ["LOCAL_SIZE"] = "1"
    try:
        return tp_module()
    finally:
        os.environ["LOCAL_SIZE"] = old


CASES = {
    "tp_does_not_divide_stage": lambda: module(stage_degrees=[3, 1], stage_tp=[2, 1]),
    "tp_not_one_per_stage": lambda: module(stage_degrees=[2, 2], stage_tp=[2]),
    "tp_group_spans_nodes": on_one_rank_nodes,
    "topology_contradicts_stage_tp": lambda: module(topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1),
                                                    stage_tp=[1, 1]),
    "async_schedule_with_tp": lambda: gpp_deepspeed.initialize(
        model=tp_module(), model_parameters=None, config={**CONFIG, "graph_pipeline": {"schedule": "pipedream"}}),
    "config_stage_tp_is_not_the_modules": lambda: gpp_deepspeed.initialize(
        model=tp_module(), model_parameters=None, config={**CONFIG, "graph_pipeline": {"stage_tp": [1, 1]}}),
    "mpu_for_another_layout": lambda: gpp_deepspeed.initialize(
        model=tp_module(), model_parameters=None, mpu=OtherMpu(), config=CONFIG),
}


def main():
    from bad_inputs import main as record_errors   # the bad-input worker's loop, on these cases

    record_errors(CASES)


if __name__ == "__main__":
    main()
