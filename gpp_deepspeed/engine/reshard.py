"""Row resharding on stage edges between stages of different data-parallel degrees.

On an edge ``s -> t`` a rank of ``s`` holds rows of the micro-batch (its shard) and each rank of
``t`` needs its own rows: :func:`gpp_deepspeed.graph.placement.reshard` says which producer sends
which rows to which consumer. This module turns that into, for one rank, the list of peer ranks
on one edge and the slice of its own tensors that goes to (or comes from) each, plus the two
tensor operations: cutting a shard's rows and concatenating received pieces.

Rows are computed on the smallest micro-batch both degrees divide, ``lcm(n_s, n_t)`` "units",
and scaled by the real shard size at run time, so a rank needs no micro-batch size up front.
With equal degrees every producer index ``i`` sends its whole shard to consumer index ``i``: no
slicing, and tensors without a batch dimension pass unchanged (as with one rank per stage).

Tensor parallelism: a stage's ranks are ``dp`` row shards of ``tp`` ranks each (see
:mod:`gpp_deepspeed.graph.placement`). Rows are resharded between row shards only: the peers of an
edge are the TP leaders (TP rank 0) of the row shards at both ends, and each leader's TP peers get
the same tensors by a broadcast inside their TP group (:mod:`.transfers`).

Gradients: every rank of a stage of degree ``n`` differentiates ``n`` times its shard's part of
the mean loss (the output stage's loss is a mean over its shard), which the stage's
data-parallel average turns into the gradient of the micro-batch's mean loss. A gradient coming
back from a stage of degree ``n_t`` is therefore scaled by ``n_s / n_t`` on arrival (see
:func:`grad_scale`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import GPPConfigError
from ..graph.placement import Placement, reshard

__all__ = ["EdgePeer", "edge_peers", "cut_rows", "join_rows", "grad_scale", "warm_up_pairs"]


@dataclass(frozen=True, slots=True)
class EdgePeer:
    """One peer rank of this rank on one stage edge, and the part of this rank's shard exchanged
    with it: units ``[start, stop)`` of ``units`` (``None``: the whole tensors, no slicing)."""

    rank: int
    rows: tuple[int, int] | None
    units: int


def edge_peers(placement: Placement, *, src: int, dst: int, replica: int, idx: int, side: str) -> tuple[EdgePeer, ...]:
    """The peers of row shard ``idx`` on edge ``src -> dst`` (the TP leaders of the row shards it
    exchanges rows with); ``side`` is ``"src"`` (this shard produces) or ``"dst"`` (it consumes).
    Ordered by row, so received pieces concatenate in order.

    >>> p = Placement.build((2, 1), world_size=3)
    >>> edge_peers(p, src=0, dst=1, replica=0, idx=0, side="dst")
    (EdgePeer(rank=0, rows=(0, 1), units=2), EdgePeer(rank=1, rows=(1, 2), units=2))
    >>> edge_peers(p, src=0, dst=1, replica=0, idx=1, side="src")
    (EdgePeer(rank=2, rows=(0, 1), units=1),)
    """
    n_src, n_dst = placement.dp[src], placement.dp[dst]
    if side == "src":
        peers, mine = placement.shard_leaders(dst, replica), (src, n_src)
    else:
        peers, mine = placement.shard_leaders(src, replica), (dst, n_dst)
    if n_src == n_dst:
        return (EdgePeer(peers[idx], None, 1), )
    lcm = math.lcm(n_src, n_dst)
    units = lcm // mine[1]
    out = []
    for t in reshard(lcm, num_src=n_src, num_dst=n_dst):
        ours, theirs = (t.src_idx, t.dst_idx) if side == "src" else (t.dst_idx, t.src_idx)
        if ours == idx:
            out.append(EdgePeer(peers[theirs], (t.start - idx * units, t.stop - idx * units), units))
    return tuple(out)


def cut_rows(tensors, peer: EdgePeer, *, edge: tuple[int, int]) -> list[torch.Tensor]:
    """The rows of ``tensors`` (this rank's shard, batch first) that go to ``peer`` on stage edge
    ``edge`` (``(src, dst)``, which an error names)."""
    if peer.rows is None:
        return list(tensors)
    out = []
    for t in tensors:
        rows = t.shape[0] if t.dim() else 0
        if rows == 0 or rows % peer.units:
            raise GPPConfigError(f"edge {edge[0]} -> {edge[1]}: a tensor of shape {tuple(t.shape)} crosses stages of "
                                 f"different degrees, so its first dimension must be the batch, split into {peer.units} equal parts; "
                                 "make the micro-batch a multiple of every stage degree")
        scale = rows // peer.units
        out.append(t[peer.rows[0] * scale:peer.rows[1] * scale])
    return out


def join_rows(pieces: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Concatenate, tensor by tensor, the pieces received from each peer (in row order)."""
    if len(pieces) == 1:
        return pieces[0]
    return [torch.cat(parts, dim=0) for parts in zip(*pieces)]


def grad_scale(placement: Placement, *, src: int, dst: int) -> float:
    """The factor applied to gradients arriving at stage ``src`` from stage ``dst``."""
    return placement.dp[src] / placement.dp[dst]


def warm_up_pairs(placement: Placement, stage_graph, *, replica: int) -> list[tuple[int, int, int, int]]:
    """Every ``(src_stage, dst_stage, src_rank, dst_rank)`` that exchanges rows on a stage edge of
    ``replica``, sorted: the same list on every rank of the replica (the transport warms each pair
    up in this order).

    >>> from gpp_deepspeed.graph.stages import StageGraph
    >>> warm_up_pairs(Placement.build((2, 1), world_size=3), StageGraph.chain(2), replica=0)
    [(0, 1, 0, 2), (0, 1, 1, 2)]
    """
    pairs = set()
    for e in stage_graph.edges:
        producers = placement.shard_leaders(e.src, replica)
        for i, rank in enumerate(producers):
            for peer in edge_peers(placement, src=e.src, dst=e.dst, replica=replica, idx=i, side="src"):
                if peer.rank != rank:   # an edge inside a rank (several stages per rank) is a hand-over
                    pairs.add((e.src, e.dst, rank, peer.rank))
    return sorted(pairs)
