"""Capture an ordinary multi-branch ``nn.Module`` as a layer list with torch.fx.

Users need not rewrite a model as ``GraphLayerSpec`` entries: :func:`capture` traces ``forward``
symbolically and returns the layers, graph inputs and output that ``GraphModel`` and
``GraphPipelineModule`` take::

    captured = capture(model, input_names=["text", "image"])
    module = GraphPipelineModule(captured.layers, input_names=captured.input_names,
                                 output=captured.output, num_stages=2, loss_fn=nn.CrossEntropyLoss())

Glossary
--------
leaf
    A submodule kept whole as one layer: by default each top-level child of the module; with
    ``layers=[...]`` the named submodules, their ancestors being traced through and every other
    module met on the way kept whole.
glue
    The code of ``forward`` between leaves: ``torch.cat``, ``+``, slicing, tensor methods, the
    module's own parameters. A glue value read by a leaf or by more than one op ends a function
    layer: a ``torch.fx.GraphModule`` that runs it and the glue ops that feed only it.
metadata op
    Glue that needs no parameter and no non-metadata tensor produced by another op (``x.shape[1] // 2``,
    ``x.size(0)``, a buffer, ``torch.zeros(3)``): copied into every layer that reads it instead of
    becoming a layer, because only tensors cross stages.
selection
    Attribute access and constant indexing of a layer's output (``out.pooler_output``, ``out[0]``,
    ``out["logits"]``): written as the path of a reference (``"tower.pooler_output"``), which the
    producer's stage applies, so only the selected tensor crosses a stage edge.
shape-specialised trace
    With ``example_inputs``, a second trace on meta tensors of their shapes where plain torch.fx
    stops at control flow on sizes; the graph then holds those sizes as constants.
tie
    Layers that share a parameter become :class:`CapturedTiedLayerSpec` entries of one DeepSpeed
    tie, so the shared weight stays one weight when they land on different stages.
repeated call
    A submodule called more than once (T5's encoder applies one dropout module twice) becomes one
    layer per call: copies sharing nothing when it has no parameters, one tie when it has. One with
    buffers is refused (each copy would update its own running statistics).

The tracers themselves (leaves, the shape-specialised trace, forward hooks, errors that quote the
model's own line) are in :mod:`gpp_deepspeed.frontend._tracing`.

Every layer is a :class:`CapturedLayerSpec` whose ``build()`` returns a *deep copy* of the captured
submodule: models built from the list start from the module's current weights (nothing is
re-initialised) and share no parameter with it or with each other. A module built on the meta device
(``with torch.device("meta"): ...``) is captured without memory, and ``build()`` materialises only
the layer it builds, by the model's own initialisation (:mod:`gpp_deepspeed.frontend.meta`) or from a
checkpoint (:func:`gpp_deepspeed.load_pretrained`), so each pipeline rank allocates only its stage.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import inspect
import operator
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx, nn

from ..errors import GPPConfigError, GraphError
from ..graph.ir import TensorRef
from ..nn.layer_dict import LayerDict
from ..spec import GraphLayerSpec
from ._glue import LAYER_NAME, GlueModule
from ._batch import BATCH_ARGS, BATCH_DIM, batch_source, mark_batch, substitute_batch
from ._tracing import META, CacheArgumentError, LeafTracer, model_line, propagate_meta, trace, trace_with_shapes
from .hf import HFModelInfo
from .meta import ModuleInit, building_on_meta, check_initializable, is_meta, materialize, meta_copy
from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec

__all__ = ["CapturedLayerSpec", "CapturedTiedLayerSpec", "CapturedModel", "capture"]

_METADATA_METHODS = {"size", "dim", "numel", "ndimension", "nelement", "get_device", "type"}
_ASSERTS = (torch._assert, torch.fx._symbolic_trace._assert_is_none)


class CapturedLayerSpec(GraphLayerSpec):
    """A ``GraphLayerSpec`` around an already-built module; ``build()`` returns a deep copy of it.

    ``prefix`` is the path of the layer's submodule in the captured module, with a trailing dot
    (``"model.layers.0."``), or ``""`` for a function layer, whose tensors carry their full paths. A
    meta module is materialised by ``init`` when built (:mod:`gpp_deepspeed.frontend.meta`), or read from
    ``weights`` (set by :func:`gpp_deepspeed.load_pretrained`). ``hf`` is the Hugging Face model the
    layer belongs to (:class:`~gpp_deepspeed.frontend.hf.HFModelInfo`, set by :func:`capture`);
    ``sharding``, set by the engine while it builds a stage of tensor-parallel degree above 1, splits
    the built layer over the stage's TP group (``apply(spec, module)`` and ``slices(module)``:
    :class:`gpp_deepspeed.engine.tensor_parallel.HFTensorParallel`).
    """

    def __init__(self, name: str, module: nn.Module, *, inputs: Sequence[str], prefix: str = "",
                 init: ModuleInit | None = None):
        super().__init__(name, type(module), inputs=inputs)
        self.module = module
        self.prefix = prefix
        self.init = init
        self.weights = None
        self.hf = None
        self.sharding = None

    def build(self, log=False) -> nn.Module:
        if building_on_meta():   # counting parameters: the structure, no memory
            return meta_copy(self.module)
        if self.weights is not None:
            return self.weights.build(self)
        module = copy.deepcopy(self.module)
        if is_meta(module):
            self.check_buildable()
            materialize(module, init=self.init, path_of=self.module_path)
        # Initialised whole under the layer's seed, so every TP rank splits the same tensors.
        return module if self.sharding is None else self.sharding.apply(self, module)

    def check_buildable(self) -> None:
        """Raise a :class:`GPPConfigError` now, before any communication, if ``build()`` would leave
        a meta tensor without a value."""
        if self.weights is None and isinstance(self.module, nn.Module) and is_meta(self.module):
            if self.init is None:
                raise GPPConfigError(f'layer "{self.name}" is on the meta device but was not captured on it; '
                                     "capture the meta module itself")
            check_initializable(self.module, init=self.init, path_of=self.module_path, layer=self.name)

    def module_path(self, name: str) -> str:
        """The path in the captured module of this layer's submodule or tensor ``name``."""
        return _join(self.prefix, name)


