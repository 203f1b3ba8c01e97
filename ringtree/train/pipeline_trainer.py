"""`ringtree train --pp N`: pipeline-parallel training on the digits, combined with data parallelism.

The world is a Mesh(dp, pp): each pipeline (one dp rank) cuts the model into pp stages and streams
micro-batches through them with the chosen schedule; each stage's gradients are averaged across
its dp group before the optimizer steps. gpipe and 1f1b step once per `micro_batches` micro-batches;
pipedream streams a whole epoch without a flush and steps after every micro-batch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ringtree import comm
from ringtree.parallel.mesh import Mesh
from ringtree.parallel.pipeline.partition import balance, param_costs, split, time_costs
from ringtree.parallel.pipeline.runtime import MicroBatch, PipelineStage, StageRun
from ringtree.schedules.pipeline import SYNCHRONOUS, build, theoretical_bubble_fraction
from ringtree.train.config import TrainConfig
from ringtree.train.data import digits
from ringtree.train.metrics import SUMMARY_KEYS, Meter
from ringtree.train.models import build_model
from ringtree.train.progress import ProgressBar
from ringtree.train.stages import model_layers
from ringtree.train.trace import Recorder
from ringtree.train.trainer import RankResult, evaluate

# The summary keys a pipeline run adds to the data-parallel trainer's (SUMMARY_KEYS).
PIPELINE_KEYS = (
    "dp",
    "pp",
    "schedule",
    "micro_batches",
    "bubble_fraction",
    "theoretical_bubble_fraction",
    "peak_activation_bytes_per_stage",
    "weight_versions_per_stage",
)


@dataclass
class _Pipe:
    """One rank's pipeline training state."""

    cfg: TrainConfig
    mesh: Mesh
    net: nn.Module
    stages: list[nn.Sequential]
    runner: PipelineStage
    optimizer: torch.optim.Optimizer | None  # None for a stage without parameters
    recorder: Recorder
    meter: Meter = field(default_factory=Meter)
    windows: list[list[float]] = field(default_factory=list)  # per run: [start, end, busy] (wall clock)
    peak_activation_bytes: int = 0
    peak_versions: int = 1
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    comm_s: float = 0.0
    micro_batches_per_run: int = 1


def train_pipeline(rank: int, cfg: TrainConfig, trace: bool = False) -> RankResult:
    """Train with cfg.pp stages per pipeline on the current process group; every rank returns its result."""
    _check_supported(cfg)
    train_set, test_set = digits()
    pipe = _setup(rank, cfg, train_set, trace)
    sampler: DistributedSampler[Any] = DistributedSampler(
        train_set, num_replicas=pipe.mesh.dp, rank=pipe.mesh.dp_rank, shuffle=True, seed=cfg.seed
    )
    per_step = cfg.batch_size * (1 if cfg.schedule not in SYNCHRONOUS else cfg.micro_batches)
    loader = DataLoader(train_set, batch_size=per_step, sampler=sampler)
    total = cfg.epochs * (len(loader) if cfg.schedule in SYNCHRONOUS else 1)
    description = f"{cfg.model}, dp {pipe.mesh.dp} x pp {cfg.pp} ({cfg.schedule})"
    with ProgressBar(rank == 0 and cfg.progress, total, description) as bar:
        for epoch in range(cfg.epochs):
            sampler.set_epoch(epoch)
            for micro_batches in _runs(loader, cfg):
                _run(pipe, micro_batches)
                bar.update(
                    len(pipe.windows), pipe.losses[-1] if pipe.losses else float("nan"), pipe.meter.rate()
                )
    _gather_weights(pipe)
    accuracy, test_loss = evaluate(pipe.net, test_set)
    return RankResult(rank, _summary(pipe, accuracy, test_loss), pipe.recorder.events)


