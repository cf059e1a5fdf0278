"""GraphPipe's gain as CANDLE-Uno grows branches (GraphPipe Fig. 7 left), analytic.

CANDLE-Uno with 2, 4, 8 and 16 branches of 4 FF layers (hidden 4096) on max(4, branches) V100s
(the paper used 4, 8 and 16 GPUs), mini-batch 16 per device as in ``plan_compare.py``. Every
method plans on the same analytic cost database with the same sweep and is timed by the same
simulator; throughput is reported against PipeDream's (as the paper does) and against the best
baseline. Figures are predictions of the analytic cost model, not measurements.

Writes ``benchmarks/results/branch_scaling.json`` and the ``branch_scaling.md`` section of
``docs/benchmarks.md``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpp_deepspeed.models import V100_SUMMIT, analytic_costs, candle_uno  # noqa: E402
from gpp_deepspeed.planner.baselines import BASELINES  # noqa: E402
from gpp_deepspeed.planner.search import graphpipe_search  # noqa: E402

BRANCHES = (2, 4, 8, 16)
PER_DEVICE = 16
METHODS = ("graphpipe", "pipedream", "piper", "ds-uniform", "ds-parameters")


def main() -> None:
    start = time.perf_counter()
    rows = []
    for k in BRANCHES:
        devices = max(4, k)
        mini_batch = PER_DEVICE * devices
        db = analytic_costs(candle_uno(branches=k), V100_SUMMIT)
        for method in METHODS:
            if method == "graphpipe":
                result = graphpipe_search(db, num_devices=devices, mini_batch=mini_batch)
            else:
                result = BASELINES[method](db, num_devices=devices, mini_batch=mini_batch)
            p = result.plan.predicted if result.plan else None
            rows.append({"branches": k, "devices": devices, "mini_batch": mini_batch, "method": method,
                         "samples_per_s": p.samples_per_s if p else None,
                         "iteration_time_s": p.iteration_time_s if p else None,
                         "peak_mem_bytes": p.peak_mem_bytes if p else None,
                         "depth": max(p.stage_in_flight) if p else None,
                         "search_time_s": result.search_time_s, "status": result.status})
            print(f"{k:3d} branches {devices:3d} dev {method:14s} "
                  + (f"{p.samples_per_s:10.1f} samples/s" if p else result.status), flush=True)
    summary = {}
    for k in BRANCHES:
        mine = {r["method"]: r for r in rows if r["branches"] == k}
        gp = mine["graphpipe"]["samples_per_s"]
        base = [r for m, r in mine.items() if m != "graphpipe" and r["samples_per_s"]]
        best = max(base, key=lambda r: r["samples_per_s"])
        summary[k] = {"vs_pipedream": gp / mine["pipedream"]["samples_per_s"],
                      "vs_best_baseline": gp / best["samples_per_s"], "best_baseline": best["method"]}
    out = ROOT / "benchmarks" / "results"
    (out / "branch_scaling.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    lines = ["## Branch scaling: CANDLE-Uno with 2 to 16 branches (analytic)", "",
             "`python benchmarks/branch_scaling.py`. CANDLE-Uno with k branches of 4 FF layers (hidden 4096) on "
             f"max(4, k) V100s, mini-batch {PER_DEVICE} per device; same cost database, sweep and simulator for every "
             f"method; predictions of the analytic cost model. Run took {time.perf_counter() - start:.0f} s.", "",
             "| branches | devices | GraphPipe / PipeDream | GraphPipe / best baseline | best baseline | "
             "GraphPipe peak in-flight | PipeDream peak in-flight | Piper |", "|---|---|---|---|---|---|---|---|"]
    for k, v in summary.items():
        mine = {r["method"]: r for r in rows if r["branches"] == k}
        piper = mine["piper"]["status"] if mine["piper"]["samples_per_s"] is None else "ok"
        lines.append(f"| {k} | {max(4, k)} | {v['vs_pipedream']:.2f} | {v['vs_best_baseline']:.2f} | "
                     f"{v['best_baseline']} | {mine['graphpipe']['depth']} | {mine['pipedream']['depth']} | {piper} |")
    (out / "branch_scaling.md").write_text("\n".join(lines) + "\n")
    import report
    report.main()


if __name__ == "__main__":
    main()
