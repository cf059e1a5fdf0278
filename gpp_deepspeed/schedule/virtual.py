"""Several stages per rank on a stage DAG: folds and the compute order of each rank.

A *fold* places the stages of a stage DAG on fewer pipeline ranks than stages (Megatron's virtual
stages, "model chunks"): each rank runs one list of actions across its stages. This module is the
schedule side of it, pure like the rest of :mod:`gpp_deepspeed.schedule`: which stage goes where,
the order in which each rank runs its stages' forwards and backwards, the program of each rank and
its checks. The choice of a fold is the planner's (:mod:`gpp_deepspeed.planner.fold_search`).

Glossary
--------
fold
    :class:`~gpp_deepspeed.schedule.greedy.Fold`: ``rank_of[s]`` is the pipeline rank that runs
    stage ``s``.
looped placement
    Stage ``s`` of a chain of ``v p`` stages on rank ``s mod p`` (Megatron's interleaved 1F1B,
    Narayanan et al., SC'21, Sec. 2.2; torch's ``ScheduleInterleaved1F1B``).
V placement
    Rank ``r`` of ``p`` holds stages ``r`` and ``2 p - 1 - r``, an early and a late one (ZB-V, Qi
    et al., "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362; DualPipeV).

Each rank's compute order is one of :data:`FOLDED_SCHEDULES`: :func:`interleaved_1f1b`
(Megatron's), :func:`~gpp_deepspeed.schedule.greedy.rank_orders` with the split backward (ZB-V's
placement, the greedy list schedule ``zb2`` runs with one stage per rank) or :func:`dualpipev_orders`
(DualPipeV's, torch's ``ScheduleDualPipeV`` order on a chain). :func:`fold_program` then lowers it
into one list of actions per rank across its stages (an edge inside a rank is a hand-over, not a
message; one ``LOAD`` per micro-batch and stage that reads the batch, one step per rank), grouped and ordered for NCCL's
rendezvous semantics and checked by the simulator in that mode (:func:`validate_folded`);
:func:`~gpp_deepspeed.planner.fold_search.search_fold` chooses a fold and its schedule, which
GraphPipe's planner calls (:mod:`gpp_deepspeed.planner.fold`). The engine runs these programs (the folded entries of the
schedule registry; :mod:`gpp_deepspeed.engine.rooms`).

Where it stands (``tests/test_virtual_stages.py``; unit ``F = I = W``, 16 micro-batches, a chain of
8 half-stages on 4 ranks, whose ideal is 48): 1F1B on the same layers as 4 whole stages takes 57.0;
interleaved 1F1B 52.5 (Megatron's closed form); ZB-V 49.5 at 1F1B's peak memory (4 whole-layer
micro-batches a rank; 51.5 under Megatron's rule, below); DualPipeV 49.5 (a bubble of ``R - 1``
half-stage forwards) at 4.5. A rank's cap in ``zbv``'s greedy order is the fold's largest
:func:`rank_in_flight` (:func:`~gpp_deepspeed.schedule.greedy.fold_in_flight`, ZB-V's ``2p`` on a
V over a chain), or ``max_in_flight``; ``zbv`` takes ZB-V's rule for the order (micro-batch by
micro-batch, a micro-batch beginning on a rank while it keeps room for one begun there: see
:mod:`~gpp_deepspeed.schedule.greedy`); where every rank holds two stages of different depths
it runs ZB-V's own order (:func:`zbv_rhythm`; on a V over a chain :func:`zbv_v_order`, torch's
``ZBVZeroBubble`` action for action) unless the greedy one computes faster.

Representative use::

    fold = Fold.looped(num_stages=8, num_ranks=4)
    order = rank_orders(StageGraph.chain(8), 16, fold, split_backward=False)   # {rank: [Action, ...]}
"""

from __future__ import annotations

from typing import Callable

from ..errors import GPPConfigError, ScheduleError
from ..graph.stages import StageGraph
from .ir import Action, ActionKind as K
from .greedy import Fold, check_in_flight, fold_in_flight, rank_in_flight, rank_orders, unit_split_duration

__all__ = ["Fold", "FOLDED_SCHEDULES", "IN_FLIGHT_CAPPED", "schedule_in_flight", "rank_orders", "interleaved_1f1b", "zbv_v_order", "zbv_rhythm",
           "dualpipev_orders", "fold_program",
           "validate_folded", "rank_peak", "rank_in_flight", "rank_makespan"]


