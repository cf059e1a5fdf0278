"""Worker: train a few batches with a recording buffer store, and save which buffers each action
touched.

Run by ``tests/dist.py``: ``python buffer_touch.py CASES.json OUT_DIR``. For every case it swaps the
engine's buffers (:class:`~gpp_deepspeed.engine.buffers.StageBuffers`, DeepSpeed's ``pipe_buffers``)
for one that notes the time of every access, by anyone (our handlers and DeepSpeed's own forward
and backward), and assigns each access to the action that was running then (the engine's
``last_timeline``). ``OUT_DIR/<id>.rank<r>.json`` holds ``[action, [buffer, ...]]`` per action of
the last batch; the test compares them with what ``KINDS`` declares.
"""

import json
import sys
import time
from pathlib import Path

import deepspeed
import torch

from gpp_deepspeed.engine.buffers import BUFFER_KEYS, StageBuffers
from train_cases import build, train

_BUFFER_OF = {key: buffer.value for buffer, keys in BUFFER_KEYS.items() for key in keys}


class RecordingBuffers(StageBuffers):
    """A stage's buffers that note ``(time, buffer)`` at every read, write and release."""

    def __init__(self, store):
        super().__init__(store)
        self.log: list[tuple[float, str]] = []

    def _note(self, key):
        name = key if isinstance(key, str) else BUFFER_KEYS[key[0]][0]
        if name in _BUFFER_OF:
            self.log.append((time.perf_counter(), _BUFFER_OF[name]))

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        self._note(key)
        super().__setitem__(key, value)

    def free(self, buffers, slot):
        for buffer in buffers:
            self._note((buffer, slot))
        super().free(buffers, slot)


def touched(engine) -> list[tuple[str, list[str]]]:
    """Each action of the last batch with the buffers accessed while it ran."""
    log = engine.pipe_buffers.log
    return [(str(action), sorted({b for t, b in log if start <= t <= end}))
            for action, start, end in engine.last_timeline]


def main():
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for case in cases:
        mc, _, engine = build(case, world_size)
        engine.pipe_buffers = RecordingBuffers(engine.pipe_buffers)
        train(engine, mc, case, range(case["steps"]))
        (out / f"{case['id']}.rank{rank}.json").write_text(json.dumps(touched(engine)))
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
