"""`ringtree sim` and `ringtree calibrate`: predicted all-reduce times, and the fit that grounds them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import typer

from ringtree.cli.app import app
from ringtree.cli.output import check_output, print_table, write_json
from ringtree.units import format_size, parse_size

SWEEPS = ("sizes", "nodes")
COLLECTIVES = ("all-reduce", "all-to-all")
DEFAULT_CALIBRATION = Path("machine.json")
# Replaying more ranks than this takes minutes (millions of messages): refused with a hint. An
# all-to-all's schedule has p^2 blocks, so it is refused sooner.
REPLAY_MAX_RANKS = {"all-reduce": 1024, "all-to-all": 256}

from ringtree.cli import plan as _plan  # noqa: E402, F401  (registers `ringtree plan`)


@app.command()
def sim(
    algorithm: str | None = typer.Option(
        None,
        help="Algorithm(s), comma-separated, or 'all' (default: ring for all-reduce, native for all-to-all).",
    ),
    collective: str = typer.Option("all-reduce", help="all-reduce or all-to-all (underscores work too)."),
    nodes: int = typer.Option(1, help="Nodes (the largest count with --sweep nodes)."),
    gpus_per_node: int | None = typer.Option(None, help="Devices per node (default 8, or the --cluster's)."),
    intra: str | None = typer.Option(None, help="Intra-node link: a preset, FILE.json or 'bw=..,lat=..'."),
    inter: str | None = typer.Option(None, help="Inter-node link: a preset, FILE.json or 'bw=..,lat=..'."),
    nics_per_node: int | None = typer.Option(
        None, help="NICs per node; device j uses NIC j mod this (default 1, or the calibration's)."
    ),
    cluster_name: str | None = typer.Option(
        None, "--cluster", help="A cluster preset (dgx-a100, p4d.24xlarge, eth-10g, ...); links override it."
    ),
    nbytes: str = typer.Option(
        "64M", "--bytes", help="Size, e.g. 8, 4K, 64M (all-to-all: the per-rank buffer, as nccl-tests)."
    ),
    method: str = typer.Option(
        "auto", help="closed-form, replay, or auto (replay up to 64 ranks, 32 for all-to-all)."
    ),
    calibration: Path | None = typer.Option(None, help="A `ringtree calibrate` file for unnamed links."),
    sweep: str | None = typer.Option(
        None, help="'sizes' (--min-bytes..--max-bytes) or 'nodes' (1..--nodes)."
    ),
    min_bytes: str = typer.Option("8", help="Smallest size of --sweep sizes."),
    max_bytes: str = typer.Option("1G", help="Largest size of --sweep sizes."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the rows as JSON here."),
    plot: Path | None = typer.Option(
        None, help="Write a PNG of the sweep here (needs --sweep; no picture unless asked)."
    ),
) -> None:
    """Predict all-reduce or all-to-all time on a modelled cluster; --sweep over sizes or node counts.

    `native` on a GPU cluster (NVLink or PCIe intra link, or an nccl-tests calibration) is NCCL:
    for an all-reduce the table shows the algorithm and protocol NCCL's cost model picks, and where
    the pick changes; an all-to-all is NCCL's grouped point-to-point (NVLink, PXN across nodes).
    """
    collective = collective.replace("_", "-")  # all_reduce is all-reduce
    try:
        estimate = _estimator(collective)
        algorithms = _algorithms(collective, algorithm)
        base = _cluster(cluster_name, nodes, gpus_per_node, intra, inter, calibration, nics_per_node)
        points = _points(sweep, nodes, parse_size(nbytes), parse_size(min_bytes), parse_size(max_bytes))
        ranks = max(n for n, _ in points) * base.gpus_per_node
        if method == "replay" and ranks > REPLAY_MAX_RANKS[collective]:
            raise ValueError(
                f"--method replay of {ranks} ranks would take minutes "
                f"(at most {REPLAY_MAX_RANKS[collective]} for {collective}); "
                "use --method auto or closed-form instead"
            )
        path = _plot_path(sweep, plot)
        check_output(json_path, "--json")
        check_output(path, "--plot")
        rows = [
            _row(estimate(a, base.with_nodes(n), size, method), base.with_nodes(n), size, collective)
            for n, size in points
            for a in algorithms
        ]
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    _print_rows(rows, base, collective)
    if "native" in algorithms and collective == "all-reduce":
        _print_crossovers(base, sorted({n for n, _ in points}))
    if json_path is not None:
        write_json(json_path, rows)
    if path is not None:
        from ringtree.plots import plot_sim_sweep

        plot_sim_sweep(rows, "ranks" if sweep == "nodes" else "bytes", path, _title(base), collective)
        typer.echo(f"wrote {path}")


def _estimator(collective: str) -> Any:
    """The function that prices one collective: (algorithm, cluster, bytes, method) -> Estimate."""
    if collective == "all-reduce":
        from ringtree.sim import allreduce_time

        return allreduce_time
    if collective == "all-to-all":
        from ringtree.sim.network.alltoall import alltoall_time

        return alltoall_time
    raise ValueError(f"unknown --collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")


def _algorithms(collective: str, algorithm: str | None) -> list[str]:
    """The --algorithm names (checked), 'all' of the collective's, or its default."""
    if collective == "all-to-all":
        from ringtree.sim.network.alltoall import ALGORITHMS, check_algorithm
    else:
        from ringtree.sim import ALGORITHMS
        from ringtree.sim.network.closed_form import check_algorithm
    if algorithm is None:
        return ["ring" if collective == "all-reduce" else "native"]
    names = list(ALGORITHMS) if algorithm == "all" else [a.strip() for a in algorithm.split(",")]
    for name in names:
        check_algorithm(name)
    return names


