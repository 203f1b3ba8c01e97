"""The training loop of `ringtree train`: the seeds' data-parallel flow on the digits.

Every rank holds the model; torch's DistributedSampler hands each rank its share of every
epoch; forward and backward run locally; DistributedDataParallel (or the master-rank dp mode)
averages the gradients; every rank steps torch's AdamW. Rank 0 shows progress, writes the
checkpoints, and every rank returns its summary and trace events.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ringtree.parallel import DistributedDataParallel, MasterDataParallel
from ringtree.parallel.launcher import Span
from ringtree.train import checkpoint, tensor_parallel
from ringtree.train.config import TrainConfig
from ringtree.train.data import digits
from ringtree.train.metrics import Meter
from ringtree.train.models import build_model
from ringtree.train.progress import ProgressBar
from ringtree.train.techniques import (
    MixedPrecision,
    PrefetchLoader,
    distillation_loss,
    enable_checkpointing,
    load_teacher,
)
from ringtree.train.techniques.amp import all_finite
from ringtree.train.trace import Event, Recorder

Batch = list[torch.Tensor]  # [inputs [b, 64], labels [b]]
Wrapped = DistributedDataParallel | MasterDataParallel


@dataclass
class RankResult:
    """What one rank returns: the run's summary (the same numbers on every rank) and its spans."""

    rank: int
    summary: dict[str, Any]
    events: list[Event] = field(default_factory=list)


@dataclass
class Run:
    """The state of one rank's training run."""

    cfg: TrainConfig
    rank: int
    net: nn.Module
    model: Wrapped
    optimizer: torch.optim.Optimizer
    sampler: DistributedSampler[Any]
    loader: DataLoader[Any] | PrefetchLoader
    recorder: Recorder
    amp: MixedPrecision
    teacher: nn.Module | None = None  # distil from it when set
    step: int = 0
    meter: Meter = field(default_factory=Meter)
    last_loss: float = float("nan")

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.loader) / self.cfg.accumulate)


def train(rank: int, cfg: TrainConfig, trace: bool = False) -> RankResult:
    """Train on the current process group (this process is `rank`); every rank returns its result."""
    train_set, test_set = digits()
    run = _setup(rank, cfg, train_set, trace)
    resumed_from = _resume(run)
    total = cfg.epochs * run.steps_per_epoch
    description = f"{cfg.model} x {dist.get_world_size()} ranks ({cfg.mode}, {cfg.algorithm})"
    with ProgressBar(rank == 0 and cfg.progress, total, description) as bar:
        for epoch in range(run.step // run.steps_per_epoch, cfg.epochs):
            _epoch(run, epoch, bar)
    accuracy, test_loss = evaluate(run.net, test_set)
    summary = _summary(run, accuracy, test_loss, resumed_from)
    if isinstance(run.model, DistributedDataParallel):
        run.model.close()
    return RankResult(rank, summary, run.recorder.events)


def _setup(rank: int, cfg: TrainConfig, train_set: TensorDataset, trace: bool) -> Run:
    teacher = None if cfg.teacher is None else load_teacher(cfg.teacher, build_model)[0]
    torch.manual_seed(cfg.seed)
    net = build_model(cfg.model)
    mesh = tensor_parallel.setup(net, cfg.tp, cfg.algorithm)  # None without --tp
    if cfg.checkpoint_activations:
        enable_checkpointing(net, cfg.checkpoint_segments)
    model: Wrapped
    if cfg.mode == "dp":
        model = MasterDataParallel(net, cfg.algorithm, timeout_s=cfg.timeout_s)
    else:
        model = DistributedDataParallel(
            net,
            bucket_cap_mb=cfg.bucket_mb,
            algorithm=cfg.algorithm,
            compression=cfg.compression,
            overlap=cfg.overlap,
            timeout_s=cfg.timeout_s,
            process_group=None if mesh is None else mesh.dp_group,
        )
    optimizer = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sampler: DistributedSampler[Any] = tensor_parallel.sampler(train_set, mesh, cfg.seed)
    batches = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler)
    loader = PrefetchLoader(batches) if cfg.prefetch else batches
    amp = MixedPrecision(cfg.amp)
    return Run(cfg, rank, net, model, optimizer, sampler, loader, Recorder(rank, enabled=trace), amp, teacher)


def _resume(run: Run) -> int | None:
    """Load checkpoint_dir/last.pt when --resume asks for it; the step it continues from."""
    if not run.cfg.resume or run.cfg.checkpoint_dir is None:
        return None
    state = checkpoint.load(run.cfg.checkpoint_dir)
    if state is None:
        if run.rank == 0:
            print(f"# no checkpoint in {run.cfg.checkpoint_dir} yet: starting from step 0")
        return None
    if state["model_name"] != run.cfg.model:
        raise ValueError(
            f"the checkpoint in {run.cfg.checkpoint_dir} holds model {state['model_name']!r}, not "
            f"{run.cfg.model!r}; pass --model {state['model_name']} or another --checkpoint-dir"
        )
    tensor_parallel.load(run.net, run.optimizer, run.cfg.model, state)
    run.step = int(state["step"])
    return run.step


def _epoch(run: Run, epoch: int, bar: ProgressBar) -> None:
    run.sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
    first = epoch * run.steps_per_epoch
    for j, chunk in enumerate(_chunks(run.loader, run.cfg.accumulate)):
        if first + j < run.step:
            continue  # done before the checkpoint we resumed from
        _step(run, chunk)
        run.step += 1
        bar.update(run.step, run.last_loss, run.meter.rate())
        every = run.cfg.checkpoint_every
        if every and run.step % every == 0:
            _save(run)
    if not run.cfg.checkpoint_every:
        _save(run)


