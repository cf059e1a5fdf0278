"""A stage's backward split in two autograd passes: input gradients now, weight gradients later.

LayerPipe and the zero-bubble schedules (arXiv 2401.10241) run the gradient with respect to a
stage's inputs (``I``) as soon as the output gradients arrive, because the predecessors wait for
it, and the gradient with respect to the weights (``W``) later, in a bubble. This module does the
split on any autograd graph, with no change to the layers (the idea of torch.distributed.pipelining's
``stage_backward_input`` / ``stage_backward_weight``; our own code):

``I`` (:func:`backward_input`)
    One autograd pass from the stage outputs to the stage inputs only
    (``torch.autograd.backward(..., inputs=inputs, retain_graph=True)``): autograd runs only the
    nodes on a path to an input, and each of them computes only the gradients of edges that lead
    to an input (a linear layer computes ``dx``, not ``dW``). Before it runs, the graph is cut into
    parameter groups: walking up from each parameter, the first nodes met that are on an input
    path are its *boundary nodes*; a hook on each records the gradient flowing into it, which is
    complete when it runs (every node feeding it is on an input path too, so it runs in ``I``).
``W`` (:meth:`WeightGrad.run`)
    One autograd pass per parameter group, from its boundary nodes (with the recorded gradients)
    to its parameters only: the work ``I`` skipped, nothing more. Gradients accumulate through the
    parameters' own ``AccumulateGrad`` nodes, so ``.grad`` and every gradient hook (DeepSpeed's
    ZeRO and bf16 hooks) see exactly what a fused backward gives them. Where a path between two
    boundary nodes of one group exists (a weight used twice on an input path), a pre-hook replaces
    the downstream node's incoming gradient with the recorded one, so nothing counts twice.
    Stage outputs that do not depend on any input (a branch fed only by loaded data) are roots of
    ``W`` with their output gradients. With no input needing a gradient at all, ``I`` does nothing
    and ``W`` is the whole backward.

What stays alive from ``I`` to ``W``: the boundary nodes, the graph below them (the saved
activations the weight gradients read) and the recorded gradients; the part of the graph above
them is released with the stage outputs. :meth:`WeightGrad.run` frees everything.

The sums of gradients from several consumers are formed in the order autograd executes the
nodes; a pass that skips nodes can add the same terms in another order than a fused backward,
so results agree to float rounding (tested to 1e-6 relative), not bit for bit.

Representative use (the engine's ``I`` and ``W`` handlers)::

    work = backward_input(outputs, output_grads, inputs=received, params=stage_params)
    send(received[i].grad ...)     # what the predecessors wait for
    ...
    work.run()                     # parameters' .grad now equal a fused backward's
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightGrad", "backward_input"]


def _node_of(t: torch.Tensor) -> Node | None:
    """The autograd node a tensor's gradient enters: its grad_fn, or a leaf's AccumulateGrad."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    # A leaf's AccumulateGrad is created lazily; a view's grad_fn points to it (torch's own trick).
    return t.view_as(t).grad_fn.next_functions[0][0]


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """For every node reachable from ``roots``: the nodes with an edge to it (towards the outputs)."""
    parents: dict[Node, list[Node]] = {r: [] for r in roots}
    queue = deque(roots)
    seen = set(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _ancestors(starts: Sequence[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``starts`` and every node with a path to one of them: the nodes ``I`` runs."""
    found = {n for n in starts if n in parents}
    queue = deque(found)
    while queue:
        for p in parents[queue.popleft()]:
            if p not in found:
                found.add(p)
                queue.append(p)
    return found


@dataclass
class _Group:
    """Parameters whose gradients come from the same boundary nodes (and output roots)."""

    params: list[torch.Tensor] = field(default_factory=list)
    boundary: list[Node] = field(default_factory=list)    # on an input path: gradient recorded in I
    roots: list[Node] = field(default_factory=list)       # output nodes off every input path


def _groups(params: Sequence[torch.Tensor], parents: dict[Node, list[Node]], on_input_path: set[Node],
            roots: set[Node]) -> list[_Group]:
    """Walk up from each parameter to the first nodes on an input path; merge parameters that
    share any node where a walk stops (so each parameter's gradient comes from one pass)."""
    owner: dict[Node, _Group] = {}
    groups: list[_Group] = []
    for p in params:
        start = _node_of(p)
        if start not in parents:
            continue  # this parameter is not used by the micro-batch
        stops: list[Node] = []
        seen, queue = {start}, deque([start])
        while queue:
            node = queue.popleft()
            for up in parents[node]:
                if up in seen:
                    continue
                seen.add(up)
                if up in on_input_path:
                    stops.append(up)
                    continue
                if up in roots:
                    stops.append(up)
                queue.append(up)
        if start in roots:
            stops.append(start)
        group = _Group(params=[p])
        merged = {id(owner[n]): owner[n] for n in stops if n in owner}
        for g in merged.values():
            group.params += g.params
            group.boundary += g.boundary
            group.roots += g.roots
        groups = [g for g in groups if id(g) not in merged]
        for n in stops:
            if n not in group.boundary and n not in group.roots:
                (group.boundary if n in on_input_path else group.roots).append(n)
        for n in group.boundary + group.roots:
            owner[n] = group
        groups.append(group)
    return groups


class WeightGrad:
    """The weight-gradient half of a split backward, ready to run (see the module docstring)."""

    def __init__(self, groups: list[_Group], recorded: dict[Node, tuple], root_grads: dict[Node, list[tuple]]):
        self._groups = groups
        self._recorded = recorded            # boundary node -> gradients flowing into it, per slot
        self._root_grads = root_grads        # root node off input paths -> [(output slot, gradient)]

    def run(self) -> None:
        """Accumulate the parameters' gradients into ``.grad`` through their AccumulateGrad nodes,
        then release the graph."""
        groups, self._groups = self._groups, []
        for i, group in enumerate(groups):
            edges, grads = [], []
            for node in group.boundary:
                for slot, g in enumerate(self._recorded.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, slot))
                        grads.append(g)
            for node in group.roots:
                for slot, g in self._root_grads[node]:
                    edges.append(GradientEdge(node, slot))
                    grads.append(g)
            if not edges:
                continue
            handles = [node.register_prehook(lambda _, saved=self._recorded[node]: saved)
                       for node in group.boundary if node in self._recorded]
            try:
                torch.autograd.backward(edges, grads, inputs=group.params, retain_graph=i < len(groups) - 1)
            finally:
                for h in handles:
                    h.remove()
        self._recorded, self._root_grads = {}, {}


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], *,
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> WeightGrad:
    """Run ``I``: accumulate the gradients of ``inputs`` (leaves) into their ``.grad``, and return
    the ``W`` that gives ``params`` their gradients later.

    ``outputs`` and ``grads`` are what a fused backward would be called with
    (``torch.autograd.backward(outputs, grads)``); a ``None`` gradient is allowed for a scalar.

    >>> x = torch.ones(2, requires_grad=True)
    >>> lin = torch.nn.Linear(2, 1)
    >>> y = lin(x)
    >>> w = backward_input([y], [torch.ones(1)], inputs=[x], params=list(lin.parameters()))
    >>> lin.weight.grad is None, x.grad is not None
    (True, True)
    >>> w.run(); lin.weight.grad.tolist()
    [[1.0, 1.0]]
    """
    pairs = [(t, g) for t, g in zip(outputs, grads) if t.requires_grad]
    roots = [_node_of(t) for t, _ in pairs]
    parents = _parents(roots)
    inputs = [t for t in inputs if t.requires_grad]
    on_input_path = _ancestors([_node_of(t) for t in inputs], parents)
    off_path_roots = {r for r in roots if r not in on_input_path}
    groups = _groups([p for p in params if p.requires_grad], parents, on_input_path, off_path_roots)
    recorded: dict[Node, tuple] = {}
    boundary = {n for g in groups for n in g.boundary}
    handles = [n.register_prehook(lambda grads_in, node=n: recorded.__setitem__(node, tuple(grads_in)))
               for n in boundary]
    try:
        live = [(t, g) for (t, g), r in zip(pairs, roots) if r in on_input_path]
        if live and inputs:
            torch.autograd.backward([t for t, _ in live], [g for _, g in live], inputs=inputs, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    root_grads: dict[Node, list[tuple]] = {}
    for (t, g), r in zip(pairs, roots):
        if r in off_path_roots:
            g = torch.ones_like(t) if g is None else g
            root_grads.setdefault(r, []).append((t.output_nr if t.grad_fn is not None else 0, g))
    return WeightGrad(groups, recorded, root_grads)
