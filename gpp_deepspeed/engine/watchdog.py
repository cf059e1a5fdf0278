"""Watchdog: when a rank dies or freezes, every other rank exits soon, naming it.

Without it, a rank whose peer died waits in a receive or a collective until
``graph_pipeline.p2p_timeout_s`` (gloo) or forever (NCCL), on every node. Here each process runs
two daemon threads:

* **heartbeat** (``gpp-watchdog``): every ``heartbeat_s`` it increments ``beat/<global rank>`` in
  the store. The thread keeps beating while the main thread computes for a long time or waits on a
  slow data loader (torch ops and sleeps release the GIL), so a slow but alive rank is never taken
  for dead; a killed (SIGKILL) or frozen (SIGSTOP) process stops beating. In the same round it reads
  the counters of the ranks this one exchanges tensors or gradients with (its pipeline and its
  data-parallel group): one that has not moved for ``watchdog_timeout_s`` (on this rank's own clock:
  no cross-node clock is compared) means that rank is dead or frozen; a rank that failed with an
  exception writes ``failed`` itself. Either way the watcher writes ``failed`` (so ranks that do not
  watch that rank learn it within one beat), prints an error naming the failed rank and its stage,
  and exits the process (``os._exit``: the main thread may be blocked inside a C++ wait that
  nothing else ends);
* **judge** (``gpp-watchdog-judge``): it never touches the store. A TCPStore call whose server is
  frozen never returns, whatever its timeout (torch 2.13: ``check``, ``get``, ``multi_get``,
  ``add`` and a new connection all block until the server wakes or dies), so the heartbeat thread
  itself can hang. The judge reads the time of the heartbeat thread's last complete round: older
  than ``watchdog_timeout_s`` means the store is unreachable, which counts as a failure of the
  process serving it (global rank 0 under every launcher here), and this rank exits naming it.
  Every store call therefore has a deadline, whether or not torch honours its own.

**Which store.** The default process group's own store (``env://``, ``tcp://``: the TCPStore global
rank 0 serves; ``file://``: a FileStore), through a clone of it (its own connection, so the thread
never waits behind a store call of the main thread), never an address guessed from the environment.
Keys live under ``gpp_watchdog/<job>/``, ``<job>`` a random id global rank 0 draws and broadcasts
when the watchdog starts, so two jobs, or two incarnations of an elastic job, sharing a store never
read each other's heartbeats or failures. A store that cannot be cloned means no watchdog, with a
warning.

**Out fast, whatever froze.** A launcher that sees one rank fail stops the others with
``SIGTERM`` and waits for them (DeepSpeed's ``terminate_process_tree``: up to 30 s; torch elastic's
agent: up to 30 s) before it kills; a frozen process takes no ``SIGTERM``, so the job outlived the
watchdog by those 30 s. Every rank therefore shares, at start-up, who it is as a process
(:class:`ProcessId`: the machine, the pid and the pid's start time, gathered over the world), and
a rank the watchdog stops first kills (``SIGKILL``) the failed rank if that rank runs on its own
machine and is still the same process (a pid reused since is left alone). The failed rank's number
travels in ``failed`` with the message, set once per job (the first report stands: a neighbour
that fails next, of the first rank's closed connections, says so and names it); when the store
itself is lost, the culprit is the rank that serves it (a neighbour that fails of its closed
connections then names that rank in its log too). The launcher then sees a child die and ends
the rest at once. A node whose every rank froze has no survivor to do this: its launcher waits
until the job's scheduler ends it.

**Exit code.** A rank the watchdog stops exits with :data:`EXIT_CODE` (75, ``EX_TEMPFAIL``): "a
peer failed, this rank did not". An elastic agent (``torchrun --max-restarts N``) restarts the
workers on it as on any failure; a supervisor can tell it from a rank's own error (exit code 1,
or a signal), which names the rank that failed first. Under torch elastic the message is also
written to the worker's ``TORCHELASTIC_ERROR_FILE`` (as ``@record`` writes an exception), so the
agent's ``ChildFailedError`` reports it.

**Exits.** An uncaught exception writes ``failed`` with it (a hook on ``sys.excepthook``), so the
others stop at once instead of after the timeout; an exception the program catches is its own
business. A process that exits normally marks itself ``done`` (not after an uncaught exception),
so finished ranks are not taken for dead. The process serving the store (global rank 0) then
lingers until every other rank has finished, or ``watchdog_timeout_s`` passes with none finishing,
so no rank still at work loses the store; a rank that loses the store after seeing its host
``done`` stops watching quietly.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Watchdog", "StoreInfo", "ProcessId", "group_store", "start_watchdog", "EXIT_CODE"]

EXIT_CODE = 75          # what a rank exits with when the watchdog stops it: a peer failed (EX_TEMPFAIL)
_PREFIX = "gpp_watchdog/"
_DONE = b"done"
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreInfo:
    """The store the watchdog talks through.

    ``store`` is the process group's own store object (kept referenced: on its host this keeps the
    server up until the watchdog is done with it), ``where`` names it in messages, and
    ``host_rank`` is the global rank whose process serves it (None: no process does, as for a file
    store, or not one of this job's ranks, as for torchrun's agent store)."""

    store: object
    where: str
    host_rank: int | None


@dataclass(frozen=True)
class ProcessId:
    """A process, as another process of the same machine can find it again: ``machine`` (the boot
    id and the pid namespace: two containers of one host are two machines here), ``pid`` and the
    pid's start time in clock ticks since boot (a pid reused later has another)."""

    machine: str
    pid: int
    start: int

    @staticmethod
    def of_this_process() -> "ProcessId":
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            machine = f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
        except OSError:   # not Linux: nothing to find again
            return ProcessId("", os.getpid(), -1)
        return ProcessId(machine, os.getpid(), _start_time(os.getpid()))

    def is_local(self) -> bool:
        """True if this process runs on this machine, is not the caller, and is still the same
        process (not gone, its pid not reused)."""
        here = ProcessId.of_this_process()
        if not self.machine or self.machine != here.machine or self.pid == here.pid:
            return False
        return _start_time(self.pid) == self.start

    def kill_if_local(self) -> bool:
        """SIGKILL this process if :meth:`is_local`; True if a signal was sent."""
        if not self.is_local():
            return False
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            return False
        return True


