"""What a fan-in stage costs: a DAG whose output stage takes N branches against a chain of the same
layers, each against its simulated step (issue 28, point 5).

One launch of ``N + 1`` gloo ranks trains, round after round, one 1F1B step of each:

* ``fanin``: N one-layer branches, each reading its own input, into one output layer that sums them
  (the fan-in stage: it receives from every branch and sends a gradient back to every branch);
* ``chain``: the same ``N + 1`` layers as a chain (one layer per stage and rank).

With ``--strict`` every rank runs under ``tests/strict_p2p.py`` (NCCL's rendezvous semantics on
gloo: a send completes when its receive is launched, a group as a whole, groups in posting order),
where a group that pairs sends to every branch with receives from every branch would wait for the
slowest branch if anything did.

Every layer is the sleeping layer of ``benchmarks/peers.py`` (forward, input gradient and weight
gradient each sleep ``T`` ms; a branch's first layer has no input gradient). Each row gives the
median step over the rounds after the first, the simulator's step for the same sleeps (free
messages) and their ratio; "wait" is the share of the step the fan-in (output) stage spent in its
transfer actions, and "messages" how many it posted per step. The ratio is what the runtime and the
machine add to the schedule; the fan-in row against the chain row is what a fan-in adds.
"Replayed" prices each compute action at what it took in the last step (``peers.replayed``), so
measured over replayed is what the runtime adds between compute. Torch's ``Schedule1F1B`` runs
the same chain in the same launch, the reference for measured over simulated.

    python benchmarks/fanin.py [--branches 4] [--rounds 8] [--strict]   # results/fanin_<N>.json, fanin.md
    python benchmarks/fanin.py --skip-deepspeed-forward ...   # an experiment: ours without DeepSpeed's
                                                             # forward wrapper (skip_deepspeed_forward)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import peers
import report

ROOT = Path(__file__).resolve().parent.parent
# Each also with its receives completed in place (graph_pipeline.early_receives false), the
# transport before lowering.post_early: posted as their message is sent, waited for at their use.
VARIANTS = ("fanin", "chain", "fanin" + peers.IN_PLACE_SUFFIX, "chain" + peers.IN_PLACE_SUFFIX)
# The reference: torch.distributed.pipelining's Schedule1F1B on the same chain, one layer per rank,
# in the same launch. Its simulated step is the chain's 1F1B (the same order on the same sleeps;
# torch's own pipeline_order is refused, peers.torch_predicted), so measured over simulated compares
# the two runtimes.
TORCH = "chain, torch 1F1B"


def topology(name: str, branches: int) -> str:
    """Register the variant's topology with peers.py (its layer rows and sleeping units) and name it."""
    key = f"{name}{branches}"
    peers.TOPOLOGIES[key] = ((1, ) * branches, 1) if name == "fanin" else ((branches, ), 1)
    return key


def build(name: str, branches: int, unit):
    """(step, engine) of one variant: our engine, 1F1B, one layer per stage and rank."""
    import torch
    from torch import nn
    import gpp_deepspeed
    from gpp_deepspeed import GraphLayerSpec, GraphPipelineModule

    schedule, early = peers.variant(name)   # the topology's name, and whether receives go early
    key = topology(schedule, branches)
    rows = peers.layer_rows(key)
    inputs = len(peers.TOPOLOGIES[key][0])
    gen = torch.Generator().manual_seed(0)
    data = [(tuple(torch.randn(peers.MBS, peers.DIM, generator=gen) for _ in range(inputs)),
             torch.randn(peers.MBS, peers.DIM, generator=gen)) for _ in range(peers.M)]
    layers = [GraphLayerSpec(r["name"], unit, peers.DIM, inputs, r["branch"], r["merge"], 1.0, r["source"], False,
                             inputs=r["inputs"]) for r in rows]
    module = GraphPipelineModule(layers, input_names=[f"x{b}" for b in range(inputs)], num_stages=len(rows),
                                 loss_fn=nn.MSELoss(), partition_method={r["name"]: i for i, r in enumerate(rows)})
    cfg = peers._ds_config() | {"graph_pipeline": {"schedule": "1f1b", "print_stage_graph": False,
                                                    "print_idle_fractions": False, "early_receives": early}}
    engine, *_ = gpp_deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
    return (lambda: engine.train_batch(data_iter=iter(data))), engine


