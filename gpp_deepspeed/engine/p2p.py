"""Point-to-point transfers along stage edges, between any two stages.

DeepSpeed's ``pipe/p2p.py`` only talks to adjacent stages and its sends block, which deadlocks on
DAGs. Here a stage runs each transfer action of its schedule (one transfer, or a grouped ``P2P``
action) as one :func:`deepspeed.comm.batch_isend_irecv` (``ncclGroupStart``/``End`` under NCCL,
posted one by one under gloo): every send and receive of the action is posted at once, the
receives are waited for before the stage computes, and sends complete in the background until
``WAIT_SENDS`` (their tensors are kept alive until then). Messages between a pair of ranks are
matched in the order they are posted, so no tags are needed (NCCL ignores them); the schedule's
order makes that order the same at both ends (see :mod:`gpp_deepspeed.schedule.lowering`).

An edge message is one buffer per dtype: the edge's tensors, flattened and concatenated in order
(gradients likewise), so a fan-in stage pays one message per edge, not one per tensor. The receiver
of activations sizes its buffers from the edge's layout, which the program sends as a message of
its own (``SEND_L``/``RECV_L``, :func:`~gpp_deepspeed.schedule.lowering.add_layouts`) before every
activation message under ``dynamic_shape``, and before those of the first batch otherwise; later
messages reuse the last layout of the edge. A layout is a fixed-size int64 header, so that its
receive is posted without knowing anything of it:

    [used, num_ports, (arity, (dtype_id, ndim, *shape) per tensor) per port, 0...]

``header_capacity(num_ports)`` int64s (``HEADER_INTS_PER_PORT`` per port of the edge); a layout
that does not fit raises :class:`~gpp_deepspeed.errors.GPPError` naming the edge.

Why this cannot deadlock under NCCL
-----------------------------------
Every transfer action of the program, one transfer or a grouped ``P2P``, is exactly one
``batch_isend_irecv`` (one group, ``ncclGroupStart``/``End``), and no point-to-point op is ever
posted any other way, so batched and single ops never meet (PyTorch's NCCL process group has run
them on different communicators). A group's receives are sized before it is posted: gradients
from this rank's own outputs, activations from a layout received in an earlier action
(:func:`~gpp_deepspeed.schedule.validate.check_lists` checks it), layouts from the fixed header
size. So what runs on the wire is the program's list of groups, one per action, in order; the
validator's rendezvous mode simulates exactly that list with a send completing only when its
receive is posted, a group completing as a whole, and a stage posting a group only after its
previous action completed (NCCL's stream order), and rejects any program that can stop under
those rules. Messages between a pair of ranks match in posting order, at both ends the same
(``layout, activations, layout, activations`` on an activation channel): the simulator checks the
n-th message of a channel has the same micro-batch and kind at both ends. A two-phase exchange
(layouts in one group, activations in the next) is as safe as that argument and no safer: both
groups are actions the validator runs, not a detail of the transport. Where the grouped program
fails the validator, lowering falls back to one transfer per group in one global order of messages
(:func:`~gpp_deepspeed.schedule.lowering.group_for_rendezvous`), which runs under these rules.

Assumed, not proven here: that the ops of one group progress once every peer's matching group has
been launched, whatever their order inside it. NCCL does not promise that for groups spanning many
peers (it may split a large group into several launches); a group here holds one stage's transfers
at one point of its program, to a few peers. ``tests/strict_p2p.py`` runs the engine under these
rules on gloo.

Posting: one ``torch.distributed.batch_isend_irecv`` of ``torch.distributed.P2POp`` s, what
``deepspeed.comm.batch_isend_irecv`` calls after converting its own ``P2POp`` s and timing the
call for DeepSpeed's communication logger; that wrapper's work (a third of the Python a message
costs on a CPU host) is done only while the logger is on (``"comms_logger": {"enabled": true}``),
so the logger still sees every transfer when asked to. On a backend that does not coalesce
(gloo), where ``batch_isend_irecv`` is a loop of ``isend`` / ``irecv``, the transport runs that
loop itself, without the ``P2POp`` s (:meth:`EdgeTransport._post`).

Communicators: NCCL creates the communicator of a pair of ranks on its first transfer, a blocking
collective of the two; :meth:`EdgeTransport.warm_up` makes one exchange over every stage edge, in
one global order, when the engine is built, so that no communicator is created mid-schedule.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed
from deepspeed import comm as dist

from ..errors import GPPError
from .compat import coalesces_p2p, comms_logging_enabled

__all__ = ["Layout", "EdgeTransport", "Outgoing", "Incoming", "encode_layout", "decode_layout", "encode_header",
           "decode_header", "header_capacity", "HEADER_INTS_PER_PORT", "pack", "unpack", "receive_buffers"]

# torch's own ``batch_isend_irecv``, to tell it from a replacement (``EdgeTransport._post``); None
# if this module was imported after one was installed, so that every batch then goes through it.
_TORCH_BATCH_ISEND_IRECV = (torch.distributed.distributed_c10d.batch_isend_irecv
                            if torch.distributed.distributed_c10d.batch_isend_irecv.__module__
                            == "torch.distributed.distributed_c10d" else None)

ID_TO_DTYPE = [
    torch.float32, torch.float64, torch.complex64, torch.complex128, torch.float16, torch.bfloat16, torch.uint8,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.bool
]
DTYPE_TO_ID = {dtype: i for i, dtype in enumerate(ID_TO_DTYPE)}


@dataclass(frozen=True)
class Layout:
    """Structure of an edge message: per-port arity and per-tensor (shape, dtype)."""

    arity: tuple[int, ...]
    specs: tuple[tuple[tuple[int, ...], torch.dtype], ...]


def encode_layout(arity, tensors) -> list[int]:
    """The layout message of one edge.

    >>> encode_layout([-1], [torch.zeros(2, 3)])
    [1, -1, 0, 2, 2, 3]
    """
    out = [len(arity)]
    pos = 0
    for a in arity:
        out.append(a)
        for t in tensors[pos:pos + (1 if a < 0 else a)]:
            out += [DTYPE_TO_ID[t.dtype], t.dim(), *t.shape]
        pos += 1 if a < 0 else a
    return out


def decode_layout(ints: list[int]) -> Layout:
    """Read a layout message back.

    >>> decode_layout([1, -1, 0, 2, 2, 3]).specs
    (((2, 3), torch.float32),)
    """
    num_ports, pos = ints[0], 1
    arity, specs = [], []
    for _ in range(num_ports):
        a = ints[pos]
        pos += 1
        arity.append(a)
        for _ in range(1 if a < 0 else a):
            dtype, ndim = ID_TO_DTYPE[ints[pos]], ints[pos + 1]
            specs.append((tuple(ints[pos + 2:pos + 2 + ndim]), dtype))
            pos += 2 + ndim
    return Layout(tuple(arity), tuple(specs))


HEADER_INTS_PER_PORT = 64
"""Layout header room per port of an edge: a port of ``k`` tensors of ``ndim`` dims each takes
``1 + k * (2 + ndim)`` int64s (64: e.g. a tuple of 10 four-dim tensors)."""


def header_capacity(num_ports: int) -> int:
    """Size in int64s of the layout header of an edge of ``num_ports`` ports.

    >>> header_capacity(1)
    66
    """
    return 2 + HEADER_INTS_PER_PORT * num_ports


def encode_header(arity, tensors, *, capacity: int, edge: tuple[int, int]) -> list[int]:
    """The fixed-size layout header of one message of ``edge``.

    >>> encode_header([-1], [torch.zeros(2, 3)], capacity=8, edge=(0, 1))
    [6, 1, -1, 0, 2, 2, 3, 0]
    """
    ints = encode_layout(arity, tensors)
    if 1 + len(ints) > capacity:
        dims = max((t.dim() for t in tensors), default=0)
        raise GPPError(f"the layout of edge {edge[0]} -> {edge[1]} ({len(arity)} port(s), {len(tensors)} tensors of up "
                       f"to {dims} dims) takes {1 + len(ints)} int64s, more than its fixed header of {capacity} "
                       f"({HEADER_INTS_PER_PORT} per port); send fewer tensors on that edge (select the ones its "
                       "consumers read with \"name:i\" references) or cut the graph elsewhere")
    return [len(ints), *ints] + [0] * (capacity - 1 - len(ints))


def decode_header(ints: list[int]) -> "Layout":
    """Read a header of :func:`encode_header` back.

    >>> decode_header([6, 1, -1, 0, 2, 2, 3, 0]).specs
    (((2, 3), torch.float32),)
    """
    return decode_layout(ints[1:1 + ints[0]])


def pack(tensors) -> list[torch.Tensor]:
    """One flat buffer per dtype, in order of first appearance: what goes over the wire. A message
    of one tensor (the common case: one activation an edge) is that tensor flattened, a view of it
    where it is contiguous, with nothing grouped or copied.

    >>> [b.tolist() for b in pack([torch.ones(2), torch.tensor([7]), torch.zeros(1, 1)])]
    [[1.0, 1.0, 0.0], [7]]
    """
    if len(tensors) == 1:
        return [tensors[0].detach().reshape(-1)]
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t.detach().reshape(-1))
    return [flat[0].contiguous() if len(flat) == 1 else torch.cat(flat) for flat in groups.values()]


def unpack(buffers, specs) -> list[torch.Tensor]:
    """The tensors of ``specs`` (shape, dtype), as views of the buffers :func:`pack` made.

    >>> [t.tolist() for t in unpack(pack([torch.ones(2), torch.tensor([7])]), [((2,), torch.float32), ((1,), torch.int64)])]
    [[1.0, 1.0], [7]]
    """
    if len(specs) == 1:
        return [buffers[0].view(specs[0][0]).detach()]
    offsets = {dtype: [buf, 0] for dtype, buf in zip(_dtypes(specs), buffers)}
    out = []
    for shape, dtype in specs:
        buf, pos = offsets[dtype]
        n = _numel(shape)
        out.append(buf[pos:pos + n].view(shape).detach())
        offsets[dtype][1] = pos + n
    return out


def _dtypes(specs) -> list[torch.dtype]:
    return list(dict.fromkeys(dtype for _, dtype in specs))


def _numel(shape) -> int:
    """Elements of a tensor of ``shape``.

    >>> _numel((2, 3)), _numel(())
    (6, 1)
    """
    n = 1
    for d in shape:
        n *= d
    return n


def receive_buffers(specs, device) -> list[torch.Tensor]:
    """Empty receive buffers for the message whose tensors are ``specs``."""
    sizes: dict[torch.dtype, int] = {}
    for shape, dtype in specs:
        sizes[dtype] = sizes.get(dtype, 0) + _numel(shape)
    return [torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()]


@dataclass
class Outgoing:
    """One message to send: to global rank ``rank`` of stage ``peer``, the ``buffers`` that
    :func:`pack` made (or one layout header)."""

    peer: int
    rank: int
    buffers: list[torch.Tensor]


@dataclass
class Incoming:
    """One message to receive from global rank ``rank`` of stage ``peer`` into ``buffers``, sized
    before the receive is posted (:func:`receive_buffers`, or one layout header)."""

    peer: int
    rank: int
    buffers: list[torch.Tensor]


class EdgeTransport:
    """One ``batch_isend_irecv`` per transfer action: receives block, sends complete in the
    background until :meth:`wait_sends`; layouts received by the program, kept per edge and peer
    rank."""

    def __init__(self, grid, device, *, stage: int, timeout_s: float):
        self.grid = grid
        self.device = device
        self.stage = stage
        self.rank = getattr(grid, "global_rank", None)   # this process (None for an in-process test transport)
        self.timeout = timedelta(seconds=timeout_s)
        self._pending: list[tuple[object, list[torch.Tensor]]] = []
        # Keyed by (edge, peer rank): with per-stage degrees an edge has several peer ranks.
        self._arrived: dict[tuple[tuple[int, int], int], deque[Layout]] = {}   # received, not used yet
        self._layouts: dict[tuple[tuple[int, int], int], Layout] = {}           # the last one used
        self._coalesces: bool | None = None   # whether the backend coalesces a batch (set at the first post)

    def reset_layouts(self) -> None:
        """Forget received layouts (call on every rank when activation shapes change: the next
        program sends them again)."""
        self._arrived.clear()
        self._layouts.clear()

    def header(self, arity, tensors, *, edge: tuple[int, int], num_ports: int) -> torch.Tensor:
        """The layout header of one message of ``edge``."""
        return torch.tensor(encode_header(arity, tensors, capacity=header_capacity(num_ports), edge=edge),
                            dtype=torch.int64, device=self.device)

    def keep_layout(self, edge: tuple[int, int], rank: int, header: torch.Tensor) -> None:
        """Keep a received layout header for the next activation receive of ``edge`` from ``rank``."""
        self._arrived.setdefault((edge, rank), deque()).append(decode_header(header.tolist()))

    def layout(self, edge: tuple[int, int], rank: int) -> Layout:
        """The layout of the next activation message of ``edge`` from ``rank``: the one received
        for it (layout programs), else the last one used (static shapes after the first batch)."""
        key = (edge, rank)
        if self._arrived.get(key):
            self._layouts[key] = self._arrived[key].popleft()
        if key not in self._layouts:
            raise GPPError(f"stage {self.stage} has no layout for edge {edge[0]} -> {edge[1]} from global rank {rank}: "
                           "a program without layouts ran before any with them (reset_activation_shape() must be "
                           "called on every rank)")
        return self._layouts[key]

    def _post(self, ops: list[tuple[bool, torch.Tensor, int]]) -> list:
        """Post ``(is_send, tensor, global rank)`` s as one batch (module docstring: through
        DeepSpeed's communication wrapper only while its logger is on). On a backend that does not
        coalesce (gloo) the ops go out one by one, as torch's ``batch_isend_irecv`` posts them
        there, without building its ``P2POp`` s and checking the list (a third of what posting a
        message costs in Python); while ``batch_isend_irecv`` is not torch's own (a test's strict
        transport, a tracer), every batch goes through it."""
        if comms_logging_enabled():
            return dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, t, r) for send, t, r in ops])
        c10d = torch.distributed
        if self._coalesces is None:
            self._coalesces = coalesces_p2p(self.device)
        if not self._coalesces and c10d.batch_isend_irecv is _TORCH_BATCH_ISEND_IRECV:
            isend, irecv = c10d.isend, c10d.irecv
            return [(isend if send else irecv)(t, r) for send, t, r in ops]
        return c10d.batch_isend_irecv([c10d.P2POp(c10d.isend if send else c10d.irecv, t, r) for send, t, r in ops])

    def warm_up(self, pairs) -> None:
        """Exchange one element over every rank pair of every stage edge, in the order of
        ``pairs`` (``(src_stage, dst_stage, src_rank, dst_rank)``, the same list on every rank):
        NCCL creates each pair's communicator here, and the least pair not yet done always has
        both its ranks at it, so this cannot deadlock."""
        me = dist.get_rank()
        for src, dst, src_rank, dst_rank in pairs:
            if me not in (src_rank, dst_rank):
                continue
            peer, rank = (dst, dst_rank) if me == src_rank else (src, src_rank)
            out = torch.zeros(1, device=self.device)
            got = torch.empty(1, device=self.device)
            works = self._post([(True, out, rank), (False, got, rank)])
            for w in works:
                self._wait(w, peer, rank)

    def exchange(self, sends: list[Outgoing], recvs: list[Incoming]) -> None:
        """Post every send and receive of one transfer action as one ``batch_isend_irecv`` and wait
        for the receives (their buffers are then filled); the sends complete in the background."""
        self.finish(recvs, self.start(sends, recvs))

    def start(self, sends: list[Outgoing], recvs: list[Incoming]) -> list[list]:
        """Post every send and receive of one transfer action as one ``batch_isend_irecv``, waiting
        for nothing: the requests to wait for before each message of ``recvs`` is in its buffers
        (:meth:`finish`, now or at the program's wait for it); sends complete in the background
        until :meth:`wait_sends`."""
        self._reap()
        ops = [(True, b, m.rank) for m in sends for b in m.buffers]
        num_sends = len(ops)
        ops += [(False, b, m.rank) for m in recvs for b in m.buffers]
        if not ops:
            return []
        works = self._post(ops)
        if len(works) == len(ops):  # one request per operation (gloo)
            self._pending += [(w, [t]) for w, (_, t, _) in zip(works[:num_sends], ops)]
            if len(recvs) == 1 and len(recvs[0].buffers) == len(works) - num_sends:
                return [works[num_sends:]]
            rest = iter(works[num_sends:])
            return [[next(rest) for _ in m.buffers] for m in recvs]
        # One request for the coalesced group (NCCL): it completes as a whole, receives included;
        # its sends' tensors stay alive until it has.
        self._pending += [(w, [t for _, t, _ in ops[:num_sends]]) for w in works]
        return [list(works) for _ in recvs]

    def finish(self, recvs: list[Incoming], requests: list[list], *, stage: int | None = None) -> None:
        """Wait until every message of ``recvs`` is in its buffers (``requests``: what
        :meth:`start` gave for them); ``stage``: the rank's stage that receives them (default the
        transport's), which a timeout names."""
        for m, works in zip(recvs, requests):
            for work in works:
                self._wait(work, m.peer, m.rank, stage=stage)

    def broadcast(self, buffers: list[torch.Tensor], *, src: int, group) -> None:
        """Broadcast ``buffers`` from global rank ``src`` over ``group`` (a stage's TP group: the
        messages its leader received, to its TP peers; :mod:`.transfers`), one collective each,
        in order, waited for like a receive."""
        for b in buffers:
            work = dist.broadcast(b, src=src, group=group, async_op=True)
            self._wait(work, self.stage, src)

    def _wait(self, work, peer: int, rank: int, *, stage: int | None = None) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            me = self.stage if stage is None else stage
            raise GPPError(f"stage {me} waited for stage {peer} (global rank {rank}), which sent "
                           f"nothing (the wait ends after graph_pipeline.p2p_timeout_s = "
                           f"{self.timeout.total_seconds():g} s, or when the peer disconnects); that rank has "
                           f"probably failed: see its log. gloo said: {exc}") from exc

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def _reap(self) -> None:
        """Drop the sends completed at the front of the list (posted first, they complete first)
        so their tensors can be freed: constant work per transfer, where scanning the whole list
        grew with the batch (gloo reports a send complete only once waited for, so nothing is
        freed before ``wait_sends`` there)."""
        pending = self._pending
        done = 0
        while done < len(pending) and pending[done][0].is_completed():
            done += 1
        if done:
            del pending[:done]
