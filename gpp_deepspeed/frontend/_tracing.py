"""The tracers behind :func:`~gpp_deepspeed.capture`, and errors that point at the model.

Glossary
--------
leaf
    A submodule recorded as one call instead of traced through: the submodules named in
    ``layers=`` and every module that contains none of them.
plain trace
    ``torch.fx`` symbolic tracing: sizes are unknown, so control flow on them stops the trace.
shaped trace
    The same tracer on a meta-device copy of the module and meta tensors of the example inputs'
    shapes (torch's ``MetaTracer``, which ``transformers``' own ``HFTracer`` built on before
    transformers 5 removed it): sizes are known while tracing, so control flow on shapes runs and
    iterating over a dimension (``list(image_features)``) unrolls; control flow on values still
    fails. The graph holds those sizes as constants.
forward hooks
    ``transformers`` 5 collects ``hidden_states`` and ``attentions`` with forward hooks on the
    layers. A leaf is recorded, not run, so the tracer runs its forward hooks itself on the traced
    value; at run time the layer calls the module, which runs them again (they then find no
    collector and do nothing).
model line
    The innermost frame of a traceback or a node's stack outside torch and gpp_deepspeed: the line of
    the model (or of ``transformers``) that an error is about.
"""

from __future__ import annotations

import bisect
import contextlib
import dis
import functools
import inspect
import os
import re
import sys
import traceback
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.experimental.meta_tracer import MetaAttribute, MetaProxy, MetaTracer

from ..errors import GPPConfigError, GPPError, GraphError
from ._questions import (META, UnansweredError, known_value, refuse_device_branch, refuse_unsized, size_on_cpu,
                         size_unaided, tensor_checks_answered)
from .meta import meta_copy

__all__ = ["LeafTracer", "ShapeLeafTracer", "trace", "trace_with_shapes", "propagate_meta", "model_line", "META",
           "CacheArgumentError"]



class LeafTracer(fx.Tracer):
    """Keeps as leaves the named submodules and every module that contains none of them, and runs
    a leaf's forward hooks on its traced output."""

    def __init__(self, named: set[str]):
        super().__init__()
        self.named = named
        self.record_stack_traces = True  # so errors about a node can quote its source line
        self.failed_in: str | None = None
        # Submodules of leaves that have forward hooks: those hooks do not run while tracing.
        self.hooks_inside: list[str] = []

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.named or not any(n.startswith(qualname + ".") for n in self.named)

    def call_module(self, m, forward, args, kwargs):
        path = self.path_of_module(m)
        leaf = self.is_leaf_module(m, path)
        _check_no_cache(path, args, kwargs)
        try:
            out = super().call_module(m, forward, args, kwargs)
        except Exception:
            # The innermost traced-through module records itself first.
            self.failed_in = self.failed_in or path
            raise
        if not leaf:
            return out
        if _active_collector():
            self.hooks_inside += [f"{path}.{name}" for name, sub in m.named_modules() if name and sub._forward_hooks]
        for hook_id, hook in list(m._forward_hooks.items()):
            # Hooks that collect outputs append the traced value; a value a hook returns is not
            # used here, because the layer runs the hook again when it calls the module.
            if m._forward_hooks_with_kwargs.get(hook_id, False):
                hook(m, args, kwargs, self._hooked_value(out))
            else:
                hook(m, args, self._hooked_value(out))
        return out

    def _hooked_value(self, out):
        """What a hook sees as the module's output: the traced value (a tuple of its elements
        when the shaped trace knows the output is a tuple)."""
        return out

    def to_bool(self, obj):
        # A branch on a device would be decided for the capture's device, not the rank's.
        if isinstance(obj, fx.Proxy):
            refuse_device_branch(obj.node)
        return super().to_bool(obj)


class CacheArgumentError(GraphError):
    """A key/value cache reaches a layer: no tracer gets further, so capture says so at once."""