def _start_time(pid: int) -> int:
    """Field 22 of ``/proc/<pid>/stat`` (after the command name, which may hold spaces), or -1."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return -1


def group_store() -> StoreInfo | None:
    """The default process group's store, or None when there is no default group."""
    from torch.distributed import distributed_c10d as c10d

    try:
        store = c10d._get_default_store()   # private in torch 2.13; the only way to the group's store
    except (RuntimeError, ValueError):
        return None
    inner = store
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    if isinstance(inner, torch.distributed.TCPStore):
        # torchrun's agent serves the store when TORCHELASTIC_USE_AGENT_STORE is set; otherwise the
        # rendezvous handlers make global rank 0 its server (env://, tcp://, DeepSpeed's MPI discovery).
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        return StoreInfo(store, f"the rendezvous store at {inner.host}:{inner.port}", None if agent else 0)
    if isinstance(inner, torch.distributed.FileStore):
        return StoreInfo(store, f"the file store {inner.path}", None)
    return StoreInfo(store, f"the process group's {type(inner).__name__}", None)


def _within(seconds: float, fn: Callable[[], object]) -> bool:
    """Run ``fn`` on a daemon thread; True if it returned (even by raising) within ``seconds``."""
    finished = threading.Event()

    def run():
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort: the store may be gone
            pass
        finally:
            finished.set()

    threading.Thread(target=run, name="gpp-watchdog-call", daemon=True).start()
    return finished.wait(seconds)


