"""The stages of one rank: a room per stage, and the one the engine runs an action in.

With several stages per rank (virtual stages: the schedules ``"interleaved"`` and ``"zbv"``,
:mod:`gpp_deepspeed.schedule.virtual`) a rank runs one list of actions across its stages, each
action naming its stage. :class:`RankStages` holds one :class:`StageRoom` per stage of this rank,
what is the stage's own: its :class:`~gpp_deepspeed.graph.stages.StageSpec`, its buffers
(:class:`~.buffers.StageBuffers`, slots as the program gives them to that stage), its edges
(:class:`~.transfers.StageTransfers`) and whether it is frozen. Before each action the schedule
calls :meth:`RankStages.enter` with the action's stage, which points the engine at that room
(``engine.stage``, ``engine.spec``, ``engine.pipe_buffers``) and the module at that stage's layers
(:meth:`~.module.GraphPipelineModule.select`), so DeepSpeed's forward and backward, the loss and
the handlers run unchanged on the stage the program names. With one stage per rank there is one
room and entering it changes nothing.

What is the rank's, not a stage's:

* the transport: a transfer action of a rank holding several stages may group several stages'
  transfers, posted as one batch in program order (:meth:`RankStages.run`); a receive the program
  waits for later (``WAIT_F``/``WAIT_B``: :func:`~gpp_deepspeed.schedule.ir.waited`) stays posted
  until that wait (:meth:`RankStages.complete`), which stores what it brought;
* the hand-overs (``HAND_F``, ``HAND_B``) between two of its stages, a local move of tensors
  (:meth:`RankStages.hand_over`);
* the data: each ``LOAD`` of a stage takes the next micro-batch of that stage, and the rank reads
  each micro-batch from the data iterator once, whichever of its stages loads it first
  (:meth:`RankStages.next_batch`).

Between schedules (``entered`` is ``None``) the engine's questions are the rank's: it reads the
batch if any of its stages does, it is the last stage if it holds the output stage.

Representative use::

    rooms = RankStages(engine, transport)
    rooms.enter(2); engine._exec_forward_pass(slot)   # what GraphPipeSchedule does per action
    rooms.run([(K.SEND_F, 0, 3, 2), (K.RECV_B, 1, 1, 0)])
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import GPPConfigError, PartitionError, ScheduleError
from ..schedule.greedy import Fold
from ..schedule.ir import ActionKind as K
from . import compat
from .buffers import StageBuffers
from .transfers import StageTransfers

__all__ = ["StageRoom", "RankStages", "check_folding", "resolve_fold", "set_plain"]


def set_plain(module, **values) -> None:
    """Set plain attributes (no parameter, module or tensor) of an ``nn.Module`` past
    ``nn.Module.__setattr__``'s registry checks, which cost microseconds a name: a folded rank
    switches its engine and module to another stage around every action."""
    for name, value in values.items():
        object.__setattr__(module, name, value)


@dataclass
class StageRoom:
    """What one stage of this rank owns."""

    stage: int
    spec: object
    buffers: StageBuffers
    transfers: StageTransfers
    frozen: bool


class RankStages:
    """This rank's stages (module docstring); ``engine.rooms``."""

    def __init__(self, engine, transport):
        module, graph = engine.module, engine.stage_graph
        self.engine, self.transport = engine, transport
        self.stages: tuple[int, ...] = module.stages
        self.rooms: dict[int, StageRoom] = {}
        for i, s in enumerate(self.stages):
            spec = module.partition.stages[s]
            buffers = StageBuffers(engine.pipe_buffers if i == 0 else None, num_slots=engine.num_pipe_buffers)
            transfers = StageTransfers(graph, engine.placement, stage_idx=s, replica=engine.grid.replica_id,
                                       rank_idx=engine.grid.stage_idx, out_ports=spec.out_ports, transport=transport,
                                       tp_group=engine.grid.get_slice_parallel_group(), tp_leader=engine.grid.tp_leader)
            self.rooms[s] = StageRoom(s, spec, buffers, transfers, frozen=s in graph.frozen)
        self.entered: int | None = None
        # Receives posted, waited for later: (stage, "F" | "B", slot) -> [(messages, requests, stores)].
        self.posted: dict[tuple[int, str, int], list[tuple[list, list, list]]] = {}
        self.output = graph.output_stage in self.rooms
        self.loads = any(self.rooms[s].spec.loads for s in self.stages)
        self._loading = [s for s in self.stages if s in graph.loading]
        self._taken = {s: 0 for s in self._loading}   # micro-batches each loading stage has taken
        self._read: list = []                          # micro-batches read, not yet taken by every stage
        self._first_read = 0                           # the index of _read[0]
        self._point(self.stages[0])

    def enter(self, stage: int | None) -> None:
        """Run what follows on ``stage`` (``None``: the schedule is over, the rank's questions)."""
        if stage is not None and stage != self.engine.stage:
            self._point(stage)
        self.entered = stage

    def _point(self, stage: int) -> None:
        room, engine = self.rooms[stage], self.engine
        set_plain(engine, stage=stage, spec=room.spec, pipe_buffers=room.buffers)
        engine.module.select(stage, frozen=room.frozen)

    def is_first(self) -> bool:
        """Reads graph inputs from the batch: the entered stage, or between schedules any of the rank's."""
        return bool(self.engine.spec.loads) if self.entered is not None else self.loads

    def is_last(self) -> bool:
        """The output stage: the entered stage is, or between schedules the rank holds it."""
        if self.entered is not None:
            return self.entered == self.engine.stage_graph.output_stage
        return self.output

    def reserve(self, num_slots: int) -> None:
        """Every room has ``num_slots`` buffer slots (DeepSpeed's ``_reserve_pipe_buffers``, per room)."""
        for room in self.rooms.values():
            for values in room.buffers.values():
                values.extend([None] * (num_slots - len(values)))
        self.engine.num_pipe_buffers = max(self.engine.num_pipe_buffers, num_slots)

    # -- the rank's own work --------------------------------------------------------------------

    def run(self, ops) -> None:
        """One transfer action: every ``(kind, slot, peer, stage, deferred)`` of ``ops`` posted as one
        batch, in program order (messages between two ranks match in posting order); the receives
        not ``deferred`` completed and stored before it returns, the others at their wait
        (:meth:`complete`)."""
        sends, recvs, parts = [], [], []
        for kind, slot, peer, stage, deferred in ops:
            room = self.rooms[stage]
            mine, stores = [], []
            room.transfers.prepare(kind, slot, peer, room.buffers, sends, mine, stores)
            recvs += mine
            if stores:
                parts.append((stage, (stage, kind.spec.message, slot) if deferred else None, mine, stores))
        requests = iter(self.transport.start(sends, recvs))
        now: dict[int, tuple[list, list, list]] = {}   # stage -> its receives completed here
        for stage, key, mine, stores in parts:
            entry = (mine, [next(requests) for _ in mine], stores)
            if key is not None:
                self.posted.setdefault(key, []).append(entry)
                continue
            whole = now.setdefault(stage, ([], [], []))
            for into, part in zip(whole, entry):
                into += part
        for stage, entry in now.items():
            self._complete(stage, *entry)

    def complete(self, stage: int, message: str, buffer_id: int) -> None:
        """``WAIT_F`` / ``WAIT_B``: wait for the receives of ``stage``'s micro-batch in slot
        ``buffer_id`` that earlier transfer actions posted (``message``: ``"F"`` activations, ``"B"``
        gradients), then store what they brought."""
        for mine, requests, stores in self.posted.pop((stage, message, buffer_id), ()):
            self._complete(stage, mine, requests, stores)

    def _complete(self, stage: int, mine: list, requests: list, stores: list) -> None:
        self.transport.finish(mine, requests, stage=stage)   # a timeout names the stage that waited
        transfers = self.rooms[stage].transfers
        transfers.broadcast(stores)   # under TP: to the leader's TP peers
        StageTransfers.store(stores)

    def hand_over(self, kind, stage: int, buffer_id: int, peer: int, peer_buffer_id: int) -> None:
        """``HAND_F``: ``stage`` takes ``peer``'s outputs on their edge as received tensors;
        ``HAND_B``: ``stage`` adds the input gradients ``peer`` computed for them to its output
        gradients. The tensors stay on the rank (detached activations: each stage's backward is
        its own autograd pass, as across ranks)."""
        me, other = self.rooms[stage], self.rooms[peer]
        if kind is K.HAND_F:
            flat, arity = other.transfers.edge_outputs(other.buffers, peer_buffer_id, stage)
            me.transfers.take_activations(me.buffers, buffer_id, peer, flat, arity)
        else:
            grads = other.transfers.input_grads(other.buffers, peer_buffer_id, stage)
            me.transfers.take_grads(me.buffers, buffer_id, peer, grads)

    def next_batch(self):
        """The entered stage's next micro-batch from the data iterator, read once per rank."""
        if len(self._loading) <= 1:
            return compat.next_batch(self.engine)
        stage = self.engine.stage
        idx = self._taken[stage]
        self._taken[stage] += 1
        while self._first_read + len(self._read) <= idx:
            self._read.append(compat.next_batch(self.engine))
        batch = self._read[idx - self._first_read]
        while self._read and min(self._taken.values()) > self._first_read:
            self._read.pop(0)
            self._first_read += 1
        return batch


