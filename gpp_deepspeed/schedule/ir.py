"""The schedule IR: per-stage action lists, the one representation that the engine executes and
that the validator, simulator and printer read.

Glossary
--------
action
    One instruction of one stage: ``Action(stage_idx, kind, mb_idx, peer)``. Its string form is
    compatible with torch.distributed.pipelining's for the chain-shaped subset (``"2F0"``; a
    transfer without a peer, ``"1SEND_F1"``, goes to the chain neighbour) and adds the peer stage of
    a DAG edge after ``@`` (``"1SEND_F1@3"``).
schedule
    ``dict[stage_idx, list[Action]]``: every stage's instructions for one batch, in program order.

Representative forms::

    0LOAD0  0F0  0SEND_F0@2  2RECV_F0@0  2F0  2B0  2SEND_B0@0  0RECV_B0@2  0B0
    2RECV_F1@0  2B0  2WAIT_F1  2F1      (a receive posted a compute early, completed just before its use)
    (1SEND_F1@2;1RECV_B0@2)P2P  0RELEASE_OUT0  0RELEASE_IN0
    1SEND_L1@2  1SEND_F1@2  2RECV_L1@1  2RECV_F1@1   (layouts first: dynamic shapes, a first batch)
    2I0  2SEND_B0@0  2W0          (split backward, as torch writes it: input gradient, then weight gradient)
    0WAIT_SENDS  0REDUCE_TIED  0REDUCE_GRAD  0STEP
    0STASH4  0B4  0RETIRE4  0REDUCE_GRAD  0UPDATE   (weight versions of the asynchronous schedules)
    0PREDICT_INPLACE4  0F4  0RESTORE4             (PipeOptim's prediction written over the live weights)
    2I0  2RELEASE_OUT0  2W0  2RELEASE_W0  (a split backward frees the outputs after I, W's inputs after W)

What each kind reads, writes and frees of its micro-batch's buffers is declared once, in
:data:`KINDS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from ..errors import ScheduleError

__all__ = ["ActionKind", "Buffer", "KindSpec", "KINDS", "LAYOUT_OF", "RELEASES", "WAIT_OF", "Action", "Schedule",
           "Segment", "format_schedule", "waited"]


class ActionKind(str, Enum):
    """What an action does. Values are the wire form used in :meth:`Action.__str__`; what each kind
    reads, writes and frees is declared once, in :data:`KINDS`."""

    LOAD = "LOAD"                # read a micro-batch (graph inputs this stage needs, labels if output stage)
    FORWARD = "F"
    BACKWARD = "B"               # full backward: input and weight gradients in one autograd pass
    BACKWARD_INPUT = "I"         # gradients w.r.t. the stage's inputs only (what predecessors wait for)
    BACKWARD_WEIGHT = "W"        # gradients w.r.t. the stage's parameters, after the micro-batch's ``I``
    SEND_F = "SEND_F"            # send this stage's activations of a micro-batch to ``peer``
    RECV_F = "RECV_F"            # receive the activations of a micro-batch from ``peer``
    SEND_B = "SEND_B"            # send the gradients of received activations back to ``peer``
    RECV_B = "RECV_B"            # receive the gradients of sent activations from ``peer``
    SEND_L = "SEND_L"            # send the layout (shapes, dtypes) of the next SEND_F of a micro-batch to ``peer``
    RECV_L = "RECV_L"            # receive that layout, before the receive of the activations it sizes
    # A rank holding several stages (schedule/virtual.py): an edge between two of its stages is a
    # local hand-over in place of the receive, no message (the send is dropped).
    HAND_F = "HAND_F"            # this stage's received tensors of the edge := ``peer``'s outputs (detached)
    HAND_B = "HAND_B"            # this stage's output gradients += the input gradients ``peer`` computed
    P2P = "P2P"                  # transfers posted together and completed together (``ops``)
    # A receive completes at its transfer action, or, when the list has a wait for it after it, at
    # that wait (posted early, waited at its use: see :func:`waited`).
    WAIT_F = "WAIT_F"            # complete this stage's posted receives of a micro-batch's activations
    WAIT_B = "WAIT_B"            # complete this stage's posted receives of a micro-batch's gradients
    RELEASE_OUT = "RELEASE_OUT"  # free a micro-batch's outputs, output gradients, labels and loss
    RELEASE_IN = "RELEASE_IN"    # free a micro-batch's loaded and received tensors (after their last use)
    RELEASE_W = "RELEASE_W"      # free what a split backward's ``W`` needed from its ``I``
    WAIT_SENDS = "WAIT_SENDS"    # wait until every asynchronous send has completed
    REDUCE_TIED = "REDUCE_TIED"  # all-reduce gradients of tied layers across the stages sharing them
    REDUCE_GRAD = "REDUCE_GRAD"  # all-reduce gradients across data-parallel replicas of the stage
    STEP = "STEP"                # optimizer step
    # Weight versions of the asynchronous schedules (schedule/asynchronous.py); their micro-batch
    # index names a weight version: the micro-batch whose forward first runs on it.
    STASH = "STASH"              # copy the stage's current weights into version mb_idx
    PREDICT = "PREDICT"          # version mb_idx := the weights predicted for its backward (PipeOptim)
    PREDICT_INPLACE = "PREDICT_INPLACE"  # live weights := their prediction, a copy of them kept (PipeOptim's code)
    RESTORE = "RESTORE"          # live weights := the copy PREDICT_INPLACE mb_idx kept (before any backward)
    RETIRE = "RETIRE"            # live weights' gradient := version mb_idx's gradient; the version is freed
    UPDATE = "UPDATE"            # one step of this stage's own optimizer (an update inside the pipeline)

    @property
    def spec(self) -> "KindSpec":
        """What this kind is, from :data:`KINDS`."""
        return KINDS[self]

    @property
    def has_mb(self) -> bool:
        return KINDS[self].mb

    @property
    def has_peer(self) -> bool:
        return KINDS[self].message != ""

    @property
    def takes_peer(self) -> bool:
        """The action names a peer stage: a transfer (``has_peer``) or a hand-over."""
        return self.has_peer or bool(KINDS[self].hand_over)

    @property
    def is_transfer(self) -> bool:
        """A point-to-point transfer, alone or grouped."""
        return self.has_peer or self is ActionKind.P2P

    @property
    def is_release(self) -> bool:
        return bool(KINDS[self].frees)


class Buffer(str, Enum):
    """What a stage holds for one micro-batch, in the buffer slot the schedule gives it
    (:func:`~gpp_deepspeed.schedule.lowering.assign_buffers`). Values name the engine's buffers."""

    LOADED = "loaded"            # graph inputs read from the batch
    RECEIVED = "received"        # tensors received from predecessors (with their gradients after a backward)
    INPUTS = "inputs"            # the flat tuple the stage's forward was called with
    OUTPUTS = "outputs"          # the stage's outputs
    LABELS = "labels"            # labels (output stage)
    LOSS = "losses"              # the micro-batch's loss (output stage)
    GRADS = "grads"              # gradients of the outputs, summed over the stages that read them
    WEIGHT_GRAD = "weight_grad"  # what ``W`` needs from ``I``: the part of the autograd graph below the inputs


