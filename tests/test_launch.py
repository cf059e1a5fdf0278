"""The launch commands of README.md and launch/README.md, run for real on 4 local CPU ranks (with timeouts)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist import free_port, remove_shm

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DEMO = ["examples/multimodal_demo.py", "--deepspeed_config", "configs/example.json"]


def run(cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("launcher", [
    [str(BIN / "deepspeed"), "--num_gpus", "4", "--master_port"],  # a free port, not 29500: may be taken
    [str(BIN / "mpiexec"), "-n", "4", sys.executable],
], ids=["deepspeed", "mpiexec"])
def test_demo_trains_to_the_single_device_losses_under_the_launcher(launcher):
    port = free_port()
    if launcher[-1] == "--master_port":
        launcher = launcher + [str(port)]
    # (DeepSpeed's MPI discovery sets no LOCAL_SIZE, so its shm op creates no files under mpiexec.)
    rc, out = run(launcher + DEMO)
    left = remove_shm(port)   # DeepSpeed's shm all-reduce files of this launch, if any survived
    assert rc == 0, out[-4000:]
    assert left == [], f"the run left {left} in /dev/shm"
    assert "pipelined losses EQUAL the single-device run" in out
    assert "stage graph: 4 stages, depth 2" in out
