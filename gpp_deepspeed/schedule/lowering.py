"""Lowering: the passes that turn a compute order into the program a stage runs.

A generator (:mod:`.generators`, :mod:`.zero_bubble`, :mod:`.asynchronous`) decides the order of
compute on every stage; :func:`lower` applies these small pure passes to it, in this order, for
every schedule (synchronous, split backward, asynchronous):

``drop_frozen_backward``
    Frozen stages run forwards only, on their live weights (no weight versions, no updates of
    their own).
``add_load``
    A ``LOAD`` before each forward on the stages that read the batch (``StageGraph.loading``).
``add_send_recv``
    The transfers of every stage edge around the compute that produces and consumes them.
``merge_backward``
    On a stage with no input gradient to send (no predecessor edge carries one), a split
    backward's ``I`` has nothing to hand anyone: each micro-batch's ``I ... W`` becomes one ``B``
    at ``W``'s place (torch's ``_merge_bw``), its gradients still received where ``I`` was.
``defer_sends`` (an asynchronous schedule's segment only)
    A gradient whose receiver runs its backward in a later ``train_batch`` is sent there.
``add_layouts`` (``dynamic_shape``, and the first batch of static shapes)
    Before each activation transfer, the transfer of its layout: a fixed-size header that sizes
    the receive of the activations; :func:`group_p2p` puts a transfer and its layout in different
    groups, so the header has arrived before the activations' receive is posted.
``group_for_rendezvous``, by ``order_transfers`` and ``group_p2p``
    Every run of transfers between two compute actions becomes one grouped ``P2P`` action, posted
    at once and completed together (``batch_isend_irecv``): the receives a compute action needs are
    posted together, and a send and a receive to the same peer at the same point progress together.
    This is torch.distributed.pipelining's fused ``SEND_F``/``RECV_B`` of 1F1B and the reason
    DeepSpeed orders even and odd stages: under NCCL a send may block until its receive is posted,
    so two stages that each send to the other before receiving would wait forever. Where the order
    as written would still deadlock, every stage first posts its transfers in one global order of
    messages (``order_transfers``: the order an asynchronous simulation receives them), so that no
    two stages each send to the other first. On a skip edge of a DAG the sender would otherwise
    post its next activation before receiving the gradient its receiver sends first.
``post_early``
    Every receive of activations or gradients is posted a compute earlier than the action that
    needs it and completed by a wait (``WAIT_F``/``WAIT_B``) just before that action, as
    torch.distributed.pipelining's runtime posts an ``irecv`` at ``RECV_F`` and waits at ``F``: the
    message travels while the stage computes, and gloo's receive-ready exchange (a send posted
    before its receive moves only once the receive is) is off the critical path.
``add_release``
    After the last action that uses a buffer of a micro-batch, the release that frees it
    (``RELEASE_OUT``, ``RELEASE_IN``, ``RELEASE_W``; what each frees and what each action uses is
    the table :data:`~gpp_deepspeed.schedule.ir.KINDS`): the schedule, not the engine, decides when
    memory is freed.
``add_epilogue``
    ``WAIT_SENDS`` and, for a synchronous schedule in training (and a 2BW segment that updates),
    the gradient reductions and the optimizer step.

:func:`assign_buffers` then gives every micro-batch of every stage a buffer slot, the least a
stage needs (:class:`~gpp_deepspeed.schedule.program.Program` holds both).

>>> from gpp_deepspeed.schedule.ir import Action
>>> stage1 = [Action.parse(t) for t in "1F0 1SEND_F0@2 1RECV_B0@2 1B0".split()]
>>> group_p2p({1: stage1})[1]
[1F0, (1SEND_F0@2;1RECV_B0@2)P2P, 1B0]
"""

from __future__ import annotations

from typing import Callable, Collection, Mapping, Sequence

from ..graph.stages import StageGraph
from .ir import LAYOUT_OF, RELEASES, Action, ActionKind as K, Schedule, Segment
from .posting import group_for_rendezvous, group_p2p, order_transfers, post_early

