"""Every command's --help at 80 columns: rich panels, each option's names whole on a line, no text
cut with "…", no `<bool>` type on a switch."""

from __future__ import annotations

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from ringtree.cli.app import app


def _commands() -> list[tuple[list[str], Any]]:
    root: Any = typer.main.get_command(app)  # a click group (typer may carry its own click)
    found: list[tuple[list[str], Any]] = []
    for name, command in root.commands.items():
        if hasattr(command, "commands"):
            found += [([name, sub], c) for sub, c in command.commands.items()]
        else:
            found.append(([name], command))
    return found


COMMANDS = _commands()


@pytest.mark.parametrize(("words", "command"), COMMANDS, ids=[" ".join(w) for w, _ in COMMANDS])
def test_help_fits_80_columns_whole(words: list[str], command: Any) -> None:
    out = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in out.output and "<bool>" not in out.output, out.output
    assert "╭─ Options" in out.output  # typer's rich panels, train's too
    shown = {w for line in lines for w in line.strip("│ ").replace("/", " ").split()}
    for param in command.params:
        for name in [*param.opts, *param.secondary_opts]:
            if name.startswith("--"):
                assert name in shown, name  # on a line of its own, not cut


def test_a_mistyped_command_points_to_ringtree_help_however_it_was_started() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "ringtree", "tran"], capture_output=True, text=True, timeout=120
    )  # as `ringtree emulate -- tran` and torchrun start it
    assert done.returncode == 2
    assert "Try 'ringtree --help' for help." in done.stderr and "python -m" not in done.stderr