def _join(prefix: str, name: str) -> str:
    return prefix + name if name else prefix[:-1]


class CapturedTiedLayerSpec(CapturedLayerSpec, TiedLayerSpec):
    """A captured layer sharing parameters with other layers (GPT-2's output projection and its
    token embedding): a DeepSpeed ``TiedLayerSpec`` whose module holds every layer of the tie
    (``holder[name]``), so each stage that runs one of them has the shared weights and DeepSpeed
    all-reduces their gradients across those stages. ``prefixes`` gives each member's prefix."""

    def __init__(self, name: str, holder: nn.ModuleDict, *, inputs: Sequence[str], key: str,
                 tied_weight_attr: Sequence[str], prefixes: dict[str, str] | None = None,
                 init: ModuleInit | None = None):
        LayerSpec.__init__(self, type(holder))
        self.name, self.inputs, self.module = name, tuple(inputs), holder
        self.key, self.tied_weight_attr = key, list(tied_weight_attr)
        self.forward_fn = _Member(name)
        self.prefixes = dict(prefixes or {})
        self.prefix, self.init, self.weights, self.hf, self.sharding = "", init, None, None, None

    def module_path(self, name: str) -> str:
        member, _, rest = name.partition(".")
        return _join(self.prefixes.get(member, member + "."), rest) if member else ""