def stage_costs(engine) -> dict:
    """The output stage's transfers in the last batch, split by what they waited for, from every
    rank's timeline (``time.perf_counter`` is the machine's monotonic clock, one for all ranks).

    For each action of the output stage that completes activation receives (a transfer action
    receiving them in place, or the ``WAIT_F`` of receives posted early), ``ready`` is when the last
    of its senders posted the matching send (the start of the sender's action that holds it: sends
    are posted first). Its time before ``ready`` is waiting for a peer (the schedule and the peers'
    speed), its time after is the transport's own work once every message could flow (for a wait,
    what is left of it: the rest overlapped the compute before). Transfer time counts the waits.
    Collective: every rank calls it."""
    import torch

    mine = [(a, t0, t1) for a, t0, t1 in engine.last_timeline]
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, (engine.stage_id, [(str(a), t0, t1) for a, t0, t1 in mine]))
    out_stage = engine.stage_graph.num_stages - 1
    if engine.stage_id != out_stage:
        return {}
    from gpp_deepspeed.schedule.ir import Action, ActionKind as K

    posted = {}   # (sender stage, mb) -> when the action holding SEND_F(mb)@out_stage started
    for stage, spans in every:
        for text, t0, _ in spans:
            for op in Action.parse(text).transfers:
                if op.kind is K.SEND_F and op.peer == out_stage:
                    posted[(stage, op.mb_idx)] = t0
    waiting = working = 0.0
    messages = groups = 0
    waited = {a.completion for a, _, _ in mine if a.kind.spec.completes}
    senders = engine.stage_graph.preds(out_stage)
    for a, t0, t1 in mine:
        recvs = ([(op.peer, op.mb_idx) for op in a.transfers if op.kind is K.RECV_F and op.completion not in waited]
                 if a.kind.is_transfer else [(p, a.mb_idx) for p in senders] if a.kind is K.WAIT_F else [])
        if not recvs:
            continue
        ready = max(posted[key] for key in recvs)
        waiting += min(max(ready - t0, 0.0), t1 - t0)
        working += t1 - max(ready, t0)
        messages += len(recvs) if a.kind is K.WAIT_F else len(a.transfers)
        groups += 1
    transfers = [(a, t0, t1) for a, t0, t1 in mine if a.kind.is_transfer or a.kind.spec.completes]
    return {"stage": engine.stage_id, "wall": mine[-1][2] - mine[0][1],
            "transfer_s": sum(t1 - t0 for _, t0, t1 in transfers), "waiting_s": waiting, "working_s": working,
            "recv_groups": groups, "recv_group_messages": messages,
            "messages": sum(len(a.transfers) for a, _, _ in transfers if a.kind.is_transfer), "actions": len(mine)}


