"""`ringtree plan --from-run`: a finished one-node run's measured step, scaled to the cluster, and
its output (the line, why, the JSON, the speed-up picture)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from ringtree.cli.output import console, write_json
from ringtree.cli.plan.cluster import ClusterOptions, cluster_title
from ringtree.cli.plan.data_parallel import DP, explain_plan, known_algorithms, plot_speedup

FROM_RUN = typer.Option(None, help="A `ringtree train --json` summary of a one-node run.", rich_help_panel=DP)


def run(
    path: Path, links: ClusterOptions, algorithm: str, json_path: Path | None, plot: Path | None = None
) -> None:
    """A finished one-node run's measured compute time, scaled to --nodes x --gpus-per-node."""
    from ringtree import files
    from ringtree.sim.training.plan import StepConfig, predict_step, with_run_wait

    try:
        summary = files.read_json(path, "--from-run")
        if not isinstance(summary, dict):
            raise ValueError(f"{path} is not a `ringtree train --json` summary (expected one JSON object)")
        config = StepConfig.from_summary(summary)
        cluster = links.cluster()
        run_nodes = int(summary.get("nodes") or 1)
        run_ranks = int(summary.get("world_size") or 1)
        chosen = str(summary.get("algorithm") or "ring") if algorithm == "auto" else algorithm
        if chosen not in (*known_algorithms(), "native"):
            chosen = "ring"  # an algorithm the planner does not know is planned as ring
    except (ValueError, OSError) as e:
        raise typer.BadParameter(str(e)) from None
    if run_nodes != 1:
        raise typer.BadParameter(f"--from-run expects a one-node run, {path} ran on {run_nodes} nodes")
    base_cluster = dataclasses.replace(cluster, nodes=1, gpus_per_node=run_ranks)
    config = with_run_wait(config, summary, base_cluster)
    row = predict_step(config, cluster, chosen)
    base = predict_step(config, base_cluster, chosen)
    speedup = row.samples_per_s / (
        config.accumulate * config.batch_size * run_ranks / float(summary["step_time_s"])
    )
    result = {
        **row.as_dict(),
        "speedup": speedup,
        "speedup_vs_predicted_run": row.samples_per_s / base.samples_per_s if base.samples_per_s else 0.0,
        "measured_run_step_s": float(summary["step_time_s"]),
        "predicted_run_step_s": base.step_s,
        "from_run": str(path),
        "zero": config.zero,
        "cluster": cluster.as_dict(),
    }
    console.print(
        f"ringtree plan --from-run {path}: {config.params / 1e6:.1f}M params, compute "
        f"{config.compute_time_s:.4f} s "
        f"per micro-step (measured); on {cluster_title(cluster)} with {chosen}: step {row.step_s:.4f} s, "
        f"speedup {speedup:.2f}x over the measured {run_ranks}-rank run",
        highlight=False,
    )
    if config.sync_wait_s > 0:
        console.print(
            f"the run waited {config.sync_wait_s * 1e3:.2f} ms per step beyond the all-reduce predicted "
            f"for its own {run_ranks} ranks (a straggler, ranks sharing cores): kept in the plan",
            highlight=False,
        )
    explain_plan(result, config, cluster, links.calibration)
    if json_path is not None:
        write_json(json_path, result)
    if plot is not None:
        plot_speedup(config, cluster, [chosen], plot, f"{path}: {cluster_title(cluster)}")
