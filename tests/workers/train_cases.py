"""Worker: train each case of a JSON case list on this rank and save what the test compares.

Run by ``tests/dist.py`` on every rank: ``python train_cases.py CASES.json OUT_DIR``. For each case
it writes ``OUT_DIR/<id>.rank<r>.pt`` with the per-step losses, the eval loss and this stage's
parameters (named as in GraphModel).
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

import deepspeed
import gpp_deepspeed
from deepspeed.pipe import PipelineModule
from gpp_deepspeed import GraphPipelineModule
from gpp_deepspeed.partitioning import parse_partition_method, resolve_partition
from gpp_deepspeed.spec import layer_graph
from models import MODELS, ReplicaOrderedDataset, make_batches
import strict_p2p


def ds_config(case, dp):
    cfg = {
        "train_micro_batch_size_per_gpu": case["mbs"],
        "gradient_accumulation_steps": case["gas"],
        "train_batch_size": case["mbs"] * case["gas"] * dp,
        "zero_optimization": {"stage": case["zero"], **case.get("zero_extra", {})},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": case.get("steps_per_print", 10**6),
        # No "schedule" in the case: the engine's default, or the schedule of the case's plan file.
        "graph_pipeline": {"print_stage_graph": False, **({"schedule": case["schedule"]} if "schedule" in case else {}),
                           **{k: case[k] for k in ("stages_per_rank", "fold", "early_receives", "stage_times",
                                                    "max_in_flight", "gc_interval", "gc_freeze", "activation_meter_steps")
                              if k in case}},
        **{k: case[k] for k in ("disable_python_gc", ) if k in case},
    }
    if case.get("wall_clock"):
        cfg["wall_clock_breakdown"] = True
    if case.get("trace_dir"):
        cfg["graph_pipeline"]["trace_dir"] = case["trace_dir"]
    if case.get("optimizer") == "adam":
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": case["lr"], "torch_adam": True, "adam_w_mode": False}}
    elif case.get("optimizer") == "fused_adam":  # DeepSpeed's own Adam (FusedAdam), its default
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": case["lr"], "adam_w_mode": False}}
    if case.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    if case.get("fp16"):   # a dynamic loss scale that moves within a few steps (doubles every 2)
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}
    # DeepSpeed 0.19.8 clips at 1.0 unless told otherwise; the reference applies the same.
    cfg["gradient_clipping"] = case.get("clip", 1.0)
    return cfg


def to_model_dtype(batches, case):
    """bf16 (fp16, float64) models take bf16 (fp16, float64) inputs; as with DeepSpeed's
    PipelineEngine, casting is the user's job."""
    dtype = (torch.bfloat16 if case.get("bf16") else torch.float16 if case.get("fp16") else
             torch.float64 if case.get("float64") else None)
    if dtype is None:
        return batches
    cast = lambda x: tuple(t.to(dtype) for t in x) if isinstance(x, tuple) else x.to(dtype)  # noqa: E731
    return [(cast(x), y) for x, y in batches]


def build(case, world_size):
    mc = MODELS[case["model"]]()
    degrees = case.get("degrees")
    dp = world_size // pipeline_ranks(case)  # replicas of the stage DAG
    if case.get("deepspeed_module"):
        module = PipelineModule(mc.layers, num_stages=case["stages"], loss_fn=nn.CrossEntropyLoss(),
                                partition_method="uniform", seed_layers=True)
    else:
        method = case["partition"]
        if method == "explicit":
            method = mc.partitions[case["stages"]]
        if isinstance(method, str) and method.endswith(".json"):  # a plan file, relative to tests/
            method = str(Path(__file__).resolve().parents[1] / method)
        if isinstance(method, str) and method.startswith("resolved:"):
            # Resolved ahead of time, outside the module, as a user may: the stage degrees come to the
            # module through the resolved partition alone.
            method = resolve_partition(layer_graph(mc.layers, input_names=mc.input_names),
                                       parse_partition_method(method.split(":", 1)[1]), num_stages=case["stages"],
                                       stage_degrees=degrees)
            degrees = None
        module = GraphPipelineModule(mc.layers, input_names=mc.input_names, num_stages=case["stages"],
                                     loss_fn=nn.CrossEntropyLoss(), partition_method=method,
                                     activation_checkpoint_interval=case.get("ckpt_interval", 0),
                                     dynamic_shape=bool(mc.seq_lens), stage_degrees=degrees,
                                     stages_per_rank=case.get("stages_per_rank", 1), fold=case.get("fold"))
    params = [p for p in module.parameters() if p.requires_grad]
    # A stage with nothing to train (a frozen tower) still gets an optimizer, with one empty group:
    # torch refuses an empty parameter list, and DeepSpeed steps every stage.
    opt = None if case.get("optimizer") in ("adam", "fused_adam") else torch.optim.SGD(
        params or [{"params": []}], lr=case["lr"], momentum=case.get("momentum", 0.9))
    # "lr_decay": the learning rate of step t is lr * lr_decay**t (torch's StepLR, stepped by DeepSpeed).
    sched = (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=case["lr_decay"])) \
        if "lr_decay" in case else None
    if case.get("float64"):   # the whole model in float64, as a user casts it before initialize
        module.double()
    init = deepspeed.initialize if case.get("deepspeed_module") else gpp_deepspeed.initialize
    data = None
    if case.get("training_data"):  # DeepSpeed's own loader instead of data_iter=
        data = ReplicaOrderedDataset(mc, dp=dp, steps=case["steps"], micro_batches=case["gas"],
                                     micro_batch_size=case["mbs"])
    engine, _, _, _ = init(model=module, optimizer=opt, model_parameters=params, config=ds_config(case, dp),
                           training_data=data, lr_scheduler=sched)
    engine.case_seen = []
    if data is not None and engine.data_iterator is not None:
        engine.data_iterator = _recording(engine.data_iterator, engine.case_seen)
    return mc, module, engine


