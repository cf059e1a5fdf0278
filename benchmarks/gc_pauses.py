"""Python's garbage collector on a pipeline: steps under each of the engine's collection settings.

``zbv`` on peers.py's four branches (8 gloo ranks, the same sleeping layers, the fold the search
picks), one launch per setting, since the collector is one per process:

* ``automatic``: Python's own collector, nothing frozen (``"gc_freeze": false``): what the engine
  did before ``gpp_deepspeed.engine.collector``;
* ``gc_freeze`` (the default): the start-up heap frozen at ``initialize``, the automatic collector on;
* ``disable_python_gc + gc_interval 1``: DeepSpeed's switch turns the automatic collector off, and
  every rank collects after each optimizer step, between batches.

Each round runs one step; the loop keeps every step's timeline (``engine.last_timeline``: its
actions and their times, a few thousand objects a step), as a training loop keeps its logs,
metrics or traces, so the heap grows as a real run's does and Python's thresholds for a full
collection are crossed now and then. The harness touches no collector setting. For every
step it records, on each rank, the collections the interpreter started by itself and how long
they took (``gc.callbacks``), apart from the one the engine asks for between batches (DeepSpeed's
``engine.collect_python_gc()``, which ``gc_interval`` calls at the end of ``train_batch``). The
table gives the median step over rounds 3..N and, over every round from the first step after
``initialize`` on, the slowest step, the steps in which some rank's interpreter ran a full
(generation 2) collection, the longest collection it started, and the engine's own collection
between batches (median over ranks and steps; part of the step time). After the rounds every rank
times one full collection (``gc.collect()``): what a collection that lands inside a step costs
under that setting (the median over ranks).

    python benchmarks/gc_pauses.py [--rounds 80]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
import peers  # noqa: E402
import report  # noqa: E402

TOPO = "four_branches"
SCHEDULES = ("zbv", )
SETTINGS = {
    "automatic": {"graph_pipeline": {"gc_freeze": False}},
    "gc_freeze (default)": {},
    "disable_python_gc + gc_interval 1": {"disable_python_gc": True, "graph_pipeline": {"gc_interval": 1}},
}
OUT = ROOT / "benchmarks" / "results" / "gc_pauses.json"
SECTION = """## Python's garbage collector on a pipeline (gc_pauses.py)

`python benchmarks/gc_pauses.py`: {doc} (the rows below), {rounds} rounds a launch; load average {load}.

{table}

{notes}"""


def worker(setting: str, out: str, rounds: int) -> None:
    import gc

    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    peers.OURS, peers.OURS_FOLDED, peers.IN_PLACE = (), SCHEDULES, ()
    unit = peers.sleep_unit_class()
    dag, _, _ = peers.batches(4)
    built = peers.build_ours(TOPO, unit, dag, config=SETTINGS[setting])
    now = {"asked": False, "start": 0.0, "full": 0, "longest": 0.0, "asked_s": 0.0}

    def timed(phase, info):   # every collection: the interpreter's own, or the one the engine asks for
        if phase == "start":
            now["start"] = time.perf_counter()
            return
        took = time.perf_counter() - now["start"]
        if now["asked"]:
            now["asked_s"] += took
            return
        now["full"] += info["generation"] == 2
        now["longest"] = max(now["longest"], took)

    for _, engine in built.values():
        collect = engine.collect_python_gc

        def asked(collect=collect):
            now["asked"] = True
            try:
                return collect()
            finally:
                now["asked"] = False
        engine.collect_python_gc = asked
    gc.callbacks.append(timed)
    record = {name: {"wall": [], "full": [], "longest": [], "asked": []} for name in built}
    kept = []
    for _ in range(rounds):
        for name, (step, _) in built.items():
            torch.distributed.barrier()
            now.update(full=0, longest=0.0, asked_s=0.0)
            start = time.perf_counter()
            step()
            wall = time.perf_counter() - start
            torch.distributed.barrier()
            kept.append([(str(a), a0, a1) for a, a0, a1 in built[name][1].last_timeline])   # the loop's log
            for key, value in (("wall", wall), ("full", now["full"]), ("longest", now["longest"]),
                               ("asked", now["asked_s"])):
                record[name][key].append(value)
    gc.callbacks.remove(timed)
    start = time.perf_counter()
    gc.collect()
    record["full_collection_s"] = time.perf_counter() - start
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, record)
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))


def rows(setting: str, ranks: list[dict]) -> list[str]:
    """One row per schedule: a step is its slowest rank's (the pipeline waits for it)."""
    out = []
    for name in SCHEDULES:
        walls = [max(step) for step in zip(*(r[name]["wall"] for r in ranks))]
        full = sum(any(step) for step in zip(*(r[name]["full"] for r in ranks)))
        longest = max(max(r[name]["longest"]) for r in ranks)
        asked = statistics.median(t for r in ranks for t in r[name]["asked"])
        collection = statistics.median(r["full_collection_s"] for r in ranks)
        out.append(f"| {setting} | `{name}` | {statistics.median(walls[peers.WARM_UP:]) * 1e3:,.0f} | "
                   f"{max(walls) * 1e3:,.0f} | {full} of {len(walls)} | {longest * 1e3:,.1f} | {asked * 1e3:,.1f} | "
                   f"{collection * 1e3:,.1f} |")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        sys.exit()
    from dist import launch

    loads, results = [os.getloadavg()[0]], {}
    for setting in SETTINGS:
        out = OUT.with_name(f"gc_pauses_{list(SETTINGS).index(setting)}.json")
        result = launch(8, Path(__file__), "--worker", setting, str(out), str(args.rounds), timeout=1800,
                        log_dir=ROOT / "benchmarks" / "results" / "tmp" / "logs" / "gc_pauses")
        if not result.ok:
            sys.exit(result.report())
        results[setting] = json.loads(out.read_text())
        out.unlink()
        loads.append(os.getloadavg()[0])
    OUT.write_text(json.dumps(results))
    table = ["| setting | schedule | median step, rounds 3.. (ms) | slowest step (ms) | steps with a full "
             "collection inside | longest collection inside a step (ms) | the engine's collection between batches "
             "(ms) | one full collection after the run (ms) |", "|---|---|---|---|---|---|---|---|"]
    for setting, ranks in results.items():
        table += rows(setting, ranks)
    text = "\n".join(table)
    doc = " ".join(__doc__.split("\n\n")[1].split()).replace("``", "`").rstrip(":")
    OUT.with_suffix(".md").write_text(SECTION.format(
        doc=doc, rounds=args.rounds, load=" to ".join(f"{x:.1f}" for x in loads), table=text,
        notes=report.notes("gc_pauses")))
    print(text)
