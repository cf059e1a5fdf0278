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

Every layer is a :class:`CapturedLayerSpec` whose ``build()`` returns a *deep copy* of the captured
submodule: models built from the list start from the module's current weights (nothing is
re-initialised) and share no parameter with it or with each other. A module built on the meta device
(``with torch.device("meta"): ...``) is captured without memory, and ``build()`` materialises only
the layer it builds, by the model's own initialisation (:mod:`gpp_deepspeed.meta`) or from a
checkpoint (:func:`gpp_deepspeed.load_pretrained`), so each pipeline rank allocates only its stage.
"""

from __future__ import annotations

import copy
import difflib
import functools
import inspect
import operator
import sys
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.fx.experimental.meta_tracer import MetaProxy, MetaTracer

from .errors import GPPConfigError, GPPError, GraphError
from .graph.ir import TensorRef
from .meta import ModuleInit, building_on_meta, check_initializable, is_meta, materialize, meta_copy
from .spec import GraphLayerSpec
from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec

__all__ = ["CapturedLayerSpec", "CapturedTiedLayerSpec", "CapturedModel", "capture"]

_METADATA_METHODS = {"size", "dim", "numel", "ndimension", "nelement", "get_device", "type"}
_ASSERTS = (torch._assert, torch.fx._symbolic_trace._assert_is_none)


class CapturedLayerSpec(GraphLayerSpec):
    """A ``GraphLayerSpec`` around an already-built module; ``build()`` returns a deep copy of it.

    ``prefix`` is the path of the layer's submodule in the captured module, with a trailing dot
    (``"model.layers.0."``), or ``""`` for a function layer, whose tensors carry their full paths. A
    meta module is materialised by ``init`` when built (:mod:`gpp_deepspeed.meta`), or read from
    ``weights`` (set by :func:`gpp_deepspeed.load_pretrained`).
    """

    def __init__(self, name: str, module: nn.Module, *, inputs: Sequence[str], prefix: str = "",
                 init: ModuleInit | None = None):
        super().__init__(name, type(module), inputs=inputs)
        self.module = module
        self.prefix = prefix
        self.init = init
        self.weights = None

    def build(self, log=False) -> nn.Module:
        if building_on_meta():   # counting parameters: the structure, no memory
            return meta_copy(self.module)
        if self.weights is not None:
            return self.weights.build(self)
        module = copy.deepcopy(self.module)
        if is_meta(module):
            self.check_buildable()
            materialize(module, init=self.init, path_of=self.module_path)
        return module

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
        self.prefix, self.init, self.weights = "", init, None

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

    ``prefixes`` maps each layer name to the prefix its parameters have in the original module.
    ``aliases`` maps each name of a tensor that the module holds under several names (tied
    weights: T5's ``shared.weight`` is also ``encoder.embed_tokens.weight``) to all of them.
    ``hf`` describes the Hugging Face model inside the module, if there is one
    (:class:`gpp_deepspeed.pretrained.HFModelInfo`: where it sits, its config, its tied keys).
    """

    layers: list[CapturedLayerSpec]
    input_names: tuple[str, ...]
    output: str
    prefixes: dict[str, str]
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    hf: Any = None

    def graph_model(self, **kwargs: Any):
        """The single-device :class:`~gpp_deepspeed.GraphModel` of the captured layers."""
        from .model import GraphModel
        return GraphModel(self.layers, input_names=self.input_names, output=self.output, **kwargs)

    def module_state_dict(self, graph_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rename a GraphModel (or ``graph_state_dict()``) state to the original module's names,
        every name of a tied tensor included, so that the module's ``load_state_dict`` takes it
        strictly."""
        out = {}
        for key, value in graph_state.items():
            kind, layer, rest = key.split(".", 2)
            if kind == "tied":  # tied.<key>.<layer>.<param>
                layer, rest = rest.split(".", 1)
            out[self.prefixes[layer] + rest] = value
        for name, value in list(out.items()):
            for alias in self.aliases.get(name, ()):
                out.setdefault(alias, value)
        return out


class _LeafTracer(fx.Tracer):
    """Keeps as leaves the named submodules and every module that contains none of them."""

    def __init__(self, named: set[str]):
        super().__init__()
        self.named = named
        self.record_stack_traces = True  # so errors about a node can quote its source line
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.named or not any(n.startswith(qualname + ".") for n in self.named)

    def call_module(self, m, forward, args, kwargs):
        _check_no_cache(self.path_of_module(m), args, kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            # The innermost traced-through module records itself first.
            self.failed_in = self.failed_in or self.path_of_module(m)
            raise


class _CacheArgumentError(GraphError):
    """A cache object reaches a layer: no tracer gets further, so capture says so at once."""


def _check_no_cache(path: str, args: tuple, kwargs: dict) -> None:
    """A key/value cache (``transformers``' ``DynamicCache``) passed to a layer is generation state
    that a training pipeline neither traces nor sends between stages: say how to turn it off."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None:
        return
    named = [*((f"argument {i}", a) for i, a in enumerate(args)), *((f"{k}=", v) for k, v in kwargs.items())]
    for where, value in named:
        if isinstance(value, cache_utils.Cache):
            raise _CacheArgumentError(f'submodule "{path}" is called with a {type(value).__name__} ({where}): a key/value cache '
                             "is generation state that a pipeline cannot capture or send between stages. Build the "
                             "model with use_cache=False (config.use_cache = False, or "
                             "capture(..., concrete_args={\"use_cache\": False}) when forward takes use_cache)")


class _SizedProxy(MetaProxy):
    """A ``MetaProxy`` that also answers ``x.ndim`` from its meta tensor (transformers' mask code
    asks ``attention_mask.ndim == 2``)."""

    @property
    def ndim(self):
        meta = getattr(self, "_tensor_meta", None)
        if torch.is_tensor(meta):
            return meta.ndim
        return self.tracer.create_proxy("call_function", getattr, (self, "ndim"), {})


class _ShapeLeafTracer(_LeafTracer, MetaTracer):
    """The leaf tracer on meta tensors of the example inputs' shapes (torch's ``MetaTracer``, which
    ``transformers``' own ``HFTracer`` built on before transformers 5 removed it): sizes are known
    while tracing, so control flow on shapes runs; control flow on values still fails."""

    _sizing_leaf = False

    def proxy(self, node: fx.Node) -> _SizedProxy:
        return _SizedProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, *rest, **options):
        # MetaTracer sizes a leaf's output by running the leaf on meta tensors: its submodules
        # must run, not be recorded as calls of their own.
        self._sizing_leaf = kind == "call_module"
        try:
            return super().create_proxy(kind, target, args, kwargs, *rest, **options)
        finally:
            self._sizing_leaf = False

    def call_module(self, m, forward, args, kwargs):
        if self._sizing_leaf:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)


