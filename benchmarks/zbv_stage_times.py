"""Before and after zbv ran the order made for the stages' times: zbv on peers.py's four branches, on the fold
the search picks, built with ``graph_pipeline.stage_times`` and without (unit times, the order the
engine ran before), torch's ZBV beside, one launch of 8 gloo ranks, medians of rounds 3..8.

    python benchmarks/zbv_stage_times.py
"""
import sys, time, json, os, statistics
from pathlib import Path
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks")); sys.path.insert(0, str(ROOT / "tests"))
import peers
TOPO = "four_branches"
OUT = ROOT / "benchmarks" / "results" / "tmp" / "zbv_stage_times.json"

def worker(out):
    import torch, deepspeed
    from torch import nn
    import gpp_deepspeed
    from gpp_deepspeed import GraphLayerSpec, GraphPipelineModule
    deepspeed.init_distributed(dist_backend="gloo")
    unit = peers.sleep_unit_class()
    gen = torch.Generator().manual_seed(0)
    sample = lambda: torch.randn(peers.MBS, peers.DIM, generator=gen)
    dag = [(tuple(sample() for _ in range(4)), sample()) for _ in range(peers.M)]
    chain = [(torch.cat(x, dim=1), y) for x, y in dag]
    batch = (torch.cat([x for x, _ in chain]), torch.cat([y for _, y in chain]))
    rows = peers.half_layer_rows(TOPO)
    choice = peers.searched_fold(TOPO, "zbv")
    fold = list(choice.fold.rank_of)
    caps = {"max_in_flight": list(choice.max_in_flight)} if choice.max_in_flight else {}
    configs = {}
    for label, times in (("zbv, stage times", {"stage_times": peers.stage_times(TOPO, len(rows), True)}), ("zbv, unit times (before)", {})):
        layers = [GraphLayerSpec(r["name"], unit, peers.DIM, 4, r["branch"], r["merge"], 0.5, r["source"], False, inputs=r["inputs"]) for r in rows]
        module = GraphPipelineModule(layers, input_names=[f"x{b}" for b in range(4)], num_stages=len(rows), loss_fn=nn.MSELoss(),
                                     partition_method={r["name"]: i for i, r in enumerate(rows)}, fold=fold)
        cfg = peers._ds_config() | {"graph_pipeline": {"schedule": "zbv", "print_stage_graph": False, "print_idle_fractions": False, **times, **caps}}
        engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
        configs[label] = lambda engine=engine: engine.train_batch(data_iter=iter(dag))
    configs["torch ZBVZeroBubble"] = peers.build_torch(TOPO, "ZBVZeroBubble", unit, batch)[0]
    res = {k: [] for k in configs}
    for r in range(8):
        for k, step in configs.items():
            torch.distributed.barrier(); t0 = time.perf_counter(); step(); torch.distributed.barrier()
            res[k].append(time.perf_counter() - t0)
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(res))

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        from dist import launch
        OUT.parent.mkdir(parents=True, exist_ok=True)
        print("load", os.getloadavg()[0])
        launch(8, Path(__file__), "--worker", str(OUT), timeout=1200, log_dir=OUT.parent / "logs" / "zbv_stage_times")
        print("load", os.getloadavg()[0])
        for k, v in json.load(open(str(OUT))).items():
            print(f"{k:28s} median of rounds 3..8 {statistics.median(v[2:])*1e3:7.1f} ms  rounds " + " ".join(f"{x*1e3:.0f}" for x in v))