def _plot_path(sweep: str | None, plot: Path | None) -> Path | None:
    """Where a sweep's PNG goes: only where --plot names it (nothing is written unasked)."""
    if sweep is None and plot is not None:
        raise ValueError("--plot needs --sweep sizes or --sweep nodes (a single point has no plot)")
    return plot


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


def _row(est: Any, cluster: Any, nbytes: int, collective: str = "all-reduce") -> dict[str, Any]:
    algbw = nbytes / est.seconds / 1e9 if est.seconds > 0 else 0.0
    p = cluster.ranks
    from ringtree.sim.network.busbw import busbw_factor

    factor = busbw_factor(collective, p)
    row = {
        "collective": collective,
        "algorithm": est.algorithm,
        "ranks": p,
        "nodes": cluster.nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "nics_per_node": cluster.nics_per_node,
        "nic_GBps": cluster.inter.bandwidth_Bps / 1e9,
        "bytes": nbytes,
        "time_s": est.seconds,
        "method": est.method,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * factor,
    }
    if est.nccl:
        row["nccl_choice"] = est.nccl
    return row


def _print_rows(rows: list[dict[str, Any]], cluster: Any, collective: str = "all-reduce") -> None:
    print_table(
        f"ringtree sim: {collective.replace('-', '_')}, {_title(cluster)}",
        ["algorithm", "ranks", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "method"],
        [
            [
                r["algorithm"],
                r["ranks"],
                format_size(r["bytes"]),
                f"{r['time_s'] * 1e6:.1f}",
                f"{r['algbw_gbps']:.3f}",
                f"{r['busbw_gbps']:.3f}",
                f"{r['method']} {r['nccl_choice']}" if "nccl_choice" in r else r["method"],
            ]
            for r in rows
        ],
    )


def _print_crossovers(cluster: Any, node_counts: list[int]) -> None:
    """Where NCCL's pick of algorithm/protocol changes, from 8 B to 8 GiB, per node count."""
    from ringtree.sim.network import nccl_model

    tuning = nccl_model.tuning_for(cluster)
    if tuning is None or cluster.ranks < 2:
        return
    for n in node_counts:
        p = n * cluster.gpus_per_node
        if p < 2:
            continue
        first = nccl_model.choose(tuning.system, p, n, 8).label
        steps = [f"{first} from 8B"] + [
            f"{new} from {format_size(size)}" for size, _, new in nccl_model.crossovers(tuning.system, p, n)
        ]
        typer.echo(f"# NCCL's pick on {n} node(s) x {cluster.gpus_per_node}: " + ", ".join(steps))


