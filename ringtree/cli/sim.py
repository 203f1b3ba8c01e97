"""`ringtree sim` and `ringtree calibrate`: predicted all-reduce times, and the fit that grounds them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from ringtree.cli.app import app
from ringtree.cli.output import print_table, write_json
from ringtree.units import format_size, parse_size

SWEEPS = ("sizes", "nodes")

from ringtree.cli import plan as _plan  # noqa: E402, F401  (registers `ringtree plan`)


@app.command()
def sim(
    algorithm: str = typer.Option("ring", help="All-reduce algorithm(s), comma-separated, or 'all'."),
    nodes: int = typer.Option(1, help="Nodes (the largest count with --sweep nodes)."),
    gpus_per_node: int | None = typer.Option(None, help="Devices per node (default 8, or the --cluster's)."),
    intra: str | None = typer.Option(None, help="Intra-node link: a preset, FILE.json or 'bw=..,lat=..'."),
    inter: str | None = typer.Option(None, help="Inter-node link: a preset, FILE.json or 'bw=..,lat=..'."),
    nics_per_node: int | None = typer.Option(None, help="NICs per node; device j uses NIC j mod this."),
    cluster_name: str | None = typer.Option(
        None, "--cluster", help="A cluster preset (dgx-a100, p4d.24xlarge, eth-10g, ...); links override it."
    ),
    nbytes: str = typer.Option("64M", "--bytes", help="All-reduce size, e.g. 8, 4K, 64M."),
    method: str = typer.Option("auto", help="closed-form, replay, or auto (replay up to 64 ranks)."),
    calibration: Path | None = typer.Option(None, help="A `ringtree calibrate` file for unnamed links."),
    sweep: str | None = typer.Option(
        None, help="'sizes' (--min-bytes..--max-bytes) or 'nodes' (1..--nodes)."
    ),
    min_bytes: str = typer.Option("8", help="Smallest size of --sweep sizes."),
    max_bytes: str = typer.Option("1G", help="Largest size of --sweep sizes."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the rows as JSON here."),
    plot: Path | None = typer.Option(None, help="PNG of a sweep (default: sim-sweep.png with --sweep)."),
) -> None:
    """Predict all-reduce time on a modelled cluster; --sweep over sizes or node counts."""
    from ringtree.sim import ALGORITHMS, allreduce_time

    try:
        algorithms = list(ALGORITHMS) if algorithm == "all" else [a.strip() for a in algorithm.split(",")]
        base = _cluster(cluster_name, nodes, gpus_per_node, intra, inter, calibration, nics_per_node)
        points = _points(sweep, nodes, parse_size(nbytes), parse_size(min_bytes), parse_size(max_bytes))
        rows = [
            _row(allreduce_time(a, base.with_nodes(n), size, method), base.with_nodes(n), size)
            for n, size in points
            for a in algorithms
        ]
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    _print_rows(rows, base)
    if json_path is not None:
        write_json(json_path, rows)
    if sweep is not None:
        from ringtree.plots import plot_sim_sweep

        path = plot or Path("sim-sweep.png")
        plot_sim_sweep(rows, "ranks" if sweep == "nodes" else "bytes", path, _title(base))
        typer.echo(f"wrote {path}")


def _cluster(
    name: str | None,
    nodes: int,
    gpus_per_node: int | None,
    intra: str | None,
    inter: str | None,
    calibration: Path | None,
    nics_per_node: int | None,
) -> Any:
    """The plain links of the options, or a --cluster preset with the links the options name."""
    from ringtree.cli.plan import ClusterOptions

    return ClusterOptions(nodes, gpus_per_node, intra, inter, nics_per_node, name, calibration).cluster()


def _points(sweep: str | None, nodes: int, nbytes: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """(nodes, bytes) to estimate: one point, sizes x4 from lo to hi, or nodes x2 from 1."""
    if sweep is None:
        return [(nodes, nbytes)]
    if sweep == "sizes":
        if lo < 1 or hi < lo:
            raise ValueError(f"need 1 <= --min-bytes <= --max-bytes, got {lo} and {hi}")
        sizes = [lo]
        while sizes[-1] * 4 <= hi:
            sizes.append(sizes[-1] * 4)
        return [(nodes, s) for s in sizes]
    if sweep == "nodes":
        counts = [1 << i for i in range(nodes.bit_length()) if 1 << i < nodes] + [nodes]
        return [(n, nbytes) for n in counts]
    raise ValueError(f"unknown --sweep {sweep!r}; choose one of {', '.join(SWEEPS)}")


def _row(est: Any, cluster: Any, nbytes: int) -> dict[str, Any]:
    algbw = nbytes / est.seconds / 1e9 if est.seconds > 0 else 0.0
    p = cluster.ranks
    return {
        "algorithm": est.algorithm,
        "ranks": p,
        "nodes": cluster.nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "bytes": nbytes,
        "time_s": est.seconds,
        "method": est.method,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * 2 * (p - 1) / p,
    }


def _print_rows(rows: list[dict[str, Any]], cluster: Any) -> None:
    print_table(
        f"ringtree sim: all_reduce, {_title(cluster)}",
        ["algorithm", "ranks", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "method"],
        [
            [
                r["algorithm"],
                r["ranks"],
                format_size(r["bytes"]),
                f"{r['time_s'] * 1e6:.1f}",
                f"{r['algbw_gbps']:.3f}",
                f"{r['busbw_gbps']:.3f}",
                r["method"],
            ]
            for r in rows
        ],
    )


def _title(cluster: Any) -> str:
    return (
        f"{cluster.gpus_per_node} per node, intra {cluster.intra.name}, inter {cluster.inter.name}, "
        f"{cluster.nics_per_node} NIC(s) per node"
    )


@app.command()
def calibrate(
    bench_json: Path = typer.Argument(..., help="Rows written by `ringtree bench --json`."),
    out: Path = typer.Option(Path("machine.json"), help="Where to write the fitted alpha, beta, gamma."),
) -> None:
    """Fit alpha, beta and gamma to measured all-reduce times; use the result with --calibration."""
    from ringtree.sim import calibrate as cal
    from ringtree.sim.closed_form import estimate
    from ringtree.sim.hardware import Cluster

    try:
        rows = cal.load_rows(bench_json)
        fitted = cal.fit(rows)
    except (ValueError, OSError) as e:
        raise typer.BadParameter(str(e)) from None
    write_json(out, {**fitted.as_dict(), "source": str(bench_json)})
    cluster = Cluster(1, fitted.world_size, fitted.link, fitted.link, fitted.gamma_s_per_byte)
    table = []
    for r in rows:
        if r.get("collective") == "all_reduce" and r["bytes"] > 0:
            predicted = estimate(
                r["algorithm"], cluster, r["bytes"], max(1, r["bytes"] // max(1, r["count"]))
            )
            table.append(
                [
                    r["algorithm"],
                    format_size(r["bytes"]),
                    f"{r['time_us']:.1f}",
                    f"{predicted * 1e6:.1f}",
                    f"{(predicted * 1e6 / r['time_us'] - 1) * 100:+.1f}",
                ]
            )
    print_table(
        f"ringtree calibrate: alpha={fitted.alpha_s * 1e6:.2f} us, "
        f"bandwidth={fitted.link.bandwidth_Bps / 1e9:.3f} GB/s, gamma={fitted.gamma_s_per_byte:.3g} s/B "
        f"(rms error {fitted.rms_rel_error:.1%}) -> {out}",
        ["algorithm", "size", "measured (us)", "fitted (us)", "error %"],
        table,
    )