@dataclass(frozen=True, slots=True, kw_only=True)
class KindSpec:
    """What one action kind does, declared once. The lowering passes (release points, buffer
    slots, grouping), the validator, the simulator and the engine's handlers read it here.

    ``reads``, ``writes`` and ``frees`` are the buffers of the action's micro-batch it uses (a
    read or a write may not happen on every stage: the forward reads labels on the output stage
    only). A transfer names the direction of its message (``"F"`` activations, ``"B"``
    gradients) and whether it sends; ``waits`` marks what may block on another stage.
    """

    mb: bool = False
    """The action carries a micro-batch index (a weight version for STASH, PREDICT, PREDICT_INPLACE,
    RESTORE and RETIRE)."""
    message: str = ""
    send: bool = False
    layout: bool = False
    """A layout message: the fixed-size header that sizes the receive of the activations that follow
    it on the same channel (``dynamic_shape``, and the first batch of static shapes)."""
    waits: bool = False
    reads: frozenset[Buffer] = frozenset()
    writes: frozenset[Buffer] = frozenset()
    frees: frozenset[Buffer] = frozenset()
    backward: bool = False
    """Part of a micro-batch's backward: ``B``, or the ``I`` and ``W`` of a split one."""
    version: bool = False
    """The index names a weight version, not the micro-batch whose buffers the action uses."""
    makes_version: bool = False
    """Makes the weight version the next forwards run on (a copy, or a prediction)."""
    predicts: bool = False
    """The version it makes is PipeOptim's prediction, ``s`` updates ahead (the program carries ``s``:
    :attr:`~gpp_deepspeed.schedule.program.Program.predictions`)."""
    updates: bool = False
    """An optimizer step with the gradient retired or accumulated so far (the stage's own, or
    DeepSpeed's step of the whole pipeline)."""
    collective: bool = False
    """Every rank of a group runs it at the same point (all-reduces, DeepSpeed's step): it stays on
    a frozen stage."""
    completes: str = ""
    """A wait (``"F"`` activations, ``"B"`` gradients): it completes the receives of its stage's
    micro-batch in that direction that earlier transfer actions posted (:func:`waited`)."""
    hand_over: str = ""
    """A hand-over on a rank holding both stages of an edge (``"F"`` activations from the producer
    ``peer``, ``"B"`` gradients from the consumer ``peer``): the receive's local counterpart."""
    peer_reads: frozenset[Buffer] = frozenset()
    """The buffers of the ``peer`` stage's micro-batch a hand-over reads: the peer must not free them
    before it (:func:`~gpp_deepspeed.schedule.virtual.fold_program` places the releases so)."""
    trains: bool = False
    """What a frozen stage (nothing to differentiate) does not run where a compute order has it: the
    backward, weight versions, the stage's own update and the reduction before it (the step that
    ends a synchronous batch is added later, on every stage)."""

    @property
    def to_successor(self) -> bool:
        """A transfer with a successor stage: activations or their layouts sent, gradients received
        (the other transfers are with a predecessor)."""
        return bool(self.message) and (self.message == "F") == self.send

    @property
    def input_gradients(self) -> bool:
        """A backward that computes the gradients of the stage's inputs (``B``, ``I``): the one its
        gradients are received before and sent after."""
        return self.backward and Buffer.RECEIVED in self.writes

    @property
    def ends_backward(self) -> bool:
        """The last backward action of a micro-batch (``B``, ``W``): the stage holds the micro-batch
        until it has run."""
        return self.backward and Buffer.WEIGHT_GRAD not in self.writes

    @property
    def on_micro_batch(self) -> bool:
        """The action belongs to one micro-batch, once per program (a weight-version action's index
        names a version; an update, a reduction or ``WAIT_SENDS`` recurs)."""
        return self.mb and not self.version

    @property
    def touches(self) -> frozenset[Buffer]:
        """The buffers the action uses (reads or writes): it must run before they are freed."""
        return self.reads | self.writes


