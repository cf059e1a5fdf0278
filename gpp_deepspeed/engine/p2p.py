"""Point-to-point transfers along stage edges, between any two stages.

DeepSpeed's ``pipe/p2p.py`` only talks to adjacent stages and its sends block (gloo's ``send`` is a
rendezvous), which deadlocks on DAGs. Here every send is asynchronous (``isend``; the tensor is
kept alive until the send completes) and every receive blocks (``irecv`` then ``wait``). Messages
between a pair of ranks are matched in the order they are posted, so no tags are needed (NCCL
ignores them).

An edge message is the edge's tensors, flattened. Before the first message of an edge (and
before every message when ``dynamic_shape`` is set) the sender sends its layout:

    [length]  then  [num_ports, (arity, (dtype_id, ndim, *shape) per tensor) per port]

as int64 tensors, the receiver allocates buffers from it and keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
from deepspeed import comm as dist

from ..errors import GPPError

__all__ = ["Layout", "EdgeTransport", "encode_layout", "decode_layout"]

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


class EdgeTransport:
    """Asynchronous sends and blocking receives to other stages of this rank's pipeline."""

    def __init__(self, grid, device, *, stage: int, timeout_s: float):
        self.grid = grid
        self.device = device
        self.stage = stage
        self.timeout = timedelta(seconds=timeout_s)
        self._pending: list[tuple[object, torch.Tensor]] = []
        self._layouts: dict[tuple[tuple[int, int], int], Layout] = {}   # (edge, peer rank) -> layout
        self._sent_layout: set[tuple[tuple[int, int], int]] = set()

    def _rank(self, stage: int) -> int:
        return self.grid.stage_to_global(stage_id=stage)

    def reset_layouts(self) -> None:
        """Forget exchanged layouts (call on every rank when activation shapes change)."""
        self._layouts.clear()
        self._sent_layout.clear()

    def _isend(self, tensor: torch.Tensor, rank: int) -> None:
        tensor = tensor.detach().contiguous()
        self._pending.append((dist.isend(tensor, rank), tensor))

    def send(self, edge: tuple[int, int], peer: int, arity, tensors, *, always_layout: bool,
             rank: int | None = None) -> None:
        """Post the asynchronous sends of one edge message (layout first when needed) to stage
        ``peer``'s rank ``rank`` (default: its first rank in this replica)."""
        self._reap()
        rank = self._rank(peer) if rank is None else rank
        if always_layout or (edge, rank) not in self._sent_layout:
            ints = encode_layout(arity, tensors)
            self._isend(torch.tensor([len(ints)], dtype=torch.int64, device=self.device), rank)
            self._isend(torch.tensor(ints, dtype=torch.int64, device=self.device), rank)
            self._sent_layout.add((edge, rank))
        for t in tensors:
            self._isend(t, rank)

    def send_tensors(self, peer: int, tensors, *, rank: int | None = None) -> None:
        """Post asynchronous sends of tensors whose layout the peer knows (gradients)."""
        self._reap()
        rank = self._rank(peer) if rank is None else rank
        for t in tensors:
            self._isend(t, rank)

    def recv_layout(self, edge: tuple[int, int], peer: int, *, always_layout: bool, rank: int | None = None) -> Layout:
        rank = self._rank(peer) if rank is None else rank
        if always_layout or (edge, rank) not in self._layouts:
            length = torch.empty(1, dtype=torch.int64, device=self.device)
            self._wait(dist.irecv(length, rank), peer, rank)
            ints = torch.empty(int(length.item()), dtype=torch.int64, device=self.device)
            self._wait(dist.irecv(ints, rank), peer, rank)
            self._layouts[(edge, rank)] = decode_layout(ints.tolist())
        return self._layouts[(edge, rank)]

    def recv_tensors(self, peer: int, specs, *, rank: int | None = None) -> list[torch.Tensor]:
        """Receive tensors of known shapes and dtypes from ``peer``; blocks until all arrived."""
        rank = self._rank(peer) if rank is None else rank
        bufs = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs]
        works = [dist.irecv(b, rank) for b in bufs]
        for w in works:
            self._wait(w, peer, rank)
        return bufs

    def _wait(self, work, peer: int, rank: int) -> None:
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
