"""The `ringtree` command: one typer app; each subcommand lives in its own module."""

from __future__ import annotations

import typer

from ringtree.cli import help as options_help
from ringtree.comm import mailbox, shm
from ringtree.parallel import placement

app = typer.Typer(
    name="ringtree",
    help="Every classic all-reduce, a simulator that predicts them, and parallel training on PyTorch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
options_help.install()  # every command's options whole at 80 columns


def _print_version(value: bool) -> None:
    if value:
        from ringtree import __version__

        typer.echo(f"ringtree {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
    ),
) -> None:
    """ringtree: understand, predict and fix the scaling of distributed training."""
    try:
        shm.transport()
        mailbox.spin_s()
        placement.enabled()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