def rank_makespan(orders: dict[int, list[Action]], stage_graph: StageGraph,
                  duration: Callable[[Action], float] | None = None) -> float:
    """When the last rank finishes ``orders`` with free, instant messages: the simulator's
    makespan (:func:`~gpp_deepspeed.schedule.validate.simulate`, asynchronous sends) of the ranks'
    lists with a message on every stage edge, one rank's own included, so that every action waits
    for what it reads. Raises :class:`ScheduleError` if the orders deadlock.

    >>> orders = rank_orders(StageGraph.chain(2), 2, Fold((0, 0)), split_backward=False)
    >>> rank_makespan(orders, StageGraph.chain(2))
    12.0
    """
    from .validate import simulate

    per_stage = _lowered_stages({s: [a for r in sorted(orders) for a in orders[r] if a.stage_idx == s]
                                 for s in range(stage_graph.num_stages)}, stage_graph, load=False)
    timeline = simulate(_interleave(per_stage, orders), duration=duration or (lambda a: unit_split_duration(a.kind)))
    return max((end for spans in timeline.spans.values() for _, _, end in spans), default=0.0)


def _lowered_stages(compute, stage_graph: StageGraph, *, load: bool = True):
    """Each stage's compute order with its loads and the transfers of its edges."""
    from .lowering import add_load, add_send_recv

    return add_send_recv(add_load(compute, stage_graph) if load else compute, stage_graph)


def _interleave(per_stage, orders: dict[int, list[Action]], *,
                rewrite: Callable[[Action], Action | None] = lambda a: a) -> dict[int, list[Action]]:
    """Each rank's list: its compute in ``orders``, every compute action bringing from its stage's
    list (``per_stage``) the receives and loads before it and the sends after it, each passed
    through ``rewrite`` (which returns what the rank runs in its place, or ``None`` to drop it)."""
    before: dict[Action, list[Action]] = {}
    after: dict[Action, list[Action]] = {}
    for acts in per_stage.values():
        pending, last = [], None
        for a in acts:
            if a.kind is K.FORWARD or a.kind.spec.backward:
                before[a], after[a], pending, last = pending, [], [], a
            elif a.kind.spec.send:
                after[last].append(a)          # a send follows what it reads
            else:
                pending.append(a)              # a receive or a load precedes what needs it
    return {r: [x for c in acts for a in (*before[c], c, *after[c]) if (x := rewrite(a)) is not None]
            for r, acts in orders.items()}


def interleaved_1f1b(stage_graph: StageGraph, num_microbatches: int, fold: Fold) -> dict[int, list[Action]]:
    """Megatron's interleaved 1F1B order on every rank of ``fold`` (Narayanan et al., SC'21,
    Sec. 2.2; torch's ``ScheduleInterleaved1F1B``), a fused backward.

    A rank's forwards go through its stages (in stage order: its "chunks") ``R`` micro-batches at a
    time, ``R`` the number of ranks: micro-batches ``0..R-1`` on its first stage, the same on its
    second, ..., then micro-batches ``R..2R-1``; its backwards go the same way with the stages
    reversed. It runs :func:`rank_in_flight` ``- 1`` forwards first (Megatron's warm-up,
    ``2(p - r - 1) + (v - 1)p`` on a chain), then alternates one forward and one backward, then
    drains. On a chain in looped placement this is Megatron's schedule action for action. On a
    DAG that order can deadlock (a rank waiting on a branch another rank runs later): then the
    ranks run :func:`rank_orders`' greedy order instead, which cannot.

    >>> orders = interleaved_1f1b(StageGraph.chain(4), 4, Fold.looped(num_stages=4, num_ranks=2))
    >>> " ".join(str(a) for a in orders[1])
    '1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3'
    """
    num_ranks, num_mb = fold.num_ranks, num_microbatches
    orders: dict[int, list[Action]] = {}
    for r in range(num_ranks):
        stages = fold.stages_of(r)
        forwards = _chunk_order(stages, num_mb, num_ranks, K.FORWARD)
        backwards = _chunk_order(stages[::-1], num_mb, num_ranks, K.BACKWARD)
        # Megatron's warm-up, or more where a DAG's chunk order would otherwise pair a backward
        # with a forward run before its own (the i-th backward follows forward warmup + i).
        where = {(a.stage_idx, a.mb_idx): i for i, a in enumerate(forwards)}
        own = max((where[(b.stage_idx, b.mb_idx)] - i for i, b in enumerate(backwards)), default=0)
        warmup = min(max(rank_in_flight(stage_graph, fold, r) - 1, own), len(forwards))
        order = forwards[:warmup]
        for f, b in zip(forwards[warmup:], backwards):
            order += [f, b]
        order += backwards[len(forwards) - warmup:]
        orders[r] = order
    try:
        _backward_after_forward(orders)
        rank_makespan(orders, stage_graph)
    except ScheduleError:
        return rank_orders(stage_graph, num_microbatches, fold, split_backward=False)
    return orders


