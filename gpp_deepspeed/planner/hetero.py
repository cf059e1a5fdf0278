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

import json
import math
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from ..errors import GPPConfigError
from .costs import CommFit, CostDB, StageCostModel, micro_batch_sizes
from .plan import Plan, PlanStage, SearchResult
from .simulate import predict

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

    def stage_model(self, db: CostDB, name: str | None, mini_batch: int, p2p_devices: int) -> StageCostModel:
        return StageCostModel(self.class_costs(db, name), mini_batch, p2p_devices=p2p_devices)

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


def hetero_search(db: CostDB, cluster: Cluster, *, mini_batch: int, objective: str = "train",
                  micro_batches: Sequence[int] | None = None) -> SearchResult:
    """The best plan for ``db`` on ``cluster``: for each micro-batch size the least-bottleneck
    chain of stages (each on replicas of one class), timed by the simulator; the fastest wins."""
    if objective not in OBJECTIVES:
        raise GPPConfigError(f'objective must be one of {OBJECTIVES}, got "{objective}"')
    start = time.perf_counter()
    train = objective == "train"
    n = cluster.num_devices
    counts = tuple(c.count for c in cluster.classes)
    best, states, predict_s = None, 0, 0.0
    for b in micro_batch_sizes(mini_batch, micro_batches):
        models = [cluster.stage_model(db, c.name, mini_batch, n) for c in cluster.classes]
        dp = _ChainDP(models, counts, b, train)
        tps, stages = dp.solve()
        states += len(dp.memo)
        if stages is None:
            continue
        plan_stages = tuple(PlanStage(layers=tuple(x.name for x in db.layers[i:j]), devices=r,
                                      device_class=cluster.classes[c].name) for i, j, c, r in stages)
        plan = Plan(model=db.model, method=f"hetero-{objective}", source=db.source, micro_batch=b,
                    mini_batch=mini_batch, stages=plan_stages,
                    notes={"bottleneck_tps_s": tps, "objective": objective,
                           "classes": {c.name: c.count for c in cluster.classes}})
        t0 = time.perf_counter()
        plan = predict(plan, db, cluster=cluster, train=train)
        predict_s += time.perf_counter() - t0
        if plan.predicted.fits_memory and (best is None or plan.predicted.samples_per_s > best.predicted.samples_per_s):
            best = plan
    elapsed = time.perf_counter() - start - predict_s
    if best is None:
        return SearchResult(method=f"hetero-{objective}", plan=None, search_time_s=elapsed, states=states,
                            status=f"no plan of {db.model} fits the cluster's {n} devices at any micro-batch")
    return SearchResult(method=f"hetero-{objective}", plan=best, search_time_s=elapsed, states=states)
