"""A stage's transfers: activations, their layouts and input gradients along its stage edges.

:class:`StageTransfers` owns what a stage knows of its edges (the tensors each carries, the peer
ranks of this rank on each, the output ports) and runs one transfer action of the program
(``SEND_F``/``RECV_F``, ``SEND_B``/``RECV_B``, ``SEND_L``/``RECV_L``, alone or grouped in a
``P2P``) against the stage's buffers (:class:`~.buffers.StageBuffers`): every send and receive of
the action posted as one batch on a transport (:class:`~.p2p.EdgeTransport`), every receive sized
before it is posted: an activation's from the layout its producer sent first, a gradient's from
the output it belongs to. It needs no engine: the tests drive two of them over an in-process
transport.

With per-stage degrees a stage edge is one message per peer rank: each consumer rank gets exactly
its rows from the producer ranks holding them (:mod:`.reshard`); gradients go back the same way,
scaled as :func:`~.reshard.grad_scale` says.

With tensor parallelism (a stage's row shard held by a TP group, :mod:`gpp_deepspeed.graph.placement`)
a stage's activations and input gradients are replicated over each TP group, so only the group's
leader (TP rank 0) sends and receives them, and every message it receives is broadcast to its TP
peers inside the same transfer action: one message per row shard crosses between stages, not one
per TP rank. That broadcast is part of what a receive *is* on a stage of TP degree > 1 (every rank
of the group runs the same program, so every rank of it reaches the same receive, and the
broadcasts of one action happen in the order of its receives on every rank of the group), not a
choice made at run time. It is the documented equivalent of DeepSpeed's ``pipe_partitioned`` /
``grad_partitioned``: DeepSpeed sends ``1/tp`` of the tensor from each TP rank to its match and
all-gathers; here the same bytes cross between stages once, from one rank, and are broadcast in
the group (what crosses the stage boundary is the same; it works between stages of different TP
degrees, where there is no matching TP rank, and for any edge, not only a single tensor).

Representative use::

    transfers = StageTransfers(stage_graph, placement, stage_idx=2, replica=0, rank_idx=0,
                               out_ports=spec.out_ports, transport=EdgeTransport(...))
    transfers.run([(K.RECV_F, slot, 0), (K.RECV_F, slot, 1)], buffers)   # one P2P group
"""

from __future__ import annotations

import torch

from ..graph.placement import Placement
from ..graph.stages import StageGraph
from ..schedule.ir import ActionKind as K, Buffer
from .buffers import StageBuffers
from .flat import flatten, port_ranges, unflatten
from .p2p import Incoming, Outgoing, header_capacity, pack, receive_buffers, unpack
from .reshard import cut_rows, edge_peers, grad_scale, join_rows

__all__ = ["StageTransfers"]


