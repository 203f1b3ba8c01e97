"""`ringtree train`: one trainer for DP x TP x PP, locally (--nproc) or under torchrun.

The options are not written here: they are generated from the fields of TrainConfig (its type,
default and help text), with typer, which every other ringtree command already uses. Generating
typer options from the dataclass keeps one CLI library in the app and no new dependency, where
tyro or jsonargparse would bring a second argument parser with its own help layout and error
style (ringtree's refusals are one sentence and exit code 2). `--config FILE` (YAML or JSON)
fills the fields first; any flag given on the command line overrides the file.
"""

from __future__ import annotations

import inspect
import os
import signal
import typing
from collections.abc import Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from ringtree.cli.app import app
from ringtree.cli.output import check_output, interrupted, print_environment, print_table, write_json

if TYPE_CHECKING:  # torch loads only when a command runs, so `ringtree plan` starts fast
    from ringtree.train import RankResult, TrainConfig

# Options of the command itself, not of the training (they pick where it runs and what it writes).
_COMMAND_OPTIONS = [
    ("nproc", int, typer.Option(4, help="Local processes to spawn (ignored under torchrun).")),
    ("config", Path | None, typer.Option(None, help="YAML or JSON file of options; flags override it.")),
    ("trace", Path | None, typer.Option(None, help="Write a Chrome-trace timeline (Perfetto) here.")),
    ("json_path", Path | None, typer.Option(None, "--json", help="Write the summary as JSON here.")),
    (
        "calibration",
        Path | None,
        typer.Option(None, help="A `ringtree calibrate` file: adds the predicted step time."),
    ),
]


def _config_parameters() -> list[inspect.Parameter]:
    """One typer option per TrainConfig field: its flag, type, default and help."""
    from ringtree.train import config

    hints = typing.get_type_hints(config.TrainConfig)
    params = []
    for f in fields(config.TrainConfig):
        flag = config.flag(f.name)
        kind = hints[f.name]
        if Mapping in (typing.get_origin(a) for a in typing.get_args(kind)):
            kind = str | None  # a mapping (--tp-plan) comes from a file on the command line
        switch = (bool in typing.get_args(kind) or kind is bool) and f.default is not False
        decls = [f"{flag}/--no-{flag[2:]}"] if switch else [flag]
        default = None if f.default is MISSING else f.default
        option = typer.Option(default, *decls, help=f.metadata["help"], show_default=default is not None)
        params.append(
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
        )
    return params


def train(ctx: typer.Context, **options: Any) -> None:
    """Train a model (the digits by default) with data, tensor and pipeline parallelism."""
    from ringtree.train.planning import predicted_step_time

    nproc, trace, json_path = options.pop("nproc"), options.pop("trace"), options.pop("json_path")
    calibration, config_file = options.pop("calibration"), options.pop("config")
    check_output(json_path, "--json")
    check_output(trace, "--trace")
    try:
        cfg = _config(ctx, options, config_file, nproc)
    except KeyboardInterrupt:  # Ctrl-C while the launcher reads the model and the checkpoints
        interrupted("train")
    results = _run(cfg, nproc, trace is not None)
    if results is None:
        return  # a non-zero rank under torchrun: rank 0 reports
    summary = results[0].summary
    summary["predicted_step_time_s"] = predicted_step_time(summary, calibration)
    _report(summary, results, trace, json_path)


def _config(ctx: typer.Context, flags: dict[str, Any], config_file: Path | None, nproc: int) -> TrainConfig:
    """The file's options, then the flags given on the command line; refused (exit 2) if invalid."""
    from ringtree.processes import under_torchrun
    from ringtree.train import TrainConfig
    from ringtree.train.config import check_world, device_type, load_file
    from ringtree.train.models import recipe
    from ringtree.train.trainer import preflight

    given = {
        name: value
        for name, value in flags.items()
        if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"
    }
    try:
        from_file = load_file(config_file) if config_file is not None else {}
        model = (from_file | given).get("model", TrainConfig.model)
        dataset = recipe(model)[1].dataset  # a model's own data set (the gpt's sort task), unless named
        cfg = TrainConfig(**({"dataset": dataset} if dataset else {}) | from_file | given)
        check_world(cfg, int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc)
        if not under_torchrun() and device_type(cfg) == "cpu":
            _check_machine(nproc, os.cpu_count() or 1, _available_gb())
        _check_restarts(cfg)
        preflight(cfg)
    except (ValueError, TypeError) as e:
        raise typer.BadParameter(getattr(e, "cli", str(e))) from None  # the flags' words
    return cfg


WORKER_GB = 0.4  # a CPU worker's memory before its model: torch and gloo (the digits' mlp peaks at 0.43)
CORES_PER_WORKER_WARNED = 0.25  # below a quarter of a core each, a run is mostly waiting for a core