def pipeline_ranks(case) -> int:
    """Ranks of one copy of the stage DAG: the degrees' sum (one per rank of each pipeline position
    under a fold), else one per stage, or per ``stages_per_rank`` stages."""
    degrees, fold = case.get("degrees"), case.get("fold")
    if fold is not None and not isinstance(fold, str):
        positions = {}
        for s, r in enumerate(fold):
            positions[r] = degrees[s] if degrees else 1
        return sum(positions.values())
    per_rank = 2 if fold == "v" else case.get("stages_per_rank", 1)
    return (sum(degrees) if degrees else case["stages"]) // per_rank


def replica(engine):
    """Which copy of the stage DAG this rank is in: the micro-batches it is fed."""
    return getattr(engine.grid, "replica_id", engine.grid.data_parallel_id)


def _recording(batches, seen):
    """``batches``, keeping a copy of every (inputs, labels) this rank reads."""
    for x, y in batches:
        seen.append(([t.clone() for t in x] if isinstance(x, (tuple, list)) else [x.clone()], y.clone()))
        yield x, y


def train(engine, mc, case, steps):
    if case.get("gc_interval") and not hasattr(engine, "case_gc"):
        return _train_watching_gc(engine, mc, case, steps)
    if case.get("no_program_after_init"):   # initialize made the training programs: the steps build none
        from gpp_deepspeed.schedule import program as programs

        build = programs.build_program

        def refused(*args, **kwargs):
            raise AssertionError("a training step built a program, which initialize should have made")
        programs.build_program = refused
        try:
            return train(engine, mc, {k: v for k, v in case.items() if k != "no_program_after_init"}, steps)
        finally:
            programs.build_program = build
    dp_rank = replica(engine)
    losses = []
    for step in steps:
        if case.get("training_data"):
            losses.append(engine.train_batch().item())
            continue
        batches = make_batches(mc, step=step, dp_rank=dp_rank, micro_batches=case["gas"], micro_batch_size=case["mbs"])
        loss = engine.train_batch(data_iter=iter(to_model_dtype(batches, case)))
        engine.case_loss_dtype = str(loss.dtype)
        losses.append(loss.item())
        meter = getattr(engine.module, "activations", None)
        if meter is not None:   # the activation meter after each step: (peak bytes, steps measured)
            engine.case_meter = [*getattr(engine, "case_meter", []), (meter.peak, meter.steps)]
    return losses


def _train_watching_gc(engine, mc, case, steps):
    """``train``, recording for every step the cyclic collections the interpreter started by itself
    and those the engine asked for (DeepSpeed's ``collect_python_gc``), in ``engine.case_gc``;
    afterwards the automatic collector is on again for the launch's next cases."""
    import gc

    engine.case_gc = {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(), "steps": []}
    asked, counts = [False], {"automatic": 0, "asked": 0}
    collect = engine.collect_python_gc

    def asking():
        asked[0] = True
        try:
            return collect()
        finally:
            asked[0] = False

    def seen(phase, info):
        if phase == "start":
            counts["asked" if asked[0] else "automatic"] += 1

    engine.collect_python_gc = asking
    gc.callbacks.append(seen)
    losses = []
    try:
        for step in steps:
            counts.update(automatic=0, asked=0)
            losses += train(engine, mc, case, [step])
            engine.case_gc["steps"].append(dict(counts))
    finally:
        gc.callbacks.remove(seen)
        gc.enable()
    return losses