__all__ = ["lower", "drop_frozen_backward", "add_load", "add_send_recv", "merge_backward", "defer_sends", "add_layouts",
           "group_for_rendezvous",
           "order_transfers", "group_p2p", "post_early", "add_release", "add_epilogue", "assign_buffers", "BufferSlots",
           "num_slots"]

# Slot of every micro-batch, per stage: ``slots[stage_idx][mb_idx]``.
BufferSlots = dict[int, dict[int, int]]


def lower(compute: Schedule, stage_graph: StageGraph, *, train: bool,
          duration: Callable[[Action], float] | None = None, segment: Segment | None = None,
          ahead: Sequence[Schedule] = (), step: bool | None = None, layouts: bool = False,
          early: bool = True) -> Schedule:
    """Apply every lowering pass (see the module docstring) to a compute order.

    ``duration``: the compute times the schedule was made for, which order the transfers when they
    must be reordered (see :func:`group_for_rendezvous`). For one ``segment`` of an asynchronous
    schedule, ``ahead`` holds the compute orders of the batches that follow it: a micro-batch's
    buffers are released after its last use in the whole program, which may lie batches later.
    ``step``: whether the lists end with the synchronous step (default: a synchronous batch in
    training does; an asynchronous segment's updates are inside it, save 2BW's once-per-batch one,
    :func:`~gpp_deepspeed.schedule.asynchronous.steps_at_end`). ``layouts``: send every
    activation's layout before it (:func:`add_layouts`). ``early``: post receives early
    (:func:`post_early`).

    >>> from gpp_deepspeed.schedule import one_f_one_b
    >>> lower(one_f_one_b(StageGraph.chain(2), 1), StageGraph.chain(2), train=True)[1][:8]
    [1LOAD0, 1RECV_F0@0, 1WAIT_F0, 1F0, 1B0, 1RELEASE_OUT0, 1SEND_B0@0, 1RELEASE_IN0]
    """
    segments = [segment]
    for _ in ahead:
        segments.append(segments[-1].next())
    window = [_lower_transfers(c, stage_graph, duration, seg, layouts, early)
              for c, seg in zip([compute, *ahead], segments)]
    return add_epilogue(add_release(window[0], ahead=window[1:]),
                        train=train and segment is None if step is None else step)


def _lower_transfers(compute: Schedule, stage_graph: StageGraph, duration, segment: Segment | None,
                     layouts: bool, early: bool) -> Schedule:
    lowered = add_send_recv(add_load(drop_frozen_backward(compute, stage_graph), stage_graph), stage_graph)
    lowered = merge_backward(lowered, stage_graph)
    if segment is not None:
        lowered = defer_sends(lowered, stage_graph, segment)
    if layouts:
        lowered = add_layouts(lowered)
    grouped = group_for_rendezvous(lowered, duration=duration)
    return post_early(grouped, duration=duration) if early else grouped


def drop_frozen_backward(schedule: Schedule, stage_graph: StageGraph) -> Schedule:
    """Remove the backward (``B``, ``I``, ``W``) of the frozen stages, which have nothing to
    differentiate (``StageGraph.frozen``): they run forwards only, on their live weights, so their
    weight-version actions and own updates go too (a synchronous step stays: it is collective).

    >>> from dataclasses import replace
    >>> from gpp_deepspeed.schedule import one_f_one_b
    >>> drop_frozen_backward(one_f_one_b(StageGraph.chain(2), 2), replace(StageGraph.chain(2), frozen=frozenset({0})))
    {0: [0F0, 0F1], 1: [1F0, 1B0, 1F1, 1B1]}
    """
    return {s: [a for a in actions if not (s in stage_graph.frozen and a.kind.spec.trains)]
            for s, actions in schedule.items()}