def check_folding(spec, module, gpp_config, config_class=None) -> None:
    """Refuse, naming the setting, before any communication, what several stages per rank cannot
    run or what does not agree: the schedule and the module's fold, the config's
    ``stages_per_rank`` / ``fold`` and the module's, ZeRO-3."""
    fold = tuple(getattr(getattr(module, "placement", None), "fold", ()) or ())
    folded = spec.folded is not None
    names = "GraphPipelineModule(..., stages_per_rank=v) or fold=[...]"
    if folded and not fold:
        raise GPPConfigError(f'graph_pipeline.schedule "{spec.name}" runs several stages per rank, but the module holds '
                             f"one per rank: build it with {names} (num_stages = v x pipeline ranks)")
    if not fold:
        if gpp_config.stages_per_rank != 1 or gpp_config.fold is not None:
            raise GPPConfigError("graph_pipeline.stages_per_rank / fold ask for several stages per rank, but the "
                                 f"module holds one per rank: build it with {names} too")
        return
    if not folded:
        raise GPPConfigError(f'graph_pipeline.schedule "{spec.name}" runs one stage per rank, but the module holds '
                             f"several per rank (fold {list(fold)}): use schedule \"interleaved\" or \"zbv\"")
    from ..schedule.program import check_fold

    check_fold(Fold(fold), module.partition.stage_graph, spec.name)
    num_ranks = max(fold) + 1
    wanted = {"looped": Fold.looped(num_stages=len(fold), num_ranks=num_ranks).rank_of,
              "v": Fold.v_shape(num_stages=len(fold)).rank_of if len(fold) % 2 == 0 else None
              }.get(gpp_config.fold, gpp_config.fold) if isinstance(gpp_config.fold, str) else gpp_config.fold
    if gpp_config.fold is not None and tuple(wanted or ()) != fold:
        raise GPPConfigError(f"graph_pipeline.fold {gpp_config.fold!r} is not the module's fold {list(fold)}")
    if gpp_config.stages_per_rank != 1 and gpp_config.stages_per_rank * num_ranks != len(fold):
        raise GPPConfigError(f"graph_pipeline.stages_per_rank {gpp_config.stages_per_rank} does not match the module, "
                             f"which holds {len(fold)} stages on {num_ranks} pipeline ranks (fold {list(fold)})")
    if config_class is not None and config_class.zero_optimization_stage == 3:
        raise GPPConfigError(f'graph_pipeline.schedule "{spec.name}" (several stages per rank) does not run '
                             '"zero_optimization.stage": 3 (its hooks gather and release one stage\'s parameters per '
                             "pass); use stage 1 or 2")