def skip_deepspeed_forward() -> None:
    """An experiment, not a way to train: ``DeepSpeedEngine.forward`` replaced by the bare call of
    the module's ``forward`` (no DeepSpeed hooks, timers, autocast or output hooks), in this
    process, to measure what DeepSpeed's forward wrapper costs a step of ours. Right only for what
    this benchmark runs (fp32, no ZeRO, no profiler): ``--skip-deepspeed-forward``."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    DeepSpeedEngine.forward = lambda self, *inputs, **kwargs: self.module.forward(*inputs, **kwargs)


def worker(branches: int, rounds: int, out: str, profile: bool = False) -> None:
    import cProfile
    import pstats
    import torch
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    if os.environ.get("GPP_STRICT_P2P") == "1":
        sys.path.insert(0, str(ROOT / "tests"))
        import strict_p2p

        strict_p2p.install()
    if os.environ.get("GPP_BENCH_SKIP_DS_FORWARD") == "1":
        skip_deepspeed_forward()
    unit = peers.sleep_unit_class()
    built = {name: build(name, branches, unit) for name in VARIANTS}
    chain = topology("chain", branches)
    built[TORCH] = (peers.build_torch(chain, "1F1B", unit, peers.batches(1)[2])[0], None)
    times = {name: [] for name in built}
    costs = {name: [] for name in built}
    profiler = cProfile.Profile() if profile and torch.distributed.get_rank() == branches else None
    for r in range(rounds):
        for name, (step, engine) in built.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            if profiler is not None and name == "fanin" and r:
                profiler.enable()
            step()
            if profiler is not None:
                profiler.disable()
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - start)
            if engine is not None:
                costs[name].append(stage_costs(engine))
        if torch.distributed.get_rank() == 0:
            print(f"round {r}: " + " ".join(f"{k}={v[-1] * 1e3:.0f}" for k, v in times.items()), flush=True)
    if profiler is not None:   # the output stage's own time per step, sleeps left out
        stats = pstats.Stats(profiler)
        stats.stats = {k: v for k, v in stats.stats.items() if "sleep" not in k[2]}
        print(f"output stage of fanin, own time over {rounds - 1} steps:", flush=True)
        stats.sort_stats("tottime").print_stats(25)
    results = {}
    for name, (_, engine) in built.items():
        if engine is None:   # torch's: its step and the chain's simulated one (above)
            results[name] = {"times": times[name], "predicted": results["chain"]["predicted"]}
            continue
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, costs[name][1:] or costs[name])
        suffix = name[len(peers.variant(name)[0]):]   # the variant's receives, on the schedule it runs
        results[name] = {"times": times[name], "predicted": peers.predicted(engine, "1f1b" + suffix, topology(peers.variant(name)[0], branches)),
                         "replayed": peers.replayed(engine, "1f1b" + suffix),
                         "depth": engine.stage_graph.pipeline_depth, "costs": gathered,
                         "output_stage": engine.stage_graph.num_stages - 1}
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def summarize(results: dict) -> dict:
    """Per variant: median step, simulated step, ratio, the output stage's transfer share and messages."""
    rows = {}
    for name, r in results.items():
        median = statistics.median(r["times"][1:] or r["times"])
        if "costs" not in r:   # torch's row: its step only
            rows[name] = {"median_ms": 1e3 * median, "predicted_ms": 1e3 * r["predicted"],
                          "ratio": median / r["predicted"]}
            continue
        out = [c for c in next(cs for cs in r["costs"] if cs and cs[0]) if c]
        med = lambda key: 1e3 * statistics.median(c[key] for c in out)  # noqa: E731
        rows[name] = {"median_ms": 1e3 * median, "predicted_ms": 1e3 * r["predicted"], "ratio": median / r["predicted"],
                      "replayed_ms": 1e3 * r["replayed"] if "replayed" in r else None,
                      "depth": r["depth"], "transfer_ms": med("transfer_s"), "waiting_ms": med("waiting_s"),
                      "working_ms": med("working_s"), "messages": out[0]["messages"],
                      "us_per_message": 1e3 * med("working_s") / out[0]["recv_group_messages"]}
    return rows


