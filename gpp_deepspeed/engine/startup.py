"""A start-up that cannot hang: DeepSpeed's CPU ops built once, build locks waited on with a deadline.

DeepSpeed builds its CPU ops (the shm all-reduce ``deepspeed_shm_comm`` on every
``init_distributed``, ``fused_adam`` for its ``"Adam"`` optimizer) the first time a process loads
them, with ``torch.utils.cpp_extension.load``, under a lock file
``<TORCH_EXTENSIONS_DIR>/<op>/lock`` (default ``~/.cache/torch_extensions/py<ver>_<cpu|cuXXX>/``).
Every start takes that lock, even when the op is built (ninja then finds nothing to do), and a
process killed while holding it (a build killed with SIGKILL, a launcher's timeout) leaves it
behind: every later start then waits in ``FileBaton.wait`` for ever, before any watchdog exists.

* :func:`build_cpu_ops` builds the ops once (``make setup`` runs it), so starts only check them;
* :func:`guard_build_locks` (installed when :mod:`gpp_deepspeed.engine` is imported, before a
  script calls ``deepspeed.init_distributed``) makes a wait on a build lock longer than
  ``GPP_BUILD_LOCK_TIMEOUT_S`` seconds (default 600) fail with :class:`BuildLockTimeout`, naming the
  lock file, whether a process on this machine holds it, and how to clear it.

``make setup`` calls :func:`main`, which builds the ops and prints where they are.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..errors import GPPError

__all__ = ["BuildLockTimeout", "CPU_OPS", "BUILD_LOCK_TIMEOUT_ENV", "build_lock_timeout_s", "guard_build_locks",
           "build_cpu_ops", "lock_holders", "main"]

# The DeepSpeed op builders a CPU run of this project loads: the shm all-reduce (every start) and
# FusedAdam (DeepSpeed's "Adam" optimizer type on CPU, used by configs/).
CPU_OPS = ("ShareMemCommBuilder", "FusedAdamBuilder")
BUILD_LOCK_TIMEOUT_ENV = "GPP_BUILD_LOCK_TIMEOUT_S"
_DEFAULT_TIMEOUT_S = 600.0


class BuildLockTimeout(GPPError, TimeoutError):
    """A start waited longer than the deadline for a DeepSpeed/torch extension build lock."""


def build_lock_timeout_s() -> float:
    """Seconds a start may wait for a build lock (``GPP_BUILD_LOCK_TIMEOUT_S``, default 600)."""
    value = os.environ.get(BUILD_LOCK_TIMEOUT_ENV, "")
    try:
        return float(value) if value else _DEFAULT_TIMEOUT_S
    except ValueError:
        raise BuildLockTimeout(f"{BUILD_LOCK_TIMEOUT_ENV}={value!r} is not a number of seconds") from None


def lock_holders(path: str | os.PathLike) -> list[int]:
    """Process ids on this machine (those this user may inspect) with ``path`` open: a build in
    progress keeps its lock file open until it releases it."""
    target = os.path.realpath(path)
    holders = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if any(os.path.realpath(fd) == target for fd in (proc / "fd").iterdir()):
                holders.append(int(proc.name))
        except OSError:   # gone, or not ours to read
            continue
    return sorted(holders)


def _timeout_message(path: str, waited: float) -> str:
    holders = lock_holders(path)
    op = Path(path).parent.name
    if holders:
        who = (f"process(es) {holders} on this machine hold it open: a build of {op} is running; let it finish, or "
               f"stop it and remove the lock")
    else:
        who = ("no process on this machine holds it open, so it is most likely stale (left by a process killed while "
               "it built or checked the op; a build on another machine sharing this folder would not show here)")
    return (f"waited {waited:.0f} s for the build lock {path} of DeepSpeed's op {op}: {who}. If no process is "
            f"building it, remove the lock (rm {path}) and start again; `make setup` builds DeepSpeed's CPU ops once, "
            f"before any run. Set {BUILD_LOCK_TIMEOUT_ENV} to wait longer (now {build_lock_timeout_s():g} s).")


def _bounded_wait(baton) -> None:
    """``FileBaton.wait`` with a deadline: it polls for the lock file to go, as torch's does."""
    limit = build_lock_timeout_s()
    start = time.monotonic()
    while os.path.exists(baton.lock_file_path):
        waited = time.monotonic() - start
        if waited > limit:
            raise BuildLockTimeout(_timeout_message(baton.lock_file_path, waited))
        time.sleep(baton.wait_seconds)


def guard_build_locks() -> None:
    """Make every wait on a torch extension build lock in this process end by the deadline
    (idempotent). torch's ``cpp_extension`` waits through ``torch.utils.file_baton.FileBaton``."""
    from torch.utils import file_baton

    if getattr(file_baton.FileBaton.wait, "_gpp_bounded", False):
        return
    _bounded_wait._gpp_bounded = True
    file_baton.FileBaton.wait = _bounded_wait


def build_cpu_ops(names: tuple[str, ...] = CPU_OPS) -> dict[str, str]:
    """Build (or check) DeepSpeed's CPU ops ``names`` now, under the lock deadline; returns where
    each one's files are. Ops the accelerator does not have, or cannot build, are skipped."""
    guard_build_locks()
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    built = {}
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or type(builder).__name__ == "NotImplementedBuilder" or not builder.is_compatible(False):
            continue
        builder.load(verbose=False)
        built[builder.name] = _get_build_directory(builder.name, verbose=False)
    return built


def main() -> None:
    for op, folder in build_cpu_ops().items():
        print(f"DeepSpeed op {op}: built in {folder}")
