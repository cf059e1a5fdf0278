"""What the engine's communication costs on this machine, measured apart: the numbers the simulator
needs to price a gloo run (issue 22, point 4).

Every figure is a median over ``--repeats`` rounds on real gloo processes, with the engine's own
transport (``EdgeTransport.exchange``: an edge's tensors packed into one buffer, every transfer of
an action posted together, as the engine runs a transfer action):

1. **A message** between two stages: one rank sends to another and the peer sends back; half the
   round trip, at several sizes, fitted to ``alpha + beta * bytes``. Once with only those two
   processes busy, once with every pair of the world exchanging at the same time (what a pipeline
   does), which is what 2 cores shared by 16 processes cost.
2. **A fan-in, the senders first**: ``k`` ranks post one message each to one rank, which then
   receives them in one grouped exchange (as a merge stage does when its branches are ahead of it);
   gloo moves a message only once both ends are posted (its TCP pair answers a send posted first
   with a "receive ready" notice, and only then gets the data), so what counts is the time from the
   later of the receives' posting and the last send's (each message carries the time its send was
   posted: ``time.perf_counter`` is the system-wide monotonic clock on Linux) to the group's
   completion, against ``k``, fitted to ``latency + k * busy``: the latency the group pays once
   and the receiver's busy time per message.
3. **A fan-in, the receiver first**: the same with the receives posted a moment before the sends
   (a stage waiting on its inputs).
4. **A fan-out's posting**: one rank posts ``k`` sends in one exchange (the receivers post later);
   the wall time the sender spends against ``k``, whose slope is the sender's busy time per message.
5. **An all-reduce** of a stage's gradients among ``g`` ranks (``deepspeed.comm.all_reduce`` on a
   group, what ``REDUCE_GRAD`` runs), against ``g``.
6. **A broadcast over the whole pipeline** (the engine's loss aggregation at the end of a batch).

From 2-4 the message model the simulator uses (:class:`~gpp_deepspeed.planner.costs.CommFit`,
LogP's split of a message into busy overhead at each end and latency in flight; Culler et al.,
PPoPP 1993): ``overhead_s`` is the mean of the sender's and the receiver's busy time per message,
``latency_s`` the latency with the receiver first (after the send is posted), and
``late_receive_s`` what the senders-first latency adds to it (after the receive is posted: gloo's
receive-ready notice and its answer, one exchange more). On a quiet machine the two latencies are
about equal; on a loaded one the extra exchange waits for a sleeping process to be scheduled.

    python benchmarks/transport_costs.py --world 16      # writes benchmarks/results/transport_costs.json

Run it on a quiet machine: every figure is wall clock.
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
FAN_IN = (1, 2, 3, 4, 6, 8)
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
        send = [Outgoing(peer=peer, rank=peer, buffers=[t])]
        recv = [Incoming(peer=peer, rank=peer, buffers=[torch.empty_like(t)])]   # sized as the engine's are
        if first:
            transport.exchange(send, [])
            transport.exchange([], recv)
        else:
            transport.exchange([], recv)
            transport.exchange(send, [])
        transport.wait_sends()

    # 1. messages: pair (0, 1) alone, then every pair (2i, 2i + 1) at once
    for label, active in (("alone", {0, 1}), ("all_pairs", set(range(world - world % 2)))):
        per_size = {}
        for nbytes in SIZES:
            dist.barrier()
            if rank in active:
                peer = rank ^ 1
                ping_pong(peer, nbytes, rank % 2 == 0)   # one round before timing
                per_size[nbytes] = _median_time(lambda: ping_pong(peer, nbytes, rank % 2 == 0), repeats) / 2
            dist.barrier()
        if rank == 0:
            results[f"message_{label}_s"] = per_size

    # 2-4. fan-in (the senders first, then the receiver first) and a fan-out's posting, k = 1..
    fan = {"senders_first": {}, "receiver_first": {}, "posting": {}}
    for k in FAN_IN:
        if k >= world:
            continue
        for key, samples in fan_round(transport, k, repeats).items():
            if rank == 0:
                fan[key][k] = statistics.median(samples)
    results.update({f"fan_in_{key}_s": v for key, v in fan.items()})

    # 5. all-reduce among the first g ranks; 6. broadcast over every rank
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


def fan_round(transport, k: int, repeats: int) -> dict[str, list[float]]:
    """Rank 0's samples of measurements 2-4 with ranks ``1..k`` as its peers (one warm-up round
    each); every rank must call it."""
    import torch
    from deepspeed import comm as dist

    from gpp_deepspeed.engine.p2p import Incoming, Outgoing

    rank = dist.get_rank()
    peers = range(1, k + 1)
    out = {"senders_first": [], "receiver_first": [], "posting": []}
    pause = 0.01   # long enough for the other side to be posted, on a loaded machine too


    def receive_all() -> float:
        """Rank 0: post the k receives as one group; seconds from the later of that and the last
        send's posting (each message carries it) to the group's completion."""
        start = time.perf_counter()
        got = [Incoming(peer=p, rank=p, buffers=[torch.empty(GRAD_FLOATS, dtype=torch.float64)]) for p in peers]
        transport.exchange([], got)
        return time.perf_counter() - max(start, max(float(m.buffers[0][0]) for m in got))

    def send_one(grad) -> None:
        grad[0] = time.perf_counter()
        transport.exchange([Outgoing(peer=0, rank=0, buffers=[grad])], [])
        transport.wait_sends()

    for i in range(repeats + 1):
        grad = torch.zeros(GRAD_FLOATS, dtype=torch.float64)
        # 2. the senders first: rank 0 receives k messages that are all waiting for it
        # 3. the receiver first: rank 0 waits for k messages sent a moment later
        for key, receiver_pause, sender_pause in (("senders_first", pause, 0.0), ("receiver_first", 0.0, pause)):
            dist.barrier()
            if rank == 0:
                time.sleep(receiver_pause)
                latency = receive_all()
                if i:
                    out[key].append(latency)
            elif rank <= k:
                time.sleep(sender_pause)
                send_one(grad)
        # 4. a fan-out's posting: rank 0's time to post k sends nobody has received yet
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            transport.exchange([Outgoing(peer=p, rank=p, buffers=[grad]) for p in peers], [])
            if i:
                out["posting"].append(time.perf_counter() - start)
            transport.wait_sends()
        elif rank <= k:
            time.sleep(pause)
            transport.exchange([], [Incoming(peer=0, rank=0, buffers=[torch.empty(GRAD_FLOATS, dtype=torch.float64)])])
    return out


def fit(per_size: dict) -> tuple[float, float]:
    """Least-squares ``alpha + beta * bytes`` through the measured sizes."""
    xs = [float(x) for x in per_size]
    ys = list(per_size.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - beta * mx, beta


def message_model(data: dict) -> dict:
    """The simulator's message model from the fan-in and fan-out measurements (module docstring):
    per-message busy time at each end (sender: posting; receiver: completing a group whose
    messages are all there), and the latency a group pays once after its later end is posted,
    the receiver first and the senders first."""
    latency_sf, recv_busy = fit(data["fan_in_senders_first_s"])
    latency_rf, _ = fit(data["fan_in_receiver_first_s"])
    _, send_busy = fit(data["fan_in_posting_s"])
    overhead = max(0.0, (max(0.0, recv_busy) + max(0.0, send_busy)) / 2)
    # The receiver first: the latency after the send; the senders first: the late receive's extra
    # exchange (gloo's receive-ready notice) on top of it.
    return {"overhead_s": overhead, "latency_s": max(0.0, latency_rf), "late_receive_s": max(0.0, latency_sf - latency_rf),
            "receive_busy_s": recv_busy, "send_busy_s": send_busy, "latency_receiver_first_s": latency_rf,
            "latency_senders_first_s": latency_sf}

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=40)
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
    data["message_model"] = message_model(data)
    path = ROOT / "benchmarks" / "results" / "transport_costs.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[str(args.world)] = data
    path.write_text(json.dumps(runs, indent=1))
    print(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
