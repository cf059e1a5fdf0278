"""GraphModel: a layer DAG as a plain ``nn.Module`` on one device.

It is the single-device twin of a :class:`~gpp_deepspeed.GraphPipelineModule` built from the same
layer list: same layers, same build seeds, same computation. Use it for evaluation, export and
debugging, and as the reference that pipelined training must match.

Parameters are named ``layers.<layer name>.<param>`` (and ``tied.<key>.<param>`` for tied layers),
the names :meth:`GraphPipelineModule.graph_state_dict` uses, so pipelined weights load into it.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from torch import nn
from deepspeed.runtime.pipe.module import TiedLayerSpec

from .graph.ir import LayerGraph, TensorRef, build_layer_graph
from .nn.dag import port_leaves, resolve, run_layers, tensors_in
from .nn.layer_dict import LayerDict
from .spec import LayerEntry, build_entry, normalize_layers

__all__ = ["GraphModel"]


class GraphModel(nn.Module):
    """The layer DAG on one device: ``forward(*inputs)`` returns the output layer's value.

    Plain ``nn.Module`` entries of the list are deep-copied, so the twin never shares weights with
    a pipelined model built from the same list.
    """

    def __init__(self, layers: Sequence[Any], *, input_names: Sequence[str] = ("input", ), output: str | None = None,
                 base_seed: int = 1234):
        super().__init__()
        self.entries: list[LayerEntry] = normalize_layers(layers, input_names, base_seed=base_seed)
        self.graph: LayerGraph = build_layer_graph(input_names, [(e.name, e.inputs) for e in self.entries],
                                                   output=output)
        self.layers = LayerDict()   # any layer name, "to" or "train" included
        self.tied = LayerDict()
        self._funcs: dict[str, Any] = {}
        for entry in self.entries:
            key = entry.tie_key
            if key is not None:
                if key not in self.tied:
                    self.tied[key] = build_entry(entry)
                spec: TiedLayerSpec = entry.layer
                module = self.tied[key]
                self._funcs[entry.name] = module if spec.forward_fn is None else _bind(spec.forward_fn, module)
                continue
            layer = build_entry(entry)
            if isinstance(entry.layer, nn.Module):
                layer = copy.deepcopy(layer)
            if isinstance(layer, nn.Module):
                self.layers[entry.name] = layer
            self._funcs[entry.name] = layer
        self._by_name = {e.name: e for e in self.entries}

    def forward(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != len(self.graph.input_names):
            raise TypeError(f"GraphModel takes {len(self.graph.input_names)} inputs "
                            f"({list(self.graph.input_names)}), got {len(inputs)}")
        return self._run(inputs)[TensorRef(self.graph.output)]

    def _run(self, inputs: Sequence[Any]) -> dict[TensorRef, Any]:
        """Every layer run in the graph's order on ``inputs``: the environment of all their outputs."""
        env: dict[TensorRef, Any] = {TensorRef(n): x for n, x in zip(self.graph.input_names, inputs)}
        return run_layers(env, ((self._by_name[name], self._funcs[name]) for name in self.graph.order))

    @torch.no_grad()
    def edge_bytes(self, partition, *inputs: torch.Tensor) -> dict[tuple[int, int], int]:
        """Bytes that each stage edge ``(src, dst)`` of ``partition`` (a
        :class:`~gpp_deepspeed.graph.stages.Partition` of this model's graph) carries for the
        micro-batch ``inputs``: the tensors the engine sends forward, measured on this forward
        (their gradients return as many bytes)."""
        env = self._run(inputs)
        sizes = {}
        for edge in partition.stage_graph.edges:
            leaves = [port_leaves(ref, resolve(env, ref)) for ref in edge.tensors]
            sizes[(edge.src, edge.dst)] = sum(t.numel() * t.element_size() for t in tensors_in(leaves))
        return sizes

    def load_pipeline_checkpoint(self, load_dir: str, tag: str | None = None, *,
                                 optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Load a checkpoint the pipeline engine wrote (any partition), and the per-layer optimizer
        state into ``optimizer`` where it was saved; returns the engine's counters
        (``global_steps``, ...). See :mod:`gpp_deepspeed.checkpoint`."""
        from .checkpoint import load_graph_model
        return load_graph_model(self, load_dir, tag, optimizer=optimizer)

    def save_pipeline_checkpoint(self, save_dir: str, tag: str, *, optimizer: torch.optim.Optimizer | None = None,
                                 global_steps: int = 0) -> str:
        """Write this model (and ``optimizer``'s state, per layer) as a checkpoint that
        ``engine.load_checkpoint`` loads under any partition; returns its folder."""
        from .checkpoint import save_graph_model
        return save_graph_model(self, save_dir, tag, optimizer=optimizer, global_steps=global_steps)


def _bind(forward_fn, module):
    return lambda *args: forward_fn(module, *args)
