"""Checkpoint save time, blocking and in the background (issue 31, point 3), on real processes.

A DAG of ``LAYERS`` square linear layers (two branches and a head; ``DIM`` wide, about 150 M
parameters, Adam: a 1.8 GB checkpoint) trains on 2 gloo ranks (2 stages). Each run times training
steps, then ``save_checkpoint`` and the steps right after it, and the moment ``latest`` names the new
checkpoint (written files, then the commit): once blocking, once with
``graph_pipeline.checkpoint_in_background``. The 1.5 B benchmark model (``large_models.py``) would
need 18 GB of fp32 weights and Adam state plus a snapshot of them on this 24 GB, 2-core machine,
so this model stands in for it.

    python benchmarks/checkpoint_save.py     # writes benchmarks/results/checkpoint_save.json + .md
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DIM, LAYERS, STEPS = 2048, 36, 3


def worker(out: Path, background: bool) -> None:
    import deepspeed
    import torch
    from torch import nn
    import gpp_deepspeed
    from gpp_deepspeed import GraphLayerSpec, GraphPipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    half = LAYERS // 2
    layers = []
    for b in range(2):
        layers += [GraphLayerSpec(f"b{b}_{i}", nn.Linear, DIM, DIM, inputs=["x" if i == 0 else f"b{b}_{i - 1}"])
                   for i in range(half)]
    layers.append(GraphLayerSpec("head", nn.Bilinear, DIM, DIM, 4, inputs=[f"b0_{half - 1}", f"b1_{half - 1}"]))
    module = GraphPipelineModule(layers, input_names=["x"], num_stages=2, loss_fn=nn.CrossEntropyLoss(),
                                 partition_method={**{f"b0_{i}": 0 for i in range(half)},
                                                   **{f"b1_{i}": 1 for i in range(half)}, "head": 1})
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
              "graph_pipeline": {"print_stage_graph": False, "print_memory": False,
                                 "checkpoint_in_background": background}}
    engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=config)

    def step():
        batches = iter([(torch.randn(4, DIM), torch.randint(0, 4, (4, ))) for _ in range(2)])
        start = time.perf_counter()
        engine.train_batch(data_iter=batches)
        return time.perf_counter() - start

    before = [step() for _ in range(STEPS)]
    ckpt = out / "ckpt"
    torch.distributed.barrier()
    start = time.perf_counter()
    engine.save_checkpoint(str(ckpt), tag="t1")
    blocked = time.perf_counter() - start
    during = []
    while not (ckpt / "latest").exists() and len(during) < 50:
        during.append(step())
    committed = time.perf_counter() - start
    while not (ckpt / "latest").exists():
        time.sleep(0.05)
    committed = max(committed, time.perf_counter() - start) if not during else committed
    size = sum(f.stat().st_size for f in (ckpt / "t1").rglob("*") if f.is_file())
    if rank == 0:
        print(json.dumps({"background": background, "step_s": min(before), "save_call_s": blocked,
                          "until_latest_s": committed, "steps_while_writing": len(during),
                          "step_while_writing_s": max(during) if during else None,
                          "checkpoint_gb": size / 1e9}), flush=True)
    torch.distributed.barrier()


def main() -> None:
    rows = []
    for background in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(29500 + int(background) + os.getpid() % 1000), LOCAL_RANK="0",
                       PYTHONPATH=str(ROOT))
            procs = [subprocess.Popen([sys.executable, __file__, "--worker", tmp, str(int(background))],
                                      env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                                      text=True) for r in range(2)]
            outs = [p.communicate(timeout=1200)[0] for p in procs]
            rows += [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]
    (RESULTS / "checkpoint_save.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / "checkpoint_save.md").write_text(section(rows))
    print(section(rows))


def section(rows: list[dict]) -> str:
    lines = ["## Checkpoint save: blocking and in the background (measured)", "",
             f"A DAG of {LAYERS} `Linear({DIM}, {DIM})` in two branches and a bilinear head (about 168 M parameters, "
             "Adam) on 2 gloo ranks (2 stages), `benchmarks/checkpoint_save.py`: the time `save_checkpoint` blocks "
             "the training loop, the time until `latest` names the new checkpoint, and the step time before and "
             "while the files are written (`graph_pipeline.checkpoint_in_background`). The 1.5 B model of "
             "`large_models.py` would need its 18 GB of fp32 weights and Adam state plus their snapshot on this "
             "24 GB machine, so this smaller one stands in for it. DeepSpeed 0.19.8's own asynchronous writers "
             "(fast and decoupled checkpoint engines) need its `async_io` op (libaio), which cannot be built here.",
             "", "| mode | save_checkpoint blocks | `latest` names it after | a step before | a step while writing |",
             "|---|---|---|---|---|"]
    for r in rows:
        while_writing = (f"{r['step_while_writing_s']:.2f} s ({r['steps_while_writing']} steps)"
                         if r["step_while_writing_s"] is not None else "none (blocked)")
        lines.append(f"| {'background' if r['background'] else 'blocking'} ({r['checkpoint_gb']:.2f} GB) | "
                     f"{r['save_call_s']:.2f} s | {r['until_latest_s']:.2f} s | {r['step_s']:.2f} s | {while_writing} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), bool(int(sys.argv[3])))
    else:
        main()
