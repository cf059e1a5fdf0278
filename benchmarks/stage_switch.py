"""Before and after a folded rank switched stages past ``nn.Module.__setattr__`` (2a6fb10): ``zbv`` on
peers.py's four branches, two engines built alike in one launch of 8 gloo ranks, one of them
switching its engine and module between stages as before (attribute sets through
``nn.Module.__setattr__``); torch's ZBV beside. Each round runs one step of each; the table gives
the median step of rounds 3..N and the median CPU per step summed over the ranks (every thread of
each process), which a shared machine stretches less than wall time.

The forward's ``in_arity`` (one set per forward, 7311658) goes past ``nn.Module.__setattr__`` in both.

    python benchmarks/stage_switch.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
import peers  # noqa: E402

TOPO = "four_branches"
OUT = ROOT / "benchmarks" / "results" / "stage_switch.json"
SECTION = """## Switching a folded rank's stage (stage_switch.py)

`python benchmarks/stage_switch.py`: {doc} One launch, {rounds} rounds, load average {load}.

{table}
"""


def _switch_as_before(rooms, stage: int) -> None:
    """``RankStages._point`` as it was before 2a6fb10: every attribute through ``nn.Module.__setattr__``."""
    room, engine = rooms.rooms[stage], rooms.engine
    engine.stage, engine.spec, engine.pipe_buffers = stage, room.spec, room.buffers
    engine.module.stage = stage
    engine.module.stage_spec = engine.module.partition.stages[stage]
    engine.module.frozen = room.frozen


def worker(out: str, rounds: int) -> None:
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    peers.OURS, peers.OURS_FOLDED, peers.IN_PLACE = (), ("zbv", ), ()
    unit = peers.sleep_unit_class()
    dag, _, batch = peers.batches(4)
    steps = {}
    for label in ("zbv, switch as before", "zbv, switch past nn.Module.__setattr__ (now)"):
        step, engine = peers.build_ours(TOPO, unit, dag)["zbv"]
        if "before" in label:
            engine.rooms._point = types.MethodType(_switch_as_before, engine.rooms)
        steps[label] = step
    steps["torch ZBVZeroBubble"] = peers.build_torch(TOPO, "ZBVZeroBubble", unit, batch)[0]
    wall, cpu = {k: [] for k in steps}, {k: [] for k in steps}
    for _ in range(rounds):
        for label, step in steps.items():
            torch.distributed.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            c1 = time.process_time()
            torch.distributed.barrier()
            wall[label].append(time.perf_counter() - t0)
            cpu[label].append(c1 - c0)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, cpu)
    if torch.distributed.get_rank() == 0:
        total = {k: [sum(r[k][i] for r in gathered) for i in range(rounds)] for k in steps}
        Path(out).write_text(json.dumps({"wall": wall, "cpu": total}, indent=1))


def table(result: dict) -> str:
    lines = ["| engine | median step (ms) | CPU per step, all ranks (ms) |", "|---|---|---|"]
    for label, times in result["wall"].items():
        lines.append(f"| {label} | {statistics.median(times[2:]) * 1e3:,.0f} | "
                     f"{statistics.median(result['cpu'][label][2:]) * 1e3:,.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
    else:
        from dist import launch

        loads = [os.getloadavg()[0]]
        launch(8, Path(__file__), "--worker", str(OUT), str(args.rounds), timeout=1200,
               log_dir=ROOT / "benchmarks" / "results" / "tmp" / "logs" / "stage_switch")
        loads.append(os.getloadavg()[0])
        text = table(json.loads(OUT.read_text()))
        doc = " ".join(__doc__.split("\n\n")[0].split()).replace("``", "`")
        OUT.with_suffix(".md").write_text(SECTION.format(doc=doc, rounds=args.rounds, table=text,
                                                         load=" to ".join(f"{x:.1f}" for x in loads)))
        print(text)