def capture(module: nn.Module, *, input_names: Sequence[str] | None = None, layers: Sequence[str] | None = None,
            concrete_args: dict[str, Any] | None = None, example_inputs: Sequence[torch.Tensor] | None = None,
            init_fn: Callable[[nn.Module], None] | None = None) -> CapturedModel:
    """Trace ``module`` at module granularity into a :class:`CapturedModel`.

    ``input_names`` names the graph inputs (default: the forward's argument names); ``layers``
    names the submodules to keep as leaves (default: each top-level child); ``concrete_args`` fixes
    arguments such as flags, as in ``torch.fx.symbolic_trace``.

    Where plain torch.fx stops at control flow on tensor sizes (``transformers``' mask builders
    check ``batch_size != position_ids.shape[0]``), ``example_inputs`` (one tensor per forward
    argument, in order) lets capture trace again on meta tensors of their shapes. That graph is
    specialised to those shapes: every micro-batch must have them.

    A module on the meta device costs no memory here; each layer is materialised when built
    (:mod:`gpp_deepspeed.meta`), by ``init_fn(submodule)`` when given (it fills one submodule's own
    tensors), else by the Hugging Face model's ``_init_weights`` or the submodule's
    ``reset_parameters()``, unless :func:`gpp_deepspeed.load_pretrained` gives it a checkpoint.
    """
    named = _check_layers(module, layers)
    try:
        graph, consts = _trace(module, _LeafTracer(named), concrete_args), {}
    except _CacheArgumentError:
        raise
    except GraphError as plain:
        if example_inputs is None:
            raise GraphError(f"{plain}; if the control flow only reads tensor sizes, pass example_inputs=(...) "
                             "to trace with their shapes") from plain
        graph, consts = _trace_with_shapes(module, named, concrete_args, example_inputs, plain)
    placeholders = _strip_concrete(graph, module, concrete_args or {})
    if input_names is None:
        input_names = [str(p.target) for p in placeholders]
    elif isinstance(input_names, str) or len(input_names) != len(placeholders):
        raise GPPConfigError(f"input_names {input_names!r} must list one name per input of "
                             f"{type(module).__name__}.forward: {[str(p.target) for p in placeholders]}")
    init = ModuleInit.of(module, init_fn) if is_meta(module) else None
    return _to_layers(module, graph, placeholders, tuple(input_names), consts, init)