def _backward_after_forward(orders: dict[int, list[Action]]) -> None:
    """Raise :class:`ScheduleError` where a rank's order runs a backward before its forward (on a
    DAG, Megatron's warm-up can be shorter than a stage's distance to the output)."""
    for r, acts in orders.items():
        done = set()
        for a in acts:
            if a.kind is K.FORWARD:
                done.add((a.stage_idx, a.mb_idx))
            elif (a.stage_idx, a.mb_idx) not in done:
                raise ScheduleError(f"rank {r} runs {a} before its forward")


def _chunk_order(stages, num_mb: int, group: int, kind: K) -> list[Action]:
    """``kind`` of every micro-batch on ``stages``: ``group`` micro-batches per stage at a time."""
    out = []
    for first in range(0, num_mb, group):
        for s in stages:
            out += [Action(s, kind, j) for j in range(first, min(first + group, num_mb))]
    return out


def fold_program(stage_graph: StageGraph, num_microbatches: int, fold: Fold, orders: dict[int, list[Action]],
                 *, duration: Callable[[Action], float] | None = None, train: bool = True,
                 layouts: bool = False, early: bool = True) -> dict[int, list[Action]]:
    """Every rank's one list of actions across its stages, lowered for a synchronous batch.

    Each stage is lowered as a stage of its own is (``LOAD``, the transfers of its edges,
    ``merge_backward``, releases); each rank then runs its stages' compute in ``orders``, every
    compute action bringing the receives and loads that precede it on its stage and the sends and
    releases that follow it. What changes on a rank holding several stages:

    * an edge between two stages of one rank sends nothing: each receive becomes a hand-over
      (``HAND_F``: the consumer takes the producer's outputs; ``HAND_B``: the producer takes the
      gradients the consumer computed for them) and the sends are dropped; the producer keeps what
      a hand-over reads until it has run (the releases count it as a use);
    * every stage that reads the batch has its ``LOAD`` (the engine reads each micro-batch from
      the data once per rank and gives each such stage its part);
    * the batch ends once per rank (``WAIT_SENDS``, and in training ``REDUCE_TIED``,
      ``REDUCE_GRAD``, ``STEP``).

    ``train=False``: the forwards of ``orders`` only (evaluation). ``layouts``: every activation
    message between ranks is preceded by its layout (:func:`~.lowering.add_layouts`). ``early``:
    receives are posted early and waited for at their use (:func:`~.lowering.post_early`).

    The transfers are then grouped and ordered for rendezvous semantics as for any schedule
    (:func:`~gpp_deepspeed.schedule.lowering.group_for_rendezvous`), so the simulator's rendezvous
    mode (NCCL) accepts the result, and :func:`validate_folded` checks it: it raises
    :class:`ScheduleError` otherwise.

    A V on four stages: rank 1 holds stages 1 and 2, whose edge is a hand-over on the rank.

    >>> chain, fold = StageGraph.chain(4), Fold.v_shape(num_stages=4)
    >>> program = fold_program(chain, 1, fold, interleaved_1f1b(chain, 1, fold))
    >>> " ".join(str(a) for a in program[1])
    '1RECV_F0@0 1WAIT_F0 1F0 2HAND_F0@1 2F0 (2SEND_F0@3;2RECV_B0@3)P2P 2WAIT_B0 2B0 2RELEASE_OUT0 1HAND_B0@2 2RELEASE_IN0 1B0 1RELEASE_OUT0 1SEND_B0@0 1RELEASE_IN0 1WAIT_SENDS 1REDUCE_TIED 1REDUCE_GRAD 1STEP'
    """
    from .lowering import add_layouts, group_for_rendezvous, merge_backward, post_early

    if train:
        merged = {s for s in range(stage_graph.num_stages) if not stage_graph.grad_preds(s)}
        orders = {r: [Action(a.stage_idx, K.BACKWARD, a.mb_idx) if a.kind is K.BACKWARD_WEIGHT and a.stage_idx in merged
                      else a for a in acts if not (a.kind is K.BACKWARD_INPUT and a.stage_idx in merged)]
                  for r, acts in orders.items()}
    else:
        orders = {r: [a for a in acts if a.kind is K.FORWARD] for r, acts in orders.items()}
    compute = {s: [a for r in sorted(orders) for a in orders[r] if a.stage_idx == s]
               for s in range(stage_graph.num_stages)}
    per_stage = _lowered_stages(compute, stage_graph)
    per_stage = merge_backward(per_stage, stage_graph) if train else per_stage
    per_stage = add_layouts(per_stage) if layouts else per_stage
    def rewrite(a: Action) -> Action | None:
        if a.kind.has_peer and fold.rank_of[a.stage_idx] == fold.rank_of[a.peer]:
            if a.kind in (K.RECV_F, K.RECV_B):   # a hand-over inside the rank: no message
                return Action(a.stage_idx, K.HAND_F if a.kind is K.RECV_F else K.HAND_B, a.mb_idx, peer=a.peer)
            return None
        return a

    tail = (K.WAIT_SENDS, K.REDUCE_TIED, K.REDUCE_GRAD, K.STEP) if train else (K.WAIT_SENDS, )
    lists = {r: acts + [Action(fold.stages_of(r)[0], k) for k in tail]
             for r, acts in _interleave(per_stage, orders, rewrite=rewrite).items()}
    grouped = group_for_rendezvous(lists, duration=duration, rank_of=fold.rank_of)
    lowered = _add_releases(post_early(grouped, duration=duration, rank_of=fold.rank_of) if early else grouped)
    validate_folded(lowered, stage_graph, num_microbatches, fold, train=train, layouts=layouts)
    return lowered


