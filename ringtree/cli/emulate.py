"""`ringtree emulate`: run a ringtree command as a multi-node torchrun job on emulated nodes."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import typer

from ringtree.cli.app import app
from ringtree.cli.output import check_output, write_json

# Options whose value is a file or folder: made absolute, so every node reads the same path.
PATH_OPTIONS = ("--json", "--plot", "--trace", "--checkpoint-dir", "--calibration", "--teacher")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def emulate(
    ctx: typer.Context,
    nodes: int = typer.Option(2, help="Emulated nodes (network namespaces), 1 to 9."),
    nproc_per_node: int = typer.Option(1, help="Ranks per node (torchrun --nproc-per-node)."),
    inter_bw: str = typer.Option("1gbit", help="Every node's link rate: 100mbit, 1gbit, 10gbit, ..."),
    slow: list[str] = typer.Option([], help="NODE:RATE gives one node a slower link, e.g. 2:100mbit."),
    measure: bool = typer.Option(True, help="Measure the shaped links before the job (--no-measure: skip)."),
    cpus_per_node: str = typer.Option(
        "shared",
        help="Cores each node may use, a cgroup quota: a number (0.5), auto (the host's cores over "
        "the nodes) or shared (the scheduler shares them freely).",
    ),
    timeout: float = typer.Option(3600.0, help="Seconds before the whole job is stopped."),
    json_path: Path | None = typer.Option(
        None, "--json", help="Write the cluster's record (rates measured) here."
    ),
    cleanup: bool = typer.Option(
        False, help="Only remove the namespaces and CPU groups an interrupted emulate left behind."
    ),
) -> None:
    """Run `ringtree SUBCOMMAND ARGS` (after `--`) on N emulated nodes joined by shaped links."""
    from ringtree import emulate as emu
    from ringtree.emulate import cpu

    check_output(json_path, "--json")  # before any namespace is made
    if not emu.has_net_admin() or shutil.which("ip") is None or shutil.which("tc") is None:
        typer.echo(
            "ringtree emulate needs root or CAP_NET_ADMIN and the iproute2 tools (ip, tc) to create "
            "network namespaces; run it as root (e.g. with sudo) on Linux.",
            err=True,
        )
        raise typer.Exit(code=2)
    if cleanup:
        removed = emu.cleanup_all()
        typer.echo(
            f"removed {len(removed)} leftover namespace(s) and CPU group(s)"
            f"{': ' if removed else ''}{' '.join(removed)}"
        )
        return
    argv = absolute_paths(list(ctx.args))
    if not argv:
        raise typer.BadParameter("name the command to run after --, e.g. `ringtree emulate -- bench`")
    try:
        cores = cpu.parse(cpus_per_node, nodes)
        spec = emu.ClusterSpec(nodes, nproc_per_node, emu.parse_rate(inter_bw), parse_slow(slow), cores)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    why = cpu.unavailable() if cores is not None else None
    if why:
        typer.echo(f"ringtree emulate: --cpus-per-node needs a cgroup cpu controller, but {why}.", err=True)
        raise typer.Exit(code=2)
    try:  # Ctrl-C and SIGTERM arrive as KeyboardInterrupt, after the nodes are removed
        result = emu.run(spec, argv, measure=measure, timeout_s=timeout)
    except (TimeoutError, RuntimeError) as e:  # the network could not be built, or the job hung
        typer.echo(f"ringtree emulate: {e}", err=True)
        raise typer.Exit(code=1) from None
    except KeyboardInterrupt:
        typer.echo("ringtree emulate: interrupted; the emulated nodes were removed", err=True)
        raise typer.Exit(code=130) from None
    if json_path is not None:
        write_json(json_path, result.record)
    if result.code and not result.verdict:  # the command's own answer is its last word
        for i, log in enumerate(result.logs):
            tail = "\n".join(log.splitlines()[-25:])
            if tail:
                print(f"# node {i}'s agent (last lines):\n{tail}", file=sys.stderr)
    raise typer.Exit(code=result.code)


def parse_slow(items: list[str]) -> dict[int, float]:
    """['2:100mbit'] -> {2: 1e8}."""
    from ringtree.emulate import parse_rate

    out = {}
    for item in items:
        node, _, rate = item.partition(":")
        if not node.strip().isdigit() or not rate:
            raise ValueError(f"cannot read --slow {item!r}; write NODE:RATE, e.g. 2:100mbit")
        out[int(node)] = parse_rate(rate)
    return out


def absolute_paths(argv: list[str]) -> list[str]:
    """Make the values of PATH_OPTIONS absolute (both `--json x` and `--json=x`)."""
    out = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if eq and name in PATH_OPTIONS:
            arg = f"{name}={os.path.abspath(value)}"
        elif i > 0 and argv[i - 1] in PATH_OPTIONS:
            arg = os.path.abspath(arg)
        out.append(arg)
    return out
