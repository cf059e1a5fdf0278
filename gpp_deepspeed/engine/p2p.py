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
(gradients likewise), so a fan-in stage pays one message per edge, not one per tensor. Before the
first message of an edge (and before every message when ``dynamic_shape`` is set) the sender sends
its layout:

    [length]  then  [num_ports, (arity, (dtype_id, ndim, *shape) per tensor) per port]

as int64 tensors; the receiver allocates buffers from it and keeps it. Those receives are posted
right after the action's other transfers, so they never hold up its sends.

Communicators: NCCL creates the communicator of a pair of ranks on its first transfer, a blocking
collective of the two; :meth:`EdgeTransport.warm_up` makes one exchange over every stage edge, in
one global order, when the engine is built, so that no communicator is created mid-schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
from deepspeed import comm as dist

from ..errors import GPPError

__all__ = ["Layout", "EdgeTransport", "Outgoing", "Incoming", "encode_layout", "decode_layout", "pack", "unpack"]

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


def pack(tensors) -> list[torch.Tensor]:
    """One flat buffer per dtype, in order of first appearance: what goes over the wire.

    >>> [b.tolist() for b in pack([torch.ones(2), torch.tensor([7]), torch.zeros(1, 1)])]
    [[1.0, 1.0, 0.0], [7]]
    """
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t.detach().reshape(-1))
    return [flat[0].contiguous() if len(flat) == 1 else torch.cat(flat) for flat in groups.values()]


def unpack(buffers, specs) -> list[torch.Tensor]:
    """The tensors of ``specs`` (shape, dtype), as views of the buffers :func:`pack` made.

    >>> [t.tolist() for t in unpack(pack([torch.ones(2), torch.tensor([7])]), [((2,), torch.float32), ((1,), torch.int64)])]
    [[1.0, 1.0], [7]]
    """
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
    n = 1
    for d in shape:
        n *= d
    return n


def _buffers(specs, device) -> list[torch.Tensor]:
    """Empty receive buffers for the message whose tensors are ``specs``."""
    sizes: dict[torch.dtype, int] = {}
    for shape, dtype in specs:
        sizes[dtype] = sizes.get(dtype, 0) + _numel(shape)
    return [torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()]


@dataclass
class Outgoing:
    """One message to send: an edge's activations (``arity`` given: the layout may go first) or
    the gradients of one (``arity`` None: the receiver knows their shapes)."""

    peer: int
    edge: tuple[int, int]
    tensors: list
    arity: list[int] | None = None
    rank: int | None = None   # which rank of stage ``peer`` (per-stage degrees); default its first


@dataclass
class Incoming:
    """One message to receive: ``specs`` when the receiver knows the shapes (gradients), else the
    edge's layout is used, received first when not known yet."""

    peer: int
    edge: tuple[int, int]
    specs: tuple | None = None
    rank: int | None = None   # which rank of stage ``peer`` (per-stage degrees); default its first