def _add_releases(lists: dict[int, list[Action]]) -> dict[int, list[Action]]:
    """:func:`~gpp_deepspeed.schedule.lowering.add_release` on a rank's list of several stages:
    each release of a stage's micro-batch right after the last action of the rank that uses what it
    frees (a hand-over uses what it reads of its peer stage), once the transfers have their final
    places."""
    from .ir import RELEASES

    out = {}
    for r, actions in lists.items():
        last: dict[tuple[int, K, int], int] = {}    # (stage, release kind, micro-batch) -> last use
        for i, a in enumerate(actions):
            for op in a.parts:
                if op.mb_idx is None or op.kind.spec.version:
                    continue
                for release in RELEASES:
                    if release.spec.frees & op.kind.spec.touches:
                        last[(op.stage_idx, release, op.mb_idx)] = i
                    if release.spec.frees & op.kind.spec.peer_reads:
                        last[(op.peer, release, op.mb_idx)] = i
        after: dict[int, list[Action]] = {}
        for (s, release, j), at in last.items():
            after.setdefault(at, []).append(Action(s, release, j))
        out[r] = [x for i, a in enumerate(actions)
                  for x in (a, *sorted(after.get(i, ()), key=lambda x: (x.stage_idx, RELEASES.index(x.kind))))]
    return out


