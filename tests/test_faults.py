"""A rank that dies or freezes mid-training stops every other rank soon, with its name.

``tests/workers/fault_worker.py`` trains a 4-stage pipeline; at step 4 the victim sends itself
SIGKILL or SIGSTOP: the middle rank 2, or global rank 0, which serves the rendezvous store every
heartbeat goes through (a frozen rank 0 freezes the store: the blind spot of issue 18). The
watchdog (:mod:`gpp_deepspeed.engine.watchdog`, timeout 15 s here) must make every other rank exit
within ``LIMIT_S`` of that moment (the timeout plus the start of a loaded machine's slack), printing
an error that names the victim and its stage, under the tests' own launcher, the ``deepspeed``
launcher, ``mpiexec`` and two ``deepspeed --no_ssh`` node launches. In the tests' own launches with
victim 2, rank 0's data loader spends 30 s (two timeouts) busy at step 1 earlier: slow but alive, it
must not be taken for dead. A rank frozen in the middle of ``save_checkpoint`` leaves ``latest``
naming the last complete checkpoint, which loads.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dist import free_port, launch, remove_shm

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SHM = Path("/dev/shm")
WORKER = Path(__file__).resolve().parent / "workers" / "fault_worker.py"
WATCHDOG_TIMEOUT_S = 15   # as in workers/fault_worker.py
LIMIT_S = WATCHDOG_TIMEOUT_S + 25   # the timeout, two heartbeats of lingering, a loaded machine's slack


def named(victim):
    return f"global rank {victim} (stage {victim} of pipeline replica 0)"


def worker_args(out, how, *, victim, slow=True):
    args = [str(out), "--victim", str(victim), "--how", how, "--at-step", "4"]
    return args + (["--slow-rank", "0", "--slow-step", "1"] if slow else [])


def check_survivors_were_slow_step_safe(outputs, survivors):
    # every rank trained past the slow step 1 and up to the failure: nobody was taken for dead early
    for r in survivors:
        assert f"rank {r} step 3" in outputs[r], f"rank {r} did not reach step 3:\n{outputs[r][-3000:]}"


# Victim 2 with rank 0 slow earlier (slow but alive is not dead); victim 0 serves the store.
@pytest.mark.parametrize("victim,how", [(2, "kill"), (2, "stop"), (0, "kill"), (0, "stop")])
def test_every_rank_exits_soon_naming_the_dead_or_frozen_rank(tmp_path, victim, how):
    survivors = [r for r in range(4) if r != victim]
    result = launch(4, WORKER, *worker_args(tmp_path, how, victim=victim, slow=victim != 0), timeout=400,
                    log_dir=tmp_path / "logs", kill_on_failure=False, wait_for=set(survivors))
    assert not result.timed_out, result.report()
    failed_at = float((tmp_path / "failed_at").read_text())
    check_survivors_were_slow_step_safe(result.outputs, survivors)
    for r in survivors:
        assert result.returncodes[r] != 0, result.report()
        print(f"fault exit ({how} global rank {victim}, test launcher): rank {r} out {result.ended_at[r] - failed_at:.1f} s after")
        assert result.ended_at[r] - failed_at < LIMIT_S, f"rank {r} took {result.ended_at[r] - failed_at:.0f} s"
        # the watchdog's message, or (SIGKILL) a neighbour's closed-connection error relayed by it
        assert f"global rank {victim}" in result.outputs[r] and f"stage {victim}" in result.outputs[r], \
            result.outputs[r][-3000:]
    if how == "stop":
        for r in survivors:
            assert "[gpp_deepspeed watchdog t=" in result.outputs[r], result.outputs[r][-3000:]


def test_a_rank_frozen_mid_save_leaves_latest_at_the_last_complete_checkpoint(tmp_path):
    from gpp_deepspeed import GraphModel
    from workers.fault_worker import layer_list

    victim, survivors = 2, [0, 1, 3]
    args = [str(tmp_path), "--victim", str(victim), "--how", "stop", "--at-step", "3", "--save-at-step", "1"]
    result = launch(4, WORKER, *args, timeout=400, log_dir=tmp_path / "logs", kill_on_failure=False,
                    wait_for=set(survivors))
    assert not result.timed_out, result.report()
    for r in survivors:
        assert result.returncodes[r] != 0 and named(victim) in result.outputs[r], result.outputs[r][-3000:]
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == "step1", "latest still names the last complete checkpoint"
    assert not (ckpt / "step3").exists() and (ckpt / "step3.partial").is_dir(), sorted(os.listdir(ckpt))
    model = GraphModel(layer_list(), input_names=["x"])
    counters = model.load_pipeline_checkpoint(str(ckpt))
    assert counters["global_steps"] == 2
    saved = {}
    for r in range(4):
        saved.update(torch.load(tmp_path / f"state.rank{r}.pt"))
    loaded = model.state_dict()
    assert set(saved) == set(loaded)
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)


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


def check_launch(outputs, out_dir, victim):
    """Every survivor printed the watchdog's message naming the frozen rank, within ``LIMIT_S`` of
    the freeze (the message carries its wall time; the rank exits two heartbeats later)."""
    text = "\n".join(outputs)
    failed_at = float((out_dir / "failed_at").read_text())
    stops = {int(r): float(t) for t, r in re.findall(r"\[gpp_deepspeed watchdog t=([\d.]+)\] global rank (\d) ", text)}
    assert sorted(stops) == [r for r in range(4) if r != victim], text[-4000:]
    for r, t in stops.items():
        print(f"fault exit (stop global rank {victim}): rank {r} stopped by its watchdog {t - failed_at:.1f} s after")
        assert t + 1.5 - failed_at < LIMIT_S, f"rank {r} stopped {t - failed_at:.0f} s after the freeze"
    assert named(victim) in text, text[-4000:]


@pytest.mark.parametrize("victim", [2, 0])
@pytest.mark.parametrize("launcher", ["deepspeed", "mpiexec"])
def test_a_frozen_rank_stops_a_launch(tmp_path, launcher, victim):
    port = free_port()
    if launcher == "deepspeed":
        cmd = [str(BIN / "deepspeed"), "--num_gpus", "4", "--master_port", str(port), str(WORKER)]
    else:
        cmd = [str(BIN / "mpiexec"), "-n", "4", sys.executable, str(WORKER)]
    mpich_before = set(SHM.glob("mpich_shm_*"))
    outputs = run_group([cmd + worker_args(tmp_path, "stop", victim=victim, slow=False)], tmp_path)
    remove_shm(port)
    # Ranks the watchdog ends never reach MPI_Finalize, so MPICH cannot unlink the node-local
    # segment it created for this launch (a known limit, see the README); remove what this run left.
    for path in set(SHM.glob("mpich_shm_*")) - mpich_before:
        path.unlink(missing_ok=True)
    check_launch(outputs, tmp_path, victim)


@pytest.mark.parametrize("victim", [2, 0])
def test_a_frozen_rank_on_one_node_stops_the_other_node(tmp_path, victim):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    port = free_port()
    cmds = [[str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--num_nodes", "2", "--node_rank",
             str(k), "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", str(port), str(WORKER),
             *worker_args(tmp_path, "stop", victim=victim, slow=False)] for k in range(2)]
    outputs = run_group(cmds, tmp_path)
    remove_shm(port)
    check_launch(outputs, tmp_path, victim)
    other = 1 - victim // 2   # the node that does not host the frozen rank names it
    assert named(victim) in outputs[other], outputs[other][-4000:]
