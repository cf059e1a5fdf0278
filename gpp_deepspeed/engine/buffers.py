"""A stage's buffers: what it holds for each micro-batch, by the slot the program gave it.

DeepSpeed's ``PipelineEngine`` keeps its buffers in ``pipe_buffers``, a dict of lists (key ->
slot -> value) that its own forward and backward read and write directly. :class:`StageBuffers`
is that same dict, named by :class:`~gpp_deepspeed.schedule.ir.Buffer` (the names the schedule's
table :data:`~gpp_deepspeed.schedule.KINDS` declares reads, writes and frees in), so the transfers
and the backward read a micro-batch's outputs as ``buffers[Buffer.OUTPUTS, slot]`` and DeepSpeed
still finds ``pipe_buffers["outputs"]``.

Glossary
--------
slot
    The index of a buffer; the program gives every micro-batch one
    (:func:`~gpp_deepspeed.schedule.assign_buffers`).
key
    One of the engine's ``pipe_buffers`` lists; a buffer is held under one key or, for the
    outputs, two (DeepSpeed's ``outputs`` and ``output_tensors``).
"""

from __future__ import annotations

from ..schedule.ir import Buffer

__all__ = ["BUFFER_KEYS", "StageBuffers"]

BUFFER_KEYS: dict[Buffer, tuple[str, ...]] = {
    Buffer.LOADED: ("loaded", ), Buffer.RECEIVED: ("received", ), Buffer.INPUTS: ("inputs", ),
    Buffer.OUTPUTS: ("outputs", "output_tensors"), Buffer.LABELS: ("labels", ), Buffer.LOSS: ("losses", ),
    Buffer.GRADS: ("grads", ), Buffer.WEIGHT_GRAD: ("weight_grad", )}
"""The ``pipe_buffers`` keys that hold each of a micro-batch's buffers (DeepSpeed's
``PipelineEngine`` owns ``inputs``, ``labels``, ``outputs`` and ``output_tensors``)."""


class StageBuffers(dict):
    """``pipe_buffers`` (``{key: [value per slot]}``), also read and written by :class:`Buffer`.

    >>> b = StageBuffers(num_slots=2)
    >>> b[Buffer.OUTPUTS, 1] = ("y", )
    >>> b["outputs"], b[Buffer.OUTPUTS, 1]
    ([None, ('y',)], ('y',))
    >>> b.free([Buffer.OUTPUTS], 1); b["outputs"]
    [None, None]
    """

    def __init__(self, store: dict | None = None, *, num_slots: int = 0):
        super().__init__(store or {})
        for keys in BUFFER_KEYS.values():
            for key in keys:
                self.setdefault(key, [None] * num_slots)

    def __getitem__(self, key):
        if isinstance(key, tuple):
            buffer, slot = key
            return super().__getitem__(BUFFER_KEYS[buffer][0])[slot]
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        if isinstance(key, tuple):
            buffer, slot = key
            super().__getitem__(BUFFER_KEYS[buffer][0])[slot] = value
            return
        super().__setitem__(key, value)

    def free(self, buffers, slot: int) -> None:
        """Drop what ``buffers`` hold in ``slot`` (a release action)."""
        for buffer in buffers:
            for key in BUFFER_KEYS[buffer]:
                super().__getitem__(key)[slot] = None
