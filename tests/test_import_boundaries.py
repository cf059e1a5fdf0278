"""The pure layers (graph IR, partitioners, schedules) load without torch, torch.distributed or deepspeed.

Each check runs in a fresh interpreter so that modules imported by other tests do not leak in.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[1]

HEAVY = ("torch", "torch.distributed", "deepspeed")

_REPORT = textwrap.dedent("""
    import json, sys
    print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
""")


def loaded_heavy_modules(import_code: str) -> list[str]:
    code = textwrap.dedent(import_code) + _REPORT.format(heavy=HEAVY)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"the import subprocess failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_graph_and_schedule_modules_themselves_import_no_torch_nor_deepspeed():
    # Stand in for the top-level package so that only gpp_deepspeed.graph, gpp_deepspeed.schedule and
    # what they import (errors, networkx) are executed, not gpp_deepspeed/__init__.py.
    loaded = loaded_heavy_modules("""
        import importlib.util, sys, types
        spec = importlib.util.find_spec("gpp_deepspeed")
        stub = types.ModuleType("gpp_deepspeed")
        stub.__path__ = list(spec.submodule_search_locations)
        sys.modules["gpp_deepspeed"] = stub
        import gpp_deepspeed.graph, gpp_deepspeed.schedule, gpp_deepspeed.config, gpp_deepspeed.errors
        assert gpp_deepspeed.schedule.build_schedule
    """)
    assert loaded == []


def test_importing_gpp_deepspeed_graph_and_schedule_imports_no_torch_nor_deepspeed():
    loaded = loaded_heavy_modules("""
        import gpp_deepspeed.graph
        import gpp_deepspeed.schedule
    """)
    assert loaded == []


def test_the_planner_imports_no_torch_nor_deepspeed():
    loaded = loaded_heavy_modules("""
        import gpp_deepspeed.planner.search, gpp_deepspeed.planner.simulate, gpp_deepspeed.planner.sp
    """)
    assert loaded == []
