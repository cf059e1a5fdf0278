"""The pure layers (graph IR, partitioners, schedules) load without torch, torch.distributed or deepspeed;
the rooms of the package import only downwards, and no module imports itself back.

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


def import_statements(source: str, module: str) -> list[tuple[str, tuple[str, ...]]]:
    """``(module named, names imported from it)`` for every ``import`` statement of ``source``,
    anywhere in the file (function bodies included) but under ``if TYPE_CHECKING:``, relative
    imports resolved as if ``source`` were the module ``module`` (``import a.b`` gives ``("a.b", ())``)."""
    package = module.rsplit(".", 1)[0]
    found: list[tuple[str, tuple[str, ...]]] = []

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                found.extend((alias.name, ()) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                found.append((base, tuple(alias.name for alias in node.names)))
            else:
                visit(ast.iter_child_nodes(node))

    visit(ast.parse(source).body)
    return found


def imported_modules(source: str, module: str) -> set[str]:
    """Every module an ``import`` statement of ``source`` names (see :func:`import_statements`);
    ``from P import name`` counts both ``P`` and ``P.name`` (``name`` may be a submodule)."""
    return {m for base, names in import_statements(source, module) for m in (base, *(f"{base}.{n}" for n in names))}


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


# ---------------------------------------------------------------------------------------------
# The rooms of gpp_deepspeed, lowest first: nn/ (torch-only building blocks) below frontend/ (capture,
# tracing, meta, Hugging Face loading) below engine/. A lower room never imports a higher one, and no
# module imports itself back through others (function-level imports count: a lazy import is still one).

def package_modules(root: Path = REPO_ROOT) -> dict[str, Path]:
    """``{module name: file}`` for every module of the ``gpp_deepspeed`` package under ``root``."""
    out = {}
    for path in sorted((root / "gpp_deepspeed").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(modules: dict[str, Path]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``(graph, outside)``: the ``modules`` each module imports (``from P import name`` imports
    ``P.name`` where that is a module, else ``P``), and the other modules it names (torch, deepspeed...)."""
    graph: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
    for module, path in modules.items():
        name = f"{module}.__init__" if path.name == "__init__.py" else module
        graph[module], outside[module] = set(), set()
        for base, names in import_statements(path.read_text(), name):
            if base.split(".")[0] != "gpp_deepspeed":
                outside[module].add(base)
                continue
            for target in [f"{base}.{n}" for n in names] or [base]:
                graph[module].add(target if target in modules else base)
    return graph, outside


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle the depth-first search meets, each as the modules around it."""
    cycles, state, path = [], {}, []

    def visit(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def reached_from(graph: dict[str, set[str]], room: str) -> set[str]:
    """The modules that importing any module of ``room`` (a package) may run: what they import, and
    so on, each with the packages above it (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``)."""
    todo = [m for m in graph if m == room or m.startswith(room + ".")]
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo.extend(".".join(parts[:k]) for k in range(1, len(parts)))
        todo.extend(graph.get(module, ()))
    return seen & set(graph)


def room_violations(root: Path, room: str, *, forbidden: tuple[str, ...],
                    allowed_outside: tuple[str, ...] = ()) -> list[str]:
    """What ``room`` reaches that it must not: modules of ``forbidden`` (packages, inside gpp_deepspeed
    or outside it) imported by the room or by anything it imports, except outside modules listed in
    ``allowed_outside``; each as ``"importer -> imported"``."""
    graph, outside = import_graph(package_modules(root))
    assert any(m.startswith(room) for m in graph), f"no module of {room} found: the scan would pass vacuously"

    def is_forbidden(name: str) -> bool:
        return name not in allowed_outside and any(name == f or name.startswith(f + ".") for f in forbidden)

    return sorted(f"{m} -> {t}" for m in reached_from(graph, room)
                  for t in graph[m] | outside[m] if is_forbidden(t))


def test_no_import_circle_among_gpp_deepspeed_modules():
    graph, _ = import_graph(package_modules())
    assert len(graph) > 50, "too few modules found: the scan would pass vacuously"
    assert import_cycles(graph) == []


def test_the_front_end_never_reaches_the_engine_and_of_deepspeed_only_the_layer_spec_types():
    # capture's layers are DeepSpeed LayerSpec / TiedLayerSpec objects (deepspeed.runtime.pipe.module):
    # that module is the front end's only contact with DeepSpeed.
    assert room_violations(REPO_ROOT, "gpp_deepspeed.frontend", forbidden=("gpp_deepspeed.engine", "deepspeed"),
                           allowed_outside=("deepspeed.runtime.pipe.module", )) == []


def test_the_torch_building_blocks_reach_neither_engine_nor_front_end_nor_deepspeed():
    assert room_violations(REPO_ROOT, "gpp_deepspeed.nn", forbidden=(
        "gpp_deepspeed.engine", "gpp_deepspeed.frontend", "gpp_deepspeed.spec", "deepspeed")) == []


def test_the_torch_building_blocks_load_without_deepspeed():
    loaded = loaded_heavy_modules("""
        import sys
        import gpp_deepspeed.nn
        assert not any(m.startswith(("gpp_deepspeed.engine", "gpp_deepspeed.frontend")) for m in sys.modules)
    """)
    assert "torch" in loaded and "deepspeed" not in loaded


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in {"gpp_deepspeed/__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_circle_scan_finds_a_lazy_circle_and_passes_over_type_checking_imports(tmp_path):
    root = _write_package(tmp_path, {
        "gpp_deepspeed/frontend/__init__.py": "",
        "gpp_deepspeed/frontend/capture.py": "def f():\n    from .pretrained import Info\n",
        "gpp_deepspeed/frontend/pretrained.py": "from .capture import CapturedModel\n",
        "gpp_deepspeed/frontend/hf.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from .pretrained import x\nfrom . import capture\n"),
    })
    graph, _ = import_graph(package_modules(root))
    assert graph["gpp_deepspeed.frontend.hf"] == {"gpp_deepspeed.frontend.capture"}
    assert import_cycles(graph) == [["gpp_deepspeed.frontend.capture", "gpp_deepspeed.frontend.pretrained",
                                     "gpp_deepspeed.frontend.capture"]]


@pytest.mark.parametrize("files, hit", [
    ({"gpp_deepspeed/frontend/capture.py": "def f():\n    from ..engine.module import GraphPipelineModule\n"},
     "gpp_deepspeed.frontend.capture -> gpp_deepspeed.engine.module"),
    ({"gpp_deepspeed/frontend/capture.py": "from ..spec import X\n", "gpp_deepspeed/spec.py": "import deepspeed.comm\n"},
     "gpp_deepspeed.spec -> deepspeed.comm"),
    ({"gpp_deepspeed/frontend/capture.py": "from ..model import X\n", "gpp_deepspeed/model.py": "from .engine import flat\n"},
     "gpp_deepspeed.model -> gpp_deepspeed.engine.flat"),
])
def test_the_room_scan_follows_imports_out_of_the_front_end(tmp_path, files, hit):
    root = _write_package(tmp_path, {"gpp_deepspeed/frontend/__init__.py": "from .capture import X\n",
                                     "gpp_deepspeed/engine/__init__.py": "", "gpp_deepspeed/engine/module.py": "",
                                     "gpp_deepspeed/engine/flat.py": "", **files})
    assert room_violations(root, "gpp_deepspeed.frontend", forbidden=("gpp_deepspeed.engine", "deepspeed"),
                           allowed_outside=("deepspeed.runtime.pipe.module", )) == [hit]


def test_no_submodule_shares_a_public_name_of_the_package():
    # gpp_deepspeed.capture and gpp_deepspeed.initialize are functions: a submodule of the same name
    # would replace the function on the package once imported.
    import gpp_deepspeed

    shadowing = [n for n in gpp_deepspeed.__all__ if f"gpp_deepspeed.{n}" in package_modules()]
    assert shadowing == []


def test_capture_and_initialize_stay_functions_after_their_modules_are_imported():
    code = textwrap.dedent("""
        import json
        from gpp_deepspeed.frontend.capture import CapturedModel
        from gpp_deepspeed.engine.initialize import initialize as from_module
        import gpp_deepspeed
        print(json.dumps([callable(gpp_deepspeed.capture), gpp_deepspeed.capture.__module__,
                          gpp_deepspeed.initialize is from_module]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, "gpp_deepspeed.frontend.capture", True]
