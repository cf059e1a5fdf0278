"""The program a pipeline runs: every stage's lowered actions and the buffer slot of every
micro-batch, one :class:`Program` per ``train_batch`` for every schedule.

A schedule's compute order (its generator in :data:`~gpp_deepspeed.schedule.SCHEDULES`) goes
through the same lowering passes (:func:`~gpp_deepspeed.schedule.lowering.lower`) whatever the
schedule, synchronous, split backward or asynchronous, and its slots come from
:func:`~gpp_deepspeed.schedule.lowering.assign_buffers`. The engine executes a program's list for
its stage and nothing else; the validator, the simulator and the planner read the same object.

Glossary
--------
program
    Every stage's actions for one batch (or one asynchronous segment): loads, compute, grouped
    transfers, releases, weight-version actions and the epilogue, with the buffer slots.
segment
    One ``train_batch`` of an asynchronous schedule's never-draining program, or the drain
    after some batches (:class:`~gpp_deepspeed.schedule.ir.Segment`).

Representative use::

    programs = ProgramFactory(stage_graph, schedule="zb1")         # what the engine and the simulator ask
    program = programs.program(8, batch_idx=k)                     # the program of train_batch k
    program = build_program(stage_graph, 8, schedule="zb1")       # a synchronous batch
    validate_program(program, stage_graph)                         # NCCL-safe, buffers, releases
    print(program)                                                 # the golden-file form
    pipeline = AsyncProgram(stage_graph, 8, schedule="pipedream")  # batch(k) and flush(k)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import GPPConfigError, ScheduleError
from ..graph.stages import StageGraph
from .asynchronous import async_compute, check_async_microbatches, predicted_updates, prediction_steps, shift, \
    steady_batch_idx, steps_at_end
from .generators import forward_only
from .ir import Action, ActionKind as K, Schedule, Segment
from .lowering import BufferSlots, assign_buffers, lower, num_slots
from .greedy import Fold
from .registry import SCHEDULES, ScheduleSpec, get_schedule
from .virtual import schedule_in_flight
from .validate import Timeline, check_lists, check_weight_versions, simulate

__all__ = ["Program", "build_program", "default_fold", "check_fold", "build_schedule", "validate_program", "AsyncProgram", "AsyncReport",
           "validate_async", "ProgramFactory"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Program:
    """Every stage's actions for one batch, with the buffer slot of each micro-batch.

    ``slots[stage_idx][mb_idx]`` is the buffer the stage keeps the micro-batch's tensors in;
    ``segment`` is set for an asynchronous schedule (which batch, or the flush after how many).

    >>> print(build_program(StageGraph.chain(2), 1, schedule="1f1b", train=False))
    program "1f1b": 2 stages, 1 micro-batch, evaluation
    stage 0: 0LOAD0 0F0 0RELEASE_IN0 0SEND_F0@1 0RELEASE_OUT0 0WAIT_SENDS
      slots: 0:0
    stage 1: 1LOAD0 1RECV_F0@0 1WAIT_F0 1F0 1RELEASE_OUT0 1RELEASE_IN0 1WAIT_SENDS
      slots: 0:0
    """

    schedule: str
    num_microbatches: int
    train: bool
    actions: Schedule
    slots: BufferSlots
    segment: Segment | None = None
    layouts: bool = False
    """Every activation transfer is preceded by the transfer of its layout
    (:func:`~gpp_deepspeed.schedule.lowering.add_layouts`): ``dynamic_shape``, or a first batch."""
    predictions: dict[int, dict[int, int]] = field(default_factory=dict)
    """PipeOptim's ``s`` for every weight version the program predicts, ``predictions[stage][version]``:
    the updates the stage makes between the version's forward and its backward, what ``PREDICT``
    and ``PREDICT_INPLACE`` predict over (:meth:`AsyncProgram.validate` counts them on the program)."""
    fold: Fold | None = None
    """Several stages per rank (:mod:`.virtual`): ``actions`` is keyed by pipeline rank (the
    position in the fold), each list running the actions of that rank's stages; ``slots`` stays
    keyed by stage. ``None``: one stage per rank, ``actions`` keyed by stage."""

    @property
    def num_stages(self) -> int:
        return len(self.slots)

    def rank_of(self, stage_idx: int) -> int:
        """The pipeline rank (key of ``actions``) that runs ``stage_idx``."""
        return stage_idx if self.fold is None else self.fold.rank_of[stage_idx]

    def num_buffers(self, stage_idx: int) -> int:
        """Buffer slots the stage needs for this program."""
        return num_slots(self.slots[stage_idx])

    def __str__(self) -> str:
        mb = "micro-batch" if self.num_microbatches == 1 else "micro-batches"
        if self.segment is None:
            what = "training" if self.train else "evaluation"
        elif self.segment.flush:
            what = f"flush after {self.segment.batch_idx} batches"
        else:
            what = f"batch {self.segment.batch_idx}"
        lines = [f'program "{self.schedule}": {self.num_stages} stages, {self.num_microbatches} {mb}, {what}'
                 + (", with layouts" if self.layouts else "")
                 + ("" if self.fold is None else f", fold {list(self.fold.rank_of)}")]
        for s in sorted(self.actions):
            lines.append(f"{'stage' if self.fold is None else 'rank'} {s}: " + " ".join(str(a) for a in self.actions[s]))
            for t in ((s, ) if self.fold is None else self.fold.stages_of(s)):
                lines.append(("  slots: " if self.fold is None else f"  stage {t} slots: ")
                             + " ".join(f"{j}:{k}" for j, k in sorted(self.slots[t].items())))
        return "\n".join(lines)


def build_program(stage_graph: StageGraph, num_microbatches: int, *, schedule: str = "1f1b", train: bool = True,
                  duration: Callable[[Action], float] | None = None, layouts: bool = False,
                  fold: Fold | None = None, early: bool = True, max_in_flight=None) -> Program:
    """The program of one batch of a synchronous schedule (or of any schedule in evaluation,
    which runs forwards only). ``duration``: the compute times the program is made for (default
    unit ones): the order of a folded schedule made on a simulated clock (``zbv``:
    :func:`~gpp_deepspeed.schedule.greedy.rank_orders`) and the order of the transfers, when they
    must be reordered (:func:`~gpp_deepspeed.schedule.lowering.group_for_rendezvous`) or posted
    early.
    ``layouts``: every activation's layout is sent before it (``dynamic_shape``, a first batch).
    ``fold``: the ranks of the stages of a schedule of several stages per rank (default
    :func:`default_fold`); refused for the others. ``early``: receives are posted as soon as their
    message is sent and waited for at their use (:func:`~gpp_deepspeed.schedule.lowering.post_early`).
    ``max_in_flight``: the micro-batches each rank may hold in ``zbv``'s order (an int, or one per
    rank; default :func:`~gpp_deepspeed.schedule.greedy.fold_in_flight`); refused for the schedules
    whose order it cannot cap."""
    if num_microbatches < 1:
        raise GPPConfigError(f"need at least one micro-batch, got {num_microbatches}")
    spec = get_schedule(schedule)
    if spec.folded is not None or fold is not None:
        return _folded_program(stage_graph, num_microbatches, spec, fold, train=train, duration=duration,
                               layouts=layouts, early=early, max_in_flight=max_in_flight)
    schedule_in_flight(spec.name, max_in_flight, stage_graph.num_stages)   # refuses a cap: no order here takes one
    if train and spec.asynchronous:
        raise GPPConfigError(f'schedule "{spec.name}" is asynchronous: its batches are AsyncProgram(...).batch(k)')
    compute = spec.generator(stage_graph, num_microbatches) if train else forward_only(stage_graph, num_microbatches)
    actions = lower(compute, stage_graph, train=train, duration=duration, layouts=layouts, early=early)
    return Program(schedule=spec.name, num_microbatches=num_microbatches, train=train, actions=actions,
                   slots=assign_buffers(actions), layouts=layouts)


def default_fold(stage_graph: StageGraph, schedule: str) -> Fold:
    """The fold a schedule of several stages per rank runs when none is given: the V for
    ``"v"`` schedules, else two stages per rank in looped placement (Megatron's ``v = 2``)."""
    spec = get_schedule(schedule)
    n = stage_graph.num_stages
    if spec.folded is not None and spec.folded.fold == "v":
        if n % 2:
            raise GPPConfigError(f'schedule "{spec.name}" places two stages per rank in a V; {n} stages do not pair up')
        return Fold.v_shape(num_stages=n)
    return Fold.looped(num_stages=n, num_ranks=max(1, (n + 1) // 2))


def check_fold(fold: Fold, stage_graph: StageGraph, schedule: str) -> None:
    """Refuse, naming both, a fold the schedule cannot run: a schedule of one stage per rank with
    a fold that gives a rank several, a fold of another stage count, or a ``"v"`` schedule
    (ZB-V, DualPipeV) on a fold that does not give every rank two stages."""
    spec = get_schedule(schedule)
    if len(fold.rank_of) != stage_graph.num_stages:
        raise GPPConfigError(f"the fold {list(fold.rank_of)} places {len(fold.rank_of)} stages, the stage graph has "
                             f"{stage_graph.num_stages}")
    if spec.folded is None:
        if fold.num_ranks != len(fold.rank_of):
            raise GPPConfigError(f'schedule "{spec.name}" runs one stage per rank; the fold {list(fold.rank_of)} gives '
                                 f"a rank several: use a schedule of several stages per rank "
                                 f"({[n for n, x in SCHEDULES.items() if x.folded is not None]})")
        return
    if spec.folded.fold == "v":
        # ZB-V and DualPipeV pair two stages on every rank: the V by default, any pairing on a DAG
        # (the planner's fold search pairs branches; both orders are defined for any pairing).
        odd = [r for r in range(fold.num_ranks) if len(fold.stages_of(r)) != 2]
        if odd:
            raise GPPConfigError(f'schedule "{spec.name}" places two stages on every rank (a V by default: rank r '
                                 f"holds stages r and 2R-1-r); the fold {list(fold.rank_of)} gives rank {odd[0]} "
                                 f"stages {list(fold.stages_of(odd[0]))}")


def _folded_program(stage_graph: StageGraph, num_microbatches: int, spec: ScheduleSpec, fold: Fold | None, *,
                    train: bool, duration, layouts: bool, early: bool = True, max_in_flight=None) -> Program:
    """The program of a schedule of several stages per rank: each rank's one list across its
    stages (:func:`~gpp_deepspeed.schedule.virtual.fold_program`), keyed by rank."""
    from .virtual import fold_program, rank_orders

    fold = fold or default_fold(stage_graph, spec.name)
    check_fold(fold, stage_graph, spec.name)
    if spec.folded is None:                  # a one-stage-per-rank schedule on a permuted fold
        raise GPPConfigError(f'schedule "{spec.name}" runs one stage per rank without a fold')
    caps = schedule_in_flight(spec.name, max_in_flight, fold.num_ranks)   # checked in evaluation too
    orders = (spec.folded.orders(stage_graph, num_microbatches, fold, duration=duration, max_in_flight=caps) if train
              else rank_orders(stage_graph, num_microbatches, fold, split_backward=False))
    actions = fold_program(stage_graph, num_microbatches, fold, orders, duration=duration, train=train,
                           layouts=layouts, early=early)
    per_stage: dict[int, list[Action]] = {s: [] for s in range(stage_graph.num_stages)}
    for r in sorted(actions):             # a group's ops belong to the stages they name, in order
        for op in (op for a in actions[r] for op in a.parts):
            per_stage[op.stage_idx].append(op)
    return Program(schedule=spec.name, num_microbatches=num_microbatches, train=train, actions=actions,
                   slots=assign_buffers(per_stage), layouts=layouts, fold=fold)


def build_schedule(stage_graph: StageGraph, num_microbatches: int, *, name: str = "1f1b",
                   train: bool = True) -> Schedule:
    """The action lists of :func:`build_program` (what tests and pictures read)."""
    return build_program(stage_graph, num_microbatches, schedule=name, train=train).actions


def validate_program(program: Program, stage_graph: StageGraph, *, mode: str = "rendezvous") -> Timeline:
    """Check a synchronous program (structure, releases, buffer slots:
    :func:`~gpp_deepspeed.schedule.validate.check_lists`) and simulate it in ``mode``."""
    if program.fold is not None:
        from .virtual import validate_folded

        validate_folded(program.actions, stage_graph, program.num_microbatches, program.fold, train=program.train,
                        layouts=program.layouts)
        return simulate(program.actions, mode=mode)
    check_lists(program.actions, stage_graph, program.num_microbatches, train=program.train, slots=program.slots,
                layouts=program.layouts)
    return simulate(program.actions, mode=mode)


@dataclass(frozen=True)
class AsyncReport:
    """What :meth:`AsyncProgram.validate` found, per stage: the most weight versions stashed at
    once (the optimizer's own copy not counted) and the most micro-batches in flight."""

    peak_versions: dict[int, int]
    peak_in_flight: dict[int, int]


class AsyncProgram:
    """The never-draining program of an asynchronous schedule, as one :class:`Program` per
    ``train_batch`` (:meth:`batch`) and per drain (:meth:`flush`).

    Every segment goes through the same lowering as a synchronous batch, with the batches after it
    in view (its releases may lie there). Buffer slots are assigned as the program runs: a
    micro-batch keeps its slot across batch boundaries until its last release. From
    :func:`~gpp_deepspeed.schedule.asynchronous.steady_batch_idx` on, every batch is the one before
    shifted by ``M`` micro-batches; once the slots a stage holds at a batch boundary repeat
    (shifted) too, the stage's batch ``k + periods[s]`` is its batch ``k`` shifted, so a program of
    any length is a few batches made once. (Slots rotate: a stage holding ``d`` micro-batches
    across a boundary cannot give micro-batch ``j + M`` the slot of ``j`` while both live.)

    >>> pipeline = AsyncProgram(StageGraph.chain(2), 1, schedule="pipedream")
    >>> pipeline.periods, [pipeline.batch(k).slots[0] for k in (5, 6)]
    ({0: 2, 1: 1}, [{4: 0, 5: 1}, {5: 1, 6: 0}])
    """

    def __init__(self, stage_graph: StageGraph, num_microbatches: int, *, schedule: str, layouts: bool = False,
                 early: bool = True):
        spec = get_schedule(schedule)
        if not spec.asynchronous:
            raise GPPConfigError(f'"{spec.name}" is not an asynchronous schedule')
        check_async_microbatches(stage_graph, num_microbatches, spec.weights, name=spec.name)
        self.spec, self.stage_graph, self.num_microbatches = spec, stage_graph, num_microbatches
        self.layouts = layouts   # every batch and flush sends each activation's layout before it
        self.early = early       # receives posted early, waited for at their use (lowering.post_early)
        self._steady = steady_batch_idx(stage_graph, num_microbatches)
        self._lowered: dict[tuple[int, bool], Schedule] = {}
        self._batches: list[Program] = []
        self._held: list[BufferSlots] = []     # slots still held after each batch
        self._flushes: dict[tuple[int, int], tuple[list[Action], dict[int, int]]] = {}
        self.first_periodic: dict[int, int] = {}
        self.periods: dict[int, int] = {}
        self._unroll()

    def batch(self, batch_idx: int) -> Program:
        """The program of ``train_batch`` number ``batch_idx`` since the pipeline was last empty."""
        if batch_idx < len(self._batches):
            return self._batches[batch_idx]
        actions, slots = {}, {}
        for s in range(self.stage_graph.num_stages):
            rep = self._representative(s, batch_idx)
            delta = (batch_idx - rep) * self.num_microbatches
            actions[s] = shift(self._batches[rep].actions[s], delta)
            slots[s] = {j + delta: slot for j, slot in self._batches[rep].slots[s].items()}
        return self._program(actions, Segment(batch_idx, self.num_microbatches), slots)

    def flush(self, num_batches: int) -> Program:
        """The program that drains the pipeline after ``num_batches`` batches (at least one)."""
        if num_batches < 1:
            raise ScheduleError("an empty pipeline has nothing to flush")
        actions, slots = {}, {}
        for s in range(self.stage_graph.num_stages):
            rep = self._representative(s, num_batches)
            if (s, rep) not in self._flushes:
                lists = {s: self._lists(rep, flush=True)[s]}
                self._flushes[(s, rep)] = lists[s], assign_buffers(lists, live={s: self._held[rep - 1][s]})[s]
            delta = (num_batches - rep) * self.num_microbatches
            stage_actions, slot_of = self._flushes[(s, rep)]
            actions[s] = shift(stage_actions, delta)
            slots[s] = {j + delta: slot for j, slot in slot_of.items()}
        return self._program(actions, Segment(num_batches, self.num_microbatches, flush=True), slots)

    def num_buffers(self, stage_idx: int) -> int:
        """Buffer slots the stage needs over the whole program."""
        flushes = [self.flush(k) for k in range(1, len(self._batches) + 1)]
        return max(p.num_buffers(stage_idx) for p in [*self._batches, *flushes])

    def validate(self, num_batches: int | None = None) -> AsyncReport:
        """Check ``num_batches`` batches and the flush after them (by default enough to cover the
        repeating part of every stage's program and its first repetition).

        Every batch and the flush are simulated on their own in rendezvous mode (deadlock-free
        under NCCL, and every message sent in a segment is received in it); their concatenation,
        per stage, must pass the synchronous checks (one forward and one backward per micro-batch,
        receives before compute, sends after, releases after the last use, no two live
        micro-batches in one slot; a micro-batch keeps its slot across batches) and the
        weight-version rules (:func:`~gpp_deepspeed.schedule.validate.check_weight_versions`), and
        PipeOptim's predictions must span the updates the program makes.
        """
        n = num_batches if num_batches is not None else len(self._batches) + max(self.periods.values())
        segments = [self.batch(k) for k in range(n)] + [self.flush(n)]
        for k, program in enumerate(segments):
            try:
                simulate(program.actions, mode="rendezvous")
            except ScheduleError as exc:
                where = "the flush" if k == n else f"batch {k}"
                raise ScheduleError(f'schedule "{self.spec.name}", {where}: {exc}') from None
        versions, in_flight = {}, {}
        data, slots = {}, {}
        for s in range(self.stage_graph.num_stages):
            program = [a for seg in segments for a in seg.actions[s]]
            data[s] = [a for a in program if all(op.kind.spec.on_micro_batch for op in a.parts)]
            slots[s] = _one_slot_each(s, segments)
            versions[s] = check_weight_versions(s, program, frozen=s in self.stage_graph.frozen)
            _check_predictions(s, program, {v: n for seg in segments for v, n in seg.predictions.get(s, {}).items()})
            live = peak = 0
            for a in program:
                live += (a.kind is K.FORWARD) - (a.kind is K.BACKWARD)
                peak = max(peak, live)
            in_flight[s] = peak
        check_lists(data, self.stage_graph, n * self.num_microbatches, train=True, slots=slots, layouts=self.layouts)
        return AsyncReport(versions, in_flight)

    # -- making the batches --------------------------------------------------------------------------

    def _lists(self, batch_idx: int, *, flush: bool = False) -> Schedule:
        """The lowered lists of a batch (or of the flush after ``batch_idx`` batches); from the
        steady batch on, those of the steady batch shifted."""
        key = (min(batch_idx, self._steady), flush)
        if key not in self._lowered:
            segment = Segment(key[0], self.num_microbatches, flush)
            ahead = [] if flush else [self._compute(Segment(k, self.num_microbatches))
                                      for k in range(key[0] + 1, key[0] + self._steady + 1)]
            self._lowered[key] = lower(self._compute(segment), self.stage_graph, train=True, segment=segment,
                                       ahead=ahead, step=steps_at_end(segment, self.spec.weights),
                                       layouts=self.layouts, early=self.early)
        delta = (batch_idx - key[0]) * self.num_microbatches
        return {s: shift(actions, delta) for s, actions in self._lowered[key].items()}

    def _compute(self, segment: Segment) -> Schedule:
        return async_compute(self.stage_graph, segment, rule=self.spec.weights)

    def _program(self, actions: Schedule, segment: Segment, slots: BufferSlots) -> Program:
        predictions = {s: {a.mb_idx: predicted_updates(self.stage_graph, s, a.mb_idx) for a in stage_actions
                           if a.kind.spec.predicts} for s, stage_actions in actions.items()}
        return Program(schedule=self.spec.name, num_microbatches=self.num_microbatches, train=True, actions=actions,
                       slots=slots, segment=segment, layouts=self.layouts,
                       predictions={s: p for s, p in predictions.items() if p})

    def _unroll(self) -> None:
        """Make batches until the slots every stage holds at a boundary repeat (shifted): sets
        each stage's first batch of its repeating part and its period, in batches."""
        m, stages = self.num_microbatches, range(self.stage_graph.num_stages)
        held: BufferSlots = {s: {} for s in stages}
        seen: dict[int, dict[tuple, int]] = {s: {} for s in stages}
        for k in range(self._steady + 256):
            actions = self._lists(k)
            later = [self._lists(j) for j in range(k + 1, k + self._steady + 1)]
            kept = {s: {j for lists in later for a in lists[s] for j in a.buffer_mbs} for s in stages}
            slots = assign_buffers(actions, live=held, kept=kept)
            self._batches.append(self._program(actions, Segment(k, m), slots))
            held = {s: {j: slot for j, slot in slots[s].items() if j in kept[s]} for s in stages}
            self._held.append(held)
            if k + 1 < self._steady:  # from batch k + 1 = steady on, every batch has the same shape
                continue
            for s in stages:
                key = tuple(sorted((j - (k + 1) * m, slot) for j, slot in held[s].items()))
                if s not in self.periods and key in seen[s]:
                    self.first_periodic[s], self.periods[s] = seen[s][key] + 1, k - seen[s][key]
                seen[s].setdefault(key, k)
            if len(self.periods) == len(stages):
                self.first_periodic = dict(sorted(self.first_periodic.items()))
                self.periods = dict(sorted(self.periods.items()))
                return
        raise ScheduleError(f'schedule "{self.spec.name}": the buffer slots never repeat')  # finite states: cannot

    def _representative(self, stage_idx: int, batch_idx: int) -> int:
        first, period = self.first_periodic[stage_idx], self.periods[stage_idx]
        return batch_idx if batch_idx < first else first + (batch_idx - first) % period


def _check_predictions(s: int, program: list[Action], carried: dict[int, int]) -> None:
    """The prediction count the segments carry for each weight version of stage ``s`` is the number
    of updates the whole program makes between that version's forward and its backward."""
    counted = prediction_steps(program)
    for v in sorted(set(counted) | set(carried)):
        if counted.get(v) != carried.get(v):
            raise ScheduleError(f"stage {s}: version {v} meets {counted.get(v)} updates before its backward, but the "
                                f"program predicts over {carried.get(v)}")


def _one_slot_each(s: int, segments: list[Program]) -> dict[int, int]:
    """A stage's slot of every micro-batch over the segments, checking that none changes slot."""
    slot_of: dict[int, int] = {}
    for program in segments:
        for j, slot in program.slots[s].items():
            if slot_of.setdefault(j, slot) != slot:
                raise ScheduleError(f"stage {s}: micro-batch {j} moves from buffer slot {slot_of[j]} to {slot} "
                                    f"between batches")
    return slot_of


def validate_async(stage_graph: StageGraph, num_microbatches: int, *, schedule: str,
                   num_batches: int | None = None, layouts: bool = False) -> AsyncReport:
    """Check an asynchronous schedule (:meth:`AsyncProgram.validate`)."""
    return AsyncProgram(stage_graph, num_microbatches, schedule=schedule, layouts=layouts).validate(num_batches)


class ProgramFactory:
    """Every program one pipeline runs under one schedule, made (and with ``validate`` checked)
    once per shape: the one place that tells a synchronous schedule's batches
    (:func:`build_program`) from an asynchronous schedule's segments (:class:`AsyncProgram`). The
    engine asks it for the program of each ``train_batch``, evaluation and flush; the simulator for
    the batch it prices.

    ``duration``: the compute times the synchronous programs are made for (:func:`build_program`;
    the engine's come from ``graph_pipeline.stage_times`` or the plan's ``stage_times``, the same
    on every rank, so every rank builds the same order); ``max_in_flight`` likewise caps ``zbv``'s
    order (``graph_pipeline.max_in_flight``, or the plan's).

    Layouts: a synchronous batch sends them when asked (a first batch, ``dynamic_shape``); an
    asynchronous schedule sends them in every batch and flush, because its batches share buffer
    slots across their boundaries, so the first cannot be lowered apart from the others (a
    static-shape pipeline pays one small header per activation message).

    >>> programs = ProgramFactory(StageGraph.chain(2), schedule="pipeoptim")
    >>> p = programs.program(2, batch_idx=1)
    >>> p.segment, p.layouts, p.predictions
    (Segment(batch_idx=1, num_microbatches=2, flush=False), True, {0: {2: 1, 3: 1}, 1: {2: 0, 3: 0}})
    >>> programs.program(2, train=False).layouts
    False
    """

    def __init__(self, stage_graph: StageGraph, *, schedule: str, validate: bool = False, fold: Fold | None = None,
                 early: bool = True, duration: Callable[[Action], float] | None = None, max_in_flight=None):
        self.spec = get_schedule(schedule)
        self.stage_graph, self.validate, self.early, self.duration = stage_graph, validate, early, duration
        self.max_in_flight = max_in_flight
        if fold is not None:
            check_fold(fold, stage_graph, self.spec.name)
        elif self.spec.folded is not None:
            fold = default_fold(stage_graph, self.spec.name)
        self.fold = fold   # several stages per rank: every program is keyed by rank (Program.fold)
        # A cap the schedule cannot take is refused now, on every rank alike, not at the first batch.
        schedule_in_flight(self.spec.name, max_in_flight, fold.num_ranks if fold else stage_graph.num_stages)
        self._batches: dict[tuple[int, bool, bool], Program] = {}
        self._pipelines: dict[int, AsyncProgram] = {}
        self._reports: dict[int, AsyncReport] = {}
        self._full: int | None = None   # micro-batches per batch of the asynchronous pipeline last asked for

    def program(self, num_microbatches: int, *, train: bool = True, batch_idx: int | None = None,
                flush: bool = False, layouts: bool = False) -> Program:
        """The program of a synchronous batch (``train``, or evaluation under any schedule), or of
        an asynchronous schedule's batch ``batch_idx`` since the pipeline was last empty (default:
        the steady batch, what every batch but the first few costs), or with ``flush`` the drain
        after ``batch_idx`` batches. ``layouts``: a synchronous batch sends every activation's
        layout before it."""
        if not (train and self.spec.asynchronous):
            key = (num_microbatches, train, layouts)
            if key not in self._batches:
                program = build_program(self.stage_graph, num_microbatches, schedule=self.spec.name, train=train,
                                        layouts=layouts, fold=self.fold, early=self.early, duration=self.duration,
                                        max_in_flight=self.max_in_flight)
                if self.validate:
                    validate_program(program, self.stage_graph)
                self._batches[key] = program
            return self._batches[key]
        if batch_idx is None:
            batch_idx = steady_batch_idx(self.stage_graph, num_microbatches)
        if (batch_idx or flush) and self._full not in (None, num_microbatches):
            raise GPPConfigError(f'schedule "{self.spec.name}": the number of micro-batches changed from '
                                 f"{self._full} to {num_microbatches} while the pipeline is full; call engine.flush() "
                                 "first")
        self._full = num_microbatches
        pipeline = self.pipeline(num_microbatches)
        return pipeline.flush(batch_idx) if flush else pipeline.batch(batch_idx)

    def pipeline(self, num_microbatches: int) -> AsyncProgram:
        """The asynchronous schedule's never-draining program with ``num_microbatches`` per batch."""
        if num_microbatches not in self._pipelines:
            self._pipelines[num_microbatches] = AsyncProgram(self.stage_graph, num_microbatches,
                                                             schedule=self.spec.name, layouts=True,
                                                             early=self.early)
            if self.validate:
                self.report(num_microbatches)
        return self._pipelines[num_microbatches]

    def report(self, num_microbatches: int) -> AsyncReport:
        """What :meth:`AsyncProgram.validate` finds on the asynchronous program (checked once)."""
        if num_microbatches not in self._reports:
            self._reports[num_microbatches] = self.pipeline(num_microbatches).validate()
        return self._reports[num_microbatches]
