"""Shared output helpers for commands: environment header, JSON files, rich tables."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

console = Console()


def print_environment(env: dict[str, Any]) -> None:
    console.print("# " + "  ".join(f"{k}={v}" for k, v in env.items()), highlight=False, soft_wrap=True)


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically: a temporary file in the same folder, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain fixed-width table (copy-pastes into docs, like nccl-tests' output)."""
    cells = [[str(c) for c in columns]] + [[str(v) for v in row] for row in rows]
    widths = [max(len(r[j]) for r in cells) for j in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    console.print(f"# {title}", highlight=False)
    console.print("\n".join(lines), highlight=False, soft_wrap=True)
