"""Flattening port values (a tensor, or a tuple of tensors) into one tensor list and back.

``arity`` records the structure: ``-1`` for a tensor, ``k >= 0`` for a tuple of ``k`` tensors.

>>> import torch
>>> flat, arity = flatten([torch.zeros(1), (torch.ones(1), torch.ones(2))])
>>> len(flat), arity
(3, [-1, 2])
>>> [type(v).__name__ for v in unflatten(flat, arity)]
['Tensor', 'tuple']
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import GPPConfigError

__all__ = ["flatten", "unflatten", "port_ranges"]


def flatten(values: Sequence[Any]) -> tuple[list[torch.Tensor], list[int]]:
    flat: list[torch.Tensor] = []
    arity: list[int] = []
    for v in values:
        if torch.is_tensor(v):
            flat.append(v)
            arity.append(-1)
        elif isinstance(v, (tuple, list)) and all(torch.is_tensor(t) for t in v):
            flat.extend(v)
            arity.append(len(v))
        else:
            raise GPPConfigError(f"a tensor sent between stages must be a tensor or a tuple of tensors, got "
                                 f"{type(v).__name__}; select tensors with \"name:i\" references")
    return flat, arity


def unflatten(flat: Sequence[torch.Tensor], arity: Sequence[int]) -> list[Any]:
    values: list[Any] = []
    pos = 0
    for a in arity:
        if a < 0:
            values.append(flat[pos])
            pos += 1
        else:
            values.append(tuple(flat[pos:pos + a]))
            pos += a
    assert pos == len(flat), (pos, len(flat))
    return values


def port_ranges(arity: Sequence[int]) -> list[range]:
    """The positions of each port's tensors in the flat list.

    >>> port_ranges([-1, 2, 0])
    [range(0, 1), range(1, 3), range(3, 3)]
    """
    ranges, pos = [], 0
    for a in arity:
        width = 1 if a < 0 else a
        ranges.append(range(pos, pos + width))
        pos += width
    return ranges
