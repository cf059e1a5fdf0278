"""What the engine's communication costs on this machine, measured apart: the numbers the simulator
needs to price a gloo run (issue 22, point 4).

Four measurements on real gloo processes, each a median over ``--repeats`` rounds:

1. **A message** between two stages: one rank sends an edge's activations to another with the
   engine's own transport (``EdgeTransport.exchange``: packed into one buffer, as the engine sends
   them) and the peer sends them back; half the round trip, at several sizes, fitted to
   ``alpha + beta * bytes``. Once with only those two processes busy, once with every pair of the
   world exchanging at the same time (what a pipeline does), which is what 2 cores shared by 16
   processes cost.
2. **A fan-in**: ``k`` ranks each send one message to one rank, which receives them in one grouped
   exchange (as a merge stage does); the receiver's time per message against ``k``.
3. **An all-reduce** of a stage's gradients among ``g`` ranks (``deepspeed.comm.all_reduce`` on a
   group, what ``REDUCE_GRAD`` runs), against ``g``.
4. **A broadcast over the whole pipeline** (the engine's loss aggregation at the end of a batch).

    python benchmarks/transport_costs.py --world 16      # writes benchmarks/results/transport_costs.json

Run it on a quiet machine (``/work/bin/slot --exclusive``): every figure is wall clock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

SIZES = (32, 1024, 32 * 1024, 256 * 1024)   # bytes per message
FAN_IN = (1, 2, 4, 8)
GROUPS = (2, 4, 8)
GRAD_FLOATS = 8 * 72   # a stage of eight 8x8 linear layers: the planned-runs emulation


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(repeats: int, out: str) -> None:
    import deepspeed
    import torch
    from deepspeed import comm as dist

    from gpp_deepspeed.engine.p2p import EdgeTransport, Incoming, Outgoing

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    transport = EdgeTransport(None, torch.device("cpu"), stage=rank, timeout_s=120)
    results: dict = {"world": world}

    def ping_pong(peer: int, nbytes: int, first: bool) -> None:
        t = torch.zeros(max(1, nbytes // 4))
        edge = (nbytes, min(rank, peer))   # one edge per size: its layout is sent once
        send = [Outgoing(peer=peer, edge=edge, tensors=[t], arity=[-1], rank=peer)]
        recv = [Incoming(peer=peer, edge=edge, rank=peer)]
        if first:
            transport.exchange(send, [], always_layout=False)
            transport.exchange([], recv, always_layout=False)
        else:
            transport.exchange([], recv, always_layout=False)
            transport.exchange(send, [], always_layout=False)
        transport.wait_sends()

    # 1. messages: pair (0, 1) alone, then every pair (2i, 2i + 1) at once
    for label, active in (("alone", {0, 1}), ("all_pairs", set(range(world - world % 2)))):
        per_size = {}
        for nbytes in SIZES:
            dist.barrier()
            if rank in active:
                peer = rank ^ 1
                ping_pong(peer, nbytes, rank % 2 == 0)   # the layout goes once, before timing
                per_size[nbytes] = _median_time(lambda: ping_pong(peer, nbytes, rank % 2 == 0), repeats) / 2
            dist.barrier()
        if rank == 0:
            results[f"message_{label}_s"] = per_size

    # 2. fan-in: ranks 1..k send to rank 0 in one grouped exchange there
    fan = {}
    for k in FAN_IN:
        if k >= world:
            continue
        samples = []
        for i in range(repeats + 1):
            t = torch.zeros(GRAD_FLOATS)
            dist.barrier()
            if rank == 0:
                time.sleep(0.01)   # every sender is waiting on its send: time the receiving side
                start = time.perf_counter()
                transport.exchange([], [Incoming(peer=p, edge=(p, 0), rank=p) for p in range(1, k + 1)],
                                   always_layout=False)
                if i:
                    samples.append(time.perf_counter() - start)
            elif rank <= k:
                transport.exchange([Outgoing(peer=0, edge=(rank, 0), tensors=[t], arity=[-1], rank=0)], [],
                                   always_layout=False)
                transport.wait_sends()
        if rank == 0:
            fan[k] = statistics.median(samples)
    results["fan_in_s"] = fan

    # 3. all-reduce among the first g ranks; 4. broadcast over every rank
    reduce = {}
    for g in GROUPS:
        if g > world:
            continue
        group = dist.new_group(list(range(g)))
        grad = torch.zeros(GRAD_FLOATS)
        dist.barrier()
        if rank < g:
            dist.all_reduce(grad, group=group)
            reduce[g] = _median_time(lambda: dist.all_reduce(grad, group=group), repeats)
        dist.barrier()
    results["allreduce_s"] = reduce
    losses = torch.zeros(2)
    dist.barrier()
    results["broadcast_all_s"] = _median_time(lambda: dist.broadcast(losses, src=world - 1), repeats)
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.barrier()


def fit(per_size: dict) -> tuple[float, float]:
    """Least-squares ``alpha + beta * bytes`` through the measured sizes."""
    xs = [float(x) for x in per_size]
    ys = list(per_size.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - beta * mx, beta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.repeats, args.out)
    from dist import launch

    with tempfile.TemporaryDirectory(prefix="gpp_transport_") as tmp:
        out = Path(tmp) / "out.json"
        res = launch(args.world, Path(__file__), "--worker", "--repeats", str(args.repeats), "--out", str(out),
                     timeout=900, log_dir=Path(tmp) / "logs")
        if not res.ok:
            raise SystemExit(res.report())
        data = json.loads(out.read_text())
    data = {"world": data["world"], **{k: {int(x): y for x, y in v.items()} if isinstance(v, dict) else v
                                       for k, v in data.items() if k != "world"}}
    for label in ("alone", "all_pairs"):
        alpha, beta = fit(data[f"message_{label}_s"])
        data[f"message_{label}_fit"] = {"alpha_s": alpha, "beta_s_per_byte": beta}
    path = ROOT / "benchmarks" / "results" / "transport_costs.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[str(args.world)] = data
    path.write_text(json.dumps(runs, indent=1))
    print(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
