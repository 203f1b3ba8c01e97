"""`ringtree train`: data-parallel training on the digits, locally (--nproc) or under torchrun."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from ringtree.cli.app import app
from ringtree.cli.output import print_environment, print_table, write_json

if TYPE_CHECKING:  # torch loads only when a command runs, so `ringtree plan` starts fast
    from ringtree.train import RankResult, TrainConfig


@app.command()
def train(
    nproc: int = typer.Option(4, help="Local processes to spawn (ignored under torchrun)."),
    model: str = typer.Option("mlp", help="mlp, mlp-tiny (a distillation student) or vit."),
    mode: str = typer.Option("ddp", help="ddp (bucketed all-reduce) or dp (rank 0 reduces and broadcasts)."),
    algorithm: str = typer.Option("ring", help="All-reduce algorithm: native, ring, tree, ps, bfb, ..."),
    bucket_mb: float = typer.Option(25.0, help="Fusion bucket cap in MB."),
    compression: str = typer.Option("none", help="none, fp16 or bf16 for the buckets on the wire."),
    overlap: bool = typer.Option(True, help="Launch buckets during backward (--no-overlap: after it)."),
    batch_size: int = typer.Option(32, help="Samples per rank and micro-batch."),
    epochs: int = typer.Option(20, help="Passes over the training split."),
    lr: float = typer.Option(3e-3, help="AdamW learning rate."),
    seed: int = typer.Option(0, help="Model init and shuffling seed."),
    accumulate: int = typer.Option(1, help="Micro-batches per optimizer step (gradient accumulation)."),
    checkpoint_dir: Path | None = typer.Option(None, help="Write checkpoints (last.pt) here."),
    checkpoint_every: int = typer.Option(0, help="Optimizer steps between checkpoints; 0: every epoch."),
    resume: bool = typer.Option(False, help="Continue from --checkpoint-dir's last checkpoint."),
    timeout: float = typer.Option(60.0, help="Seconds before a stuck collective raises."),
    progress: bool = typer.Option(True, help="Show rank 0's progress bar."),
    checkpoint_activations: bool = typer.Option(
        False, help="Recompute activations in backward instead of keeping them (less memory, more compute)."
    ),
    checkpoint_segments: int = typer.Option(0, help="Checkpointed segments; 0: about sqrt(blocks)."),
    amp: str = typer.Option("off", help="Mixed precision: off, bf16 (autocast on CPU) or fp16 (CUDA only)."),
    teacher: Path | None = typer.Option(None, help="Distil from a --checkpoint-dir checkpoint (file, dir)."),
    distill_temperature: float = typer.Option(2.0, help="Softmax temperature T of the distillation loss."),
    distill_alpha: float = typer.Option(0.5, help="Weight of the teacher's soft loss (1 - A on the labels)."),
    prefetch: bool = typer.Option(False, help="Prepare the next batch on a thread while this one computes."),
    tp: int = typer.Option(1, help="Tensor-parallel ranks per vit replica (world = dp x tp); 1: none."),
    pp: int = typer.Option(1, help="Pipeline stages per model replica (world = dp x pp); 1: no pipeline."),
    micro_batches: int = typer.Option(4, help="Micro-batches per pipeline step (gpipe, 1f1b)."),
    schedule: str = typer.Option("1f1b", help="Pipeline schedule: gpipe, 1f1b, pipedream or pipedream-vs."),
    pp_balance: str = typer.Option("params", help="Cut pipeline stages by params or profiled time."),
    trace: Path | None = typer.Option(None, help="Write a Chrome-trace timeline (Perfetto) here."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the summary as JSON here."),
    calibration: Path | None = typer.Option(
        None, help="A `ringtree calibrate` file of this machine: adds the planner's predicted step time."
    ),
) -> None:
    """Train a model on the 8x8 digits with data parallelism and report accuracy and throughput."""
    from ringtree.train import TrainConfig
    from ringtree.train.planning import predicted_step_time

    try:
        cfg = TrainConfig(
            model=model,
            mode=mode,
            algorithm=algorithm,
            bucket_mb=bucket_mb,
            compression=None if compression == "none" else compression,
            overlap=overlap,
            batch_size=batch_size,
            epochs=epochs,
            lr=lr,
            seed=seed,
            accumulate=accumulate,
            checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir),
            checkpoint_every=checkpoint_every,
            resume=resume,
            timeout_s=timeout,
            progress=progress,
            tp=tp,
            pp=pp,
            micro_batches=micro_batches,
            schedule=schedule,
            pp_balance=pp_balance,
            checkpoint_activations=checkpoint_activations,
            checkpoint_segments=checkpoint_segments,
            amp=amp,
            teacher=None if teacher is None else str(teacher),
            distill_temperature=distill_temperature,
            distill_alpha=distill_alpha,
            prefetch=prefetch,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    results = _run(cfg, nproc, trace is not None)
    if results is None:
        return  # a non-zero rank under torchrun: rank 0 reports
    summary = {
        **results[0].summary,
        "predicted_step_time_s": predicted_step_time(results[0].summary, calibration),
    }
    _report(summary, results, trace, json_path)


def _run(cfg: TrainConfig, nproc: int, tracing: bool) -> list[RankResult] | None:
    """Under torchrun: train in this world (rank 0 gathers every rank's result). Otherwise spawn."""
    from ringtree.launch import run_under_torchrun, spawn, under_torchrun

    train_rank = _trainer(cfg)
    if under_torchrun():
        gathered: list[RankResult] | None = run_under_torchrun(
            _train_and_gather, (cfg, tracing), backend="gloo", timeout_s=cfg.timeout_s
        )
        return gathered
    if nproc < 1:
        raise typer.BadParameter(f"--nproc must be at least 1, got {nproc}")
    results: list[RankResult] = spawn(
        train_rank, nproc, (cfg, tracing), timeout_s=24 * 3600.0, collective_timeout_s=cfg.timeout_s
    )
    return results


def _trainer(cfg: TrainConfig) -> Callable[[int, TrainConfig, bool], RankResult]:
    """The data-parallel trainer, or the pipeline trainer when --pp > 1."""
    from ringtree.train import train as train_ddp
    from ringtree.train.pipeline_trainer import train_pipeline

    return train_pipeline if cfg.pp > 1 else train_ddp


def _train_and_gather(rank: int, cfg: TrainConfig, tracing: bool) -> list[RankResult] | None:
    """Train this rank of a torchrun world; rank 0 gets every rank's result."""
    import torch.distributed as dist

    mine = _trainer(cfg)(rank, cfg, tracing)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every if rank == 0 else None


def _report(
    summary: dict[str, Any], results: list[RankResult], trace: Path | None, json_path: Path | None
) -> None:
    from ringtree.bench import environment
    from ringtree.train import trace as chrome
    from ringtree.train.metrics import SUMMARY_KEYS
    from ringtree.train.pipeline_trainer import PIPELINE_KEYS

    print_environment(
        {
            **environment(),
            "backend": "gloo",
            "world_size": summary["world_size"],
            "local_world_size": summary["world_size"] // summary["nodes"],
        }
    )
    keys = [k for k in (*SUMMARY_KEYS, *PIPELINE_KEYS) if k in summary]  # PIPELINE_KEYS with --pp only
    print_table("ringtree train", ["metric", "value"], [[k, _fmt(summary[k])] for k in keys])
    if json_path is not None:
        write_json(json_path, {k: summary[k] for k in keys})
    if trace is not None:
        chrome.write(trace, [e for r in results for e in r.events])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "null" if value is None else str(value)