def _chunks(loader: Iterable[Batch], k: int) -> Iterator[list[Batch]]:
    """The loader's batches in groups of k (one optimizer step each; the last group may be short)."""
    group: list[Batch] = []
    for batch in loader:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []
    if group:
        yield group


def _step(run: Run, chunk: Sequence[Batch]) -> None:
    """One optimizer step: forward and backward of every micro-batch, the last one synchronizing."""
    start = time.perf_counter()
    run.optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for i, (x, y) in enumerate(chunk):
        sync: AbstractContextManager[None] = nullcontext() if i == len(chunk) - 1 else run.model.no_sync()
        with sync:
            with run.recorder.span("forward", micro_batch=i), run.amp.autocast():
                loss = _loss(run, x, y) / len(chunk)  # the mean over the K micro-batches' samples
            with run.recorder.span("backward", micro_batch=i):
                run.amp.backward(loss)
        loss_sum += float(loss.detach())
    with run.recorder.span("optimizer", step=run.step):
        _optimizer_step(run)
    elapsed = time.perf_counter() - start
    comm_s, exposed_s, spans = _comm_of(run.model)
    for s in spans:
        run.recorder.add(s.name, s.start, s.end, "comm", bytes=s.nbytes, algorithm=run.cfg.algorithm)
    samples = sum(len(y) for _, y in chunk) * run.sampler.num_replicas  # the DP ranks' samples
    run.meter.add(elapsed, comm_s, exposed_s, samples)
    run.last_loss = loss_sum


def _loss(run: Run, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the labels, or the distillation loss when there is a teacher (in fp32)."""
    logits = run.model(x).float()
    if run.teacher is None:
        return F.cross_entropy(logits, y)
    with torch.no_grad():
        soft = run.teacher(x).float()
    return distillation_loss(logits, soft, y, run.cfg.distill_temperature, run.cfg.distill_alpha)


def _optimizer_step(run: Run) -> None:
    """Step (rank 0 alone in dp mode); under amp, every rank skips a step whose gradients are not finite."""
    finite = True if run.cfg.amp == "off" else _finite_on_every_rank(run.net)
    if isinstance(run.model, MasterDataParallel):
        if finite:
            run.model.step(run.optimizer)
        else:
            run.amp.skipped_steps += 1
    else:
        run.amp.step(run.optimizer, finite)


def _finite_on_every_rank(net: nn.Module) -> bool:
    """One flag all-reduced with MIN: the ranks agree (in dp mode each sees only its own gradients)."""
    flag = torch.tensor([1.0 if all_finite(net.parameters()) else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


@dataclass(frozen=True)
class _Named:
    name: str
    start: float
    end: float
    nbytes: int


def _comm_of(model: Wrapped) -> tuple[float, float, list[_Named]]:
    """The last step's communication time, the part of it exposed, and its spans."""
    if isinstance(model, MasterDataParallel):
        names = ("reduce", "broadcast")
        spans = [_Named(n, s.start, s.end, s.nbytes) for n, s in zip(names, model.last_comm, strict=True)]
        comm_s = sum(s.end - s.start for s in spans)
        return comm_s, comm_s, spans  # nothing overlaps the master's reduce and broadcast
    stats = model.last_sync
    return stats.comm_time_s, stats.exposed_s, [_bucket(s) for s in stats.spans]


def _bucket(s: Span) -> _Named:
    return _Named(f"all_reduce bucket {s.bucket}", s.start, s.end, s.nbytes)


def _save(run: Run) -> None:
    if run.cfg.checkpoint_dir is None:
        return
    model = tensor_parallel.model_state(run.net, run.cfg.model)  # dense: --tp N resumes at any N
    optimizer = tensor_parallel.optimizer_state(run.net, run.optimizer)
    if run.rank == 0:
        state = {"step": run.step, "model_name": run.cfg.model, "model": model, "optimizer": optimizer}
        checkpoint.save(run.cfg.checkpoint_dir, state)
    dist.barrier()  # no rank runs ahead of a checkpoint that may still be written


@torch.no_grad()
def evaluate(net: nn.Module, test_set: TensorDataset) -> tuple[float, float]:
    """(accuracy as a fraction of 1, mean cross-entropy) on the held-out split."""
    x, y = test_set.tensors
    net.eval()
    logits = net(x)
    net.train()
    return float((logits.argmax(dim=1) == y).float().mean()), float(F.cross_entropy(logits, y))


def _summary(run: Run, accuracy: float, test_loss: float, resumed_from: int | None) -> dict[str, Any]:
    cfg = run.cfg
    return {
        "accuracy": accuracy,
        "test_loss": test_loss,
        "train_loss": run.last_loss,
        **run.meter.slowest_rank_means(),
        "predicted_step_time_s": None,
        "world_size": dist.get_world_size(),
        "nodes": dist.get_world_size() // int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
        "mode": cfg.mode,
        "algorithm": cfg.algorithm,
        "model": cfg.model,
        "parameters": sum(p.numel() for p in run.net.parameters()),
        "compression": cfg.compression,
        "bucket_mb": cfg.bucket_mb,
        "overlap": cfg.overlap,
        "batch_size": cfg.batch_size,
        "accumulate": cfg.accumulate,
        "steps": run.step,
        "resumed_from_step": resumed_from,
        "amp": cfg.amp,
        "skipped_steps": run.amp.skipped_steps,
        "checkpoint_segments": getattr(run.net, "checkpoint_segments", 0),
        "distilled_from": cfg.teacher,
    }