def _check_machine(nproc: int, cores: int, available_gb: float | None) -> None:
    """Refuse local workers that cannot fit in the memory left; warn, with the figures, of many
    more workers than cores (every collective then waits for a descheduled rank)."""
    if available_gb is not None and nproc * WORKER_GB > available_gb:
        fits = max(1, int(available_gb / WORKER_GB))
        raise ValueError(
            f"--nproc {nproc} needs about {nproc * WORKER_GB:.1f} GB ({WORKER_GB} GB per worker) and this "
            f"machine has {available_gb:.1f} GB available; use --nproc {fits} or fewer"
        )
    if cores / nproc < CORES_PER_WORKER_WARNED:
        typer.echo(
            f"warning: --nproc {nproc} workers share {cores} core(s), {cores / nproc:.2f} of a core each: "
            f"steps will be slow and their times mostly waiting; --nproc {cores} or fewer measures the "
            "algorithms",
            err=True,
        )


def _available_gb() -> float | None:
    """The memory the kernel says is available (MemAvailable), or None where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1e6  # kB
    except OSError:
        pass
    return None


def _check_restarts(cfg: TrainConfig) -> None:
    """Under torchrun its agent restarts the workers: --max-restarts must be torchrun's own."""
    from ringtree.processes import under_torchrun

    agent = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    if cfg.max_restarts and under_torchrun() and agent is not None and int(agent) != cfg.max_restarts:
        raise ValueError(
            f"--max-restarts {cfg.max_restarts} but torchrun was started with --max-restarts {agent}: "
            f"torchrun's agent restarts the workers, so pass --max-restarts {cfg.max_restarts} to torchrun"
        )


def _run(cfg: TrainConfig, nproc: int, tracing: bool) -> list[RankResult] | None:
    """Under torchrun: train in this world (rank 0 gathers every rank's result). Otherwise start
    nproc local workers under torch's elastic agent, the one torchrun runs, so that a killed worker
    is restarted (--max-restarts) exactly as on a cluster."""
    from ringtree.processes import default_backend, elastic_spawn, run_under_torchrun, under_torchrun
    from ringtree.train.config import device_type

    backend = default_backend(device_type(cfg))
    if under_torchrun():
        gathered: list[RankResult] | None = run_under_torchrun(
            _train_and_gather, (cfg, tracing), backend=backend, timeout_s=cfg.get("timeout_s")
        )
        return gathered
    from torch.distributed.elastic.multiprocessing import SignalException

    from ringtree.processes import WorkerError
    from ringtree.train.interrupt import shared_step

    with shared_step() as board:
        try:
            results: list[RankResult] = elastic_spawn(
                _train_rank,
                nproc,
                (cfg, tracing),
                max_restarts=cfg.max_restarts,
                backend=backend,
                collective_timeout_s=cfg.get("timeout_s"),
            )
        except (KeyboardInterrupt, SignalException) as e:  # Ctrl-C, or the launcher was killed
            _interrupted(board.read(), cfg, int(getattr(e, "sigval", signal.SIGINT)))
        except WorkerError as e:  # a worker's refusal (exit 2) or its failure before training
            if e.code == 2:
                raise typer.BadParameter(e.message) from None
            typer.echo(f"ringtree train: {e.message}", err=True)
            raise typer.Exit(code=e.code) from None
    return results


def _interrupted(step: int, cfg: TrainConfig, signum: int) -> NoReturn:
    """One line, where the run stopped and what --resume would continue from; exit 128 + signal."""
    from ringtree.train import checkpoint

    found = checkpoint.newest_file(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    last = found if found is not None else "none" if cfg.checkpoint_dir else "none (no --checkpoint-dir)"
    typer.echo(f"\ninterrupted at step {step}; last checkpoint: {last}", err=True)
    raise typer.Exit(code=128 + signum)


def _train_rank(rank: int, cfg: TrainConfig, tracing: bool) -> RankResult:
    from ringtree.train import Trainer

    return Trainer.from_config(cfg, trace=tracing).run()


def _train_and_gather(rank: int, cfg: TrainConfig, tracing: bool) -> list[RankResult] | None:
    """Train this rank of a torchrun world; rank 0 gets every rank's result."""
    import torch.distributed as dist

    mine = _train_rank(rank, cfg, tracing)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every if rank == 0 else None


def _report(
    summary: dict[str, Any], results: list[RankResult], trace: Path | None, json_path: Path | None
) -> None:
    from ringtree.bench import environment
    from ringtree.train import trace as chrome
    from ringtree.train.summary import rows

    print_environment(
        {
            **environment(),
            "backend": summary["backend"],
            "world_size": summary["world_size"],
            "local_world_size": summary["world_size"] // summary["nodes"],
        }
    )
    print_table("ringtree train", ["metric", "value"], rows(summary))
    if json_path is not None:
        write_json(json_path, summary)
        print(f"# wrote the summary to {json_path}")
    if trace is not None:
        chrome.write(trace, [e for r in results for e in r.events], summary["backend"])
        print(f"# wrote the trace to {trace}")


def _register() -> None:
    params = [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
        *(
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
            for name, kind, option in _COMMAND_OPTIONS
        ),
        *_config_parameters(),
    ]
    train.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    app.command()(train)  # its help as every command's (ringtree.cli.help): each option whole


_register()
