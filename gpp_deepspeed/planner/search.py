"""GraphPipe's stage-graph search (arXiv 2406.17145, Sec. 5, Alg. 1).

Three layers, as in the paper:

1. a sweep over micro-batch sizes (powers of two dividing the mini-batch, Sec. 5 and A.2), and
   in the ``"runtime"`` space over the uniform data-parallel degree;
2. a binary search on the bottleneck time per sample ``t_max`` (the objective, Eq. 1);
3. a feasibility DP over the series-parallel decomposition of the layer DAG whose value is the
   *least in-flight count of the subgraph's source stage* such that every stage in it meets
   ``TPS <= t_max`` and fits in memory under the in-flight rule (Sec. 5 "DP"; Sec. 6).

DP tables (uniform micro-batch ``b`` and 1F1B, the paper's default and evaluated setting, so
in-flight counts are micro-batches = depth to the sink, :mod:`.inflight`):

``solve(node, n, d)``
    least in-flight count of the source stage(s) of SP-tree ``node`` run on exactly ``n``
    devices, when the stage(s) after its sink keep ``d`` micro-batches in flight (``d = 0``
    after the output stage); ``None`` when infeasible.
``series(node, j, n, d)``
    the same for the suffix ``children[j:]`` of a Series node. Its first stage either covers the
    children ``j..k-1`` whole (one stage, the base case of Alg. 1), or lies inside child ``j``,
    which is then solved on its own with the suffix's source as its successor (Alg. 1's series
    case, solved back to front: "solve G2 first"), or, when child ``j`` is Parallel, joins its
    last branches to the merge layers ``j+1..k-1`` (see below).
``parallel(node, i, e, n, d)``
    the children ``i..e-1`` of a Parallel node: its first group of children runs as one stage, or
    its first child is decomposed on its own, beside the rest; their in-flight counts meet at the
    shared successor: ``max(k1, k2)`` (Alg. 1's parallel case, "we take the larger").

A stage is therefore an SP-tree node, a contiguous range of a Series node's children, a
contiguous range of a Parallel node's children, or the last branches of a Parallel node together
with the layers that merge them. The last form is our extension of the paper's SP cases: with
node-SP trees a merge layer (a concat, a head) would otherwise need a stage of its own, and a
device of its own, however small it is; letting a branch carry it keeps devices busy (a convex
stage either way, so the runtime needs nothing new). Device counts per stage come from
``stage_devices``: powers of two dividing ``b`` (the paper's data-parallel degrees) in the
``"full"`` space, or one fixed degree in the ``"runtime"`` space that today's engine runs
(one stage per pipeline rank, every stage replicated alike).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import networkx as nx

from ..errors import GPPConfigError, InfeasiblePlanError
from .costs import CommFit, CostDB, Hardware, LayerCost, StageCostModel, micro_batch_sizes
from .plan import Plan, PlanStage, SearchResult
from .simulate import predict
from .sp import Leaf, Series, sp_tree

__all__ = ["graphpipe_search", "graphpipe_partition", "proxy_costs", "SPACES", "bottleneck_search"]

SPACES = ("full", "runtime")
_REL_TOL = 1e-3
_GROWTH = 1.25
_MISSING = object()


@dataclass
class _Node:
    kind: str                 # "leaf", "series" or "parallel"
    mask: int
    children: tuple[int, ...]
    prefix: tuple[int, ...]   # prefix[j] = mask of children[:j]
    size: int                 # layers under the node


def _flatten(tree, cm: StageCostModel) -> list[_Node]:
    """Number the SP tree's nodes, children before parents; the root is last."""
    nodes: list[_Node] = []

    def visit(t) -> int:
        if isinstance(t, Leaf):
            kids: tuple[int, ...] = ()
            mask = cm.mask_of([t.name])
            kind = "leaf"
        else:
            kids = tuple(visit(c) for c in t.children)
            mask = 0
            for c in kids:
                mask |= nodes[c].mask
            kind = "series" if isinstance(t, Series) else "parallel"
        prefix = [0]
        for c in kids:
            prefix.append(prefix[-1] | nodes[c].mask)
        nodes.append(_Node(kind, mask, kids, tuple(prefix), bin(mask).count("1")))
        return len(nodes) - 1

    visit(tree)
    return nodes


