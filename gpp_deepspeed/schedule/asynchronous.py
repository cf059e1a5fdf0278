"""Asynchronous pipelines on a DAG of stages: PipeDream, PipeDream-2BW and PipeOptim.

Each is 1F1B without a flush: stage ``s`` runs ``lag(s) = depth(s) - 1`` warm-up forwards once,
then alternates ``F(j + lag)`` and ``B(j)`` for ever, over a stream of micro-batches numbered from
the last time the pipeline was empty. ``train_batch`` number ``k`` runs the slice of that program
that forwards micro-batches ``k*M .. k*M + M - 1`` (``M`` = gradient accumulation steps); the
backwards in it are those that follow these forwards, ``B(k*M - lag) .. B(k*M + M - 1 - lag)``.
``engine.flush()`` runs the drain, the last ``lag`` backwards. Weight semantics (one line each):

``pipedream``
    Weight stashing (PipeDream, SOSP'19, Sec. 3.3): a backward uses the weights its forward used;
    the stage updates after every backward with that micro-batch's gradient.
``2bw``
    Double-buffered weights (PipeDream-2BW, ICML'21, Sec. 3.1): every micro-batch of batch ``b``
    runs on ``W(b-1)``; after its last backward the stage updates once with the batch's mean
    gradient, ``W(b+1) = W(b) - lr * grad f(W(b-1))``; at most two stashed versions.
``pipeoptim``
    Weight prediction (PipeOptim, arXiv 2312.00839, Sec. IV): the forward of micro-batch ``j`` runs
    on ``W - lr * s * dW``, the optimizer's own prediction of the weights ``s`` updates later, ``s``
    = the updates the stage makes between ``F(j)`` and ``B(j)`` (``D - rank - 1`` on a chain); the
    backward differentiates that forward; the stage updates after every backward.

Weight versions are explicit actions whose micro-batch index names a version (the micro-batch
whose forward first runs on it): ``STASH v`` copies the stage's current weights into version
``v``, ``PREDICT v`` writes the prediction into it, and ``UPDATE v`` steps the optimizer with the
gradient accumulated on version ``v`` and frees it. A forward runs on the version made by the
latest ``STASH``/``PREDICT`` before it; a backward on its forward's version.

Messages never cross a ``train_batch`` boundary (``DeepSpeed`` aggregates the loss over the
pipeline between batches, a collective that a pending rendezvous send could block): a gradient
whose receiver runs its backward in a later batch than the sender is sent at the start of the
receiver's batch (:func:`defer_sends`). That loss aggregation also makes the stages meet once per
batch, so a steady batch (the pipeline full before and after it, :func:`steady_batch_idx`) costs
about ``M * (T_F + T_B) + (D - 1) * T_F``: the forward skew returns at every batch, the drain never.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import GPPConfigError, ScheduleError
from ..graph.stages import StageGraph
from .generators import add_load, add_send_recv
from .ir import Action, ActionKind as K, Schedule
from .lowering import add_release, group_for_rendezvous, order_transfers
from .validate import _check_buffers, _check_releases, _check_stage, simulate

__all__ = ["ASYNC_SCHEDULES", "is_async", "lag", "async_segment", "steady_batch_idx", "prediction_steps",
           "predicted_updates", "async_slots", "shift", "validate_async", "AsyncReport", "check_async_microbatches"]

ASYNC_SCHEDULES = ("pipedream", "2bw", "pipeoptim")


def is_async(name: str) -> bool:
    """True for the schedules that never drain between batches.

    >>> is_async("PipeDream"), is_async("1f1b")
    (True, False)
    """
    return name.lower() in ASYNC_SCHEDULES


def lag(stage_graph: StageGraph, stage_idx: int) -> int:
    """Warm-up forwards of a stage, and the backwards by which it trails its forwards: ``depth - 1``.

    >>> lag(StageGraph.chain(4), 0), lag(StageGraph.chain(4), 3)
    (3, 0)
    """
    return stage_graph.depth(stage_idx) - 1


def check_async_microbatches(stage_graph: StageGraph, num_microbatches: int, name: str) -> None:
    """2BW needs every stage to finish a batch's backwards before the next-but-one batch starts
    (at most two stashed versions): ``M >= depth - 1`` (the 2BW paper's ``m >= d``)."""
    need = max(lag(stage_graph, s) for s in range(stage_graph.num_stages))
    if name.lower() == "2bw" and num_microbatches < need:
        raise GPPConfigError(f'schedule "2bw" needs gradient_accumulation_steps >= {need} (the deepest stage\'s '
                             f"warm-up forwards), got {num_microbatches}")


def _forward(s: int, j: int, name: str, m: int, w: int) -> list[Action]:
    if name == "pipedream":
        return [Action(s, K.STASH, j), Action(s, K.FORWARD, j)]
    if name == "pipeoptim":
        return [Action(s, K.PREDICT, j), Action(s, K.FORWARD, j)]
    # 2bw: one version per batch, taken before the batch's first forward; on a stage without lag the
    # previous batch's update waits until then, so the version is W(b-1) and not W(b).
    if j % m:
        return [Action(s, K.FORWARD, j)]
    head = [Action(s, K.STASH, j)]
    if w == 0 and j >= m:
        head.append(Action(s, K.UPDATE, j - m))
    return head + [Action(s, K.FORWARD, j)]


def _backward(s: int, i: int, name: str, m: int, w: int) -> list[Action]:
    if name != "2bw":
        return [Action(s, K.BACKWARD, i), Action(s, K.UPDATE, i)]
    last_of_batch = i % m == m - 1
    return [Action(s, K.BACKWARD, i)] + ([Action(s, K.UPDATE, i - m + 1)] if last_of_batch and w > 0 else [])


def _compute(stage_graph: StageGraph, s: int, m: int, batch_idx: int, name: str, flush: bool) -> list[Action]:
    """Stage ``s``'s compute and weight actions of one batch (or of the flush after ``batch_idx``)."""
    w = lag(stage_graph, s)
    order: list[Action] = []
    if flush:
        n = batch_idx * m
        if name == "2bw" and w == 0 and n:
            return [Action(s, K.UPDATE, n - m)]
        for i in range(max(n - w, 0), n):
            order += _backward(s, i, name, m, w)
        return order
    for j in range(batch_idx * m, (batch_idx + 1) * m):
        order += _forward(s, j, name, m, w)
        if j - w >= 0:
            order += _backward(s, j - w, name, m, w)
    return order


def _segment_of(i: int, w: int, m: int, batch_idx: int, flush: bool) -> int:
    """The segment (batch number, or ``batch_idx`` for the flush after it) of ``B(i)`` on a stage of lag ``w``."""
    seg = (i + w) // m
    return min(seg, batch_idx) if flush else seg


def defer_sends(lowered: Schedule, stage_graph: StageGraph, m: int, batch_idx: int, *, flush: bool) -> Schedule:
    """Move every ``SEND_B`` to the segment where its receiver runs the matching ``RECV_B``.

    A sender of lag ``w_s`` runs ``B(i)`` in batch ``(i + w_s) // M``; its predecessor, of larger
    lag ``w_u``, receives in batch ``(i + w_u) // M``. Sends whose receive is in a later batch leave
    this batch; sends from earlier batches whose receive is in this one open it, in micro-batch
    order (the order of their channel).
    """
    out: Schedule = {}
    for s, actions in lowered.items():
        w_s = lag(stage_graph, s)
        kept = [a for a in actions if not (a.kind is K.SEND_B and _segment_of(a.mb_idx, lag(stage_graph, a.peer), m,
                                                                               batch_idx, flush) > batch_idx)]
        head = []
        for u in stage_graph.preds(s):
            w_u = lag(stage_graph, u)
            lo = batch_idx * m - w_u
            hi = batch_idx * m if flush else (batch_idx + 1) * m - w_u
            head += [Action(s, K.SEND_B, i, peer=u) for i in range(max(lo, 0), hi)
                     if _segment_of(i, w_s, m, batch_idx, flush) < batch_idx
                     and _segment_of(i, w_u, m, batch_idx, flush) == batch_idx]
        out[s] = sorted(head, key=lambda a: a.mb_idx) + kept
    return out


def _transfers(stage_graph: StageGraph, m: int, batch_idx: int, name: str, loading_stages: set[int],
               flush: bool) -> Schedule:
    """One segment with its transfers, deferred and grouped for rendezvous, without releases."""
    compute = {s: _compute(stage_graph, s, m, batch_idx, name, flush) for s in range(stage_graph.num_stages)}
    lowered = defer_sends(add_send_recv(add_load(compute, loading_stages=loading_stages), stage_graph), stage_graph,
                          m, batch_idx, flush=flush)
    grouped = group_for_rendezvous(lowered)
    try:
        simulate(grouped, mode="rendezvous")
        return grouped
    except ScheduleError:
        # A stage with no compute in the segment (a flush without lag) would post all its deferred
        # sends as one group, which waits on receives its peers post only after their own backward:
        # post the transfers one by one in the global order instead, which cannot deadlock.
        return order_transfers(lowered)


def async_segment(stage_graph: StageGraph, num_microbatches: int, batch_idx: int, *, name: str,
                  loading_stages: set[int], flush: bool = False) -> Schedule:
    """The lowered action lists of batch ``batch_idx`` since the pipeline was last empty, or, with
    ``flush``, of the drain after ``batch_idx`` batches. Micro-batch indices count from the last
    empty pipeline; buffer slots are ``mb % async_slots(...)``.

    Releases go after a micro-batch's last use in the whole program, which may lie batches later:
    they are placed on the program from this segment to the last one any of its micro-batches
    reaches (whether the batches after it or the flush, they hold the same uses).
    """
    name = name.lower()
    if name not in ASYNC_SCHEDULES:
        raise GPPConfigError(f'"{name}" is not an asynchronous schedule; valid: {list(ASYNC_SCHEDULES)}')
    m = num_microbatches
    ahead = [] if flush else range(batch_idx + 1, batch_idx + steady_batch_idx(stage_graph, m) + 1)
    window = [_transfers(stage_graph, m, batch_idx, name, loading_stages, flush)]
    window += [_transfers(stage_graph, m, k, name, loading_stages, False) for k in ahead]
    out: Schedule = {}
    for s in range(stage_graph.num_stages):
        program = [a for seg in window for a in seg[s]]
        released = add_release({s: program})[s]
        mine, seen = [], 0
        for a in released:   # keep this segment's actions and the releases that follow them
            if a.kind not in (K.RELEASE_IN, K.RELEASE_OUT):
                seen += 1
            if seen <= len(window[0][s]) and not (seen == 0):
                mine.append(a)
        out[s] = mine + [Action(s, K.WAIT_SENDS)]
    return out


def async_slots(stage_graph: StageGraph, num_microbatches: int) -> int:
    """Buffer slots of an asynchronous schedule, ``mb % slots``: a micro-batch is live from its
    forward's batch until its last deferred gradient send, less than ``M + deepest lag`` later."""
    return num_microbatches + 2 * max(stage_graph.depth(s) for s in range(stage_graph.num_stages)) + 1


def steady_batch_idx(stage_graph: StageGraph, num_microbatches: int) -> int:
    """A batch number from which every batch is the previous one shifted by ``M`` micro-batches
    (no warm-up forward and no deferred send from the warm-up left in it)."""
    deepest = max(lag(stage_graph, s) for s in range(stage_graph.num_stages))
    return -(-deepest // num_microbatches) + 1


def predicted_updates(stage_graph: StageGraph, stage_idx: int, mb_idx: int) -> int:
    """PipeOptim's ``s`` for micro-batch ``mb_idx`` on a stage: the updates the stage makes between
    its forward and its backward in 1F1B without flush, ``min(j, lag)`` (``D - rank - 1`` on a chain
    once the pipeline is full; :func:`validate_async` checks it against the program).

    >>> predicted_updates(StageGraph.chain(4), 0, 10), predicted_updates(StageGraph.chain(4), 0, 1)
    (3, 1)
    """
    return min(mb_idx, lag(stage_graph, stage_idx))


def shift(actions: list[Action], delta: int) -> list[Action]:
    """The same actions ``delta`` micro-batches later: batch ``k + d`` of a steady pipeline is batch
    ``k`` shifted by ``d * M`` (for ``k >= steady_batch_idx``; tested), and so is its flush.

    >>> shift([Action.parse("0F2"), Action.parse("0WAIT_SENDS")], 4)
    [0F6, 0WAIT_SENDS]
    """
    def moved(a: Action) -> Action:
        if a.kind is K.P2P:
            return Action.group(moved(op) for op in a.ops)
        return a if a.mb_idx is None else Action(a.stage_idx, a.kind, a.mb_idx + delta, a.peer)
    return [moved(a) for a in actions]


def prediction_steps(actions: list[Action]) -> dict[int, int]:
    """For each ``PREDICT v`` of a stage's program: the ``UPDATE`` actions between the forward that
    runs on version ``v`` and that forward's backward (PipeOptim's weight version difference ``s``).

    >>> from gpp_deepspeed.schedule.ir import Action as A
    >>> prediction_steps([A.parse(x) for x in "0PREDICT0 0F0 0PREDICT1 0F1 0B0 0UPDATE0 0B1 0UPDATE1".split()])
    {0: 0, 1: 1}
    """
    version: dict[int, int] = {}
    current = None
    updates = 0
    at_forward: dict[int, int] = {}
    steps: dict[int, int] = {}
    for a in actions:
        if a.kind is K.PREDICT:
            current = a.mb_idx
        elif a.kind is K.FORWARD:
            version[a.mb_idx] = current
            at_forward[a.mb_idx] = updates
        elif a.kind is K.BACKWARD and version.get(a.mb_idx) is not None:
            steps[version[a.mb_idx]] = updates - at_forward[a.mb_idx]
        elif a.kind is K.UPDATE:
            updates += 1
    return steps


@dataclass(frozen=True)
class AsyncReport:
    """What :func:`validate_async` found, per stage: the most weight versions stashed at once (the
    optimizer's own copy not counted) and the most micro-batches in flight."""

    peak_versions: dict[int, int]
    peak_in_flight: dict[int, int]


def validate_async(stage_graph: StageGraph, num_microbatches: int, *, name: str, loading_stages: set[int],
                   num_batches: int | None = None) -> AsyncReport:
    """Check an asynchronous schedule over ``num_batches`` batches and the flush after them.

    Every batch and the flush are simulated on their own (deadlock-free, and every message sent in
    a segment is received in it); their concatenation, per stage, must pass the synchronous checks
    (one forward and one backward per micro-batch, receives before compute, sends after) and the
    weight-version rules: a forward runs on a live version, a backward before its version's
    ``UPDATE``, every version is made once and updated once, after all its backwards.
    """
    check_async_microbatches(stage_graph, num_microbatches, name)
    if num_batches is None:
        num_batches = steady_batch_idx(stage_graph, num_microbatches) + 1
    segments = [async_segment(stage_graph, num_microbatches, k, name=name, loading_stages=loading_stages)
                for k in range(num_batches)]
    segments.append(async_segment(stage_graph, num_microbatches, num_batches, name=name,
                                  loading_stages=loading_stages, flush=True))
    for k, seg in enumerate(segments):
        try:
            simulate(seg, mode="rendezvous")
        except ScheduleError as exc:
            where = "the flush" if k == num_batches else f"batch {k}"
            raise ScheduleError(f'schedule "{name}", {where}: {exc}') from None
    versions, in_flight = {}, {}
    for s in range(stage_graph.num_stages):
        program = [a for seg in segments for a in seg[s]]
        data = [a for a in program if a.kind not in _WEIGHT_KINDS and a.kind is not K.WAIT_SENDS]
        _check_stage(s, data, stage_graph, num_batches * num_microbatches, True)
        _check_releases(s, data)
        slots = async_slots(stage_graph, num_microbatches)
        _check_buffers(s, data, {j: j % slots for a in data for j in a.mb_idxs})
        versions[s] = _check_versions(s, program)
        for v, steps in prediction_steps(program).items():
            if steps != predicted_updates(stage_graph, s, v):
                raise ScheduleError(f"stage {s}: version {v} meets {steps} updates before its backward, not "
                                    f"{predicted_updates(stage_graph, s, v)}")
        live = peak = 0
        for a in program:
            live += (a.kind is K.FORWARD) - (a.kind is K.BACKWARD)
            peak = max(peak, live)
        in_flight[s] = peak
    return AsyncReport(versions, in_flight)


_WEIGHT_KINDS = frozenset({K.STASH, K.PREDICT, K.UPDATE})


def _check_versions(s: int, program: list[Action]) -> int:
    alive: set[int] = set()
    made: set[int] = set()
    users: dict[int, set[int]] = {}
    version_of: dict[int, int] = {}
    backward_done: set[int] = set()
    current = None
    peak = 0
    for a in program:
        if a.kind in (K.STASH, K.PREDICT):
            if a.mb_idx in made:
                raise ScheduleError(f"stage {s} makes weight version {a.mb_idx} twice")
            made.add(a.mb_idx)
            alive.add(a.mb_idx)
            users[a.mb_idx] = set()
            current = a.mb_idx
            peak = max(peak, len(alive))
        elif a.kind is K.FORWARD:
            if current not in alive:
                raise ScheduleError(f"stage {s} runs {a} on no live weight version")
            version_of[a.mb_idx] = current
            users[current].add(a.mb_idx)
        elif a.kind is K.BACKWARD:
            backward_done.add(a.mb_idx)
            if version_of[a.mb_idx] not in alive:
                raise ScheduleError(f"stage {s} runs {a} after its weight version {version_of[a.mb_idx]} was updated")
        elif a.kind is K.UPDATE:
            if a.mb_idx not in alive or not users[a.mb_idx]:
                raise ScheduleError(f"stage {s} runs {a} on a version that is not live or has no forward")
            pending = sorted(users[a.mb_idx] - backward_done)
            if pending:
                raise ScheduleError(f"stage {s} runs {a} before the backwards of micro-batches {pending}")
            alive.discard(a.mb_idx)
    if alive:
        raise ScheduleError(f"stage {s} never updates weight versions {sorted(alive)} (the flush must drain them)")
    return peak