def _title(cluster: Any) -> str:
    return str(cluster.per_node())


@app.command()
def calibrate(
    files: list[Path] = typer.Argument(
        ..., help="`ringtree bench --json` files and/or nccl-tests all_reduce_perf and alltoall_perf logs."
    ),
    out: Path | None = typer.Option(
        None, help="Where to write the fit (default machine.json, if no such file exists)."
    ),
    inter: str | None = typer.Option(
        None, help="NIC of multi-node nccl-tests logs (default ib-hdr, ib-ndr for Hopper and later)."
    ),
    nics_per_node: int | None = typer.Option(
        None, help="NICs per node of multi-node nccl-tests logs (default one per GPU)."
    ),
) -> None:
    """Fit the simulator to measured all-reduce times; use the result with --calibration.

    Bench rows fit alpha, beta and gamma of the closed form (an intra- and an inter-node link when
    rows come from several nodes); nccl-tests logs fit corrections to NCCL's own cost model
    (alltoall_perf logs: to its all-to-all, grouped point-to-point).
    """
    from ringtree.sim.network import calibrate as cal
    from ringtree.sim.network import nccl_fit
    from ringtree.sim.network.hardware import parse_link
    from ringtree.sim.network.presets import INTER

    try:
        if nics_per_node is not None and nics_per_node < 1:
            raise ValueError(f"--nics-per-node must be at least 1, got {nics_per_node}")
        target = _calibration_target(out, files)
        bench_rows: list[dict[str, Any]] = []
        nccl_rows: list[dict[str, Any]] = []
        for f in files:
            b, n = cal.read_measurements(f)
            bench_rows += b
            nccl_rows += n
        nic = parse_link(inter, INTER) if inter else None
        if nic is not None and not nccl_rows:
            raise ValueError("--inter describes the NICs of nccl-tests logs; none was given")
        reduce_rows = [r for r in nccl_rows if r["collective"] == "all_reduce"]
        a2a_rows = [r for r in nccl_rows if r["collective"] == "all_to_all"]
        if reduce_rows and a2a_rows:
            nccl_fit.hardware(nccl_rows, nic, nics_per_node)  # refuses logs of two GPU generations
        nccl = nccl_fit.fit(reduce_rows, nic, nics_per_node) if reduce_rows else None
        if a2a_rows:
            nccl = _with_alltoall(nccl, a2a_rows, nic, nics_per_node)
        fitted = cal.fit(bench_rows) if bench_rows else _from_nccl(nccl)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if nccl is not None:
        # with bench rows too, ringtree's own algorithms keep the bench-fitted links, and the NCCL
        # fit's statistics stay under `nccl`; without them they are the top level's (one key each)
        kept = nccl if bench_rows else {k: v for k, v in nccl.items() if k not in _FIT_STATS}
        fitted = replace(fitted, nccl={**kept, "links_from_bench": bool(bench_rows)})
    write_json(target, {**fitted.as_dict(), "source": [str(f) for f in files]})
    if bench_rows:
        _print_bench_fit(fitted, bench_rows, target)
    if nccl is not None and nccl["table"]:
        _print_nccl_fit(nccl, target)
        _print_interpolation(nccl)
    if nccl is not None and "alltoall" in nccl:
        _print_alltoall_fit(nccl, target)


_FIT_STATS = ("rows", "rms_rel_error", "max_rel_error", "levels")  # a fit's residuals


