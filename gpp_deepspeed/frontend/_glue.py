"""The module of a captured function layer: generated code whose errors name the model's line.

A function layer (glue: ``torch.cat``, ``x.to(dtype)``, ``query_tokens.expand(b, -1, -1)``) runs
code that torch.fx generated (``File "<eval_with_key>.3"``), which no user wrote. An error raised
there gets a note naming the layer and the model's own line that the failing statement was traced
from, so the user reads ``unet_2d.py:278: timesteps = timesteps * ...`` instead of the generated
code::

    TypeError: only integer tensors of a single element can be converted to an index
    in captured layer "tensor", traced from diffusers/models/unets/unet_2d.py:278: ...
"""

from __future__ import annotations

import re
import traceback

from torch import fx

from ._tracing import model_line

__all__ = ["GlueModule", "LAYER_NAME"]

# meta key of a glue graph's output node: the layer's name (graph meta survives deep copies)
LAYER_NAME = "gpp_layer_name"

_ASSIGNED = re.compile(r"^\s*(\w+)\s*=")


class GlueModule(fx.GraphModule):
    """``fx.GraphModule`` whose errors carry a note naming the layer and the model's line."""

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except Exception as exc:
            note = self._where(exc)
            if note and note not in getattr(exc, "__notes__", ()):
                exc.add_note(note)
            raise

    def _where(self, exc: Exception) -> str:
        """``in captured layer "name", traced from file:line: code`` for the generated statement
        that raised, or ``""`` when the error did not come from this layer's code."""
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == self._code_file()]
        if not frames:
            return ""
        match = _ASSIGNED.match(frames[-1].line or "")
        by_name = {n.name: n for n in self.graph.nodes}
        node = by_name.get(match[1]) if match else None
        where = model_line(node)[len(" (at "):-1] if node is not None and model_line(node) else "an unknown line"
        layer = next(n for n in reversed(self.graph.nodes) if n.op == "output").meta.get(LAYER_NAME, "?")
        return f'in captured layer "{layer}", traced from {where}'

    def _code_file(self) -> str:
        return self.forward.__code__.co_filename