class _DP:
    """One feasibility DP at fixed micro-batch ``b`` and target ``tmax``."""

    def __init__(self, cm: StageCostModel, nodes: list[_Node], b: int, tmax: float, stage_devices: Sequence[int],
                 work: Callable[[int], float], infeasible: dict | None = None):
        self.cm, self.nodes, self.b, self.tmax = cm, nodes, b, tmax * (1 + 1e-12)
        self.stage_devices = tuple(sorted(stage_devices))
        self.max_stage = self.stage_devices[-1]
        # Every stage's device count is a multiple of this, so every subgraph's is too.
        self.step = math.gcd(*self.stage_devices)
        self.work = work
        self.memo: dict = {}
        # state -> the largest tmax at which it was infeasible; infeasible at any smaller tmax too,
        # which the binary search reuses after every success (its next tmax is smaller).
        self.infeasible = {} if infeasible is None else infeasible
        self._min_devices: dict[int, int] = {}
        self._cum: dict[int, list[float]] = {}
        self.states = 0

    def min_devices(self, mask: int) -> int:
        # Per-sample compute never shrinks when a micro-batch is sharded, so a set of layers
        # needs at least work / tmax devices to meet tmax.
        n = self._min_devices.get(mask)
        if n is None:
            n = self._min_devices[mask] = max(1, math.ceil(self.work(mask) / self.tmax - 1e-9))
        return n

    def _up(self, n: int) -> int:
        """The least multiple of ``step`` that is at least ``n``."""
        return -(-n // self.step) * self.step

    def _remember(self, key, best):
        self.memo[key] = best
        if best is None and self.infeasible.get(key, -1.0) < self.tmax:
            self.infeasible[key] = self.tmax
        return best

    def _known(self, key):
        """``(True, value)`` when the state is memoised or known infeasible at this tmax."""
        if key in self.memo:
            return True, self.memo[key]
        if self.tmax <= self.infeasible.get(key, -1.0):
            return True, None
        return False, None

    def max_devices(self, node: _Node) -> int:
        return node.size * self.max_stage

    def stage_ok(self, mask: int, n: int, k: int) -> bool:
        cm, b = self.cm, self.b
        return cm.time_per_sample(mask, b, n) <= self.tmax and cm.fits(mask, b, n, k)

    def solve(self, v: int, n: int, d: int):
        """``(k, choice)`` with the least source in-flight count, or None."""
        node = self.nodes[v]
        if node.kind == "leaf":
            if n in self.stage_devices and self.stage_ok(node.mask, n, d + 1):
                return (d + 1, ("stage", node.mask, n))
            return None
        if node.kind == "series":
            return self.series(v, 0, n, d)
        return self.parallel(v, 0, len(node.children), n, d)

    def series(self, v: int, j: int, n: int, d: int):
        node = self.nodes[v]
        m = len(node.children)
        if j == m:
            return (d, None) if n == 0 else None
        key = ("s", v, j, n, d)
        known, value = self._known(key)
        if known:
            return value
        self.states += 1
        best = None
        rest_mask = node.mask & ~node.prefix[j]
        if n < self.min_devices(rest_mask):
            return self._remember(key, None)
        memo = self.memo
        cum = self._cumulative(v)
        tmax, total = self.tmax, cum[m]
        # (a) one stage over children j..k-1 on n1 devices, then the rest of the series
        for n1 in self.stage_devices:
            if n1 > n:
                break
            cap = tmax * n1
            for k in range(j + 1, m + 1):
                if cum[k] - cum[j] > cap:
                    break
                if k < m and n1 + max(1, math.ceil((total - cum[k]) / tmax - 1e-9)) > n or k == m and n1 != n:
                    continue
                mask = node.prefix[k] & ~node.prefix[j]
                rest = memo.get(("s", v, k, n - n1, d), _MISSING) if k < m else (d, None)
                if rest is _MISSING:
                    rest = self.series(v, k, n - n1, d)
                if rest is None or (best is not None and rest[0] + 1 >= best[0]):
                    continue
                if self.stage_ok(mask, n1, rest[0] + 1):
                    best = (rest[0] + 1, ("range", j, k, mask, n1, n - n1))
        # (c) the last branches of a Parallel child j join the merge stage after them
        if self.nodes[node.children[j]].kind == "parallel" and j + 1 < m:
            best = self.merged(v, j, n, d, best)
        # (b) the first stage lies inside child j, solved with the rest as its successor
        c = node.children[j]
        if self.nodes[c].kind != "leaf":
            lo = self.min_devices(self.nodes[c].mask)
            hi = min(n, self.max_devices(self.nodes[c]))
            for n1 in range(self._up(lo), hi + 1, self.step):
                rest = self.series(v, j + 1, n - n1, d)
                if rest is None:
                    continue
                r = self.solve(c, n1, rest[0])
                if r is not None and (best is None or r[0] < best[0]):
                    best = (r[0], ("child", j, n1, n - n1, rest[0]))
        return self._remember(key, best)

    def parallel(self, v: int, i: int, e: int, n: int, d: int):
        """The children ``i..e-1`` of a Parallel node: the first group of them runs as one stage
        (or the first child is decomposed on its own) beside the rest."""
        node = self.nodes[v]
        if e - i == 1:
            return self.solve(node.children[i], n, d)
        key = ("p", v, i, e, n, d)
        known, value = self._known(key)
        if known:
            return value
        self.states += 1
        best = None
        mask = node.prefix[e] & ~node.prefix[i]
        if n < self.min_devices(mask):
            return self._remember(key, None)
        # (a) children i..t-1 as one stage beside the rest (t == e: the whole range)
        for t in range(i + 1, e + 1):
            group = node.prefix[t] & ~node.prefix[i]
            w = self.work(group)
            if w > self.tmax * min(n, self.max_stage):
                break
            rest_mask = mask & ~group
            need_rest = self.min_devices(rest_mask) if t < e else 0
            for n1 in self.stage_devices:
                if n1 + need_rest > n:
                    break
                if w > self.tmax * n1 or (t == e and n1 != n):
                    continue
                if best is not None and d + 1 >= best[0]:
                    break
                r2 = self.parallel(v, t, e, n - n1, d) if t < e else (d + 1, None)
                if r2 is None or not self.stage_ok(group, n1, d + 1):
                    continue
                k = max(d + 1, r2[0])
                if best is None or k < best[0]:
                    best = (k, ("group", t, group, n1, n - n1))
        # (b) child i decomposed on its own beside the rest
        c = node.children[i]
        if self.nodes[c].kind != "leaf":
            rest_mask = mask & ~self.nodes[c].mask
            lo = self.min_devices(self.nodes[c].mask)
            hi = min(n - self.min_devices(rest_mask), self.max_devices(self.nodes[c]))
            for n1 in range(self._up(lo), hi + 1, self.step):
                r1 = self.solve(c, n1, d)
                if r1 is None or (best is not None and r1[0] >= best[0]):
                    continue
                r2 = self.parallel(v, i + 1, e, n - n1, d)
                if r2 is None:
                    continue
                k = max(r1[0], r2[0])
                if best is None or k < best[0]:
                    best = (k, ("child", n1, n - n1))
        return self._remember(key, best)

    def _cumulative(self, v: int) -> list[float]:
        """Prefix sums of the children's work: the work of children ``j..k-1`` in O(1)."""
        cum = self._cum.get(v)
        if cum is None:
            cum = [0.0]
            for c in self.nodes[v].children:
                cum.append(cum[-1] + self.work(self.nodes[c].mask))
            self._cum[v] = cum
        return cum

    def _range_capacity(self, v: int, i: int, e: int) -> int:
        node = self.nodes[v]
        return (node.prefix[e] & ~node.prefix[i]).bit_count() * self.max_stage

    def merged(self, v: int, j: int, n: int, d: int, best):
        """Child ``j`` of Series ``v`` is Parallel: its last branches join the stage that runs the
        merge (children ``j+1..k-1``), and its first branches are solved beside that stage, which
        is their successor. A branch then needs no stage of its own just to feed the merge."""
        node = self.nodes[v]
        par_id = node.children[j]
        par = self.nodes[par_id]
        q, m = len(par.children), len(node.children)
        rests: dict = {}   # (k, devices) -> series(v, k, devices, d), shared by every i
        for i in range(1, q):
            tail, head = par.mask & ~par.prefix[i], par.prefix[i]
            need_head = self.min_devices(head)
            for k in range(j + 2, m + 1):
                mask = tail | (node.prefix[k] & ~node.prefix[j + 1])
                w = self.work(mask)
                if w > self.tmax * min(n, self.max_stage):
                    break
                need_rest = self.min_devices(node.mask & ~node.prefix[k]) if k < m else 0
                for n1 in self.stage_devices:
                    if n1 + need_head + need_rest > n:
                        break
                    if w > self.tmax * n1:
                        continue
                    most_head = min(n - n1 - need_rest, self._range_capacity(par_id, 0, i))
                    heads = range(self._up(need_head), most_head + 1, self.step) if k < m else [n - n1]
                    for n_head in heads:
                        n_rest = n - n1 - n_head
                        rest = rests.get((k, n_rest), _MISSING)
                        if rest is _MISSING:
                            rest = rests[(k, n_rest)] = self.series(v, k, n_rest, d) if k < m else (d, None)
                        if rest is None:
                            continue
                        k_stage = rest[0] + 1
                        if best is not None and k_stage >= best[0]:
                            continue
                        if not self.stage_ok(mask, n1, k_stage):
                            continue
                        r = self.parallel(par_id, 0, i, n_head, k_stage)
                        if r is not None and (best is None or max(r[0], k_stage) < best[0]):
                            best = (max(r[0], k_stage), ("merge", i, k, mask, n1, n_head, n_rest, k_stage))
        return best

    def stages(self, v: int, n: int, d: int) -> list[tuple[int, int]]:
        """Rebuild the ``(mask, devices)`` stages of a feasible ``solve(v, n, d)``."""
        node = self.nodes[v]
        if node.kind == "leaf":
            return [(node.mask, n)]
        if node.kind == "series":
            return self._series_stages(v, 0, n, d)
        return self._parallel_stages(v, 0, len(node.children), n, d)

    def _series_stages(self, v: int, j: int, n: int, d: int) -> list[tuple[int, int]]:
        node = self.nodes[v]
        if j == len(node.children):
            return []
        choice = self.series(v, j, n, d)[1]
        if choice[0] == "range":
            _, _, k, mask, n1, n_rest = choice
            return [(mask, n1)] + self._series_stages(v, k, n_rest, d)
        if choice[0] == "merge":
            _, i, k, mask, n1, n_head, n_rest, k_stage = choice
            return ([(mask, n1)] + self._parallel_stages(node.children[j], 0, i, n_head, k_stage)
                    + self._series_stages(v, k, n_rest, d))
        _, _, n1, n_rest, d_rest = choice
        return self.stages(node.children[j], n1, d_rest) + self._series_stages(v, j + 1, n_rest, d)

    def _parallel_stages(self, v: int, i: int, e: int, n: int, d: int) -> list[tuple[int, int]]:
        node = self.nodes[v]
        if e - i == 1:
            return self.stages(node.children[i], n, d)
        choice = self.parallel(v, i, e, n, d)[1]
        if choice[0] == "group":
            _, t, group, n1, n_rest = choice
            return [(group, n1)] + (self._parallel_stages(v, t, e, n_rest, d) if t < e else [])
        _, n1, n_rest = choice
        return self.stages(node.children[i], n1, d) + self._parallel_stages(v, i + 1, e, n_rest, d)


def _work_fn(cm: StageCostModel, shard: float) -> Callable[[int], float]:
    """Per-sample compute of a layer set on shards of ``shard`` samples: a lower bound on the
    device-seconds per sample any stage split of it needs when no device gets a larger shard
    (per-sample time never falls as shards shrink)."""
    per_layer = []
    for c in cm.db.layers:
        f, bw = c.times(shard)
        per_layer.append((f + bw) / shard)
    cache: dict[int, float] = {}

    def work(mask: int) -> float:
        w = cache.get(mask)
        if w is None:
            w = 0.0
            m = mask
            while m:
                low = m & -m
                w += per_layer[low.bit_length() - 1]
                m ^= low
            cache[mask] = w
        return w

    return work


def bottleneck_search(cm: StageCostModel, tree, *, num_devices: int, micro_batch: int,
                      stage_devices: Sequence[int], rel_tol: float = _REL_TOL, floor: float = 0.0):
    """Binary search on ``tmax`` (Alg. 1, lines 1-9): the least feasible bottleneck time per
    sample within ``rel_tol``, its stages, and the DP states visited; ``(None, None, states)``
    when no ``tmax`` is feasible (memory or device counts). ``floor`` is a known lower bound on
    the answer (the optimum of a larger space), which narrows the first bracket."""
    nodes = _flatten(tree, cm)
    work = _work_fn(cm, micro_batch / min(stage_devices))
    states = 0
    infeasible: dict = {}

    def attempt(tmax: float):
        nonlocal states
        dp = _DP(cm, nodes, micro_batch, tmax, stage_devices, work, infeasible)
        r = dp.solve(len(nodes) - 1, num_devices, 0)
        states += dp.states
        return dp.stages(len(nodes) - 1, num_devices, 0) if r is not None else None

    # A layer that fits on no stage, even alone with one micro-batch in flight, rules out every plan.
    widest = max(stage_devices)
    if not all(cm.fits(1 << i, micro_batch, widest, 1) for i in range(cm.num_layers)):
        return None, None, states
    lo = max(floor, work(cm.full_mask) / num_devices)   # perfect balance: no plan does better
    # Every layer as its own single-device stage bounds any stage made of them from above.
    ceiling = 2 * max(lo, sum(cm.time_per_sample(1 << i, micro_batch, 1) for i in range(cm.num_layers)))
    # Bracket the optimum by growing from the lower bound (it is usually within tens of percent
    # of it), which takes fewer DP runs than bisecting down from the ceiling. When that first
    # guess fails with one data-parallel degree, where memory often rules out every plan, one DP
    # at the ceiling (cheap with one degree) says so before doubling towards it.
    hi = min(_GROWTH * lo, ceiling)
    best = attempt(hi)
    if best is None:
        lo = hi
        if len(stage_devices) == 1 and attempt(ceiling) is None:
            return None, None, states
    while best is None and hi < ceiling:
        hi = min(2 * hi, ceiling)
        best = attempt(hi)
        if best is None:
            lo = hi
    if best is None:
        return None, None, states
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        found = attempt(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    return hi, best, states


def graphpipe_search(db: CostDB, *, num_devices: int, mini_batch: int, micro_batches: Sequence[int] | None = None,
                     space: str = "full", rel_tol: float = _REL_TOL,
                     progress: Callable[[str], None] | None = None) -> SearchResult:
    """GraphPipe's plan for ``db`` on ``num_devices`` devices: the best predicted throughput over
    the micro-batch sweep of the least-bottleneck stage graphs.

    ``space="full"`` lets every stage have its own data-parallel degree (a power of two); the
    ``"runtime"`` space gives every stage the same degree, as the engine runs today.
    """
    if space not in SPACES:
        raise GPPConfigError(f'search space must be one of {SPACES}, got "{space}"')
    start = time.perf_counter()
    tree, added = sp_tree(db.graph)
    cm = StageCostModel(db, mini_batch, p2p_devices=num_devices)
    candidates = []
    states = 0
    predict_s = 0.0
    best_time = float("inf")
    for b in sorted(micro_batch_sizes(mini_batch, micro_batches), reverse=True):
        # The DP minimises the bottleneck (the paper's objective, Eq. 1), which ignores pipeline
        # fill and drain; with few micro-batches a shallower plan on one uniform data-parallel
        # degree can finish sooner. So the full space also tries every uniform degree, and the
        # simulator picks among the least-bottleneck plans, as it does among micro-batch sizes.
        uniform = [d for d in _divisors(num_devices) if b % d == 0]
        options = uniform if space == "runtime" else [None] + uniform
        full_devices = [n for n in _powers_of_two(b) if n <= num_devices]
        full_tps = None   # the full space's least bottleneck at this b: a floor for its subsets
        for d in options:
            # The bottleneck stage alone is busy mini_batch * TPS >= mini_batch * work / devices,
            # so an option whose perfect balance cannot beat the best plan so far is skipped.
            if mini_batch * _work_fn(cm, b / (d or 1))(cm.full_mask) / num_devices >= best_time:
                continue
            floor = 0.0
            if d is not None and space == "full" and d in full_devices:
                if full_tps is None:
                    continue      # the full space had no plan at this b; neither has its subset
                floor = full_tps * (1 - rel_tol)
                if mini_batch * floor >= best_time:
                    continue
            stage_devices = [d] if d is not None else full_devices
            tps, stages, visited = bottleneck_search(cm, tree, num_devices=num_devices, micro_batch=b,
                                                     stage_devices=stage_devices, rel_tol=rel_tol, floor=floor)
            states += visited
            if d is None:
                full_tps = tps
            if progress is not None:
                what = f"micro-batch {b}" + (f", degree {d}" if d else "")
                progress(f"graphpipe: {what}: " + ("no feasible plan" if tps is None else
                                                    f"{len(stages)} stages, bottleneck {tps:.4g} s/sample"))
            if stages is None:
                continue
            t0 = time.perf_counter()
            plan = predict(_plan(db, cm, stages, b, mini_batch, tps, added, space), db)
            predict_s += time.perf_counter() - t0
            if plan.predicted.fits_memory:
                candidates.append(plan)
                best_time = min(best_time, plan.predicted.iteration_time_s)
    elapsed = time.perf_counter() - start - predict_s
    if not candidates:
        gib = db.hardware.memory_bytes / 2**30
        return SearchResult(method="graphpipe", plan=None, search_time_s=elapsed, states=states,
                            status=f"no plan fits {gib:.1f} GiB per device on {num_devices} devices at any micro-batch")
    best = max(candidates, key=lambda p: p.predicted.samples_per_s)
    return SearchResult(method="graphpipe", plan=best, search_time_s=elapsed, states=states)


def _plan(db: CostDB, cm: StageCostModel, stages: list[tuple[int, int]], b: int, mini_batch: int, tps: float,
          added: tuple, space: str) -> Plan:
    """Stages as a :class:`Plan`, numbered in a topological order of the stage graph."""
    stage_of = {}
    for s, (mask, _) in enumerate(stages):
        for name in cm.names_of(mask):
            stage_of[name] = s
    g = nx.DiGraph()
    g.add_nodes_from(range(len(stages)))
    for c in db.layers:
        for ref in c.inputs:
            src = ref.split(":")[0]
            if src in stage_of and stage_of[src] != stage_of[c.name]:
                g.add_edge(stage_of[src], stage_of[c.name])
    order = list(nx.lexicographical_topological_sort(g, key=lambda s: min(cm.index[n] for n in cm.names_of(stages[s][0]))))
    plan_stages = tuple(PlanStage(layers=cm.names_of(stages[s][0]), devices=stages[s][1]) for s in order)
    notes = {"bottleneck_tps_s": tps, "space": space,
             "sp_added_edges": [list(e) for e in added]}
    return Plan(model=db.model, method="graphpipe", source=db.source, micro_batch=b, mini_batch=mini_batch,
                stages=plan_stages, notes=notes)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(b: int) -> list[int]:
    return [1 << i for i in range(b.bit_length()) if b % (1 << i) == 0]


def graphpipe_partition(db: CostDB, *, num_stages: int, micro_batch: int = 1,
                        rel_tol: float = _REL_TOL) -> dict[str, int]:
    """GraphPipe's least-bottleneck stage graph with exactly ``num_stages`` single-rank stages.

    This is what ``GraphPipelineModule(partition_method="graphpipe")`` runs on every rank: the
    pipeline's stage count is fixed by the topology, so the search only decides which layers go
    together. It is deterministic, so every rank computes the same partition.
    """
    cm = StageCostModel(db, micro_batch, p2p_devices=num_stages)
    tree, _ = sp_tree(db.graph)
    tps, stages, _ = bottleneck_search(cm, tree, num_devices=num_stages, micro_batch=micro_batch,
                                       stage_devices=[1], rel_tol=rel_tol)
    if stages is None:
        raise InfeasiblePlanError(f"GraphPipe found no partition of {db.model} into {num_stages} stages that fits "
                                  f"{db.hardware.memory_bytes / 2**30:.1f} GiB per device; use more stages")
    plan = _plan(db, cm, stages, micro_batch, micro_batch, tps, (), "runtime")
    return plan.stage_of


def proxy_costs(graph, param_counts: Sequence[int], *, model: str = "model") -> CostDB:
    """A cost database from parameter counts alone (time proportional to parameters, free links,
    unlimited memory): what ``partition_method="graphpipe"`` plans with when no profile is given."""
    free = CommFit(alpha_s=0.0, beta_s_per_byte=0.0)
    layers = tuple(LayerCost(name=node.name, inputs=tuple(str(r) for r in node.inputs), micro_batches=(1,),
                             fwd_s=(float(p),), bwd_s=(2.0 * p,), param_bytes=0, out_bytes=0, stash_bytes=0)
                   for node, p in zip(graph.nodes, param_counts))
    hw = Hardware(name="proxy", memory_bytes=2**62, devices_per_node=2**20, intra=free, inter=free)
    return CostDB(model=model, source="proxy: time proportional to parameter count", input_names=graph.input_names,
                  output=graph.output, layers=layers, hardware=hw)