def add_load(schedule: Schedule, stage_graph: StageGraph) -> Schedule:
    """Put a ``LOAD`` before each forward on the stages that read the batch (``StageGraph.loading``).

    >>> add_load({0: [Action(0, K.FORWARD, 0)], 1: [Action(1, K.FORWARD, 0)]}, StageGraph.chain(3))
    {0: [0LOAD0, 0F0], 1: [1F0]}
    """
    out: Schedule = {}
    for s, actions in schedule.items():
        out[s] = []
        for a in actions:
            if a.kind is K.FORWARD and s in stage_graph.loading:
                out[s].append(Action(s, K.LOAD, a.mb_idx))
            out[s].append(a)
    return out


def add_send_recv(schedule: Schedule, stage_graph: StageGraph) -> Schedule:
    """Surround compute with the transfers of every stage edge.

    ``F`` is preceded by a ``RECV_F`` from each predecessor and followed by a ``SEND_F`` to each
    successor; ``B`` (or ``I``, the input-gradient half of a split backward) is preceded by a
    ``RECV_B`` from each successor and followed by a ``SEND_B`` to each predecessor, on the edges
    that carry gradients (``StageEdge.grad``); ``W`` talks to no one. Sends are asynchronous,
    receives block, so the order of receives is what the validator checks.

    >>> add_send_recv({0: [Action(0, K.FORWARD, 0)], 1: [Action(1, K.FORWARD, 0)]}, StageGraph.chain(2))
    {0: [0F0, 0SEND_F0@1], 1: [1RECV_F0@0, 1F0]}
    """
    out: Schedule = {}
    for s, actions in schedule.items():
        preds, succs = stage_graph.preds(s), stage_graph.succs(s)
        lowered: list[Action] = []
        for a in actions:
            if a.kind is K.FORWARD:
                lowered += [Action(s, K.RECV_F, a.mb_idx, peer=p) for p in preds]
                lowered.append(a)
                lowered += [Action(s, K.SEND_F, a.mb_idx, peer=t) for t in succs]
            elif a.kind.spec.input_gradients:  # W needs nothing from other stages
                # Only edges that carry gradients (not a frozen tower's output) exchange them.
                lowered += [Action(s, K.RECV_B, a.mb_idx, peer=t) for t in stage_graph.grad_succs(s)]
                lowered.append(a)
                lowered += [Action(s, K.SEND_B, a.mb_idx, peer=p) for p in stage_graph.grad_preds(s)]
            else:
                lowered.append(a)
        out[s] = lowered
    return out


def merge_backward(schedule: Schedule, stage_graph: StageGraph) -> Schedule:
    """On every stage that sends no gradient back (``StageGraph.grad_preds`` empty: it reads only
    the batch, or only edges that carry none), replace each micro-batch's ``I`` and ``W`` by one
    ``B`` at ``W``'s place. Such an ``I`` computes nothing anyone waits for, so the whole backward
    runs where the weight gradient was scheduled; the gradients it reads are still received where
    ``I`` was (the successor's send is not held back). Every other action stays where it is.

    >>> from gpp_deepspeed.schedule.ir import Action
    >>> split = {s: [Action.parse(t) for t in text.split()] for s, text in
    ...          {0: "0F0 0F1 0RECV_B0@1 0I0 0F2 0W0", 1: "1RECV_F0@0 1F0 1I0 1SEND_B0@0 1W0"}.items()}
    >>> merge_backward(split, StageGraph.chain(2))
    {0: [0F0, 0F1, 0RECV_B0@1, 0F2, 0B0], 1: [1RECV_F0@0, 1F0, 1I0, 1SEND_B0@0, 1W0]}
    """
    out: Schedule = {}
    for s, actions in schedule.items():
        if stage_graph.grad_preds(s):
            out[s] = list(actions)
            continue
        out[s] = [Action(s, K.BACKWARD, a.mb_idx) if a.kind is K.BACKWARD_WEIGHT else a
                  for a in actions if a.kind is not K.BACKWARD_INPUT]
    return out