def validate_folded(program: dict[int, list[Action]], stage_graph: StageGraph, num_microbatches: int,
                    fold: Fold, *, train: bool = True, layouts: bool = False) -> None:
    """Check a folded program (:func:`fold_program`) rank by rank; raise :class:`ScheduleError`.

    * Every rank runs actions of its own stages only.
    * Each stage's actions, taken out of its rank's list, pass the validator's checks of a stage
      (:func:`~gpp_deepspeed.schedule.validate.check_lists`: one forward and one backward of every
      micro-batch, a transfer on every edge between ranks, every release, buffer slots) against the
      stage graph without its edges inside a rank.
    * On an edge inside a rank, the hand-overs are actions of the program, in order: the
      consumer's ``HAND_F`` after the producer's forward and before its own; the producer's
      ``HAND_B`` after the consumer's input-gradient backward (``B`` or ``I``) and before its own;
      neither on an edge between ranks.
    * The whole program runs under NCCL's rendezvous semantics
      (:func:`~gpp_deepspeed.schedule.validate.simulate`).
    """
    from dataclasses import replace

    from .lowering import assign_buffers
    from .validate import check_lists, simulate

    for r, actions in program.items():
        strangers = [op for a in actions for op in a.parts if fold.rank_of[op.stage_idx] != r]
        if strangers:
            raise ScheduleError(f"rank {r} runs {strangers[0]}, an action of a stage of rank "
                                f"{fold.rank_of[strangers[0].stage_idx]}")
        for a in actions:
            if a.kind.spec.hand_over and fold.rank_of[a.peer] != r:
                raise ScheduleError(f"rank {r} runs {a}, a hand-over from stage {a.peer} on rank {fold.rank_of[a.peer]}")
    per_stage: dict[int, list[Action]] = {s: [] for s in range(stage_graph.num_stages)}
    for actions in program.values():
        for a in actions:
            mine: dict[int, list[Action]] = {}
            for op in a.parts:
                mine.setdefault(op.stage_idx, []).append(op)
            for s, ops in mine.items():
                per_stage[s].append(ops[0] if len(ops) == 1 else Action.group(ops))
    between = replace(stage_graph, edges=tuple(e for e in stage_graph.edges
                                               if fold.rank_of[e.src] != fold.rank_of[e.dst]))
    check_lists(per_stage, between, num_microbatches, train=train, slots=assign_buffers(per_stage), layouts=layouts)
    for e in stage_graph.edges:
        if fold.rank_of[e.src] == fold.rank_of[e.dst]:
            _check_hand_over(program[fold.rank_of[e.src]], e, num_microbatches, train=train)
    simulate(program, mode="rendezvous", rank_of=fold.rank_of)


def _check_hand_over(actions: list[Action], edge, num_microbatches: int, *, train: bool) -> None:
    """The hand-overs of one edge inside a rank, in order (see :func:`validate_folded`)."""
    where = {(op.kind, op.stage_idx, op.mb_idx, op.peer): i for i, a in enumerate(actions) for op in a.parts}
    src, dst = edge.src, edge.dst
    for j in range(num_microbatches):
        hand_f = where.get((K.HAND_F, dst, j, src))
        if hand_f is None:
            raise ScheduleError(f"stage {dst} never takes micro-batch {j} from stage {src} on their rank "
                                f"({Action(dst, K.HAND_F, j, peer=src)})")
        if not where[(K.FORWARD, src, j, None)] < hand_f < where[(K.FORWARD, dst, j, None)]:
            raise ScheduleError(f"{Action(dst, K.HAND_F, j, peer=src)} must run after {Action(src, K.FORWARD, j)} "
                                f"and before {Action(dst, K.FORWARD, j)}")
        if not (train and edge.grad):
            continue
        hand_b = where.get((K.HAND_B, src, j, dst))
        back = lambda s: where.get((K.BACKWARD, s, j, None), where.get((K.BACKWARD_INPUT, s, j, None)))  # noqa: E731
        if hand_b is None:
            raise ScheduleError(f"stage {src} never takes the gradient of micro-batch {j} from stage {dst} on their "
                                f"rank ({Action(src, K.HAND_B, j, peer=dst)})")
        if not back(dst) < hand_b < back(src):
            raise ScheduleError(f"{Action(src, K.HAND_B, j, peer=dst)} must run after stage {dst}'s backward of "
                                f"micro-batch {j} and before stage {src}'s")


def schedule_in_flight(name: str, max_in_flight, num_ranks: int) -> tuple[int, ...] | None:
    """``max_in_flight`` (``graph_pipeline.max_in_flight``, a plan's) for schedule ``name`` on
    ``num_ranks`` ranks: None stays None (the schedule's own caps), else every rank's cap
    (:func:`~gpp_deepspeed.schedule.greedy.check_in_flight`); refused, naming both, for a schedule
    whose order no cap shapes (all but :data:`IN_FLIGHT_CAPPED`)."""
    if max_in_flight is None:
        return None
    if name not in IN_FLIGHT_CAPPED:
        raise GPPConfigError(f'schedule "{name}" runs an order that max_in_flight does not shape; it caps the '
                             f"micro-batches in flight of {sorted(IN_FLIGHT_CAPPED)} (got max_in_flight={max_in_flight})")
    return check_in_flight(max_in_flight, num_ranks)