class _Member:
    """``forward_fn`` of a tied captured layer: call the holder's member ``name``."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, holder: nn.ModuleDict, *args):
        return holder[self.name](*args)


@dataclass(frozen=True)
class CapturedModel:
    """The result of :func:`capture`: a layer list with its graph inputs and output layer.

    ``prefixes`` maps each layer name to the prefix its parameters have in the original module;
    ``aliases`` maps the name of a tensor the module holds under several names (T5's token
    embedding is ``shared``, ``encoder.embed_tokens`` and ``decoder.embed_tokens``) to all of them;
    ``unused`` names the module's parameters that no layer holds, because the output does not
    depend on them (they get no gradient in the module either); ``input_shapes`` gives the shapes
    the captured code assumes for each graph input (``None``: any size; empty: no shape assumed),
    see :func:`capture`; ``paths`` maps each layer that calls a submodule to that submodule's
    dotted path in the module (``"llama_model_layers_0"`` -> ``"llama.model.layers.0"``).
    """

    layers: list[CapturedLayerSpec]
    input_names: tuple[str, ...]
    output: str
    prefixes: dict[str, str]
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unused: tuple[str, ...] = ()
    input_shapes: dict[str, tuple[int | None, ...]] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)
    hf: Any = None

    def graph_model(self, **kwargs: Any):
        """The single-device :class:`~gpp_deepspeed.GraphModel` of the captured layers."""
        from ..model import GraphModel
        return GraphModel(self.layers, input_names=self.input_names, output=self.output, **kwargs)

    def stage_map(self, stages: Mapping[str, int], *, default: int | None = None) -> dict[str, int]:
        """``{layer name: stage}`` for ``partition_method=``, from stages given by module path.

        A key of ``stages`` is a submodule's dotted path as in the model (``"llama.model.layers.3"``,
        or ``"llava.model.vision_tower"`` for every layer inside it; the longest matching key wins)
        or a layer name. Layers no key covers get ``default``; glue layers (``getitem_9``, ``mul``)
        that no key names go where the first layer reading them is (or, read by none, where their
        last input is made), so a map need not name them.

        Raises :class:`~gpp_deepspeed.errors.GPPConfigError` for a key that is neither (naming
        close ones) and for layers left without a stage when there is no ``default``.
        """
        names = [s.name for s in self.layers]
        known = set(names) | {p for path in self.paths.values() for p in _ancestors(path)}
        for key in stages:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=5, cutoff=0.5)
                raise GPPConfigError(f'stage_map: "{key}" is neither a layer nor a submodule holding one; '
                                     f"close names: {close or sorted(known)[:10]}")
        stage_of: dict[str, int] = {}
        for name in names:
            keys = [name] if name in stages else [p for p in _ancestors(self.paths.get(name, "")) if p in stages]
            if keys:
                stage_of[name] = stages[max(keys, key=len)]
            elif name in self.paths and default is not None:
                stage_of[name] = default
        inputs = {s.name: [TensorRef.parse(r).node for r in s.inputs] for s in self.layers}
        for name in reversed(names):   # readers come after what they read
            readers = [stage_of[s] for s in names if name in inputs[s] and s in stage_of]
            if name not in stage_of and readers:
                stage_of[name] = min(readers)
        for name in names:
            made = [stage_of[i] for i in inputs[name] if i in stage_of]
            if name not in stage_of and made:
                stage_of[name] = max(made)
        missing = [n for n in names if n not in stage_of]
        if missing:
            raise GPPConfigError(f"stage_map: no stage for layers {missing[:6]}; name them (or a submodule holding "
                                 "them) or pass default=")
        return stage_of

    def module_state_dict(self, graph_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rename a GraphModel (or ``graph_state_dict()``) state to the original module's names
        (every name of a tensor the module holds under several, as its ``state_dict()`` does)."""
        out = {}
        for key, value in graph_state.items():
            kind, layer, rest = key.split(".", 2)
            if kind == "tied":  # tied.<key>.<layer>.<param>
                layer, rest = rest.split(".", 1)
            name = self.prefixes[layer] + rest
            out.update(dict.fromkeys(self.aliases.get(name, (name, )), value))
        return out


