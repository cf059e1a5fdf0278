"""The pure layers (graph IR, partitioners, schedules) load without torch, torch.distributed or deepspeed.

Each check runs in a fresh interpreter so that modules imported by other tests do not leak in.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


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
        # the stub stood in: the package's own __init__ (its lazy names) never ran
        assert sys.modules["gpp_deepspeed"] is stub and not hasattr(stub, "initialize"), "gpp_deepspeed/__init__ ran"
        assert "gpp_deepspeed.schedule.program" in sys.modules and "gpp_deepspeed.engine" not in sys.modules
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


# ---------------------------------------------------------------------------------------------
# engine/ never imports the planner: partitions are resolved in gpp_deepspeed.partitioning.

PACKAGE_ROOT = REPO_ROOT / "gpp_deepspeed"


def imported_modules(source: str, module: str) -> set[str]:
    """Every module an ``import`` statement of ``source`` names, anywhere in the file (function
    bodies included), relative imports resolved as if ``source`` were the module ``module``;
    ``from P import name`` counts both ``P`` and ``P.name`` (``name`` may be a submodule)."""
    package = module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def planner_imports_in(directory: Path, *, root: Path = REPO_ROOT) -> dict[str, list[str]]:
    """``{file: [planner modules it imports]}`` for the Python files under ``directory``, module
    names taken from their paths below ``root``."""
    out = {}
    for path in sorted(directory.rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        hits = sorted(m for m in imported_modules(path.read_text(), module)
                      if m == "gpp_deepspeed.planner" or m.startswith("gpp_deepspeed.planner."))
        if hits:
            out[str(path.relative_to(root))] = hits
    return out


def test_the_engine_imports_nothing_from_the_planner():
    assert sorted(PACKAGE_ROOT.joinpath("engine").glob("*.py")), "no engine module found: the scan would pass vacuously"
    assert planner_imports_in(PACKAGE_ROOT / "engine") == {}


@pytest.mark.parametrize("line", [
    "from ..planner.costs import CostDB",
    "from ..planner import Plan",
    "from .. import planner",
    "import gpp_deepspeed.planner.search",
    "from gpp_deepspeed.planner.plan import Plan as P",
    "def f():\n    from ..planner.search import graphpipe_partition\n",
])
def test_the_planner_import_scan_catches_an_injected_import(tmp_path, line):
    engine = tmp_path / "gpp_deepspeed" / "engine"
    engine.mkdir(parents=True)
    (engine / "module.py").write_text("import os\nfrom ..graph.ir import LayerGraph\n" + line + "\n")
    assert list(planner_imports_in(engine, root=tmp_path)) == ["gpp_deepspeed/engine/module.py"]


def test_the_planner_import_scan_flags_the_engine_as_it_was_before_partitions_moved_out(tmp_path):
    engine = tmp_path / "gpp_deepspeed" / "engine"
    engine.mkdir(parents=True)
    (engine / "module.py").write_text("from ..planner.costs import CostDB\nfrom ..planner.plan import Plan\n"
                                      "from ..planner.search import graphpipe_partition, proxy_costs\n")
    assert planner_imports_in(engine, root=tmp_path)["gpp_deepspeed/engine/module.py"] == [
        "gpp_deepspeed.planner.costs", "gpp_deepspeed.planner.costs.CostDB", "gpp_deepspeed.planner.plan",
        "gpp_deepspeed.planner.plan.Plan", "gpp_deepspeed.planner.search",
        "gpp_deepspeed.planner.search.graphpipe_partition", "gpp_deepspeed.planner.search.proxy_costs"]


def test_the_planner_import_scan_resolves_relative_imports_against_the_file():
    assert imported_modules("from ..planner import Plan", "gpp_deepspeed.engine.module") >= {
        "gpp_deepspeed.planner", "gpp_deepspeed.planner.Plan"}
    assert imported_modules("from .planner import x", "gpp_deepspeed.engine.module") == {
        "gpp_deepspeed.engine.planner", "gpp_deepspeed.engine.planner.x"}


def test_the_partition_options_import_no_torch_nor_deepspeed():
    loaded = loaded_heavy_modules("""
        import gpp_deepspeed.partitioning
    """)
    assert loaded == []


# ---------------------------------------------------------------------------------------------
# engine/ never branches on a schedule's name: it reads the registry's ScheduleSpec and runs a Program.

def schedule_name_branches(directory: Path) -> list[str]:
    """``file:line`` of every comparison (``==``, ``in``, ...) or dict key in the Python files under
    ``directory`` that names a registered schedule as a string literal (error messages may name
    them; code may not decide by them)."""
    from gpp_deepspeed.schedule.registry import SCHEDULES

    names = {n.lower() for n in SCHEDULES}

    def literals(node) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value.lower()]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [s for elt in node.elts for s in literals(elt)]
        return []

    hits = []
    for path in sorted(directory.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                found = [s for side in (node.left, *node.comparators) for s in literals(side)]
            elif isinstance(node, ast.Dict):
                found = [s for key in node.keys if key is not None for s in literals(key)]
            else:
                continue
            if names & set(found):
                hits.append(f"{path.name}:{node.lineno}")
    return hits


def test_the_engine_never_branches_on_a_schedule_name():
    assert sorted(PACKAGE_ROOT.joinpath("engine").glob("*.py")), "no engine module found: the scan would pass vacuously"
    assert schedule_name_branches(PACKAGE_ROOT / "engine") == []


@pytest.mark.parametrize("line", [
    'if spec.name == "2bw":\n    pass',
    'if name in ("zb1", "zb2"):\n    pass',
    'x = "PipeOptim" != name',
    'HANDLERS = {"pipedream": 1}',
])
def test_the_schedule_name_scan_catches_an_injected_branch(tmp_path, line):
    (tmp_path / "engine.py").write_text('raise ValueError("use \\"2bw\\"")  # a message may name one\n' + line + "\n")
    assert schedule_name_branches(tmp_path) == ["engine.py:2"]


def test_capture_and_initialize_stay_functions_after_their_modules_are_imported():
    # Importing gpp_deepspeed.capture binds the submodule to the package's attribute of the same
    # name; the documented gpp_deepspeed.capture(model) must still call the function.
    code = textwrap.dedent("""
        import json
        from gpp_deepspeed.frontend import CapturedModel
        from gpp_deepspeed.initialize import initialize as from_module
        import gpp_deepspeed
        print(json.dumps([callable(gpp_deepspeed.capture), gpp_deepspeed.capture.__module__,
                          gpp_deepspeed.initialize is from_module]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, "gpp_deepspeed.capture", True]
