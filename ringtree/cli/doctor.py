"""`ringtree doctor`: find the slow link, the slow rank or the odd version before training."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from ringtree.cli.app import app
from ringtree.cli.output import check_output, console, interrupted, print_table, write_json
from ringtree.units import parse_size

if TYPE_CHECKING:  # torch loads only when the command runs
    from ringtree.doctor import DoctorConfig


@app.command()
def doctor(
    nproc: int = typer.Option(4, help="Local processes to spawn (ignored under torchrun)."),
    local_size: int = typer.Option(0, help="Pretend N ranks per node when spawning; 0: one node."),
    size: str = typer.Option("1M", help="Bytes per bandwidth message, e.g. 256K, 1M, 16M."),
    iters: int = typer.Option(3, help="Timed messages per link."),
    matmul: int = typer.Option(256, help="n of the n x n float32 matmul timed on every rank."),
    threshold: float = typer.Option(
        0.5, help="A link or rank below this fraction of the expected is a suspect."
    ),
    expect_bw: str = typer.Option(
        "", help="Inter-node rate you expect, e.g. 10gbit; default: the median node's."
    ),
    timeout: float = typer.Option(60.0, help="Seconds before a stuck transfer raises."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the report (with `suspects`) here."),
) -> None:
    """Measure bandwidth and latency between and within nodes, each rank's compute, and versions."""
    from ringtree.doctor import DoctorConfig

    check_output(json_path, "--json")  # before the check runs, not after
    try:
        expect = 0.0
        if expect_bw:
            from ringtree.emulate.network import parse_rate

            expect = parse_rate(expect_bw) / 1e9
        cfg = DoctorConfig(parse_size(size), iters, matmul, threshold, expect, timeout)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    result = _run(cfg, nproc, local_size)
    if result is None:
        return  # a non-zero rank under torchrun: rank 0 reports
    show(result)
    if json_path is not None:
        write_json(json_path, result)
    if result["suspects"] or result["mismatches"]:
        raise typer.Exit(code=1)


def _run(cfg: DoctorConfig, nproc: int, local_size: int) -> dict[str, Any] | None:
    """Under torchrun: this world. Otherwise nproc spawned local ranks (as `bench` does)."""
    from ringtree.processes import run_under_torchrun, spawn, under_torchrun

    if under_torchrun():
        return run_under_torchrun(_ranked, (cfg,), timeout_s=cfg.timeout_s)  # type: ignore[no-any-return]
    if nproc < 1 or (local_size and nproc % local_size):
        raise typer.BadParameter(
            f"--nproc {nproc} must be at least 1 and a multiple of --local-size {local_size}"
        )
    try:
        reports = spawn(
            _ranked,
            nproc,
            (cfg,),
            timeout_s=600.0,
            local_world_size=local_size or None,
            collective_timeout_s=cfg.timeout_s,
        )
    except KeyboardInterrupt:
        interrupted("doctor")
    return reports[0]  # type: ignore[no-any-return]


def _ranked(rank: int, cfg: DoctorConfig) -> dict[str, Any] | None:
    from ringtree.doctor import run

    return run(cfg)


def show(result: dict[str, Any]) -> None:
    """The node matrix (bandwidth and latency), the compute table, versions and suspects."""
    n = result["nodes"]
    console.print(
        f"# doctor: {n} nodes x {result['ranks_per_node']} ranks, "
        + "  ".join(f"{k}={v}" for k, v in result["versions"].items()),
        highlight=False,
        soft_wrap=True,
    )
    cell: dict[tuple[int, int], str] = {}
    for x in result["links"]:
        text = f"{x['gbps']:.3f} Gbit/s {x['latency_us']:.0f}us"
        cell[x["node_a"], x["node_b"]] = cell[x["node_b"], x["node_a"]] = text
    print_table(
        "links between nodes (row, column; diagonal: within the node)",
        ["node", *map(str, range(n))],
        [[u, *(cell.get((u, v), "-") for v in range(n))] for u in range(n)],
    )
    print_table(
        "compute (float32 matmul)",
        ["rank", "node", "GFLOP/s"],
        [[c["rank"], c["node"], f"{c['gflops']:.2f}"] for c in result["compute"]],
    )
    for m in result["mismatches"]:
        console.print(f"version mismatch: rank {m['rank']} has {m['key']}={m['value']}, rank 0 {m['rank0']}")
    for s in result["suspects"]:
        unit = "Gbit/s" if s["kind"] == "link" else "GFLOP/s"
        console.print(
            f"suspect: node {s['node']} rank {s['rank']} ({s['kind']}): "
            f"{s['measured']:.3f} {unit}, expected about {s['expected']:.3f}",
            highlight=False,
        )
    if not result["suspects"] and not result["mismatches"]:
        console.print("no suspects", highlight=False)
