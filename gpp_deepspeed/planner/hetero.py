"""Planning over heterogeneous devices (EdgePipe, arXiv 2110.14895), for training or inference.

A :class:`Cluster` is a few device classes (say A100s and V100s), each with a count, a compute
speed relative to the cost database's device (or a cost database of its own), a memory and its
links. A stage's replicas are of one class. EdgePipe partitions a model over such devices to
maximise pipeline throughput, for inference (forward only); the same search with training's stage
time and memory (forward, backward, all-reduce, in-flight stashes) plans training.

The search (:func:`hetero_search`) is a DP over contiguous ranges of a topological layer order,
as EdgePipe's and PipeDream's are (stages form a chain, run as a graph pipeline over the real
edges)::

    g(i, free, k) = least bottleneck TPS covering layers i.. with a chain of exactly k stages, using
                    at most ``free`` devices of each class (devices may stay idle, as in EdgePipe)
                  = min over j > i, class c, replicas r (a power of two dividing b, r <= free[c])
                    with layers i..j-1 fitting class c's memory at k micro-batches in flight
                    (training; one for inference):  max(TPS_c(i..j-1, b, r), g(j, free - r e_c, k - 1))
    g(L, free, 0) = 0

Every price comes from :class:`~gpp_deepspeed.planner.costs.StageCostModel` on the class's cost
database, and :func:`~gpp_deepspeed.planner.simulate.simulate_plan` times the plan with the same
per-class prices. ``docs/planner.md`` shows a cluster file.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from ..errors import GPPConfigError
from ._dp import flatten, narrow_bracket
from .costs import CommFit, CostDB, StageCostModel, micro_batch_sizes
from .plan import Plan, PlanStage, SearchResult
from .simulate import predict
from .sp import sp_tree

__all__ = ["DeviceClass", "Cluster", "hetero_search", "OBJECTIVES"]

OBJECTIVES = ("train", "inference")
_CLASS_KEYS = {"name", "count", "speed", "memory_bytes", "devices_per_node", "intra", "costs"}


@dataclass(frozen=True, kw_only=True)
class DeviceClass:
    """``count`` devices alike: ``speed`` times as fast as the cost database's device (its layer
    times are divided by it) or priced by ``costs``, their own database; ``memory_bytes``,
    ``devices_per_node`` and the ``intra``-node link default to the database's."""

    name: str
    count: int
    speed: float = 1.0
    memory_bytes: int | None = None
    devices_per_node: int | None = None
    intra: CommFit | None = None
    costs: CostDB | None = None


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Device classes and the link between their nodes (stage-to-stage traffic and all-reduces
    that leave a node use it; default: the cost database's inter-node link)."""

    classes: tuple[DeviceClass, ...]
    link: CommFit | None = None

    def __post_init__(self):
        names = [c.name for c in self.classes]
        if not names or len(set(names)) != len(names):
            raise GPPConfigError(f"a cluster needs device classes with distinct names, got {names}")
        for c in self.classes:
            if c.count < 1 or c.speed <= 0:
                raise GPPConfigError(f'device class "{c.name}": count must be >= 1 and speed > 0, '
                                     f"got {c.count} and {c.speed}")

    @property
    def num_devices(self) -> int:
        return sum(c.count for c in self.classes)

    def by_name(self, name: str | None) -> DeviceClass:
        for c in self.classes:
            if c.name == name:
                return c
        raise GPPConfigError(f'no device class "{name}" in the cluster; classes: {[c.name for c in self.classes]}')

    def class_costs(self, db: CostDB, name: str | None) -> CostDB:
        """``db`` as the devices of class ``name`` see it."""
        return _class_costs(db, self.by_name(name), self.link)

    def stage_model(self, db: CostDB, name: str | None, mini_batch: int, p2p_devices: int, *,
                    zero_stage: int = 0) -> StageCostModel:
        return StageCostModel(self.class_costs(db, name), mini_batch, p2p_devices=p2p_devices, zero_stage=zero_stage)

    @classmethod
    def load(cls, path: str | Path) -> "Cluster":
        """A cluster file: ``{"link": {"alpha_s", "beta_s_per_byte"}, "classes": [{"name", "count",
        "speed" | "costs": "db.json", "memory_bytes", "devices_per_node", "intra"}, ...]}``."""
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise GPPConfigError(f'cluster file "{path}": {e}') from None
        extra = set(d) - {"classes", "link"}
        if extra or "classes" not in d:
            raise GPPConfigError(f'cluster file "{path}": needs "classes" (and optionally "link"), got {sorted(d)}')
        classes = []
        for c in d["classes"]:
            bad = set(c) - _CLASS_KEYS
            if bad or "name" not in c or "count" not in c:
                raise GPPConfigError(f'cluster file "{path}": device class {c.get("name", c)} needs "name" and '
                                     f'"count", may have {sorted(_CLASS_KEYS)}; unknown: {sorted(bad)}')
            own = CostDB.load(path.parent / c["costs"]) if "costs" in c else None
            intra = CommFit(**c["intra"]) if "intra" in c else None
            classes.append(DeviceClass(**{**c, "intra": intra, "costs": own}))
        link = CommFit(**d["link"]) if "link" in d else None
        return cls(classes=tuple(classes), link=link)


@lru_cache(maxsize=64)
def _class_costs(db: CostDB, c: DeviceClass, link: CommFit | None) -> CostDB:
    if c.costs is not None:
        if [x.name for x in c.costs.layers] != [x.name for x in db.layers]:
            raise GPPConfigError(f'device class "{c.name}": its cost database has other layers than {db.model}\'s')
        base, speed = c.costs, 1.0
    else:
        base, speed = db, c.speed

    def scaled(values):
        return None if values is None else tuple(v / speed for v in values)

    layers = tuple(replace(x, fwd_s=scaled(x.fwd_s), bwd_s=scaled(x.bwd_s), bwd_input_s=scaled(x.bwd_input_s),
                           bwd_weight_s=scaled(x.bwd_weight_s)) for x in base.layers)
    hw = base.hardware
    hw = replace(hw, name=c.name, memory_bytes=c.memory_bytes or hw.memory_bytes,
                 devices_per_node=c.devices_per_node or hw.devices_per_node, intra=c.intra or hw.intra,
                 inter=link or hw.inter)
    return replace(base, layers=layers, hardware=hw, source=f"{base.source}; device class {c.name} (speed {speed:g}x)")


class _ChainDP:
    """:func:`hetero_search`'s DP at one micro-batch size (see the module docstring)."""

    def __init__(self, models: list[StageCostModel], counts: tuple[int, ...], b: int, train: bool):
        self.models, self.counts, self.b, self.train = models, counts, b, train
        self.L = models[0].num_layers
        self.replicas = [r for r in (1 << i for i in range(b.bit_length())) if b % r == 0]
        self.memo: dict = {}

    def stage_tps(self, c: int, i: int, j: int, r: int, k: int) -> float:
        cm = self.models[c]
        mask = ((1 << j) - 1) & ~((1 << i) - 1)
        if self.train:
            ok = cm.fits(mask, self.b, r, k)
            return cm.time_per_sample(mask, self.b, r) if ok else math.inf
        ok = cm.inference_memory(mask, self.b, r) <= cm.db.hardware.memory_bytes
        return cm.time_per_sample_inference(mask, self.b, r) if ok else math.inf

    def g(self, i: int, free: tuple[int, ...], k: int):
        """``(bottleneck, choice)`` for layers ``i..`` in exactly ``k`` chained stages."""
        if i == self.L:
            return (0.0, None) if k == 0 else (math.inf, None)
        if k == 0 or k > self.L - i:
            return math.inf, None
        key = (i, free, k)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        best = (math.inf, None)
        for j in range(i + 1, self.L - k + 2):
            for c, n_free in enumerate(free):
                for r in self.replicas:
                    if r > n_free:
                        break
                    t = self.stage_tps(c, i, j, r, k if self.train else 1)
                    if t >= best[0]:
                        continue
                    rest = self.g(j, free[:c] + (n_free - r,) + free[c + 1:], k - 1)[0]
                    if max(t, rest) < best[0]:
                        best = (max(t, rest), (j, c, r))
        self.memo[key] = best
        return best

    def solve(self):
        """The least bottleneck over every stage count, and its ``(i, j, class, replicas)`` stages."""
        best_k = min(range(1, self.L + 1), key=lambda k: self.g(0, self.counts, k)[0])
        tps = self.g(0, self.counts, best_k)[0]
        if math.isinf(tps):
            return None, None
        stages, i, free, k = [], 0, self.counts, best_k
        while i < self.L:
            j, c, r = self.g(i, free, k)[1]
            stages.append((i, j, c, r))
            i, free, k = j, free[:c] + (free[c] - r,) + free[c + 1:], k - 1
        return tps, stages


class _GraphDP:
    """GraphPipe's feasibility DP (:mod:`._dp`, Sec. 5) with the devices a vector over classes: at
    one micro-batch size and target ``tmax``, the least in-flight count of a subgraph's source
    stages when its stages use at most ``free[c]`` devices of each class ``c`` (devices may stay
    idle, as in EdgePipe) and its successors keep ``d`` micro-batches in flight.

    Tables (``free`` a tuple of counts per class)::

        series(v, j, free, d)     the children j.. of Series node v: one stage over children j..k-1
                                  on r replicas of one class, before the rest; or child j solved on
                                  its own with the rest as its successor, free split between them
        parallel(v, i, e, free, d) the children i..e-1 of Parallel node v: children i..t-1 as one
                                  stage beside the rest, or child i on its own beside the rest
                                  (max of the in-flight counts, Alg. 1's parallel case)

    A stage is therefore an SP-tree node or a range of a Series or Parallel node's children.
    """

    def __init__(self, models: list[StageCostModel], nodes, b: int, tmax: float, train: bool):
        self.models, self.nodes, self.b, self.tmax, self.train = models, nodes, b, tmax * (1 + 1e-12), train
        self.replicas = [r for r in (1 << i for i in range(b.bit_length())) if b % r == 0]
        self.memo: dict = {}
        # A stage of class c meeting tmax needs replicas >= its per-sample work on c / tmax (per-sample
        # work never falls as shards shrink), and class c does class 0's work at most speedup[c]
        # times faster: a subgraph whose class-0 work exceeds tmax * sum(free * speedup) is infeasible.
        per_layer = [[f + (bw if train else 0.0) for f, bw in cm.layer_times(b)] for cm in models]
        self.speedup = [max((w0 / wc for w0, wc in zip(per_layer[0], pc) if wc > 0), default=1.0) for pc in per_layer]
        self._need: dict[int, float] = {}

    def hopeless(self, mask: int, free: tuple[int, ...]) -> bool:
        need = self._need.get(mask)
        if need is None:
            cm = self.models[0]
            need = self._need[mask] = sum(
                sum(t[:2] if self.train else t[:1]) for i, t in enumerate(cm.layer_times(self.b)) if mask >> i & 1
            ) / self.b / self.tmax
        return need > sum(f * x for f, x in zip(free, self.speedup)) * (1 + 1e-9)

    def stage_ok(self, mask: int, c: int, r: int, k: int) -> bool:
        cm = self.models[c]
        if self.train:
            return cm.time_per_sample(mask, self.b, r) <= self.tmax and cm.fits(mask, self.b, r, k)
        return (cm.time_per_sample_inference(mask, self.b, r) <= self.tmax
                and cm.inference_memory(mask, self.b, r) <= cm.db.hardware.memory_bytes)

    def _stage(self, mask: int, free: tuple[int, ...], k: int):
        """Every ``(class, replicas)`` on which ``mask`` is one stage meeting tmax at depth ``k``."""
        for c, n_free in enumerate(free):
            for r in self.replicas:
                if r > n_free:
                    break
                if self.stage_ok(mask, c, r, k):
                    yield c, r

    def solve(self, v: int, free: tuple[int, ...], d: int):
        """``(k, choice)`` with the least source in-flight count, or None."""
        node = self.nodes[v]
        if node.kind == "leaf":
            return next(((d + 1, ("stage", c, r)) for c, r in self._stage(node.mask, free, d + 1)), None)
        if node.kind == "series":
            return self.series(v, 0, free, d)
        return self.parallel(v, 0, len(node.children), free, d)

    def series(self, v: int, j: int, free: tuple[int, ...], d: int):
        node = self.nodes[v]
        m = len(node.children)
        if j == m:
            return (d, None)
        key = ("s", node.cls, j, free, d)   # identical branches are solved once
        if key in self.memo:
            return self.memo[key]
        best = None
        if self.hopeless(node.mask & ~node.prefix[j], free):
            self.memo[key] = None
            return None
        for k in range(j + 1, m + 1):
            mask = node.prefix[k] & ~node.prefix[j]
            for c, n_free in enumerate(free):
                for r in self.replicas:
                    if r > n_free:
                        break
                    rest = self.series(v, k, _take(free, c, r), d)
                    if rest is not None and (best is None or rest[0] + 1 < best[0]) and \
                            self.stage_ok(mask, c, r, rest[0] + 1):
                        best = (rest[0] + 1, ("range", k, c, r))
        child = node.children[j]
        if self.nodes[child].kind != "leaf" and j + 1 < m:
            for mine in _splits(free):
                rest = self.series(v, j + 1, _minus(free, mine), d)
                if rest is None:
                    continue
                r = self.solve(child, mine, rest[0])
                if r is not None and (best is None or r[0] < best[0]):
                    best = (r[0], ("child", mine, rest[0]))
        self.memo[key] = best
        return best

    def parallel(self, v: int, i: int, e: int, free: tuple[int, ...], d: int):
        node = self.nodes[v]
        if e - i == 1:
            return self.solve(node.children[i], free, d)
        kids = tuple(self.nodes[c].cls for c in node.children[i:e])
        key = ("p", kids, free, d) if node.sym else ("p", v, i, e, free, d)
        if key in self.memo:
            return self.memo[key]
        best = None
        if self.hopeless(node.prefix[e] & ~node.prefix[i], free):
            self.memo[key] = None
            return None
        for t in range(i + 1, e + 1):
            group = node.prefix[t] & ~node.prefix[i]
            for c, r in self._stage(group, free, d + 1):
                rest = (d, None) if t == e else self.parallel(v, t, e, _take(free, c, r), d)
                if rest is not None and (best is None or max(d + 1, rest[0]) < best[0]):
                    best = (max(d + 1, rest[0]), ("group", t, c, r))
        if self.nodes[node.children[i]].kind != "leaf":
            for mine in _splits(free):
                k1 = self.solve(node.children[i], mine, d)
                k2 = self.parallel(v, i + 1, e, _minus(free, mine), d) if k1 is not None else None
                if k2 is not None and (best is None or max(k1[0], k2[0]) < best[0]):
                    best = (max(k1[0], k2[0]), ("child", mine))
        self.memo[key] = best
        return best

    def stages(self, v: int, free: tuple[int, ...], d: int) -> list[tuple[int, int, int]]:
        """The ``(mask, class, replicas)`` stages of a feasible ``solve(v, free, d)``."""
        node = self.nodes[v]
        if node.kind == "leaf":
            _, (_, c, r) = self.solve(v, free, d)
            return [(node.mask, c, r)]
        if node.kind == "series":
            return self._series_stages(v, 0, free, d)
        return self._parallel_stages(v, 0, len(node.children), free, d)

    def _series_stages(self, v, j, free, d):
        node = self.nodes[v]
        if j == len(node.children):
            return []
        choice = self.series(v, j, free, d)[1]
        if choice[0] == "range":
            _, k, c, r = choice
            return [(node.prefix[k] & ~node.prefix[j], c, r)] + self._series_stages(v, k, _take(free, c, r), d)
        _, mine, d_rest = choice
        return self.stages(node.children[j], mine, d_rest) + self._series_stages(v, j + 1, _minus(free, mine), d)

    def _parallel_stages(self, v, i, e, free, d):
        node = self.nodes[v]
        if e - i == 1:
            return self.stages(node.children[i], free, d)
        choice = self.parallel(v, i, e, free, d)[1]
        if choice[0] == "group":
            _, t, c, r = choice
            group = [(node.prefix[t] & ~node.prefix[i], c, r)]
            return group if t == e else group + self._parallel_stages(v, t, e, _take(free, c, r), d)
        _, mine = choice
        return self.stages(node.children[i], mine, d) + self._parallel_stages(v, i + 1, e, _minus(free, mine), d)


def _take(free: tuple[int, ...], c: int, r: int) -> tuple[int, ...]:
    return free[:c] + (free[c] - r,) + free[c + 1:]


def _minus(free: tuple[int, ...], used: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(f - u for f, u in zip(free, used))


def _splits(free: tuple[int, ...]):
    """Every ``mine <= free`` with at least one device, the rest going elsewhere."""
    for mine in itertools.product(*(range(f + 1) for f in free)):
        if any(mine):
            yield mine


def _graph_search(db: CostDB, cluster: Cluster, models: list[StageCostModel], b: int, train: bool,
                  upper: float | None, rel_tol: float = 1e-3):
    """The least bottleneck stage DAG at micro-batch ``b`` (binary search on tmax over
    :class:`_GraphDP`), its ``(mask, class, replicas)`` stages and the DP states visited."""
    tree, _ = sp_tree(db.graph)
    nodes = flatten(tree, models[0])
    root, counts = len(nodes) - 1, tuple(c.count for c in cluster.classes)
    states = 0

    def attempt(tmax):
        nonlocal states
        dp = _GraphDP(models, nodes, b, tmax, train)
        r = dp.solve(root, counts, 0)
        states += len(dp.memo)
        return None if r is None else dp.stages(root, counts, 0)

    def bottleneck(stages):
        return max(models[c].time_per_sample(m, b, r) if train else models[c].time_per_sample_inference(m, b, r)
                   for m, c, r in stages)

    slowest = max(range(len(models)), key=lambda c: models[c].time_per_sample(models[c].full_mask, b, 1))
    ceiling = 2 * (models[slowest].time_per_sample(models[slowest].full_mask, b, 1) if train else
                   models[slowest].time_per_sample_inference(models[slowest].full_mask, b, 1))
    hi = min(upper, ceiling) if upper else ceiling
    best = attempt(hi)
    while best is None and hi < ceiling:
        hi = min(2 * hi, ceiling)
        best = attempt(hi)
    if best is None:
        return None, None, states
    hi, best = narrow_bracket(attempt, bottleneck, 0.0, min(hi, bottleneck(best)), best, rel_tol=rel_tol)
    return hi, best, states


def hetero_search(db: CostDB, cluster: Cluster, *, mini_batch: int, objective: str = "train",
                  micro_batches: Sequence[int] | None = None, shapes: Sequence[str] = ("chain", "graph")
                  ) -> SearchResult:
    """The best plan for ``db`` on ``cluster``: for each micro-batch size the least-bottleneck
    chain of stages (EdgePipe's DP) and the least-bottleneck stage DAG (GraphPipe's DP over the
    device classes), each stage on replicas of one class, timed by the simulator; the fastest
    wins (``notes["shape"]`` says which). ``shapes`` restricts the searches."""
    if objective not in OBJECTIVES:
        raise GPPConfigError(f'objective must be one of {OBJECTIVES}, got "{objective}"')
    if not shapes or set(shapes) - {"chain", "graph"}:
        raise GPPConfigError(f'shapes must be "chain" and/or "graph", got {list(shapes)}')
    start = time.perf_counter()
    train = objective == "train"
    n = cluster.num_devices
    counts = tuple(c.count for c in cluster.classes)
    best, states, predict_s = None, 0, 0.0
    notes = {"objective": objective, "classes": {c.name: c.count for c in cluster.classes}}
    for b in micro_batch_sizes(mini_batch, micro_batches):
        models = [cluster.stage_model(db, c.name, mini_batch, n) for c in cluster.classes]
        found = []
        chain_tps = None
        if "chain" in shapes:
            dp = _ChainDP(models, counts, b, train)
            chain_tps, stages = dp.solve()
            states += len(dp.memo)
            if stages is not None:
                found.append(("chain", chain_tps, [(((1 << j) - 1) & ~((1 << i) - 1), c, r) for i, j, c, r in stages]))
        if "graph" in shapes:
            tps, stages, visited = _graph_search(db, cluster, models, b, train, chain_tps)
            states += visited
            if stages is not None:
                found.append(("graph", tps, stages))
        for shape, tps, stages in found:
            plan = _hetero_plan(db, cluster, models[0], stages, b, mini_batch, {**notes, "bottleneck_tps_s": tps,
                                                                                   "shape": shape})
            t0 = time.perf_counter()
            plan = predict(plan, db, cluster=cluster, train=train)
            predict_s += time.perf_counter() - t0
            if plan.predicted.fits_memory and (best is None or
                                               plan.predicted.samples_per_s > best.predicted.samples_per_s):
                best = plan
    elapsed = time.perf_counter() - start - predict_s
    if best is None:
        return SearchResult(method=f"hetero-{objective}", plan=None, search_time_s=elapsed, states=states,
                            status=f"no plan of {db.model} fits the cluster's {n} devices at any micro-batch")
    return SearchResult(method=f"hetero-{objective}", plan=best, search_time_s=elapsed, states=states)


def _hetero_plan(db: CostDB, cluster: Cluster, cm: StageCostModel, stages: list[tuple[int, int, int]], b: int,
                 mini_batch: int, notes: dict) -> Plan:
    """``(mask, class, replicas)`` stages as a plan, numbered in a topological order of the stage
    graph (each stage's layers in the model's order)."""
    topo = cm.stage_order([mask for mask, _, _ in stages])
    plan_stages = tuple(PlanStage(layers=cm.names_of(stages[s][0]), devices=stages[s][2],
                                  device_class=cluster.classes[stages[s][1]].name) for s in topo)
    return Plan(model=db.model, method=f"hetero-{notes['objective']}", source=db.source, micro_batch=b,
                mini_batch=mini_batch, stages=plan_stages, notes=notes)
