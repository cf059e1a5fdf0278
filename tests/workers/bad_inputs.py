"""Worker: try each kind of bad input on this rank and record the error it raises.

Every rank must raise the same clear error, before any communication, so no rank waits on
another. Writes ``OUT_DIR/errors.rank<r>.json``: ``{case: [exception type, message]}``.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import deepspeed
import gpp_deepspeed
from gpp_deepspeed import GraphLayerSpec, GraphPipelineModule
from gpp_deepspeed.partitioning import BranchBalanced, resolve_partition
from gpp_deepspeed.planner import Plan, PlanStage
from gpp_deepspeed.spec import layer_graph


def lin(name, *inputs, d=4):
    return GraphLayerSpec(name, nn.Linear, d, d, inputs=list(inputs))


GOOD = [lin("a", "x"), lin("b", "a"), lin("c", "b")]


def my_checkpoint(function, *args):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**6}

CASES = {
    "cycle": lambda: GraphPipelineModule([lin("a", "x", "c"), lin("b", "a"), lin("c", "b"), lin("out", "c")],
                                         input_names=["x"], num_stages=2),
    "unknown_input": lambda: GraphPipelineModule([lin("a", "x"), lin("b", "nope")], input_names=["x"], num_stages=2),
    "duplicate_name": lambda: GraphPipelineModule([lin("a", "x"), lin("a", "x"), lin("c", "a")], input_names=["x"],
                                                  num_stages=2),
    "dangling_layer": lambda: GraphPipelineModule([lin("a", "x"), lin("lost", "x"), lin("c", "a")],
                                                  input_names=["x"], num_stages=2),
    "mapping_misses_layer": lambda: GraphPipelineModule(GOOD, input_names=["x"], num_stages=2,
                                                        partition_method={"a": 0, "b": 1}),
    "mapping_stage_cycle": lambda: GraphPipelineModule(GOOD, input_names=["x"], num_stages=2,
                                                       partition_method={"a": 0, "b": 1, "c": 0}),
    "more_stages_than_layers": lambda: GraphPipelineModule(GOOD[:1], input_names=["x"], num_stages=2),
    "world_size_not_divisible": lambda: GraphPipelineModule(GOOD, input_names=["x"], num_stages=3),
    "unknown_partition_method": lambda: GraphPipelineModule(GOOD, input_names=["x"], num_stages=2,
                                                            partition_method="balanced"),
    "plan_wrong_stage_count": lambda: GraphPipelineModule(GOOD, input_names=["x"], num_stages=2, partition_method=Plan(
        model="good", method="manual", source="test", micro_batch=1, mini_batch=1,
        stages=(PlanStage(layers=("a",)), PlanStage(layers=("b",)), PlanStage(layers=("c",))))),
    "plan_file_missing": lambda: GraphPipelineModule(GOOD, input_names=["x"], num_stages=2,
                                                     partition_method="no/such/plan.json"),
    "resolved_for_another_model": lambda: GraphPipelineModule(GOOD, input_names=["x"], partition_method=resolve_partition(
        layer_graph(GOOD[:2], input_names=["x"]), BranchBalanced(weight="layers"), num_stages=2)),
    "degrees_do_not_divide_world": lambda: GraphPipelineModule(GOOD, input_names=["x"], stage_degrees=[2, 1]),
    "plan_wrong_world_size": lambda: GraphPipelineModule(GOOD, input_names=["x"], partition_method=Plan(
        model="good", method="graphpipe", source="test", micro_batch=2, mini_batch=4,
        stages=(PlanStage(layers=("a", "b")), PlanStage(layers=("c",), devices=2)))),
    "micro_batch_not_divisible_by_degree": lambda: gpp_deepspeed.initialize(
        model=GraphPipelineModule(GOOD, input_names=["x"], stage_degrees=[2], loss_fn=nn.MSELoss()),
        model_parameters=None, config={**CONFIG, "train_micro_batch_size_per_gpu": 3}),
    "unknown_config_key": lambda: gpp_deepspeed.initialize(
        model=GraphPipelineModule(GOOD, input_names=["x"], num_stages=2, loss_fn=nn.MSELoss()),
        model_parameters=None, config={**CONFIG, "graph_pipeline": {"scheduel": "1f1b"}}),
    # zb1 recomputes with torch's non-reentrant checkpoint: asking for a reentrant one, or one's own, is refused
    "split_schedule_with_reentrant_checkpointing": lambda: gpp_deepspeed.initialize(
        model=GraphPipelineModule(GOOD, input_names=["x"], num_stages=2, loss_fn=nn.MSELoss(),
                                  activation_checkpoint_interval=1),
        model_parameters=None, config={**CONFIG, "pipeline": {"use_reentrant": True},
                                       "graph_pipeline": {"schedule": "zb1"}}),
    "split_schedule_with_own_checkpoint_function": lambda: gpp_deepspeed.initialize(
        model=GraphPipelineModule(GOOD, input_names=["x"], num_stages=2, loss_fn=nn.MSELoss(),
                                  activation_checkpoint_interval=1, activation_checkpoint_func=my_checkpoint),
        model_parameters=None, config={**CONFIG, "graph_pipeline": {"schedule": "zb2"}}),
    # DeepSpeed clips by global norm (1.0) unless told otherwise: per-micro-batch updates cannot.
    "async_with_clipping": lambda: gpp_deepspeed.initialize(
        model=GraphPipelineModule(GOOD, input_names=["x"], num_stages=2, loss_fn=nn.MSELoss()),
        model_parameters=None, config={**CONFIG, "graph_pipeline": {"schedule": "pipedream"}}),
    # ZeRO-1 steps with the pipeline's norm: fine for 2bw's once-per-batch step, not per micro-batch.
    "async_with_zero": lambda: gpp_deepspeed.initialize(
        model=(m := GraphPipelineModule(GOOD, input_names=["x"], num_stages=2, loss_fn=nn.MSELoss())),
        optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
        config={**CONFIG, "gradient_clipping": 0.0, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
                "graph_pipeline": {"schedule": "pipedream"}}),
    # 2BW's retired gradients reach the optimizer outside a backward, where ZeRO-2's hooks never look.
    "2bw_with_zero2": lambda: gpp_deepspeed.initialize(
        model=(m := GraphPipelineModule(GOOD, input_names=["x"], num_stages=2, loss_fn=nn.MSELoss())),
        optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
        config={**CONFIG, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
                "graph_pipeline": {"schedule": "2bw"}}),
    # ZeRO-3 frees a layer's parameters after I; the split backward's W would need them.
    "zero3_with_split_backward": lambda: gpp_deepspeed.initialize(
        model=(m := GraphPipelineModule(GOOD, input_names=["x"], num_stages=2, loss_fn=nn.MSELoss())),
        optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
        config={**CONFIG, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
                "graph_pipeline": {"schedule": "zb1"}}),
    # The authors' PipeOptim restores the live weights after the forward: a recomputation would not see the prediction.
    "pipeoptim_inplace_with_recomputation": lambda: gpp_deepspeed.initialize(
        model=(m := GraphPipelineModule(GOOD, input_names=["x"], num_stages=2, loss_fn=nn.MSELoss(),
                                        activation_checkpoint_interval=1)),
        optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
        config={**CONFIG, "gradient_clipping": 0.0, "graph_pipeline": {"schedule": "pipeoptim-inplace"}}),
    "pipeoptim_with_weight_decay": lambda: gpp_deepspeed.initialize(
        model=(m := GraphPipelineModule(GOOD, input_names=["x"], num_stages=2, loss_fn=nn.MSELoss())),
        optimizer=torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4),
        config={**CONFIG, "gradient_clipping": 0.0, "graph_pipeline": {"schedule": "pipeoptim"}}),
}


def wrong_batch():
    module = GraphPipelineModule(GOOD, input_names=["x"], num_stages=2, loss_fn=nn.MSELoss())
    engine, *_ = gpp_deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                                          config=CONFIG)
    batch = ((torch.zeros(2, 4), torch.zeros(2, 4)), torch.zeros(2, 4))  # two inputs for a one-input graph
    engine.train_batch(iter([batch] * 2))


CASES["wrong_number_of_inputs"] = wrong_batch


def eval_too_few_micro_batches():
    """eval_batch reads gradient_accumulation_steps micro-batches unless told num_micro_batches=."""
    module = GraphPipelineModule(GOOD, input_names=["x"], num_stages=2, loss_fn=nn.MSELoss())
    engine, *_ = gpp_deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                                          config={**CONFIG, "gradient_accumulation_steps": 2, "train_batch_size": 4})
    engine.eval_batch(iter([(torch.zeros(2, 4), torch.zeros(2, 4))]))


CASES["eval_too_few_micro_batches"] = eval_too_few_micro_batches


def zero3_checkpoint():
    """ZeRO-3 trains under 1f1b, but its per-layer checkpoint files would hold partitions: refused."""
    module = GraphPipelineModule(GOOD, input_names=["x"], num_stages=2, loss_fn=nn.MSELoss())
    engine, *_ = gpp_deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                                          config={**CONFIG, "zero_optimization": {"stage": 3},
                                                  "zero_allow_untested_optimizer": True})
    with tempfile.TemporaryDirectory() as folder:
        engine.save_checkpoint(folder)


CASES["zero3_checkpoint"] = zero3_checkpoint


def dead_peer():
    """Stage 0 never runs its schedule: stage 1 must give up after p2p_timeout_s, not wait forever."""
    module = GraphPipelineModule(GOOD, input_names=["x"], num_stages=2, loss_fn=nn.MSELoss())
    engine, *_ = gpp_deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                                          config={**CONFIG, "graph_pipeline": {"p2p_timeout_s": 2}})
    if engine.stage_id == 0:
        time.sleep(6)  # alive but silent for longer than the timeout
        raise ValueError("stage 0 stands for a rank that failed before its first send")
    engine.train_batch(iter([(torch.zeros(2, 4), torch.zeros(2, 4))] * 2))


CASES["dead_peer"] = dead_peer


def main(cases=None):
    """Run every case of ``cases`` (default: this file's) and write what each raised, per rank."""
    out = Path(sys.argv[1])
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    errors = {}
    for name, make in (CASES if cases is None else cases).items():
        try:
            make()
            errors[name] = [None, "no error"]
        except Exception as exc:  # noqa: BLE001 - recording exactly what the user would see
            errors[name] = [type(exc).__name__, str(exc), isinstance(exc, ValueError)]
    (out / f"errors.rank{rank}.json").write_text(json.dumps(errors, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
