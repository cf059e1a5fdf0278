"""Checking and simulating a :data:`Schedule` without starting any process.

The simulator executes every stage's action list under one of two communication semantics
(messages on one channel, ``src -> dst`` per direction, match in order):

``async`` (gloo)
    sends never block the sender, a receive blocks until the matching send was posted, and
    ``WAIT_SENDS`` blocks until every send of the stage has been received;
``rendezvous`` (NCCL, large messages)
    a send completes only when its matching receive is posted, so both ends block; a grouped
    ``P2P`` action posts all its transfers at once and completes as a whole, when each has. A
    stage's actions run one after the other, so a group is posted only once the stage's previous
    group completed: NCCL's stream order, under which a group launched after another starts only
    when that one has finished. The model holds because the engine posts every transfer action,
    single or grouped, layouts included, as exactly one ``batch_isend_irecv`` and never a single
    ``isend``/``irecv`` (:mod:`gpp_deepspeed.engine.p2p`): what the validator sees as one group is
    one group on the wire.

A layout (``SEND_L``/``RECV_L``, :func:`~gpp_deepspeed.schedule.lowering.add_layouts`) is a message
of the activations' channel, just before the activations it sizes; the n-th message of a channel
must be of the same kind (layout or data) and micro-batch at both ends.

If no stage can move and some have actions left, the schedule deadlocks, and the error says
where. :func:`check_lists` checks the structure (including buffer slots and release points, read
from the table of what every action kind uses and frees, :data:`~gpp_deepspeed.schedule.ir.KINDS`)
and :func:`check_weight_versions` the weight versions of an asynchronous program;
:func:`validate_schedule` checks the structure and runs the rendezvous mode, which implies the
async one. The same simulator gives the makespan and per-stage busy time of a schedule under
given action durations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import ScheduleError
from ..graph.stages import StageGraph
from .ir import LAYOUT_OF, RELEASES, Action, ActionKind as K, Schedule, waited

__all__ = ["Timeline", "simulate", "validate_schedule", "check_lists", "check_weight_versions", "default_duration",
           "MODES"]


def default_duration(action: Action) -> float:
    """Unit forward, double backward (a unit input gradient and a unit weight gradient when split),
    free everything else."""
    return {K.FORWARD: 1.0, K.BACKWARD: 2.0, K.BACKWARD_INPUT: 1.0, K.BACKWARD_WEIGHT: 1.0}.get(action.kind, 0.0)


@dataclass
class Timeline:
    """Start and end time of every action, per stage."""

    spans: dict[int, list[tuple[Action, float, float]]] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max((end for spans in self.spans.values() for _, _, end in spans), default=0.0)

    def busy(self, stage_idx: int) -> float:
        return sum(end - start for _, start, end in self.spans[stage_idx])

    def bubble_fraction(self, stage_idx: int) -> float:
        span = self.makespan
        return 0.0 if span == 0 else 1.0 - self.busy(stage_idx) / span


MODES = ("async", "rendezvous")


class _Channels:
    """Posted sends and receives per channel; the n-th send of a channel matches its n-th receive.
    A transfer takes its place on its channel when its stage posts it (program order) and its time
    when it is launched (:meth:`launch`; later than posted under NCCL's stream order)."""

    def __init__(self, latency: float, late_receive: float = 0.0, rank_of=None):
        self.latency, self.late_receive = latency, late_receive
        self.rank_of = rank_of
        self.posted: dict[tuple, list[list[list]]] = {}   # channel -> [sends, receives], each [what, time]

    def post(self, op: Action) -> tuple[tuple, int]:
        ch = op.channel
        what = (op.mb_idx, op.kind.spec.layout)
        if self.rank_of is not None:
            # Several stages per rank: every message between two ranks, one way, shares one wire
            # and matches in posting order, whatever stages and direction it belongs to.
            what, ch = (*what, ch), (self.rank_of[ch[0]], self.rank_of[ch[1]], "rank")
        side = self.posted.setdefault(ch, [[], []])[0 if op.kind.spec.send else 1]
        side.append([what, None])
        return ch, len(side) - 1

    def launch(self, op: Action, ch: tuple, n: int, time: float) -> None:
        self.posted[ch][0 if op.kind.spec.send else 1][n][1] = time

    def match_time(self, ch: tuple, n: int) -> float | None:
        """When message ``n`` of ``ch`` is through (both ends launched), or None if one end is missing."""
        sends, recvs = self.posted.get(ch, [[], []])
        if n >= len(sends) or n >= len(recvs) or sends[n][1] is None or recvs[n][1] is None:
            return None
        ((sent_mb, sent_layout, *sent_ch), sent_at), ((recv_mb, recv_layout, *recv_ch), recv_at) = sends[n], recvs[n]
        if sent_ch != recv_ch:
            raise ScheduleError(f"message {n} from rank {ch[0]} to rank {ch[1]} is sent on channel {sent_ch[0]} but "
                                f"received as channel {recv_ch[0]}: the two ranks post their messages in different "
                                "orders")
        if sent_mb != recv_mb:
            raise ScheduleError(f"message {n} on channel {ch[0]}->{ch[1]} ({ch[2]}) carries micro-batch {sent_mb} "
                                f"but its receive expects micro-batch {recv_mb}")
        if sent_layout != recv_layout:
            what = {True: "a layout", False: "activations"}
            raise ScheduleError(f"message {n} on channel {ch[0]}->{ch[1]} ({ch[2]}) is {what[sent_layout]} of "
                                f"micro-batch {sent_mb} but its receive expects {what[recv_layout]}: both ends "
                                "must send and receive a layout just before the activations it sizes")
        # A message moves once both ends are posted (NCCL; gloo's TCP pair answers a send posted
        # before its receive with a "receive ready" notice, and only then sends the data: the
        # late receive's extra exchange).
        if recv_at > sent_at:
            return recv_at + self.latency + self.late_receive
        return sent_at + self.latency


@dataclass
class _Group:
    """One transfer action on the wire: its ``(op, channel, n)``, when its stage posted it, when
    it was launched and when it completed as a whole (``None``: not yet)."""

    action: Action
    slot: int
    ops: list[tuple[Action, tuple, int]]
    posted: float
    launched: float | None = None
    done: float | None = None


def simulate(schedule: Schedule, *, duration: Callable[[Action], float] = default_duration,
             latency: float = 0.0, late_receive: float = 0.0, mode: str = "async",
             rank_of: tuple[int, ...] | None = None) -> Timeline:
    """Run every stage's list and time it.

    A transfer action posts its transfers. A receive completes in that action, which waits for
    it, or, when the list has a wait for it (``WAIT_F``/``WAIT_B`` of its micro-batch:
    :func:`~gpp_deepspeed.schedule.ir.waited`), at that wait, the stage going on meanwhile.

    ``mode="async"`` is gloo's behaviour, what the engine relies on at least: a send never blocks
    its stage, a receive completes once the matching send was posted, ``WAIT_SENDS`` waits until
    every send of the stage was received. ``mode="rendezvous"`` is NCCL's for large messages: a
    send completes only when its receive is posted too; a grouped ``P2P`` action's transfers are
    launched together and complete as a whole; and a stage's groups are launched one at a time in
    posting order, each once the one before it has completed (NCCL's stream order; the stage
    itself goes on past a group it does not wait for). The model holds because the engine posts
    every transfer action, single or grouped, layouts included, as exactly one
    ``batch_isend_irecv`` and never a single ``isend``/``irecv`` (:mod:`gpp_deepspeed.engine.p2p`):
    what the validator sees as one group is one group on the wire. A schedule that completes in
    rendezvous mode completes in async mode.

    Raises :class:`ScheduleError` on deadlock (naming the action each stuck stage waits on and
    the transfers nobody posted the other end of) and when the n-th message of a channel carries
    another micro-batch than its n-th receive expects.

    ``latency``: seconds every message is in flight once both its send and its receive are posted
    (the part of a message's cost that overlaps other work: :attr:`CommFit.latency_s
    <gpp_deepspeed.planner.costs.CommFit.latency_s>`); a grouped action waits for its last message,
    so it pays the latency once, not once per message. ``late_receive``: what a message whose
    receive is posted after its send waits on top of that (:attr:`CommFit.late_receive_s
    <gpp_deepspeed.planner.costs.CommFit.late_receive_s>`): a receive posted early does not pay
    it. ``rank_of``: the rank of every stage when ranks hold several stages (``schedule`` keyed by
    rank): the messages between two ranks match in posting order over all their channels, as on
    the wire.
    """
    if mode not in MODES:
        raise ScheduleError(f'unknown simulation mode "{mode}"; valid: {list(MODES)}')
    rendezvous = mode == "rendezvous"
    channels = _Channels(latency, late_receive, rank_of)
    deferred = {s: waited(actions) for s, actions in schedule.items()}
    pc = {s: 0 for s in schedule}
    clock = {s: 0.0 for s in schedule}
    stream: dict[int, list[_Group]] = {s: [] for s in schedule}    # a stage's groups, in posting order
    first_open = {s: 0 for s in schedule}                          # its first group not complete
    current: dict[int, _Group] = {}                                # the group of the action a stage is at
    pending: dict[tuple, list[tuple[_Group, tuple, int]]] = {}      # a wait's key -> its posted receives
    timeline = Timeline({s: [] for s in schedule})

    def launch(group: _Group, at: float) -> None:
        group.launched = at
        for op, ch, n in group.ops:
            channels.launch(op, ch, n, at)

    def advance(s: int) -> bool:
        """Launch and complete the stage's groups in stream order (rendezvous); whether any did."""
        moved = False
        groups = stream[s]
        while first_open[s] < len(groups):
            group = groups[first_open[s]]
            if group.launched is None:
                before = groups[first_open[s] - 1].done if first_open[s] else 0.0
                launch(group, max(group.posted, before))
                moved = True
            times = [channels.match_time(ch, n) for _, ch, n in group.ops]
            if None in times:
                break
            group.done = max([group.launched] + times)
            first_open[s] += 1
            moved = True
        return moved

    def through(entries) -> float | None:
        """When every ``(group, channel, n)`` of ``entries`` is complete: its group under
        rendezvous (one request per group), its own message otherwise."""
        times = [g.done if rendezvous else channels.match_time(ch, n) for g, ch, n in entries]
        return None if None in times else max(times, default=0.0)

    progress = True
    while progress:
        progress = False
        for s, actions in schedule.items():
            if rendezvous and advance(s):
                progress = True
            while pc[s] < len(actions):
                a = actions[pc[s]]
                start = clock[s]
                if a.kind.is_transfer:
                    if s not in current:
                        group = current[s] = _Group(a, pc[s], [(op, *channels.post(op)) for op in a.transfers], posted=start)
                        stream[s].append(group)
                        if rendezvous:
                            advance(s)
                        else:
                            launch(group, start)
                        for entry in group.ops:
                            if entry[0].completion in deferred[s]:
                                pending.setdefault(entry[0].completion, []).append((group, *entry[1:]))
                    group = current[s]
                    blocking = [(group, ch, n) for op, ch, n in group.ops
                                if not op.kind.spec.send and op.completion not in deferred[s]]
                    done = through(blocking)
                    if done is None:
                        break
                    start = max(start, done)
                    del current[s]
                elif a.kind.spec.completes or a.kind is K.WAIT_SENDS:
                    entries = pending.get(a.completion, []) if a.kind.spec.completes else [
                        (g, ch, n) for g in stream[s] for op, ch, n in g.ops if op.kind.spec.send]
                    done = through(entries)
                    if done is None:
                        break
                    start = max(start, done)
                    pending.pop(a.completion, None)
                end = start + duration(a)
                timeline.spans[s].append((a, start, end))
                clock[s] = end
                pc[s] += 1
                progress = True
    stuck = {s: schedule[s][pc[s]] if pc[s] < len(schedule[s]) else None for s in schedule
             if pc[s] < len(schedule[s]) or rendezvous and first_open[s] < len(stream[s])}
    if stuck:
        raise ScheduleError(_deadlock_message(stuck, pc, stream, first_open, current, channels, mode))
    return timeline


def _deadlock_message(stuck, pc, stream, first_open, current, channels: _Channels, mode: str) -> str:
    waits = []
    for s, a in sorted(stuck.items()):
        # The group the stage waits on: under rendezvous its first incomplete one (stream order).
        groups = stream[s][first_open[s]:first_open[s] + 1] if mode == "rendezvous" else [current.get(s)]
        missing = [op for g in groups if g is not None for op, ch, n in g.ops
                   if channels.match_time(ch, n) is None and (mode == "rendezvous" or not op.kind.spec.send)]
        other = "; ".join(f"{op} waits for stage {op.peer} to post its "
                          f"{'receive' if op.kind.spec.send else 'send'}" for op in missing)
        host = f"{a} (slot {pc[s]})" if a is not None else "the end of its list"
        group = groups[0] if groups and groups[0] is not None else None
        at = host if group is None or group.slot == pc[s] else f"{group.action} (slot {group.slot}; the stage has gone on to {host})"
        waits.append(f"stage {s} at {at}" + (f" [{other}]" if other else ""))
    text = "schedule deadlocks"
    if mode == "rendezvous":
        text += (" under rendezvous semantics (a send completes only when its receive is posted, as NCCL "
                 "sends of large messages do)")
    text += ": " + ", ".join(waits)
    if mode == "rendezvous":
        text += ("; post transfers that must progress together as one grouped P2P action (batch_isend_irecv), "
                 "or order them so that one side receives first")
    return text


def validate_schedule(schedule: Schedule, stage_graph: StageGraph, num_microbatches: int, *, train: bool,
                      slots: dict[int, dict[int, int]] | None = None, mode: str = "rendezvous", layouts: bool = False,
                      releases: bool = True) -> Timeline:
    """Check a schedule's structure (:func:`check_lists`) and run it through :func:`simulate`
    (rendezvous mode by default). Returns the simulated timeline."""
    check_lists(schedule, stage_graph, num_microbatches, train=train, slots=slots, layouts=layouts,
                releases=releases)
    return simulate(schedule, mode=mode)


def check_lists(schedule: Schedule, stage_graph: StageGraph, num_microbatches: int, *, train: bool,
                slots: dict[int, dict[int, int]] | None = None, layouts: bool = False, releases: bool = True) -> None:
    """Check every stage's list of a whole program (a synchronous batch, or an asynchronous
    program's batches and flush put end to end, its weight actions aside).

    Checks, per stage: every micro-batch has one forward (and, when training, one backward after
    its forward: a ``B``, or an ``I`` followed by a ``W``); every forward is preceded by a receive
    from each predecessor and followed by a send to each successor (mirrored for backwards);
    communication only uses stage edges; every release comes once per micro-batch, after every
    use of what it frees, and, with ``releases`` (a lowered program; not a compute order or a
    sketch without release points), every micro-batch that uses a buffer has the release that
    frees it; and no two micro-batches that share a buffer slot (``slots[stage][mb]``, what
    :func:`~gpp_deepspeed.schedule.lowering.assign_buffers` returns) are live at once. With
    ``layouts``, every activation transfer has its layout transfer in an earlier action of the
    stage (a receive is sized from it before it is posted); without, there is none. A wait
    (``WAIT_F``/``WAIT_B``) follows every receive it completes and comes before the action that
    uses them.
    """
    if sorted(schedule) != list(range(stage_graph.num_stages)):
        raise ScheduleError(f"schedule has stages {sorted(schedule)}, expected 0..{stage_graph.num_stages - 1}")
    for s, actions in schedule.items():
        slot_of = (slots or {}).get(s)
        _check_stage(s, actions, stage_graph, num_microbatches, train)
        _check_layouts(s, actions, layouts)
        _check_waits(s, actions)
        _check_releases(s, actions, required=releases)
        if slot_of is not None:
            _check_buffers(s, actions, slot_of)


def _flat(actions: list[Action]):
    """(slot, action) for every action, with a grouped transfer's ops at its slot."""
    for i, a in enumerate(actions):
        for op in a.parts:
            yield i, op


def _check_stage(s: int, actions: list[Action], graph: StageGraph, num_mb: int, train: bool) -> None:
    preds, succs = set(graph.preds(s)), set(graph.succs(s))
    grad_preds, grad_succs = set(graph.grad_preds(s)), set(graph.grad_succs(s))
    backward = train and s not in graph.frozen   # a frozen stage runs forwards only
    where: dict[tuple, int] = {}
    for i, a in _flat(actions):
        if a.stage_idx != s:
            raise ScheduleError(f"stage {s} slot {i} holds {a}, an action of stage {a.stage_idx}")
        if a.kind.has_peer and a.kind.spec.to_successor and a.peer not in succs:
            raise ScheduleError(f"stage {s} slot {i}: {a} but stage {a.peer} is not a successor of stage {s}")
        if a.kind.has_peer and not a.kind.spec.to_successor and a.peer not in preds:
            raise ScheduleError(f"stage {s} slot {i}: {a} but stage {a.peer} is not a predecessor of stage {s}")
        if a.kind is K.RECV_B and a.peer not in grad_succs or a.kind is K.SEND_B and a.peer not in grad_preds:
            raise ScheduleError(f"stage {s} slot {i}: {a} but the edge between stages {s} and {a.peer} carries no "
                                "gradient (none of its tensors depends on a trainable parameter)")
        if not backward and a.kind.spec.backward:
            raise ScheduleError(f"stage {s} slot {i}: {a} but stage {s} " + (
                "is frozen (nothing to differentiate)" if train else "runs no backward in evaluation"))
        key = (a.kind, a.mb_idx, a.peer)
        if key in where:
            raise ScheduleError(f"stage {s} runs {a} twice (slots {where[key]} and {i})")
        where[key] = i
    for j in range(num_mb):
        if (K.FORWARD, j, None) not in where:
            raise ScheduleError(f"stage {s} never runs {Action(s, K.FORWARD, j)}")
        if backward:
            _check_backward_kinds(s, j, where)
        f = where[(K.FORWARD, j, None)]
        if (K.LOAD, j, None) in where and where[(K.LOAD, j, None)] > f:
            raise ScheduleError(f"stage {s} loads micro-batch {j} after its forward")
        for p in preds:
            if where.get((K.RECV_F, j, p), f + 1) > f:
                raise ScheduleError(f"stage {s} runs {Action(s, K.FORWARD, j)} before receiving it from stage {p}")
        for t in succs:
            if where.get((K.SEND_F, j, t), -1) < f:
                raise ScheduleError(f"stage {s} does not send micro-batch {j} to stage {t} after its forward")
        if backward:
            # With a split backward, I is what receives and sends gradients; W follows it.
            b = where.get((K.BACKWARD, j, None), where.get((K.BACKWARD_INPUT, j, None)))
            if b < f:
                raise ScheduleError(f"stage {s} runs the backward of micro-batch {j} before its forward")
            for t in grad_succs:
                if where.get((K.RECV_B, j, t), b + 1) > b:
                    raise ScheduleError(f"stage {s} runs {Action(s, K.BACKWARD, j)} before receiving its "
                                        f"gradient from stage {t}")
            for p in grad_preds:
                if where.get((K.SEND_B, j, p), -1) < b:
                    raise ScheduleError(f"stage {s} does not send the gradient of micro-batch {j} to stage {p}")
    extra = sorted({a.mb_idx for _, a in _flat(actions) if a.mb_idx is not None and not 0 <= a.mb_idx < num_mb})
    if extra:
        raise ScheduleError(f"stage {s} refers to micro-batches {extra} outside 0..{num_mb - 1}")


def _check_layouts(s: int, actions: list[Action], layouts: bool) -> None:
    """With ``layouts``, each ``SEND_F``/``RECV_F`` has its ``SEND_L``/``RECV_L`` (same micro-batch
    and peer) in an earlier action: a receive's buffers are sized from its layout, which must have
    arrived before the receive is posted, and one group completes as a whole. Without, no layouts."""
    where: dict[tuple, int] = {}
    for i, a in _flat(actions):
        if a.kind.spec.layout:
            if not layouts:
                raise ScheduleError(f"stage {s} slot {i}: {a} in a program without layouts")
            where[(a.kind, a.mb_idx, a.peer)] = i
        elif layouts and a.kind in LAYOUT_OF:
            at = where.get((LAYOUT_OF[a.kind], a.mb_idx, a.peer))
            if at is None or at >= i:
                raise ScheduleError(f"stage {s} slot {i}: {a} needs {Action(s, LAYOUT_OF[a.kind], a.mb_idx, a.peer)} "
                                    "in an earlier action" + ("" if at is None else f", not in the same one (slot {at})"))


def _check_waits(s: int, actions: list[Action]) -> None:
    """Every wait completes receives posted before it and none posted after it, and comes before
    the forward (``WAIT_F``) or the backward that takes the gradients (``WAIT_B``) of its
    micro-batch: a receive it completes is not complete until then (:func:`~.ir.waited`)."""
    waits = {a.completion: i for i, a in _flat(actions) if a.kind.spec.completes}
    posted: set[tuple] = set()
    for i, a in _flat(actions):
        key = a.completion
        if key in waits and not a.kind.spec.completes:
            if i > waits[key]:
                raise ScheduleError(f"stage {s} slot {i}: {a} is posted after {actions[waits[key]]} (slot {waits[key]}), "
                                    "the wait that completes it")
            posted.add(key)
        need = a.consumes
        if need in waits and waits[need] > i:
            raise ScheduleError(f"stage {s} slot {i}: {a} runs before {actions[waits[need]]} (slot {waits[need]}) "
                                "completes the receives it needs")
    idle = sorted(set(waits) - posted, key=lambda k: waits[k])
    if idle:
        raise ScheduleError(f"stage {s} slot {waits[idle[0]]}: {actions[waits[idle[0]]]} completes no receive posted "
                            "before it")


def _check_backward_kinds(s: int, j: int, where: dict[tuple, int]) -> None:
    """A micro-batch's backward is one ``B``, or an ``I`` followed by a ``W`` (never both)."""
    full, grad_in, grad_w = ((k, j, None) in where for k in (K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT))
    if full and (grad_in or grad_w):
        raise ScheduleError(f"stage {s} runs {Action(s, K.BACKWARD, j)} and a split backward of the same micro-batch")
    if not full and not (grad_in and grad_w):
        missing = K.BACKWARD if not (grad_in or grad_w) else (K.BACKWARD_WEIGHT if grad_in else K.BACKWARD_INPUT)
        raise ScheduleError(f"stage {s} never runs {Action(s, missing, j)}")
    if grad_in and where[(K.BACKWARD_WEIGHT, j, None)] < where[(K.BACKWARD_INPUT, j, None)]:
        raise ScheduleError(f"stage {s} runs {Action(s, K.BACKWARD_WEIGHT, j)} before {Action(s, K.BACKWARD_INPUT, j)}: "
                            "the weight gradient needs the output gradients that the input-gradient pass received")


def _check_releases(s: int, actions: list[Action], *, required: bool) -> None:
    """Every release comes once per micro-batch, and nothing uses what a release freed
    (:data:`~gpp_deepspeed.schedule.ir.KINDS`); when ``required``, a micro-batch that uses a buffer
    has the release that frees it (else the buffer would stay held after the program)."""
    released: dict[tuple, int] = {}
    used: dict[tuple, int] = {}     # (release kind, micro-batch) -> slot of a use it must follow
    for i, a in _flat(actions):
        if a.kind.is_release:
            if (a.kind, a.mb_idx) in released:
                raise ScheduleError(f"stage {s} runs {a} twice (slots {released[(a.kind, a.mb_idx)]} and {i})")
            released[(a.kind, a.mb_idx)] = i
            continue
        for kind in RELEASES:
            if a.mb_idx is None or not kind.spec.frees & a.kind.spec.touches:
                continue
            if (kind, a.mb_idx) in released:
                raise ScheduleError(f"stage {s} slot {i}: {a} uses what {Action(s, kind, a.mb_idx)} freed at slot "
                                    f"{released[(kind, a.mb_idx)]}")
            used.setdefault((kind, a.mb_idx), i)
    missing = sorted((j, RELEASES.index(kind)) for kind, j in used if (kind, j) not in released) if required else []
    if missing:
        j, kind = missing[0][0], RELEASES[missing[0][1]]
        freed = ", ".join(sorted(b.value for b in kind.spec.frees))
        raise ScheduleError(f"stage {s} never frees micro-batch {j}'s {freed}: no {Action(s, kind, j)} after its use "
                            f"at slot {used[(kind, j)]}")


def _check_buffers(s: int, actions: list[Action], slot_of: dict[int, int]) -> None:
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, a in enumerate(actions):
        for j in a.buffer_mbs:
            first.setdefault(j, i)
            last[j] = i
    missing = sorted(set(first) - set(slot_of))
    if missing:
        raise ScheduleError(f"stage {s}: micro-batches {missing} have no buffer slot")
    for j in first:
        for k in first:
            if j < k and slot_of[j] == slot_of[k] and first[k] <= last[j] and first[j] <= last[k]:
                raise ScheduleError(f"stage {s}: micro-batches {j} and {k} share buffer {slot_of[j]} "
                                    f"while both are in flight; use more buffers")


def check_weight_versions(s: int, program: list[Action], *, frozen: bool = False) -> int:
    """Check one stage's weight versions over a whole asynchronous program: a forward runs on a
    live version (an in-place prediction only between ``PREDICT_INPLACE`` and its ``RESTORE``), a
    backward before its version's ``RETIRE``; every version is made once and retired once, after all
    its backwards; a retired gradient is used by an update (``UPDATE``, ``STEP``) before the next
    ``RETIRE``. Returns the most weight copies held at once (an in-place prediction holds one, the
    live weights, until its ``RESTORE``). A ``frozen`` stage runs on its live weights: it has no
    weight actions and takes no update of its own."""
    if frozen:
        own = [a for a in program if a.kind.spec.trains and not a.kind.spec.collective]
        if own:
            raise ScheduleError(f"stage {s} is frozen but runs {own[0]}")
        return 0
    alive: set[int] = set()      # versions made and not yet retired
    copies: set[int] = set()     # versions that hold a copy of the weights
    made: set[int] = set()
    users: dict[int, set[int]] = {}
    version_of: dict[int, int] = {}
    backward_done: set[int] = set()
    current = None
    in_place = None              # the in-place prediction written over the live weights, if any
    unstepped = None             # a retired version whose gradient no update has used yet
    peak = 0
    for a in program:
        if a.kind.spec.makes_version:
            if a.mb_idx in made:
                raise ScheduleError(f"stage {s} makes weight version {a.mb_idx} twice")
            if in_place is not None:
                raise ScheduleError(f"stage {s} runs {a} before restoring the live weights ({in_place})")
            made.add(a.mb_idx)
            alive.add(a.mb_idx)
            copies.add(a.mb_idx)
            users[a.mb_idx] = set()
            current = a.mb_idx
            if a.kind is K.PREDICT_INPLACE:
                in_place = a.mb_idx
            peak = max(peak, len(copies))
        elif a.kind is K.RESTORE:
            if in_place != a.mb_idx:
                raise ScheduleError(f"stage {s} runs {a} but the live weights hold no in-place prediction {a.mb_idx}")
            in_place = current = None
            copies.discard(a.mb_idx)
        elif a.kind is K.FORWARD:
            if current not in alive:
                raise ScheduleError(f"stage {s} runs {a} on no live weight version")
            version_of[a.mb_idx] = current
            users[current].add(a.mb_idx)
        elif a.kind is K.BACKWARD:
            backward_done.add(a.mb_idx)
            if in_place is not None:
                raise ScheduleError(f"stage {s} runs {a} before restoring the live weights ({in_place})")
            if version_of[a.mb_idx] not in alive:
                raise ScheduleError(f"stage {s} runs {a} after its weight version {version_of[a.mb_idx]} was retired")
        elif a.kind is K.RETIRE:
            if a.mb_idx not in alive or not users[a.mb_idx]:
                raise ScheduleError(f"stage {s} runs {a} on a version that is not live or has no forward")
            pending = sorted(users[a.mb_idx] - backward_done)
            if pending:
                raise ScheduleError(f"stage {s} runs {a} before the backwards of micro-batches {pending}")
            if unstepped is not None:
                raise ScheduleError(f"stage {s} runs {a} before an update used the gradient of version {unstepped}")
            alive.discard(a.mb_idx)
            copies.discard(a.mb_idx)
            unstepped = a.mb_idx
        elif a.kind.spec.updates:
            if a.kind is K.UPDATE and unstepped is None:
                raise ScheduleError(f"stage {s} runs {a} with no retired gradient")
            unstepped = None
    if alive:
        raise ScheduleError(f"stage {s} never retires weight versions {sorted(alive)} (the flush must drain them)")
    return peak