class Watchdog:
    """One per process; see the module docstring. ``describe(rank)`` names a rank for messages."""

    def __init__(self, *, rank: int, world_size: int, peers: list[int], describe, heartbeat_s: float,
                 timeout_s: float, store: StoreInfo, job: str, processes: dict[int, ProcessId] | None = None):
        self.rank, self.world_size, self.describe = rank, world_size, describe
        self.processes = dict(processes or {})   # global rank -> its process (killed if it freezes here)
        self.peers = sorted(set(peers) - {rank})
        self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s
        self.info, self.job = store, job
        self._client_store = None
        self._stop = threading.Event()
        self._exiting = threading.Lock()
        self._batch_started = 0.0     # when the main thread entered its current batch (0: in none)
        self._beats = 0
        self._last_seen: dict[int, tuple[bytes, float]] = {}
        self._last_round = time.monotonic()
        self._last_error: Exception | None = None
        self._host_done = False
        self._died = False
        self._thread = threading.Thread(target=self._loop, name="gpp-watchdog", daemon=True)
        self._judge = threading.Thread(target=self._judge_loop, name="gpp-watchdog-judge", daemon=True)

    @property
    def hosts_store(self) -> bool:
        return self.info.host_rank == self.rank

    # -- main-thread side -------------------------------------------------------------------------

    def start(self) -> "Watchdog":
        self._thread.start()
        self._judge.start()
        atexit.register(self.stop)
        previous = sys.excepthook

        def hook(kind, value, tb):
            if not issubclass(kind, (KeyboardInterrupt, SystemExit)):
                self._died = True
                mine = f"global rank {self.rank} ({self.describe(self.rank)}) failed: {kind.__name__}: {value}"[:2000]
                cause = self.likely_cause(mine)
                if cause is not None:
                    sys.stderr.write(f"\n[gpp_deepspeed watchdog t={time.time():.1f}] global rank {self.rank} "
                                     f"({self.describe(self.rank)}) failed {cause}\n")
            previous(kind, value, tb)

        sys.excepthook = hook
        return self

    @contextmanager
    def watching(self):
        """The main thread is running a batch (named in the message if the store is lost)."""
        self._batch_started = time.monotonic()
        try:
            yield
        finally:
            self._batch_started = 0.0

    def report_failure(self, message: str, *, culprit: int | None = None) -> str | None:
        """Tell every watching rank to stop, with ``message`` and the rank that failed (best effort,
        bounded in time). The first report of a job stands: a later one (a neighbour that failed
        because the first rank's connections closed) would otherwise put its own name where the
        cause was. Returns the report that stands, or None if the store did not answer."""
        standing = []

        def tell():
            # one key, set once: the culprit travels in the same value, so a watcher never reads
            # the first message with a later reporter's culprit, or without one
            ours = f"{'' if culprit is None else culprit}\n{message}"
            standing.append(_failure(self._connect().compare_set("failed", "", ours))[1])

        _within(5 * self.heartbeat_s + 5.0, tell)
        return standing[0] if standing else None

    def likely_cause(self, mine: str) -> str | None:
        """Report this rank's failure ``mine``; if another failure probably caused it, a phrase
        naming that one ("after another rank reported: ...") for this rank's log, else None.

        A rank usually fails of a neighbour's closed connections, and its own error then names the
        neighbour, not the root cause: the first report in the store is that cause. When the store
        does not answer either, its host is gone or frozen, and a closed connection here most
        likely followed from that (global rank 0 killed: rank 1's receive fails naming 0, rank 2's
        then names 1), so the host is named."""
        first = self.report_failure(mine)
        if first is not None:
            return None if first == mine else f"after another rank reported: {first}"
        host = self.info.host_rank
        if host is None or host == self.rank:
            return None
        return (f"while {self._the_store()} does not answer either: global rank {host} was most likely killed "
                "or is frozen, and this rank's error followed from it")

    def stop(self) -> None:
        """Stop beating; mark this rank done unless it died of an exception; on the store's host,
        wait for the other ranks to finish first."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._died:
            if self.hosts_store:   # keep the store up until the others have read "failed"
                time.sleep(2 * self.heartbeat_s + 0.5)
            return
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.heartbeat_s + 1.0)   # its last beat must not follow "done"
        deadline = 5 * self.heartbeat_s + 5.0
        if not _within(deadline, lambda: self._connect().set(f"beat/{self.rank}", _DONE)):
            return   # the store is gone (its host finished first): nobody is left to tell
        _within(deadline, lambda: self._connect().add("finished", 1))
        if self.hosts_store:
            self._wait_for_others()

    def _wait_for_others(self) -> None:
        """Keep serving the store until every other rank has finished, or ``timeout_s`` passes with
        none finishing (a rank still at work must not lose the store it beats through)."""
        store = self._connect()
        finished, moved = -1, time.monotonic()
        while time.monotonic() - moved < self.timeout_s:
            count = []
            if not _within(5 * self.heartbeat_s + 5.0, lambda: count.append(store.add("finished", 0))) or not count:
                return
            if count[0] >= self.world_size:
                return
            if count[0] != finished:
                finished, moved = count[0], time.monotonic()
            time.sleep(self.heartbeat_s / 2)

    # -- the heartbeat thread ---------------------------------------------------------------------

    def _connect(self):
        """A new connection to the store, under this job's prefix."""
        return torch.distributed.PrefixStore(f"{_PREFIX}{self.job}/", self.info.store.clone())

    def _client(self):
        if self._client_store is None:
            self._client_store = self._connect()
        return self._client_store

    def _loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._beat_and_watch()
                self._last_round = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - any store error: reconnect next round
                self._last_error = exc
                self._client_store = None

    def _beat_and_watch(self) -> None:
        store = self._client()
        self._beats += 1
        if self._stop.is_set():
            return
        store.set(f"beat/{self.rank}", str(self._beats))
        if store.check(["failed"]):
            culprit, message = _failure(store.get("failed"))
            self._exit(message, relayed=True, culprit=culprit)
        now = time.monotonic()
        host = self.info.host_rank
        watched = sorted(set(self.peers) | ({host} if host is not None and host != self.rank else set()))
        present = [p for p in watched if store.check([f"beat/{p}"])]
        values = dict(zip(present, store.multi_get([f"beat/{p}" for p in present]) if present else []))
        self._host_done = values.get(host) == _DONE
        for peer in self.peers:
            if peer not in values:
                continue
            value, seen = values[peer], self._last_seen.get(peer)
            if seen is None or seen[0] != value:
                self._last_seen[peer] = (value, now)
            elif value != _DONE and now - seen[1] > self.timeout_s:
                message = (f"global rank {peer} ({self.describe(peer)}) stopped making progress: no heartbeat for "
                           f"{now - seen[1]:.0f} s (graph_pipeline.watchdog_timeout_s = {self.timeout_s:g}); it "
                           "was killed or is frozen")
                self.report_failure(message, culprit=peer)
                self._exit(message, relayed=False, culprit=peer)

    # -- the judge --------------------------------------------------------------------------------

    def _judge_loop(self) -> None:
        while not self._stop.wait(min(self.heartbeat_s, 1.0)):
            silent = time.monotonic() - self._last_round
            if silent <= self.timeout_s:
                continue
            if self._host_done:
                return   # the host finished and waited for us as long as it could: stop watching
            self._exit(self._store_lost_message(silent), relayed=False, culprit=self.info.host_rank)

    def _the_store(self) -> str:
        """The store as messages name it: where it is and, when one of the job's ranks serves it,
        which (a trailing comma closes that clause)."""
        host = self.info.host_rank
        if host is None:
            return self.info.where
        return f"{self.info.where}, served by global rank {host} ({self.describe(host)}),"

    def _store_lost_message(self, silent: float) -> str:
        host = self.info.host_rank
        culprit = (f"global rank {host} was killed or is frozen" if host is not None else
                   "its server was killed or is frozen")
        where = (f" while this rank waits in a batch for {time.monotonic() - self._batch_started:.0f} s"
                 if self._batch_started else "")
        error = f" ({type(self._last_error).__name__}: {str(self._last_error)[:200]})" if self._last_error else ""
        return (f"{self._the_store()} has not answered for {silent:.0f} s (graph_pipeline."
                f"watchdog_timeout_s = {self.timeout_s:g}){where}: {culprit}{error}")

    def _exit(self, message: str, *, relayed: bool, culprit: int | None = None) -> None:
        if not self._exiting.acquire(blocking=False):
            time.sleep(3600)   # the other thread is already taking the process down
        who = f"global rank {self.rank} ({self.describe(self.rank)})"
        prefix = "stops: another rank reported" if relayed else "stops"
        # A frozen culprit on this machine takes no SIGTERM: it is killed (after the lingering
        # below, so that every rank reads "failed" before a killed peer's closed connections wake
        # its main thread), so that the launcher, which waits for its children, sees one die and
        # ends the rest at once.
        victim = self.processes.get(culprit) if culprit is not None else None
        if victim is not None and victim.is_local():
            message += f"; this rank kills it (SIGKILL, pid {victim.pid})"
        sys.stderr.write(f"\n[gpp_deepspeed watchdog t={time.time():.1f}] {who} {prefix}: {message} "
                         f"(exit code {EXIT_CODE}: a peer failed)\n")
        sys.stderr.flush()
        sys.stdout.flush()
        _write_elastic_error_file(f"{who} {prefix}: {message}")
        # Linger two beats so every watcher reads "failed" before this process goes (the store's
        # host leaving at once would make the others blame it instead).
        time.sleep(2 * self.heartbeat_s + 0.5)
        if victim is not None:
            victim.kill_if_local()
        os._exit(EXIT_CODE)


