"""Piper's planner (Tarnawski et al., NeurIPS'21): a DP over the downsets of the layer DAG.

Glossary
--------
upset
    A set of layers closed under consumers: with a layer it holds every layer that reads it.
    Piper grows its "ideals" from the sink side (``Graph::runDP``); an upset is the complement
    of a downset, so there are as many of either. Layers only: graph inputs are not nodes.
stage
    ``U \\ U'`` for nested upsets ``U' < U``: a convex set of layers. The stages of a plan are
    the differences of a chain of nested upsets, so they come in a linear order (source first)
    and run as a chain pipeline with synchronous 1F1B, as in Piper.
s
    Devices of a stage and of every stage after it (sink side). With tensor parallelism fixed to
    ``t = 1`` it is also Piper's device count ``k``, so the two indices of ``dp[I][k][s]`` collapse.
in flight
    Piper's memory rule: a stage on ``d`` devices keeps ``y = ceil(s / d)`` micro-batches stashed
    (code comment in Piper's ``algo.cpp``: "usage is A*y + B").

DP table (one per micro-batch size ``b``)::

    dp[U][s] = least bottleneck time per sample of a pipeline covering upset U on exactly s devices
             = min over upsets U' < U, d | b, d <= s, stage U \\ U' fits with y = ceil(s / d):
                   max(dp[U'][s - d], TPS(U \\ U', b, d))
    dp[{}][0] = 0, every other dp[{}][s] = inf;  answer min over 1 <= s <= N of dp[all layers][s]

``TPS`` is the shared cost model's time per sample
(:meth:`~gpp_deepspeed.planner.costs.StageCostModel.time_per_sample`) with the boundaries of the
chain pipeline that runs the plan (a skip tensor is relayed through the stages in between,
:meth:`~gpp_deepspeed.planner.costs.StageCostModel.chain_boundaries`), evaluated for every pair
``U' < U`` at once with numpy. Cost: ``O(|D|^2)`` pairs of upsets (GraphPipe, arXiv 2406.17145,
Sec. 7.2, quoting Piper's Appendix D) times the ``(b, d, s)`` combinations; ``|D|`` grows as
``length^branches``, so Piper stops at a state limit (``IDEALS_LIMIT = 40,000`` in its code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import SearchLimitError
from .costs import StageCostModel, weight_state_bytes, zero_collectives

__all__ = ["enumerate_upsets", "piper_bottlenecks"]


def enumerate_upsets(model: StageCostModel, *, limit: int) -> list[int]:
    """Every upset of the layer DAG as a bitmask over ``db.layers`` indices, smallest first.

    Raises :class:`SearchLimitError` as soon as more than ``limit`` have been found, without
    enumerating the rest (a 16-branch model has about ``5**16`` of them).
    """
    sinks = 0
    for i, consumers in enumerate(model.consumers):
        if not consumers:
            sinks |= 1 << i
    seen = {0}
    stack = [(0, sinks)]   # an upset and the layers that may join it (its producers, the sinks)
    while stack:
        upset, reachable = stack.pop()
        avail = reachable & ~upset
        while avail:
            low = avail & -avail
            avail ^= low
            layer = low.bit_length() - 1
            if model.consumers[layer] & ~upset:
                continue
            grown = upset | low
            if grown in seen:
                continue
            seen.add(grown)
            if len(seen) > limit:
                raise SearchLimitError(
                    f"Piper: more than {limit} downsets (state limit); {model.db.model} has too many parallel "
                    f"branches for Piper's O(|D|^2) DP over downsets (raise state_limit to try anyway)")
            stack.append((grown, reachable | model.producers[layer]))
    return sorted(seen, key=int.bit_count)


@dataclass
class _Pairs:
    """Every upset's layer-additive sums and the bit tables for pricing pairs ``U' < U``."""

    upsets: list[int]
    words: np.ndarray        # [D, W] uint64: the upsets as bit words, for subset tests
    member: np.ndarray       # [D, n] bool
    fed_bytes: np.ndarray    # [D] bytes per sample X reads from outside itself, each tensor once
    params: np.ndarray       # [D] parameter bytes
    stash: np.ndarray        # [D] stashed bytes per sample
    layer_params: np.ndarray  # [n] parameter bytes of each layer

    @classmethod
    def build(cls, model: StageCostModel, upsets: list[int]) -> "_Pairs":
        layers = model.db.layers
        n, num_upsets = model.num_layers, len(upsets)
        width = (n + 63) // 64 * 8
        raw = b"".join(u.to_bytes(width, "little") for u in upsets)
        words = np.frombuffer(raw, dtype="<u8").reshape(num_upsets, width // 8)
        member = np.unpackbits(np.frombuffer(raw, dtype=np.uint8).reshape(num_upsets, width), axis=1,
                               bitorder="little")[:, :n].astype(bool)
        reads = np.zeros((n, n), dtype=np.float32)       # reads[l, p]: layer l reads layer p
        for l in range(n):
            for p in model._members(model.producers[l]):
                reads[l, p] = 1.0
        readers = member.astype(np.float32) @ reads
        feeds = ~member & (readers > 0)
        out_bytes = np.array([c.out_bytes for c in layers], dtype=np.float64)
        as_float = member.astype(np.float64)
        param_bytes = np.array([c.param_bytes for c in layers], dtype=np.float64)
        return cls(upsets=upsets, words=words, member=member, fed_bytes=feeds @ out_bytes,
                   params=as_float @ param_bytes,
                   stash=as_float @ np.array([c.stash_bytes for c in layers], dtype=np.float64),
                   layer_params=param_bytes)

    def below(self, u: int) -> np.ndarray:
        """Indices of the upsets strictly inside upset ``u`` (they precede it: sorted by size)."""
        return np.flatnonzero(((self.words[:u] & ~self.words[u]) == 0).all(axis=1))

    def boundaries(self, u: int, sub: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bytes per sample entering and leaving each stage ``U \\ U'``, ``U'`` in ``sub``, as the
        chain pipeline that runs Piper's plans relays them.

        The stages before ``U \\ U'`` hold every layer outside ``U`` and those after it ``U'``, so the
        cut before the stage carries what ``U`` reads from outside itself and the cut after it
        what ``U'`` does: :meth:`StageCostModel.cut_bytes` at the stage's two boundaries.
        """
        return np.full(len(sub), self.fed_bytes[u]), self.fed_bytes[sub]


