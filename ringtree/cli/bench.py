"""`ringtree bench`: the nccl-tests-style side-by-side benchmark of collective algorithms."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from ringtree import dtypes
from ringtree.cli.app import app
from ringtree.cli.output import check_output, interrupted, print_environment, print_table, write_json
from ringtree.units import format_size, parse_size

if TYPE_CHECKING:  # torch loads only when the command runs, so other commands start fast
    from ringtree.bench import BenchConfig


@app.command()
def bench(
    nproc: int = typer.Option(4, help="Local processes to spawn (ignored under torchrun)."),
    collective: str = typer.Option(
        "all-reduce",
        help="all-reduce, reduce-scatter, all-gather, all-to-all, broadcast or reduce "
        "(underscores work too).",
    ),
    algorithms: str = typer.Option("all", help="Comma-separated algorithm names, or 'all'."),
    min_bytes: str = typer.Option("8", help="Smallest size, e.g. 8, 4K, 64M."),
    max_bytes: str = typer.Option("64M", help="Largest size."),
    step_factor: int = typer.Option(2, help="Multiply the size by this between rows."),
    dtype: str = typer.Option(
        "fp32", help="fp32, fp64, fp16, bf16, int32, int64, ...; torch's names (float32, bfloat16) too."
    ),
    op: str = typer.Option("sum", help="sum, avg, product, max or min."),
    warmup: int = typer.Option(5, help="Untimed calls before timing each row."),
    iters: int = typer.Option(20, help="Timed calls per row."),
    root: int = typer.Option(0, help="Root rank of broadcast and reduce."),
    device: str = typer.Option("cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)."),
    local_size: int = typer.Option(0, help="Pretend N ranks per node (hierarchical); 0: one node."),
    timeout: float = typer.Option(60.0, help="Seconds before a stuck collective raises."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the rows as JSON here."),
    plot: Path | None = typer.Option(None, help="Write a PNG of busbw and time against size."),
) -> None:
    """Measure collective algorithms side by side: time, algbw, busbw and wrong elements per size."""
    from ringtree.bench import ROW_KEYS, BenchConfig

    check_output(json_path, "--json")
    check_output(plot, "--plot")
    names = tuple(a.strip() for a in algorithms.split(",") if a.strip())
    if not names:
        raise typer.BadParameter(f"--algorithms {algorithms!r} names no algorithm; pass names or 'all'")
    try:
        cfg = BenchConfig(
            collective=collective,
            algorithms=() if names == ("all",) else names,
            min_bytes=parse_size(min_bytes),
            max_bytes=parse_size(max_bytes),
            step_factor=step_factor,
            dtype=dtypes.torch_name(dtype),
            op=op,
            warmup=warmup,
            iters=iters,
            root=root,
            device=device,
            timeout_s=timeout,
        )
    except (ValueError, TypeError) as e:
        raise typer.BadParameter(str(e)) from None
    rows, env = _run(cfg, nproc, local_size)
    if rows is None:
        return  # a non-zero rank under torchrun: rank 0 reports
    print_environment(env)
    print_table(
        f"ringtree bench: {cfg.collective}",
        [
            "size",
            "count",
            "type",
            "redop",
            "algorithm",
            "transport",
            "time (us)",
            "algbw (GB/s)",
            "busbw (GB/s)",
            "#wrong",
        ],
        [
            [
                format_size(r["bytes"]),
                r["count"],
                r["dtype"],
                r["op"],
                r["algorithm"],
                r["transport"],
                f"{r['time_us']:.1f}",
                f"{r['algbw_gbps']:.3f}",
                f"{r['busbw_gbps']:.3f}",
                r["wrong"],
            ]
            for r in rows
        ],
    )
    if json_path is not None:
        write_json(json_path, [{k: r[k] for k in ROW_KEYS} for r in rows])
    if plot is not None:
        from ringtree.plots import plot_bench

        plot_bench(rows, plot, env)
    if any(r["wrong"] for r in rows):
        raise typer.Exit(code=1)


def _run(cfg: BenchConfig, nproc: int, local_size: int) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
    """Under torchrun: run in this world. Otherwise spawn nproc local ranks."""
    from ringtree.processes import default_backend, run_under_torchrun, spawn, under_torchrun

    backend = default_backend(cfg.device)
    if under_torchrun():
        rank, rows, env = run_under_torchrun(_ranked, (cfg,), backend=backend, timeout_s=cfg.timeout_s)
        return (rows if rank == 0 else None), env
    if nproc < 1:
        raise typer.BadParameter(f"--nproc must be at least 1, got {nproc}")
    try:
        results = spawn(
            _spawned,
            nproc,
            (cfg,),
            backend=backend,
            timeout_s=24 * 3600.0,
            local_world_size=local_size or None,
            collective_timeout_s=cfg.timeout_s,
        )
    except KeyboardInterrupt:
        interrupted("bench")
    rows, env = results[0]
    return rows, env


def _ranked(rank: int, cfg: BenchConfig) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    return (rank, *_spawned(rank, cfg))


def _spawned(rank: int, cfg: BenchConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from ringtree.bench import environment, worker

    return worker(rank, cfg), environment(cfg.device)
