"""ringtree.sim's imports point downward: data types below the models that read them.

Every import counts, those under `if TYPE_CHECKING:` and inside functions too (a circle that only the
type checker follows is still a circle in the design).
"""

from __future__ import annotations

import ast
from pathlib import Path

import ringtree.sim

SIM = Path(ringtree.sim.__file__).parent
NETWORK = {p.stem for p in (SIM / "network").glob("*.py")} - {"__init__"}
TRAINING = {p.stem for p in (SIM / "training").glob("*.py")} - {"__init__"}
PACKAGE = {m: "network" for m in NETWORK} | {m: "training" for m in TRAINING}


def imports(module: str) -> set[str]:
    """The ringtree.sim modules `module` (network's or training's) imports anywhere in its source."""
    tree = ast.parse((SIM / PACKAGE[module] / f"{module}.py").read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        parts = [n.split(".") for n in names if n.startswith("ringtree.sim.")]
        out |= {p[3] for p in parts if len(p) > 3 and p[2] in ("network", "training") and p[3] in PACKAGE}
        assert not any(len(p) == 3 and p[2] in PACKAGE for p in parts), (
            f"{module} imports a module by its old path"
        )
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


def test_the_network_model_imports_nothing_of_the_training_planner() -> None:
    for module in NETWORK:
        assert not imports(module) & TRAINING, f"network.{module} imports {imports(module) & TRAINING}"


def test_sim_plan_keeps_the_planner_s_public_names() -> None:
    import ringtree.sim.plan as shim
    from ringtree.sim.training import plan

    tree = ast.parse((SIM / "training" / "plan.py").read_text())
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    defined += [
        t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
    ]
    public = {n for n in defined if not n.startswith("_")}
    assert public <= set(shim.__all__)
    assert all(getattr(shim, n) is getattr(plan, n) for n in shim.__all__)