def _kind(*, reads=(), writes=(), frees=(), **kw) -> KindSpec:
    return KindSpec(reads=frozenset(reads), writes=frozenset(writes), frees=frozenset(frees), **kw)


_B = Buffer
KINDS: dict[ActionKind, KindSpec] = {
    ActionKind.LOAD: _kind(mb=True, writes=(_B.LOADED, _B.LABELS)),
    ActionKind.FORWARD: _kind(mb=True, reads=(_B.LOADED, _B.RECEIVED, _B.LABELS),
                              writes=(_B.INPUTS, _B.OUTPUTS, _B.LOSS)),
    # A backward leaves the gradients of the received tensors on them (what SEND_B sends).
    ActionKind.BACKWARD: _kind(mb=True, backward=True, trains=True, reads=(_B.INPUTS, _B.OUTPUTS, _B.GRADS, _B.LOSS),
                               writes=(_B.RECEIVED, )),
    ActionKind.BACKWARD_INPUT: _kind(mb=True, backward=True, trains=True, reads=(_B.INPUTS, _B.OUTPUTS, _B.GRADS, _B.LOSS),
                                     writes=(_B.RECEIVED, _B.WEIGHT_GRAD)),
    ActionKind.BACKWARD_WEIGHT: _kind(mb=True, backward=True, trains=True, reads=(_B.WEIGHT_GRAD, )),
    ActionKind.SEND_F: _kind(mb=True, message="F", send=True, reads=(_B.OUTPUTS, )),
    ActionKind.RECV_F: _kind(mb=True, message="F", waits=True, writes=(_B.RECEIVED, )),
    ActionKind.SEND_B: _kind(mb=True, message="B", send=True, reads=(_B.RECEIVED, )),
    # A gradient's receive reads the outputs it belongs to (their shapes) and adds into GRADS.
    ActionKind.RECV_B: _kind(mb=True, message="B", waits=True, reads=(_B.OUTPUTS, ), writes=(_B.GRADS, )),
    # A layout travels the activations' channel, just before them; it is read off the outputs.
    ActionKind.SEND_L: _kind(mb=True, message="F", send=True, layout=True, reads=(_B.OUTPUTS, )),
    ActionKind.RECV_L: _kind(mb=True, message="F", waits=True, layout=True),
    ActionKind.HAND_F: _kind(mb=True, hand_over="F", writes=(_B.RECEIVED, ), peer_reads=frozenset({_B.OUTPUTS})),
    ActionKind.HAND_B: _kind(mb=True, hand_over="B", trains=True, reads=(_B.OUTPUTS, ), writes=(_B.GRADS, ),
                             peer_reads=frozenset({_B.RECEIVED})),
    ActionKind.P2P: _kind(waits=True),   # uses what its ops use
    # A wait stores what its receives brought: it writes what they write (and a gradient's reads the
    # outputs it is added to), so releases and buffer slots count it as a use.
    ActionKind.WAIT_F: _kind(mb=True, waits=True, completes="F", writes=(_B.RECEIVED, )),
    ActionKind.WAIT_B: _kind(mb=True, waits=True, completes="B", reads=(_B.OUTPUTS, ), writes=(_B.GRADS, )),
    ActionKind.RELEASE_OUT: _kind(mb=True, frees=(_B.OUTPUTS, _B.LABELS, _B.LOSS, _B.GRADS)),
    ActionKind.RELEASE_IN: _kind(mb=True, frees=(_B.LOADED, _B.RECEIVED, _B.INPUTS)),
    ActionKind.RELEASE_W: _kind(mb=True, frees=(_B.WEIGHT_GRAD, )),
    ActionKind.WAIT_SENDS: _kind(waits=True),
    ActionKind.REDUCE_TIED: _kind(collective=True),
    ActionKind.REDUCE_GRAD: _kind(collective=True, trains=True),
    ActionKind.STEP: _kind(collective=True, updates=True),
    ActionKind.STASH: _kind(mb=True, version=True, makes_version=True, trains=True),
    ActionKind.PREDICT: _kind(mb=True, version=True, makes_version=True, predicts=True, trains=True),
    ActionKind.PREDICT_INPLACE: _kind(mb=True, version=True, makes_version=True, predicts=True, trains=True),
    ActionKind.RESTORE: _kind(mb=True, version=True, trains=True),
    ActionKind.RETIRE: _kind(mb=True, version=True, trains=True),
    ActionKind.UPDATE: _kind(updates=True, trains=True),
}
"""Every action kind's :class:`KindSpec`: the one table to extend when adding a kind."""

