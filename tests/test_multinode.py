"""A real two-node run on one machine: two separate ``deepspeed --no_ssh --node_rank K`` launches
(2 ranks each) meet over TCP and train the 4-stage demo as one world of 4 ranks.

Each node launch is its own process group (``start_new_session``); if one node fails, or the time
runs out, both groups are killed, so the test fails fast instead of hanging. The second test puts
each node in its own network namespace joined by a veth pair (needs root and ``ip netns``), so the
two nodes really are on different hosts as far as the network is concerned.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dist import free_port, remove_shm

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DEMO = ["examples/multimodal_demo.py", "--deepspeed_config", "configs/example.json"]
EQUAL = "pipelined losses EQUAL the single-device run"
TIMEOUT = 240


def node_cmd(node_rank, hostfile, master_addr, port):
    # --hostfile names the two nodes (labels only: with --no_ssh nothing connects to them);
    # without it the runner knows only 'localhost' and refuses --num_nodes 2.
    return [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--num_nodes", "2",
            "--node_rank", str(node_rank), "--num_gpus", "2", "--master_addr", master_addr,
            "--master_port", str(port), *DEMO]


def run_nodes(cmds, envs, log_dir, timeout=TIMEOUT):
    """Start each node's command in its own session; kill every group on a failure or at timeout."""
    procs, logs = [], []
    start = time.monotonic()
    for k, (cmd, env) in enumerate(zip(cmds, envs)):
        log = open(log_dir / f"node{k}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    timed_out = False
    try:
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, 0) for p in procs)
            timed_out = time.monotonic() - start > timeout
            if failed or timed_out:
                break
            time.sleep(0.2)
    finally:
        # each launcher, its ranks and anything they started share one process group: kill every
        # group (also after a clean exit, in case a rank was left behind), then reap the launchers
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    seconds = time.monotonic() - start
    report = f"timed_out={timed_out} after {seconds:.1f}s\n" + "\n".join(
        f"--- node {k} (rc {p.returncode}) ---\n{out[-4000:]}" for k, (p, out) in enumerate(zip(procs, outputs)))
    return [p.returncode for p in procs], outputs, timed_out, report


def base_env():
    return dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def check(rcs, outputs, timed_out, report):
    assert not timed_out, report
    assert rcs == [0, 0], report
    # rank 0 (on node 0) runs the single-device reference and prints the verdict
    assert EQUAL in outputs[0], report
    for k, out in enumerate(outputs):
        assert "'node0': [0, 1], 'node1': [2, 3]" in out, report  # global_rank_mapping: 2 x 2 = world 4
        assert f"--node_rank={k}" in out, report
    assert "stage graph: 4 stages, depth 2" in outputs[0], report


def test_two_no_ssh_nodes_on_loopback_train_to_the_single_device_losses(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    port = free_port()
    cmds = [node_cmd(k, hostfile, "127.0.0.1", port) for k in range(2)]
    result = run_nodes(cmds, [base_env(), base_env()], tmp_path)
    left = remove_shm(port)
    check(*result)
    assert left == [], f"the run left {left} in /dev/shm"


def _have_netns():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"gppchk{uuid.uuid4().hex[:6]}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


@pytest.mark.skipif(not _have_netns(), reason="needs root and `ip netns` to give each node its own network")
def test_two_nodes_in_separate_network_namespaces_train_to_the_single_device_losses(tmp_path):
    tag = uuid.uuid4().hex[:6]
    ns = [f"gpp{tag}n0", f"gpp{tag}n1"]
    veth = [f"gv{tag}a", f"gv{tag}b"]
    addr = ["10.213.7.1", "10.213.7.2"]

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    try:
        for n in ns:
            ip("netns", "add", n)
        ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for k in range(2):
            ip("link", "set", veth[k], "netns", ns[k])
            ip("-n", ns[k], "addr", "add", f"{addr[k]}/24", "dev", veth[k])
            ip("-n", ns[k], "link", "set", veth[k], "up")
            ip("-n", ns[k], "link", "set", "lo", "up")
        port = free_port()
        cmds = [["ip", "netns", "exec", ns[k], *node_cmd(k, hostfile, addr[0], port)] for k in range(2)]
        # gloo binds to the address of the interface named here (the host name does not resolve
        # to an address inside the namespace)
        envs = [dict(base_env(), GLOO_SOCKET_IFNAME=veth[k]) for k in range(2)]
        check(*run_nodes(cmds, envs, tmp_path))
    finally:
        for n in ns:  # deleting a namespace deletes its end of the veth pair, and with it the peer
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def test_mpich_launcher_over_a_two_host_hostfile_trains_to_the_single_device_losses(tmp_path):
    # deepspeed --launcher mpich turns the hostfile into one `mpirun -hosts localhost,127.0.0.1 -ppn 2`
    # (MPICH's hydra); both names are this machine, so hydra starts both hosts' ranks locally and
    # DeepSpeed's MPI discovery (mpi4py) wires the world of 4. Its exit status can be 0 even when
    # ranks fail, so the verdict line is what counts.
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    cmd = [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--launcher", "mpich", "--no_ssh_check",
           "--master_addr", "127.0.0.1", *DEMO]
    rcs, outputs, timed_out, report = run_nodes([cmd], [base_env()], tmp_path)
    assert not timed_out and rcs == [0], report
    assert "-hosts localhost,127.0.0.1" in outputs[0], report
    assert EQUAL in outputs[0], report
