"""A start that cannot hang, leaves the user's random generators alone, and talks to its own job only.

Each test starts real processes (``tests/workers/startup_worker.py``): a DeepSpeed start facing a
build lock that a killed process left behind (in a temporary ``TORCH_EXTENSIONS_DIR``: the real
cache is never touched), building a module and an engine after seeding torch, and a ``file://``
process group while another job's store listens at ``MASTER_ADDR:MASTER_PORT``.
"""

import json
import os
from datetime import timedelta

import pytest
import torch

from dist import free_port, launch

pytestmark = pytest.mark.dist

WORKER = os.path.join(os.path.dirname(__file__), "workers", "startup_worker.py")


def test_a_start_waiting_on_a_stale_build_lock_fails_naming_the_lock_and_the_fix(tmp_path):
    extensions = tmp_path / "torch_extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()   # what a start killed while building the shm op leaves
    result = launch(1, WORKER, "lock", str(tmp_path), timeout=240, log_dir=tmp_path / "logs",
                    env={"TORCH_EXTENSIONS_DIR": str(extensions), "GPP_BUILD_LOCK_TIMEOUT_S": "3"})
    assert result.ok, result.report()
    got = json.loads((tmp_path / "lock.json").read_text())
    assert got["error"] is not None and got["error"].startswith("BuildLockTimeout"), got
    assert str(lock) in got["error"] and f"rm {lock}" in got["error"], got["error"]
    assert "most likely stale" in got["error"], got["error"]
    assert got["seconds"] < 3 + 30, "the start gave up at the deadline, not later"
    assert lock.exists(), "the lock is the user's to remove"


def test_building_a_module_and_an_engine_leaves_the_users_random_generators_as_it_found_them(tmp_path):
    result = launch(2, WORKER, "rng", str(tmp_path), timeout=300, log_dir=tmp_path / "logs")
    assert result.ok, result.report()
    for rank in range(2):
        got = torch.load(tmp_path / f"rng.rank{rank}.pt")
        for seed_layers in (False, True):
            # the draws after building are the draws the user's seed gives without building
            assert torch.equal(got[f"after_module_seed_layers_{seed_layers}"], got["seed_7"]), (rank, seed_layers)
            assert torch.equal(got[f"after_initialize_seed_layers_{seed_layers}"], got["seed_8"]), (rank, seed_layers)


def test_the_watchdog_of_a_file_process_group_uses_its_file_store_not_master_addr(tmp_path):
    # Another job's store listens where MASTER_ADDR:MASTER_PORT point; the old watchdog fell back
    # to that address under file:// initialisation and would have beaten into it.
    port = free_port()
    other_job = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                           timeout=timedelta(seconds=30))
    keys_before = other_job.num_keys()
    result = launch(2, WORKER, "file_store", str(tmp_path), timeout=300, log_dir=tmp_path / "logs",
                    env={"MASTER_PORT": str(port)})
    assert result.ok, result.report()
    assert other_job.num_keys() == keys_before, "nothing was written into another job's store"
    seen = [json.loads((tmp_path / f"file_store.rank{r}.json").read_text()) for r in range(2)]
    for got in seen:
        assert got["where"].startswith("the file store "), got
        assert set(got["beats"]) == {"0", "1"} and all(int(b) > 0 for b in got["beats"].values()), got
    assert seen[0]["job"] == seen[1]["job"], "one namespace per job, the same on every rank"
    for out in result.outputs:
        assert "socket has timed out" not in out and "TCPStore" not in out, out[-3000:]
