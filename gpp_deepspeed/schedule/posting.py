"""Where each stage posts its transfers: the lowering passes that group them, order them and post
receives early (:mod:`.lowering` runs them; its docstring says when).

* :func:`group_p2p`: every run of transfers between two compute actions is one grouped ``P2P``
  action (``batch_isend_irecv``), a layout apart from the activations it sizes.
* :func:`group_for_rendezvous` and :func:`order_transfers`: the grouping that runs under
  rendezvous semantics (NCCL), by one global order of messages where the order as written would not.
* :func:`post_early`: every receive posted as soon as its message is sent, completed by a wait
  (``WAIT_F``/``WAIT_B``) just before its use.

Each returns lists that the simulator's rendezvous mode (:func:`~.validate.simulate`) accepts.
"""

from __future__ import annotations

from typing import Callable

from ..errors import ScheduleError
from .ir import LAYOUT_OF, WAIT_OF, Action, ActionKind as K, Schedule

__all__ = ["group_p2p", "group_for_rendezvous", "order_transfers", "post_early"]


def group_p2p(schedule: Schedule) -> Schedule:
    """Merge every run of two or more transfers between compute actions into one ``P2P`` action.

    A ``LOAD`` or a release inside a run moves after the group (a load only has to precede its
    forward, a release follow the last use). An activation transfer whose layout is in the run
    starts a new group: its receive is sized from the layout, which must have arrived (one group
    completes as a whole), and both ends split alike.

    >>> group_p2p({2: [Action.parse(t) for t in "2RECV_L0@0 2RECV_L0@1 2RECV_F0@0 2RECV_F0@1 2F0".split()]})[2]
    [(2RECV_L0@0;2RECV_L0@1)P2P, (2RECV_F0@0;2RECV_F0@1)P2P, 2F0]

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
            if a.kind in LAYOUT_OF and Action(a.stage_idx, LAYOUT_OF[a.kind], a.mb_idx, a.peer) in run:
                flush()
            run.append(a)
        elif run and (a.kind is K.LOAD or a.kind.is_release):
            after.append(a)
        else:
            flush()
            out.append(a)
    flush()
    return out


def group_for_rendezvous(schedule: Schedule, *, duration: Callable[[Action], float] | None = None,
                         rank_of: tuple[int, ...] | None = None) -> Schedule:
    """The transfers of ``schedule`` posted so that it runs under rendezvous semantics (NCCL).

    The first of these that the simulator runs in rendezvous mode: :func:`group_p2p` of the order
    as written; :func:`group_p2p` of :func:`order_transfers`'s order; that order ungrouped, which
    always runs (a stage of an asynchronous segment with no compute of its own would otherwise post
    all its deferred sends in one group, which waits on receives its peers post only after their
    own backward). A chain, and most DAGs, keep the order in which each stage's compute needs and
    produces its tensors; only schedules whose stages would each send to the other first (skip
    edges of a DAG between stages of very different warm-up) have their transfers reordered, in
    an order taken from a simulation (``duration``: the compute times the schedule was made for,
    default unit forwards and double backwards). ``rank_of``: ranks hold several stages, the
    lists are per rank (see :func:`~gpp_deepspeed.schedule.validate.simulate`).
    """
    from .validate import simulate

    ordered = None
    for attempt in ("written", "ordered"):
        if attempt == "ordered":
            ordered = order_transfers(schedule, duration=duration)
        grouped = group_p2p(schedule if ordered is None else ordered)
        try:
            simulate(grouped, mode="rendezvous", rank_of=rank_of)
        except ScheduleError:
            continue
        return grouped
    return ordered


_TICK = 1e-9
"""The least time a compute takes when transfers are ordered by a simulation (:func:`_positive`)."""


def _positive(duration: Callable[[Action], float] | None) -> Callable[[Action], float]:
    """``duration`` (default :func:`~gpp_deepspeed.schedule.validate.default_duration`) with every
    forward and backward taking at least :data:`_TICK`: ordering transfers by simulated times
    relies on each compute ending after it starts, or a send could tie with, and be placed before,
    the compute that produces it (a split backward's ``I`` on a stage whose input needs no gradient
    is priced at nothing)."""
    from .validate import default_duration

    priced = duration or default_duration
    return lambda a: max(priced(a), _TICK) if a.kind is K.FORWARD or a.kind.spec.backward else priced(a)


def order_transfers(schedule: Schedule, *, duration: Callable[[Action], float] | None = None) -> Schedule:
    """Put every stage's transfers in one global order of messages, keeping its compute order.

    The schedule (compute order plus ungrouped transfers, as
    :func:`~gpp_deepspeed.schedule.generators.add_send_recv` writes it) is simulated with
    asynchronous sends (:func:`~gpp_deepspeed.schedule.validate.simulate`, priced by ``duration``,
    by default unit forwards and double backwards; a compute priced at nothing, as a layer with no
    input gradient, counts a tick, :func:`_positive`). Each message then has a key, the time it is received with its channel and index
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
    from .validate import simulate

    timeline = simulate(schedule, mode="async", duration=_positive(duration))
    keys: dict[tuple, tuple] = {}      # (stage, slot) -> sort key of its message
    recv_at: dict[tuple, tuple] = {}   # (channel, n) -> key of that message
    sends: list[tuple[int, int, tuple]] = []
    for s, spans in timeline.spans.items():
        for slot, a, (ch, n) in _messages(a for a, _, _ in spans):
            if _is_send(a):
                sends.append((s, slot, (ch, n)))
            else:
                keys[(s, slot)] = recv_at[(ch, n)] = (spans[slot][1], ch, n)
    for s, slot, message in sends:
        if message not in recv_at:
            raise ScheduleError(f"{timeline.spans[s][slot][0]} is never received")
        keys[(s, slot)] = recv_at[message]
    return {s: _merge(actions, {i: keys[(s, i)] for i, a in enumerate(actions) if a.kind.has_peer})
            for s, actions in schedule.items()}