def zbv_v_order(num_ranks: int, num_microbatches: int) -> dict[int, list[Action]]:
    """ZB-V's order on every rank of a V over a chain of ``2p`` stages (Qi et al., "Pipeline
    Parallelism with Controllable Memory", arXiv 2405.15362: the V building block repeated; torch's
    ``ScheduleZBVZeroBubble``): :func:`zbv_rhythm` on that chain and fold. Rank ``r`` holds stage
    ``r`` (its early stage) and ``2p - 1 - r`` (its late one).

    >>> " ".join(str(a) for a in zbv_v_order(2, 4)[0])
    '0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3'
    """
    return zbv_rhythm(StageGraph.chain(2 * num_ranks), num_microbatches, Fold.v_shape(num_stages=2 * num_ranks))


def zbv_rhythm(stage_graph: StageGraph, num_microbatches: int, fold: Fold) -> dict[int, list[Action]]:
    """ZB-V's order on a fold whose every rank holds two stages: an early one ``e`` and a late one
    ``l`` (the deeper is ``e``), with ZB-V's counts read off their depths as :func:`dualpipev_orders`
    reads DualPipeV's: ``a = depth(e) - depth(l)``, ``b = depth(l) - 1`` (on a V over a chain
    ``2(p - r) - 1`` and ``r``, ZB-V's), and ``m`` micro-batches, at least ``max depth(e) - 1``
    (``2p - 1``; fewer are the first ``m`` of that order). Each rank runs:

    - warm-up: ``a`` forwards of ``e`` (a micro-batch's way from ``e`` to ``l``), ``b`` pairs
      ``F_l F_e``, then ``(a + 1) // 2`` times ``l``'s ``F I W``;
    - steady: a forward of ``e`` (while any are left), ``e``'s ``I W``, then ``l``'s ``F I W``,
      until every forward of ``l`` has run;
    - cool-down: ``b`` pairs ``I_e I_l``, ``(a + 1) // 2`` pairs of ``I_e`` and the oldest ``W_e``,
      then ``l``'s ``W``s left, then ``e``'s.

    On a V over a chain each rank holds at most ``2p`` micro-batches of a stage (ZB-V's bound,
    1F1B's first stage's activations). Its fixed rhythm runs each input gradient with its weight
    gradient right after it in the steady state, which leaves every message between ranks the
    slack of a ``W`` where :func:`rank_orders`' greedy order runs the input gradients back to back.
    Raises :class:`ScheduleError` where a rank does not hold two stages of different depths; on a
    DAG the order can deadlock, which :func:`rank_makespan` finds.
    """
    depth = stage_graph.depth
    pairs = {}
    for r in range(fold.num_ranks):
        stages = fold.stages_of(r)
        if len(stages) != 2 or depth(stages[0]) == depth(stages[1]):
            raise ScheduleError(f"ZB-V's order needs two stages of different depths on every rank; rank {r} holds "
                                f"{list(stages)}")
        pairs[r] = sorted(stages, key=lambda s: -depth(s))
    m = max(num_microbatches, max(depth(e) for e, _ in pairs.values()) - 1)
    F, I, W = K.FORWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT
    orders: dict[int, list[Action]] = {}
    for r, (early, late) in pairs.items():
        a, b = depth(early) - depth(late), depth(late) - 1
        order: list[Action] = []
        count = {(s, k): 0 for s in (early, late) for k in (F, I, W)}

        def run(*steps):
            for s, k in steps:
                order.append(Action(s, k, count[(s, k)]))
                count[(s, k)] += 1

        run(*[(early, F)] * a)
        for _ in range(b):
            run((late, F), (early, F))
        for _ in range((a + 1) // 2):
            run((late, F), (late, I), (late, W))
        while count[(late, F)] < count[(early, F)] or count[(early, F)] < m:
            if count[(early, F)] < m:
                run((early, F))
            run((early, I), (early, W), (late, F), (late, I), (late, W))
        for _ in range(b):
            run((early, I), (late, I))
        for _ in range((a + 1) // 2):
            run((early, I), (early, W))
        run(*[(late, W)] * (count[(late, I)] - count[(late, W)]))
        run(*[(early, W)] * (count[(early, I)] - count[(early, W)]))
        orders[r] = [x for x in order if x.mb_idx < num_microbatches]
    return orders


def _zbv(stage_graph, num_mb, fold, duration=None, max_in_flight=None):
    caps = schedule_in_flight("zbv", max_in_flight, fold.num_ranks)
    orders = rank_orders(stage_graph, num_mb, fold, split_backward=True, duration=duration, by_microbatch=True,
                         max_in_flight=fold_in_flight(stage_graph, fold) if caps is None else dict(enumerate(caps)))
    if caps is None:
        # ZB-V's own order where it runs, unless the greedy order computes faster (uneven stage
        # times, a DAG's uneven ranks): where as short, it is less exposed to message latency.
        try:
            fixed = zbv_rhythm(stage_graph, num_mb, fold)
            if rank_makespan(fixed, stage_graph, duration) <= rank_makespan(orders, stage_graph, duration):
                return fixed
        except ScheduleError:    # not two stages of different depths a rank, or a deadlock on this DAG
            pass
    return orders


def _fixed(name: str, orders: Callable) -> Callable:
    """The orders function of a folded schedule whose order is fixed: no simulated clock, no cap."""
    def fixed(stage_graph, num_mb, fold, duration=None, max_in_flight=None):
        schedule_in_flight(name, max_in_flight, fold.num_ranks)
        return orders(stage_graph, num_mb, fold)
    return fixed


FOLDED_SCHEDULES: dict[str, tuple[str, Callable, bool]] = {
    "interleaved": ("looped", _fixed("interleaved", interleaved_1f1b), False),
    "zbv": ("v", _zbv, True),
    "dualpipev": ("v", _fixed("dualpipev", lambda g, m, f: dualpipev_orders(g, m, f)), True),   # defined below
}
"""Every folded schedule by name: (the fold it is made for, its orders function ``(stage_graph,
num_microbatches, fold, duration=None, max_in_flight=None) -> {rank: [Action, ...]}``, whether it
splits the backward). The planner's ``search_fold`` tries each on every fold it can run on (``dualpipev``: two stages a
rank); the fold kind is only the default placement (``Fold.looped`` / ``Fold.v_shape``).
``max_in_flight`` (an int, or one per rank) caps the micro-batches each rank holds in the schedules
of :data:`IN_FLIGHT_CAPPED` (default :func:`~gpp_deepspeed.schedule.greedy.fold_in_flight`); the
others refuse it."""

IN_FLIGHT_CAPPED = frozenset({"zbv"})
"""The folded schedules whose order is made under a cap of micro-batches in flight per rank."""


def rank_peak(actions: list[Action], activation: dict[int, float] | None) -> float:
    """The most activation memory a rank's compute order holds at once: ``activation[s]`` (default
    1) for each micro-batch whose forward on stage ``s`` has run and whose backward (``B``, or
    ``W`` when split) has not."""
    live = peak = 0.0
    for a in actions:
        size = (activation or {}).get(a.stage_idx, 1.0)
        if a.kind is K.FORWARD:
            live += size
            peak = max(peak, live)
        elif a.kind.spec.ends_backward:
            live -= size
    return peak


def dualpipev_orders(stage_graph: StageGraph, num_microbatches: int, fold: Fold) -> dict[int, list[Action]]:
    """DualPipeV's compute order on every rank of a fold with two stages a rank (DeepSeek-V3's
    DualPipe, arXiv 2412.19437, cut in half into a V; torch 2.13's ``ScheduleDualPipeV``
    ``_calculate_single_rank_operations`` and DeepSpeed 0.19.8's ``DualPipeVSchedule.steps``).

    A rank's two stages are its *early* stage ``e`` (the deeper one: stage ``r`` of the chain's V)
    and its *late* stage ``l`` (stage ``2R - 1 - r``). Its list goes in DualPipeV's eight steps,
    with three counts read off the stage graph: ``a = depth(e) - depth(l) - 1`` forwards on ``e``
    before the first on ``l`` (how far apart the two are on the DAG's longest paths), ``b =
    depth(l)`` micro-batches the late stage holds (1F1B's in-flight count for it) and ``c = a // 2``
    (on a chain ``a = 2(R - r - 1)``, ``b = r + 1``, ``c = R - r - 1``, DualPipeV's counts):

    1. ``a`` x ``F_e``;  2. ``b`` x ``F_e F_l``;  3. ``c`` x ``I_l W F_l`` (the split backward);
    4. ``M - a - b`` x the pairs ``(F_e B_l) (F_l B_e)``: a forward of one micro-batch beside the
       backward of another on the rank's other stage (the overlapped ``F&B`` chunk, run in that
       order);
    5. ``a - c`` x ``B_l (F_l B_e)``;  6. ``b`` x ``B_l B_e``, switching to ``I`` halfway (torch's
       parity rule, on ``b``);  7. ``c`` x ``W I_e``;  8. the deferred ``W``.

    The weight gradients deferred by an ``I`` run oldest first where a ``W`` stands. On a chain in V
    placement this is torch's order action for action (``FULL_BACKWARD`` as ``B``, an overlapped
    pair as its forward then its backward). On a DAG the counts come from the edges (depths), and
    the orders are checked by a replay (:func:`rank_makespan`): a fold on which they would deadlock
    raises :class:`ScheduleError`, as does a rank without exactly two stages or fewer micro-batches
    than a rank needs (``a + b``; ``2R - 1`` on a chain, where torch asks for ``2R``).

    >>> orders = dualpipev_orders(StageGraph.chain(4), 4, Fold.v_shape(num_stages=4))
    >>> " ".join(str(a) for a in orders[1])
    '1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3'
    """
    orders = {}
    for r in range(fold.num_ranks):
        stages = fold.stages_of(r)
        if len(stages) != 2:
            raise ScheduleError(f"dualpipev runs two stages a rank (a V); rank {r} holds stages {list(stages)}")
        early, late = sorted(stages, key=lambda s: (-stage_graph.depth(s), s))
        a = max(stage_graph.depth(early) - stage_graph.depth(late) - 1, 0)
        b = stage_graph.depth(late)
        if num_microbatches < a + b:
            raise ScheduleError(f"dualpipev needs at least {a + b} micro-batches for rank {r} (stages {early} and "
                                f"{late}); got {num_microbatches}")
        orders[r] = _dualpipev_rank(early, late, num_microbatches, a, b, a // 2)
    try:
        rank_makespan(orders, stage_graph)
    except ScheduleError as e:
        raise ScheduleError(f"dualpipev's order deadlocks on the fold {list(fold.rank_of)} of this stage graph "
                            f"({e}); fold the stages so that each rank's early stage feeds its late one, or run zbv")
    return orders


def _dualpipev_rank(e: int, l: int, m: int, a: int, b: int, c: int) -> list[Action]:  # noqa: E741
    """One rank's list in DualPipeV's eight steps (see :func:`dualpipev_orders`)."""
    out: list[Action] = []
    nxt: dict[tuple[int, K], int] = {}
    weights: list[Action] = []

    def add(s: int, kind: K) -> None:
        key = (s, K.FORWARD if kind is K.FORWARD else K.BACKWARD)
        j = nxt.get(key, 0)
        nxt[key] = j + 1
        out.append(Action(s, kind, j))
        if kind is K.BACKWARD_INPUT:
            weights.append(Action(s, K.BACKWARD_WEIGHT, j))

    def weight() -> None:
        if weights:
            out.append(weights.pop(0))

    for _ in range(a):
        add(e, K.FORWARD)
    for _ in range(b):
        add(e, K.FORWARD), add(l, K.FORWARD)
    for _ in range(c):
        add(l, K.BACKWARD_INPUT), weight(), add(l, K.FORWARD)
    for _ in range(m - a - b):
        add(e, K.FORWARD), add(l, K.BACKWARD), add(l, K.FORWARD), add(e, K.BACKWARD)
    for _ in range(a - c):
        add(l, K.BACKWARD), add(l, K.FORWARD), add(e, K.BACKWARD)
    split = False
    for i in range(b):                  # torch switches to I halfway, on the late stage first if b is even
        split = split or (i == b // 2 and b % 2 == 0)
        add(l, K.BACKWARD_INPUT if split else K.BACKWARD)
        split = split or i == b // 2
        add(e, K.BACKWARD_INPUT if split else K.BACKWARD)
    for _ in range(c):
        weight(), add(e, K.BACKWARD_INPUT)
    while weights:
        weight()
    return out
