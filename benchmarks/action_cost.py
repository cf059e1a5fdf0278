"""Where the engine's time per action goes: a cProfile of rank 0 on a 2-rank chain of tiny layers.

Two gloo ranks train a 2-stage chain of four 8x8 linear layers (no compute to speak of), 16
micro-batches, 1F1B. After two warm-up steps rank 0 runs ``--steps`` steps under cProfile; the
report groups the functions' own time (``tottime``) into the parts of an action's cost (dispatch,
instruction lookup, transfer bookkeeping, gloo's posting and waiting, timing and recording, the
watchdog, buffer bookkeeping, compute) and divides by the actions run, so each line reads as
microseconds per action.

    python benchmarks/action_cost.py [--steps 20]    # prints the table (issue 28, point 5)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
M, MBS, DIM = 16, 2, 8

# (part, predicate on (file, function)): the first that matches names a function's part.
PARTS = [
    ("watchdog", lambda f, n: "watchdog" in f),
    ("gloo: waiting for the peer (work.wait)", lambda f, n: "c10d.wait" in n),
    ("gloo: posting (send, recv, batch_isend_irecv)", lambda f, n: "distributed" in f or "deepspeed/comm" in f
     or "c10d" in n),
    ("timing / recording", lambda f, n: n in ("perf_counter", "steps") and ("instructions" in f or f == "~")
     or "timer" in f),
    ("instruction lookup and run loop", lambda f, n: "instructions.py" in f or "functools" in f or "schedule/ir.py" in f),
    ("dispatch (engine loop, engine attribute sets)", lambda f, n: n in ("_exec_schedule", "<lambda>") and "engine" in f
     or n == "__iter__" and "schedule" in f or n == "__setattr__" or "__instancecheck__" in n),
    ("layouts / pack / unpack", lambda f, n: "gpp_deepspeed/engine/p2p.py" in f and n in (
        "pack", "unpack", "receive_buffers", "_numel", "_dtypes", "layout", "header", "keep_layout",
        "encode_header", "decode_header", "encode_layout", "decode_layout")),
    ("p2p bookkeeping (ops, reap, waits)", lambda f, n: "gpp_deepspeed/engine/p2p.py" in f),
    ("transfer bookkeeping (transfers, reshard, flat)", lambda f, n: any(
        m in f for m in ("engine/transfers.py", "engine/reshard.py", "engine/flat.py"))),
    ("buffer bookkeeping (buffers, releases)", lambda f, n: "engine/buffers.py" in f),
    ("compute and the rest (forward, backward, loss, optimizer)", lambda f, n: True),
]


def worker(steps: int, out: str) -> None:
    import torch
    from torch import nn
    import deepspeed
    import gpp_deepspeed
    from deepspeed.pipe import LayerSpec

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    data = [(torch.randn(MBS, DIM), torch.randn(MBS, DIM)) for _ in range(M)]
    cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": M, "steps_per_print": 10**6,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "graph_pipeline": {"print_stage_graph": False}}
    module = gpp_deepspeed.GraphPipelineModule([LayerSpec(nn.Linear, DIM, DIM) for _ in range(4)], num_stages=2,
                                               loss_fn=nn.MSELoss(), partition_method="uniform")
    engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    for _ in range(2):
        engine.train_batch(iter(data))
    actions = len(engine.last_timeline)
    # Unprofiled: each kind's time per action, the gaps between actions (the engine's loop) and
    # the step outside its actions (DeepSpeed's train_batch around the schedule).
    kinds: dict[str, list[float]] = {}
    gaps, outside = [], []
    for _ in range(steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        engine.train_batch(iter(data))
        wall_step = time.perf_counter() - start
        spans = engine.last_timeline
        for action, t0, t1 in spans:
            kind = action.kind.name if action.kind.name != "P2P" else "P2P(" + "+".join(
                sorted({op.kind.name for op in action.ops})) + ")"
            kinds.setdefault(kind, []).append(t1 - t0)
        gaps.append(sum(b[1] - a[2] for a, b in zip(spans, spans[1:])))
        outside.append(wall_step - (spans[-1][2] - spans[0][1]))
    profile = cProfile.Profile()
    torch.distributed.barrier()
    start = time.perf_counter()
    profile.enable()
    for _ in range(steps):
        engine.train_batch(iter(data))
    profile.disable()
    wall = time.perf_counter() - start
    if rank == 0:
        stats = pstats.Stats(profile).stats
        parts: dict[str, float] = {}
        funcs = []
        for (file, _, name), (_, calls, tottime, _, _) in stats.items():
            part = next(p for p, match in PARTS if match(file, name))
            parts[part] = parts.get(part, 0.0) + tottime
            funcs.append((tottime, calls, f"{Path(file).name}:{name}", part))
        funcs.sort(reverse=True)
        Path(out).write_text(json.dumps({
            "actions": actions, "steps": steps, "wall": wall, "parts": parts, "top": funcs[:40],
            "kinds": {k: (len(v) / steps, statistics.median(v)) for k, v in kinds.items()},
            "gaps": statistics.median(gaps), "outside": statistics.median(outside)}))
    torch.distributed.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description="cost per action of the engine, by part (cProfile, rank 0)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps, args.out)
    sys.path.insert(0, str(ROOT / "tests"))
    from dist import launch

    with tempfile.TemporaryDirectory(prefix="gpp_action_cost_") as tmp:
        out = Path(tmp) / "profile.json"
        res = launch(2, Path(__file__), "--worker", "--steps", str(args.steps), "--out", str(out), timeout=600,
                     log_dir=Path(tmp) / "logs")
        if not res.ok:
            raise SystemExit(res.report())
        data = json.loads(out.read_text())
    print("unprofiled, rank 0: per kind, actions per step and median time per action (us)")
    for kind, (count, med) in sorted(data["kinds"].items(), key=lambda kv: -kv[1][0] * kv[1][1]):
        print(f"  {kind:34s} {count:5.1f}  {1e6 * med:8.1f}")
    print(f"  between actions (engine loop, dispatch): {1e3 * data['gaps']:.2f} ms per step, "
          f"{1e6 * data['gaps'] / data['actions']:.1f} us per action; outside the actions: "
          f"{1e3 * data['outside']:.2f} ms per step")
    per = 1e6 / (data["actions"] * data["steps"])
    print(f"{data['actions']} actions per step on rank 0, {data['steps']} steps, "
          f"{1e3 * data['wall'] / data['steps']:.2f} ms per step under the profiler, "
          f"{per * data['wall']:.0f} us per action")
    print("| part | us per action (own time, profiled) |\n|---|---|")
    for part, seconds in sorted(data["parts"].items(), key=lambda kv: -kv[1]):
        print(f"| {part} | {per * seconds:.1f} |")
    print("\ntop functions (own time, us per action; calls per step):")
    for tottime, calls, name, part in data["top"][:30]:
        print(f"  {per * tottime:7.1f}  {calls / data['steps']:7.1f}  {name}  [{part}]")


if __name__ == "__main__":
    main()
