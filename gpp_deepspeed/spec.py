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
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten_with_path
from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec

from .errors import GPPConfigError, GraphError
from .graph.ir import LayerGraph, TensorRef, build_layer_graph

__all__ = ["GraphLayerSpec", "LayerEntry", "normalize_layers", "layer_graph", "layer_seed", "call_layer", "build_entry",
           "check_captured_rows", "resolve", "port_leaves", "tensors_in"]


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


def call_layer(entry: LayerEntry, fn: Callable, args: Sequence[Any]) -> Any:
    """Call a layer with its inputs in its calling convention (checking the graph inputs it reads
    against the sizes its code was captured for, if any)."""
    shapes = getattr(entry.layer, "input_shapes", None)
    if shapes:
        _check_input_shapes(entry, shapes, args)
    if entry.packed:
        return fn(args[0] if len(args) == 1 else tuple(args))
    return fn(*args)


def _check_input_shapes(entry: LayerEntry, shapes: Mapping[str, tuple], args: Sequence[Any]) -> None:
    for ref, value in zip(entry.inputs, args):
        want = shapes.get(ref)
        if want is None or not torch.is_tensor(value):
            continue
        if len(want) != value.dim() or any(w is not None and w != n for w, n in zip(want, value.shape)):
            raise GPPConfigError(
                f'input "{ref}" has shape {tuple(value.shape)}, but layer "{entry.name}" was captured for '
                f"{_shape_text(want)}: capture(..., example_inputs=...) fixes the sizes the model's code reads "
                f"({_free_text(want)}). Capture with example inputs of the shape every micro-batch has on one rank "
                "(train_micro_batch_size_per_gpu rows, divided by the stage's degree)")


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


def _shape_text(shape: tuple) -> str:
    return "(" + ", ".join("any" if d is None else str(d) for d in shape) + ")"


def _free_text(shape: tuple) -> str:
    return "the batch dimension stays free" if shape and shape[0] is None else "every dimension is fixed"


def resolve(env: dict[TensorRef, Any], ref: TensorRef) -> Any:
    """The value of ``ref`` in an environment of received ports and whole layer outputs."""
    if ref in env:
        return env[ref]
    value = env[ref.whole]
    for i, step in enumerate(ref.path):
        value = _select(value, step, ref, TensorRef(ref.node, ref.path[:i]))
    return value


def _select(value: Any, step: int | str, ref: TensorRef, at: TensorRef) -> Any:
    """One step of a reference's path: an index (tuple, list, tensor, ``ModelOutput``) or a key /
    attribute (dict, dataclass, ``ModelOutput``)."""
    try:
        if isinstance(step, int) and type(value) is not dict:
            return value[step]
        if isinstance(step, str) and isinstance(value, Mapping):
            return value[step]
        if isinstance(step, str) and not torch.is_tensor(value):
            return getattr(value, step)
    except (IndexError, KeyError, TypeError, AttributeError):
        pass
    what = f"element {step}" if isinstance(step, int) else f'"{step}"'
    raise GraphError(f'"{ref}" selects {what} of "{at}", which is {_describe(value)}')


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of a layer's value: a tensor, or tuples / lists of them nested (other leaves
    are skipped).

    >>> [tuple(t.shape) for t in tensors_in((torch.zeros(2), [torch.zeros(3, 1), None]))]
    [(2,), (3, 1)]
    """
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []


def port_leaves(ref: TensorRef, value: Any) -> Any:
    """Check that a value sent between stages is a tensor or a tuple / list of tensors.

    Only tensors cross a stage edge: a structured value (a dict, a dataclass, a ``ModelOutput``)
    is read by its leaves, which the producer's stage selects (``"enc.pooler_output"``).
    """
    if torch.is_tensor(value) or isinstance(value, (tuple, list)) and all(torch.is_tensor(v) for v in value):
        return value
    leaves = [str(TensorRef(ref.node, ref.path + tuple(k.key if hasattr(k, "key") else k.idx for k in path)))
              for path, leaf in tree_flatten_with_path(value)[0] if torch.is_tensor(leaf)]
    raise GraphError(f'"{ref}" is read by another stage, but it is {_describe(value)}, not a tensor: only '
                     f"tensors cross stages. Read the tensors it holds instead: {leaves[:8] or 'none (it holds no tensor)'}")


def _describe(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} elements"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {list(value)[:8]}"
    return f"a {type(value).__name__}"