def _with_alltoall(
    nccl: dict[str, Any] | None, rows: list[dict[str, Any]], nic: Any, nics: int | None
) -> dict[str, Any]:
    """The `nccl` section with the all-to-all fit under `alltoall`; from alltoall_perf logs alone,
    the hardware they ran on with NCCL's uncorrected all-reduce model, and the all-to-all fit's
    residuals as the section's own."""
    from dataclasses import asdict

    from ringtree.sim.network import nccl_fit
    from ringtree.sim.network.nccl_system import Corrections, NcclSystem

    if nccl is not None:
        return {**nccl, "alltoall": nccl_fit.fit_alltoall(rows, NcclSystem(**nccl["system"]))}
    intra, link, n_nics, system = nccl_fit.hardware(rows, nic, nics)
    alltoall = nccl_fit.fit_alltoall(rows, system)
    return {
        "system": asdict(system), "corrections": asdict(Corrections()), "intra": intra.as_dict(),
        "inter": link.as_dict(), "nics_per_node": n_nics, "fitted": [], "table": [],
        **{k: alltoall[k] for k in _FIT_STATS}, "alltoall": alltoall,
    }  # fmt: skip


def _calibration_target(out: Path | None, inputs: list[Path]) -> Path:
    """--out, or machine.json when it does not exist yet; never one of the inputs."""
    if out is None and DEFAULT_CALIBRATION.exists():
        raise ValueError(
            f"{DEFAULT_CALIBRATION} already exists and was not named; pass --out FILE "
            f"(or --out {DEFAULT_CALIBRATION} to replace it)"
        )
    target = out or DEFAULT_CALIBRATION
    check_output(target, "--out")
    if any(target.resolve() == f.resolve() for f in inputs):
        raise ValueError(f"--out {target} is one of the input files; write the fit to another file")
    return target


def _from_nccl(nccl: Any) -> Any:
    """The one-level Calibration fields of an nccl-tests-only fit: its corrected intra-node link."""
    from ringtree.sim.network.calibrate import Calibration, LevelFit
    from ringtree.sim.network.nccl_model import HW_LAT

    c, intra = nccl["corrections"], nccl["intra"]
    levels = {k: LevelFit(**v) for k, v in nccl["levels"].items()}
    return Calibration(
        HW_LAT["nvlink"]["ring"][2] * 1e-6 * c["latency_intra"],
        c["transfer_intra"] / intra["bandwidth_Bps"],
        0.0,  # NCCL's model has no separate reduction cost: it is in the measured bandwidth
        max(int(r["world_size"]) for r in nccl["table"] or nccl["alltoall"]["table"]),
        nccl["rows"],
        nccl["rms_rel_error"],
        nccl["max_rel_error"],
        levels=levels,
    )


def _print_bench_fit(fitted: Any, rows: list[dict[str, Any]], out: Path) -> None:
    import numpy as np

    from ringtree.sim.network.calibrate import model_time

    values = [fitted.alpha_s, fitted.beta_s_per_byte]
    if fitted.inter_alpha_s is not None:
        values += [fitted.inter_alpha_s, fitted.inter_beta_s_per_byte]
    theta = np.array([*values, fitted.gamma_s_per_byte])
    table = []
    for r in rows:
        if r.get("collective") == "all_reduce" and r["bytes"] > 0 and r["time_us"] > 0:
            predicted = model_time(r, theta) * 1e6
            nodes = r.get("nodes", 1)
            table.append(
                [r["algorithm"], f"{nodes}x{r['world_size'] // nodes}", format_size(r["bytes"]),
                 f"{r['time_us']:.1f}", f"{predicted:.1f}", f"{(predicted / r['time_us'] - 1) * 100:+.1f}"]
            )  # fmt: skip
    links = f"alpha={fitted.alpha_s * 1e6:.2f} us, bandwidth={fitted.link.bandwidth_Bps / 1e9:.3f} GB/s"
    if fitted.inter_link is not None:
        links = f"intra {links}; inter alpha={fitted.inter_alpha_s * 1e6:.2f} us, " + (
            f"bandwidth={fitted.inter_link.bandwidth_Bps / 1e9:.3f} GB/s"
        )
    print_table(
        f"ringtree calibrate: {links}, gamma={fitted.gamma_s_per_byte:.3g} s/B "
        f"({_residuals(fitted.levels)}) -> {out}",
        ["algorithm", "shape", "size", "measured (us)", "fitted (us)", "error %"],
        table,
    )