def _merge(actions: list[Action], keys: dict[int, tuple], early: dict[int, int] | None = None) -> list[Action]:
    """One stage's local actions in their order, with its transfers in key order between them;
    ``early[i]``: the local action before which receive ``i`` is placed, if earlier than just in
    time."""
    local = [a for a in actions if not a.kind.has_peer]
    # Position in ``local`` of the compute a send follows (it may run after it) or a receive
    # precedes (it must run before it).
    anchor: dict[int, int] = {}
    seen = 0
    for i, a in enumerate(actions):
        if a.kind.has_peer:
            anchor[i] = seen - 1 if _is_send(a) else (early or {}).get(i, seen)
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


def _messages(actions):
    """``(index, transfer, (channel, n))`` for every single transfer of one list, in order: the
    n-th message of its channel, the same pair at both ends."""
    count: dict[tuple, int] = {}
    for i, a in enumerate(actions):
        if a.kind.has_peer:
            ch = a.channel
            count[ch] = count.get(ch, -1) + 1
            yield i, a, (ch, count[ch])


def _is_send(a: Action) -> bool:
    return a.kind.spec.send


def post_early(schedule: Schedule, *, duration: Callable[[Action], float] | None = None,
               rank_of: tuple[int, ...] | None = None) -> Schedule:
    """Post every receive of activations or gradients as soon as its message is sent, and
    complete it with a wait just before the action that needs it (``WAIT_F`` before the forward,
    ``WAIT_B`` before the backward that takes the gradients; one wait per stage, direction and
    micro-batch, whatever the number of peers). This is torch.distributed.pipelining's runtime
    (``_add_send_recv`` places a receive where its send is issued; ``RECV_F`` posts an ``irecv``,
    ``F`` waits for it): the message travels while the receiver computes, and gloo's
    receive-ready exchange (a send posted before its receive moves only once the receive is) is
    off the critical path.

    When is "as soon as": the schedule, simulated with asynchronous sends and ``duration`` (the
    compute times it was made for; default unit forwards and double backwards), gives each message
    the time its send is posted. Every stage then posts its transfers in the order of those times,
    one global order of messages (as :func:`order_transfers`, which keys them by their receive): a
    send right after the compute that produces it, a receive before the local action that runs when
    its message is sent, and never before what it depends on (the forward whose outputs a gradient's
    receive is sized from, another action on the same micro-batch's buffers) nor after the action
    that needs it. A result slower than ``schedule`` where messages take no time is not kept.
    Under NCCL's stream order a group launched early holds up the groups posted after
    it; one global order keeps the least message not yet through launched at both ends. The
    transfers are grouped again (:func:`group_p2p`); if the result would not run under rendezvous
    semantics, or a message is not received in the lists (a deferred send of an asynchronous
    segment), ``schedule`` is returned as it is, its receives completing in their own actions.
    ``rank_of``: the lists are per rank, ranks holding several stages.

    The last stage of a three-stage 1F1B posts micro-batch 1's activations with micro-batch 0's,
    before its forward and backward (the middle stage sends them as the last stage starts that
    forward), and waits for them after both:

    >>> from gpp_deepspeed.graph import StageGraph
    >>> from gpp_deepspeed.schedule import add_load, add_send_recv, one_f_one_b
    >>> chain = StageGraph.chain(3)
    >>> lists = group_for_rendezvous(add_send_recv(add_load(one_f_one_b(chain, 2), chain), chain))
    >>> " ".join(map(str, post_early(lists)[2]))
    '2LOAD0 (2RECV_F0@1;2RECV_F1@1)P2P 2WAIT_F0 2F0 2B0 2SEND_B0@1 2LOAD1 2WAIT_F1 2F1 2B1 2SEND_B1@1'
    """
    from .validate import simulate

    duration = _positive(duration)
    flat = {s: [op for a in actions for op in a.parts] for s, actions in schedule.items()}
    try:
        timeline = simulate(flat, mode="async", duration=duration, rank_of=rank_of)
        sent = {message: spans[i][1] for spans in timeline.spans.values()
                for i, a, message in _messages(a for a, _, _ in spans) if a.kind.spec.send}
        early = {s: _with_waits(_post_stage_early(timeline.spans[s], sent)) for s in flat}
        simulate(early, mode="rendezvous", rank_of=rank_of)
        # Never slower where messages are free: a receive held back by what it depends on holds
        # back the sends keyed after it.
        if simulate(early, duration=duration, rank_of=rank_of).makespan > timeline.makespan:
            return schedule
    except ScheduleError:
        return schedule
    return early


