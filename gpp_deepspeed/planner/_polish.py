"""Local search on a found plan's exact bottleneck: GraphPipe's DP prices each stage before its
neighbours' degrees are known, so a plan with stages of different degrees can cost more than the
DP thought (the engine reshards rows between them, one message per peer rank). Starting from such a
plan, :func:`polish` tries small changes, priced exactly as the simulator prices them
(:meth:`~gpp_deepspeed.planner.costs.StageCostModel.plan_bottleneck`), and keeps the best one while
it lowers the bottleneck.

The changes keep every stage convex and the stage graph acyclic, so the engine runs any result:

* **split** a stage of ``n`` ranks at a position of its layers in the database's topological
  order into two stages of ``n1 + n2 = n`` ranks (each part is convex: no layer of the first is a
  descendant of one of the second);
* **merge** two stages whose union is convex into one on the sum of their ranks;
* **move ranks** from one stage to another, both keeping a degree the search allows.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Sequence

from .costs import StageCostModel

__all__ = ["polish"]

Stages = list[tuple[int, int]]   # (layer mask, data-parallel degree) per stage


def polish(cm: StageCostModel, stages: Sequence[tuple[int, int]], b: int, stage_devices: Sequence[int],
           fits: Callable[[Stages], bool], *, budget_s: float = 0.3) -> Stages:
    """``stages`` after best-improvement steps on their exact bottleneck at micro-batch ``b``,
    each step the change (above) that lowers it most and still ``fits`` (memory under the
    schedule), until none does or ``budget_s`` seconds have passed. Degrees stay in
    ``stage_devices``; the device count stays the same.

    >>> from gpp_deepspeed.planner.costs import CommFit, CostDB, Hardware, LayerCost
    >>> link = CommFit(alpha_s=1.0, beta_s_per_byte=0.0)     # a message keeps each end busy 1 s
    >>> hw = Hardware(name="h", memory_bytes=1, devices_per_node=8, intra=link, inter=link)
    >>> layer = lambda name, inputs: LayerCost(name=name, inputs=inputs, micro_batches=(4,), fwd_s=(4.0,),
    ...                                        bwd_s=(8.0,), param_bytes=0, out_bytes=1, stash_bytes=0)
    >>> db = CostDB(model="m", source="hand", input_names=("x",), output="l2", hardware=hw,
    ...             layers=(layer("l0", ("x",)), layer("l1", ("l0",)), layer("l2", ("l1",))))
    >>> cm = StageCostModel(db, 4)
    >>> found = [(0b011, 4), (0b100, 1)]        # l0, l1 on 4 ranks feed l2 on 1: 4 messages each way
    >>> cm.plan_bottleneck(found, 4)            # l2: (4 + 8) / 4 per sample, and 2 * 4 * 1 s / 4 busy
    5.0
    >>> better = polish(cm, found, 4, (1, 2, 4), lambda stages: True)
    >>> better, cm.plan_bottleneck(better, 4)
    ([(1, 2), (2, 2), (4, 1)], 4.0)
    """
    allowed = frozenset(stage_devices)
    best = list(stages)
    best_value = cm.plan_bottleneck(best, b)
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline:
        step, step_value = None, best_value * (1 - 1e-9)
        for candidate in _changes(cm, best, allowed):
            value = cm.plan_bottleneck(candidate, b)
            if value < step_value and fits(candidate):
                step, step_value = candidate, value
            if time.perf_counter() >= deadline:
                break
        if step is None:
            break
        best, best_value = step, step_value
    return sorted(best, key=lambda stage: stage[0] & -stage[0])   # by each stage's first layer


def _changes(cm: StageCostModel, stages: Stages, allowed: frozenset[int]) -> Iterator[Stages]:
    """Every plan one change away from ``stages`` (module docstring)."""
    for s, (mask, n) in enumerate(stages):
        rest = stages[:s] + stages[s + 1:]
        members = cm._members(mask)
        for k in range(1, len(members)):
            first = sum(1 << i for i in members[:k])
            for n1 in allowed:
                if n - n1 in allowed:
                    yield rest + [(first, n1), (mask & ~first, n - n1)]
    for s, (mask_s, n_s) in enumerate(stages):
        for t in range(s + 1, len(stages)):
            mask_t, n_t = stages[t]
            union = mask_s | mask_t
            if n_s + n_t in allowed and _convex(cm, union):
                yield [x for i, x in enumerate(stages) if i not in (s, t)] + [(union, n_s + n_t)]
    for s, (mask_s, n_s) in enumerate(stages):
        for t, (mask_t, n_t) in enumerate(stages):
            if s == t:
                continue
            for wider in allowed:
                moved = wider - n_s
                if moved > 0 and n_t - moved in allowed:
                    yield [(mask_s, wider) if i == s else (mask_t, n_t - moved) if i == t else x
                           for i, x in enumerate(stages)]


def _convex(cm: StageCostModel, mask: int) -> bool:
    """No path leaves layer set ``mask`` and comes back into it."""
    below = above = 0
    for i in cm._members(mask):
        below |= cm.descendants[i]
        above |= cm.ancestors[i]
    return not below & above & ~mask
