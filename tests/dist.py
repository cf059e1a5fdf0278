"""Start real torch.distributed processes for a test, bounded by a timeout.

Each rank is a ``python`` process with the environment a launcher gives (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). If any rank fails, or the time runs out, every
rank is killed, so a test fails fast instead of hanging.

DeepSpeed's CPU communication op creates one shared-memory file per rank, named by the master
address and port (:mod:`gpp_deepspeed.engine.shm`). The ranks remove their own; after a launch,
whatever is left under this launch's port (a rank killed before it could) is reported in
``Result.leftover_shm`` and removed, so a test leaves ``/dev/shm`` as it found it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    returncodes: list[int | None]
    outputs: list[str]
    seconds: float
    timed_out: bool
    leftover_shm: list[str] = field(default_factory=list)
    ended_at: list[float | None] = field(default_factory=list)   # wall time each rank exited (None: killed)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    def report(self) -> str:
        tails = "\n".join(f"--- rank {r} (rc {rc}) ---\n{out[-4000:]}"
                          for r, (rc, out) in enumerate(zip(self.returncodes, self.outputs)))
        return f"timed_out={self.timed_out} after {self.seconds:.1f}s\n{tails}"


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when the test process dies, so ranks never outlive a test that
    pytest-timeout (or a Ctrl-C) ended before :func:`launch` could kill them itself."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_files(port: int, master_addr: str = "127.0.0.1") -> list[Path]:
    """DeepSpeed's shm all-reduce files of this user's launch on ``master_addr:port``, if any."""
    from gpp_deepspeed.engine.shm import SHM_DIR, shm_name

    prefix = shm_name(uid=os.getuid(), master_addr=master_addr, master_port=port, rank=0)[:-1]
    return sorted(p for p in SHM_DIR.glob(prefix + "*") if p.name[len(prefix):].isdigit())


def remove_shm(port: int, master_addr: str = "127.0.0.1") -> list[str]:
    """Remove what a finished launch on ``master_addr:port`` left in /dev/shm; returns the names."""
    left = shm_files(port, master_addr)
    for path in left:
        path.unlink(missing_ok=True)
    return [p.name for p in left]


def runs(argv: list[str]) -> list[list[str]]:
    """A worker's command line of several runs joined by ``+``, run one after the other by the same
    ranks (a launch pays each rank's start of torch and DeepSpeed once for all of them):
    ``["init", "A", "+", "roundtrip", "B", "C"]`` -> ``[["init", "A"], ["roundtrip", "B", "C"]]``."""
    out = [[]]
    for arg in argv:
        if arg == "+":
            out.append([])
        else:
            out[-1].append(arg)
    return out


def launch(world_size: int, script: str | Path, *args: str, timeout: float = 300, log_dir: Path,
           kill_on_failure: bool = True, wait_for: set[int] | None = None, env: dict[str, str] | None = None) -> Result:
    """Run ``script`` on ``world_size`` local ranks; kill all of them on a failure or at ``timeout``.

    With ``kill_on_failure=False`` a failed rank does not stop the others (fault tests watch how
    they stop by themselves), and only the ranks in ``wait_for`` (default: all) are waited for.
    ``env`` adds to (or overrides) every rank's environment."""
    port = int((env or {}).get("MASTER_PORT") or free_port())
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(world_size):
        rank_env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                        LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
        rank_env.update(env or {})
        log = open(log_dir / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=rank_env, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=str(ROOT), preexec_fn=_die_with_parent))
    timed_out = False
    waited = [procs[r] for r in sorted(wait_for if wait_for is not None else range(world_size))]
    ended_at: list[float | None] = [None] * world_size
    while any(p.poll() is None for p in waited):
        for r, p in enumerate(procs):
            if ended_at[r] is None and p.poll() is not None:
                ended_at[r] = time.time()
        failed = kill_on_failure and any(p.poll() not in (None, 0) for p in procs)
        if failed or time.monotonic() - start > timeout:
            timed_out = not failed
            time.sleep(0.5 if failed else 0)  # let a failing rank's peers print what they saw
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.1)
    for r, p in enumerate(procs):
        if ended_at[r] is None and p.poll() is not None and p.returncode != -9:
            ended_at[r] = time.time()
        if p.poll() is None:
            p.kill()   # a rank not waited for (frozen on purpose)
        p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return Result([p.returncode for p in procs], outputs, time.monotonic() - start, timed_out, remove_shm(port),
                  ended_at)
