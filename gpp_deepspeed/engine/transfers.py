"""The engine's transfer handlers: activations, their layouts and input gradients along stage edges.

:class:`TransferMixin` runs the transfer actions of a stage's program (``SEND_F``/``RECV_F``,
``SEND_B``/``RECV_B``, ``SEND_L``/``RECV_L``, grouped or alone) for :class:`GraphPipelineEngine`.
Each transfer action is one batch of point-to-point operations on the engine's
:class:`~.p2p.EdgeTransport` (``self.transport``), every receive sized before it is posted: an
activation's shape from the layout its producer sent first, a gradient's from the output it
belongs to. With per-stage degrees a stage edge is one message per peer rank: each consumer rank
gets exactly its rows from the producer ranks holding them (:mod:`.reshard`); gradients go back
the same way, scaled as :func:`~.reshard.grad_scale` says.

What it reads of the engine: ``pipe_buffers`` (``outputs``, ``received``, ``grads``), the stage's
edges and peers (``_in_edges``, ``_out_edges``, ``_in_peers``, ``_out_peers``, ``_out_index``),
``placement``, ``stage_id``, ``device``, and DeepSpeed's ``timers`` and ``wall_clock_breakdown``.
"""

from __future__ import annotations

import torch
from deepspeed.runtime.pipe.engine import (PIPE_RECV_GRAD_TIMER, PIPE_RECV_INPUT_TIMER, PIPE_SEND_GRAD_TIMER,
                                            PIPE_SEND_OUTPUT_TIMER)

from ..schedule.ir import ActionKind as K
from .flat import flatten, port_ranges, unflatten
from .p2p import Incoming, Outgoing, header_capacity, pack, receive_buffers, unpack
from .reshard import cut_rows, grad_scale, join_rows

__all__ = ["TransferMixin"]

# DeepSpeed's pipe timer of each transfer kind (wall_clock_breakdown).
_TIMERS = {K.SEND_F: PIPE_SEND_OUTPUT_TIMER, K.RECV_F: PIPE_RECV_INPUT_TIMER, K.SEND_B: PIPE_SEND_GRAD_TIMER,
           K.RECV_B: PIPE_RECV_GRAD_TIMER, K.SEND_L: PIPE_SEND_OUTPUT_TIMER, K.RECV_L: PIPE_RECV_INPUT_TIMER}