def _check_supported(cfg: TrainConfig) -> None:
    """Options of the data-parallel trainer that the pipeline trainer does not offer raise, naming them."""
    unsupported = {
        "--mode dp": cfg.mode != "ddp",
        "--accumulate (use --micro-batches)": cfg.accumulate != 1,
        "--compression": cfg.compression is not None,
        "--checkpoint-dir/--resume": cfg.checkpoint_dir is not None,
    }
    named = [name for name, given in unsupported.items() if given]
    if named:
        raise ValueError(f"--pp {cfg.pp} does not combine with {', '.join(named)}; drop them or use --pp 1")


def _setup(rank: int, cfg: TrainConfig, train_set: TensorDataset, trace: bool) -> _Pipe:
    mesh = Mesh(pp=cfg.pp)
    torch.manual_seed(cfg.seed)  # every rank builds the same model and keeps its stage
    net = build_model(cfg.model)
    layers = model_layers(net)
    if cfg.pp > len(layers):
        raise ValueError(
            f"--pp {cfg.pp} is more stages than the {len(layers)} layers of {cfg.model}; use --pp at most "
            f"{len(layers)}"
        )
    sizes = _stage_sizes(layers, cfg, train_set.tensors[0][: cfg.batch_size])
    stages = split(layers, sizes)
    stage = stages[mesh.pp_rank]
    params = list(stage.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay) if params else None
    runner = PipelineStage(stage, mesh.pp_rank, mesh.pp_ranks, cfg.timeout_s)
    return _Pipe(cfg, mesh, net, stages, runner, optimizer, Recorder(rank, enabled=trace))


def _stage_sizes(layers: list[nn.Module], cfg: TrainConfig, sample: torch.Tensor) -> list[int]:
    """Layers per stage; profiled times differ between ranks, so rank 0's cut is used by all."""
    costs = param_costs(layers) if cfg.pp_balance == "params" else time_costs(layers, sample)
    sizes: list[Any] = [balance(costs, cfg.pp)]
    dist.broadcast_object_list(sizes, src=0)
    return list(sizes[0])


def _runs(loader: DataLoader[Any], cfg: TrainConfig) -> Iterator[list[MicroBatch]]:
    """Synchronous schedules: each batch cut into micro-batches; pipedream: the whole epoch at once."""
    if cfg.schedule in SYNCHRONOUS:
        for x, y in loader:
            yield list(zip(x.tensor_split(cfg.micro_batches), y.tensor_split(cfg.micro_batches), strict=True))
        return
    yield [(x, y) for x, y in loader]


def _run(pipe: _Pipe, micro_batches: list[MicroBatch]) -> None:
    """One run of the schedule over the micro-batches (one optimizer step for gpipe and 1f1b)."""
    micro_batches = [(x, y) for x, y in micro_batches if len(y)]  # a short last batch may leave some empty
    schedule = build(pipe.cfg.schedule, pipe.cfg.pp, len(micro_batches))
    pipe.micro_batches_per_run = max(pipe.micro_batches_per_run, len(micro_batches))
    if pipe.optimizer is not None:
        pipe.optimizer.zero_grad(set_to_none=True)
    comm_before, start = pipe.comm_s, time.perf_counter()
    result = pipe.runner.run(schedule, micro_batches, step=lambda: _step(pipe))
    elapsed = time.perf_counter() - start
    comm_s = pipe.comm_s - comm_before
    samples = sum(len(y) for _, y in micro_batches) * pipe.mesh.dp
    pipe.meter.add(elapsed, comm_s, comm_s, samples)
    _record(pipe, result)


