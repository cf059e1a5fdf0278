"""Layer specifications: how a user's layer list becomes named graph nodes.

A :class:`GraphLayerSpec` is a DeepSpeed ``LayerSpec`` with a unique name and named inputs. Any
other entry of the list (``LayerSpec``, ``TiedLayerSpec``, an ``nn.Module`` or a callable) behaves as
in DeepSpeed: it takes the previous entry's output as its one argument, so an unchanged DeepSpeed
layer list is a chain.

Every layer is built under its own seed, so a pipelined model and its single-device twin start
from identical weights whatever the partition:

* a ``GraphLayerSpec`` named ``n``: ``base_seed + crc32(n)``;
* any other entry at list index ``i``: ``base_seed + i``, DeepSpeed's ``seed_layers=True`` rule, so a
  plain layer list starts exactly as ``PipelineModule(..., seed_layers=True)`` does;
* a ``TiedLayerSpec``: the seed of the first entry with its key, so every copy is identical.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec

from .errors import GPPConfigError, GraphError
from .graph.ir import LayerGraph, build_layer_graph

__all__ = ["GraphLayerSpec", "LayerEntry", "normalize_layers", "layer_graph", "layer_seed", "build_entry",
           "check_captured_rows"]


class GraphLayerSpec(LayerSpec):
    """A DeepSpeed ``LayerSpec`` with a unique ``name`` and the names of its ``inputs``.

    Each input is a graph input (from ``input_names``), another layer's name, ``"name:i"`` for
    element ``i`` of a layer that returns a tuple, or ``"name.key"`` for a key or attribute of a
    layer that returns a dict, a dataclass or a ``ModelOutput`` (steps chain: ``"enc.hidden_states:-1"``).
    A layer may return any such structure; only the tensors other stages read cross a stage edge.
    The layer's forward gets them positionally::

        GraphLayerSpec("fuse", Concat, inputs=["text_block", "image_block"])  # Concat.forward(a, b)

    ``input_shapes`` maps graph input names to the shapes the layer's code assumes (``None`` for a
    dimension of any size); :func:`~gpp_deepspeed.capture` sets it when it traces with
    ``example_inputs``, and every call checks the graph inputs the layer reads against it.
    """

    input_shapes: Mapping[str, tuple[int | None, ...]] = {}

    def __init__(self, name: str, typename: type, *module_args, inputs: Sequence[str] = (), **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        if isinstance(inputs, str):
            inputs = [inputs]
        self.name = name
        self.inputs = tuple(str(i) for i in inputs)

    def __repr__(self) -> str:
        return f"GraphLayerSpec({self.name!r}, {super().__repr__()}, inputs={list(self.inputs)})"


@dataclass(frozen=True)
class LayerEntry:
    """One entry of the layer list as a graph node.

    ``packed`` entries (plain DeepSpeed entries) take their inputs as one argument, a tensor or a
    tuple, as DeepSpeed's sequential forward does; ``GraphLayerSpec`` entries take them positionally.
    """

    name: str
    layer: Any
    inputs: tuple[str, ...]
    seed: int
    packed: bool

    @property
    def tie_key(self) -> str | None:
        return self.layer.key if isinstance(self.layer, TiedLayerSpec) else None


def layer_seed(base_seed: int, name: str) -> int:
    """The build seed of a ``GraphLayerSpec`` named ``name``.

    >>> layer_seed(1234, "head") == layer_seed(1234, "head")
    True
    """
    return base_seed + zlib.crc32(name.encode()) % (2**31)


def normalize_layers(layers: Sequence[Any], input_names: Sequence[str], *, base_seed: int) -> list[LayerEntry]:
    """Turn a user's layer list into named entries with explicit inputs and build seeds."""
    if isinstance(input_names, str):
        raise GraphError(f"input_names must be a list of names, got the string {input_names!r}")
    layers = list(layers)
    if not layers:
        raise GraphError("the layer list is empty")
    tie_seed: dict[str, int] = {}
    entries = []
    previous: tuple[str, ...] = tuple(input_names)
    for idx, layer in enumerate(layers):
        if isinstance(layer, GraphLayerSpec):
            entry = LayerEntry(layer.name, layer, layer.inputs, layer_seed(base_seed, str(layer.name)), packed=False)
        elif isinstance(layer, (LayerSpec, nn.Module)) or callable(layer):
            seed = base_seed + idx
            if isinstance(layer, TiedLayerSpec):
                seed = tie_seed.setdefault(layer.key, seed)
            entry = LayerEntry(f"layer{idx}", layer, previous, seed, packed=True)
        else:
            raise GraphError(f"entry {idx} of the layer list is a {type(layer).__name__}, not a LayerSpec, "
                             "nn.Module or callable")
        entries.append(entry)
        previous = (entry.name, )
    return entries


def layer_graph(layers: Sequence[Any], *, input_names: Sequence[str] = ("input", ),
                output: str | None = None) -> LayerGraph:
    """The layer DAG of a layer list, as :class:`~gpp_deepspeed.GraphPipelineModule` derives it,
    without building any layer: what :func:`~gpp_deepspeed.partitioning.resolve_partition` cuts
    when a partition is resolved ahead of time.

    >>> g = layer_graph([GraphLayerSpec("a", nn.Linear, 2, 2, inputs=["x"]), nn.ReLU()], input_names=["x"])
    >>> [(n.name, [str(r) for r in n.inputs]) for n in g.nodes]
    [('a', ['x']), ('layer1', ['a'])]
    """
    entries = normalize_layers(layers, input_names, base_seed=0)  # seeds play no part in the graph
    return build_layer_graph(input_names, [(e.name, e.inputs) for e in entries], output=output)


def build_entry(entry: LayerEntry) -> Any:
    """Build an entry's module under its seed (specs), or return it as is (modules, callables)."""
    if isinstance(entry.layer, LayerSpec):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(entry.seed)
            return entry.layer.build()
    return entry.layer


def check_captured_rows(entries: Sequence[LayerEntry], stage_of: Mapping[str, int],
                        rows_of_stage: Sequence[int]) -> None:
    """Refuse, before any communication, a micro-batch whose rows on some stage differ from the
    rows a layer of that stage was captured for (a capture whose batch dimension stayed fixed).
    Every rank runs it on the same values and raises the same error."""
    for entry in entries:
        shapes = getattr(entry.layer, "input_shapes", None) or {}
        fixed = {s[0] for s in shapes.values() if s and s[0] is not None}
        stage = stage_of[entry.name]
        for rows in fixed:
            if rows != rows_of_stage[stage]:
                raise GPPConfigError(
                    f'layer "{entry.name}" (stage {stage}) was captured for micro-batches of {rows} rows, but a rank '
                    f"of stage {stage} runs {rows_of_stage[stage]} rows per micro-batch. The capture could not keep "
                    "the batch dimension symbolic (its traced code depends on the rows beyond sizes that follow them: "
                    "Llava unrolls list(image_features) one step per row), so every rank of every stage must see "
                    f"{rows} rows: capture with example inputs of {rows_of_stage[stage]} rows, or choose the micro-batch "
                    "and stage degrees so that every rank sees the same rows")
