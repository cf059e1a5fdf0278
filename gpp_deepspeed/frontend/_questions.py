"""What a model's code asks of a traced value, answered as the real tensor would, or refused.

A traced value is an ``fx.Proxy``, not a tensor, so code that inspects its inputs sees something no
real run sees: ``torch.is_tensor(timesteps)`` is False, and diffusers' U-Net would record the branch
that wraps a Python number (``torch.tensor([timesteps])``), which fails at run time. While
:func:`~gpp_deepspeed.frontend._tracing.trace` runs, each such question gets the real answer where the
trace knows it, and a :class:`UnansweredError` naming the model's line where it does not; never the
proxy's own answer.

Glossary
--------
question
    ``torch.is_tensor(x)``, ``isinstance(x, torch.Tensor)`` (from the model's code, not torch's),
    control flow on ``x.is_floating_point()``, ``x.dtype``, ``x.device``.
known value
    What the shaped trace recorded for a node (a meta tensor, or a structure of them); in the
    plain trace only the graph inputs are known to be tensors.
device question
    Control flow on ``x.device`` (``if x.device.type == "mps"``): the device is the rank's at run
    time, never the capture's (meta in the shaped trace), so it is refused, naming the line.
sizing unaided
    An op that torch's ``MetaTracer`` cannot size is run on the known values of its arguments
    (its ``torch.where`` override takes no Python number).
sizing on the CPU
    A leaf that cannot run on meta tensors (it calls ``.item()``: transformers' ``padding_mask.all()``)
    is run once on a CPU copy of it, zero weights and inputs of ones of the known shapes and dtypes,
    only to learn its output's shapes and dtypes; that copy is then dropped. A question about the
    output of a leaf that neither sizes is refused, saying so (:func:`refuse_unsized`).
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import operator
import os
import sys
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_map

__all__ = ["META", "UnansweredError", "known_value", "tensor_checks_answered", "refuse_device_branch", "refuse_unsized",
           "size_on_cpu", "size_unaided"]

# node.meta key of the value a node had in the shaped trace (a meta tensor, or a structure of them)
META = "gpp_meta_value"
_OWN_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)
_DEVICE_READS = {"device", "is_cuda", "is_cpu", "is_mps", "is_meta", "is_xpu", "get_device"}
_original_isinstance = builtins.isinstance
_original_is_tensor = torch.is_tensor


class UnansweredError(fx.proxy.TraceError):
    """The model's code asked something of a traced value that capture cannot answer as the real
    value would; ``advice`` says what to do (the error then names the model's line)."""

    def __init__(self, question: str, advice: str):
        super().__init__(question)
        self.advice = advice


def known_value(proxy: Any) -> Any:
    """The value the shaped trace recorded for ``proxy`` (a meta tensor, a tuple of them), or None."""
    try:
        return object.__getattribute__(proxy, "_tensor_meta")
    except AttributeError:
        return None


def _is_tensor(proxy: fx.Proxy, asked: str) -> bool:
    value = known_value(proxy)
    answer = _original_is_tensor(value) if value is not None else _tensor_node(proxy.node)
    if answer is None:
        raise UnansweredError(
            f"{asked} on the traced value {proxy.node.name} ({proxy.node.op} {proxy.node.target}), which this "
            "trace cannot tell is a tensor",
            "pass example_inputs=(...) (one micro-batch as one rank sees it) so that capture traces with the "
            "values' types known, or keep the submodule that asks whole")
    return answer


# Tensor methods and attributes whose result is not a tensor.
_NOT_TENSOR = {"size", "dim", "numel", "ndimension", "nelement", "get_device", "tolist", "item", "__len__",
               "is_floating_point", "is_complex", "is_contiguous", "stride", "storage_offset", "element_size",
               "data_ptr", "shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_cuda", "names"}
_TENSOR_ATTRS = {"T", "mT", "H", "mH", "real", "imag", "data", "grad"}


def _tensor_node(node: fx.Node) -> bool | None:
    """Whether ``node``'s value is a tensor, from the graph alone: known for graph inputs, tensor
    methods and torch functions of tensors, selections from tensors; None for what a submodule
    returned (a tuple, a ``ModelOutput``) and selections from it."""
    if META in node.meta:
        return _original_is_tensor(node.meta[META])
    if node.op == "placeholder":
        return True
    if node.op != "call_function" and node.op != "call_method":
        return None
    source = node.args[0] if node.args and _original_isinstance(node.args[0], fx.Node) else None
    if node.target is getattr:
        known = _tensor_node(source) if source is not None else None
        return None if not known else node.args[1] in _TENSOR_ATTRS
    if node.target is operator.getitem:
        return True if source is not None and _tensor_node(source) else None
    if node.target in _NOT_TENSOR or getattr(node.target, "__name__", None) in _NOT_TENSOR:
        return False
    if node.op == "call_method" or getattr(node.target, "__module__", "").startswith("torch"):
        return True
    inputs = [_tensor_node(a) for a in node.all_input_nodes]
    return True if any(inputs) else False if all(i is False for i in inputs) else None


def _from_model(depth: int) -> bool:
    """Whether the frame ``depth`` levels up is the model's code (not torch's, nor this package's)."""
    return not sys._getframe(depth + 1).f_code.co_filename.startswith(_OWN_DIRS)


def _names_tensor(cls: Any) -> bool:
    return cls is torch.Tensor or type(cls) is tuple and any(c is torch.Tensor for c in cls)


@contextlib.contextmanager
def tensor_checks_answered():
    """While tracing, ``torch.is_tensor(x)`` and ``isinstance(x, torch.Tensor)`` asked by the model's
    code of a traced ``x`` answer whether the real value is a tensor (or raise
    :class:`UnansweredError`); everything else, torch's and this package's own checks included, is
    unchanged."""

    def is_tensor(obj):
        if _original_isinstance(obj, fx.Proxy) and _from_model(1):
            return _is_tensor(obj, "torch.is_tensor")
        return _original_is_tensor(obj)

    def isinstance_(obj, cls):
        if _original_isinstance(obj, fx.Proxy) and _names_tensor(cls) and _from_model(1):
            return _is_tensor(obj, "isinstance(..., torch.Tensor)") or _original_isinstance(obj, cls)
        return _original_isinstance(obj, cls)

    builtins.isinstance, torch.is_tensor = isinstance_, is_tensor
    try:
        yield
    finally:
        builtins.isinstance, torch.is_tensor = _original_isinstance, _original_is_tensor


def refuse_device_branch(node: fx.Node) -> None:
    """Raise :class:`UnansweredError` if the condition ``node`` reads a tensor's device: at run time
    that is the rank's device, which the trace cannot know (the shaped trace's is ``meta``)."""
    # A tensor made on a device (torch.arange(n, device=x.device)) has the same shape anywhere.
    for n in _upstream(node, follow=lambda a: a.op != "call_module" and _tensor_node(a) is not True):
        read = (n.args[1] if n.op == "call_function" and n.target is getattr and len(n.args) > 1
                else n.target if n.op == "call_method" else None)
        if read in _DEVICE_READS:
            raise UnansweredError(
                f"control flow on a tensor's device ({n.name}: .{read})",
                "the device is the rank's at run time, not the capture's: move that code into a submodule (kept "
                "whole, it runs as it is), or fix the branch with concrete_args")


def refuse_unsized(node: fx.Node, unsized: dict[str, str]) -> None:
    """Raise :class:`UnansweredError` if the condition ``node`` depends on the output of a leaf that
    could not be sized (``unsized``: its path -> why): its shapes and dtypes are unknown for that
    reason, not because the condition reads tensor values."""
    for n in _upstream(node):
        if n.op == "call_module" and n.target in unsized:
            raise UnansweredError(
                f'control flow on the output of submodule "{n.target}", which could be run neither on meta '
                f"tensors nor on tiny CPU inputs of its input shapes ({unsized[n.target]}), so its "
                "shapes and dtypes are unknown",
                f'name submodules inside "{n.target}" in layers= (so it is traced through), or make it '
                "runnable on CPU tensors of those shapes")


def _upstream(node: fx.Node, *, follow=lambda n: True):
    """``node`` and every node it reads from, each once, walking back only through the inputs
    that ``follow`` accepts."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        yield n
        stack.extend(a for a in n.all_input_nodes if follow(a))


def size_unaided(proxy: fx.Proxy, kind: str, target, args, kwargs) -> None:
    """Size an op by itself on the known values of its arguments where torch's ``MetaTracer``
    could not (its override of ``torch.where`` takes no Python number: transformers' eager mask
    fills with ``torch.finfo(dtype).min``)."""
    def known(value):
        if _original_isinstance(value, fx.Proxy):
            value = known_value(value)
            if value is None:
                raise LookupError
        return value

    try:
        args, kwargs = fx.node.map_aggregate(args, known), fx.node.map_aggregate(kwargs, known)
        if "device" in kwargs:
            kwargs["device"] = "meta"
        out = target(*args, **kwargs) if kind == "call_function" else getattr(args[0], target)(*args[1:], **kwargs)
    except Exception:
        return
    proxy.install_tensor_meta(out)


def size_on_cpu(root: nn.Module, target: str, args: tuple, kwargs: dict) -> Any:
    """The output of leaf ``target`` of the meta module ``root`` as meta tensors, found by running a CPU
    copy of it (zero weights) on inputs of ones with the known shapes and dtypes of ``args``/``kwargs``.
    Raises what the run raises, or ``ValueError`` when an input's shape is unknown."""
    def real(value):
        if _original_isinstance(value, fx.Proxy):
            value = known_value(value)
            if value is None:
                raise ValueError("an input of unknown shape")
        if _original_is_tensor(value):
            return torch.ones(value.shape, dtype=value.dtype) if value.dtype != torch.bool else torch.ones(
                value.shape, dtype=torch.bool)
        return value

    leaf = copy.deepcopy(root.get_submodule(target)).to_empty(device="cpu")
    with torch.no_grad():
        for t in (*leaf.parameters(), *leaf.buffers()):
            t.zero_()
        out = leaf(*fx.node.map_aggregate(args, real), **fx.node.map_aggregate(kwargs, real))
    return tree_map(lambda v: v.to("meta") if _original_is_tensor(v) else v, out)