def run_case(case, out, rank, world_size):
    if case.get("trace"):
        case = {**case, "trace_dir": str(out / f"trace_{case['id']}")}
    mc, module, engine = build(case, world_size)
    result = {"stage": engine.stage_id, "dp": replica(engine), "shard": getattr(engine.grid, "stage_idx", 0),
              "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad),
              "schedule": getattr(engine, "gpp_config", None) and engine.gpp_config.schedule,
              "ckpt_interval": module.activation_checkpoint_interval,
              "ckpt_func": getattr(module.activation_checkpoint_func, "__name__", None),
              # the optimizer DeepSpeed built, and whether it partitions gradients (ZeRO-2)
              "optimizer": type(engine.optimizer).__name__,
              "partitions_grads": bool(getattr(engine.optimizer, "partition_gradients", False))}
    if hasattr(engine, "stage_graph"):
        result["depth"] = engine.stage_graph.depth(engine.stage_id)
        result["frozen"] = engine.stage_id in engine.stage_graph.frozen
        result["reads_batch"] = engine.is_first_stage() or engine.is_last_stage()
    if case.get("checkpoint"):
        ckpt = str(out / f"ckpt_{case['id']}")
        result["trained"] = train(engine, mc, case, range(2))
        engine.save_checkpoint(ckpt, tag="t2")
        result["state_before"] = sorted(module.graph_state_dict())
        # "resume_as": the keys of the case that change when it resumes (another layout).
        after = {**case, **case.get("resume_as", {})}
        if "resume_as" not in case:
            result["uninterrupted"] = train(engine, mc, case, range(2, 4))
        mc, module, engine = build(after, world_size)
        engine.load_checkpoint(ckpt, tag="t2")
        result["resumed"] = train(engine, mc, after, range(2, 4))
        result["resumed_stage"], result["state_after"] = engine.stage_id, sorted(module.graph_state_dict())
        if hasattr(engine, "stage_graph"):
            result["resumed_depth"] = engine.stage_graph.depth(engine.stage_id)
    else:
        result["losses"] = train(engine, mc, case, range(case["steps"]))
        # What this rank ran in its last training batch (the program's list for its stage).
        result["actions"] = [str(a) for a, _, _ in getattr(engine, "last_timeline", ())]
        result["ran"] = sorted({op.kind.value for a, _, _ in getattr(engine, "last_timeline", ()) for op in a.parts})
        it = iter(to_model_dtype(make_batches(mc, step=100, dp_rank=replica(engine),
                                              micro_batches=case["gas"], micro_batch_size=case["mbs"]), case))
        loss, logits = engine.eval_batch(it, return_logits=True)
        result["eval"] = loss.item()
        result["eval_dtype"] = str(loss.dtype)
        result["loss_dtype"] = getattr(engine, "case_loss_dtype", None)
        result["logits"] = logits.detach().float().clone() if torch.is_tensor(logits) else None
        if case.get("training_data"):
            result["seen"] = engine.case_seen
        if isinstance(module, GraphPipelineModule):
            with engine.gathered_parameters():   # ZeRO-3 partitions them
                result["state"] = {k: v.detach().float().clone() for k, v in module.graph_state_dict().items()}
            result["ties"], result["rank_stages"] = tie_users(module), list(module.stages)
    if hasattr(engine, "case_gc"):
        result["gc"] = engine.case_gc
    if hasattr(engine, "case_meter"):
        result["meter"] = engine.case_meter
    if case.get("fp16"):
        result["loss_scale"] = float(engine.optimizer.loss_scale)
    if hasattr(engine, "weight_version_memory"):
        result["weight_versions"] = engine.weight_version_memory()
    result["strict_p2p"] = strict_p2p.stats()
    torch.save(result, out / f"{case['id']}.rank{rank}.pt")


def tie_users(module) -> dict:
    """For each tied key this rank holds: which of its stages use the tie's weights and how many
    parameters the tie has here (a rank holding two stages of one tie builds it once, so both use
    the same parameters)."""
    out = {}
    for key, tied in module.tied_modules.items():
        own = {id(p) for p in tied.parameters()}
        out[key] = {"stages": [s for s in module.stages if own & {id(p) for p in module.stage_parameters(s)}],
                    "params": len(own), "in_module": sum(id(p) in own for p in module.parameters())}
    return out


def allow_fp16_on_this_cpu() -> None:
    """DeepSpeed asks its CPU accelerator whether fp16 is supported, which answers with oneDNN's
    fp16 support (absent on this machine's CPU); torch computes fp16 on any CPU, and DeepSpeed's
    fp16 optimizer and loss scaler are device-independent Python. The fp16 cases run them for real
    with the answer set to yes (nothing else is replaced)."""
    from deepspeed.accelerator import get_accelerator
    get_accelerator().is_fp16_supported = lambda: True


def main():
    cases = json.loads(Path(sys.argv[1]).read_text())
    if any(case.get("fp16") for case in cases):
        allow_fp16_on_this_cpu()
    out = Path(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    if os.environ.get("GPP_STRICT_P2P") == "1":   # tests/strict_p2p.py: stops wherever NCCL could
        strict_p2p.install()
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for case in cases:
        run_case(case, out, rank, world_size)
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
