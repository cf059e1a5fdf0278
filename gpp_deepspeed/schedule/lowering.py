"""Lowering passes that give the schedule the batch's resources: grouped transfers, release points
and buffer slots.

Each pass is a small pure function on action lists, applied after
:func:`~gpp_deepspeed.schedule.generators.add_send_recv` (the order
:func:`~gpp_deepspeed.schedule.generators.lower` uses):

``order_transfers`` (by ``group_for_rendezvous``, when the order as written would deadlock)
    Every stage posts its transfers in one global order of messages (the order an asynchronous
    simulation receives them), so that no two stages each send to the other first. On a skip edge
    of a DAG the sender would otherwise post its next activation before receiving the gradient
    its receiver sends first and, under NCCL, both would wait forever.

``group_p2p``
    Every run of transfers between two compute actions becomes one grouped ``P2P`` action, posted
    at once and completed together (``batch_isend_irecv``): the receives a compute action needs are
    posted together, and a send and a receive to the same peer at the same point progress together.
    This is torch.distributed.pipelining's fused ``SEND_F``/``RECV_B`` of 1F1B and the reason
    DeepSpeed orders even and odd stages: under NCCL a send may block until its receive is posted,
    so two stages that each send to the other before receiving would wait forever.
``add_release``
    ``RELEASE_OUT`` right after the last action that reads a micro-batch's outputs, output gradients,
    labels or loss, and ``RELEASE_IN`` right after the last one that reads its loaded or received
    tensors: the schedule, not the engine, decides when memory is freed.
``assign_buffers``
    A buffer slot per micro-batch and stage, the least a stage needs: a micro-batch holds its slot
    from its first action to its last (its releases), and a freed slot is reused.

>>> from gpp_deepspeed.schedule.ir import Action
>>> stage1 = [Action.parse(t) for t in "1F0 1SEND_F0@2 1RECV_B0@2 1B0".split()]
>>> group_p2p({1: stage1})[1]
[1F0, (1SEND_F0@2;1RECV_B0@2)P2P, 1B0]
"""

from __future__ import annotations

from typing import Callable

from ..errors import ScheduleError
from .ir import Action, ActionKind as K, Schedule

__all__ = ["group_for_rendezvous", "order_transfers", "group_p2p", "add_release", "assign_buffers", "BufferSlots", "num_slots"]

# Slot of every micro-batch, per stage: ``slots[stage_idx][mb_idx]``.
BufferSlots = dict[int, dict[int, int]]

# What reads each half of a micro-batch's buffers (see RELEASE_IN / RELEASE_OUT).
# ``I`` reads both; ``W`` only what the output side holds (its fused fallback runs a whole backward
# from the output gradients).
_READS_INPUTS = frozenset({K.LOAD, K.RECV_F, K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.SEND_B})
_READS_OUTPUTS = frozenset({K.LOAD, K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT, K.SEND_F,
                            K.RECV_B})


def group_p2p(schedule: Schedule) -> Schedule:
    """Merge every run of two or more transfers between compute actions into one ``P2P`` action.

    A ``LOAD`` or a release inside a run moves after the group (a load only has to precede its
    forward, a release follow the last use).

    >>> from gpp_deepspeed.schedule.ir import Action
    >>> acts = [Action.parse(t) for t in "2B0 2SEND_B0@0 2LOAD1 2RECV_F1@0 2RECV_F1@1 2F1".split()]
    >>> group_p2p({2: acts})[2]
    [2B0, (2SEND_B0@0;2RECV_F1@0;2RECV_F1@1)P2P, 2LOAD1, 2F1]
    """
    return {s: _group_stage(actions) for s, actions in schedule.items()}


def _group_stage(actions: list[Action]) -> list[Action]:
    out: list[Action] = []
    run: list[Action] = []
    after: list[Action] = []

    def flush():
        if run:
            out.append(run[0] if len(run) == 1 else Action.group(run))
        out.extend(after)
        run.clear()
        after.clear()

    for a in actions:
        if a.kind.has_peer:
            run.append(a)
        elif run and a.kind in (K.LOAD, K.RELEASE_IN, K.RELEASE_OUT):
            after.append(a)
        else:
            flush()
            out.append(a)
    flush()
    return out


