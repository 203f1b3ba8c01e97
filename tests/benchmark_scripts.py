"""The benchmark scripts (benchmarks/*.py are scripts, not a package) loaded as modules for tests."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@cache
def load(name: str) -> ModuleType:
    """benchmarks/`name`.py, imported once per test session."""
    module_name = f"benchmark_{name}"
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