class StageTransfers:
    """One rank's transfers on the edges of its stage ``stage_idx`` (module docstring).

    ``replica`` and ``rank_idx`` place this rank (its pipeline replica and its index among the
    stage's ranks); ``out_ports`` are the stage's output tensors in the order of its outputs.
    """

    def __init__(self, stage_graph: StageGraph, placement: Placement, *, stage_idx: int, replica: int, rank_idx: int,
                 out_ports, transport, tp_group=None, tp_leader: int | None = None):
        self.stage_idx = stage_idx
        self.placement = placement
        self.transport = transport
        # Tensor parallelism: rank_idx is the row shard; only the TP leader talks to other stages.
        self.tp_group, self.tp_leader = (tp_group, tp_leader) if placement.tp[stage_idx] > 1 else (None, None)
        self.is_tp_leader = self.tp_leader is None or transport.rank == self.tp_leader
        self._out_index = {ref: i for i, ref in enumerate(out_ports)}
        # This stage's edges by peer, in the order the schedule visits them (fixed for the run).
        self.in_edges = {e.src: e for e in stage_graph.edges if e.dst == stage_idx}
        self.out_edges = {e.dst: e for e in stage_graph.edges if e.src == stage_idx}
        place = dict(replica=replica, idx=rank_idx)
        self._in_peers = {s: edge_peers(placement, src=s, dst=stage_idx, side="dst", **place) for s in self.in_edges}
        self._out_peers = {t: edge_peers(placement, src=stage_idx, dst=t, side="src", **place)
                           for t in self.out_edges}
        # fixed for the run: the scale of the gradients that come back on each out-edge
        self._grad_scale = {t: grad_scale(placement, src=stage_idx, dst=t) for t in self.out_edges}

    def run(self, ops, buffers: StageBuffers) -> None:
        """Run one transfer action: every send and receive of ``ops`` (``(kind, slot, peer)``
        each), layouts included, posted as one batch; each receive is sized before it is posted
        and its tensors stored in ``buffers`` once the batch's receives completed."""
        sends, recvs, stores = [], [], []
        for kind, slot, peer, *_ in ops:
            self.prepare(kind, slot, peer, buffers, sends, recvs, stores)
        self.transport.exchange(sends, recvs)
        self.broadcast(stores)
        self.store(stores)

    def prepare(self, kind, slot, peer, buffers: StageBuffers, sends: list, recvs: list, stores: list) -> None:
        """Add one transfer's messages to a batch: its sends to ``sends``, its sized receives to
        ``recvs`` and what stores them, once received, to ``stores`` (:meth:`store`). Under TP only
        the leader sends and receives; its TP peers size the same buffers for :meth:`broadcast`."""
        if kind.spec.send:
            if self.is_tp_leader:
                sends += self._outgoing(kind, buffers, slot, peer)
            return
        ranks, specs, store = self._incoming(kind, buffers, slot, peer)
        got = [Incoming(peer, rank, receive_buffers(spec, self.transport.device)) for rank, spec in zip(ranks, specs)]
        if self.is_tp_leader:
            recvs += got
        stores.append((store, ranks, got, specs))

    def broadcast(self, stores: list) -> None:
        """Under TP, the leader's received messages to its TP peers (module docstring), after the
        exchange; nothing otherwise."""
        if self.tp_group is not None:
            self.transport.broadcast([b for _, _, got, _ in stores for m in got for b in m.buffers],
                                     src=self.tp_leader, group=self.tp_group)

    @staticmethod
    def store(stores: list) -> None:
        """Put what a batch's receives brought where it goes (after the exchange)."""
        for store, ranks, got, specs in stores:
            store(ranks, [unpack(m.buffers, spec) for m, spec in zip(got, specs)])

    # -- hand-overs (an edge between two stages of this rank: schedule/virtual.py) ---------------

    def edge_outputs(self, buffers: StageBuffers, slot: int, peer: int) -> tuple[list, list[int]]:
        """The flat tensors of the edge to ``peer`` (this stage's outputs of ``slot``) and their arity."""
        outputs = buffers[Buffer.OUTPUTS, slot]
        return flatten([outputs[self._out_index[ref]] for ref in self.out_edges[peer].tensors])

    def take_activations(self, buffers: StageBuffers, slot: int, peer: int, flat, arity) -> None:
        """``HAND_F``: the producer ``peer``'s flat tensors of the edge, detached, stored as if
        received (a leaf that requires grad on an edge that carries gradients)."""
        self._store_activations(buffers, slot, peer, arity, [[t.detach() for t in flat]])

    def input_grads(self, buffers: StageBuffers, slot: int, peer: int) -> list:
        """The gradients of what this stage received from ``peer`` (what ``SEND_B`` would send)."""
        return self._input_grads(buffers[Buffer.RECEIVED, slot], peer)

    def take_grads(self, buffers: StageBuffers, slot: int, peer: int, grads: list) -> None:
        """``HAND_B``: the consumer ``peer``'s input gradients, added to this stage's output gradients."""
        positions = self._grad_positions(flatten(buffers[Buffer.OUTPUTS, slot]), peer)
        self._store_grads(buffers, slot, peer, positions, [grads])

    def wait_sends(self) -> None:
        self.transport.wait_sends()

    # -- sends ------------------------------------------------------------------------------------

    def _outgoing(self, kind, buffers, slot, peer) -> list[Outgoing]:
        """The messages of one send: activations, their layout headers, or input gradients."""
        if kind is K.SEND_B:
            grads = self._input_grads(buffers[Buffer.RECEIVED, slot], peer)
            return [Outgoing(peer, to.rank, pack(cut_rows(grads, to, edge=(peer, self.stage_idx))))
                    for to in self._in_peers[peer]]
        edge = self.out_edges[peer]
        outputs = buffers[Buffer.OUTPUTS, slot]
        flat, arity = flatten([outputs[self._out_index[ref]] for ref in edge.tensors])
        out = []
        for to in self._out_peers[peer]:
            part = cut_rows(flat, to, edge=(self.stage_idx, peer))
            out.append(Outgoing(peer, to.rank, pack(part) if kind is K.SEND_F else [self.transport.header(
                arity, part, edge=(self.stage_idx, peer), num_ports=len(edge.tensors))]))
        return out

    def _input_grads(self, received, peer):
        flat, _ = flatten([received[ref] for ref in self.in_edges[peer].tensors])
        # A tensor this stage did not use still gets a (zero) gradient: the producer waits for one.
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in flat if t.is_floating_point()]

    # -- receives ---------------------------------------------------------------------------------

    def _incoming(self, kind, buffers, slot, peer):
        """One receive: the peer ranks, the (shape, dtype) specs of each one's message, sized before
        it is posted, and ``store(ranks, tensors)``, which puts what arrived where it goes."""
        edge = (peer, self.stage_idx)
        if kind is K.RECV_L:
            ranks = [frm.rank for frm in self._in_peers[peer]]
            spec = (((header_capacity(len(self.in_edges[peer].tensors)), ), torch.int64), )

            def store(ranks, parts):
                for rank, (header, ) in zip(ranks, parts):
                    self.transport.keep_layout(edge, rank, header)

            return ranks, [spec] * len(ranks), store
        if kind is K.RECV_F:
            ranks = [frm.rank for frm in self._in_peers[peer]]
            layouts = [self.transport.layout(edge, rank) for rank in ranks]
            return ranks, [layout.specs for layout in layouts], (
                lambda ranks, parts: self._store_activations(buffers, slot, peer, layouts[0].arity, parts))
        outputs = flatten(buffers[Buffer.OUTPUTS, slot])
        positions = self._grad_positions(outputs, peer)
        specs = [tuple((tuple(t.shape), t.dtype) for t in cut_rows([outputs[0][i] for i in positions], frm,
                                                                   edge=(self.stage_idx, peer)))
                 for frm in self._out_peers[peer]]
        return [frm.rank for frm in self._out_peers[peer]], specs, (
            lambda ranks, parts: self._store_grads(buffers, slot, peer, positions, parts))

    def _grad_positions(self, outputs, peer) -> list[int]:
        """Flat output positions of the edge to ``peer``'s floating-point tensors, in the order
        their gradients come (``outputs``: the stage's flat outputs and their arity)."""
        flat, arity = outputs
        ranges = port_ranges(arity)
        return [i for ref in self.out_edges[peer].tensors for i in ranges[self._out_index[ref]]
                if flat[i].is_floating_point()]

    def _store_activations(self, buffers, slot, peer, arity, parts):
        tensors = join_rows(parts)
        for t in tensors:
            t.requires_grad = t.is_floating_point() and torch.is_grad_enabled() and self.in_edges[peer].grad
        received = buffers[Buffer.RECEIVED, slot] or {}
        received.update(zip(self.in_edges[peer].tensors, unflatten(tensors, arity)))
        buffers[Buffer.RECEIVED, slot] = received

    def _store_grads(self, buffers, slot, peer, positions, parts):
        got = join_rows(parts)
        scale = self._grad_scale[peer]
        if scale != 1:  # see reshard.py: each rank differentiates its stage degree times its share
            got = [g * scale for g in got]
        grads: dict[int, torch.Tensor] = buffers[Buffer.GRADS, slot] or {}
        for pos, g in zip(positions, got):
            grads[pos] = g if pos not in grads else grads[pos] + g
        buffers[Buffer.GRADS, slot] = grads
