"""A ``ModuleDict`` keyed by layer names, whatever they are.

``nn.ModuleDict`` refuses a key that is an attribute of the dict (``to``, ``float``, ``train``,
``keys``, ``forward``, ...): ``KeyError: "attribute 'to' already exists"``. Layer names come from the
user or from capture (a glue op ``x.to(dtype)`` is the layer ``to``), so the containers that hold
layers by name (:class:`~gpp_deepspeed.GraphModel`, a tie's holder) store them in ``_modules`` only,
and reach them by ``[name]``, never by attribute. State-dict keys (``layers.to.weight``) and
checkpoints, which walk ``_modules``, are then the same as for any other name.
"""

from __future__ import annotations

from torch import nn

from ..errors import GraphError

__all__ = ["LayerDict"]


class LayerDict(nn.ModuleDict):
    """``nn.ModuleDict`` that also takes keys named like its attributes.

    >>> holder = LayerDict({"to": nn.Identity(), "float": nn.Linear(1, 1)})
    >>> type(holder["to"]).__name__, sorted(holder.state_dict())
    ('Identity', ['float.bias', 'float.weight'])
    """

    def __setitem__(self, key: str, module: nn.Module) -> None:
        if not isinstance(key, str) or not key or "." in key:
            raise GraphError(f"layer name {key!r} must be a non-empty string without dots")
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        self._modules[key] = module
