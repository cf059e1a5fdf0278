"""A rank that dies or freezes mid-training stops every other rank within 60 s, with its name.

``tests/workers/fault_worker.py`` trains a 4-stage pipeline; at step 4 the middle rank 2 sends
itself SIGKILL or SIGSTOP. The watchdog (:mod:`gpp_deepspeed.engine.watchdog`, timeout 15 s here)
must make every other rank exit within 60 s of that moment, printing an error that names global
rank 2 and its stage, under the tests' own launcher, the ``deepspeed`` launcher, ``mpiexec`` and
two ``deepspeed --no_ssh`` node launches. Earlier in the tests' own launches rank 0's data loader
spends 30 s (two timeouts) busy at step 1: slow but alive, it must not be taken for dead.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist import free_port, launch, remove_shm

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SHM = Path("/dev/shm")
WORKER = Path(__file__).resolve().parent / "workers" / "fault_worker.py"
VICTIM = 2
LIMIT_S = 60
NAMED = f"global rank {VICTIM} (stage {VICTIM} of pipeline replica 0)"


def worker_args(out, how, *, slow=True):
    args = [str(out), "--victim", str(VICTIM), "--how", how, "--at-step", "4"]
    return args + (["--slow-rank", "0", "--slow-step", "1"] if slow else [])


def check_survivors_were_slow_step_safe(outputs):
    # every rank trained past the slow step 1 and up to the failure: nobody was taken for dead early
    for r, out in enumerate(outputs):
        assert f"rank {r} step 3" in out, f"rank {r} did not reach step 3:\n{out[-3000:]}"


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_every_rank_exits_within_60s_naming_the_dead_or_frozen_rank(tmp_path, how):
    survivors = [r for r in range(4) if r != VICTIM]
    result = launch(4, WORKER, *worker_args(tmp_path, how), timeout=400, log_dir=tmp_path / "logs",
                    kill_on_failure=False, wait_for=set(survivors))
    assert not result.timed_out, result.report()
    failed_at = float((tmp_path / "failed_at").read_text())
    check_survivors_were_slow_step_safe(result.outputs)
    for r in survivors:
        assert result.returncodes[r] != 0, result.report()
        assert result.ended_at[r] - failed_at < LIMIT_S, f"rank {r} took {result.ended_at[r] - failed_at:.0f} s"
        # the watchdog's message, or (SIGKILL) a neighbour's closed-connection error relayed by it
        assert f"global rank {VICTIM}" in result.outputs[r] and f"stage {VICTIM}" in result.outputs[r], \
            result.outputs[r][-3000:]
    if how == "stop":
        for r in survivors:
            assert "[gpp_deepspeed watchdog t=" in result.outputs[r], result.outputs[r][-3000:]


def run_group(cmds, log_dir, timeout=400):
    """Start each command in its own session; return their outputs once every launch ended or every
    survivor printed the watchdog's message (DeepSpeed's launcher would then wait 30 s more on the
    frozen child); kill what is left."""
    procs, logs = [], []
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    for k, cmd in enumerate(cmds):
        log = open(log_dir / f"launch{k}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    ended = [None] * len(procs)
    start = time.monotonic()
    try:
        while any(e is None for e in ended) and time.monotonic() - start < timeout:
            for k, p in enumerate(procs):
                if ended[k] is None and p.poll() is not None:
                    ended[k] = time.time()
            if sum(open(log.name).read().count("[gpp_deepspeed watchdog t=") for log in logs) >= 3:
                time.sleep(3)   # the ranks linger two heartbeats after their message
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)   # the frozen victim and anything left
            except ProcessLookupError:
                pass
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return outputs


def check_launch(outputs, out_dir):
    """Every survivor printed the watchdog's message naming the frozen rank, within 60 s of the
    freeze (the message carries its wall time; the rank exits two heartbeats later)."""
    text = "\n".join(outputs)
    failed_at = float((out_dir / "failed_at").read_text())
    stops = {int(r): float(t) for t, r in re.findall(r"\[gpp_deepspeed watchdog t=([\d.]+)\] global rank (\d) ", text)}
    assert sorted(stops) == [r for r in range(4) if r != VICTIM], text[-4000:]
    for r, t in stops.items():
        assert t + 1.5 - failed_at < LIMIT_S, f"rank {r} stopped {t - failed_at:.0f} s after the freeze"
    assert NAMED in text, text[-4000:]


@pytest.mark.parametrize("launcher", ["deepspeed", "mpiexec"])
def test_a_frozen_rank_stops_a_launch(tmp_path, launcher):
    port = free_port()
    if launcher == "deepspeed":
        cmd = [str(BIN / "deepspeed"), "--num_gpus", "4", "--master_port", str(port), str(WORKER)]
    else:
        cmd = [str(BIN / "mpiexec"), "-n", "4", sys.executable, str(WORKER)]
    mpich_before = set(SHM.glob("mpich_shm_*"))
    outputs = run_group([cmd + worker_args(tmp_path, "stop", slow=False)], tmp_path)
    remove_shm(port)
    # Ranks the watchdog ends never reach MPI_Finalize, so MPICH cannot unlink the node-local
    # segment it created for this launch (a known limit, see the README); remove what this run left.
    for path in set(SHM.glob("mpich_shm_*")) - mpich_before:
        path.unlink(missing_ok=True)
    check_launch(outputs, tmp_path)


def test_a_frozen_rank_on_one_node_stops_the_other_node(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    port = free_port()
    cmds = [[str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--num_nodes", "2", "--node_rank",
             str(k), "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", str(port), str(WORKER),
             *worker_args(tmp_path, "stop", slow=False)] for k in range(2)]
    outputs = run_group(cmds, tmp_path)
    remove_shm(port)
    check_launch(outputs, tmp_path)
    assert NAMED in outputs[0], "node 0, which does not host the frozen rank, names it"
