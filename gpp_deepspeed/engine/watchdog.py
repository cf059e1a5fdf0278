"""Watchdog: when a rank dies or freezes, every other rank exits soon, naming it.

Without it, a rank whose peer died waits in a receive or a collective until
``graph_pipeline.p2p_timeout_s`` (gloo) or forever (NCCL), on every node. Here each process runs
one daemon thread that talks to the rendezvous store (the ``TCPStore`` behind the default process
group, through a connection of its own, so it never contends with the main thread):

* **heartbeat**: every ``heartbeat_s`` it increments ``beat/<global rank>``. The thread keeps
  beating while the main thread computes for a long time or waits on a slow data loader (torch
  ops and sleeps release the GIL), so a slow but alive rank is never taken for dead; a killed
  (SIGKILL) or frozen (SIGSTOP) process stops beating;
* **watch**: it reads the counters of the ranks this one exchanges tensors or gradients with
  (its pipeline and its data-parallel group). A counter that has not moved for
  ``watchdog_timeout_s`` (measured on this rank's own clock: no cross-node clock is compared)
  means that rank is dead or frozen; a rank that failed with an exception writes ``failed``
  itself. Either way the watcher writes ``failed`` (so ranks that do not watch that rank learn it
  within one beat), prints an error naming the failed rank and its stage, and exits the process
  (``os._exit``: the main thread may be blocked inside a C++ wait that nothing else ends);
* **uncaught exception**: a rank dying of an exception writes ``failed`` with it (a hook on
  ``sys.excepthook``), so the others stop at once instead of after the timeout. An exception the
  program catches is its own business: the rank is alive and keeps beating;
* **store lost**: if the store itself stops answering (its host, global rank 0, died or froze),
  a rank exits only if its main thread has been inside the same ``train_batch`` / ``eval_batch``
  for ``watchdog_timeout_s`` since: rank 0 may simply have finished before a peer's last
  instructions, and then the peer leaves its batch first.

A process marks itself ``done`` when it exits normally (not after an uncaught exception), so
finished ranks are not taken for dead.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch

__all__ = ["Watchdog", "start_watchdog", "EXIT_CODE"]

EXIT_CODE = 75          # what a rank exits with when the watchdog stops it (EX_TEMPFAIL)
_PREFIX = "gpp_watchdog/"
_DONE = b"done"


def _default_store_address() -> tuple[str, int] | None:
    """Host and port of the TCPStore behind the default process group, if it is one."""
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()   # private in torch 2.13; the only way to the group's store
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    if isinstance(store, torch.distributed.TCPStore):
        return store.host, store.port
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return (host, int(port)) if host and port and port.isdigit() else None


class Watchdog:
    """One per process; see the module docstring. ``describe(rank)`` names a rank for messages."""

    def __init__(self, *, rank: int, peers: list[int], describe, heartbeat_s: float, timeout_s: float,
                 address: tuple[str, int]):
        self.rank, self.peers, self.describe = rank, sorted(set(peers) - {rank}), describe
        self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s
        self._address = address
        self._store = None
        self._stop = threading.Event()
        self._batch = 0               # number of the train/eval batch the main thread is in, 0: none
        self._batch_started = 0.0
        self._beats = 0
        self._last_seen: dict[int, tuple[bytes, float]] = {}
        self._store_lost_since: float | None = None
        self._lost_batch = 0
        self._died = False
        self._thread = threading.Thread(target=self._loop, name="gpp-watchdog", daemon=True)

    # -- main-thread side -------------------------------------------------------------------------

    def start(self) -> "Watchdog":
        self._thread.start()
        atexit.register(self.stop)
        previous = sys.excepthook

        def hook(kind, value, tb):
            if not issubclass(kind, (KeyboardInterrupt, SystemExit)):
                self._died = True
                self.report_failure(f"global rank {self.rank} ({self.describe(self.rank)}) failed: "
                                    f"{kind.__name__}: {value}"[:2000])
            previous(kind, value, tb)

        sys.excepthook = hook
        return self

    @contextmanager
    def watching(self):
        """The main thread is running a batch (a lost store is judged by this)."""
        self._batch += 1
        self._batch_started = time.monotonic()
        try:
            yield
        finally:
            self._batch_started = 0.0

    def report_failure(self, message: str) -> None:
        """Tell every watching rank to stop, with ``message`` (best effort)."""
        try:
            self._connect().set("failed", message)
        except Exception:  # the store may be gone too: the heartbeats still stop
            pass

    def stop(self) -> None:
        """Stop beating; mark this rank done unless it died of an exception."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._died:
            return
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.heartbeat_s + 1.0)   # its last beat must not follow "done"
        if self._store_lost_since is not None:
            return   # the store is gone (rank 0 finished first): nobody is left to tell
        try:
            self._connect().set(f"beat/{self.rank}", _DONE)
        except Exception:
            pass

    # -- the thread -------------------------------------------------------------------------------

    def _connect(self):
        """A new connection to the store (the thread keeps its own; other callers open one each)."""
        host, port = self._address
        store = torch.distributed.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                           timeout=timedelta(seconds=max(5.0, self.heartbeat_s * 5)))
        return torch.distributed.PrefixStore(_PREFIX, store)

    def _client(self):
        if self._store is None:
            self._store = self._connect()
        return self._store

    def _loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._beat_and_watch()
                self._store_lost_since = None
            except Exception as exc:  # noqa: BLE001 - any store error means the store is unreachable
                if self._stop.is_set():
                    return
                self._store_lost(exc)

    def _beat_and_watch(self) -> None:
        store = self._client()
        self._beats += 1
        if self._stop.is_set():
            return
        store.set(f"beat/{self.rank}", str(self._beats))
        if store.check(["failed"]):
            self._exit(store.get("failed").decode(errors="replace"), relayed=True)
        now = time.monotonic()
        keys = [f"beat/{p}" for p in self.peers]
        present = [p for p, k in zip(self.peers, keys) if store.check([k])]
        values = store.multi_get([f"beat/{p}" for p in present]) if present else []
        for peer, value in zip(present, values):
            seen = self._last_seen.get(peer)
            if seen is None or seen[0] != value:
                self._last_seen[peer] = (value, now)
            elif value != _DONE and now - seen[1] > self.timeout_s:
                message = (f"global rank {peer} ({self.describe(peer)}) stopped making progress: no heartbeat for "
                           f"{now - seen[1]:.0f} s (graph_pipeline.watchdog_timeout_s = {self.timeout_s:g}); it "
                           "was killed or is frozen")
                self.report_failure(message)
                self._exit(message, relayed=False)

    def _store_lost(self, exc: Exception) -> None:
        now = time.monotonic()
        if self._store_lost_since is None:
            self._store_lost_since = now
            self._store = None   # reconnect next time
            self._lost_batch = self._batch
        in_same_batch = self._batch_started and self._batch == self._lost_batch
        if in_same_batch and now - self._store_lost_since > self.timeout_s:
            self._exit(f"the rendezvous store at {self._address[0]}:{self._address[1]}, hosted by global rank 0 "
                       f"({self.describe(0)}), has not answered for {now - self._store_lost_since:.0f} s while this "
                       f"rank waits in a batch: global rank 0 was killed or is frozen ({type(exc).__name__}: "
                       f"{str(exc)[:200]})", relayed=False)

    def _exit(self, message: str, *, relayed: bool) -> None:
        who = f"global rank {self.rank} ({self.describe(self.rank)})"
        prefix = "stops: another rank reported" if relayed else "stops"
        sys.stderr.write(f"\n[gpp_deepspeed watchdog t={time.time():.1f}] {who} {prefix}: {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        # Linger two beats so every watcher reads "failed" before this process goes (global rank 0
        # hosts the store: leaving at once would make the others blame it instead).
        time.sleep(2 * self.heartbeat_s + 0.5)
        os._exit(EXIT_CODE)


_WATCHDOG: Watchdog | None = None


def start_watchdog(*, rank: int, peers: list[int], describe, heartbeat_s: float, timeout_s: float) -> Watchdog | None:
    """This process's watchdog (started once; later engines reuse it, with their peers added)."""
    global _WATCHDOG
    if _WATCHDOG is not None:
        _WATCHDOG.peers = sorted(set(_WATCHDOG.peers) | (set(peers) - {rank}))
        _WATCHDOG.describe = describe
        return _WATCHDOG
    address = _default_store_address()
    if address is None:
        return None
    _WATCHDOG = Watchdog(rank=rank, peers=peers, describe=describe, heartbeat_s=heartbeat_s, timeout_s=timeout_s,
                         address=address).start()
    return _WATCHDOG