def _aliases(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every name of each tensor that ``module.state_dict()`` holds under several names."""
    names: dict[int, list[str]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
    return {n: tuple(group) for group in names.values() if len(group) > 1 for n in group}


def _trace(module: nn.Module, tracer: _LeafTracer, concrete_args, **meta) -> fx.Graph:
    try:
        return tracer.trace(module, concrete_args=concrete_args, **meta)
    except GPPError:
        raise
    except Exception as exc:
        raise _trace_error(module, tracer.failed_in, exc) from exc


def _trace_with_shapes(module, named, concrete_args, example_inputs, plain: GraphError):
    """Trace a meta-device copy of ``module`` with meta inputs; return the graph and the tensor
    constants the trace created (``{attribute name: tensor}``), which the real module lacks."""
    params = [p for p in inspect.signature(module.forward).parameters if p not in (concrete_args or {})]
    if len(example_inputs) != len(params):
        raise GPPConfigError(f"example_inputs has {len(example_inputs)} tensors but {type(module).__name__}.forward "
                             f"takes {len(params)} inputs: {params}")
    meta_module = meta_copy(module)  # shares nothing with module, costs no parameter memory
    tracer = _ShapeLeafTracer(named)
    meta_args = {name: x.to("meta") for name, x in zip(params, example_inputs)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MetaTracer warns for every op it cannot size; errors say more
        try:
            graph = _trace(meta_module, tracer, concrete_args, meta_args=meta_args)
        except _CacheArgumentError:
            raise
        except GraphError as shaped:
            raise GraphError(f"neither torch.fx nor shape-specialised tracing can capture "
                             f"{type(module).__name__}: {shaped}") from plain
    known = {n for n, _ in module.named_modules()} | {n for n, _ in module.named_parameters()} | {
        n for n, _ in module.named_buffers()}
    consts = {n.target: getattr(meta_module, n.target) for n in graph.nodes
              if n.op == "get_attr" and n.target not in known and hasattr(meta_module, n.target)}
    return graph, consts


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


def _trace_error(module: nn.Module, failed_in: str | None, exc: Exception) -> GraphError:
    torch_dir = inspect.getfile(torch).rsplit("/", 1)[0]
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(torch_dir)]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else ""
    if failed_in:
        fix = (f'mark that submodule as a layer (capture(..., layers=[..., "{failed_in}"])) so it is kept '
               "whole instead of traced")
        culprit = f'submodule "{failed_in}"'
    else:
        fix = ("move that code into a submodule (which is kept whole), or fix the values it depends on "
               "with concrete_args")
        culprit = f"{type(module).__name__}.forward"
    return GraphError(f"cannot trace {culprit}{where}: {type(exc).__name__}: {exc}. Data-dependent control "
                      f"flow cannot be captured: {fix}")


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
            raise GraphError(f'the result of glue op "{node.name}" ({node.target}) is unused{_line(node)}; '
                             "in-place ops between submodules cannot be captured: assign the result instead")
    return [p for p in placeholders if p not in fixed or p.users]


def _is_pure(node: fx.Node) -> bool:
    """Not an in-place op (``x.add_(y)``, ``torch.relu_``, ``inplace=True``): an unused result can go."""
    if node.op in ("placeholder", "output", "call_module"):
        return False
    name = getattr(node.target, "__name__", str(node.target))
    return not (name.endswith("_") and not name.endswith("__") or node.kwargs.get("inplace") is True)


def _line(node: fx.Node) -> str:
    lines = (node.stack_trace or "").strip().splitlines()
    return f" ({lines[-2].strip()}: {lines[-1].strip()})" if len(lines) >= 2 else ""


def _selection_step(node: fx.Node) -> int | str | None:
    """The path step of a selection op, ``x[i]``, ``x["key"]`` or ``x.field`` (not a tensor
    attribute such as ``x.shape``): it becomes part of a reference, applied on the producer's stage."""
    if node.op != "call_function" or len(node.args) != 2 or node.kwargs:
        return None
    key = node.args[1]
    if node.target is operator.getitem and isinstance(key, (int, str)) and not isinstance(key, bool):
        return key
    if node.target is getattr and isinstance(key, str) and not hasattr(torch.Tensor, key):
        return key
    return None


def _classify(nodes: list[fx.Node], result: fx.Node, is_param) -> tuple[set, dict]:
    """Split glue into metadata ops copied into their readers (``inline``) and selections of a
    layer's output (``refs``: node -> (producer, path)), so that only the selected leaves of a
    structured output (a tuple, a dict, a ``ModelOutput``) cross stages."""
    called: dict[str, fx.Node] = {}
    inline: set[fx.Node] = set()
    refs: dict[fx.Node, tuple[fx.Node, tuple]] = {}
    for n in nodes:
        if n.op == "call_module":
            if n.target in called:
                raise GraphError(f'submodule "{n.target}" is called more than once{_line(n)}; a layer runs once per '
                                 "forward, so shared weights need one submodule per use (or TiedLayerSpec)")
            called[n.target] = n
        elif n.op not in ("placeholder", "output") and not is_param(n):
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
    from .pretrained import HFModelInfo
    return CapturedModel(_tie_shared(specs, init), input_names, name_of[result], prefixes, _aliases(module),
                         HFModelInfo.find(module))


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
        holder = nn.ModuleDict({m.name: m.module for m in tie})
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
        raise GraphError(f'layer "{name}" ({root.name}{_line(root)}) reads no tensor from the inputs or other '
                         "layers; compute it inside a submodule or from an input")
    sub = fx.Graph()
    env = {a: sub.placeholder(f"in{i}") for i, a in enumerate(external)}
    keep = set(copied) | member_set
    for n in (n for n in root.graph.nodes if n in keep):
        if is_param(n):
            owner = owners.setdefault(n.target, name)
            if owner != name:
                raise GraphError(f'parameter "{n.target}" is read by the glue code of two layers ("{owner}" and '
                                 f'"{name}"){_line(n)}; move the code that uses it into a submodule')
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(env[root])
    targets = {n.target for n in sub.nodes if n.op in ("get_attr", "call_module")}
    owner = {t: consts[t] if t in consts else functools.reduce(getattr, t.split("."), module) for t in targets}
    return fx.GraphModule(owner, sub, class_name=f"Glue_{name}"), [ref(a) for a in external]
