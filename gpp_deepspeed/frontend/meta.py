"""Deferred materialisation: a model built on the meta device gets real tensors only where it runs.

Pipeline parallelism exists for models that do not fit one device, so no rank should build the
whole model. As torchtitan and Hugging Face's ``init_empty_weights`` do, build it on the meta
device, where tensors have shapes and dtypes but no storage, capture it, and let each rank
materialise the layers of its own stage::

    with torch.device("meta"):
        model = LlamaForCausalLM(config)                 # costs no memory
    captured = capture(LM(model), layers=[...], example_inputs=(ids, ))
    module = GraphPipelineModule(captured.layers, ...)   # each rank allocates and initialises its stage

Glossary
--------
meta module
    A module with a tensor on ``torch.device("meta")``.
materialise
    Give a meta layer real tensors: allocate them on a device (parameters shared by several
    submodules stay shared) and fill them by an initialiser, or from a checkpoint
    (:mod:`gpp_deepspeed.frontend.pretrained`).
initialiser
    What fills one submodule's own tensors (:class:`ModuleInit`), in this order of preference: the
    ``init_fn`` given to ``capture``; the ``_init_weights`` of the innermost Hugging Face
    ``PreTrainedModel`` holding the submodule (the model's own initialisation, what
    ``from_pretrained`` runs on the tensors a checkpoint lacks); the submodule's own
    ``reset_parameters()`` (every ``torch.nn`` layer has one). Submodules are visited children
    first, as Hugging Face's ``initialize_weights`` does. PEFT adapters (LoRA's ``lora_A`` and
    ``lora_B``) are then initialised by PEFT's own rule, the layer's ``reset_lora_parameters``
    (B = 0, so the adapted model starts equal to its base).
dry run
    The initialiser run on a meta copy of a layer while every tensor it writes in full is recorded:
    it tells, on every rank and before any communication, which tensors nothing would initialise.

A layer is materialised under its build seed (:func:`gpp_deepspeed.spec.layer_seed`), so a pipelined
model and its single-device :class:`~gpp_deepspeed.GraphModel` twin get identical tensors whatever
the partition.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import GPPConfigError

__all__ = ["ModuleInit", "is_meta", "meta_copy", "building_on_meta", "materialize", "uninitialized_tensors",
           "check_initializable"]


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in _tensors(module))


def building_on_meta() -> bool:
    """Whether the default device is meta (inside ``with torch.device("meta"):``), where a layer
    spec builds a meta module, e.g. to count its parameters without allocating them."""
    return torch.get_default_device().type == "meta"


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` with every parameter and buffer on the meta device: the structure
    without the memory. Parameters shared inside ``module`` stay shared in the copy."""
    memo: dict[int, Any] = {}
    for t in _tensors(module):
        if id(t) not in memo:
            meta = t.detach().to("meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


@dataclass(frozen=True)
class ModuleInit:
    """How the submodules of a captured model get initial values (see the module glossary).

    ``owners`` lists the Hugging Face ``PreTrainedModel`` submodules of the captured model as
    ``(path prefix, model)``, innermost first, where a path prefix is ``""`` or ends with a dot; they
    are kept only while the captured model is on the meta device, so they hold no memory.
    """

    owners: tuple[tuple[str, nn.Module], ...] = ()
    init_fn: Callable[[nn.Module], None] | None = None
    adapters: tuple[tuple[str, Any], ...] = ()   # (PEFT adapter name, its config's init_lora_weights)

    @classmethod
    def of(cls, root: nn.Module, init_fn: Callable[[nn.Module], None] | None = None) -> "ModuleInit":
        """The initialiser of ``root``'s submodules (Hugging Face owners found by class)."""
        owners = [(f"{name}." if name else "", m) for name, m in root.named_modules() if _is_pretrained(m)]
        owners.sort(key=lambda o: -len(o[0]))
        adapters = {name: getattr(config, "init_lora_weights", True) for m in root.modules()
                    if _is_peft(m) for name, config in m.peft_config.items()}
        return cls(owners=tuple(owners), init_fn=init_fn, adapters=tuple(adapters.items()))

    def init_adapters(self, module: nn.Module, allocated: set[int]) -> None:
        """PEFT's own initialisation of the adapters of ``module``'s LoRA layers whose tensors were
        just allocated (ids in ``allocated``): ``reset_lora_parameters``, as ``get_peft_model`` ran
        it on tensors the meta device left empty."""
        rules = dict(self.adapters)
        for sub in module.modules():
            if not callable(getattr(sub, "reset_lora_parameters", None)):
                continue
            for name, lora_a in getattr(sub, "lora_A", {}).items():
                if not any(id(p) in allocated for p in lora_a.parameters()):
                    continue
                rule = rules.get(name, True)
                if rule not in (True, False, "gaussian"):
                    raise GPPConfigError(f'PEFT adapter "{name}" is initialised by init_lora_weights={rule!r}, '
                                         "which reads the base weights: build the model off the meta device, or "
                                         "load the adapter from a directory")
                sub.reset_lora_parameters(name, rule)

    def how(self, path: str, module: nn.Module) -> str | None:
        """Which initialiser fills ``module`` (at ``path`` in the captured model), or None."""
        if self.init_fn is not None:
            return "init_fn"
        if self._owner(path) is not None:
            return "_init_weights"
        if callable(getattr(module, "reset_parameters", None)):
            return "reset_parameters"
        return None

    def apply(self, path: str, module: nn.Module) -> None:
        """Initialise ``module``'s own parameters and buffers (not its children's)."""
        how = self.how(path, module)
        with torch.no_grad():
            if how == "init_fn":
                self.init_fn(module)
            elif how == "_init_weights":
                with _hf_init_guard():
                    self._owner(path)._init_weights(module)
            elif how == "reset_parameters":
                module.reset_parameters()

    def _owner(self, path: str) -> nn.Module | None:
        for prefix, owner in self.owners:
            if path.startswith(prefix) or path + "." == prefix:
                return owner
        return None


def materialize(module: nn.Module, *, init: ModuleInit, path_of: Callable[[str], str],
                device: torch.device | str = "cpu") -> nn.Module:
    """Allocate ``module``'s meta tensors on ``device`` and initialise the submodules that own them.

    ``path_of`` maps a submodule's name inside ``module`` to its path in the captured model (which
    decides its initialiser). Parameters shared between submodules stay one parameter.
    ``torch.nn.Module.to_empty`` would untie them. Runs under the caller's RNG state: seed first.
    """
    fresh: dict[int, torch.Tensor] = {}
    owning: set[int] = set()
    for name, sub in module.named_modules(remove_duplicate=False):
        own = False
        for slots in (sub._parameters, sub._buffers):
            for key, t in slots.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in fresh:
                    new = torch.empty_like(t, device=device)
                    fresh[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(
                        t, nn.Parameter) else new
                slots[key] = fresh[id(t)]
                own = True
        if own:
            owning.add(id(sub))
    for name, sub in _children_first(module):
        if id(sub) in owning:
            owning.discard(id(sub))   # a submodule reached by two paths is initialised once
            init.apply(path_of(name), sub)
    init.init_adapters(module, {id(t) for t in fresh.values()})
    return module


def uninitialized_tensors(module: nn.Module, *, init: ModuleInit, path_of: Callable[[str], str]) -> list[str]:
    """The names (in the captured model) of ``module``'s meta tensors that its initialisers would
    not fill, found by a dry run on a meta copy: nothing is allocated."""
    dry = meta_copy(module)
    tracked: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, sub in dry.named_modules(remove_duplicate=False):
        for key, t in [*sub._parameters.items(), *sub._buffers.items()]:
            if t is not None:
                tracked.setdefault(id(t.untyped_storage()), []).append((path_of(f"{name}.{key}" if name else key), t))
    recorder = _WriteRecorder(tracked)
    seen: set[int] = set()
    with recorder:
        for name, sub in _children_first(dry):
            if id(sub) in seen or not any(t is not None for t in (*sub._parameters.values(), *sub._buffers.values())):
                continue
            seen.add(id(sub))
            try:
                init.apply(path_of(name), sub)
            except Exception as exc:  # an initialiser that cannot run on meta tensors (reads values)
                raise GPPConfigError(f'initialising "{path_of(name)}" ({type(sub).__name__}) on the meta device '
                                     f"failed: {type(exc).__name__}: {exc}. Load this layer from a checkpoint "
                                     "(gpp_deepspeed.load_pretrained) or give capture(..., init_fn=...)") from exc
    names = dict.fromkeys(n for group in tracked.values() for n, t in group if id(t) not in recorder.written)
    return list(names)


class _WriteRecorder(TorchDispatchMode):
    """Records the tensors that in-place ops overwrite in full (a write to a slice does not count)."""

    def __init__(self, tracked: dict[int, list[tuple[str, torch.Tensor]]]):
        super().__init__()
        self.tracked = tracked
        self.written: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if torch.is_tensor(value):
                    self._record(value)
        return func(*args, **kwargs)

    def _record(self, value: torch.Tensor) -> None:
        for _, t in self.tracked.get(id(value.untyped_storage()), ()):
            # The same tensor, or a view of all of it (``p.data``).
            if value is t or (value.shape == t.shape and value.stride() == t.stride()
                              and value.storage_offset() == t.storage_offset()):
                self.written.add(id(t))


def check_initializable(module: nn.Module, *, init: ModuleInit, path_of: Callable[[str], str], layer: str) -> None:
    """Raise :class:`GPPConfigError` naming layer ``layer``'s meta tensors that nothing initialises
    (a dry run: nothing is allocated and nothing is communicated)."""
    names = uninitialized_tensors(module, init=init, path_of=path_of)
    if names:
        more = f" (and {len(names) - 4} more)" if len(names) > 4 else ""
        raise GPPConfigError(
            f'layer "{layer}" is on the meta device and nothing initialises {names[:4]}{more}: their modules have '
            "no reset_parameters() and no Hugging Face _init_weights sets them. Load the layer from a checkpoint "
            "(gpp_deepspeed.load_pretrained), give capture(..., init_fn=fn) (fn(module) fills one module's own "
            "tensors), or build the model off the meta device")


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    for sub in module.modules():
        for t in (*sub._parameters.values(), *sub._buffers.values()):
            if t is not None:
                yield t


def _children_first(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``(name, submodule)`` in post-order: children before their parent, as Hugging Face's
    ``smart_apply`` initialises them."""
    for name, child in module._modules.items():
        if child is not None:
            yield from _children_first(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _is_peft(module: nn.Module) -> bool:
    """A ``peft.PeftModel``, checked without importing peft."""
    import sys
    peft = sys.modules.get("peft.peft_model")
    return peft is not None and isinstance(module, peft.PeftModel)


def _is_pretrained(module: nn.Module) -> bool:
    """A ``transformers.PreTrainedModel``, checked without importing transformers."""
    import sys
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


@contextlib.contextmanager
def _hf_init_guard():
    """Hugging Face's guard around ``_init_weights`` (``torch.nn.init`` functions made to skip
    tensors it marked as loaded), as its ``initialize_weights`` runs them."""
    import transformers.initialization as hf_init
    with hf_init.guard_torch_init_functions():
        yield