@dataclass
class _Combos:
    """The ``(b, d)`` combinations swept, grouped by ``d``, and their per-upset compute sums.

    A stage's TPS is ``compute / b + coef @ features`` (see :func:`_price`), which is
    :meth:`StageCostModel.time_per_sample` regrouped so that one matrix product prices all pairs.
    """

    micro_batches: list[int]
    num_devices: int
    degrees: list[int]                 # distinct d
    rows: list[slice | np.ndarray]     # per d: the micro_batches with b % d == 0
    d: np.ndarray                      # [K, 1] d of each combination, d-major
    shard: np.ndarray                  # [K, 1] samples per device, b / d
    coef: np.ndarray                   # [K, 4] 1/b, 1/d, all-reduce latency / B, per byte / B
    compute: np.ndarray                # [K, D] fwd + bwd seconds per sample of each upset
    scratch: tuple[np.ndarray, np.ndarray] = ()   # two [K * D] buffers reused for every U

    @classmethod
    def build(cls, model: StageCostModel, pairs: _Pairs, micro_batches: Sequence[int], num_devices: int) -> "_Combos":
        hw = model.db.hardware
        mbs = list(micro_batches)
        degrees = [d for d in range(1, num_devices + 1) if any(b % d == 0 for b in mbs)]
        rows, ds, shards, coef, per_layer = [], [], [], [], []
        for d in degrees:
            picked = [i for i, b in enumerate(mbs) if b % d == 0]
            contiguous = picked == list(range(picked[0], picked[-1] + 1))
            rows.append(slice(picked[0], picked[-1] + 1) if contiguous else np.array(picked))
            (latency, per_byte), *per_mb = zero_collectives(hw.ring(d), d, zero_stage=model.zero_stage)
            mb_latency, mb_per_byte = sum(c[0] for c in per_mb), sum(c[1] for c in per_mb)
            for i in picked:
                b = mbs[i]
                ds.append(d)
                shards.append(b / d)
                # The all-reduce is paid once per mini-batch B: b / B of it per micro-batch, 1 / B
                # per sample; ZeRO-2/3's collectives once per micro-batch, 1 / b per sample.
                coef.append((1 / b, 1 / d, latency / model.mini_batch + mb_latency / b,
                             per_byte / model.mini_batch + mb_per_byte / b))
                per_layer.append([sum(model.layer_times(b / d)[l]) / b for l in range(model.num_layers)])
        compute = np.array(per_layer, dtype=np.float64) @ pairs.member.T.astype(np.float64)
        return cls(mbs, num_devices, degrees, rows, np.array(ds, dtype=np.float64)[:, None],
                   np.array(shards)[:, None], np.array(coef), compute, (np.empty(compute.size), np.empty(compute.size)))


