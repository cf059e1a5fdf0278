"""Device profiles: the paper models timed on a GPU, by ``gpp profile`` and at start-up.

Two measurements on a machine with one CUDA device (issue 22, point 5):

* ``gpp profile MODEL --device cuda`` of the paper's three multi-branch models at their A.2 sizes
  (fp32, layer granularity), each layer timed forward, backward and split backward at every
  micro-batch size; MMT's profile also times the link (two processes, gloo: one GPU cannot host
  two NCCL ranks). The cost databases land in ``--out``; ``--compare`` (run anywhere, no GPU)
  sets them beside the analytic H100 database and the plans each gives.
* a start-up profile: ``GraphPipelineModule(partition_method="graphpipe", cost_db=DeviceProfile)``
  on one NCCL rank, which times the captured layers on the rank's own device before it plans,
  then trains: the tiny MMT three steps, equal to its single-device ``GraphModel`` on the same
  device, and the paper-size MMT two steps.

    python benchmarks/device_profiles.py --out DIR          # on the GPU machine
    python benchmarks/device_profiles.py --compare DIR      # here: the table in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("mmt", "dlrm", "candle_uno")
MICRO_BATCHES = "1,2,4,8,16,32"
PLAN_DEVICES, PER_DEVICE = (8, 16, 32), 16


def profile_models(out: Path) -> dict:
    """``gpp profile`` of every model on the GPU, each into ``out/MODEL.cuda.json``."""
    from gpp_deepspeed.cli import main as gpp

    timings = {}
    for name in MODELS:
        start = time.perf_counter()
        argv = ["profile", name, "--device", "cuda", "--micro-batches", MICRO_BATCHES, "-o", str(out / f"{name}.cuda.json")]
        if name != "mmt":
            argv.append("--no-link-measure")
        rc = gpp(argv)
        timings[name] = {"rc": rc, "wall_s": time.perf_counter() - start}
        print(f"gpp profile {name}: rc {rc}, {timings[name]['wall_s']:.1f} s", flush=True)
    return timings


def start_up(out: Path) -> dict:
    """One NCCL rank: plan from layers timed at start-up, then train (see :func:`worker`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    res = subprocess.run([sys.executable, __file__, "--worker", str(out)], env=env, timeout=400)
    return {"rc": res.returncode, "wall_s": time.perf_counter() - start}


def worker(out: Path) -> None:
    import deepspeed
    import torch

    import gpp_deepspeed
    from gpp_deepspeed import GraphModel, GraphPipelineModule
    from gpp_deepspeed.models import build_layers, loss_fn, make_batch, multimodal_transformer, tiny
    from gpp_deepspeed.partitioning import DeviceProfile

    cuda = torch.cuda.is_available()   # a CPU run (gloo, tiny model only) checks the script itself
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__}
    cases = [("tiny", tiny("mmt"), 3, 4, 4)] + ([("paper", multimodal_transformer(), 2, 4, 2)] if cuda else [])
    for size, desc, steps, mbs, gas in cases:
        config = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                  "gradient_clipping": 1.0, "steps_per_print": 100, "zero_optimization": {"stage": 0}}
        profile = DeviceProfile(make_inputs=lambda b, d=desc: make_batch(d, b, seed=0)[0], micro_batches=(1, 2, 4),
                                repeats=3)
        torch.manual_seed(0)
        start = time.perf_counter()
        module = GraphPipelineModule(build_layers(desc), input_names=desc.input_names, num_stages=1,
                                     loss_fn=loss_fn(desc), partition_method="graphpipe", cost_db=profile)
        profiled_s = time.perf_counter() - start
        engine, *_ = gpp_deepspeed.initialize(model=module, config=config,
                                              model_parameters=[p for p in module.parameters() if p.requires_grad])

        def batches(step):
            return [tuple(t.to(device) if torch.is_tensor(t) else tuple(x.to(device) for x in t)
                          for t in make_batch(desc, mbs, seed=1000 * step + k)) for k in range(gas)]

        losses, times = [], []
        for step in range(steps):
            sync()
            t0 = time.perf_counter()
            losses.append(engine.train_batch(data_iter=iter(batches(step))).item())
            sync()
            times.append(time.perf_counter() - t0)
        db = module.measured_costs
        row = {"layers": len(db.layers), "source": db.source, "hardware": db.hardware.name,
               "module_build_and_profile_s": profiled_s, "losses": losses, "step_s": times,
               "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}
        (out / f"startup_{size}.{device.type}.json").write_text(db.to_json())
        if size == "tiny":
            # The same layers on one process, plain PyTorch on the same device, same micro-batches.
            # GraphModel builds each layer under the seed the pipeline's layer was built under.
            twin = GraphModel(build_layers(desc), input_names=desc.input_names).to(device)
            opt = torch.optim.Adam(twin.parameters(), lr=1e-3)
            criterion, reference = loss_fn(desc), []
            for step in range(steps):
                opt.zero_grad()
                total = 0.0
                for inputs, labels in batches(step):
                    loss = criterion(twin(*inputs), labels)
                    (loss / gas).backward()
                    total += loss.item()
                torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
                opt.step()
                reference.append(total / gas)
            row["single_device_losses"] = reference
            row["max_relative_difference"] = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        result[size] = row
        print(f"start-up profile, {size} MMT: {json.dumps(row)}", flush=True)
        del engine, module
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    (out / "startup.json").write_text(json.dumps(result, indent=1))
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for the cost databases (on the GPU machine)")
    parser.add_argument("--compare", help="a directory --out wrote: the table for docs/benchmarks.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(Path(args.worker))
    if args.compare:
        return compare(Path(args.compare))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"profile": profile_models(out), "start_up": start_up(out)}
    (out / "device_profiles_run.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)


def compare(folder: Path) -> None:
    """The GPU's cost databases beside the analytic H100 ones, and GraphPipe's plans from each:
    ``results/device_profiles.{json,md}`` and the section of ``docs/benchmarks.md``."""
    import dataclasses

    from gpp_deepspeed.models import H100_80GB, analytic_costs, candle_uno, dlrm, multimodal_transformer
    from gpp_deepspeed.planner import CostDB
    from gpp_deepspeed.planner.search import graphpipe_search

    descs = {"mmt": multimodal_transformer(), "dlrm": dlrm(), "candle_uno": candle_uno()}
    sizes = tuple(int(b) for b in MICRO_BATCHES.split(","))
    rows = []
    for name in MODELS:
        measured = CostDB.load(folder / f"{name}.cuda.json")
        analytic = analytic_costs(descs[name], H100_80GB, micro_batches=sizes)
        # Plan both on the analytic H100 cluster's links and memory: the plans differ only by the
        # layers' times (the profile's own link is two processes on one host, not NVLink).
        timed = dataclasses.replace(measured, hardware=analytic.hardware)
        row = {"model": name, "layers": len(measured.layers)}
        for b in (1, 16):
            m = sum(c.times(b)[0] + c.times(b)[1] for c in measured.layers)
            a = sum(c.times(b)[0] + c.times(b)[1] for c in analytic.layers)
            row[f"b{b}"] = {"measured_s": m, "analytic_s": a}
        for devices in PLAN_DEVICES:
            plans = {}
            for label, db in (("measured", timed), ("analytic", analytic)):
                plan = graphpipe_search(db, num_devices=devices, mini_batch=PER_DEVICE * devices).plan
                plans[label] = None if plan is None else {
                    "stages": len(plan.stages), "degrees": [s.devices for s in plan.stages],
                    "micro_batch": plan.micro_batch, "samples_per_s": plan.predicted.samples_per_s}
            row[f"plan_{devices}"] = plans
        rows.append(row)
    start_up = json.loads((folder / "startup.json").read_text())
    run = json.loads((folder / "device_profiles_run.json").read_text())
    results = {"rows": rows, "start_up": start_up, "run": run}
    (ROOT / "benchmarks" / "results" / "device_profiles.json").write_text(json.dumps(results, indent=1))
    write_section(results)


def write_section(results: dict) -> None:
    su, run = results["start_up"], results["run"]
    text = ["## Device profiles: the paper models timed on a GPU\n",
            "`python benchmarks/device_profiles.py --out DIR` on a machine with one GPU, then `--compare DIR` here "
            f"(cost databases in `benchmarks/results/device_profiles/`). Measured on one {su['device']} (torch "
            f"{su['torch']}), fp32, the paper's A.2 sizes, layer granularity; the analytic database prices an "
            "H100-SXM5 at its bf16 tensor-core peak (`models/analytic.py`, 989 TFLOP/s), and fp32 without TF32 "
            "peaks near 67 TFLOP/s, so the measured layers are 4-9x slower. With compute that much dearer against "
            "the same links, the searches on the measured layers choose fewer stages and more data parallelism "
            "(MMT: one stage). Plans: GraphPipe's search, 16 samples per device, both on the analytic "
            "H100 cluster's links and memory, so they differ only by the layers' times.\n",
            "| model | `gpp profile` wall (s) | fwd+bwd, micro-batch 1: measured / analytic (ms) | micro-batch 16 | "
            + " | ".join(f"plan on {d}: stages, micro-batch, samples/s (measured / analytic)" for d in PLAN_DEVICES)
            + " |",
            "|---|---|---|---|" + "---|" * len(PLAN_DEVICES)]
    for r in results["rows"]:
        cells = [r["model"], f"{run['profile'][r['model']]['wall_s']:.1f}"]
        for b in (1, 16):
            x = r[f"b{b}"]
            cells.append(f"{x['measured_s'] * 1e3:.1f} / {x['analytic_s'] * 1e3:.1f} "
                         f"({x['measured_s'] / x['analytic_s']:.1f}x)")
        for d in PLAN_DEVICES:
            p = r[f"plan_{d}"]
            cells.append(" / ".join("-" if p[k] is None else f"{p[k]['stages']}, {p[k]['micro_batch']}, "
                                    f"{p[k]['samples_per_s']:.0f}" for k in ("measured", "analytic")))
        text.append("| " + " | ".join(cells) + " |")
    text.append("")
    lines = []
    for size in ("tiny", "paper"):
        row = su.get(size)
        if row is None:
            continue
        line = (f"- **{size} MMT**, `partition_method=\"graphpipe\"` with a `DeviceProfile` on one NCCL rank: "
                f"{row['layers']} layers timed on the device and planned in {row['module_build_and_profile_s']:.1f} s "
                f"(module built and profiled), then {len(row['losses'])} training steps, losses "
                f"{', '.join(f'{x:.4f}' for x in row['losses'])}, GPU peak {row['peak_gib']:.2f} GiB")
        if "max_relative_difference" in row:
            line += (f"; the single-device `GraphModel` on the same GPU: {', '.join(f'{x:.4f}' for x in row['single_device_losses'])} "
                     f"(largest relative difference {row['max_relative_difference']:.1e})")
        lines.append(line + ".")
    lines.append("- The paper-size steps only show that the start-up profile, the plan and a training step run at "
                 "that size on the device (Adam at lr 1e-3 on random labels, two steps: not a convergence run).")
    text += lines + [""]
    (ROOT / "benchmarks" / "results" / "device_profiles.md").write_text("\n".join(text))
    import report
    report.main()


if __name__ == "__main__":
    main()