def group_for_rendezvous(schedule: Schedule, *, duration: Callable[[Action], float] | None = None) -> Schedule:
    """:func:`group_p2p` of the schedule as written when that runs under rendezvous semantics,
    else of :func:`order_transfers`'s order, which always does.

    A chain, and most DAGs, keep the order in which each stage's compute needs and produces its
    tensors; only schedules whose stages would each send to the other first (skip edges of a
    DAG between stages of very different warm-up) have their transfers reordered, since that
    order is taken from a simulation (``duration``: the compute times the schedule was made for,
    default unit forwards and double backwards).
    """
    from .validate import simulate

    grouped = group_p2p(schedule)
    try:
        simulate(grouped, mode="rendezvous")
    except ScheduleError:
        return group_p2p(order_transfers(schedule, duration=duration))
    return grouped


def order_transfers(schedule: Schedule, *, duration: Callable[[Action], float] | None = None) -> Schedule:
    """Put every stage's transfers in one global order of messages, keeping its compute order.

    The schedule (compute order plus ungrouped transfers, as
    :func:`~gpp_deepspeed.schedule.generators.add_send_recv` writes it) is simulated with
    asynchronous sends (:func:`~gpp_deepspeed.schedule.validate.simulate`, priced by ``duration``,
    by default unit forwards and double backwards; compute times must be positive). Each message then has a key, the time it is received with its channel and index
    as tie-breaks, the same at both of its ends. Each stage keeps its local actions in order and
    places its transfers between them in key order: a send as soon as its compute ran and every
    transfer keyed before it was placed, a receive just in time for the action that needs it.
    When all stages post their transfers in one global order, the least message not yet through
    has both ends posted, so the schedule cannot deadlock even when every send waits for its
    receive (NCCL); compute times being positive, the order agrees with every stage's compute
    order. On a chain nothing moves; on a DAG, an activation on a skip edge is sent when its
    receiver is ready for it, not before the gradient the receiver sends first.

    Stage 0 below runs two warm-up forwards (as on a skip edge of ``0 -> 1 -> 2``, ``0 -> 2``) but
    stage 1 takes micro-batch 2 only after returning the gradient of micro-batch 0, so stage 0
    sends micro-batch 2 with its receive of that gradient:

    >>> from gpp_deepspeed.schedule.ir import Action
    >>> sched = {0: [Action.parse(t) for t in "0F0 0SEND_F0@1 0F1 0SEND_F1@1 0F2 0SEND_F2@1 0RECV_B0@1 0B0 "
    ...              "0RECV_B1@1 0B1 0RECV_B2@1 0B2".split()],
    ...          1: [Action.parse(t) for t in "1RECV_F0@0 1F0 1B0 1SEND_B0@0 1RECV_F1@0 1F1 1B1 1SEND_B1@0 "
    ...              "1RECV_F2@0 1F2 1B2 1SEND_B2@0".split()]}
    >>> order_transfers(sched)[0][:8]
    [0F0, 0SEND_F0@1, 0F1, 0SEND_F1@1, 0F2, 0RECV_B0@1, 0SEND_F2@1, 0B0]
    """
    from .validate import default_duration, simulate

    timeline = simulate(schedule, mode="async", duration=duration or default_duration)
    keys: dict[tuple, tuple] = {}      # (stage, slot) -> sort key of its message
    recv_at: dict[tuple, tuple] = {}   # (channel, n) -> key of that message
    sends: list[tuple[int, int, tuple]] = []
    for s, spans in timeline.spans.items():
        count: dict[tuple, int] = {}
        for slot, (a, start, _) in enumerate(spans):
            if a.kind.has_peer:
                ch = _channel(a)
                n = count[ch] = count.get(ch, -1) + 1
                if _is_send(a):
                    sends.append((s, slot, (ch, n)))
                else:
                    keys[(s, slot)] = recv_at[(ch, n)] = (start, ch, n)
    for s, slot, message in sends:
        if message not in recv_at:
            raise ScheduleError(f"{timeline.spans[s][slot][0]} is never received")
        keys[(s, slot)] = recv_at[message]
    return {s: _merge(actions, {i: keys[(s, i)] for i, a in enumerate(actions) if a.kind.has_peer})
            for s, actions in schedule.items()}