def _price(model: StageCostModel, pairs: _Pairs, combos: _Combos, u: int, sub: np.ndarray):
    """TPS ``[K, k]`` of every stage ``U \\ U'`` under every combination, and the most devices
    ``s`` each may have from itself on and still fit (``[K, k]``, below 1 when it never fits;
    None when every stage fits with any ``s``)."""
    hw, link = model.db.hardware, model.link
    in_b, out_b = pairs.boundaries(u, sub)
    params = pairs.params[u] - pairs.params[sub]
    features = np.stack([
        2 * link.busy_s * ((in_b > 0).astype(np.float64) + (out_b > 0)),    # per message, x 1/b
        2 * link.beta_s_per_byte * (in_b + out_b),                            # bytes, x b/d / b
        (params > 0).astype(np.float64),
        params])
    tps, extra = (buf[:combos.coef.shape[0] * len(sub)].reshape(-1, len(sub)) for buf in combos.scratch)
    np.take(combos.compute, sub, axis=1, out=tps, mode="clip")
    np.subtract(combos.compute[:, u][:, None], tps, out=tps)
    tps += np.matmul(combos.coef, features, out=extra)
    # Fits with y in flight when weight + y * stash <= memory (StageCostModel.memory); y <= N.
    weight = weight_state_bytes(params, optimizer_factor=hw.optimizer_factor, num_devices=combos.d,
                                zero_stage=model.zero_stage)    # [K, k]
    if model.zero_stage == 3:
        # One layer's parameters gathered at a time (StageCost.gathered_bytes): the stage's largest.
        largest = np.where(pairs.member[u] & ~pairs.member[sub], pairs.layer_params, 0.0).max(axis=1, initial=0.0)
        weight = weight + np.where(combos.d > 1, largest, 0.0)
    stash = pairs.stash[u] - pairs.stash[sub]
    if np.all(weight + combos.num_devices * combos.shard.max() * stash <= hw.memory_bytes):
        return tps, None
    stash = stash * combos.shard
    room = hw.memory_bytes - weight
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.floor(room / stash)      # +-inf without stash; nan for 0 / 0, which always fits
        y[np.isnan(y)] = np.inf
        # Undo floor()'s rounding so that y agrees with the exact test.
        y += (weight + (y + 1) * stash <= hw.memory_bytes)
        y -= (weight + y * stash > hw.memory_bytes)
    return tps, y * combos.d


