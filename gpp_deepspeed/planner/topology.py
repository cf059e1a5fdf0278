"""Topology-aware mapping: which concrete devices run which stage of a plan.

A plan says how many devices each stage gets; on a real cluster the links between devices differ
(NVLink islands, PCIe, InfiniBand), so *which* devices matter: a stage's all-reduce runs over the
ring of its replicas, and every stage edge sends activations from one stage's replicas to the
next's. "Efficient Pipeline Planning for Expedited Distributed DNN Training" (Luo et al., INFOCOM
2022) maps stages onto a connectivity graph of devices to minimise the iteration time; this module
does that for our plans:

* :class:`Topology`: an affine link fit (:class:`~gpp_deepspeed.planner.costs.CommFit`) for every
  pair of devices; from a file, or :meth:`Topology.two_level` for hosts of ``k`` GPUs (a hostfile).
* :func:`placement_time`: a plan's iteration time with stage ``s`` on devices ``placement[s]``:
  the stages' compute from the shared cost model (its links priced free), plus every stage edge's
  bytes (:func:`~gpp_deepspeed.planner.costs.edge_bytes`) in the messages the engine sends between
  the replicas that exchange them (busy at both ends, in flight the slowest link's latency), and
  each stage's ring all-reduce
  (:func:`~gpp_deepspeed.planner.costs.allreduce_time`) over its own ring, all run through the
  same schedule simulator as every plan.
* :func:`place`: the placement of least iteration time: exhaustive when the ordered placements
  are few, else pairwise-swap descent from the contiguous placement (the paper's heuristic is
  likewise a local search over device assignments).

The placement travels in the plan (``Plan.placement``); :func:`rank_order` turns it into the rank
permutation a launcher applies (``launch/README.md``: rank ``r`` of the engine's contiguous layout
runs on device ``rank_order[r]``), and :func:`mpiexec_segments` into an MPICH command that does so.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from ..errors import GPPConfigError
from ..graph.placement import reshard
from .costs import CommFit, CostDB, StageCostModel, allreduce_time, edge_bytes, zero_collectives
from .plan import Plan
from .simulate import simulate_plan

__all__ = ["Topology", "placement_time", "place", "contiguous", "rank_order", "mpiexec_segments"]

_EXHAUSTIVE = 20_000


@dataclass(frozen=True)
class Topology:
    """``links[i][j]``: the link from device ``i`` to device ``j``; ``hosts[i]``: device ``i``'s
    host name and ``gpus[i]`` its index on that host (for launching)."""

    links: tuple[tuple[CommFit, ...], ...]
    hosts: tuple[str, ...] = ()
    gpus: tuple[int, ...] = ()

    @property
    def num_devices(self) -> int:
        return len(self.links)

    @classmethod
    def two_level(cls, hosts: Sequence[str], gpus_per_node: int, *, intra: CommFit, inter: CommFit) -> "Topology":
        """Hosts of ``gpus_per_node`` devices each: ``intra`` inside a host, ``inter`` across."""
        where = [(h, g) for h in hosts for g in range(gpus_per_node)]
        links = tuple(tuple(intra if a[0] == b[0] else inter for b in where) for a in where)
        return cls(links, tuple(h for h, _ in where), tuple(g for _, g in where))

    @classmethod
    def from_hostfile(cls, path: str | Path, *, intra: CommFit, inter: CommFit) -> "Topology":
        """A DeepSpeed/MPI hostfile (``host slots=k`` per line) as a two-level topology."""
        hosts, slots = [], set()
        for line in Path(path).read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                host, _, rest = line.partition(" ")
                if not rest.strip().startswith("slots="):
                    raise GPPConfigError(f'hostfile {path}: line "{line}" is not "<host> slots=<n>"')
                hosts.append(host)
                slots.add(int(rest.strip()[len("slots="):]))
        if len(slots) != 1:
            raise GPPConfigError(f"hostfile {path}: hosts have different slot counts {sorted(slots)}")
        return cls.two_level(hosts, slots.pop(), intra=intra, inter=inter)

    @classmethod
    def load(cls, path: str | Path) -> "Topology":
        """``{"devices": N, "default": {"alpha_s", "beta_s_per_byte"[, "overhead_s"]}, "links": [[i, j,
        alpha_s, beta_s_per_byte[, overhead_s]], ...]}`` (links symmetric unless both directions are
        given; ``overhead_s``: :class:`~gpp_deepspeed.planner.costs.CommFit`'s)."""
        d = json.loads(Path(path).read_text())
        n, default = d["devices"], CommFit(**d["default"])
        links = [[default] * n for _ in range(n)]
        for i, j, alpha, beta, *overhead in d.get("links", ()):
            if not (0 <= i < n and 0 <= j < n):
                raise GPPConfigError(f"topology {path}: link {i}-{j} names a device outside 0..{n - 1}")
            links[i][j] = links[j][i] = CommFit(alpha_s=alpha, beta_s_per_byte=beta, overhead_s=(overhead or [None])[0])
        return cls(tuple(map(tuple, links)))


def contiguous(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """Stage ``s`` on the next ``devices`` device ids: what launching in rank order gives."""
    out, start = [], 0
    for s in plan.stages:
        out.append(tuple(range(start, start + s.devices)))
        start += s.devices
    return tuple(out)


def _edge_times(topo: Topology, placement: Sequence[Sequence[int]], micro_batch: int,
                edges: dict[tuple[int, int], float]) -> tuple[list[float], CommFit]:
    """Per stage: seconds its busiest replica is busy with one micro-batch's messages, each
    direction, and the link of the longest time in flight among those they use.

    Every edge moves what the engine sends (:func:`~gpp_deepspeed.graph.placement.reshard`): each
    producer replica sends its own rows to the consumer replicas that hold them, one message per
    pair, over that pair's link (:meth:`~gpp_deepspeed.planner.costs.CommFit.busy` at both ends);
    a stage waits for its busiest replica. Activations forward and their gradients backward take
    the same time.
    """
    busy = [[0.0] * len(p) for p in placement]
    slowest = CommFit(alpha_s=0.0, beta_s_per_byte=0.0)
    for (u, v), nbytes in edges.items():
        a, c = placement[u], placement[v]
        for t in reshard(math.lcm(len(a), len(c)), num_src=len(a), num_dst=len(c)):
            rows = micro_batch * (t.stop - t.start) / math.lcm(len(a), len(c))
            link = topo.links[a[t.src_idx]][c[t.dst_idx]]
            dt = link.busy(nbytes * rows)
            busy[u][t.src_idx] += dt
            busy[v][t.dst_idx] += dt
            if nbytes > 0 and (link.latency_s, link.late_receive_s) > (slowest.latency_s, slowest.late_receive_s):
                slowest = link
    return [max(b) for b in busy], slowest


def _ring_collectives(topo: Topology, ring: Sequence[int], param_bytes: float, zero_stage: int) -> list[float]:
    """The group's collectives in the placement's ring order, every step as slow as the ring's
    slowest link: seconds once per mini-batch, then per micro-batch with F, before I and after W
    (:func:`~gpp_deepspeed.planner.costs.zero_collectives`; ZeRO-0/1: the ring all-reduce,
    :func:`~gpp_deepspeed.planner.costs.allreduce_time`)."""
    n = len(ring)
    if n < 2:
        return [0.0] * 4
    slowest = max((topo.links[ring[i]][ring[(i + 1) % n]] for i in range(n)), key=lambda link: link.time(param_bytes / n))
    if zero_stage <= 1:
        return [allreduce_time(slowest, n, param_bytes), 0.0, 0.0, 0.0]
    return [0.0 if param_bytes <= 0 else latency + per_byte * param_bytes
            for latency, per_byte in zero_collectives(slowest, n, zero_stage=zero_stage)]


def placement_time(plan: Plan, db: CostDB, topo: Topology, placement: Sequence[Sequence[int]]) -> float:
    """Iteration time of ``plan`` with stage ``s`` on devices ``placement[s]``."""
    free = CommFit(alpha_s=0.0, beta_s_per_byte=0.0)
    compute_db = replace(db, hardware=replace(db.hardware, intra=free, inter=free, collective=None))
    cm = StageCostModel(compute_db, plan.mini_batch, p2p_devices=plan.num_devices, zero_stage=plan.zero_stage)
    edges = edge_bytes(db, plan.stage_of, relay=plan.pipeline == "chain")
    comm, slowest = _edge_times(topo, placement, plan.micro_batch, edges)
    costs = []
    for s, stage in enumerate(plan.stages):
        # A stage's TP all-reduces are priced on free links here (its TP group sits in one node;
        # the placement moves stages, not the links inside a TP group).
        c = cm.stage(cm.mask_of(stage.layers), plan.micro_batch, stage.devices, recompute=stage.recompute,
                     tp=stage.tp)
        step, ag_fwd, ag_bwd, rs_bwd = _ring_collectives(topo, placement[s], c.param_bytes, plan.zero_stage)
        costs.append(replace(c, fwd_s=c.fwd_s + comm[s] + ag_fwd, bwd_s=c.bwd_s + comm[s] + ag_bwd + rs_bwd,
                             bwd_input_s=c.bwd_input_s + comm[s] + ag_bwd, bwd_weight_s=c.bwd_weight_s + rs_bwd,
                             allreduce_s=step))
    return simulate_plan(plan, db, stage_costs=costs, link=slowest).prediction.iteration_time_s


def _distinct(counts: Sequence[int], n: int) -> int:
    """Ordered placements: replica order matters (it pairs replicas across an edge, and it is the
    all-reduce's ring)."""
    return math.perm(n, sum(counts))


def place(plan: Plan, db: CostDB, topo: Topology) -> tuple[tuple[tuple[int, ...], ...], float]:
    """The placement of least :func:`placement_time`, and that time."""
    counts = [s.devices for s in plan.stages]
    n = topo.num_devices
    if sum(counts) > n:
        raise GPPConfigError(f"plan needs {sum(counts)} devices but the topology has {n}")
    if _distinct(counts, n) <= _EXHAUSTIVE:
        best = min(_placements(counts, n), key=lambda p: placement_time(plan, db, topo, p))
        return best, placement_time(plan, db, topo, best)
    return _descend(plan, db, topo)


def _placements(counts: Sequence[int], n: int):
    """Every ordered assignment of disjoint devices to the stages' replicas."""
    for perm in itertools.permutations(range(n), sum(counts)):
        out, start = [], 0
        for c in counts:
            out.append(perm[start:start + c])
            start += c
        yield tuple(out)


def _descend(plan: Plan, db: CostDB, topo: Topology):
    """Pairwise swaps of devices between stages (and with idle devices) from the contiguous
    placement while any lowers the iteration time."""
    current = [list(p) for p in contiguous(plan)]
    idle = [d for d in range(topo.num_devices) if all(d not in p for p in current)]
    slots = [(s, i) for s, p in enumerate(current) for i in range(len(p))] + [(-1, i) for i in range(len(idle))]
    best = placement_time(plan, db, topo, current)
    improved = True
    while improved:
        improved = False
        for (s1, i1), (s2, i2) in itertools.combinations(slots, 2):
            if s1 == s2 or s1 == -1:
                continue
            a = current[s1] if s1 >= 0 else idle
            c = current[s2] if s2 >= 0 else idle
            a[i1], c[i2] = c[i2], a[i1]
            t = placement_time(plan, db, topo, current)
            if t < best * (1 - 1e-12):
                best, improved = t, True
            else:
                a[i1], c[i2] = c[i2], a[i1]
    return tuple(tuple(p) for p in current), best


def rank_order(plan: Plan) -> tuple[int, ...]:
    """The rank permutation: the engine runs stage 0 on ranks ``0..d0-1``, stage 1 on the next
    ``d1`` and so on; rank ``r`` must run on device ``rank_order(plan)[r]``."""
    placement = plan.placement or contiguous(plan)
    return tuple(d for p in placement for d in p)


def mpiexec_segments(plan: Plan, topo: Topology, command: Sequence[str]) -> list[str]:
    """An MPICH ``mpiexec`` MPMD command line that starts rank ``r`` on ``rank_order[r]``: one
    segment per run of consecutive ranks on one host (MPICH numbers ranks in segment order), and
    on each host ``CUDA_VISIBLE_DEVICES`` lists that host's GPUs in the order of its ranks (the
    ``LOCAL_RANK`` DeepSpeed's MPI discovery gives is that order)."""
    if not topo.hosts:
        raise GPPConfigError("the topology has no host names (build it from a hostfile)")
    order = rank_order(plan)
    per_host: dict[str, list[str]] = {}
    for d in order:
        per_host.setdefault(topo.hosts[d], []).append(str(topo.gpus[d]))
    argv = ["mpiexec"]
    for host, run in itertools.groupby(order, key=lambda d: topo.hosts[d]):
        k = len(list(run))
        if len(argv) > 1:
            argv.append(":")
        argv += ["-n", str(k), "-host", host, "-env", "CUDA_VISIBLE_DEVICES", ",".join(per_host[host]), *command]
    return argv
