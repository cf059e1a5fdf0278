"""Remove the shared-memory file DeepSpeed's CPU communication op leaves in ``/dev/shm``.

What creates it: ``deepspeed.comm.init_distributed`` builds a ``TorchBackend``
(``deepspeed/comm/torch.py``), whose constructor loads the CPU op ``deepspeed_shm_comm`` and calls
its ``initialize(world_size, rank)``. In ``ops/csrc/cpu/comm/shm_interface.cpp`` that calls
``shm_initialize`` when every rank is local (``LOCAL_SIZE`` equals the world size), and
``shm.cpp`` then creates, per rank, a 66 MiB POSIX shared-memory object named::

    deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>

(``shm_open``, so ``/dev/shm/<name>`` on Linux), and maps every other rank's object, spinning
until it exists. DeepSpeed never unlinks them (``shared_close`` is never called), so every run
leaves ``world_size`` such files in RAM-backed ``/dev/shm``.

What this module does: once every rank has passed ``shm_initialize`` (a barrier over the world,
after which every peer has mapped this rank's object), each rank unlinks *its own* object. The
mappings stay valid until the processes exit, so DeepSpeed's shm all-reduce keeps working, and the
memory is returned when the last process exits, even one killed with SIGKILL. An ``atexit`` hook
does the same for a process that exits before reaching that point (unlinking by exact name: never
another rank's, another port's or another user's file).
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

import torch

__all__ = ["SHM_DIR", "SHM_PREFIX", "shm_name", "own_shm_path", "release_own_shm"]

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer"   # SHM_BUFFER_NAME in deepspeed/ops/csrc/cpu/comm/shm.cpp


def shm_name(*, uid: int, master_addr: str, master_port: str | int, rank: int) -> str:
    """The name ``shm.cpp`` gives rank ``rank``'s all-reduce workspace.

    >>> shm_name(uid=0, master_addr="127.0.0.1", master_port=29500, rank=3)
    'deepspeed_allreduce_buffer_0_127.0.0.1_29500_3'
    """
    return f"{SHM_PREFIX}_{uid}_{master_addr}_{master_port}_{rank}"


def own_shm_path() -> Path | None:
    """This process's workspace file, if DeepSpeed's shm op was initialised in it, else None."""
    from deepspeed.comm import comm as ds_comm   # cdb is a module global there, set by init_distributed

    backend = getattr(ds_comm, "cdb", None)
    if backend is None or getattr(backend, "shm_comm_op", None) is None:
        return None
    if torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    elif os.environ.get("RANK", "").isdigit():   # after destroy_process_group: the launcher's rank
        rank = int(os.environ["RANK"])
    else:
        return None
    # shm_interface.cpp reads these from the environment at initialize(); so do we.
    return SHM_DIR / shm_name(uid=os.getuid(), master_addr=os.environ.get("MASTER_ADDR", ""),
                              master_port=os.environ.get("MASTER_PORT", ""), rank=rank)


_released: set[Path] = set()


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    _released.add(path)


def release_own_shm(*, synchronize: bool = True) -> Path | None:
    """Unlink this rank's workspace file; returns its path (None when there was none).

    With ``synchronize`` (the default) it first waits on a barrier over the world, so every peer
    has mapped the file (they open it by name at ``init_distributed``). Call it on every rank.
    """
    path = own_shm_path()
    if path is None or path in _released:
        return path
    if synchronize:
        torch.distributed.barrier()
    _unlink(path)
    return path


def _release_at_exit() -> None:
    try:
        path = own_shm_path()
    except Exception:  # interpreter shutdown: the modules may be half torn down
        return
    if path is not None and path not in _released:
        _unlink(path)


atexit.register(_release_at_exit)
