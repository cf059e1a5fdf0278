import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

# One ninja for every build of DeepSpeed's CPU ops. torch runs the first ``ninja`` on PATH; the
# launcher tests (deepspeed, torchrun, mpiexec) put this interpreter's bin first, where pip put the
# ninja DeepSpeed depends on (1.13 here), while ranks started by tests/dist.py used the system's
# (1.11 here). The two hash a command differently in ``.ninja_log``, so each took the other's build
# for a changed command and rebuilt the shm all-reduce op (30-60 s, every rank of the launch waiting)
# at every switch between the two kinds of test: several minutes of a suite run.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])

from dist import launch  # noqa: E402

WORKERS = Path(__file__).resolve().parent / "workers"


@pytest.fixture(scope="session")
def run_cases(tmp_path_factory):
    """``run_cases(name, world_size, cases, timeout, env)``: train the cases on real gloo ranks once
    per session and return the output folder (``<id>.rank<r>.pt`` per case and rank). ``env`` adds
    to the ranks' environment (``GPP_STRICT_P2P=1``: the strict transport, tests/strict_p2p.py)."""
    done = {}

    def run(name, world_size, cases, timeout=600, env=None):
        if name not in done:
            out = tmp_path_factory.mktemp(name)
            (out / "cases.json").write_text(json.dumps(cases))
            result = launch(world_size, WORKERS / "train_cases.py", str(out / "cases.json"), str(out),
                            timeout=timeout, log_dir=out / "logs", env=env)
            done[name] = (out, result)
        out, result = done[name]
        assert result.ok, result.report()
        return out

    return run


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory):
    """The tiny Llama's multi-rank runs (``tests/workers/pretrained_cases.py``) for
    tests/test_large_models.py and tests/test_peft.py, in one launch of ``STAGES`` ranks per session:
    ``{mode: output folder}`` for ``init``, ``roundtrip``, ``bad`` and (with ``peft`` installed)
    ``peft``, plus ``"sharded"`` and ``"plain"``, the saved directories the runs read, and
    ``"logs"``. Every rank pays one start of torch, DeepSpeed and transformers for all of them."""
    import importlib.util

    from llama_tiny import STAGES, save_llama

    root = tmp_path_factory.mktemp("pretrained")
    paths = {"sharded": root / "sharded", "plain": root / "plain", "logs": root / "logs"}
    save_llama(paths["sharded"], shard="20KB")
    save_llama(paths["plain"])
    # init and bad build no engine, so roundtrip's stage graph and memory report are the first in rank 0's log
    jobs = {"init": [], "roundtrip": [paths["sharded"]], "bad": []}
    if importlib.util.find_spec("peft") is not None:
        jobs["peft"] = [paths["plain"]]
    args = []
    for mode, inputs in jobs.items():
        paths[mode] = root / mode
        paths[mode].mkdir()
        args += ["+", mode, *map(str, inputs), str(paths[mode])]
    result = launch(STAGES, WORKERS / "pretrained_cases.py", *args[1:], timeout=900, log_dir=paths["logs"])
    assert result.ok, result.report()
    return paths
