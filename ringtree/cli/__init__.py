"""Command-line interface: `ringtree bench | sim | plan | calibrate | train | trace | show | doctor |
emulate`,
`ringtree checkpoint inspect | consolidate`."""

from __future__ import annotations

import os
import sys

from ringtree.cli import (
    bench,  # noqa: F401  (registers its subcommand)
    checkpoint,  # noqa: F401  (registers its subcommands)
    doctor,  # noqa: F401  (registers its subcommand)
    emulate,  # noqa: F401  (registers its subcommand)
    show,  # noqa: F401  (registers its subcommand)
    sim,  # noqa: F401  (registers sim, plan and calibrate)
    trace,  # noqa: F401  (registers its subcommand)
    train,  # noqa: F401  (registers its subcommand)
)
from ringtree.cli.app import app


def main() -> None:
    """Run the command. A torchrun worker then leaves without interpreter teardown: torch's
    C++ destructors sometimes abort a gloo worker there ("terminate called without an active
    exception") after a successful run, and torchrun would report the job as failed."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        from ringtree.processes import whole_lines

        whole_lines()  # torchrun's `python -u` splits a print in two writes that ranks interleave
    try:
        app()
    except SystemExit as e:
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            raise
        _exit_now(_told(e.code if isinstance(e.code, int) else int(e.code is not None)))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _exit_now(0)


def _told(code: int) -> int:
    """Under `ringtree emulate`, a command's deliberate exit code (doctor's 1: suspects found) goes
    to RINGTREE_VERDICT_FILE and the worker leaves with 0, so that torchrun does not follow the
    command's last word with a ChildFailedError report; emulate exits with the code."""
    path = os.environ.get("RINGTREE_VERDICT_FILE")
    if code not in (1, 2) or not path:  # 1: the command's finding, 2: bad input; others are failures
        return code
    with open(path, "a") as f:  # one short append per rank: whole lines, whatever the order
        f.write(f"{code}\n")
    return 0


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