def capture(module: nn.Module, *, input_names: Sequence[str] | None = None, layers: Sequence[str] | None = None,
            concrete_args: dict[str, Any] | None = None, example_inputs: Sequence[torch.Tensor] | None = None,
            init_fn: Callable[[nn.Module], None] | None = None) -> CapturedModel:
    """Trace ``module`` at module granularity into a :class:`CapturedModel`.

    ``input_names`` names the graph inputs (default: the forward's argument names); ``layers``
    names the submodules to keep as leaves (default: each top-level child); ``concrete_args`` fixes
    arguments such as flags, as in ``torch.fx.symbolic_trace``.

    Where plain torch.fx stops at control flow on tensor sizes (``transformers``' mask builders
    check ``batch_size != position_ids.shape[0]``), ``example_inputs`` (one tensor per forward
    argument, in order: one micro-batch as one rank sees it) lets capture trace again on meta
    tensors of their shapes. The sizes the code reads are then constants, except the batch
    dimension where they follow it linearly (see :mod:`gpp_deepspeed.frontend._batch`);
    ``CapturedModel.input_shapes`` says which remain, and a micro-batch of another shape is refused
    naming both. With a plain trace, ``example_inputs`` only tell capture the dtypes of the values
    (so that an input read only for its dtype need not cross stages); nothing is specialised.

    A module on the meta device costs no memory here; each layer is materialised when built
    (:mod:`gpp_deepspeed.frontend.meta`), by ``init_fn(submodule)`` when given (it fills one submodule's own
    tensors), else by the Hugging Face model's ``_init_weights`` or the submodule's
    ``reset_parameters()``, unless :func:`gpp_deepspeed.load_pretrained` gives it a checkpoint.
    """
    named = _check_layers(module, layers)
    shapes: list[tuple] = []    # the example inputs' shapes where the graph assumes them
    try:
        graph, consts = trace(module, LeafTracer(named), concrete_args), {}
        if example_inputs is not None and not concrete_args:
            propagate_meta(module, graph, example_inputs)
    except CacheArgumentError:
        raise
    except GraphError as plain:
        if example_inputs is None:
            raise
        graph, consts = trace_with_shapes(module, named, concrete_args, example_inputs, plain)
        shapes = [tuple(x.shape) for x in example_inputs]
        rows = {s[0] if s else None for s in shapes}
        if len(rows) == 1 and None not in rows and mark_batch(graph, consts, lambda r: trace_with_shapes(
                module, named, concrete_args, [x.new_empty((r, *x.shape[1:]), device="meta") for x in example_inputs],
                plain), rows.pop()):
            shapes = [(None, *s[1:]) for s in shapes]
    placeholders = _strip_concrete(graph, module, concrete_args or {})
    dropped = _drop_dead_calls(graph)
    if dropped:
        warnings.warn(f"capture leaves out the calls of submodules {dropped[:6]} whose results the output of "
                      f"{type(module).__name__} does not depend on; parameters that only those calls read get no "
                      "gradient in the module either, and are not part of the pipeline nor of its checkpoints "
                      "(CapturedModel.unused)", stacklevel=2)
    if input_names is None:
        input_names = [str(p.target) for p in placeholders]
    elif isinstance(input_names, str) or len(input_names) != len(placeholders):
        raise GPPConfigError(f"input_names {input_names!r} must list one name per input of "
                             f"{type(module).__name__}.forward: {[str(p.target) for p in placeholders]}")
    init = ModuleInit.of(module, init_fn) if is_meta(module) else None
    captured = _to_layers(module, graph, placeholders, tuple(input_names), consts, init)
    if layers is None and len(captured.paths) == 1:
        warnings.warn(_one_layer_hint(module, next(iter(captured.paths.values()))), stacklevel=2)
    if shapes:
        fixed = dict(zip(captured.input_names, shapes))
        for spec in captured.layers:
            spec.input_shapes = fixed
        captured = dataclasses.replace(captured, input_shapes=fixed)
    return captured


def _one_layer_hint(module: nn.Module, child: str) -> str:
    """Why a default capture gave one layer, and which submodules to name instead."""
    blocks = max(((n, m) for n, m in module.named_modules() if isinstance(m, nn.ModuleList)),
                 key=lambda item: len(item[1]), default=None)
    example = (f'; for instance the {len(blocks[1])} blocks of "{blocks[0]}" ("{blocks[0]}.0", "{blocks[0]}.1", ...) '
               "and the modules before and after them" if blocks else "")
    return (f'capture kept each top-level child of {type(module).__name__} whole (layers=None), and it has one, '
            f'"{child}": the captured model is one layer and cannot be cut into stages. Name the submodules to '
            f"keep whole in layers=[...]{example}")


def _check_layers(module: nn.Module, layers: Sequence[str] | None) -> set[str]:
    if layers is None:
        return set()
    if isinstance(layers, str):
        raise GPPConfigError(f"layers must be a list of submodule names, got the string {layers!r}")
    known = [n for n, _ in module.named_modules() if n]
    for name in layers:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=5, cutoff=0.5)
            raise GPPConfigError(f'layers names "{name}", which is not a submodule of {type(module).__name__}; '
                                 f"close names: {close or known[:10]}")
    return set(layers)


