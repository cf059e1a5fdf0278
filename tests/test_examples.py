"""Each example in ``examples/`` trains at its tiny size under the real ``deepspeed`` launcher and
matches its single-device twin.

Two ranks (``--num_gpus 2``, gloo on CPU) and 3 steps keep each run to about 15-30 s on a 2-core
machine; the examples' default of 4 ranks is exercised by ``tests/test_launch.py`` for the demo.
Each run is bounded by a timeout: on expiry the launcher's whole process group is killed, so a
hung rank fails the test instead of hanging it.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dist import free_port, remove_shm

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TIMEOUT_S = 150
EXAMPLES = [  # (examples/<name>.py with configs/<name>.json, extra arguments)
    ("mmt", []),
    ("dlrm", []),
    ("candle_uno", ["--branches", "4"]),
    ("gpt_dropin", []),
    ("clip", []),  # transformers' CLIPModel, captured
]
SLOW = {"clip": 300}  # importing transformers on every rank: about 150 s at the shared machine's worst load


def run(cmd: list[str], timeout: float = TIMEOUT_S) -> tuple[int, str]:
    """Run ``cmd`` in its own process group; kill the whole group at ``timeout`` seconds."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s; output:\n{out[-4000:]}")
    return proc.returncode, out


@pytest.mark.parametrize("name,extra", EXAMPLES, ids=[name for name, _ in EXAMPLES])
def test_example_matches_single_device_under_deepspeed_launcher(name, extra):
    port = free_port()
    rc, out = run([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), f"examples/{name}.py",
                   "--deepspeed_config", f"configs/{name}.json", "--steps", "3", *extra], timeout=SLOW.get(name, TIMEOUT_S))
    left = remove_shm(port)
    assert rc == 0, out[-4000:]
    assert left == [], f"the example left {left} in /dev/shm"
    assert "pipelined losses EQUAL the single-device run" in out, out[-4000:]
    assert "stage graph: 2 stages" in out, out[-4000:]
    assert "graph pipeline idle per stage" in out, out[-4000:]


def test_captured_module_example_matches_the_original_module_under_deepspeed_launcher():
    port = free_port()
    rc, out = run([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), "examples/captured_model.py",
                   "--deepspeed_config", "configs/example.json"])
    left = remove_shm(port)
    assert rc == 0, out[-4000:]
    assert left == [], f"the example left {left} in /dev/shm"
    assert "pipelined losses EQUAL the original module's" in out, out[-4000:]
    assert "stage graph: 2 stages" in out, out[-4000:]