def defer_sends(schedule: Schedule, stage_graph: StageGraph, segment: Segment) -> Schedule:
    """Move every ``SEND_B`` of an asynchronous schedule's segment to the segment where its
    receiver runs the matching ``RECV_B``.

    Messages never cross a ``train_batch`` boundary (DeepSpeed aggregates the loss over the
    pipeline between batches, a collective that a pending rendezvous send could block). A stage of
    lag ``w`` (``depth - 1``, its warm-up forwards) runs ``B(i)`` in batch ``(i + w) // M``; its
    predecessor, of larger lag, receives that gradient in a later batch. Sends whose receive is in
    a later batch leave this one; sends from earlier batches whose receive is in this one open it,
    in micro-batch order (the order of their channel).

    >>> from gpp_deepspeed.schedule.ir import Action
    >>> batch0 = {1: [Action.parse(t) for t in "1RECV_F0@0 1F0 1B0 1SEND_B0@0".split()]}
    >>> defer_sends(batch0, StageGraph.chain(2), Segment(0, num_microbatches=1))[1]
    [1RECV_F0@0, 1F0, 1B0]
    >>> defer_sends({1: []}, StageGraph.chain(2), Segment(1, num_microbatches=1))[1]
    [1SEND_B0@0]
    """
    def lag(s: int) -> int:
        return stage_graph.depth(s) - 1

    def segment_of(i: int, w: int) -> int:   # the segment of B(i) on a stage of lag w
        seg = (i + w) // m
        return min(seg, k) if segment.flush else seg

    k, m = segment.batch_idx, segment.num_microbatches
    out: Schedule = {}
    for s, actions in schedule.items():
        kept = [a for a in actions if not (a.kind is K.SEND_B and segment_of(a.mb_idx, lag(a.peer)) > k)]
        head = []
        for u in stage_graph.grad_preds(s):
            lo = k * m - lag(u)
            hi = k * m if segment.flush else (k + 1) * m - lag(u)
            head += [Action(s, K.SEND_B, i, peer=u) for i in range(max(lo, 0), hi)
                     if segment_of(i, lag(s)) < k and segment_of(i, lag(u)) == k]
        out[s] = sorted(head, key=lambda a: a.mb_idx) + kept
    return out


def add_layouts(schedule: Schedule) -> Schedule:
    """Put the transfer of each activation message's layout just before it: ``SEND_L`` before
    ``SEND_F``, ``RECV_L`` before ``RECV_F``. A layout is a message of the activations' channel,
    so every channel carries layout, activations, layout, activations... at both of its ends.

    >>> add_layouts({1: [Action.parse(t) for t in "1RECV_F0@0 1F0 1SEND_F0@2".split()]})[1]
    [1RECV_L0@0, 1RECV_F0@0, 1F0, 1SEND_L0@2, 1SEND_F0@2]
    """
    out: Schedule = {}
    for s, actions in schedule.items():
        out[s] = []
        for a in actions:
            if a.kind in LAYOUT_OF:
                out[s].append(Action(s, LAYOUT_OF[a.kind], a.mb_idx, a.peer))
            out[s].append(a)
    return out


