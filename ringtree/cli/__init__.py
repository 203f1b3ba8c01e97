"""Command-line interface: `ringtree bench | sim | plan | calibrate | train`."""

from __future__ import annotations

from ringtree.cli import (
    bench,  # noqa: F401  (registers its subcommand)
    sim,  # noqa: F401  (registers sim, plan and calibrate)
    train,  # noqa: F401  (registers its subcommand)
)
from ringtree.cli.app import app


def main() -> None:
    app()
