"""Runs leave /dev/shm as they found it.

DeepSpeed's CPU communication op creates a 66 MiB ``/dev/shm/deepspeed_allreduce_buffer_*`` file
per rank and never removes it; the engine unlinks each rank's own file once every peer has mapped
it (:mod:`gpp_deepspeed.engine.shm`). Other runs on this machine create such files at the same
time, so each test looks only at the files named with its own launch's port. The launcher tests
(``test_launch.py``, ``test_examples.py``, ``test_multinode.py``) assert the same of the demo and
the examples under the ``deepspeed`` launcher.
"""

import json
from pathlib import Path

import pytest

from dist import launch

pytestmark = pytest.mark.dist

WORKER = Path(__file__).resolve().parent / "workers" / "shm_worker.py"


def seen_by_ranks(out, world_size):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def test_a_finished_run_removes_the_shm_files_deepspeed_created(tmp_path):
    result = launch(2, WORKER, str(tmp_path), timeout=400, log_dir=tmp_path / "logs")
    assert result.ok, result.report()
    seen = seen_by_ranks(tmp_path, 2)
    # DeepSpeed did create them (else this test proves nothing), and initialize removed them.
    assert all(s["after_init_distributed"] for s in seen), seen
    assert not any(s["after_initialize"] for s in seen), seen
    assert result.leftover_shm == [], result.leftover_shm


def test_ranks_killed_mid_run_leave_no_shm_files(tmp_path):
    # Rank 1 dies by SIGKILL after initialize; the launcher then SIGKILLs rank 0, which waits on it.
    # No exit handler runs anywhere, and still nothing is left.
    result = launch(2, WORKER, str(tmp_path), "--die-after-initialize", "1", timeout=400, log_dir=tmp_path / "logs")
    assert result.returncodes[1] == -9, result.report()
    assert all(s["after_init_distributed"] for s in seen_by_ranks(tmp_path, 2))
    assert result.leftover_shm == [], result.leftover_shm