NCCL_FIT_COLUMNS = (
    "log", "ranks", "nodes", "size", "measured (us)", "NCCL pick", "NCCL model (us)", "fitted (us)", "error %"
)  # fmt: skip


def _print_nccl_fit(nccl: dict[str, Any], out: Path) -> None:
    c = nccl["corrections"]
    system = nccl["system"]
    print_table(
        f"ringtree calibrate: NCCL model, {system['generation']} {system['fabric']} "
        f"({system['intra_bus_GBps']:.0f} GB/s bus, {system['channels']} channels), "
        f"{nccl['nics_per_node']} x {nccl['inter']['name']} per node; corrections "
        + ", ".join(f"{k} x{v:.2f}" for k, v in c.items())
        + f" ({_residuals_dict(nccl['levels'])}) -> {out}",
        NCCL_FIT_COLUMNS,
        [
            [Path(r["file"]).name, r["world_size"], r["nodes"], format_size(r["bytes"]),
             f"{r['measured_us']:.1f}", r["nccl_choice"], f"{r['nccl_model_us']:.1f}",
             f"{r['fitted_us']:.1f}",
             f"{(r['fitted_us'] / r['measured_us'] - 1) * 100:+.1f}"]
            for r in nccl["table"]
        ],
    )  # fmt: skip


def _print_alltoall_fit(nccl: dict[str, Any], out: Path) -> None:
    fit = nccl["alltoall"]
    print_table(
        "ringtree calibrate: NCCL all-to-all model (grouped point-to-point); corrections "
        + ", ".join(f"{k} x{v:.2f}" for k, v in fit["corrections"].items())
        + f" ({_residuals_dict(fit['levels'])}) -> {out}",
        ["log", "ranks", "nodes", "size", "measured (us)", "NCCL model (us)", "fitted (us)", "error %"],
        [
            [Path(r["file"]).name, r["world_size"], r["nodes"], format_size(r["bytes"]),
             f"{r['measured_us']:.1f}", f"{r['nccl_model_us']:.1f}", f"{r['fitted_us']:.1f}",
             f"{(r['fitted_us'] / r['measured_us'] - 1) * 100:+.1f}"]
            for r in fit["table"]
        ],
    )  # fmt: skip
    typer.echo(
        "all-to-all at a node shape these logs hold: read off their rows (log-log between sizes, "
        "the fitted model's shape beyond them); other shapes: the fitted model"
    )


def _print_interpolation(nccl: dict[str, Any]) -> None:
    """Per log: the fit's residuals, and which sizes at which GPU count `sim`/`plan` read off its rows."""
    by_log: dict[str, list[dict[str, Any]]] = {}
    for r in nccl["table"]:
        by_log.setdefault(str(r["file"]), []).append(r)
    for name, rows in by_log.items():
        rel = [r["fitted_us"] / r["measured_us"] - 1 for r in rows]
        rms = (sum(x * x for x in rel) / len(rel)) ** 0.5
        nodes, p = int(rows[0]["nodes"]), int(rows[0]["world_size"])
        sizes = sorted(int(r["bytes"]) for r in rows)
        typer.echo(
            f"{Path(name).name}: {p} GPUs on {nodes} node(s) x {p // nodes}: fit residuals rms {rms:.1%}, "
            f"max {max(abs(x) for x in rel):.1%} over {len(rows)} sizes; `sim`/`plan` native at "
            f"{nodes} x {p // nodes}: {_bytes(sizes[0])}-{_bytes(sizes[-1])} interpolated "
            "(log-log) between these rows, other sizes the nearest row scaled by the fitted model"
        )
    typer.echo("other GPU counts and node shapes: the fitted NCCL model")


def _bytes(nbytes: int) -> str:
    text = format_size(nbytes)
    return f"{text}B" if text.isdigit() else text


def _residuals(levels: dict[str, Any]) -> str:
    return _residuals_dict({k: v.__dict__ for k, v in levels.items()})


def _residuals_dict(levels: dict[str, dict[str, Any]]) -> str:
    return "; ".join(
        f"{name}: rms error {v['rms_rel_error']:.1%} over {v['rows']} rows" for name, v in levels.items()
    )
