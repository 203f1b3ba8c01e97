"""`ringtree checkpoint inspect | consolidate`: what a checkpoint holds, and one dense file of it."""

from __future__ import annotations

from pathlib import Path

import typer

from ringtree.cli.app import app
from ringtree.cli.output import check_output, console, print_table, write_json

checkpoint_app = typer.Typer(
    help="Inspect a checkpoint, or consolidate a sharded one into one dense file.", no_args_is_help=True
)
app.add_typer(checkpoint_app, name="checkpoint")


@checkpoint_app.command()
def inspect(
    directory: Path = typer.Argument(
        ..., help="A --checkpoint-dir (its newest), or one step-N.dcp / step-N.pt."
    ),
    json_path: Path | None = typer.Option(None, "--json", help="Write the report here as JSON."),
) -> None:
    """Print the step, the model, the layout it was saved at, every file's size and SHA-256, and
    whether it verifies (exit 1 when it does not)."""
    from ringtree.train import checkpointer
    from ringtree.train.checkpoint import CheckpointError

    check_output(json_path, "--json")
    try:
        report = checkpointer.inspect(directory)
    except CheckpointError as e:
        raise typer.BadParameter(str(e)) from None
    layout = report["layout"] or {}
    dims = " x ".join(f"{k} {layout[k]}" for k in ("dp", "tp", "pp", "cp") if k in layout)
    where = "an unrecorded layout"
    if layout:
        n = layout.get("world_size")
        ep = f", ep {layout['ep']}" if "ep" in layout else ""  # expert parallel: over dp (x cp)
        where = f"{n} rank{'' if n == 1 else 's'} ({dims}, zero {layout.get('zero')}{ep})"
    verdict = "verifies" if report["verifies"] else f"does NOT verify: {report['problem']}"
    console.print(
        f"{report['path']}: {report['kind']} checkpoint of {report['model_name']} at step {report['step']}, "
        f"saved at {where}; {verdict}",
        highlight=False,
        soft_wrap=True,
    )
    rows = [(f["name"], f["bytes"], f["sha256"][:16]) for f in report["files"]]
    print_table("files", ["file", "bytes", "sha256 (first 16)"], rows)
    if json_path is not None:
        write_json(json_path, report)
    if not report["verifies"]:
        raise typer.Exit(code=1)


@checkpoint_app.command()
def consolidate(
    directory: Path = typer.Argument(..., help="A --checkpoint-dir (its newest), or one step-N.dcp."),
    out: Path = typer.Argument(..., help="The dense file to write (torch.load reads it)."),
) -> None:
    """Write the checkpoint's whole model as one state_dict file for the plain (unsharded) model."""
    from ringtree.train import checkpointer
    from ringtree.train.checkpoint import CheckpointError

    check_output(out, "OUT")
    if out.exists():
        raise typer.BadParameter(f"OUT {out} exists; choose another path or delete it first")
    try:
        written = checkpointer.consolidate(directory, out)
    except CheckpointError as e:
        raise typer.BadParameter(str(e)) from None
    console.print(f"wrote {written}", highlight=False)
