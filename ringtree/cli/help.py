"""How every command's options are shown in --help: rich panels, each option whole.

typer's rich help puts an option's names, its type and its text in four columns; at 80 columns
long names (--checkpoint-activations, --no-flash-attention) and long words are cut with "…" and
switches show a `<bool>` type. Here each option takes one line for its names and type (click's
own help record: `--nproc <int>`, `--overlap / --no-overlap`), and its text wraps below it, at
word boundaries, folding only a word longer than the line. The panels, their titles and their
order stay typer's.
"""

from __future__ import annotations

from typing import Any

import click
from rich import box
from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.text import Text
from typer import rich_utils


def options_panel(*, name: str, params: list[Any], ctx: click.Context, console: Console, **_: Any) -> None:
    """One panel of options: names and type on a line, the text indented below (typer's signature)."""
    records = [r for p in params if (r := p.get_help_record(ctx)) is not None]
    if not records:
        return
    lines: list[Any] = []
    for names, text in records:
        lines.append(Text(names, style=rich_utils.STYLE_OPTION, overflow="fold"))
        if text:
            lines.append(Padding(Text(text, overflow="fold"), (0, 0, 0, 4)))
    panel = Panel(Group(*lines), box=box.ROUNDED, border_style="dim", title=name, title_align="left")
    console.print(panel)


def install() -> None:
    """Render every command's option panels with options_panel."""
    rich_utils._print_options_panel = options_panel  # type: ignore[assignment]  # typer has no hook
