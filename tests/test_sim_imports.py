"""ringtree.sim's imports point downward: data types below the models that read them.

Every import counts, those under `if TYPE_CHECKING:` and inside functions too (a circle that only the
type checker follows is still a circle in the design).
"""

from __future__ import annotations

import ast
from pathlib import Path

import ringtree.sim

SIM = Path(ringtree.sim.__file__).parent


def imports(module: str) -> set[str]:
    """The ringtree.sim modules `module` imports anywhere in its source."""
    tree = ast.parse((SIM / f"{module}.py").read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {
            n.split(".")[2]
            for n in names
            if n.startswith("ringtree.sim.") and (SIM / f"{n.split('.')[2]}.py").exists()
        }
    return out - {module}


def reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in imports(todo.pop()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_hardware_model_imports_only_data() -> None:
    assert imports("hardware") <= {"nccl_system"}
    assert imports("nccl_system") == set()


def test_no_circle_through_hardware_measured_or_nccl_model() -> None:
    for module in ("hardware", "nccl_system", "nccl_model", "measured"):
        assert module not in reachable(module), f"{module} imports itself through {reachable(module)}"
