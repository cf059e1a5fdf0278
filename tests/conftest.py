import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

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
