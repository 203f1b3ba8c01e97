"""Shared output helpers for commands: environment header, JSON files, rich tables."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console

console = Console(soft_wrap=True)  # a line piped or wider than the terminal stays one line


def print_environment(env: dict[str, Any]) -> None:
    console.print("# " + "  ".join(f"{k}={v}" for k, v in env.items()), highlight=False, soft_wrap=True)


def check_output(path: Path | None, option: str) -> None:
    """Refuse, before any work is done, an output path that could not be written at the end:
    an existing folder, a parent that is a file or does not exist (a typo is not silently made
    into folders), or one that cannot be written in (exit 2, one sentence)."""
    if path is None:
        return
    if path.is_dir():
        raise typer.BadParameter(
            f"{option} {path} is a folder; name a file inside it, e.g. {path / 'out.json'}"
        )
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise typer.BadParameter(f"{option} {path}: {parent} is a file, not a folder; choose another path")
    if parent != path.parent:
        raise typer.BadParameter(
            f"{option} {path}: the folder {path.parent} does not exist; create it "
            f"(mkdir -p {path.parent}) or choose another path"
        )
    if parent is not None and not os.access(parent, os.W_OK):
        raise typer.BadParameter(f"{option} {path}: cannot write in {parent}; choose a writable folder")


def interrupted(command: str) -> NoReturn:
    """Ctrl-C before a command wrote anything: one line and exit code 130 (128 + SIGINT)."""
    typer.echo(f"\nringtree {command}: interrupted; nothing written", err=True)
    raise typer.Exit(code=130)


def write_json(path: Path, data: Any) -> None:
    """Write strict JSON atomically (a temporary file in the same folder, then a rename), with the
    ordinary permissions of a new file (mkstemp's are private)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"  # NaN/Infinity are not JSON
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain fixed-width table (copy-pastes into docs, like nccl-tests' output)."""
    cells = [[str(c) for c in columns]] + [[str(v) for v in row] for row in rows]
    widths = [max(len(r[j]) for r in cells) for j in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    console.print(f"# {title}", highlight=False)
    console.print("\n".join(lines), highlight=False, soft_wrap=True)