def _check_no_cache(path: str, args: tuple, kwargs: dict) -> None:
    """A key/value cache (``transformers``' ``DynamicCache``, what ``use_cache=True`` makes) passed to
    a layer is generation state that a training pipeline neither traces nor sends between stages:
    say how to turn it off."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None:
        return
    named = [*((f"argument {i}", a) for i, a in enumerate(args)), *((f"{k}=", v) for k, v in kwargs.items())]
    for where, value in named:
        if isinstance(value, cache_utils.Cache):
            raise CacheArgumentError(
                f'submodule "{path}" is called with a {type(value).__name__} ({where}): a key/value cache is '
                "generation state that a pipeline cannot capture or send between stages. Build the model with "
                "use_cache=False (config.use_cache = False, or capture(..., concrete_args={\"use_cache\": False}) "
                "when forward takes use_cache)")


class _SizedProxy(MetaProxy):
    """A ``MetaProxy`` that also answers ``x.ndim``, ``len(x)`` and ``iter(x)`` from its meta tensor
    (transformers' mask code asks ``attention_mask.ndim == 2``; Llava's ``list(image_features)``
    splits the batch dimension, which the example inputs fix)."""

    @property
    def ndim(self):
        meta = self._meta()
        if meta is not None:
            return meta.ndim
        return self.tracer.create_proxy("call_function", getattr, (self, "ndim"), {})

    @property
    def dtype(self):
        # A node, not the capture-time dtype: casts such as Llava's .to(inputs_embeds.dtype) then
        # follow the dtype the stage runs in (bf16 training). Its meta answers control flow.
        return self.tracer.create_proxy("call_function", getattr, (self, "dtype"), {})

    def __len__(self):
        size = self._length()
        return super().__len__() if size is None else size

    def __iter__(self):
        size = self._length()
        if size is not None:
            return iter([self[i] for i in range(size)])
        # As fx's Proxy.__iter__, which reads the caller's frame: `a, b = proxy` unpacks by index.
        caller = inspect.currentframe().f_back
        code = list(dis.get_instructions(caller.f_code))
        inst = code[bisect.bisect_left(code, caller.f_lasti, key=lambda i: i.offset)]
        if inst.opname == "UNPACK_SEQUENCE":
            return (self[i] for i in range(inst.argval))
        return self.tracer.iter(self)

    def _meta(self) -> torch.Tensor | None:
        meta = getattr(self, "_tensor_meta", None)
        return meta if torch.is_tensor(meta) else None

    def __getattr__(self, k: str):
        if k == "_tensor_meta":
            return self.__getattribute__(k)
        return _SizedAttribute(self, k)

    def _length(self) -> int | None:
        """The length of the traced value where the meta trace knows it: a tuple's, or a tensor's
        first dimension."""
        meta = getattr(self, "_tensor_meta", None)
        if isinstance(meta, (tuple, list)):
            return len(meta)
        return meta.shape[0] if torch.is_tensor(meta) and meta.ndim else None


class _SizedAttribute(MetaAttribute, _SizedProxy):
    """An attribute of a traced value (``image_outputs.hidden_states``) whose meta is the attribute
    of its owner's meta, so that indexing it (``[-2]``) is sized too (torch's ``MetaAttribute`` has none)."""

    @property
    def _tensor_meta(self):
        owner = getattr(self.root, "_tensor_meta", None)
        value = getattr(owner, self.attr, None) if owner is not None else None
        if value is None or callable(value):
            raise AttributeError("_tensor_meta")
        return value


class ShapeLeafTracer(LeafTracer, MetaTracer):
    """:class:`LeafTracer` on meta tensors of the example inputs' shapes (see *shaped trace*).

    A leaf that cannot run on meta tensors is sized on the CPU instead (see
    :mod:`gpp_deepspeed.frontend._questions`); ``unsized`` maps each leaf that neither sized to why.
    """

    _sizing_leaf = False

    def __init__(self, named: set[str]):
        super().__init__(named)
        self.unsized: dict[str, str] = {}

    def proxy(self, node: fx.Node) -> _SizedProxy:
        return _SizedProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, *rest, **options):
        # MetaTracer sizes a leaf's output by running the leaf on meta tensors: its submodules
        # must run, not be recorded as calls of their own, and hooks must not see meta tensors
        # (a collector would keep them as the layers' outputs).
        self._sizing_leaf = kind == "call_module"
        try:
            with _sizing_as_at_run_time(self.root.get_submodule(target) if self._sizing_leaf else None):
                proxy = super().create_proxy(kind, target, args, kwargs, *rest, **options)
        finally:
            self._sizing_leaf = False
        if isinstance(proxy, MetaProxy) and "_tensor_meta" not in proxy.__dict__:
            if kind == "call_module":
                self._size_on_cpu(proxy, target, args, kwargs)
            elif kind in ("call_function", "call_method"):
                size_unaided(proxy, kind, target, args, kwargs)
        if isinstance(proxy, MetaProxy) and "_tensor_meta" in proxy.__dict__:
            proxy.node.meta[META] = proxy._tensor_meta
        return proxy

    def _size_on_cpu(self, proxy: MetaProxy, target: str, args, kwargs) -> None:
        self._sizing_leaf, self._disable_module_getattr = True, True
        try:
            with _sizing_as_at_run_time(self.root.get_submodule(target)):
                proxy.install_tensor_meta(size_on_cpu(self.root, target, args, kwargs))
        except Exception as exc:   # the trace goes on; a question about this output then says why
            self.unsized[target] = f"{type(exc).__name__}: {exc}"
        finally:
            self._sizing_leaf, self._disable_module_getattr = False, False

    def call_module(self, m, forward, args, kwargs):
        if self._sizing_leaf:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def to_bool(self, obj):
        # Control flow on a value the trace knows without data (a dtype comparison) takes the
        # branch of the capture-time value, as control flow on sizes does.
        if isinstance(obj, fx.Proxy):
            refuse_device_branch(obj.node)
        meta = known_value(obj)
        if isinstance(meta, bool):
            return meta
        if isinstance(obj, fx.Proxy):
            refuse_unsized(obj.node, self.unsized)
        return super().to_bool(obj)

    def _hooked_value(self, out):
        meta = getattr(out, "_tensor_meta", None)
        return tuple(out[i] for i in range(len(meta))) if isinstance(meta, tuple) else out


@contextlib.contextmanager
def _sizing_as_at_run_time(leaf: nn.Module | None):
    """Size ``leaf`` on meta tensors as its layer will run it: without an outer module's output
    collector (traced away; hooks inside the leaf would give it meta tensors) and without the
    leaf's own forward hooks (:meth:`LeafTracer.call_module` runs those on the traced value)."""
    if leaf is None:
        yield
        return
    hooks, leaf._forward_hooks = leaf._forward_hooks, OrderedDict()
    collector = _transformers_collector()
    token = collector.set(None) if collector is not None else None
    try:
        yield
    finally:
        leaf._forward_hooks = hooks
        if collector is not None:
            collector.reset(token)