def resolve_fold(fold, stages_per_rank: int, num_stages: int | None, world_size: int) -> tuple[int, ...]:
    """The pipeline rank of every stage (empty: one stage per rank), checked before any
    communication: ``fold`` a list, ``"looped"`` or ``"v"``, else looped when ``stages_per_rank > 1``."""
    if not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise PartitionError(f"stages_per_rank must be a positive integer, got {stages_per_rank!r}")
    if fold is None and stages_per_rank == 1:
        return ()
    if fold is not None and not isinstance(fold, str):
        rank_of = tuple(fold)
    else:
        kind = fold or "looped"
        per_rank = 2 if kind == "v" else stages_per_rank
        if kind not in ("looped", "v") or (kind == "v" and stages_per_rank not in (1, 2)):
            raise PartitionError(f'fold must be "looped", "v" (two stages per rank) or the pipeline rank of every '
                                 f"stage, got {fold!r} with stages_per_rank={stages_per_rank}")
        total = num_stages if num_stages is not None else per_rank * world_size
        if total % per_rank:
            raise PartitionError(f"num_stages ({total}) must be stages_per_rank ({per_rank}) x pipeline ranks")
        try:
            rank_of = (Fold.v_shape(num_stages=total) if kind == "v"
                       else Fold.looped(num_stages=total, num_ranks=total // per_rank)).rank_of
        except ScheduleError as exc:
            raise PartitionError(str(exc)) from None
    try:
        Fold(rank_of)
    except ScheduleError as exc:
        raise PartitionError(str(exc)) from None
    if num_stages is not None and len(rank_of) != num_stages:
        raise PartitionError(f"the fold {list(rank_of)} places {len(rank_of)} stages, num_stages is {num_stages}")
    if stages_per_rank > 1 and isinstance(fold, (list, tuple)) and \
            len(rank_of) != stages_per_rank * (max(rank_of) + 1):
        raise PartitionError(f"the fold {list(rank_of)} does not give every rank stages_per_rank={stages_per_rank} "
                             "stages")
    return rank_of