def _failure(value: bytes) -> tuple[int | None, str]:
    """The culprit and message of a job's ``failed`` key (``"<rank or nothing>\\n<message>"``)."""
    culprit, _, message = value.decode(errors="replace").partition("\n")
    return (int(culprit) if culprit else None), message


def _write_elastic_error_file(message: str) -> None:
    """Under torch elastic, leave ``message`` where the agent reads a worker's error (the JSON
    that ``torch.distributed.elastic.multiprocessing.errors.record`` writes)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": f"PeerFailure (exit code {EXIT_CODE}): {message}",
                                   "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass


_WATCHDOG: Watchdog | None = None
_WARNED = False


def _job_id() -> str:
    """A random id drawn by global rank 0, the same on every rank (a collective of the world)."""
    ids = [uuid.uuid4().hex[:12] if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(ids, src=0)
    return ids[0]


def start_watchdog(*, rank: int, peers: list[int], describe, heartbeat_s: float, timeout_s: float) -> Watchdog | None:
    """This process's watchdog (started once, on every rank together; later engines reuse it, with
    their peers added). None, with a warning once, when the process group's store cannot serve it."""
    global _WATCHDOG, _WARNED
    if _WATCHDOG is not None:
        _WATCHDOG.peers = sorted(set(_WATCHDOG.peers) | (set(peers) - {rank}))
        _WATCHDOG.describe = describe
        return _WATCHDOG
    info = group_store()
    usable = info is not None
    if usable:
        try:
            info.store.clone()
        except Exception:  # noqa: BLE001 - a store written in Python, say: no connection of our own
            usable = False
    job = _job_id()   # every rank takes part, whatever its store
    processes = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(processes, ProcessId.of_this_process())
    if not usable:
        if not _WARNED:
            _log.warning("graph_pipeline.watchdog is on, but %s cannot be cloned into a connection of its own: "
                         "no watchdog runs, so a dead or frozen rank is found only after graph_pipeline.p2p_timeout_s",
                         info.where if info is not None else "no default process group store")
            _WARNED = True
        return None
    _WATCHDOG = Watchdog(rank=rank, world_size=torch.distributed.get_world_size(), peers=peers, describe=describe,
                         heartbeat_s=heartbeat_s, timeout_s=timeout_s, store=info, job=job,
                         processes=dict(enumerate(processes))).start()
    return _WATCHDOG