def _step(pipe: _Pipe) -> None:
    """Average this stage's gradients over its dp group, then step the optimizer."""
    if pipe.optimizer is None:
        return
    if pipe.mesh.dp > 1:
        start = time.perf_counter()
        params = [p for p in pipe.runner.module.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
        comm.all_reduce(flat, "avg", pipe.cfg.algorithm, pipe.mesh.dp_group, timeout_s=pipe.cfg.timeout_s)
        offset = 0
        for p in params:
            assert p.grad is not None
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        pipe.comm_s += time.perf_counter() - start
        pipe.recorder.add("all_reduce grads", start, time.perf_counter(), "comm", stage=pipe.mesh.pp_rank)
    pipe.optimizer.step()
    pipe.steps += 1


def _record(pipe: _Pipe, result: StageRun) -> None:
    """Trace spans, the run's [start, end, busy] window, the memory and version peaks, the losses."""
    work = [s for s in result.spans if s.kind != "step"]
    for s in result.spans:
        pipe.recorder.add(s.kind, s.start, s.end, micro_batch=s.micro_batch, stage=pipe.mesh.pp_rank)
    offset = time.time() - time.perf_counter()  # wall clock: comparable across the host's processes
    busy = sum(s.end - s.start for s in work)
    pipe.windows.append([work[0].start + offset, work[-1].end + offset, busy])
    pipe.peak_activation_bytes = max(pipe.peak_activation_bytes, result.peak_activation_bytes)
    pipe.peak_versions = max(pipe.peak_versions, result.peak_versions)
    pipe.losses += result.losses


def _gather_weights(pipe: _Pipe) -> None:
    """Every rank loads every stage's weights of its pipeline, so that `net` is the trained model."""
    states: list[Any] = [None] * pipe.cfg.pp
    dist.all_gather_object(states, pipe.stages[pipe.mesh.pp_rank].state_dict(), group=pipe.mesh.pp_group)
    for stage, state in zip(pipe.stages, states, strict=True):
        stage.load_state_dict(state)


def measured_bubble(windows: torch.Tensor) -> float:
    """1 - busy / (p x makespan) per run, averaged over runs after the first (warm-up) one.

    windows: [p, runs, 3] of (start, end, busy seconds) per stage and run.
    """
    p = windows.shape[0]
    makespan = windows[:, :, 1].max(dim=0).values - windows[:, :, 0].min(dim=0).values  # [runs]
    bubble = 1.0 - windows[:, :, 2].sum(dim=0) / (p * makespan)
    kept = bubble[1:] if len(bubble) > 1 else bubble
    return float(kept.mean())


def _summary(pipe: _Pipe, accuracy: float, test_loss: float) -> dict[str, Any]:
    cfg, mesh = pipe.cfg, pipe.mesh
    mine = torch.tensor(pipe.windows, dtype=torch.float64)  # [runs, 3]
    every = [torch.empty_like(mine) for _ in range(cfg.pp)]
    dist.all_gather(every, mine, group=mesh.pp_group)
    peaks = torch.tensor([float(pipe.peak_activation_bytes), float(pipe.peak_versions)], dtype=torch.float64)
    per_stage = [torch.empty_like(peaks) for _ in range(cfg.pp)]
    dist.all_gather(per_stage, peaks, group=mesh.pp_group)
    losses: list[Any] = [pipe.losses[-1] if pipe.losses else None]
    dist.broadcast_object_list(losses, src=mesh.pp_ranks[-1], group=mesh.pp_group)
    summary: dict[str, Any] = dict.fromkeys(SUMMARY_KEYS)  # keys of techniques this trainer lacks: null
    return summary | {
        "accuracy": accuracy,
        "test_loss": test_loss,
        "train_loss": losses[0],
        **pipe.meter.slowest_rank_means(),
        "predicted_step_time_s": None,
        "world_size": dist.get_world_size(),
        "nodes": dist.get_world_size() // int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
        "mode": "ddp" if mesh.dp > 1 else "pp",
        "algorithm": cfg.algorithm,
        "model": cfg.model,
        "parameters": sum(p.numel() for p in pipe.net.parameters()),
        "compression": None,
        "bucket_mb": cfg.bucket_mb,
        "overlap": False,
        "batch_size": cfg.batch_size,
        "accumulate": cfg.accumulate,
        "steps": pipe.steps,
        "resumed_from_step": None,
        "dp": mesh.dp,
        "pp": cfg.pp,
        "schedule": cfg.schedule,
        "micro_batches": cfg.micro_batches,
        "bubble_fraction": measured_bubble(torch.stack(every)),
        "theoretical_bubble_fraction": theoretical_bubble_fraction(cfg.pp, pipe.micro_batches_per_run),
        "peak_activation_bytes_per_stage": [int(t[0]) for t in per_stage],
        "weight_versions_per_stage": [int(t[1]) for t in per_stage],
    }
