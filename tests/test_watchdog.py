"""The watchdog's store side, without a training job: namespaces, a frozen store, bounded lock waits.

The whole-job behaviour (a rank killed or frozen mid-training, under every launcher) is in
``test_faults.py``; here a store served in this process or by a small helper process, and a
:class:`~gpp_deepspeed.engine.watchdog.Watchdog` whose exit is recorded instead of taken.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch

from gpp_deepspeed.engine.startup import BuildLockTimeout, guard_build_locks
from gpp_deepspeed.engine.watchdog import StoreInfo, Watchdog


class Stopped(Exception):
    pass


def watchdog(store, *, rank, job, peers=(), timeout_s=2.0, host_rank=0):
    """A watchdog that records its exit (and raises ``Stopped`` in the calling thread) instead of
    ending the process."""
    wd = Watchdog(rank=rank, world_size=4, peers=list(peers), describe=lambda r: f"stage {r}", heartbeat_s=0.1,
                  timeout_s=timeout_s, store=StoreInfo(store, "the test store", host_rank), job=job)
    wd.exits = []

    def record(message, *, relayed, culprit=None):
        wd.exits.append((message, relayed, time.monotonic()))
        raise Stopped(message)

    wd._exit = record
    return wd


def served_store():
    return torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                      timeout=timedelta(seconds=10))


def test_two_jobs_sharing_a_store_never_see_each_others_failures_or_heartbeats():
    store = served_store()
    job_a, job_b, job_a_again = (watchdog(store, rank=1, job=j, peers=[2]) for j in ("a", "b", "a"))
    job_a.report_failure("global rank 2 (stage 2) failed: boom")
    job_b._beat_and_watch()   # job b's round: no failure of its own job
    assert job_b.exits == []
    with pytest.raises(Stopped):
        job_a_again._beat_and_watch()
    assert job_a_again.exits[0][:2] == ("global rank 2 (stage 2) failed: boom", True)
    assert not store.check(["failed"]) and not store.check(["beat/1"]), "nothing outside the job's prefix"


def test_the_first_failure_reported_stands_and_a_later_reporter_is_told_it():
    # A killed rank 2 closes rank 1's connections; rank 1 reports first, naming 2. Rank 0, whose
    # only peer is 1, fails next of 1's closed connection: its report must not replace the cause.
    store = served_store()
    first, later, watcher = (watchdog(store, rank=r, job="j", peers=[2]) for r in (1, 0, 3))
    cause = "global rank 1 (stage 1) failed: stage 1 waited for stage 2 (global rank 2)"
    assert first.report_failure(cause, culprit=2) == cause
    assert later.report_failure("global rank 0 (stage 0) failed: stage 0 waited for stage 1", culprit=1) == cause
    with pytest.raises(Stopped):
        watcher._beat_and_watch()
    assert watcher.exits[0][:2] == (cause, True)
    seen = []
    watcher._exit = lambda message, *, relayed, culprit=None: seen.append(culprit)
    watcher._beat_and_watch()
    assert seen == [2], "the culprit travels with the first message"


@contextmanager
def store_served_by_another_process(name):
    """(the server's process, a client of its store): global rank 0's place, a process the test
    can kill or freeze."""
    port_file = f"/tmp/gpp_watchdog_test_{name}_{os.getpid()}"
    server = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, torch.distributed as d\n"
        "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
        f"open({port_file!r}, 'w').write(str(s.port)); time.sleep(600)\n")])
    try:
        deadline = time.monotonic() + 60
        while not (os.path.exists(port_file) and open(port_file).read()):
            assert server.poll() is None and time.monotonic() < deadline, "the store's process did not start"
            time.sleep(0.1)
        yield server, torch.distributed.TCPStore("127.0.0.1", int(open(port_file).read()), is_master=False,
                                                 wait_for_workers=False, timeout=timedelta(seconds=10))
    finally:
        server.kill()
        server.wait()
        os.unlink(port_file)


def test_a_rank_failing_while_the_store_is_gone_names_the_stores_host_as_the_likely_cause():
    # Global rank 0 serves the store and is killed: rank 1's receive fails naming 0, then rank 2's
    # fails naming 1 (1's connections closed). With no store to read the first report from, rank 2
    # must still point at rank 0, and a rank failing with the store up must not blame its host.
    with store_served_by_another_process("gone") as (server, client):
        rank2 = watchdog(client, rank=2, job="j", peers=[1, 3])
        server.kill()
        server.wait()
        cause = rank2.likely_cause("global rank 2 (stage 2) failed: stage 2 waited for stage 1 (global rank 1)")
    assert cause is not None and "global rank 0 (stage 0)" in cause and "does not answer" in cause, cause
    up = watchdog(served_store(), rank=2, job="j", peers=[1, 3])
    assert up.likely_cause("global rank 2 (stage 2) failed: boom") is None, "its own report stands: no other cause"


def test_a_frozen_store_server_stops_the_watchdog_within_its_timeout_naming_the_host():
    # The server runs in another process that is then frozen (SIGSTOP), as when global rank 0,
    # which serves the rendezvous store, freezes: every store call of the watchdog then blocks.
    with store_served_by_another_process("frozen") as (server, client):
        wd = watchdog(client, rank=1, job="j", peers=[0, 2], timeout_s=2.0)
        judged = threading.Event()
        wd._exit = lambda message, *, relayed, culprit=None: (wd.exits.append((message, time.monotonic())), judged.set())
        wd._thread.start()
        wd._judge.start()
        try:
            time.sleep(1.0)   # a few good rounds
            assert wd.exits == []
            frozen_at = time.monotonic()
            os.kill(server.pid, signal.SIGSTOP)
            assert judged.wait(15), "the judge ended a watchdog whose store stopped answering"
        finally:
            wd._stop.set()
    message, at = wd.exits[0]
    # the last complete round was at most one beat (0.1 s) before the freeze
    assert 2.0 - 0.2 <= at - frozen_at < 2.0 + 5.0, at - frozen_at
    assert "has not answered" in message and "global rank 0 (stage 0)" in message, message


def test_a_wait_on_a_build_lock_ends_at_the_deadline_naming_the_lock(tmp_path, monkeypatch):
    from torch.utils.file_baton import FileBaton

    guard_build_locks()
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    monkeypatch.setenv("GPP_BUILD_LOCK_TIMEOUT_S", "0.3")
    baton = FileBaton(str(lock))
    assert not baton.try_acquire()
    start = time.monotonic()
    with pytest.raises(BuildLockTimeout, match="most likely stale") as err:
        baton.wait()
    assert 0.3 <= time.monotonic() - start < 2.0
    assert f"rm {lock}" in str(err.value) and "GPP_BUILD_LOCK_TIMEOUT_S" in str(err.value)


def test_a_build_lock_held_open_by_a_live_process_is_named_as_held(tmp_path, monkeypatch):
    from torch.utils.file_baton import FileBaton

    guard_build_locks()
    lock = tmp_path / "lock"
    holder = FileBaton(str(lock))
    assert holder.try_acquire()   # this process "builds": it holds the lock open
    monkeypatch.setenv("GPP_BUILD_LOCK_TIMEOUT_S", "0.2")
    try:
        with pytest.raises(BuildLockTimeout, match=rf"process\(es\) \[{os.getpid()}\]"):
            FileBaton(str(lock)).wait()
    finally:
        holder.release()


def test_a_process_id_kills_only_the_same_process_on_the_same_machine():
    from gpp_deepspeed.engine.watchdog import ProcessId

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        here = ProcessId.of_this_process()
        target = ProcessId(here.machine, child.pid, _start_of(child.pid))
        assert not ProcessId(here.machine, child.pid, target.start + 1).kill_if_local(), "a reused pid is left alone"
        assert not ProcessId("another machine", child.pid, target.start).kill_if_local()
        assert not here.kill_if_local(), "never itself"
        assert target.kill_if_local()
        assert child.wait(10) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()


def _start_of(pid):
    from gpp_deepspeed.engine.watchdog import _start_time

    return _start_time(pid)