def add_release(schedule: Schedule, *, ahead: Sequence[Schedule] = ()) -> Schedule:
    """Put each release of every micro-batch right after the last action that uses a buffer it
    frees (:data:`~gpp_deepspeed.schedule.ir.KINDS`: ``RELEASE_OUT``, then ``RELEASE_IN``, then
    ``RELEASE_W`` where they fall on the same action).

    ``ahead``: for one segment of an asynchronous program, the lists of the segments that follow;
    a micro-batch whose last use lies there is released there, not in ``schedule``.

    >>> from gpp_deepspeed.schedule.ir import Action
    >>> acts = [Action.parse(t) for t in "1RECV_F0@0 1F0 1SEND_F0@2 1RECV_B0@2 1B0 1SEND_B0@0".split()]
    >>> add_release({1: acts})[1]
    [1RECV_F0@0, 1F0, 1SEND_F0@2, 1RECV_B0@2, 1B0, 1RELEASE_OUT0, 1SEND_B0@0, 1RELEASE_IN0]
    >>> add_release({2: [Action.parse(t) for t in "2I0 2W0".split()]})[2]
    [2I0, 2RELEASE_OUT0, 2RELEASE_IN0, 2W0, 2RELEASE_W0]
    """
    out: Schedule = {}
    for s, actions in schedule.items():
        program = actions + [a for later in ahead for a in later[s]]
        last: dict[tuple[K, int], int] = {}       # (release kind, micro-batch) -> index of its last use
        for i, a in enumerate(program):
            for op in a.parts:
                if op.mb_idx is None:
                    continue
                for release in RELEASES:
                    if release.spec.frees & op.kind.spec.touches:
                        last[(release, op.mb_idx)] = i
        after: dict[int, list[Action]] = {}
        for (release, j), at in last.items():
            after.setdefault(at, []).append(Action(s, release, j))
        lowered: list[Action] = []
        for i, a in enumerate(actions):
            lowered.append(a)
            lowered += sorted(after.get(i, ()), key=lambda r: RELEASES.index(r.kind))   # stable: first use first
        out[s] = lowered
    return out


def add_epilogue(schedule: Schedule, *, train: bool) -> Schedule:
    """End every stage's list with ``WAIT_SENDS`` and, when training synchronously, the gradient
    reductions and the optimizer step (one step per batch: no weight staleness)."""
    tail = [K.WAIT_SENDS] + ([K.REDUCE_TIED, K.REDUCE_GRAD, K.STEP] if train else [])
    return {s: actions + [Action(s, k) for k in tail] for s, actions in schedule.items()}


def assign_buffers(schedule: Schedule, *, live: Mapping[int, Mapping[int, int]] | None = None,
                   kept: Mapping[int, Collection[int]] | None = None) -> BufferSlots:
    """The buffer slot of every micro-batch on every stage, reusing a slot once it is free.

    A micro-batch holds its slot from the first action that uses its buffers to the last one
    (with :func:`add_release`, its last release); slots are handed out lowest first, so a stage
    gets as many as it ever has micro-batches live at once. For one segment of an asynchronous
    program, ``live[s]`` gives the micro-batches that hold a slot when the lists start (and their
    slot), ``kept[s]`` those that still hold theirs when the lists end (the program goes on); the
    result includes the live ones.

    >>> from gpp_deepspeed.schedule.ir import Action
    >>> acts = [Action.parse(t) for t in "0F0 0F1 0B0 0F2 0B1 0B2".split()]
    >>> assign_buffers({0: acts})
    {0: {0: 0, 1: 1, 2: 0}}
    >>> assign_buffers({0: acts}, live={0: {5: 0}}, kept={0: {5}})
    {0: {5: 0, 0: 1, 1: 2, 2: 1}}
    """
    slots: BufferSlots = {}
    for s, actions in schedule.items():
        held = dict((live or {}).get(s, {}))
        stays = set((kept or {}).get(s, ()))
        last: dict[int, int] = {}
        for i, a in enumerate(actions):
            for j in a.buffer_mbs:
                last[j] = i
        slot_of = dict(held)
        free = set(range(max(held.values(), default=-1) + 1)) - set(held.values())
        count = max(held.values(), default=-1) + 1
        for j in held:   # a live micro-batch the lists no longer use frees its slot at once
            if j not in last and j not in stays:
                free.add(held[j])
        for i, a in enumerate(actions):
            for j in a.buffer_mbs:
                if j not in slot_of:
                    if free:
                        slot_of[j] = min(free)
                        free.remove(slot_of[j])
                    else:
                        slot_of[j] = count
                        count += 1
            free.update(slot_of[j] for j in a.buffer_mbs if last[j] == i and j not in stays)
        slots[s] = slot_of
    return slots


def num_slots(slot_of: dict[int, int]) -> int:
    """How many buffers a stage with this slot assignment needs (at least one)."""
    return max(slot_of.values(), default=0) + 1
