"""`ringtree plan --from-trace DIR`: a traced run's step (compute, gradient bytes, overlap from its
profiler traces) on its own layout, which reproduces its measured step, then on the asked cluster."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from ringtree.cli.output import console, write_json
from ringtree.cli.plan.cluster import ClusterOptions, cluster_title
from ringtree.cli.plan.data_parallel import DP

FROM_TRACE = typer.Option(
    None, help="Profiler traces of a run (files or their folder): its step on --nodes.", rich_help_panel=DP
)
RUN_GPUS_PER_NODE = typer.Option(
    None, help="With --from-trace: the traced run's devices per node (default: all on one node).",
    rich_help_panel=DP,
)  # fmt: skip


def run(
    path: Path, links: ClusterOptions, algorithm: str, json_path: Path | None, run_gpus: int | None = None
) -> None:
    from ringtree.trace import load, report
    from ringtree.trace.step import planned, run_cluster, traced_step

    try:
        analysed = report.analyse(load.read_all([path]))
        traced = traced_step(analysed)
        if run_gpus is not None:
            if run_gpus < 1 or traced.world_size % run_gpus:
                raise ValueError(
                    f"--run-gpus-per-node {run_gpus} does not divide the run's {traced.world_size} ranks"
                )
            traced = dataclasses.replace(traced, gpus_per_node=run_gpus)
        cluster = links.cluster()
        backend = analysed.traces[0].backend
        chosen = ("native" if backend == "nccl" else "ring") if algorithm == "auto" else algorithm
        own = run_cluster(traced, cluster)
        config, mine, asked = planned(traced, own, cluster, chosen)
    except (ValueError, OSError) as e:
        raise typer.BadParameter(str(e)) from None
    result = {
        **asked.as_dict(),
        "from_trace": str(path),
        "measured_run_step_s": traced.step_s,
        "predicted_run_step_s": mine.step_s,
        "speedup": traced.step_s / asked.step_s * cluster.ranks / traced.world_size if asked.step_s else 0.0,
        "traced_compute_s": config.compute_time_s,
        "traced_grad_bytes": traced.grad_bytes,
        "traced_overlap_pct": traced.overlap_pct,
        "traced_wait_s": config.sync_wait_s,
        "cluster": cluster.as_dict(),
    }
    console.print(
        f"ringtree plan --from-trace {path}: {traced.world_size} ranks, step {traced.step_s * 1e3:.2f} ms "
        f"measured, {mine.step_s * 1e3:.2f} ms predicted on its own layout; compute "
        f"{config.compute_time_s * 1e3:.2f} ms, {traced.grad_bytes / 1e6:.2f} MB of gradients a step "
        f"({traced.overlap_pct:.0f}% overlapped)",
        highlight=False,
        soft_wrap=True,
    )
    console.print(
        f"on {cluster_title(cluster)} with {chosen}: step {asked.step_s * 1e3:.2f} ms, throughput "
        f"{result['speedup']:.2f}x the traced run's",
        highlight=False,
        soft_wrap=True,
    )
    if json_path is not None:
        write_json(json_path, result)
