"""Worker: tensor parallelism inside stages, on gloo ranks (``tests/test_tensor_parallel.py``).

``python tp_cases.py CASES.json OUT_DIR`` on every rank (``tests/dist.py``). Two kinds of case:

``dag``
    a 3-stage DAG of :mod:`tp_layers` (stage TP x DP = 2x1, 1x2, 2x1 on 6 ranks) on our engine;
    each rank saves its losses and its layers' parameters whole (gathered over its TP group),
    which the test compares with the single-device model.
``3d``
    DeepSpeed's ``PipeModelDataParallelTopology(2, 2, 2)`` chain, trained by DeepSpeed's own
    ``PipelineEngine`` and by ours (same layers, same data), then a fresh DeepSpeed engine loads
    the checkpoint ours saved; each rank saves losses and ``module.state_dict()`` of all three.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

import deepspeed
import gpp_deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from gpp_deepspeed import GraphLayerSpec, GraphPipelineModule
from gpp_deepspeed.graph.placement import Placement
import strict_p2p
import tp_layers
from tp_layers import TPMLP, Add, Dense

D, F = 8, 16
DAG_STAGES = {"a": 0, "b": 1, "add": 2, "c": 2}


def batches(seed: int, *, gas: int, mbs: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(mbs, D, generator=g), torch.randn(mbs, D, generator=g)) for _ in range(gas)]


def dag_layers(tp: dict[str, int], tp_rank: dict[str, int]):
    """The DAG: ``a`` (TP MLP) feeds ``b`` (dense) and, skipping it, ``add``; ``c`` (TP MLP) reads the sum."""
    return [GraphLayerSpec("a", TPMLP, D, F, seed=1, tp=tp["a"], tp_rank=tp_rank["a"], inputs=["x"]),
            GraphLayerSpec("b", Dense, D, seed=2, inputs=["a"]),
            GraphLayerSpec("add", Add, inputs=["a", "b"]),
            GraphLayerSpec("c", TPMLP, D, F, seed=3, tp=tp["c"], tp_rank=tp_rank["c"], inputs=["add"])]


def config(case, dp: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": case["mbs"], "gradient_accumulation_steps": case["gas"],
           "train_batch_size": case["mbs"] * case["gas"] * dp, "zero_optimization": {"stage": case.get("zero", 0)},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**6,
           "gradient_clipping": case.get("clip", 0.0)}
    if "schedule" in case:
        cfg["graph_pipeline"] = {"schedule": case["schedule"], "print_stage_graph": False}
    return cfg


def train(engine, case, replica: int) -> list[float]:
    return [engine.train_batch(data_iter=iter(batches(100 * step + replica, gas=case["gas"], mbs=case["mbs"]))).item()
            for step in range(case["steps"])]


def run_dag(case, rank, world):
    placement = Placement.build(case["degrees"], world_size=world, tp=case["tp"])
    place = placement.locate(rank)
    tp = {n: case["tp"][s] for n, s in DAG_STAGES.items()}
    tp_rank = {n: place.tp_idx if s == place.stage else 0 for n, s in DAG_STAGES.items()}
    module = GraphPipelineModule(dag_layers(tp, tp_rank), input_names=["x"], loss_fn=nn.MSELoss(),
                                 partition_method=DAG_STAGES, stage_degrees=case["degrees"], stage_tp=case["tp"])
    grid = module.mpu()
    assert (grid.get_slice_parallel_rank(), grid.stage_idx) == (place.tp_idx, place.dp_idx)
    tp_layers.bind(grid)
    opt = torch.optim.SGD(module.parameters(), lr=case["lr"])
    engine, _, _, _ = gpp_deepspeed.initialize(model=module, optimizer=opt, config=config(case, placement.replicas))
    tp_layers.label_passes(engine.stage_backward)
    losses = train(engine, case, engine.grid.replica_id)
    ran = sorted({op.kind.value for a, _, _ in engine.last_timeline for op in a.parts})   # the last training batch
    eval_loss = engine.eval_batch(iter(batches(999, gas=case["gas"], mbs=case["mbs"]))).item()
    params = {}
    with engine.gathered_parameters():
        for entry, layer in zip(module._local_entries, module.forward_funcs):
            for k, v in tp_layers.full_parameters(layer, tp=grid.get_slice_parallel_world_size(),
                                                  group=grid.get_slice_parallel_group()).items():
                params[f"{entry.name}.{k}"] = v
    allreduces = sorted(set(tp_layers.BACKWARD_ALLREDUCES))
    tp_layers.BACKWARD_ALLREDUCES.clear()
    return {"losses": losses, "eval": eval_loss, "allreduce_passes": allreduces, "stage": place.stage, "params": params,
            "ran": ran}


def chain_layers(topo, rank):
    """Four TP MLPs, the first and the last one tied (a copy on each stage, as GPT's embedding)."""
    mp = topo.get_coord(rank).model
    tied = [TiedLayerSpec("mlp", TPMLP, D, F, seed=10, tp=2, tp_rank=mp, tied_weight_attr=["w1", "b1", "w2", "b2"])]
    return tied + [LayerSpec(TPMLP, D, F, seed=10 + i, tp=2, tp_rank=mp) for i in (1, 2)] + tied


def run_3d(case, rank, world, out):
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    coord = topo.get_coord(rank)
    result = {}

    def state(module):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    # 1. DeepSpeed's own PipelineEngine.
    ds_module = PipelineModule(chain_layers(topo, rank), topology=topo, loss_fn=nn.MSELoss(), partition_method="uniform")
    tp_layers.bind(ds_module.mpu())
    opt = torch.optim.SGD(ds_module.parameters(), lr=case["lr"])
    engine, _, _, _ = deepspeed.initialize(model=ds_module, optimizer=opt, config=config(case, 2))
    result["ds_losses"], result["ds_state"] = train(engine, case, coord.data), state(ds_module)
    result["ds_partitioned"] = (engine.is_pipe_partitioned, engine.is_grad_partitioned)
    ds_ckpt = str(out / "ckpt_3d_ds")
    engine.save_checkpoint(ds_ckpt, tag="t")
    # 2. Ours, as a drop-in: the same topology, and mpu= the grid (as Megatron-DeepSpeed passes it).
    module = GraphPipelineModule(chain_layers(topo, rank), topology=topo, loss_fn=nn.MSELoss(),
                                 partition_method="uniform")
    grid = module.mpu()
    assert (grid.get_stage_id(), grid.get_data_parallel_rank(), grid.get_slice_parallel_rank()) == (
        coord.pipe, coord.data, coord.model), "our grid places every rank where DeepSpeed's does"
    result["groups"] = {"dp": list(grid.get_data_parallel_group_ranks()), "slice": list(grid.slice_group),
                        "ds_dp": list(ds_module.mpu().get_data_parallel_group_ranks()),
                        "ds_slice": list(ds_module.mpu().slice_group)}
    tp_layers.bind(grid)
    opt = torch.optim.SGD(module.parameters(), lr=case["lr"])
    engine, _, _, _ = gpp_deepspeed.initialize(model=module, optimizer=opt, config=config(case, 2), mpu=grid)
    result["losses"], result["state"] = train(engine, case, coord.data), state(module)
    ckpt = str(out / "ckpt_3d")
    engine.save_checkpoint(ckpt, tag="t")
    torch.distributed.barrier()
    result["files"] = sorted(os.listdir(os.path.join(ckpt, "t")))
    # 3. A fresh DeepSpeed engine loads the checkpoint ours wrote.
    ds_module = PipelineModule(chain_layers(topo, rank), topology=topo, loss_fn=nn.MSELoss(), partition_method="uniform")
    tp_layers.bind(ds_module.mpu())
    opt = torch.optim.SGD(ds_module.parameters(), lr=case["lr"])
    engine, _, _, _ = deepspeed.initialize(model=ds_module, optimizer=opt, config=config(case, 2))
    engine.load_checkpoint(ckpt, tag="t")
    result["ds_loaded_state"] = state(ds_module)
    # 4. The reverse: a fresh engine of ours loads the checkpoint DeepSpeed wrote.
    module = GraphPipelineModule(chain_layers(topo, rank), topology=topo, loss_fn=nn.MSELoss(),
                                 partition_method="uniform")
    tp_layers.bind(module.mpu())
    opt = torch.optim.SGD(module.parameters(), lr=case["lr"])
    engine, _, _, _ = gpp_deepspeed.initialize(model=module, optimizer=opt, config=config(case, 2))
    engine.load_checkpoint(ds_ckpt, tag="t")
    result["loaded_ds_state"] = state(module)
    return result


def main():
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    if os.environ.get("GPP_STRICT_P2P") == "1":
        strict_p2p.install()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for case in cases:
        result = run_3d(case, rank, world, out) if case["kind"] == "3d" else run_dag(case, rank, world)
        result["strict_p2p"] = strict_p2p.stats()
        torch.save(result, out / f"{case['id']}.rank{rank}.pt")
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
