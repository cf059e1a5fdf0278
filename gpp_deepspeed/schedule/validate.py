"""Checking and simulating a :data:`Schedule` without starting any process.

The simulator executes every stage's action list with the engine's communication semantics:
sends are asynchronous (they never block the sender), a receive blocks until the matching send
was posted (messages on one channel, ``src -> dst`` per direction, match in order), and
``WAIT_SENDS`` blocks until every send of the stage has been received. If no stage can move and
some have actions left, the schedule deadlocks, and :func:`validate_schedule` says where.
The same simulator gives the makespan and per-stage busy time of a schedule under given
action durations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import ScheduleError
from ..graph.stages import StageGraph
from .ir import Action, ActionKind as K, Schedule

__all__ = ["Timeline", "simulate", "validate_schedule", "default_duration"]


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


def _channel(a: Action) -> tuple[int, int, str]:
    """The ordered message channel an action uses: (sender stage, receiver stage, direction)."""
    if a.kind is K.SEND_F:
        return (a.stage_idx, a.peer, "F")
    if a.kind is K.RECV_F:
        return (a.peer, a.stage_idx, "F")
    if a.kind is K.SEND_B:
        return (a.stage_idx, a.peer, "B")
    return (a.peer, a.stage_idx, "B")


def simulate(schedule: Schedule, *, duration: Callable[[Action], float] = default_duration,
             latency: float = 0.0) -> Timeline:
    """Run every stage's list with asynchronous sends and blocking receives.

    Raises :class:`ScheduleError` on deadlock (naming the action each stuck stage waits on) and
    when the n-th message of a channel carries another micro-batch than its n-th receive expects.
    """
    pc = {s: 0 for s in schedule}
    clock = {s: 0.0 for s in schedule}
    sent: dict[tuple, list[tuple[int, float]]] = {}       # channel -> [(mb, post time)]
    received: dict[tuple, list[float]] = {}                # channel -> [receive time]
    my_sends: dict[int, list[tuple[tuple, int]]] = {s: [] for s in schedule}
    timeline = Timeline({s: [] for s in schedule})
    progress = True
    while progress:
        progress = False
        for s, actions in schedule.items():
            while pc[s] < len(actions):
                a = actions[pc[s]]
                start = clock[s]
                if a.kind in (K.SEND_F, K.SEND_B):
                    ch = _channel(a)
                    my_sends[s].append((ch, len(sent.setdefault(ch, []))))
                    sent[ch].append((a.mb_idx, start))
                elif a.kind in (K.RECV_F, K.RECV_B):
                    ch = _channel(a)
                    n = len(received.setdefault(ch, []))
                    if n >= len(sent.get(ch, [])):
                        break
                    mb, posted = sent[ch][n]
                    if mb != a.mb_idx:
                        raise ScheduleError(f"{a} receives micro-batch {a.mb_idx} but message {n} on channel "
                                            f"{ch[0]}->{ch[1]} ({ch[2]}) carries micro-batch {mb}")
                    start = max(start, posted + latency)
                    received[ch].append(start)
                elif a.kind is K.WAIT_SENDS:
                    pending = [(ch, n) for ch, n in my_sends[s] if n >= len(received.get(ch, []))]
                    if pending:
                        break
                    start = max([start] + [received[ch][n] for ch, n in my_sends[s]])
                end = start + duration(a)
                timeline.spans[s].append((a, start, end))
                clock[s] = end
                pc[s] += 1
                progress = True
    stuck = {s: schedule[s][pc[s]] for s in schedule if pc[s] < len(schedule[s])}
    if stuck:
        waits = ", ".join(f"stage {s} at {a} (slot {pc[s]})" for s, a in sorted(stuck.items()))
        raise ScheduleError(f"schedule deadlocks: {waits}")
    return timeline


def validate_schedule(schedule: Schedule, stage_graph: StageGraph, num_microbatches: int, *, train: bool,
                      num_buffers: dict[int, int] | None = None) -> Timeline:
    """Check a schedule's structure and run it through :func:`simulate`.

    Checks, per stage: every micro-batch has one forward (and, when training, one backward after
    its forward: a ``B``, or an ``I`` followed by a ``W``); every forward is preceded by a receive from each predecessor and followed by a
    send to each successor (mirrored for backwards); communication only uses stage edges; and, if
    ``num_buffers`` is given, no two micro-batches that share a buffer (``mb % num_buffers``) are in
    flight at once. Returns the simulated timeline.
    """
    if sorted(schedule) != list(range(stage_graph.num_stages)):
        raise ScheduleError(f"schedule has stages {sorted(schedule)}, expected 0..{stage_graph.num_stages - 1}")
    for s, actions in schedule.items():
        _check_stage(s, actions, stage_graph, num_microbatches, train, (num_buffers or {}).get(s))
    return simulate(schedule)


def _check_stage(s: int, actions: list[Action], graph: StageGraph, num_mb: int, train: bool,
                 num_buffers: int | None) -> None:
    preds, succs = set(graph.preds(s)), set(graph.succs(s))
    where: dict[tuple, int] = {}
    for i, a in enumerate(actions):
        if a.stage_idx != s:
            raise ScheduleError(f"stage {s} slot {i} holds {a}, an action of stage {a.stage_idx}")
        if a.kind in (K.SEND_F, K.RECV_B) and a.peer not in succs:
            raise ScheduleError(f"stage {s} slot {i}: {a} but stage {a.peer} is not a successor of stage {s}")
        if a.kind in (K.RECV_F, K.SEND_B) and a.peer not in preds:
            raise ScheduleError(f"stage {s} slot {i}: {a} but stage {a.peer} is not a predecessor of stage {s}")
        key = (a.kind, a.mb_idx, a.peer)
        if key in where:
            raise ScheduleError(f"stage {s} runs {a} twice (slots {where[key]} and {i})")
        where[key] = i
    for j in range(num_mb):
        if (K.FORWARD, j, None) not in where:
            raise ScheduleError(f"stage {s} never runs {Action(s, K.FORWARD, j)}")
        if train:
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
        if train:
            # With a split backward, I is what receives and sends gradients; W follows it.
            b = where.get((K.BACKWARD, j, None), where.get((K.BACKWARD_INPUT, j, None)))
            if b < f:
                raise ScheduleError(f"stage {s} runs the backward of micro-batch {j} before its forward")
            for t in succs:
                if where.get((K.RECV_B, j, t), b + 1) > b:
                    raise ScheduleError(f"stage {s} runs {Action(s, K.BACKWARD, j)} before receiving its "
                                        f"gradient from stage {t}")
            for p in preds:
                if where.get((K.SEND_B, j, p), -1) < b:
                    raise ScheduleError(f"stage {s} does not send the gradient of micro-batch {j} to stage {p}")
    extra = sorted({a.mb_idx for a in actions if a.mb_idx is not None and not 0 <= a.mb_idx < num_mb})
    if extra:
        raise ScheduleError(f"stage {s} refers to micro-batches {extra} outside 0..{num_mb - 1}")
    if num_buffers:
        _check_buffers(s, actions, num_buffers)


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


def _check_buffers(s: int, actions: list[Action], num_buffers: int) -> None:
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.mb_idx is not None:
            first.setdefault(a.mb_idx, i)
            last[a.mb_idx] = i
    for j in first:
        for k in first:
            if j < k and j % num_buffers == k % num_buffers and first[k] <= last[j]:
                raise ScheduleError(f"stage {s}: micro-batches {j} and {k} share buffer {j % num_buffers} "
                                    f"while both are in flight; use more buffers")