def table(rows: dict) -> str:
    lines = ["| variant | depth | median step (ms) | simulated (ms) | measured / simulated | replayed (ms) "
             "| measured / replayed | output stage: in transfers (ms) | of which waiting for a peer's send "
             "| of which after every send was posted | per message (us) | messages |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        replayed = r.get("replayed_ms")   # runs saved before the column have none, torch's row neither
        head = f"| {name} | {r.get('depth', '')} | {r['median_ms']:.1f} | {r['predicted_ms']:.1f} | {r['ratio']:.3f} | "
        if "transfer_ms" not in r:
            lines.append(head + " | | | | | | |")
            continue
        lines.append(head + (f"{replayed:.1f} | {r['median_ms'] / replayed:.3f} | " if replayed else " | | ")
                     + f"{r['transfer_ms']:.1f} | {r['waiting_ms']:.1f} | {r['working_ms']:.1f} | "
                     f"{r['us_per_message']:.0f} | {r['messages']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="a fan-in stage against a chain of the same layers")
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--label", default="", help="a name for this run in the results file")
    parser.add_argument("--table-only", action="store_true", help="rewrite results/fanin.md from the saved runs")
    parser.add_argument("--strict", action="store_true", help="run under tests/strict_p2p.py (NCCL's semantics)")
    parser.add_argument("--skip-deepspeed-forward", action="store_true",
                        help="an experiment: our engine without DeepSpeed's forward wrapper (skip_deepspeed_forward)")
    parser.add_argument("--profile", action="store_true", help="cProfile the output stage (printed in its log)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.branches, args.rounds, args.out, args.profile)
    if args.table_only:
        return write_section()
    sys.path.insert(0, str(ROOT / "tests"))
    from dist import launch

    tmp = ROOT / "benchmarks" / "results" / "tmp"
    out = tmp / f"fanin_{args.branches}.json"
    load = os.getloadavg()[0]
    res = launch(args.branches + 1, Path(__file__), "--worker", "--branches", str(args.branches), "--rounds",
                 str(args.rounds), "--out", str(out), *(["--profile"] if args.profile else []),
                 timeout=900 + 60 * args.rounds, log_dir=tmp / "logs" / "fanin",
                 env={**({"GPP_STRICT_P2P": "1"} if args.strict else {}),
                      **({"GPP_BENCH_SKIP_DS_FORWARD": "1"} if args.skip_deepspeed_forward else {})} or None)
    if args.profile:
        print(res.outputs[args.branches][-6000:])
    if not res.ok:
        raise SystemExit(res.report())
    rows = summarize(json.loads(out.read_text()))
    strict = ", strict transport" if args.strict else ""
    print(f"{args.branches} branches, {args.rounds} rounds{strict}, load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(table(rows))
    path = ROOT / "benchmarks" / "results" / f"fanin_{args.branches}.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    saved[args.label or time.strftime("%Y-%m-%d %H:%M")] = {"rounds": args.rounds, "load_average": load,
                                                             "strict": args.strict, "rows": rows}
    path.write_text(json.dumps(saved, indent=1))
    write_section()


def write_section() -> None:
    """``benchmarks/results/fanin.md``, the section of docs/benchmarks.md: every saved run."""
    lines = ["## A fan-in stage against a chain of the same layers (fanin.py)", "",
             "`python benchmarks/fanin.py --branches N [--strict]` (issue 28, point 5). One launch of N + 1 gloo "
             "ranks trains a DAG whose output stage takes N one-layer branches and a chain of the same N + 1 "
             "layers, one 1F1B step of each per round (16 micro-batches; each layer's forward, input gradient and "
             "weight gradient sleep 20 ms); medians after the first round. The output stage's time in transfer "
             "actions is split by the timelines of every rank: before the last sender had posted the matching send "
             "(waiting for a peer: what coupling to the slowest branch would cost), and after (the transport's own "
             "work, per message of the receiving actions). `--strict` runs it under `tests/strict_p2p.py` (NCCL's "
             "semantics). The machine was shared with other jobs (load averages in the run column). Since issue 28's "
             "early receives, each variant also runs with its receives completed in place (`early_receives` false, "
             "the transport before); with receives posted early, the output stage's transfer time counts its waits "
             "(`WAIT_F`), and a wait's time after every send was posted is what was left of the messages once the "
             "compute before it ended. Since 2026-12-02: \"replayed\" is the simulator's step for the program with "
             "each compute action priced at what it took in the last step (`peers.replayed`: the layers' sleeps as "
             "they overshot, their own Python, DeepSpeed's and our wrappers), so measured over replayed is what the "
             "runtime adds between compute; and torch.distributed.pipelining's `Schedule1F1B` runs the chain in the "
             "same launch (one layer per rank; simulated: the chain's 1F1B, the same order on the same sleeps), the "
             "reference for measured over simulated.", ""]
    for path in sorted((ROOT / "benchmarks" / "results").glob("fanin_*.json")):
        branches = int(path.stem.split("_")[1])
        for label, run in json.loads(path.read_text()).items():
            lines += [f"{branches} branches, {label} ({run['rounds']} rounds, load average "
                      f"{run['load_average']:.1f} at the start):", "", table(run["rows"]), ""]
    text = "\n".join(lines)
    if report.notes("fanin"):
        text = text.rstrip("\n") + "\n\n" + report.notes("fanin")
    (ROOT / "benchmarks" / "results" / "fanin.md").write_text(text)


if __name__ == "__main__":
    main()
