"""A point-to-point transport at least as strict as NCCL's, on gloo: for tests only.

We cannot run two NCCL ranks here (one GPU at most), so the tests run the engine under a transport
that stops wherever NCCL could stop. :func:`install` replaces ``torch.distributed``'s
``batch_isend_irecv``, ``isend`` and ``irecv`` in this process (every rank calls it, after
``init_process_group``; ``tests/workers/train_cases.py`` does when ``GPP_STRICT_P2P=1``):

rendezvous
    a send completes only when its receive has been launched: the receiving rank acknowledges each
    receive as it launches it, on a separate gloo group, and the send waits for that message;
whole groups
    ``batch_isend_irecv`` returns one request for the batch (as NCCL's coalescing manager does),
    complete when every send and receive of it has;
stream order
    a rank launches its groups one at a time in posting order, on one thread: a group starts only
    when the one posted before it has completed (a single ``isend``/``irecv`` is a group of one);
separate channels
    batched ops travel on one gloo group, single ones on another, so a batched send never matches a
    single receive (PyTorch's NCCL process group has run them on different communicators);
hang report
    a group not complete after ``GPP_STRICT_P2P_HANG_S`` seconds (default 30) prints
    ``strict p2p: rank R hangs on group N [...]`` with the group's ops and ends the process with
    exit code 3, so a launch fails in seconds instead of hanging.

Plain gloo is looser on every point (a send completes once written, each op of a batch has its
own request, ops are not ordered across batches, batched and single ops match), which is why a
schedule that deadlocks under NCCL can pass there; ``tests/test_strict_transport.py`` holds the
controls.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["install", "stats", "HANG_EXIT_CODE"]

HANG_EXIT_CODE = 3
_state: "_Strict | None" = None


class _Request:
    """The one request of a group: complete when the launcher thread has completed the group."""

    def __init__(self):
        self._done = threading.Event()

    def wait(self, timeout=None) -> bool:
        secs = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if not self._done.wait(secs):
            raise RuntimeError(f"strict p2p: group not complete after {secs} s")
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


class _Strict:
    def __init__(self, hang_s: float):
        self.rank = dist.get_rank()
        self.hang_s = hang_s
        # Every rank creates the same groups in the same order (new_group is collective).
        self.channels = {batched: (dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
                         for batched in (True, False)}
        self.counts = {"groups": 0, "batched_ops": 0, "single_ops": 0}
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._launch_in_order, name="strict-p2p", daemon=True).start()

    def post(self, ops: list[tuple[bool, torch.Tensor, int]], *, batched: bool) -> _Request:
        """Queue one group of ``(is_send, tensor, peer)``; its request completes with the group."""
        request = _Request()
        self.counts["batched_ops" if batched else "single_ops"] += len(ops)
        self.queue.put((ops, batched, request))
        return request

    def _launch_in_order(self) -> None:
        try:
            self._launch_forever()
        except Exception as exc:   # a bug here must not look like a hang 30 s later
            print(f"strict p2p: rank {self.rank} launcher failed: {exc!r}", file=sys.stderr, flush=True)
            os._exit(HANG_EXIT_CODE + 1)

    def _launch_forever(self) -> None:
        while True:
            ops, batched, request = self.queue.get()
            self.counts["groups"] += 1
            data, ack = self.channels[batched]
            works, keep = [], []
            for is_send, tensor, peer in ops:
                flag = torch.zeros(1)
                keep.append(flag)
                if is_send:
                    works.append((_ORIGINAL["isend"](tensor, peer, group=data), is_send, peer))
                    works.append((_ORIGINAL["irecv"](flag, peer, group=ack), is_send, peer))  # its receive launched
                else:
                    works.append((_ORIGINAL["irecv"](tensor, peer, group=data), is_send, peer))
                    works.append((_ORIGINAL["isend"](flag, peer, group=ack), is_send, peer))  # tell the sender
            deadline = time.monotonic() + self.hang_s
            for work, is_send, peer in works:
                try:
                    work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
                except RuntimeError:
                    self._hang(ops, batched)
            request._done.set()

    def _hang(self, ops, batched) -> None:
        what = "; ".join(f"{'send' if s else 'recv'} {t.numel()} {str(t.dtype).replace('torch.', '')} "
                         f"{'to' if s else 'from'} {p}" for s, t, p in ops)
        print(f"strict p2p: rank {self.rank} hangs on group {self.counts['groups']} "
              f"({'batched' if batched else 'single'}) [{what}] after {self.hang_s:g} s", file=sys.stderr, flush=True)
        os._exit(HANG_EXIT_CODE)


_ORIGINAL: dict = {}


def _is_send(op) -> bool:
    return op.op in (_ORIGINAL["isend"], _isend)


def _global(peer, group, group_peer) -> int:
    """The global rank of a peer named either way (the strict channels span the whole world)."""
    return peer if peer is not None else dist.get_global_rank(group, group_peer)


def _batch_isend_irecv(p2p_op_list):
    if not p2p_op_list:
        return []
    ops = [(_is_send(op), op.tensor, _global(op.peer, op.group, getattr(op, "group_peer", None))) for op in p2p_op_list]
    return [_state.post(ops, batched=True)]


def _isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    return _state.post([(True, tensor, _global(dst, group, group_dst))], batched=False)


def _irecv(tensor, src=None, group=None, tag=0, group_src=None):
    return _state.post([(False, tensor, _global(src, group, group_src))], batched=False)


def install(hang_s: float | None = None) -> None:
    """Make this process's point-to-point ops strict (see the module docstring); every rank calls
    it after ``init_process_group``, before any point-to-point op."""
    global _state
    if _state is not None:
        return
    hang_s = float(os.environ.get("GPP_STRICT_P2P_HANG_S", "30")) if hang_s is None else hang_s
    _ORIGINAL.update(isend=c10d.isend, irecv=c10d.irecv, batch=c10d.batch_isend_irecv)
    _state = _Strict(hang_s)
    # Both module namespaces: P2POp checks its op against distributed_c10d's own names.
    for module in (dist, c10d):
        module.isend, module.irecv, module.batch_isend_irecv = _isend, _irecv, _batch_isend_irecv


def stats() -> dict | None:
    """How many groups this rank launched and how many batched and single ops it posted (None if
    the strict transport is not installed)."""
    return None if _state is None else dict(_state.counts)