def _post_stage_early(spans, sent: dict[tuple, float]) -> list[Action]:
    """One stage's list (``spans``: its actions simulated, transfers ungrouped) with every transfer
    keyed by its message's send time (``sent``) and placed by :func:`_merge`: a data receive
    before the local action that ends when (or after) its message is sent, a compute's worth of
    margin when the times tie, and after every transfer keyed before it can be placed."""
    actions = [a for a, _, _ in spans]
    ends = [end for a, _, end in spans if not a.kind.has_peer]
    local = [a for a in actions if not a.kind.has_peer]
    keys: dict[int, tuple] = {}
    before: dict[int, int] = {}   # transfer -> how many local actions precede it
    for i, a, (ch, n) in _messages(actions):
        if (ch, n) not in sent:
            raise ScheduleError(f"{a} is never sent")
        keys[i], before[i] = (sent[(ch, n)], ch, n), i - len(keys)
    early: dict[int, int] = {}
    floor = 0   # where the transfers keyed so far have been placed, at the earliest
    for i in sorted(keys, key=lambda i: (keys[i], i)):
        a = actions[i]
        if a.completion is not None:   # a data receive; a layout's stays where it is
            at = next((k for k, end in enumerate(ends) if end >= keys[i][0]), before[i])
            deps = max((k + 1 for k in range(before[i]) if _must_precede(local[k], a)), default=0)
            early[i] = min(max(at, deps, floor), before[i])
            floor = max(floor, early[i])
        else:
            floor = max(floor, before[i])
    return _merge(actions, keys, early)


def _with_waits(actions: list[Action]) -> list[Action]:
    """``actions`` (transfers ungrouped) with a wait before the first action that needs the data
    receives of each stage, direction and micro-batch, transfers grouped (:func:`group_p2p`)."""
    receives = {a.completion for a in actions if a.completion is not None}
    out: list[Action] = []
    for a in actions:
        need = a.consumes
        if need in receives:
            receives.discard(need)
            out.append(Action(a.stage_idx, WAIT_OF[need[1]], a.mb_idx))
        out.append(a)
    return _group_stage(out)


def _must_precede(before: Action, receive: Action) -> bool:
    """``receive`` cannot be posted before ``before``, which writes what it reads of its stage's
    micro-batch (a gradient's receive is sized from the forward's outputs). Receives and
    hand-overs into the same buffer add to it in any order."""
    return (before.stage_idx == receive.stage_idx and before.mb_idx == receive.mb_idx
            and not before.kind.spec.version and bool(before.kind.spec.writes & receive.kind.spec.reads))