LAYOUT_OF: dict[ActionKind, ActionKind] = {ActionKind.SEND_F: ActionKind.SEND_L, ActionKind.RECV_F: ActionKind.RECV_L}
"""The layout transfer that goes before each activation transfer when a program sends layouts."""

WAIT_OF: dict[str, ActionKind] = {k.spec.completes: k for k in ActionKind if KINDS[k].completes}
"""The wait of each direction of receives (``"F"``, ``"B"``)."""

RELEASES: tuple[ActionKind, ...] = tuple(k for k in ActionKind if KINDS[k].frees)
"""The release kinds, in the order :func:`~gpp_deepspeed.schedule.lowering.add_release` places
releases that fall on the same action."""

# Longest kinds first so that "SEND_F" is not read as "S" + ...
_KIND_ALTERNATIVES = "|".join(sorted((re.escape(k.value) for k in ActionKind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"^(\d+)({_KIND_ALTERNATIVES})(\d*)(?:@(\d+))?$")
_GROUP_RE = re.compile(r"^\(([^()]*)\)P2P$")


@dataclass(frozen=True, slots=True)
class Action:
    """One instruction of one stage.

    >>> a = Action(1, ActionKind.SEND_F, 0, peer=3)
    >>> str(a)
    '1SEND_F0@3'
    >>> Action.parse(str(a)) == a
    True
    >>> g = Action.group([a, Action(1, ActionKind.RECV_B, 0, peer=3)])
    >>> str(g), Action.parse(str(g)) == g
    ('(1SEND_F0@3;1RECV_B0@3)P2P', True)
    """

    stage_idx: int
    kind: ActionKind
    mb_idx: int | None = None
    peer: int | None = None
    ops: tuple["Action", ...] = ()

    @classmethod
    def group(cls, ops) -> "Action":
        """The grouped transfer of ``ops`` (transfers of one stage), posted and completed together."""
        ops = tuple(ops)
        return cls(ops[0].stage_idx if ops else 0, ActionKind.P2P, ops=ops)

    @property
    def transfers(self) -> tuple["Action", ...]:
        """The single transfers this action performs: its ``ops`` when grouped, itself when a
        transfer, else none."""
        if self.kind is ActionKind.P2P:
            return self.ops
        return (self, ) if self.kind.has_peer else ()

    @property
    def parts(self) -> tuple["Action", ...]:
        """The single actions this action performs: its ``ops`` when grouped, else itself."""
        return self.ops if self.kind is ActionKind.P2P else (self, )

    @property
    def mb_idxs(self) -> tuple[int, ...]:
        """The micro-batches this action names (weight versions included)."""
        return tuple(dict.fromkeys(op.mb_idx for op in self.parts if op.mb_idx is not None))

    @property
    def buffer_mbs(self) -> tuple[int, ...]:
        """The micro-batches whose buffers this action reads, writes or frees (:data:`KINDS`)."""
        return tuple(dict.fromkeys(op.mb_idx for op in self.parts
                                   if op.mb_idx is not None and (op.kind.spec.touches or op.kind.spec.frees)))

    @property
    def completion(self) -> tuple[int, str, int] | None:
        """What completes a data receive (``RECV_F``, ``RECV_B``): its stage, direction and
        micro-batch, the key of the wait that may complete it (:func:`waited`); ``None`` for any
        other action (a layout's receive always completes in its own action: the receive it sizes
        is posted from it)."""
        spec = KINDS[self.kind]
        if spec.message and not spec.send and not spec.layout:
            return (self.stage_idx, spec.message, self.mb_idx)
        return (self.stage_idx, spec.completes, self.mb_idx) if spec.completes else None

    @property
    def consumes(self) -> tuple[int, str, int] | None:
        """The :attr:`completion` key of the data receives this action needs complete: the
        forward's activations, the gradients of the backward that computes input gradients
        (``B``, ``I``); ``None`` for any other action."""
        if self.kind is ActionKind.FORWARD:
            return (self.stage_idx, "F", self.mb_idx)
        return (self.stage_idx, "B", self.mb_idx) if self.kind.spec.input_gradients else None

    @property
    def channel(self) -> tuple[int, int, str]:
        """The ordered channel a single transfer's message travels: (sender stage, receiver stage,
        ``"F"`` or ``"B"``). The n-th send of a channel matches its n-th receive."""
        spec = KINDS[self.kind]
        if not spec.message:
            raise ScheduleError(f"{self} is not a single transfer")
        return (self.stage_idx, self.peer, spec.message) if spec.send else (self.peer, self.stage_idx, spec.message)

    def __post_init__(self):
        if self.kind is ActionKind.P2P:
            if len(self.ops) < 2:
                raise ScheduleError(f"a grouped transfer needs at least two transfers, got {list(self.ops)}")
            # Transfers of several stages may be grouped: a rank holding several stages posts them
            # together; in a program of one stage per rank the validator refuses another stage's op.
            bad = [op for op in self.ops if not op.kind.has_peer]
            if bad:
                raise ScheduleError(f"a grouped transfer of stage {self.stage_idx} holds {bad}: only single "
                                    "transfers can be grouped")
            if self.mb_idx is not None or self.peer is not None:
                raise ScheduleError("a grouped transfer has no micro-batch or peer of its own")
            return
        if self.ops:
            raise ScheduleError(f"only P2P actions hold sub-actions, not {self.kind.name}")
        if self.kind.has_mb != (self.mb_idx is not None):
            raise ScheduleError(f"{self.kind.name} {'needs' if self.kind.has_mb else 'takes no'} micro-batch index")
        if self.peer is not None and self.peer < 0:
            raise ScheduleError(f"{self.kind.name} of stage {self.stage_idx} has no peer stage {self.peer}")
        if self.kind.takes_peer != (self.peer is not None):
            raise ScheduleError(f"{self.kind.name} {'needs' if self.kind.takes_peer else 'takes no'} peer stage")

    def __str__(self) -> str:
        if self.kind is ActionKind.P2P:
            return "(" + ";".join(str(op) for op in self.ops) + ")P2P"
        text = f"{self.stage_idx}{self.kind.value}"
        if self.mb_idx is not None:
            text += str(self.mb_idx)
        if self.peer is not None:
            text += f"@{self.peer}"
        return text

    def __repr__(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Read the string form; a transfer without ``@peer`` (torch's chain form, ``"1SEND_F1"``)
        goes to the neighbouring stage of a chain.

        >>> Action.parse("1SEND_F1"), Action.parse("1RECV_B0")
        (1SEND_F1@2, 1RECV_B0@2)
        """
        group = _GROUP_RE.match(text.strip())
        if group:
            return cls.group(cls.parse(op) for op in group.group(1).split(";"))
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ScheduleError(f'cannot parse action "{text}"')
        stage, kind, mb, peer = m.groups()
        stage, kind = int(stage), ActionKind(kind)
        if peer:
            peer = int(peer)
        elif kind.has_peer:
            peer = stage + 1 if kind.spec.to_successor else stage - 1
        else:
            peer = None
        return cls(stage, kind, int(mb) if mb else None, peer)


Schedule = dict[int, list[Action]]


@dataclass(frozen=True, slots=True)
class Segment:
    """Which part of an asynchronous schedule's never-draining program a list of actions is: the
    ``train_batch`` number ``batch_idx`` since the pipeline was last empty, or, with ``flush``, the
    drain after ``batch_idx`` batches. Micro-batches are numbered from the last empty pipeline.

    >>> Segment(2, num_microbatches=4).first_mb, Segment(2, num_microbatches=4).next()
    (8, Segment(batch_idx=3, num_microbatches=4, flush=False))
    """

    batch_idx: int
    num_microbatches: int
    flush: bool = False

    @property
    def first_mb(self) -> int:
        """The first micro-batch whose forward this segment runs (batch ``k`` forwards ``k*M .. k*M + M - 1``)."""
        return self.batch_idx * self.num_microbatches

    def next(self) -> "Segment":
        """The batch after this one."""
        return Segment(self.batch_idx + 1, self.num_microbatches)


def waited(actions) -> frozenset[tuple[int, str, int]]:
    """The receives of a list that complete at a wait, not in their transfer action: the
    :attr:`Action.completion` key of every ``WAIT_F`` / ``WAIT_B`` in ``actions``.

    A receive is *posted* by its transfer action. It *completes* (the stage waits for it and
    stores what it brought) at the stage's wait of its micro-batch and direction when the list
    has one, after it (the validator checks the order); otherwise in its own transfer action. So
    a receive can be posted a compute early and waited for just before its use, as
    torch.distributed.pipelining's runtime does (``RECV_F`` posts an ``irecv``, ``F`` waits),
    and a list without waits (layouts, hand-written lists) keeps the blocking receive.

    >>> sorted(waited([Action.parse(t) for t in "2RECV_F1@0 2B0 2WAIT_F1 2F1".split()]))
    [(2, 'F', 1)]
    """
    return frozenset(a.completion for a in actions if a.kind.spec.completes)


def format_schedule(schedule: Schedule) -> str:
    """One line per stage: ``stage 0: 0LOAD0 0F0 0SEND_F0@2 ...``."""
    return "\n".join(f"stage {s}: " + " ".join(str(a) for a in schedule[s]) for s in sorted(schedule))
