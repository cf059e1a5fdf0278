"""Names a package loads on first use (PEP 562), so that importing it stays light.

>>> getattr_, dir_ = lazy_names("json", {"loads": "json"}, ["loads"], globals_={})
>>> getattr_("loads") is __import__("json").loads
True
"""

from __future__ import annotations

from importlib import import_module

__all__ = ["lazy_names"]


def lazy_names(package: str, lazy: dict[str, str], public: list[str], *, globals_: dict):
    """A package's ``__getattr__`` and ``__dir__``: ``lazy`` maps a name to the (relative) module
    it comes from; the first access imports it and keeps it in ``globals_``."""

    def __getattr__(name):
        if name in lazy:
            value = getattr(import_module(lazy[name], package), name)
            globals_[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(globals_) | set(public))

    return __getattr__, __dir__
