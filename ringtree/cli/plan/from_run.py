"""`ringtree plan --from-run`: a finished one-node run's measured step, scaled to the cluster, and
its output (the line, why, the JSON, the speed-up picture). A run that compressed with PowerSGD
or synchronised less (--sync local-sgd, diloco, streaming-diloco) is priced as it ran: its method
and words become the planner's --sync words (`sync_words`), and the --sync table follows."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import typer

from ringtree.cli.output import console, write_json
from ringtree.cli.plan.cluster import ClusterOptions, cluster_title
from ringtree.cli.plan.data_parallel import DP, explain_plan, known_algorithms, plot_speedup
from ringtree.cli.plan.lowcomm import SyncOptions, report

FROM_RUN = typer.Option(None, help="A `ringtree train --json` summary of a one-node run.", rich_help_panel=DP)


def sync_words(summary: dict[str, Any], path: Path, given: SyncOptions | None = None) -> SyncOptions | None:
    """The planner's --sync words for the run's own synchronisation (None: plain DDP), with the
    plan's --replicas and --sweep from `given`; ValueError, one sentence, when it cannot be priced."""
    from ringtree.sim.lowcomm import PERIODIC

    given = given or SyncOptions()
    sync = str(summary.get("sync") or "ddp")
    compression = summary.get("compression")
    if sync not in ("ddp", *PERIODIC):
        raise ValueError(
            f"{path} ran --sync {sync}, which the planner does not price; pass the summary of a run with "
            f"--sync ddp, local-sgd, diloco or streaming-diloco"
        )
    if compression == "powersgd" and sync != "ddp":
        raise ValueError(
            f"{path} ran --sync {sync} with --compression powersgd inside its replica groups, which the "
            f"planner does not price together; plan it without --from-run as --sync {sync} (the outer "
            "sync) and as --sync powersgd (the inner all-reduce) over --module and --compute-time"
        )
    if given.replicas is not None and sync == "ddp":
        raise ValueError(
            f"--replicas sets the replica groups of a local-sgd or diloco run, and {path} ran --sync ddp"
            f"{' with PowerSGD' if compression == 'powersgd' else ''}: drop --replicas"
        )
    if compression == "powersgd":
        rank = summary.get("powersgd_rank")
        work = summary.get("powersgd_compute_s")  # its own work, measured: priced as that
        return SyncOptions("powersgd", powersgd_rank=None if rank is None else int(rank),
                           replicas=given.replicas, sweep=given.sweep,
                           powersgd_compute_time=None if work is None else float(work))  # fmt: skip
    if sync == "ddp":
        return None if given.sweep is None else given
    streaming = sync == "streaming-diloco"
    return SyncOptions(
        sync,
        replicas=given.replicas,  # the planned cluster's (default one group per node), not the run's
        inner_steps=summary.get("inner_steps"),
        fragments=summary.get("fragments") if streaming else None,
        overlap_steps=summary.get("overlap_steps") if streaming else None,
        outer_dtype=summary.get("outer_dtype") if sync != "local-sgd" else None,
        sweep=given.sweep,
    )


def sync_model(summary: dict[str, Any], path: Path, config: Any, sync: SyncOptions, hbm_Bps: float) -> Any:
    """The planner's model of the run for --sync: its parameters and, where the method needs them
    (PowerSGD's matrices, Streaming DiLoCo's layers), the tensors of the model it trained."""
    from ringtree.sim.lowcomm import Model

    needs = sync.sync == "powersgd" or (sync.fragments or 1) > 1
    if not needs:
        return Model(config.params, config.itemsize, config.bucket_mb)
    from ringtree.cli.modules import run_model_shapes

    model = str(summary.get("model") or "")
    try:
        tensors, layers = run_model_shapes(model)
    except Exception as e:  # a factory that fails to import or build: the same refusal
        what = "PowerSGD's factors" if sync.sync == "powersgd" else "Streaming DiLoCo's fragments"
        raise ValueError(
            f"{path}: {what} depend on the model's tensors, and its model {model!r} cannot be rebuilt "
            f"here ({e}); plan it without --from-run, with --module pkg.mod:factory --compute-time S "
            f"--sync {sync.sync}"
        ) from None
    return Model(config.params, config.itemsize, config.bucket_mb, tensors, layers=layers, hbm_Bps=hbm_Bps)


def run(
    path: Path,
    links: ClusterOptions,
    algorithm: str,
    json_path: Path | None,
    plot: Path | None = None,
    given: SyncOptions | None = None,
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
        sync = sync_words(summary, path, given)
    except (ValueError, OSError) as e:
        raise typer.BadParameter(str(e)) from None
    if run_nodes != 1:
        raise typer.BadParameter(f"--from-run expects a one-node run, {path} ran on {run_nodes} nodes")
    base_cluster = dataclasses.replace(cluster, nodes=1, gpus_per_node=run_ranks)
    config = with_run_wait(config, summary, base_cluster)
    model = None
    if sync is not None:
        hbm = links.gpu().hbm_GBps * 1e9 if links.name is not None else 0.0
        try:
            model = sync_model(summary, path, config, sync, hbm)
            sync.check(cluster, model)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
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
    if sync is not None:
        result |= _sync_report(summary, sync, model, cluster, chosen, config)
    if json_path is not None:
        write_json(json_path, result)
    if plot is not None:
        plot_speedup(config, cluster, [chosen], plot, f"{path}: {cluster_title(cluster)}")


def _sync_report(
    summary: dict[str, Any], sync: SyncOptions, model: Any, cluster: Any, algorithm: str, config: Any
) -> dict[str, Any]:
    """The --sync table for the run's own method (the step above is DDP's every step)."""
    from ringtree.sim.training.plan import predict_step

    if sync.sync is not None:
        words = " ".join(f"{flag} {value}" for flag, value in _run_words(sync))
        console.print(
            f"the run synchronised with --sync {sync.sync}{' ' + words if words else ''}: the step above "
            "is DDP's every step; the run's own method is priced below, beside the others",
            highlight=False,
        )
    start, steps = summary.get("powersgd_start_iter"), summary.get("steps")
    if sync.sync == "powersgd" and start is not None and steps is not None and int(steps) < int(start):
        console.print(
            f"the run's {steps} steps ended before PowerSGD's start iteration {start} (it all-reduced "
            "uncompressed until then): the plan prices the compressed steps after it",
            highlight=False,
        )
    try:
        return report(sync, model, cluster, algorithm, lambda a: lambda c: predict_step(config, c, a),
                      "data-parallel formula: the run's measured compute")  # fmt: skip
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _run_words(sync: SyncOptions) -> list[tuple[str, Any]]:
    names = ("powersgd_rank", "inner_steps", "fragments", "overlap_steps", "outer_dtype")
    return [(f"--{n.replace('_', '-')}", getattr(sync, n)) for n in names if getattr(sync, n) is not None]