def _transformers_collector():
    """transformers 5's context variable holding the outputs its forward hooks collect, if loaded."""
    module = sys.modules.get("transformers.utils.output_capturing")
    return getattr(module, "_active_collector", None)


def _active_collector() -> bool:
    """Whether a transformers output collector is active (a traced-through forward asked for
    hidden_states or attentions)."""
    collector = _transformers_collector()
    return collector is not None and bool(collector.get())


@contextlib.contextmanager
def _checks_on_traced_values_skipped():
    """While tracing, ``torch._check*`` calls whose condition is a traced value pass: they assert
    on data (Llava's "image features and image tokens do not match") and record no graph node,
    so the captured layers do not repeat them."""
    originals = {name: getattr(torch, name) for name in _CHECKS}

    def skip_traced(original, cond_at):
        def check(*args, **kwargs):
            if len(args) > cond_at and isinstance(args[cond_at], fx.Proxy):
                return None
            return original(*args, **kwargs)
        return check

    for name, cond_at in _CHECKS.items():
        setattr(torch, name, skip_traced(originals[name], cond_at))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


@contextlib.contextmanager
def _dtype_info_of_traced_dtypes():
    """While tracing, ``torch.finfo`` / ``torch.iinfo`` of a traced dtype give the limits of its
    capture-time dtype (transformers' eager masks fill with ``torch.finfo(dtype).min``)."""
    originals = {name: getattr(torch, name) for name in ("finfo", "iinfo")}

    def known(original):
        def info(*args):
            if args and isinstance(args[0], fx.Proxy):
                args = (getattr(args[0], "_tensor_meta"), *args[1:])
            return original(*args)
        return info

    for name, original in originals.items():
        setattr(torch, name, known(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


# torch's runtime checks -> the position of their condition argument
_CHECKS = {"_check": 0, "_check_with": 1, "_check_tensor_all": 0, "_check_tensor_all_with": 1}


def trace(module: nn.Module, tracer: LeafTracer, concrete_args, *, shaped: bool = False, **meta) -> fx.Graph:
    """``tracer.trace(module)``, its failures turned into a :class:`GraphError` about the model's line."""
    try:
        with _checks_on_traced_values_skipped(), _dtype_info_of_traced_dtypes(), tensor_checks_answered():
            return tracer.trace(module, concrete_args=concrete_args, **meta)
    except GPPError:
        raise
    except Exception as exc:
        raise _trace_error(module, tracer, exc, shaped=shaped) from exc


def trace_with_shapes(module: nn.Module, named: set[str], concrete_args, example_inputs, plain: GraphError):
    """Trace a meta-device copy of ``module`` with meta inputs; return the graph and the tensor
    constants the trace created (``{attribute name: tensor}``), which the real module lacks."""
    params = [p for p in inspect.signature(module.forward).parameters if p not in (concrete_args or {})]
    if len(example_inputs) != len(params):
        raise GPPConfigError(f"example_inputs has {len(example_inputs)} tensors but {type(module).__name__}.forward "
                             f"takes {len(params)} inputs: {params}")
    meta_module = meta_copy(module)
    tracer = ShapeLeafTracer(named)
    meta_args = {name: x.to("meta") for name, x in zip(params, example_inputs)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MetaTracer warns for every op it cannot size; errors say more
        try:
            graph = trace(meta_module, tracer, concrete_args, shaped=True, meta_args=meta_args)
        except CacheArgumentError:
            raise
        except GraphError as shaped:
            raise GraphError(f"neither torch.fx nor shape-specialised tracing can capture "
                             f"{type(module).__name__}: {shaped}") from plain
    known = {n for n, _ in module.named_modules()} | {n for n, _ in module.named_parameters()} | {
        n for n, _ in module.named_buffers()}
    consts = {n.target: getattr(meta_module, n.target) for n in graph.nodes
              if n.op == "get_attr" and n.target not in known and hasattr(meta_module, n.target)}
    return graph, consts


def propagate_meta(module: nn.Module, graph: fx.Graph, example_inputs: Sequence[torch.Tensor]) -> None:
    """Record in ``node.meta[META]`` the value each node of a plain trace takes on meta tensors of
    the example inputs' shapes (what the shaped trace records while tracing). The graph does not
    change: nothing is specialised. Stops quietly at the first node that cannot run on meta
    tensors; the nodes after it have no META (capture then only forgoes what META allows)."""
    meta_module = meta_copy(module)
    inputs = iter(x.to("meta") for x in example_inputs)
    env: dict[fx.Node, Any] = {}

    def load(a):
        return fx.node.map_arg(a, lambda n: env[n])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for node in graph.nodes:
            try:
                if node.op == "placeholder":
                    value = next(inputs)
                elif node.op == "get_attr":
                    value = functools.reduce(getattr, node.target.split("."), meta_module)
                elif node.op == "call_function":
                    value = node.target(*load(node.args), **load(node.kwargs))
                elif node.op == "call_method":
                    self_, *args = load(node.args)
                    value = getattr(self_, node.target)(*args, **load(node.kwargs))
                elif node.op == "call_module":
                    value = meta_module.get_submodule(node.target)(*load(node.args), **load(node.kwargs))
                else:
                    continue
            except Exception:
                return
            env[node] = value
            node.meta[META] = value


def _trace_error(module: nn.Module, tracer: LeafTracer, exc: Exception, *, shaped: bool) -> GraphError:
    frames = [(f.filename, f.lineno, f.line) for f in traceback.extract_tb(exc.__traceback__)]
    where = _model_frame(frames)
    where = f" at {where}" if where else ""
    failed_in = tracer.failed_in
    if failed_in:
        inside = sorted(n for n in tracer.named if n.startswith(failed_in + "."))
        cost = (f"; that makes it one layer on one stage, so the {len(inside)} layers named inside it "
                f"({', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''}) can no longer be cut apart"
                if inside else "")
        fix = f'keep submodule "{failed_in}" whole (capture(..., layers=[..., "{failed_in}"])){cost}'
        culprit = f'submodule "{failed_in}"'
    else:
        fix = "move that code into a submodule (which is kept whole), or fix the values it depends on with concrete_args"
        culprit = f"{type(module).__name__}.forward"
    if isinstance(exc, UnansweredError):
        why = f" {exc.advice}."
    elif isinstance(exc, fx.proxy.TraceError) and shaped:
        why = f" Sizes are known in this trace, so that control flow depends on tensor values: {fix}."
    elif isinstance(exc, fx.proxy.TraceError) or "not supported in symbolic tracing" in str(exc):
        why = (" Symbolic tracing knows no sizes nor values. If that code reads only sizes (x.shape, len(x), "
               "iterating over a dimension), pass example_inputs=(...) (one micro-batch as one rank sees it) to "
               f"trace with those sizes; if it reads tensor values, {fix}.")
    elif not tracer.hooks_inside:
        why = f" If that code cannot run on traced values, {fix}."
    else:
        why = ""
    if tracer.hooks_inside:
        why += (f" Forward hooks of {_outermost(tracer.hooks_inside)} did not run while tracing, because those "
                "submodules sit inside layers that are recorded, not run (transformers 5 collects hidden_states and "
                "attentions with such hooks), so what they collect is missing: name the hooked submodules in "
                "layers= so their hooks run on the traced values.")
    return GraphError(f"cannot trace {culprit}{where}: {type(exc).__name__}: {exc}.{why}")


def _outermost(paths: list[str], limit: int = 3) -> list[str]:
    """The first ``limit`` of ``paths`` that lie inside no other of them."""
    outer = [p for p in dict.fromkeys(paths) if not any(p.startswith(q + ".") for q in paths)]
    return outer[:limit] + (["..."] if len(outer) > limit else [])


def model_line(node: fx.Node) -> str:
    """`` (at file:line: code)`` of the model's own line that created ``node``, or ``""``."""
    frames = [(m["file"], int(m["line"]), m["code"]) for m in _STACK_FRAME.finditer(node.stack_trace or "")]
    where = _model_frame(frames)
    return f" (at {where})" if where else ""


_STACK_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in [^\n]*\n(?P<code>[^\n]*)')
# Frames in these directories are the tracer's, not the model's: errors quote the line below them.
_TRACER_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)


def _model_frame(frames: Sequence[tuple[str, int, str | None]]) -> str:
    """``file:line: code`` of the innermost frame outside torch and gpp_deepspeed (the model's own
    code, which may be a ``transformers`` file), or ``""`` when there is none."""
    own = [f for f in frames if not f[0].startswith(_TRACER_DIRS)]
    if not own:
        return ""
    filename, lineno, code = own[-1]
    return f"{filename}:{lineno}: {(code or '').strip()}"