class TransferMixin:
    """The transfer handlers of :class:`~.engine.GraphPipelineEngine` (module docstring)."""

    def _exec_transfers(self, ops):
        """Run one transfer action: every send and receive of ``ops``, layouts included, posted as
        one batch (:meth:`EdgeTransport.exchange`); each receive is sized before it is posted."""
        sends, recvs, receivers = [], [], []
        for kind, buffer_id, peer in ops:
            if kind.spec.send:
                sends += self._outgoing(kind, buffer_id, peer)
                continue
            ranks, specs, store, extra = self._incoming(kind, buffer_id, peer)
            got = [Incoming(peer, rank, receive_buffers(spec, self.device)) for rank, spec in zip(ranks, specs)]
            recvs += got
            receivers.append((store, buffer_id, peer, extra, ranks, got, specs))
        self.transport.exchange(sends, recvs)
        for store, buffer_id, peer, extra, ranks, got, specs in receivers:
            store(buffer_id, peer, extra, ranks, [unpack(m.buffers, spec) for m, spec in zip(got, specs)])

    # With per-stage degrees a stage edge is one message per peer rank: each consumer rank gets
    # exactly its rows from the producer ranks holding them (reshard.py); gradients go back the same
    # way. With equal degrees that is one message to the same-index rank.

    def _outgoing(self, kind, buffer_id, peer) -> list[Outgoing]:
        """The messages of one send: activations, their layout headers, or input gradients."""
        if kind is K.SEND_B:
            grads, what = self._input_grads(buffer_id, peer), f"edge {peer} -> {self.stage_id}"
            return [Outgoing(peer, to.rank, pack(cut_rows(grads, to, what=what))) for to in self._in_peers[peer]]
        edge = self._out_edges[peer]
        flat, arity = self._flat_ports(buffer_id, edge.tensors)
        out = []
        for to in self._out_peers[peer]:
            part = cut_rows(flat, to, what=f"edge {self.stage_id} -> {peer}")
            out.append(Outgoing(peer, to.rank, pack(part) if kind is K.SEND_F else [self.transport.header(
                arity, part, edge=(self.stage_id, peer), num_ports=len(edge.tensors))]))
        return out

    def _incoming(self, kind, buffer_id, peer):
        """One receive: the peer ranks, the (shape, dtype) specs of each one's message, sized before
        it is posted, and where it goes (``store(buffer_id, peer, extra, ranks, tensors)``)."""
        if kind is K.RECV_L:
            ranks = [frm.rank for frm in self._in_peers[peer]]
            spec = (((header_capacity(len(self._in_edges[peer].tensors)), ), torch.int64), )
            return ranks, [spec] * len(ranks), self._store_layouts, None
        if kind is K.RECV_F:
            ranks = [frm.rank for frm in self._in_peers[peer]]
            layouts = [self.transport.layout((peer, self.stage_id), rank) for rank in ranks]
            return ranks, [layout.specs for layout in layouts], self._store_activations, layouts[0].arity
        positions, outputs = self._grad_positions(buffer_id, peer)
        what = f"edge {self.stage_id} -> {peer}"
        specs = [tuple((tuple(t.shape), t.dtype) for t in cut_rows(outputs, frm, what=what))
                 for frm in self._out_peers[peer]]
        return [frm.rank for frm in self._out_peers[peer]], specs, self._store_grads, positions

    def _flat_ports(self, buffer_id, refs):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        return flatten([outputs[self._out_index[ref]] for ref in refs])

    def _input_grads(self, buffer_id, peer):
        received = self.pipe_buffers["received"][buffer_id]
        flat, _ = flatten([received[ref] for ref in self._in_edges[peer].tensors])
        # A tensor this stage did not use still gets a (zero) gradient: the producer waits for one.
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in flat if t.is_floating_point()]

    def _grad_positions(self, buffer_id, peer):
        """Flat output positions of the edge to ``peer``'s floating-point tensors, in the order
        their gradients come, and those output tensors (the gradients' shapes)."""
        flat, arity = flatten(self.pipe_buffers["outputs"][buffer_id])
        ranges = port_ranges(arity)
        positions = [i for ref in self._out_edges[peer].tensors for i in ranges[self._out_index[ref]]
                     if flat[i].is_floating_point()]
        return positions, [flat[i] for i in positions]

    def _store_layouts(self, buffer_id, peer, _, ranks, parts):
        for rank, (header, ) in zip(ranks, parts):
            self.transport.keep_layout((peer, self.stage_id), rank, header)

    def _store_activations(self, buffer_id, peer, arity, ranks, parts):
        tensors = join_rows(parts)
        for t in tensors:
            t.requires_grad = t.is_floating_point() and torch.is_grad_enabled() and self._in_edges[peer].grad
        received = self.pipe_buffers["received"][buffer_id] or {}
        received.update(zip(self._in_edges[peer].tensors, unflatten(tensors, arity)))
        self.pipe_buffers["received"][buffer_id] = received

    def _store_grads(self, buffer_id, peer, positions, ranks, parts):
        got = join_rows(parts)
        scale = grad_scale(self.placement, src=self.stage_id, dst=peer)
        if scale != 1:  # see reshard.py: each rank differentiates its stage degree times its share
            got = [g * scale for g in got]
        grads: dict[int, torch.Tensor] = self.pipe_buffers["grads"][buffer_id] or {}
        for pos, g in zip(positions, got):
            grads[pos] = g if pos not in grads else grads[pos] + g
        self.pipe_buffers["grads"][buffer_id] = grads

    def _exec_transfer_group(self, ops):
        timers = list(dict.fromkeys(_TIMERS[kind] for kind, _, _ in ops))   # a layout shares its data's timer
        if self.wall_clock_breakdown():  # a grouped transfer counts under each of its kinds' timers
            for name in timers:
                self.timers(name).start()
        try:
            self._exec_transfers(ops)
        finally:
            if self.wall_clock_breakdown():
                for name in timers:
                    self.timers(name).stop()

    def _exec_send_activations_to(self, buffer_id, peer):
        self._exec_transfers([(K.SEND_F, buffer_id, peer)])

    def _exec_recv_activations_from(self, buffer_id, peer):
        self._exec_transfers([(K.RECV_F, buffer_id, peer)])

    def _exec_send_grads_to(self, buffer_id, peer):
        self._exec_transfers([(K.SEND_B, buffer_id, peer)])

    def _exec_recv_grads_from(self, buffer_id, peer):
        self._exec_transfers([(K.RECV_B, buffer_id, peer)])

    def _exec_wait_sends(self):
        self.transport.wait_sends()
