"""Checkpoints written in the background: ``save_checkpoint`` returns once every tensor is copied,
and the files are written while training goes on (``graph_pipeline.checkpoint_in_background``).

DeepSpeed 0.19.8's own asynchronous writers (``FastCheckpointEngine``, and the
``DecoupledCheckpointEngine`` that runs it in another process) write through DeepSpeed's
``async_io`` op, which needs ``libaio``; where it cannot be built they cannot run. Here the pieces
are torch's:

* **snapshot** (blocking): every ``checkpoint_engine.save(state, path)`` DeepSpeed and
  :mod:`.portable` make copies the state's tensors to fresh CPU memory (a ``memcpy``: training
  will update the live ones in place) and queues ``torch.save`` of the copy;
* **write** (overlapped): one writer thread per process runs the queued saves in order (torch's
  serialisation releases the GIL while it writes);
* **commit** (overlapped, no collective): after its last write a rank leaves a marker
  ``.written/<global rank>`` in the checkpoint's staging folder; global rank 0's writer thread waits
  until every rank's marker is there, then renames ``<tag>.partial`` to ``<tag>`` and points
  ``latest`` at it (:func:`gpp_deepspeed.checkpoint.commit_tag`). A rank that dies or freezes before
  its marker leaves the staging folder uncommitted: ``latest`` keeps naming the last complete
  checkpoint, as with a blocking save.

One checkpoint is in flight at a time: the next ``save_checkpoint`` (and ``load_checkpoint``)
first waits for this process's writes of the previous one. Markers need a file system every rank
sees (the usual case, and DeepSpeed's assumption without ``use_node_local_storage``); with node-local
storage saves stay blocking.

Representative signatures::

    BackgroundCheckpointEngine(base)          # wraps DeepSpeed's TorchCheckpointEngine
    engine.save(state_dict, path)             # snapshot now, write later
    engine.save_owned(state_dict, path)       # a state of fresh copies: no snapshot
    engine.finish(save_dir, tag, rank=, world_size=, save_latest=)   # markers, then commit on rank 0
    engine.wait()                             # this process's writes (and its commit) done
"""

from __future__ import annotations

import atexit
import os
import queue
import shutil
import threading
import time
from concurrent.futures import Future

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ..checkpoint import commit_tag, staging_tag, write_latest

__all__ = ["BackgroundCheckpointEngine", "snapshot", "MARKERS"]

MARKERS = ".written"   # in a staging folder: one empty file per rank whose files are all written


def snapshot(obj):
    """``obj`` with every tensor copied to new CPU memory (containers rebuilt, the rest as is)."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        items = [(k, snapshot(v)) for k, v in obj.items()]
        try:
            return type(obj)(items)
        except TypeError:   # a dict subclass with another constructor
            return dict(items)
    if type(obj) in (list, tuple):
        return type(obj)(snapshot(v) for v in obj)
    return obj


class BackgroundCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine whose writes run on a thread (see the module docstring)."""

    def __init__(self, base: TorchCheckpointEngine):
        self.__dict__.update(base.__dict__)   # name, serialisation setting
        # A daemon thread, not a ThreadPoolExecutor: the interpreter joins an executor's threads at
        # exit, and a commit waiting for a rank that died must not hold the process.
        self._queue: queue.Queue = queue.Queue()
        self._writes: list[Future] = []
        self._commit: Future | None = None
        threading.Thread(target=self._run, name="gpp-ckpt-writer", daemon=True).start()
        atexit.register(self._wait_at_exit)

    def _run(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(exc)

    def _submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def save(self, state_dict, path: str):
        self.save_owned(snapshot(state_dict), path)

    def save_owned(self, state_dict, path: str):
        """``save`` of a state whose tensors nothing else holds (fresh copies): written as it is."""
        self._writes.append(self._submit(_write, state_dict, path, self.zipfile_serialization))

    def finish(self, save_dir: str, tag: str, *, rank: int, world_size: int, save_latest: bool,
               timeout_s: float = 3600.0) -> None:
        """Queue this rank's marker after its writes; on global rank 0 also the commit once every
        marker is there (or give up after ``timeout_s``: the checkpoint stays uncommitted)."""
        self._writes.append(self._submit(_mark, os.path.join(save_dir, staging_tag(tag)), rank))
        if rank == 0:
            self._commit = self._submit(_commit_when_written, save_dir, tag, world_size, save_latest, timeout_s)

    def wait(self) -> None:
        """Block until this process's queued writes (and commit) are done; raise the first error."""
        writes, self._writes = self._writes, []
        commit, self._commit = self._commit, None
        for future in writes + ([commit] if commit is not None else []):
            future.result()

    def _wait_at_exit(self) -> None:
        """A normal exit finishes this rank's writes, and waits a little for the commit."""
        for future in self._writes:
            future.exception()
        if self._commit is not None:
            try:
                self._commit.exception(timeout=60)
            except TimeoutError:
                pass

    def load(self, path: str, map_location=None):
        self.wait()
        return super().load(path, map_location=map_location)


def _write(state, path: str, zipfile: bool) -> None:
    torch.save(state, path, _use_new_zipfile_serialization=zipfile)


def _mark(staging: str, rank: int) -> None:
    os.makedirs(os.path.join(staging, MARKERS), exist_ok=True)
    open(os.path.join(staging, MARKERS, str(rank)), "w").close()


def _commit_when_written(save_dir: str, tag: str, world_size: int, save_latest: bool, timeout_s: float) -> None:
    markers = os.path.join(save_dir, staging_tag(tag), MARKERS)
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(markers)) < world_size:
        if time.monotonic() > deadline:
            return   # a rank never finished: the checkpoint stays a .partial folder
        time.sleep(0.05)
    shutil.rmtree(markers)
    commit_tag(save_dir, tag)
    if save_latest:
        write_latest(save_dir, tag)