def _merge(actions: list[Action], keys: dict[int, tuple]) -> list[Action]:
    """One stage's local actions in their order, with its transfers in key order between them."""
    local = [a for a in actions if not a.kind.has_peer]
    # Position in ``local`` of the compute a send follows (it may run after it) or a receive
    # precedes (it must run before it).
    anchor: dict[int, int] = {}
    seen = 0
    for i, a in enumerate(actions):
        if a.kind.has_peer:
            anchor[i] = seen - 1 if _is_send(a) else seen
        else:
            seen += 1
    order = sorted(keys, key=lambda i: (keys[i], i))
    out: list[Action] = []
    pos = 0

    def place(upto: int, done: int) -> None:
        nonlocal pos
        while pos < len(order) and (pos <= upto or _is_send(actions[order[pos]]) and anchor[order[pos]] < done):
            i = order[pos]
            if _is_send(actions[i]) and anchor[i] >= done:
                raise ScheduleError(f"{actions[i]} is ordered before the compute that produces it")
            out.append(actions[i])
            pos += 1

    for done, a in enumerate(local):
        needed = [k for k, i in enumerate(order) if not _is_send(actions[i]) and anchor[i] == done]
        place(max(needed, default=-1), done)
        out.append(a)
    place(len(order), len(local))
    return out


def _is_send(a: Action) -> bool:
    return a.kind in (K.SEND_F, K.SEND_B)


def _channel(a: Action) -> tuple[int, int, str]:
    """(sender, receiver, direction) of a transfer: the ordered channel its message travels."""
    if _is_send(a):
        return (a.stage_idx, a.peer, a.kind.value[-1])
    return (a.peer, a.stage_idx, a.kind.value[-1])


def add_release(schedule: Schedule) -> Schedule:
    """Put ``RELEASE_OUT`` and ``RELEASE_IN`` of every micro-batch right after their last use.

    >>> from gpp_deepspeed.schedule.ir import Action
    >>> acts = [Action.parse(t) for t in "1RECV_F0@0 1F0 1SEND_F0@2 1RECV_B0@2 1B0 1SEND_B0@0".split()]
    >>> add_release({1: acts})[1]
    [1RECV_F0@0, 1F0, 1SEND_F0@2, 1RECV_B0@2, 1B0, 1RELEASE_OUT0, 1SEND_B0@0, 1RELEASE_IN0]
    """
    out: Schedule = {}
    for s, actions in schedule.items():
        last_in: dict[int, int] = {}
        last_out: dict[int, int] = {}
        for i, a in enumerate(actions):
            for op in a.transfers or (a, ):
                if op.mb_idx is None:
                    continue
                if op.kind in _READS_INPUTS:
                    last_in[op.mb_idx] = i
                if op.kind in _READS_OUTPUTS:
                    last_out[op.mb_idx] = i
        lowered: list[Action] = []
        for i, a in enumerate(actions):
            lowered.append(a)
            lowered += [Action(s, K.RELEASE_OUT, j) for j, at in last_out.items() if at == i]
            lowered += [Action(s, K.RELEASE_IN, j) for j, at in last_in.items() if at == i]
        out[s] = lowered
    return out


def assign_buffers(schedule: Schedule) -> BufferSlots:
    """The buffer slot of every micro-batch on every stage, reusing a slot once it is free.

    A micro-batch holds its slot from the first action that touches it to the last one (with
    :func:`add_release`, its last release); slots are handed out lowest first, so a stage gets
    as many as it ever has micro-batches live at once.

    >>> from gpp_deepspeed.schedule.ir import Action
    >>> acts = [Action.parse(t) for t in "0F0 0F1 0B0 0F2 0B1 0B2".split()]
    >>> assign_buffers({0: acts})
    {0: {0: 0, 1: 1, 2: 0}}
    """
    slots: BufferSlots = {}
    for s, actions in schedule.items():
        last: dict[int, int] = {}
        for i, a in enumerate(actions):
            for j in a.mb_idxs:
                last[j] = i
        slot_of: dict[int, int] = {}
        free: set[int] = set()
        count = 0
        for i, a in enumerate(actions):
            for j in a.mb_idxs:
                if j not in slot_of:
                    if free:
                        slot_of[j] = min(free)
                        free.remove(slot_of[j])
                    else:
                        slot_of[j] = count
                        count += 1
            free.update(slot_of[j] for j in a.mb_idxs if last[j] == i)
        slots[s] = slot_of
    return slots


def num_slots(slot_of: dict[int, int]) -> int:
    """How many buffers a stage with this slot assignment needs (at least one)."""
    return max(slot_of.values(), default=0) + 1
