"""DeepSpeed's private side is reached from one module, ``gpp_deepspeed/engine/compat.py``.

The private names are read from DeepSpeed itself (the classes the package subclasses or drives, and
their modules), so a new use of any of them elsewhere in the package fails here, whatever its name.
Allowed outside the seam: the ``_exec_*`` handlers and ``_INSTRUCTION_MAP`` (DeepSpeed's dispatch
table, the way it extends its own engine), the overrides listed in ``compat.OVERRIDDEN``, and a
class of the package keeping its own state under a name DeepSpeed reads (``StageGrid._topo``).
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import pytest

from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.pipe.topology import PipelineParallelGrid
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils.timer import SynchronizedWallClockTimer

from gpp_deepspeed.engine import compat

PACKAGE = Path(__file__).resolve().parents[1] / "gpp_deepspeed"
SEAM = PACKAGE / "engine" / "compat.py"
DRIVEN = (PipelineEngine, PipelineModule, PipelineParallelGrid, DeepSpeedZeroOptimizer, BF16_Optimizer,
          SynchronizedWallClockTimer, SynchronizedWallClockTimer.Timer)


def _is_private(name: str) -> bool:
    return (name.startswith("_") and not name.startswith("__")) or (name.endswith("_") and not name.endswith("__"))


def deepspeed_private_names() -> set[str]:
    """Every private name defined by the DeepSpeed classes the package drives, their bases, and their
    modules: methods, class attributes, and attributes the modules' code assigns on any object."""
    names, modules = set(), set()
    for cls in DRIVEN:
        for klass in cls.__mro__:
            if klass.__module__.startswith("deepspeed"):
                names |= set(vars(klass))
                modules.add(sys.modules[klass.__module__])
    for module in modules:
        names |= set(vars(module))
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
    return {n for n in names if _is_private(n)}


def _own_attributes(tree: ast.AST) -> dict[int, set[str]]:
    """For each class of the package without a DeepSpeed base: the ``self.x`` it assigns (by line span)."""
    own = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and not n.bases):
        attrs = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                 and isinstance(n.value, ast.Name) and n.value.id == "self"}
        for line in range(cls.lineno, cls.end_lineno + 1):
            own[line] = attrs
    return own


def private_uses(path: Path, private: set[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    own = _own_attributes(tree)
    uses = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            name = node.args[1].value
        if (name is None or name not in private or name.startswith("_exec_") or name == "_INSTRUCTION_MAP"
                or name in compat.OVERRIDDEN or name in own.get(node.lineno, ())):
            continue
        uses.append(f"{path.name}:{node.lineno}: {name}")
    return uses


@pytest.fixture(scope="module")
def private():
    return deepspeed_private_names()


def test_the_scan_knows_the_private_names_the_seam_uses(private):
    # If DeepSpeed's names stopped being found, the test below would pass vacuously.
    assert {"_scale_loss_by_gas", "_running_engine_backward", "_backward_epilogue", "_set_bounds",
            "_layer_specs", "_model_parallel_all_reduce", "_hp_grad", "started_"} <= private
    assert private_uses(SEAM, private), "compat.py itself must show up as using private names"


def test_no_deepspeed_private_name_is_used_outside_the_seam(private):
    uses = [u for path in sorted(PACKAGE.rglob("*.py")) if path != SEAM for u in private_uses(path, private)]
    assert uses == [], "move these into gpp_deepspeed/engine/compat.py as named functions:\n" + "\n".join(uses)


def test_a_private_use_outside_the_seam_is_caught(private, tmp_path):
    stray = tmp_path / "stray.py"
    stray.write_text("def f(engine):\n    return engine._scale_loss_by_gas(engine.total_loss)\n")
    assert [u.split(": ")[1] for u in private_uses(stray, private)] == ["_scale_loss_by_gas"]


@pytest.mark.parametrize("name", sorted(compat.OVERRIDDEN))
def test_every_overridden_private_method_still_exists_in_deepspeed(name):
    assert hasattr(PipelineEngine, name) or hasattr(PipelineModule, name), (
        f"DeepSpeed no longer defines {name}: the package's override of it would never run")
