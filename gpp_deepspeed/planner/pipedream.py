"""PipeDream's partitioner (Narayanan et al., SOSP'19, Sec. 3.1) on a linearised model.

Glossary
--------
chain order
    The layers in one topological order (the model's list order). GraphPipe's comparison runs
    PipeDream on this "converted DNN that linearizes all branches" (arXiv 2406.17145, Sec. 7.2).
cut bytes
    Bytes per sample crossing the boundary before chain position ``k``: every tensor produced
    before ``k`` and read at or after it. A chain pipeline relays skip tensors through the stages
    in between, so this is what the stage on either side sends and receives
    (:meth:`~gpp_deepspeed.planner.costs.StageCostModel.chain_boundaries`).
replicas
    A stage's data-parallel degree ``r``; each replica runs ``b / r`` samples of a micro-batch.
NOAM
    PipeDream's in-flight rule: a stage keeps ``ceil(m / r)`` micro-batches stashed, ``m`` being
    the devices of this and every later stage (SOSP'19 Sec. 3.3, "NOAM").
weight versions
    Planning for an asynchronous schedule (``weights``, its
    :class:`~gpp_deepspeed.schedule.WeightRule`), a stage also holds the copies of its weights
    the schedule stashes: one per in-flight micro-batch for PipeDream's weight stashing (SOSP'19
    Sec. 3.3), two for PipeDream-2BW (:meth:`~gpp_deepspeed.schedule.WeightRule.stashed_versions`).
    A stage fits when ``weight + NOAM * stash + versions(NOAM) * params <= memory``; the plan
    found is then priced by the simulator on the program the engine runs.

DP table (one micro-batch size ``b``; positions ``0..n`` index the chain order)::

    A[i][m] = least bottleneck time per sample of the suffix [i, n) on exactly m devices
            = min over j in (i, n], r | b, r <= m, stage [i, j) fits with NOAM = ceil(m / r):
                  max(TPS([i, j), b, r), A[j][m - r])
    A[n][0] = 0,  A[n][m > 0] = A[i < n][0] = inf;  answer A[0][N]

``TPS`` is the shared cost model's time per sample
(:meth:`~gpp_deepspeed.planner.costs.StageCostModel.time_per_sample`) with the chain's cut bytes
as the stage boundary; here it is evaluated from prefix sums in O(1) per range. The paper's
recurrence nests ranges hierarchically (``O(n^3 m^2)`` per level); on one flat level the suffix
form above is the same optimum in ``O(n^2 N |R|)`` transitions, ``|R|`` the replica counts.
Exact pruning: a range whose compute alone exceeds the best value found for its cell, or the
bottleneck of a uniform partition (an upper bound on the optimum), is never extended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..schedule.asynchronous import WeightRule
from .costs import StageCostModel, weight_state_bytes, zero_collectives

__all__ = ["ChainCosts", "pipedream_bottleneck"]

_INF = float("inf")


@dataclass
class ChainCosts:
    """Prefix sums that price any contiguous range of the chain order as a stage in O(1).

    The formulas are those of :meth:`StageCostModel.stage` with a chain boundary: compute is
    summed per layer, each stage receives and sends its two cut tensors forward and their
    gradients backward, and a replicated stage pays its share ``b / B`` of a ring all-reduce (under
    ZeRO-2/3 its per-micro-batch collectives, :func:`~gpp_deepspeed.planner.costs.zero_collectives`);
    its weight state is :func:`~gpp_deepspeed.planner.costs.weight_state_bytes`.
    """

    model: StageCostModel
    positions: tuple[int, ...]      # chain position -> index in db.layers
    cut: tuple[float, ...]          # cut[k]: bytes per sample crossing the boundary before position k
    params: tuple[float, ...]       # prefix sums of parameter bytes
    stash: tuple[float, ...]        # prefix sums of stashed bytes per sample
    _compute: dict                  # (b, r) -> prefix sums of fwd + bwd seconds at shard b / r

    @classmethod
    def build(cls, model: StageCostModel, order: Sequence[str]) -> "ChainCosts":
        layers = model.db.layers
        positions = tuple(model.index[name] for name in order)
        cut = model.cut_bytes(positions)
        return cls(model=model, positions=positions, cut=tuple(cut),
                   params=_prefix(layers[i].param_bytes for i in positions),
                   stash=_prefix(layers[i].stash_bytes for i in positions), _compute={})

    @property
    def num_layers(self) -> int:
        return len(self.positions)

    def mask(self, i: int, j: int) -> int:
        """The layer bitmask of chain positions ``[i, j)``."""
        m = 0
        for k in range(i, j):
            m |= 1 << self.positions[k]
        return m

    def compute(self, b: int, r: int) -> tuple[float, ...]:
        """Prefix sums of forward plus backward seconds per micro-batch of ``b`` on ``r`` replicas."""
        key = (b, r)
        hit = self._compute.get(key)
        if hit is None:
            times = self.model.layer_times(b / r)
            hit = self._compute[key] = _prefix(sum(times[i]) for i in self.positions)
        return hit

    def stage_row(self, i: int, b: int, r: int, *, cap: float = _INF, stop: int | None = None):
        """Per stop ``j``: a compute-only lower bound on TPS, the TPS, the weight bytes and the
        stash bytes per in-flight micro-batch of positions ``[i, j)`` as one stage with ``r``
        replicas at micro-batch ``b``. Ends (lower bound and weight ``inf`` from there on) at
        ``stop``, where even one micro-batch in flight does not fit, or where the lower bound
        exceeds ``cap``.

        :meth:`StageCostModel.stage`'s arithmetic on prefix sums, inlined: it runs ``O(n^2 |R|)``
        times per micro-batch size.
        """
        n = self.num_layers
        compute, cut, params, stash_sum = self.compute(b, r), self.cut, self.params, self.stash
        hw = self.model.db.hardware
        limit = hw.memory_bytes
        busy, beta = self.model.link.busy_s, self.model.link.beta_s_per_byte
        shard = b / r
        share = b / self.model.mini_batch
        zero = self.model.zero_stage
        # The group's collectives (zero_collectives): once per mini-batch (b / B of it per
        # micro-batch) and, under ZeRO-2/3, per micro-batch.
        (ar_alpha, ar_beta), *per_mb = zero_collectives(hw.ring(r), r, zero_stage=zero)
        mb_alpha, mb_beta = sum(c[0] for c in per_mb), sum(c[1] for c in per_mb)
        comm_in = 2 * self.model.link.busy(cut[i] * shard)
        lower = [_INF] * (n + 1)
        tps = [_INF] * (n + 1)
        weight = [0.0] * (i + 1) + [_INF] * (n - i)
        stash = [0.0] * (n + 1)
        c0, p0, s0, f = compute[i], params[i], stash_sum[i], hw.optimizer_factor
        largest = 0.0    # ZeRO-3 gathers one layer's parameters at a time (StageCost.gathered_bytes)
        for j in range(i + 1, (n if stop is None else stop) + 1):
            p = params[j] - p0
            if zero == 3 and r > 1:
                largest = max(largest, params[j] - params[j - 1])
            w = weight_state_bytes(p, optimizer_factor=f, num_devices=r, zero_stage=zero) + largest
            st = (stash_sum[j] - s0) * shard
            work = compute[j] - c0
            if w + st > limit or work > cap * b:
                break
            x = cut[j] * shard
            comm = comm_in + 2 * (busy + beta * x) if x > 0 else comm_in
            allreduce = (ar_alpha + ar_beta * p) * share + mb_alpha + mb_beta * p if p > 0 else 0.0
            lower[j] = work / b
            tps[j] = (work + comm + allreduce) / b
            weight[j] = w
            stash[j] = st
        return lower, tps, weight, stash


def pipedream_bottleneck(costs: ChainCosts, *, micro_batch: int, num_devices: int, replication: bool = True,
                         weights: WeightRule | None = None) -> tuple[float | None, list[tuple[int, int, int]] | None, int]:
    """Solve PipeDream's DP (see the module docstring) for one micro-batch size.

    Returns the least bottleneck time per sample, the stages as ``(start, stop, replicas)`` chain
    position ranges in pipeline order, and the DP cells filled; ``(None, None, cells)`` when no
    partition on exactly ``num_devices`` devices fits in memory. ``replication=False`` is
    PipeDream's ``--straight_pipeline``: one device per stage, ``num_devices`` stages. ``weights``:
    the weight rule of the asynchronous schedule planned for, whose weight versions count in memory.
    """
    b, big_n, n = micro_batch, num_devices, costs.num_layers
    reps = [r for r in range(1, big_n + 1) if b % r == 0] if replication else [1]
    max_rep = reps[-1]
    limit = costs.model.db.hardware.memory_bytes
    # by_devices[m][i] = A[i][m]: the DP reads whole columns A[.][m - r].
    by_devices = [[_INF] * (n + 1) for _ in range(big_n + 1)]
    choice: dict[tuple[int, int], tuple[int, int]] = {}
    by_devices[0][n] = 0.0
    cells = 0
    # No stage of an optimal plan is slower than a known plan's bottleneck: rows end there.
    bound = _uniform_bound(costs, b, big_n, reps, weights) * (1 + 1e-9)
    for i in range(n - 1, -1, -1):
        rows = {r: costs.stage_row(i, b, r, cap=bound) for r in reps}
        fitting: dict[tuple[int, int], int] = {}
        for m in range(1, min(big_n, (n - i) * max_rep) + 1):
            cells += 1
            best, arg = bound, None
            for r in reps:
                if r > m:
                    break
                rest = m - r
                lower, tps, weight, stash = rows[r]
                # The rest needs at least one layer per max_rep devices; memory only grows with j.
                in_flight = -(-m // r)
                j_fit = fitting.get((r, in_flight))
                if j_fit is None:
                    versions = weights.stashed_versions(in_flight) if weights is not None else 0
                    j_fit = fitting[r, in_flight] = _last_fitting(weight, stash, costs.params, i, in_flight,
                                                                  versions, limit)
                j_max = min(n - -(-rest // max_rep), j_fit)
                j_min = n if rest == 0 else i + 1
                after_col = by_devices[rest]
                for j in range(j_min, j_max + 1):
                    if lower[j] >= best:
                        break       # compute alone only grows with j
                    after = after_col[j]
                    if after >= best:
                        continue
                    t = tps[j]
                    value = t if t > after else after
                    if value < best:
                        best, arg = value, (j, r)
            if arg is not None:
                by_devices[m][i], choice[i, m] = best, arg
    if (0, big_n) not in choice:
        return None, None, cells
    stages, i, m = [], 0, big_n
    while i < n:
        j, r = choice[i, m]
        stages.append((i, j, r))
        i, m = j, m - r
    return by_devices[big_n][0], stages, cells


def _uniform_bound(costs: ChainCosts, b: int, num_devices: int, reps: list[int], weights: WeightRule | None) -> float:
    """The least bottleneck of the plans that cut the chain into equal layer counts with the
    same replica count per stage (DeepSpeed's uniform partition), or inf when none fits."""
    n, limit, best = costs.num_layers, costs.model.db.hardware.memory_bytes, _INF
    for r in reps:
        num_stages = num_devices // r
        if num_devices % r or num_stages > n:
            continue
        chunk, extra = divmod(n, num_stages)
        bounds = [k * chunk + min(k, extra) for k in range(num_stages + 1)]
        worst = 0.0
        for k, (i, j) in enumerate(zip(bounds, bounds[1:])):
            _, tps, weight, stash = costs.stage_row(i, b, r, stop=j)
            in_flight = num_stages - k      # NOAM of stage k
            versions = weights.stashed_versions(in_flight) if weights is not None else 0
            if weight[j] + in_flight * stash[j] + versions * (costs.params[j] - costs.params[i]) > limit:
                worst = _INF
                break
            worst = max(worst, tps[j])
        best = min(best, worst)
    return best


def _last_fitting(weight: list[float], stash: list[float], params: tuple[float, ...], i: int, in_flight: int,
                  versions: int, limit: float) -> int:
    """The largest ``j`` with ``weight[j] + in_flight * stash[j] + versions * params[i:j] <= limit``
    (``i`` if none): all grow with ``j``, so bisect."""
    lo, hi = i, len(weight) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if weight[mid] + in_flight * stash[mid] + versions * (params[mid] - params[i]) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _prefix(values) -> tuple[float, ...]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return tuple(out)