class EdgeTransport:
    """Grouped transfers to other stages of this rank's pipeline: receives block, sends complete
    in the background until :meth:`wait_sends`."""

    def __init__(self, grid, device, *, stage: int, timeout_s: float):
        self.grid = grid
        self.device = device
        self.stage = stage
        self.timeout = timedelta(seconds=timeout_s)
        self._pending: list[tuple[object, torch.Tensor]] = []
        # Keyed by (edge, peer rank): with per-stage degrees an edge has several peer ranks.
        self._layouts: dict[tuple[tuple[int, int], int], Layout] = {}
        self._sent_layout: set[tuple[tuple[int, int], int]] = set()

    def _rank(self, stage: int) -> int:
        return self.grid.stage_to_global(stage_id=stage)

    def _peer_rank(self, m) -> int:
        return self._rank(m.peer) if m.rank is None else m.rank

    def reset_layouts(self) -> None:
        """Forget exchanged layouts (call on every rank when activation shapes change)."""
        self._layouts.clear()
        self._sent_layout.clear()

    def _op(self, op, tensor: torch.Tensor, rank: int):
        return dist.P2POp(op, tensor, rank)

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
            works = dist.batch_isend_irecv([self._op(dist.isend, out, rank), self._op(dist.irecv, got, rank)])
            for w in works:
                self._wait(w, peer, rank)

    def exchange(self, sends: list[Outgoing], recvs: list[Incoming], *, always_layout: bool):
        """Post every send and receive of one transfer action together; wait for the receives.

        Returns, per incoming message, its layout (None for gradients) and its tensors.
        """
        self._reap()
        ops, keep = [], []
        for m in sends:
            rank = self._peer_rank(m)
            if m.arity is not None and (always_layout or (m.edge, rank) not in self._sent_layout):
                ints = encode_layout(m.arity, m.tensors)
                keep += [torch.tensor([len(ints)], dtype=torch.int64, device=self.device),
                         torch.tensor(ints, dtype=torch.int64, device=self.device)]
                ops += [self._op(dist.isend, keep[-2], rank), self._op(dist.isend, keep[-1], rank)]
                self._sent_layout.add((m.edge, rank))
            for buf in pack(m.tensors):
                keep.append(buf)
                ops.append(self._op(dist.isend, buf, rank))
        num_sends = len(ops)
        layouts: list = [None] * len(recvs)
        bufs: list = [None] * len(recvs)
        waits: list[tuple[object, int]] = []
        late = []
        for i, m in enumerate(recvs):
            rank = self._peer_rank(m)
            if m.specs is None and (always_layout or (m.edge, rank) not in self._layouts):
                late.append(i)
                continue
            layouts[i] = self._layouts[(m.edge, rank)] if m.specs is None else None
            bufs[i] = _buffers(m.specs if m.specs is not None else layouts[i].specs, self.device)
            ops += [self._op(dist.irecv, b, rank) for b in bufs[i]]
            waits += [(None, m.peer, rank)] * len(bufs[i])
        works = dist.batch_isend_irecv(ops) if ops else []
        if len(works) == len(ops):  # one request per operation (gloo)
            self._pending += list(zip(works[:num_sends], keep))
            waits = [(w, peer, rank) for w, (_, peer, rank) in zip(works[num_sends:], waits)]
        else:  # one request for the coalesced group (NCCL): it completes as a whole
            first = (recvs or sends)[0]
            waits = [(w, first.peer, self._peer_rank(first)) for w in works]
        for i in late:
            m = recvs[i]
            rank = self._peer_rank(m)
            layouts[i] = self.recv_layout(m.edge, m.peer, rank=rank)
            bufs[i] = _buffers(layouts[i].specs, self.device)
            waits += [(dist.irecv(b, rank), m.peer, rank) for b in bufs[i]]
        for work, peer, rank in waits:
            self._wait(work, peer, rank)
        return [(layout, unpack(b, layout.specs if layout is not None else m.specs))
                for layout, b, m in zip(layouts, bufs, recvs)]

    def recv_layout(self, edge: tuple[int, int], peer: int, *, rank: int | None = None) -> Layout:
        """Receive and keep the layout of ``edge`` from stage ``peer``'s rank ``rank`` (blocking)."""
        rank = self._rank(peer) if rank is None else rank
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(length, rank), peer, rank)
        ints = torch.empty(int(length.item()), dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(ints, rank), peer, rank)
        self._layouts[(edge, rank)] = decode_layout(ints.tolist())
        return self._layouts[(edge, rank)]

    def _wait(self, work, peer: int, rank: int | None = None) -> None:
        rank = self._rank(peer) if rank is None else rank
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            raise GPPError(f"stage {self.stage} waited for stage {peer} (global rank {rank}), which sent "
                           f"nothing (the wait ends after graph_pipeline.p2p_timeout_s = "
                           f"{self.timeout.total_seconds():g} s, or when the peer disconnects); that rank has "
                           f"probably failed: see its log. gloo said: {exc}") from exc

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def _reap(self) -> None:
        """Drop completed sends so their tensors can be freed."""
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
