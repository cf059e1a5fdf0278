"""The numeric kernel of GraphPipe's search: the feasibility DP over the series-parallel tree.

DP tables (uniform micro-batch ``b``, the paper's default and evaluated setting; a DP value is a
*depth*, the stages on the longest path to the output, which under 1F1B is the stage's in-flight
count, Sec. 6; the memory test asks the schedule what a stage at that depth stashes,
:func:`~gpp_deepspeed.planner.inflight.schedule_memory`):

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

import bisect
import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from .costs import StageCostModel
from .sp import Leaf, Series

__all__ = ["FeasibilityDP", "flatten", "narrow_bracket", "work_fn"]

_MISSING = object()


@dataclass
class _Node:
    kind: str                 # "leaf", "series" or "parallel"
    mask: int
    children: tuple[int, ...]
    prefix: tuple[int, ...]   # prefix[j] = mask of children[:j]
    size: int                 # layers under the node
    depth: int = 1            # stages on its longest path when every layer is a stage
    cls: int = 0              # nodes of one class are priced alike (identical branches)
    sym: bool = False         # Parallel: children of one class are interchangeable in groups


def flatten(tree, cm: StageCostModel) -> list[_Node]:
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
        depths = [nodes[c].depth for c in kids]
        depth = 1 if not kids else sum(depths) if kind == "series" else max(depths)
        nodes.append(_Node(kind, mask, kids, tuple(prefix), bin(mask).count("1"), depth))
        return len(nodes) - 1

    visit(tree)
    _classify(nodes, cm)
    return nodes


def _classify(nodes: list[_Node], cm: StageCostModel) -> None:
    """Give nodes that every stage inside them prices alike one class: same tree shape, same
    per-layer costs, same edges inside, and the same bytes from and to the outside. GraphPipe's
    pitch is models with many identical branches (CANDLE-Uno, MMT); the DP then solves one branch
    and one count of branches instead of every branch and every range of them."""
    layers = cm.db.layers
    classes: dict = {}
    for node in nodes:
        members = cm._members(node.mask)
        local = {i: x for x, i in enumerate(members)}
        outside: dict[int, int] = {}
        desc = []
        for i in members:
            c = layers[i]
            ins, ext = [], []
            for p in cm._members(cm.producers[i]):
                if p in local:
                    ins.append(local[p])
                else:
                    ext.append((outside.setdefault(p, len(outside)), layers[p].out_bytes))
            desc.append((c.micro_batches, c.fwd_s, c.bwd_s, c.param_bytes, c.out_bytes, c.stash_bytes,
                         tuple(ins), tuple(ext), bool(cm.consumers[i] & ~node.mask)))
        key = (node.kind, tuple(nodes[k].cls for k in node.children), tuple(desc))
        node.cls = classes.setdefault(key, len(classes))
        if node.kind == "parallel":
            # Siblings that read one outside tensor share it when grouped into a stage, so a group's
            # bytes would depend on which siblings it holds: no symmetry there.
            seen, shared = 0, False
            for k in node.children:
                ext = 0
                for i in cm._members(nodes[k].mask):
                    ext |= cm.producers[i] & ~nodes[k].mask
                shared |= bool(ext & seen)
                seen |= ext
            node.sym = not shared


class FeasibilityDP:
    """One feasibility DP at fixed micro-batch ``b`` and target ``tmax``.

    Series states are solved one device count at a time, lazily. Parallel ranges are solved for
    every device count at once: their table holds, per in-flight level ``K``, the set of device
    counts (a bitset, bit ``n``) on which the range meets ``tmax`` with source in-flight at most
    ``K``. Sharing ``n`` devices among siblings is then a sumset of bitsets (shifts and ors)
    instead of a loop over every split, and identical branches share one table per branch count.
    """

    def __init__(self, cm: StageCostModel, nodes: list[_Node], b: int, tmax: float, stage_devices: Sequence[int],
                 work: Callable[[int], float], num_devices: int, infeasible: dict | None = None,
                 priced: dict | None = None, recompute: bool = False,
                 stash: Callable[[int], tuple[int, int]] = lambda k: (k, 0)):
        self.cm, self.nodes, self.b, self.tmax = cm, nodes, b, tmax * (1 + 1e-12)
        # A stage at depth k (stages on its longest path to the output) stashes stash(k) = (micro-
        # batches, weight copies) under the schedule the plan will run (inflight.schedule_memory).
        self.stash = stash
        self.stage_devices = tuple(sorted(stage_devices))
        self.max_stage = self.stage_devices[-1]
        # Every stage's device count is a multiple of this, so every subgraph's is too.
        self.step = math.gcd(*self.stage_devices)
        # fewest[n]: the fewest stages whose device counts sum to exactly n. A subgraph of L
        # layers has at most L stages, so it cannot use n devices when fewest[n] > L.
        self.fewest = _fewest_stages(self.stage_devices, num_devices)
        self.work = work
        self.num_devices = num_devices
        self.memo: dict = {}
        # state -> the largest tmax at which it was infeasible; infeasible at any smaller tmax too,
        # which the binary search reuses after every success (its next tmax is smaller).
        self.infeasible = {} if infeasible is None else infeasible
        # (mask, devices) -> (TPS, weight bytes, stash bytes), shared by the bisection's DP runs
        self.priced = {} if priced is None else priced
        self.memory = cm.db.hardware.memory_bytes
        self.recompute = recompute
        self._min_devices: dict[int, int] = {}
        self._cum: dict[int, list[float]] = {}
        self._tables: dict = {}
        self._ranges: dict = {}
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
        """Layer set ``mask`` on ``n`` devices meets ``tmax`` and fits at depth ``k`` (with what the
        schedule stashes there) at one of its TP degrees (:meth:`StageCostModel.tp_options`), as
        it is or, where the search may recompute, with its activations recomputed."""
        stashed = self.stash(k)
        for recompute in ((False, True) if self.recompute else (False, )):
            for tp in self.cm.tp_options(n, self.b):
                tps, cost = self._priced(mask, n, recompute, tp)
                if tps <= self.tmax and cost.memory(*stashed) <= self.memory:
                    return True
        return False

    def _priced(self, mask: int, n: int, recompute: bool, tp: int = 1):
        key = (mask, n, recompute, tp)
        priced = self.priced.get(key)
        if priced is None:
            priced = self.priced[key] = (self.cm.time_per_sample(mask, self.b, n, recompute=recompute, tp=tp),
                                         self.cm.stage(mask, self.b, n, recompute=recompute, tp=tp))
        return priced

    def stage_bits(self, mask: int, k: int) -> int:
        """Device counts (bit ``n``) on which layer set ``mask`` is one stage meeting ``tmax``
        with ``k`` micro-batches in flight."""
        bits = 0
        for n in self.stage_devices:
            if self.stage_ok(mask, n, k):
                bits |= 1 << n
        return bits

    def solve(self, v: int, n: int, d: int):
        """``(k, choice)`` with the least source in-flight count, or None."""
        node = self.nodes[v]
        if node.kind == "leaf":
            if n in self.stage_devices and self.stage_ok(node.mask, n, d + 1):
                return (d + 1, ("stage", n))
            return None
        if node.kind == "series":
            return self.series(v, 0, n, d)
        return self.parallel(v, 0, len(node.children), n, d)

    def series(self, v: int, j: int, n: int, d: int):
        node = self.nodes[v]
        m = len(node.children)
        if j == m:
            return (d, None) if n == 0 else None
        key = ("s", node.cls, j, n, d)
        known, value = self._known(key)
        if known:
            return value
        self.states += 1
        best = None
        rest_mask = node.mask & ~node.prefix[j]
        if n < self.min_devices(rest_mask) or self.fewest[n] > rest_mask.bit_count():
            return self._remember(key, None)
        memo, fewest = self.memo, self.fewest
        cum = self._cumulative(v)
        tmax, total = self.tmax, cum[m]
        # (a) one stage over children j..k-1 on n1 devices, then the rest of the series. Only a
        # window of k can work: the stage must meet tmax on n1 devices (k not too large) and the
        # rest must still get its least devices from the n - n1 left (k not too small).
        for n1 in self.stage_devices:
            if n1 > n:
                break
            if n1 == n:
                first = m
            else:
                first = max(j + 1, bisect.bisect_left(cum, total - (n - n1 + 1e-6) * tmax))
                while first < m and n1 + max(1, math.ceil((total - cum[first]) / tmax - 1e-9)) > n:
                    first += 1
            last = min(m, bisect.bisect_right(cum, cum[j] + tmax * n1) - 1)
            left = fewest[n - n1]
            for k in range(first, last + 1):
                if k == m and n1 != n or k < m and left > node.size - node.prefix[k].bit_count():
                    continue    # the rest cannot use exactly n - n1 devices
                mask = node.prefix[k] & ~node.prefix[j]
                rest = memo.get(("s", node.cls, k, n - n1, d), _MISSING) if k < m else (d, None)
                if rest is _MISSING:
                    rest = self.series(v, k, n - n1, d)
                if rest is None or (best is not None and rest[0] + 1 >= best[0]):
                    continue
                if self.stage_ok(mask, n1, rest[0] + 1):
                    best = (rest[0] + 1, ("range", k, n1, n - n1))
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
                    best = (r[0], ("child", n1, n - n1, rest[0]))
        return self._remember(key, best)

    # -- Parallel ranges, all device counts at once ------------------------------------------

    def _range_key(self, v: int, i: int, e: int):
        key = self._ranges.get((v, i, e))
        if key is None:
            node = self.nodes[v]
            kids = tuple(self.nodes[c].cls for c in node.children[i:e])
            key = self._ranges[(v, i, e)] = ("r", kids) if node.sym else ("r", v, i, e)
        return key

    def _cap(self, mask: int) -> int:
        """Bits of the device counts a part ``mask`` can use: the rest needs its own minimum."""
        rest = self.cm.full_mask & ~mask
        most = self.num_devices - (self.min_devices(rest) if rest else 0)
        return (1 << (most + 1)) - 1 if most >= 0 else 0

    def child_table(self, c: int, d: int) -> list[int]:
        """Per level ``K`` (``K = d + 1 + index``): the device counts on which node ``c`` meets
        ``tmax`` with source in-flight at most ``K`` when its successors keep ``d``."""
        node = self.nodes[c]
        if node.kind == "parallel":
            return self.table(c, 0, len(node.children), d)
        key = ("c", node.cls, d)
        tab = self._tables.get(key)
        if tab is not None:
            return tab
        if node.kind == "leaf":
            tab = [self.stage_bits(node.mask, d + 1)] * node.depth
        else:
            tab = [0] * node.depth
            lo = self._up(self.min_devices(node.mask))
            hi = min(self._cap(node.mask).bit_length() - 1, self.max_devices(node))
            fewest, size = self.fewest, node.size
            for n in range(lo, hi + 1, self.step):
                if fewest[n] > size:
                    continue
                r = self.series(c, 0, n, d)
                if r is not None:
                    for x in range(r[0] - d - 1, node.depth):
                        tab[x] |= 1 << n
        self._tables[key] = tab
        return tab

    def table(self, v: int, i: int, e: int, d: int) -> list[int]:
        """:meth:`child_table` for the children ``i..e-1`` of Parallel node ``v``: the first group
        of them runs as one stage, or the first child is decomposed on its own, beside the rest;
        in-flight counts meet at the shared successor, ``max(k1, k2)`` (Alg. 1's parallel case)."""
        node = self.nodes[v]
        if e - i == 1:
            return self.child_table(node.children[i], d)
        key = (self._range_key(v, i, e), d)
        tab = self._tables.get(key)
        if tab is not None:
            return tab
        self.states += 1
        levels = max(self.nodes[c].depth for c in node.children[i:e])
        mask = node.prefix[e] & ~node.prefix[i]
        cap = self._cap(mask)
        tab = [0] * levels
        # (a) children i..t-1 as one stage beside the rest (t == e: the whole range)
        for t in range(i + 1, e + 1):
            group = node.prefix[t] & ~node.prefix[i]
            if self.work(group) > self.tmax * self.max_stage:
                break
            g = self._group_bits(v, i, t, group, d + 1)
            if not g:
                continue
            if t == e:
                tab = [x | g for x in tab]
                continue
            rest = self.table(v, t, e, d)
            tab = [x | _sumset(g, r, cap) for x, r in zip(tab, _padded(rest, levels))]
        # (b) child i decomposed on its own beside the rest
        c = node.children[i]
        if self.nodes[c].kind != "leaf":
            mine = _padded(self.child_table(c, d), levels)
            rest = _padded(self.table(v, i + 1, e, d), levels)
            tab = [x | _sumset(a, r, cap) for x, a, r in zip(tab, mine, rest)]
        self._tables[key] = tab
        return tab

    def _group_bits(self, v: int, i: int, t: int, group: int, k: int) -> int:
        key = ("g", self._range_key(v, i, t), k)
        bits = self._tables.get(key)
        if bits is None:
            bits = self._tables[key] = self.stage_bits(group, k)
        return bits

    def parallel(self, v: int, i: int, e: int, n: int, d: int):
        """The children ``i..e-1`` of Parallel node ``v`` on ``n`` devices: ``(k, None)`` with
        the least source in-flight count, or None (the stages come from :meth:`stages`)."""
        for x, bits in enumerate(self.table(v, i, e, d)):
            if bits >> n & 1:
                return (d + 1 + x, None)
        return None

    def _cumulative(self, v: int) -> list[float]:
        """Prefix sums of the children's work: the work of children ``j..k-1`` in O(1)."""
        cum = self._cum.get(v)
        if cum is None:
            cum = [0.0]
            for c in self.nodes[v].children:
                cum.append(cum[-1] + self.work(self.nodes[c].mask))
            self._cum[v] = cum
        return cum

    def merged(self, v: int, j: int, n: int, d: int, best):
        """Child ``j`` of Series ``v`` is Parallel: its last branches join the stage that runs the
        merge (children ``j+1..k-1``), and its first branches are solved beside that stage, which
        is their successor. A branch then needs no stage of its own just to feed the merge."""
        node = self.nodes[v]
        par_id = node.children[j]
        par = self.nodes[par_id]
        q, m = len(par.children), len(node.children)
        width = self.num_devices + 1
        rests: dict = {}   # (k, level) -> the rest's device counts at in-flight <= level, reversed
        levels_of: dict = {}
        for i in range(1, q):
            tail, need_head = par.mask & ~par.prefix[i], self.min_devices(par.prefix[i])
            for k in range(j + 2, m + 1):
                mask = tail | (node.prefix[k] & ~node.prefix[j + 1])
                w = self.work(mask)
                if w > self.tmax * min(n, self.max_stage):
                    break
                need_rest = self.min_devices(node.mask & ~node.prefix[k]) if k < m else 0
                levels = levels_of.get(k)
                if levels is None:
                    levels = levels_of[k] = [d] if k == m else self._series_levels(v, k, d, n, rests)
                for n1 in self.stage_devices:
                    if n1 + need_head + need_rest > n:
                        break
                    if w > self.tmax * n1:
                        continue
                    for level in levels:
                        k_stage = level + 1
                        if best is not None and k_stage >= best[0]:
                            break
                        if not self.stage_ok(mask, n1, k_stage):
                            break   # more in flight fits no better
                        head = self.table(par_id, 0, i, k_stage)
                        # bit h of reach: the rest runs on exactly n - n1 - h devices at this level
                        reach = 1 << (n - n1) if k == m else rests[(k, level)] >> (width - 1 - n + n1)
                        for x, bits in enumerate(head):
                            hit = bits & reach
                            if hit and (best is None or k_stage + 1 + x < best[0]):
                                n_head = (hit & -hit).bit_length() - 1
                                best = (k_stage + 1 + x, ("merge", i, k, n1, n_head, n - n1 - n_head, k_stage))
                                break
        return best

    def _series_levels(self, v: int, k: int, d: int, n: int, rests: dict) -> list[int]:
        """In-flight levels of the suffix ``k..`` of Series ``v`` on up to ``n`` devices, each with
        the (reversed) device counts that reach it, into ``rests``."""
        node = self.nodes[v]
        width = self.num_devices + 1
        found: dict[int, int] = {}
        rest_mask = node.mask & ~node.prefix[k]
        lo, size, fewest = self._up(self.min_devices(rest_mask)), rest_mask.bit_count(), self.fewest
        for n_rest in range(lo, n + 1, self.step):
            if fewest[n_rest] > size:
                continue
            r = self.series(v, k, n_rest, d)
            if r is not None:
                found[r[0]] = found.get(r[0], 0) | 1 << (width - 1 - n_rest)
        levels = sorted(found)
        acc = 0
        for level in levels:
            acc |= found[level]
            rests[(k, level)] = acc
        return levels

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
            _, k, n1, n_rest = choice
            return [(node.prefix[k] & ~node.prefix[j], n1)] + self._series_stages(v, k, n_rest, d)
        if choice[0] == "merge":
            _, i, k, n1, n_head, n_rest, k_stage = choice
            par = self.nodes[node.children[j]]
            mask = (par.mask & ~par.prefix[i]) | (node.prefix[k] & ~node.prefix[j + 1])
            return ([(mask, n1)] + self._parallel_stages(node.children[j], 0, i, n_head, k_stage)
                    + self._series_stages(v, k, n_rest, d))
        _, n1, n_rest, d_rest = choice
        return self.stages(node.children[j], n1, d_rest) + self._series_stages(v, j + 1, n_rest, d)

    def _parallel_stages(self, v: int, i: int, e: int, n: int, d: int) -> list[tuple[int, int]]:
        """The first option, in the DP's order, that meets the range's least in-flight level."""
        node = self.nodes[v]
        if e - i == 1:
            return self.stages(node.children[i], n, d)
        x = self.parallel(v, i, e, n, d)[0] - d - 1
        for t in range(i + 1, e + 1):
            group = node.prefix[t] & ~node.prefix[i]
            if self.work(group) > self.tmax * self.max_stage:
                break
            g = self._group_bits(v, i, t, group, d + 1)
            for n1 in self.stage_devices:
                if not g >> n1 & 1:
                    continue
                if t == e and n1 == n:
                    return [(group, n1)]
                if t < e and n > n1 and _level(self.table(v, t, e, d), x) >> (n - n1) & 1:
                    return [(group, n1)] + self._parallel_stages(v, t, e, n - n1, d)
        c = node.children[i]
        mine, rest = _level(self.child_table(c, d), x), _level(self.table(v, i + 1, e, d), x)
        while mine:
            low = mine & -mine
            n1 = low.bit_length() - 1
            mine ^= low
            if n > n1 and rest >> (n - n1) & 1:
                return self.stages(c, n1, d) + self._parallel_stages(v, i + 1, e, n - n1, d)
        raise AssertionError("a feasible parallel range has no option at its own level")


@functools.lru_cache(maxsize=32)
def _fewest_stages(stage_devices: tuple[int, ...], num_devices: int) -> tuple[float, ...]:
    """``fewest[n]``: the fewest terms from ``stage_devices`` (repeats allowed) summing to ``n``,
    for ``n`` up to ``num_devices`` (infinite when none do).

    >>> _fewest_stages((1, 2, 4), 7)
    (0, 1, 1, 2, 1, 2, 2, 3)
    """
    fewest = [0] + [math.inf] * num_devices
    for n in range(1, num_devices + 1):
        fewest[n] = 1 + min((fewest[n - c] for c in stage_devices if c <= n), default=math.inf)
    return tuple(fewest)


def _level(tab: list[int], x: int) -> int:
    """Level ``x`` of a table; a shallower table is complete at its last level."""
    return tab[x] if x < len(tab) else tab[-1]


def _padded(tab: list[int], levels: int) -> list[int]:
    return tab if len(tab) >= levels else tab + [tab[-1]] * (levels - len(tab))


def _sumset(a: int, b: int, cap: int) -> int:
    """Bit ``x + y`` for every bit ``x`` of ``a`` and ``y`` of ``b``, up to ``cap``'s bits."""
    if not a or not b:
        return 0
    if a.bit_count() > b.bit_count():
        a, b = b, a
    out = 0
    while a:
        low = a & -a
        out |= b << (low.bit_length() - 1)
        a ^= low
    return out & cap


def work_fn(cm: StageCostModel, shard: float) -> Callable[[int], float]:
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


def narrow_bracket(attempt, bottleneck, lo: float, hi: float, best, *, rel_tol: float):
    """Bisect ``[lo, hi]`` down to ``rel_tol``: the least ``tmax`` at which ``attempt(tmax)``
    finds stages, and those stages (``best``, found at ``hi``). ``attempt`` fails below the
    optimum and succeeds at or above it; a found plan's own ``bottleneck`` (at most the ``tmax``
    that found it) closes the bracket from above.

    >>> narrow_bracket(lambda t: t if t >= 3 else None, lambda s: s, 0.0, 8.0, 8.0, rel_tol=0.01)[0] >= 3
    True
    """
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        found = attempt(mid)
        if found is None:
            lo = mid
        else:
            hi, best = min(mid, bottleneck(found)), found
    return hi, best
