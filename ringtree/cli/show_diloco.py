"""`ringtree show diloco`: the replicas' inner steps and the fragments' outer all-reduces, as text,
JSON and a picture."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from ringtree.cli.output import console, write_json

SHOWN_REPLICAS = 4  # replica columns printed; every replica runs the same steps


def show_diloco(
    replicas: int | None,
    fragments: int | None,
    overlap_steps: int | None,
    inner_steps: int | None,
    json_path: Path | None,
    png: Path | None,
) -> None:
    from ringtree.show import diloco

    r, f, t = replicas or 2, fragments or 1, overlap_steps or 0
    h = diloco.default_inner_steps(f, t) if inner_steps is None else inner_steps
    line = diloco.timeline(r, f, t, h)
    title = (
        f"diloco: {r} replicas, H = {h} inner steps, {f} fragment{'s' if f > 1 else ''} (one every "
        f"H/F = {h // f} steps), overlap T = {t}"
    )
    console.print("ringtree show " + title, highlight=False)
    table = Table(show_lines=False)
    table.add_column("step", justify="right")
    shown = min(r, SHOWN_REPLICAS)
    for k in range(shown):
        table.add_column(f"replica {k}")
    if r > shown:
        table.add_column(f"replicas {shown}..{r - 1}")
    table.add_column("between the replicas (the slow link)", overflow="fold")
    for step in line.steps:
        cell = f"inner {step.step}" + "".join(f", f{k} := global" for k in step.applies)
        cells = [cell] * shown + (["same"] if r > shown else [])
        table.add_row(str(step.step), *cells, diloco.outer_cell(step, line))
    console.print(table)
    console.print(
        f"fK: fragment K (strided layers K, K+F, ...). Each sync moves 1/{f} of the pseudo-gradients; "
        + (
            f"its all-reduce runs behind the next {t} inner step{'s' if t > 1 else ''}, then the fragment "
            "merges (global + alpha (local - global))."
            if t
            else "the replicas wait for it (no overlap), then continue from the new global copy."
        ),
        highlight=False,
    )
    if json_path is not None:
        write_json(json_path, diloco.to_json(line))
        console.print(f"wrote {json_path}", highlight=False)
    if png is not None:
        diloco.plot(line, png, title)
        console.print(f"wrote {png}", highlight=False)
