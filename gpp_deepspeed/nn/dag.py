"""Running a DAG of layers on values: the one interpreter of a layer list.

:class:`~gpp_deepspeed.GraphModel` runs the whole graph, a pipeline stage
(:class:`~gpp_deepspeed.GraphPipelineModule`) runs its own layers, in chunks under activation
checkpointing, and the profiler (:mod:`gpp_deepspeed.profiler`) runs one layer at a time on several
micro-batch sizes; all of them step through :func:`run_layer`. ::

    env = {TensorRef("x"): x}                                  # graph inputs (or received ports)
    run_layers(env, [(entry, fn) for entry, fn in layers])     # in the graph's order
    y = resolve(env, TensorRef(output))

Glossary
--------
entry
    One node of the layer list, a :class:`~gpp_deepspeed.spec.LayerEntry`: its ``name``, the
    references it reads (``inputs``), whether it takes them packed in one argument (``packed``),
    and the spec it was built from (``layer``, whose ``input_shapes`` a call checks).
environment
    ``{TensorRef: value}``: the graph inputs or received ports, and the whole output of every layer
    run so far, stored under the layer's name.
reference
    A :class:`~gpp_deepspeed.graph.ir.TensorRef`: a layer's output or a path into it
    (``"enc.hidden_states:-1"``), which :func:`resolve` applies.

Torch only: nothing here imports DeepSpeed, the engine or the front end.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten_with_path

from ..errors import GPPConfigError, GraphError
from ..graph.ir import TensorRef

__all__ = ["run_layer", "run_layers", "layer_refs", "call_layer", "resolve", "tensors_in", "port_leaves"]


def layer_refs(entry: Any) -> tuple[TensorRef, tuple[TensorRef, ...]]:
    """Where ``entry``'s output goes in an environment and the references it reads: what
    :func:`run_layer` works out at each call, made once by a caller that runs the same layers
    for every micro-batch (a pipeline stage)."""
    return TensorRef(entry.name), tuple(TensorRef.parse(r) for r in entry.inputs)


def run_layer(env: dict[TensorRef, Any], entry: Any, fn: Callable, *, call: Callable | None = None,
              refs: tuple[TensorRef, tuple[TensorRef, ...]] | None = None) -> Any:
    """Run one layer on ``env``: look its inputs up, call it, store its output under its name.

    Returns the output. ``call(entry, fn, args)`` runs the layer; by default :func:`call_layer`
    (the profiler passes one that also times it). ``refs``: the entry's :func:`layer_refs`, if
    the caller keeps them.
    """
    out, reads = refs or layer_refs(entry)
    env[out] = value = (call or call_layer)(entry, fn, [resolve(env, r) for r in reads])
    return value


def run_layers(env: dict[TensorRef, Any], layers) -> dict[TensorRef, Any]:
    """Run ``layers``, ``(entry, fn)`` pairs in an order where every layer follows those it reads,
    on ``env``; returns ``env``, now holding every layer's output."""
    for entry, fn in layers:
        run_layer(env, entry, fn)
    return env


def call_layer(entry: Any, fn: Callable, args: Sequence[Any]) -> Any:
    """Call a layer with its inputs in its calling convention (checking the graph inputs it reads
    against the sizes its code was captured for, if any)."""
    shapes = getattr(entry.layer, "input_shapes", None)
    if shapes:
        _check_input_shapes(entry, shapes, args)
    if entry.packed:
        return fn(args[0] if len(args) == 1 else tuple(args))
    return fn(*args)


def _check_input_shapes(entry: Any, shapes: Mapping[str, tuple], args: Sequence[Any]) -> None:
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