def _strip_concrete(graph: fx.Graph, module: nn.Module, concrete_args: dict) -> list[fx.Node]:
    """Drop the placeholders of ``concrete_args`` and fx's asserts on them; return the others."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    params = list(inspect.signature(module.forward).parameters)
    fixed = {p for p, name in zip(placeholders, params) if name in concrete_args}
    derived = set(fixed)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTS:
            graph.erase_node(node)
        elif node.op != "placeholder" and node.all_input_nodes and set(node.all_input_nodes) <= derived:
            derived.add(node)
    for node in reversed(list(graph.nodes)):
        # Values computed and never read (an output field nobody uses, a mask for another
        # attention kernel) are dropped.
        if not node.users and (node in derived or _is_pure(node)):
            graph.erase_node(node)
    for node in graph.nodes:
        if node.op in ("call_function", "call_method") and not node.users:
            raise GraphError(f'the result of glue op "{node.name}" ({node.target}) is unused{model_line(node)}; '
                             "in-place ops between submodules cannot be captured: assign the result instead")
    return [p for p in placeholders if p not in fixed or p.users]


def _drop_dead_calls(graph: fx.Graph) -> list[str]:
    """Erase what the output does not depend on (Llava's vision tower runs a last layer whose output
    it does not read); return the submodules whose calls went."""
    live: set[fx.Node] = set()
    stack = [n for n in graph.nodes if n.op == "output"]
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(node.all_input_nodes)
    dead = [n for n in graph.nodes if n not in live and n.op != "placeholder"]
    used = {str(n.target) for n in live if n.op == "call_module"}
    # A submodule whose other call is used is named by the unused call's line: its weights stay.
    names = [str(n.target) if str(n.target) not in used else f"{n.target} (its call{model_line(n)})"
             for n in dead if n.op == "call_module"]
    for node in reversed(dead):
        graph.erase_node(node)
    return list(dict.fromkeys(names))


def _is_pure(node: fx.Node) -> bool:
    """Not an in-place op (``x.add_(y)``, ``torch.relu_``, ``inplace=True``): an unused result can go."""
    if node.op in ("placeholder", "output", "call_module"):
        return False
    name = getattr(node.target, "__name__", str(node.target))
    return not (name.endswith("_") and not name.endswith("__") or node.kwargs.get("inplace") is True)


def _selection_step(node: fx.Node) -> int | str | None:
    """The path step of a selection op, ``x[i]``, ``x["key"]`` or ``x.field`` (not a tensor
    attribute such as ``x.shape``): it becomes part of a reference, applied on the producer's stage."""
    if node.op != "call_function" or len(node.args) != 2 or node.kwargs:
        return None
    key = node.args[1]
    if isinstance(node.args[0], fx.Node) and torch.is_tensor(node.args[0].meta.get(META)) and isinstance(key, int):
        return None   # a row of a tensor (Llava's list(image_features)) is glue, not a selection
    if node.target is operator.getitem and isinstance(key, (int, str)) and not isinstance(key, bool):
        return key
    if node.target is getattr and isinstance(key, str) and not hasattr(torch.Tensor, key):
        return key
    return None


def _check_repeated_calls(module: nn.Module, nodes: list[fx.Node]) -> None:
    """A submodule called more than once becomes one layer per call (copies of it). Without
    parameters the copies share nothing (a dropout, an activation); with parameters the copies
    are one tie (:func:`_tie_shared`), so the weights stay one weight. Buffers (running statistics)
    would be updated apart by each copy: such a submodule is refused."""
    first: dict[str, fx.Node] = {}
    for n in nodes:
        if n.op != "call_module":
            continue
        if n.target not in first:
            first[n.target] = n
            continue
        buffers = [b for b, _ in module.get_submodule(n.target).named_buffers()]
        if buffers:
            caller = _caller(n)
            keep = (f'name the submodule whose forward calls it in layers= ("{caller}") so the calls stay in one layer'
                    if caller else "call it once in forward")
            raise GraphError(f'submodule "{n.target}" is called more than once{model_line(first[n.target])}{model_line(n)} '
                             f"and holds buffers {buffers[:4]}; each call would become a layer of its own, and "
                             f"copies of those buffers (running statistics) would be updated apart: {keep}, or give "
                             "each call its own submodule")


