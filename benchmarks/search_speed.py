"""How long the planners take to search: GraphPipe at cluster scale, and against branch count.

Three measurements, all on analytic cost databases (the search time is real wall clock on this
machine; the plans' throughputs are predictions of the analytic cost model):

1. **Paper models**: GraphPipe's full-space search on MMT, DLRM, CANDLE-Uno and the sequential
   transformer, at layer and sublayer granularity, on 8, 16 and 32 V100s with 16 samples per
   device (``plan_compare.py``'s setting). Target: under 5 s per configuration.
2. **Cluster scale**: CANDLE-Uno with 64 branches on 1,024 A100s, mini-batch 16,384, both search
   spaces (what ``gpp profile candle_uno --analytic a100 --size branches=64`` then ``gpp plan
   ... --devices 1024 --mini-batch 16384`` runs). Target: under 60 s. The bubble of its plan is
   broken down into the stage that bounds the iteration.
3. **Branch scaling**: GraphPipe, PipeDream and Piper on CANDLE-Uno with 2 to 64 branches, 16 A100s,
   mini-batch 256, plotted to ``docs/search_scaling.png``. Piper's DP is over the downsets of the
   DAG, ``(L + 1)^k + T`` of them for ``k`` branches of ``L`` layers and ``T`` layers after the
   merge; it runs while that is under ``PIPER_LIMIT`` and the count is plotted beyond.

Times are medians of ``--repeats`` runs; the machine is shared, so single runs vary by 2x.
``--root DIR`` times the planner of another checkout (e.g. an older commit) and writes only
``--out``. Writes ``benchmarks/results/search_speed.json`` and the ``search_speed.md`` section of
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PAPER = (("mmt", "layer"), ("mmt", "sublayer"), ("dlrm", "layer"), ("candle_uno", "layer"),
         ("seq_transformer", "layer"), ("seq_transformer", "sublayer"))
DEVICES = (8, 16, 32)
PER_DEVICE = 16
BRANCHES = (2, 3, 4, 5, 6, 8, 16, 32, 64)
SCALING_DEVICES = 16
PIPER_LIMIT = 4_000          # downsets; Piper's DP is quadratic in them
LARGE = dict(branches=64, devices=1024, mini_batch=16384)


def _load(root: Path):
    sys.path.insert(0, str(root))
    from gpp_deepspeed import models
    from gpp_deepspeed.planner.baselines import BASELINES
    from gpp_deepspeed.planner.search import graphpipe_search
    return models, BASELINES, graphpipe_search


def _median_search(run, repeats: int):
    results, cpu = [], []
    for _ in range(repeats):
        t = time.process_time()
        results.append(run())
        cpu.append(time.process_time() - t)
    times = [r.search_time_s for r in results]
    _median_search.cpu = statistics.median(cpu)   # CPU seconds (search and simulation): load-proof
    return statistics.median(times), times, results[0]


def paper_models(models, graphpipe_search, repeats: int, log) -> list[dict]:
    builders = {"mmt": lambda g: models.multimodal_transformer(granularity=g), "dlrm": lambda g: models.dlrm(),
                "candle_uno": lambda g: models.candle_uno(),
                "seq_transformer": lambda g: models.sequential_transformer(granularity=g)}
    rows = []
    for name, gran in PAPER:
        db = models.analytic_costs(builders[name](gran), models.V100_SUMMIT)
        for n in DEVICES:
            b = PER_DEVICE * n
            median, times, r = _median_search(lambda: graphpipe_search(db, num_devices=n, mini_batch=b), repeats)
            p = r.plan.predicted if r.plan else None
            rows.append({"model": name, "granularity": gran, "devices": n, "mini_batch": b, "search_s": median,
                         "cpu_s": _median_search.cpu, "runs_s": times, "states": r.states, "samples_per_s": p.samples_per_s if p else None})
            log(f"{name:16s} {gran:8s} {n:3d} dev  search {median:6.2f} s (runs {', '.join(f'{t:.2f}' for t in times)}, "
                f"cpu {_median_search.cpu:.2f} s)"
                f"  {rows[-1]['samples_per_s'] or 0:10.1f} samples/s")
    return rows


def cluster_scale(models, graphpipe_search, log) -> list[dict]:
    db = models.analytic_costs(models.candle_uno(branches=LARGE["branches"]), models.A100_80GB)
    rows = []
    for space in ("runtime", "full"):
        t0, c0 = time.perf_counter(), time.process_time()
        r = graphpipe_search(db, num_devices=LARGE["devices"], mini_batch=LARGE["mini_batch"], space=space)
        # what `gpp plan` waits for: the search and the simulation of its candidates
        total_s, total_cpu = time.perf_counter() - t0, time.process_time() - c0
        p = r.plan
        row = {"space": space, "search_s": r.search_time_s, "states": r.states, "total_s": total_s,
               "total_cpu_s": total_cpu, "samples_per_s": p.predicted.samples_per_s if p else None, "status": r.status}
        if p is not None:
            row.update(bubble=p.predicted.bubble_fraction, stages=p.num_stages, micro_batch=p.micro_batch,
                       degrees=sorted({s.devices for s in p.stages}), **_bottleneck(db, p))
        rows.append(row)
        log(f"candle_uno 64 branches 1024 dev {space:7s}  search {r.search_time_s:6.1f} s  "
            + (f"{row['samples_per_s']:.0f} samples/s, bubble {row['bubble']:.1%}" if p else r.status))
    return rows


def _bottleneck(db, plan) -> dict:
    """The busiest stage of ``plan`` and what its iteration is made of, to explain the bubble."""
    from gpp_deepspeed.planner.costs import StageCostModel
    busy = plan.predicted.stage_busy_s
    s = max(range(plan.num_stages), key=lambda i: busy[i])
    cm = StageCostModel(db, plan.mini_batch, p2p_devices=plan.num_devices)
    stage = plan.stages[s]
    mask = cm.mask_of(stage.layers)
    c = cm.stage(mask, plan.micro_batch, stage.devices)
    wider = cm.stage(mask, plan.micro_batch, 8 * stage.devices)
    params = sum(db.by_name[n].param_bytes for n in stage.layers)
    return {"bottleneck_stage": list(stage.layers), "bottleneck_devices": stage.devices,
            "bottleneck_busy_s": busy[s], "iteration_s": plan.predicted.iteration_time_s,
            "bottleneck_compute_s": plan.num_microbatches * (c.fwd_s + c.bwd_s), "bottleneck_allreduce_s": c.allreduce_s,
            "bottleneck_param_bytes": params, "wider_devices": 8 * stage.devices,
            "wider_compute_s": plan.num_microbatches * (wider.fwd_s + wider.bwd_s), "wider_allreduce_s": wider.allreduce_s,
            "other_stages_busy_max_s": max(b for i, b in enumerate(busy) if i != s)}


def branch_scaling(models, baselines, graphpipe_search, repeats: int, log) -> list[dict]:
    rows = []
    n, mini_batch = SCALING_DEVICES, PER_DEVICE * SCALING_DEVICES
    for k in BRANCHES:
        desc = models.candle_uno(branches=k)
        db = models.analytic_costs(desc, models.A100_80GB)   # 64 branches' merge layer outgrows a V100
        layers_per_branch, top = 4, len(db.layers) - 4 * k
        downsets = (layers_per_branch + 1) ** k + top
        for method in ("graphpipe", "pipedream", "piper"):
            if method == "piper" and downsets > PIPER_LIMIT:
                rows.append({"branches": k, "method": method, "search_s": None, "downsets": downsets})
                continue
            if method == "graphpipe":
                def run():
                    return graphpipe_search(db, num_devices=n, mini_batch=mini_batch)
            else:
                def run(method=method):
                    return baselines[method](db, num_devices=n, mini_batch=mini_batch)
            median, times, r = _median_search(run, 1 if method == "piper" else repeats)
            rows.append({"branches": k, "method": method, "search_s": median, "runs_s": times, "states": r.states,
                         "downsets": downsets, "samples_per_s": r.plan.predicted.samples_per_s if r.plan else None,
                         "status": r.status})
            log(f"{k:3d} branches {method:10s} search {median:8.3f} s  {r.status}")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"graphpipe": ("GraphPipe", "o-"), "pipedream": ("PipeDream", "s-"), "piper": ("Piper", "^-")}
    for method, (label, style) in styles.items():
        pts = [(r["branches"], r["search_s"]) for r in rows if r["method"] == method and r["search_s"] is not None]
        ax.plot(*zip(*pts), style, label=label)
    ax.set(xscale="log", yscale="log", xlabel="branches (CANDLE-Uno, 4 layers each)", ylabel="search time (s)",
           title=f"Search time, {SCALING_DEVICES} A100s, mini-batch {PER_DEVICE * SCALING_DEVICES}")
    for a in (ax, ax2):
        a.set_xscale("log")
        a.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        a.set_xticks(BRANCHES, [str(k) for k in BRANCHES])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    piper = sorted({(r["branches"], r["downsets"]) for r in rows if r["method"] == "piper"})
    ax2.plot(*zip(*piper), "^-", color="C2", label="Piper: downsets (its DP is quadratic in them)")
    gp = [(r["branches"], r["states"]) for r in rows if r["method"] == "graphpipe"]
    ax2.plot(*zip(*gp), "o-", color="C0", label="GraphPipe: DP states visited")
    ax2.axhline(40_000, color="grey", ls=":", label="Piper's IDEALS_LIMIT (40,000)")
    ax2.set(xscale="log", yscale="log", xlabel="branches", ylabel="count", title="Search space")
    ax2.set_xticks(BRANCHES, [str(k) for k in BRANCHES])
    ax2.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(data: dict, before: dict | None) -> str:
    lines = ["## Search time (wall clock on this shared 2-core machine)", "",
             "`python benchmarks/search_speed.py`. Medians of "
             f"{data['repeats']} runs; the machine was shared with other jobs, so single runs vary by up to 2x. "
             "Plans are those of the analytic cost model (predictions).", "",
             "### GraphPipe on the paper's models (full space, 16 samples per device)", ""]
    prev = {(r["model"], r["granularity"], r["devices"]): r for r in (before or {}).get("paper", [])}
    prev_cluster = {r["space"]: r for r in (before or {}).get("cluster", [])}
    label = (before or {}).get("commit", "c25a8f0")
    head = "| model | granularity | devices | search (s) | CPU (s) | states | samples/s |"
    sep = "|---|---|---|---|---|---|---|"
    if prev:
        head += f" before ({label}): search (s) | before: CPU (s) | before: samples/s |"
        sep += "---|---|---|"
    lines += [head, sep]
    for r in data["paper"]:
        line = (f"| {r['model']} | {r['granularity']} | {r['devices']} | {r['search_s']:.2f} | {r['cpu_s']:.2f} | "
                f"{r['states']} | {r['samples_per_s']:.0f} |")
        p = prev.get((r["model"], r["granularity"], r["devices"]))
        if prev:
            line += f" {p['search_s']:.2f} | {p['cpu_s']:.2f} | {p['samples_per_s']:.0f} |" if p else " - | - | - |"
        lines.append(line)
    worst = max(r["search_s"] for r in data["paper"])
    worst_cpu = max(r["cpu_s"] for r in data["paper"])
    lines += ["", f"Slowest configuration: {worst:.2f} s wall clock, {worst_cpu:.2f} s of CPU (target: under 5 s). "
              "CPU is the process's CPU time for the same call (search and the simulation of its candidates), which "
              "other jobs on the machine do not inflate; compare before and after on it. The wall clock of a run "
              "depends on the load when it ran (other users' single-process work shared the 2 cores).", "",
              "### CANDLE-Uno, 64 branches, 1,024 A100s, mini-batch 16,384", "",
              "| space | search (s) | search and simulation (s) | its CPU (s) | states | samples/s | stages | "
              "micro-batch | degrees | bubble |" + (f" before ({label}): search and simulation (s), CPU (s) |" if prev_cluster else ""),
              "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if prev_cluster else "")]
    for r in data["cluster"]:
        line = (f"| {r['space']} | {r['search_s']:.1f} | {r.get('total_s', float('nan')):.1f} | "
                f"{r.get('total_cpu_s', float('nan')):.1f} | {r['states']} | {r['samples_per_s']:.0f} | {r['stages']} | "
                f"{r['micro_batch']} | {r['degrees']} | {r['bubble']:.1%} |")
        b = prev_cluster.get(r["space"])
        if prev_cluster:
            line += f" {b.get('total_s', b['search_s']):.1f}, {b.get('total_cpu_s', float('nan')):.1f} |" if b else " - |"
        lines.append(line)
    r = data["cluster"][0]
    lines += ["", f"Why the bubble: the busiest stage ({', '.join(r['bottleneck_stage'])}, {r['bottleneck_devices']} "
              f"devices) is busy {r['bottleneck_busy_s'] * 1e3:.0f} ms of the {r['iteration_s'] * 1e3:.0f} ms iteration: "
              f"{r['bottleneck_compute_s'] * 1e3:.0f} ms of compute and a {r['bottleneck_allreduce_s'] * 1e3:.0f} ms "
              f"all-reduce of its {r['bottleneck_param_bytes'] / 1e9:.2f} GB of gradients. On "
              f"{r['wider_devices']} devices its compute would fall to {r['wider_compute_s'] * 1e3:.0f} ms but the "
              f"all-reduce, now across nodes, would take {r['wider_allreduce_s'] * 1e3:.0f} ms. No other stage is "
              f"busy more than {r['other_stages_busy_max_s'] * 1e3:.1f} ms. See docs/planner.md.", "",
              f"### Search time against branch count ({SCALING_DEVICES} A100s, mini-batch {PER_DEVICE * SCALING_DEVICES})", "",
              "![search time against branch count](search_scaling.png)", "",
              "| branches | GraphPipe (s) | PipeDream (s) | Piper (s) | Piper's downsets |", "|---|---|---|---|---|"]
    by = {(x["branches"], x["method"]): x for x in data["scaling"]}
    for k in BRANCHES:
        cell = [by[(k, m)]["search_s"] for m in ("graphpipe", "pipedream", "piper")]
        lines.append(f"| {k} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cell)
                     + f" | {by[(k, 'piper')]['downsets']:,} |")
    lines += ["", f"Piper is run while its downsets number at most {PIPER_LIMIT:,}; beyond, the count alone is given."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout whose planner to time")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "search_speed.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="paper,cluster,scaling")
    parser.add_argument("--before", type=Path, default=ROOT / "benchmarks" / "results" / "search_speed_before.json",
                        help="a JSON written by --root on an older checkout, to compare (its 'commit' key names it; "
                        "default: the times of the checkout before issue 22, measured on this machine)")
    args = parser.parse_args()
    models, baselines, graphpipe_search = _load(args.root)
    log = lambda m: print(m, flush=True)  # noqa: E731
    parts = args.parts.split(",")
    data = {"repeats": args.repeats}
    if "paper" in parts:
        data["paper"] = paper_models(models, graphpipe_search, args.repeats, log)
    if "cluster" in parts:
        data["cluster"] = cluster_scale(models, graphpipe_search, log)
    if "scaling" in parts:
        data["scaling"] = branch_scaling(models, baselines, graphpipe_search, args.repeats, log)
    args.out.write_text(json.dumps(data, indent=1))
    if args.root != ROOT or set(parts) != {"paper", "cluster", "scaling"}:
        return
    before = json.loads(args.before.read_text()) if args.before and args.before.exists() else None
    if before is not None:
        data["before"] = before
        args.out.write_text(json.dumps(data, indent=1))
    plot(data["scaling"], ROOT / "docs" / "search_scaling.png")
    (ROOT / "benchmarks" / "results" / "search_speed.md").write_text(markdown(data, before))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report
    report.main()


if __name__ == "__main__":
    main()