def piper_bottlenecks(model: StageCostModel, upsets: list[int], *, micro_batches: Sequence[int], num_devices: int
                      ) -> tuple[dict[int, tuple[float, list[tuple[int, int]]] | None], int, int]:
    """Solve Piper's DP (see the module docstring) for every micro-batch size in one pass.

    ``upsets`` come from :func:`enumerate_upsets`. Returns, per micro-batch size, the least
    bottleneck time per sample and its stages as ``(layer mask, devices)`` from source to sink
    (or None when nothing fits), the DP cells filled and the ``(U', U)`` pairs priced.
    """
    pairs = _Pairs.build(model, upsets)
    combos = _Combos.build(model, pairs, micro_batches, num_devices)
    big_n, num_upsets = num_devices, len(upsets)
    dp = np.full((len(combos.micro_batches), big_n + 1, num_upsets), np.inf)   # [b, s, U]
    dp[:, 0, 0] = 0.0
    priced = 0
    # Scratch space reused for every U: fresh multi-megabyte arrays per U cost page faults.
    gathered = np.empty(dp.size)
    scratch = np.empty(dp.size)
    for u in range(1, num_upsets):
        sub = pairs.below(u)
        priced += len(sub)
        tps, most = _price(model, pairs, combos, u, sub)
        after = gathered[:dp.shape[0] * dp.shape[1] * len(sub)].reshape(dp.shape[0], dp.shape[1], len(sub))
        np.take(dp, sub, axis=2, out=after, mode="clip")
        start = 0
        for d, rows in zip(combos.degrees, combos.rows):
            block = slice(start, start + _count(rows))
            start = block.stop
            best = _best(after[rows], d, tps[block], None if most is None else most[block], scratch)
            dp[rows, d:, u] = np.minimum(dp[rows, d:, u], best)
    results = {}
    for row, b in enumerate(combos.micro_batches):
        s = int(np.argmin(dp[row, 1:, -1])) + 1
        value = float(dp[row, s, -1])
        results[b] = None if value == np.inf else (value, _stages(model, pairs, combos, dp, row, s))
    return results, num_upsets * big_n * len(combos.micro_batches), priced


def _count(rows: slice | np.ndarray) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else len(rows)


def _best(after: np.ndarray, d: int, tps: np.ndarray, most: np.ndarray | None, scratch: np.ndarray) -> np.ndarray:
    """``[rows, N + 1 - d]``: the best value of ``dp[U][s]``, ``s >= d``, over the stages
    ``U \\ U'`` on ``d`` devices; ``after`` is ``dp[.][U']`` for the rows' micro-batches."""
    rows, big_n, k = after.shape[0], after.shape[1] - 1, after.shape[2]
    value = scratch[:rows * (big_n + 1 - d) * k].reshape(rows, big_n + 1 - d, k)
    np.maximum(after[:, :big_n + 1 - d, :], tps[:, None, :], out=value)   # max(dp[s - d][U'], TPS)
    if most is not None:
        fits = np.arange(d, big_n + 1)[None, :, None] <= most[:, None, :]
        np.copyto(value, np.inf, where=~fits)
    return value.min(axis=2)


def _stages(model, pairs: _Pairs, combos: _Combos, dp: np.ndarray, row: int, s: int) -> list[tuple[int, int]]:
    """Walk the DP back from all layers on ``s`` devices: ``(mask, devices)`` from source to sink.

    At each upset the witness is the cheapest ``(U', d)`` re-priced, so no float is compared
    for equality with the table.
    """
    stages, u = [], len(pairs.upsets) - 1
    indices = range(len(combos.micro_batches))
    while u:
        sub = pairs.below(u)
        tps, most = _price(model, pairs, combos, u, sub)
        best, start = None, 0
        for d, rows in zip(combos.degrees, combos.rows):
            picked = list(indices[rows])
            block, start = start, start + len(picked)
            if d > s or row not in picked:
                continue
            combo = block + picked.index(row)
            value = np.maximum(dp[row, s - d, sub], tps[combo])
            if most is not None:
                value = np.where(s <= most[combo], value, np.inf)
            k = int(np.argmin(value))
            if best is None or value[k] < best[0]:
                best = (value[k], int(sub[k]), d)
        assert best is not None and best[0] < np.inf, "a finite DP value has a witness"
        _, prev, d = best
        stages.append((pairs.upsets[u] & ~pairs.upsets[prev], d))
        u, s = prev, s - d
    return stages