def _caller(node: fx.Node) -> str:
    """The traced-through module whose forward made the call ``node`` ("" for the root's forward)."""
    stack = [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
    return stack[-2] if len(stack) >= 2 else ""


def _classify(nodes: list[fx.Node], result: fx.Node, is_param) -> tuple[set, dict]:
    """Split glue into metadata ops copied into their readers (``inline``) and selections of a
    layer's output (``refs``: node -> (producer, path)), so that only the selected leaves of a
    structured output (a tuple, a dict, a ``ModelOutput``) cross stages."""
    inline: set[fx.Node] = set()
    refs: dict[fx.Node, tuple[fx.Node, tuple]] = {}
    for n in nodes:
        if n.op not in ("placeholder", "output", "call_module") and not is_param(n):
            step, src = _selection_step(n), n.args[0] if n.args else None
            if step is not None and isinstance(src, fx.Node) and (
                    src in refs or src.op in ("call_module", "call_function", "call_method") and src not in inline):
                base, path = refs.get(src, (src, ()))
                refs[n] = (base, path + (step, ))
                continue
            if n is result:
                continue
            metadata = (n.op == "get_attr" or n.op == "call_function" and n.target is getattr
                        or n.op == "call_method" and n.target in _METADATA_METHODS)
            if metadata or all(a in inline for a in n.all_input_nodes):
                inline.add(n)
    return inline, refs


def _to_layers(module: nn.Module, graph: fx.Graph, placeholders: list[fx.Node],
               input_names: tuple[str, ...], consts: dict[str, torch.Tensor], init: ModuleInit | None) -> CapturedModel:
    nodes = list(graph.nodes)
    result = nodes[-1].args[0]
    if not isinstance(result, fx.Node) or result.op in ("placeholder", "get_attr"):
        what = f"a {type(result).__name__.replace('immutable_', '')} {result!r}" if result is not None else "None"
        raise GraphError(f"{type(module).__name__}.forward returns {what}; the "
                         "runtime feeds one tensor to the loss, so forward must return one tensor computed "
                         "from its inputs (return extra values from a separate method)")
    params = dict(module.named_parameters())
    is_param = lambda n: n.op == "get_attr" and n.target in params
    _check_repeated_calls(module, nodes)
    inline, refs = _classify(nodes, result, is_param)
    # Each glue op joins the layer of its only user when that user is glue: a chain ends in one layer.
    group: dict[fx.Node, fx.Node] = {}
    for n in reversed(nodes):
        if n.op in ("placeholder", "output") or n in inline or n in refs or is_param(n):
            continue
        users = list(n.users)
        joins = (n.op != "call_module" and n is not result and len(users) == 1 and users[0] in group
                 and users[0].op != "call_module")
        group[n] = group[users[0]] if joins else n
    roots = [n for n in nodes if group.get(n) is n]
    taken = set(input_names)
    name_of: dict[fx.Node, str] = dict(zip(placeholders, input_names))
    for root in roots:
        name_of[root] = _fresh(str(root.target).replace(".", "_") if root.op == "call_module" else root.name, taken)

    def ref(n: fx.Node) -> str:
        if n in refs:
            src, path = refs[n]
            return str(TensorRef(name_of[src], path))
        return name_of[n]

    owners: dict[str, str] = {}
    specs, prefixes = [], {}
    for root in roots:
        members = [n for n in nodes if group.get(n) is root]
        args = list(root.args)
        if root.op == "call_module" and not root.kwargs and args and all(
                isinstance(a, fx.Node) and (a in name_of or a in refs) for a in args):
            layer, inputs = module.get_submodule(root.target), [ref(a) for a in args]
            prefixes[name_of[root]] = root.target + "."
        else:
            layer, inputs = _function_layer(module, members, root, inline, is_param, ref, owners, name_of[root],
                                            consts)
            prefixes[name_of[root]] = ""
        specs.append(CapturedLayerSpec(name_of[root], layer, inputs=inputs, prefix=prefixes[name_of[root]], init=init))
    if result in refs:  # forward returns a selection of a layer's output: the loss reads that leaf
        name_of[result] = _fresh(result.name, taken)
        specs.append(CapturedLayerSpec(name_of[result], nn.Identity(), inputs=[ref(result)]))
        prefixes[name_of[result]] = ""
    aliases = _aliases(module)
    held = {prefixes[s.name] + n for s in specs for n, _ in s.module.named_parameters()}
    unused = tuple(n for n, _ in module.named_parameters() if not held & set(aliases.get(n, (n, ))))
    paths = {name_of[r]: str(r.target) for r in roots if r.op == "call_module"}
    hf = HFModelInfo.find(module)
    specs = _tie_shared(specs, init)
    for spec in specs:
        spec.hf = hf
    return CapturedModel(specs, input_names, name_of[result], prefixes, aliases, unused, paths=paths, hf=hf)


def _ancestors(path: str) -> list[str]:
    """``"a.b.c"`` -> ``["a", "a.b", "a.b.c"]`` (``""`` -> ``[]``)."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _aliases(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each name of a tensor that ``module.state_dict()`` holds under more than one name -> all its names."""
    names: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    return {n: tuple(group) for group in names.values() if len(group) > 1 for n in group}


def _tie_shared(specs: list[CapturedLayerSpec], init: ModuleInit | None = None) -> list[CapturedLayerSpec]:
    """Make the layers that share a parameter one tie (copies would train apart)."""
    owner: dict[int, str] = {}
    group = {s.name: s.name for s in specs}

    def find(n):
        while group[n] != n:
            n = group[n]
        return n

    for spec in specs:
        if isinstance(spec.module, nn.Module):
            for p in spec.module.parameters():
                group[find(spec.name)] = find(owner.setdefault(id(p), spec.name))
    members: dict[str, list[CapturedLayerSpec]] = {}
    for spec in specs:
        members.setdefault(find(spec.name), []).append(spec)
    out = []
    for spec in specs:
        tie = members[find(spec.name)]
        if len(tie) == 1:
            out.append(spec)
            continue
        holder = LayerDict({m.name: m.module for m in tie})
        named = dict(holder.named_parameters(remove_duplicate=False))
        users = {}
        for name, p in named.items():
            users.setdefault(id(p), []).append(name)
        alone = [names[0] for names in users.values() if len({n.split(".", 1)[0] for n in names}) == 1]
        if alone:
            raise GraphError(f"layers {[m.name for m in tie]} share parameters, but {alone[:4]} belong to only one "
                             "of them; a tie may hold only shared parameters: keep the layers that share "
                             "weights free of other parameters (or capture them as one layer)")
        out.append(CapturedTiedLayerSpec(spec.name, holder, inputs=spec.inputs, key=f"tie_{tie[0].name}",
                                         tied_weight_attr=[names[0] for names in users.values()],
                                         prefixes={m.name: m.prefix for m in tie}, init=init))
    return out


def _fresh(base: str, taken: set[str]) -> str:
    """``base``, or ``base_k`` for the least ``k`` that makes it a new name (added to ``taken``)."""
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def _function_layer(module, members, root, inline, is_param, ref, owners, name, consts):
    """A GraphModule running ``members`` (plus copies of the metadata ops they read) -> (layer, inputs)."""
    member_set = set(members)
    copied, external = [], []

    def walk(n):
        for a in n.all_input_nodes:
            if a in member_set or a in copied or a in external:
                continue
            if a in inline or is_param(a):
                walk(a)
                copied.append(a)
            else:
                external.append(a)

    for n in members:
        walk(n)
    if not external:
        external = [_anchor_input(root, [n for n in copied if is_param(n)], name, ref)]
    keep = set(copied) | member_set
    donors = _metadata_donors(module, external, keep)
    inputs = [a for a in external if a not in donors]
    source = None
    if any(BATCH_ARGS in n.meta for n in keep):
        # Sizes that follow the rows are computed from the rows of a tensor the layer reads
        # (else of a graph input, which the layer's stage then loads).
        source = batch_source(inputs) or batch_source([n for n in root.graph.nodes if n.op == "placeholder"])
        donors.pop(source, None)
        inputs += [source] if source not in inputs else []
    sub = fx.Graph()
    env = {a: sub.placeholder(f"in{i}") for i, a in enumerate(inputs)}
    for a, donor in donors.items():
        env[a] = env[donor] if isinstance(donor, fx.Node) else sub.get_attr(donor)
    rows = functools.cache(lambda: sub.call_method("size", (env[source], source.meta[BATCH_DIM])))
    for n in (n for n in root.graph.nodes if n in keep):
        if is_param(n):
            owner = owners.setdefault(n.target, name)
            if owner != name:
                raise GraphError(f'parameter "{n.target}" is read by the glue code of two layers ("{owner}" and '
                                 f'"{name}"){model_line(n)}; move the code that uses it into a submodule')
        env[n] = sub.node_copy(n, lambda a: env[a])
        substitute_batch(sub, env[n], n, rows)
    sub.output(env[root]).meta[LAYER_NAME] = name
    targets = {n.target for n in sub.nodes if n.op in ("get_attr", "call_module")}
    owner = {t: consts[t] if t in consts else functools.reduce(getattr, t.split("."), module) for t in targets}
    return GlueModule(owner, sub, class_name=f"Glue_{name}"), [ref(a) for a in inputs]


def _anchor_input(root: fx.Node, params: list[fx.Node], name: str, ref) -> fx.Node:
    """The graph input that a layer computed from the module's parameters alone reads (a learned
    query or class token expanded to the batch: ``query_tokens.expand(b, -1, -1)``): a layer needs an
    input to be scheduled, and one with a batch dimension gives the rows where they follow the
    batch. The layer holds the parameters, so they live on the stage that runs it."""
    if not params:
        raise GraphError(f'layer "{name}" ({root.name}{model_line(root)}) reads no tensor from the inputs or other '
                         "layers; compute it inside a submodule or from an input")
    inputs = []
    for n in root.graph.nodes:
        if n.op == "placeholder":
            try:
                ref(n)
            except KeyError:   # an input fixed by concrete_args
                continue
            inputs.append(n)
    return batch_source(inputs) or inputs[0]


def _metadata_donors(module: nn.Module, external: list[fx.Node], keep: set[fx.Node]) -> dict[fx.Node, Any]:
    """The inputs of a function layer that it reads only for their ``.device`` or ``.dtype``, each
    with a value the layer already holds that answers the same: a node of another input, or the name of
    a parameter or buffer of a submodule the layer calls. Those inputs then cross no stage edge.

    Rules (``docs/capture.md``): every tensor a stage holds is on the rank's device, so any of its
    tensors answers ``.device``; tensors whose dtypes were equal at capture are equal at run time
    (``module.to(dtype)``, DeepSpeed's bf16/fp16 cast everything floating alike), so a value with the
    same capture-time dtype (known from the example inputs' trace) answers ``.dtype``.
    """
    held = [(str(n.target), t) for n in keep if n.op == "call_module"
            for t in _named_tensors(module.get_submodule(str(n.target)))]
    donors: dict[fx.Node, Any] = {}
    for a in external:
        reads = {u.args[1] for u in a.users if u in keep} if all(
            u.op == "call_function" and u.target is getattr and u.args[1] in ("device", "dtype")
            for u in a.users if u in keep) else set()
        if not reads:
            continue
        dtype = _meta_dtype(a)
        if "dtype" in reads and dtype is None:
            continue  # its capture-time dtype is unknown: no value can be shown to answer for it
        others = [b for b in external if b is not a and b not in donors and _meta_dtype(b) is not None
                  and ("dtype" not in reads or _meta_dtype(b) == dtype)]
        own = [f"{path}.{t_name}" for path, (t_name, t) in held if "dtype" not in reads or t.dtype == dtype]
        donor = own[0] if own else others[0] if others else None
        if donor is not None:
            donors[a] = donor
    if len(donors) == len(external):
        return {}   # keep one input: a layer that reads nothing could not be scheduled
    return donors


def _named_tensors(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*m.named_parameters(), *m.named_buffers()]


def _meta_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype ``node`` had in the trace with the example inputs' shapes, if it is a tensor there."""
    value = node.meta.get(META)
    return value.dtype if torch.is_tensor(value) else None
