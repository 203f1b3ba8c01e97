"""`ringtree trace`: where a real run's time goes, from its profiler traces (one file per rank)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from ringtree.cli.app import app
from ringtree.cli.output import check_output, console, interrupted, print_table, write_json
from ringtree.units import format_size

if TYPE_CHECKING:
    from ringtree.trace.bandwidth import Model
    from ringtree.trace.report import Report


@app.command()
def trace(
    paths: list[Path] = typer.Argument(
        ..., help="Trace files (.json, .json.gz; one per rank) or the folder holding them."
    ),
    steps: str | None = typer.Option(
        None, help="ProfilerSteps FIRST:LAST to analyse (default: every step but the last, as HTA)."
    ),
    cluster_name: str | None = typer.Option(
        None, "--cluster", help="Compare each collective's busbw with this cluster preset's model."
    ),
    calibration: Path | None = typer.Option(
        None, help="Compare with the links of a `ringtree calibrate` file instead."
    ),
    gpus_per_node: int | None = typer.Option(
        None, help="Devices per node for the model (default: the --cluster's, or 8)."
    ),
    workers: int | None = typer.Option(None, help="Processes reading files in parallel (default: the CPUs)."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the report as JSON here."),
    plot: Path | None = typer.Option(
        None, help="Write a PNG of each rank's time and each collective's busbw."
    ),
) -> None:
    """Per-rank time breakdown (Holistic Trace Analysis's definitions), every collective's bandwidth
    matched across ranks, and the stragglers, from torch.profiler's Chrome traces."""
    from ringtree.trace import load, report
    from ringtree.trace.window import parse_steps

    check_output(json_path, "--json")
    check_output(plot, "--plot")
    try:
        window = parse_steps(steps)
        model = _model(cluster_name, calibration, gpus_per_node)
        if workers is not None and workers < 1:
            raise ValueError(f"--workers must be at least 1, got {workers}")
        traces = load.read_all(paths, workers)
        result = report.analyse(traces, window, model)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    except KeyboardInterrupt:
        interrupted("trace")
    show(result)
    if json_path is not None:
        write_json(json_path, result.as_dict())
        console.print(f"# wrote {json_path}", highlight=False)
    if plot is not None:
        from ringtree.trace.plot import plot_report

        plot_report(result, plot)
        console.print(f"# wrote {plot}", highlight=False)


def _model(name: str | None, calibration: Path | None, gpus_per_node: int | None) -> Model | None:
    if name is None and calibration is None:
        if gpus_per_node is not None:
            raise ValueError("--gpus-per-node places the model's groups: add --cluster or --calibration")
        return None
    from ringtree.cli.plan import ClusterOptions
    from ringtree.trace.model import collective_model

    cluster = ClusterOptions(1, gpus_per_node, None, None, None, name, calibration).cluster()
    return collective_model(cluster)


def show(r: Report) -> None:
    """The verdict first, then the tables."""
    d = r.as_dict()
    for line in d["verdict"]:
        console.print(line, highlight=False, soft_wrap=True)
    console.print("")
    print_table(
        "per rank (seconds over the steps; % of kernel time as HTA)",
        [
            "rank",
            "step (ms)",
            "kernel (s)",
            "compute",
            "non-compute",
            "idle",
            "overlap",
            "exposed comm (s)",
            "idle host/kernel/other (s)",
        ],
        [_rank_cells(x) for x in d["ranks"]],
    )
    if r.collectives:
        console.print("")
        print_table(
            "collectives (time: shortest duration among ranks; wait: the rest)",
            [
                "group",
                "op",
                "size",
                "dtype",
                "ranks",
                "count",
                "time (ms)",
                "median (ms)",
                "wait (ms)",
                "algbw (GB/s)",
                "busbw (GB/s)",
                "model busbw",
            ],
            [_collective_cells(x) for x in d["collectives"]],
        )
    if r.stragglers:
        console.print("")
        print_table(
            "stragglers",
            ["rank", "late per step (ms)", "last in steps"],
            [[s.rank, f"{s.late_s_per_step * 1e3:.2f}", ",".join(map(str, s.steps))] for s in r.stragglers],
        )


def _rank_cells(x: dict[str, Any]) -> list[str]:
    overlap = "-" if x["comm_overlap_pct"] is None else f"{x['comm_overlap_pct']:.1f}%"
    step = "-" if x["step_time_s"] is None else f"{x['step_time_s'] * 1e3:.1f}"
    idle = f"{x['idle_host_wait_s']:.3f}/{x['idle_kernel_wait_s']:.3f}/{x['idle_other_s']:.3f}"
    return [
        str(x["rank"]),
        step,
        f"{x['kernel_s']:.3f}",
        f"{x['compute_pct']:.1f}%",
        f"{x['non_compute_pct']:.1f}%",
        f"{x['idle_pct']:.1f}%",
        overlap,
        f"{x['exposed_comm_s']:.3f}",
        idle,
    ]


def _collective_cells(x: dict[str, Any]) -> list[str]:
    model = "-" if x["model_busbw_gbps"] is None else f"{x['model_busbw_gbps']:.2f}"
    return [
        x["group"],
        x["op"],
        format_size(x["bytes"]) if x["bytes"] else "?",
        x["dtype"] or "?",
        f"{x['matched_ranks']}/{x['group_size']}",
        str(x["count"]),
        f"{x['time_s'] * 1e3:.2f}",
        f"{x['median_s'] * 1e3:.3f}",
        f"{x['wait_s'] * 1e3:.2f}",
        f"{x['algbw_gbps']:.2f}",
        f"{x['busbw_gbps']:.2f}",
        model,
    ]
