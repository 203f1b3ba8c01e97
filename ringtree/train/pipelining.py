"""The trainer's pipeline parts: cutting the model into stages, the stage a runtime runs, bubbles.

Each pipeline (one DP coordinate) cuts the model into pp stages; a stage's parameters are wrapped
in ringtree's DistributedDataParallel over its DP group. Every forward of a run goes under
no_sync(); just before the run's last backward (gpipe, 1f1b: the last micro-batch's) the stage
tells DDP to synchronize, so its buckets overlap that backward as in plain data parallelism.
PipeDream computes gradients on stashed weight copies, outside DDP's hooks: its step callback
all-reduces them with DDP.sync_gradients() (the same buckets, algorithm and compression). The
zero-bubble schedules add their W's gradients outside the hooks too, and synchronize the same way.
The V-shaped ones (zb-v, dualpipev) hold two chunks a rank: a DDP each, or under ZeRO one
ShardedDataParallel around both (`ChunkPair`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtree.parallel import DistributedDataParallel, ShardedDataParallel
from ringtree.parallel.ddp import SyncStats
from ringtree.parallel.pipeline.partition import balance, param_costs, split, time_costs
from ringtree.parallel.pipeline.runtime import MicroBatch
from ringtree.schedules.pipeline import (
    SYNCHRONOUS,
    ZERO_BUBBLE,
    Kind,
    PipelineSchedule,
    build,
    theoretical_bubble_fraction,
)
from ringtree.sim.training.pipeline import StageCosts, replay_pipeline
from ringtree.train.techniques import run_blocks
from ringtree.train.techniques.activation_checkpointing import default_segments


def cut(layers: list[nn.Module], pp: int, by: str, sample: torch.Tensor) -> list[nn.Sequential]:
    """The pp stages; profiled times differ between ranks, so rank 0's cut is used by all."""
    if pp > len(layers):
        raise ValueError(f"--pp {pp} is more stages than the model's {len(layers)} layers; use --pp <= that")
    costs = param_costs(layers) if by == "params" else time_costs(layers, sample)
    sizes: list[Any] = [balance(costs, pp)]
    dist.broadcast_object_list(sizes, src=0)
    return split(layers, list(sizes[0]))


class Stage(nn.Module):
    """What the pipeline runtime runs on this rank: the stage's module under autocast, in DDP.

    `arm(schedule, stage, sync)` before each run: with sync, the run's last backward synchronizes.
    `chunk`: the body is a ChunkPair (or DDP around one) and this stage runs its chunk `chunk`.
    """

    def __init__(self, body: nn.Module, autocast: Any, chunk: int | None = None) -> None:
        super().__init__()
        self.body, self.autocast = body, autocast  # body: the stage's module, or DDP around it
        self._calls, self._sync_at = 0, -1
        self.kwargs = {} if chunk is None else {"chunk": chunk}

    def arm(self, schedule: PipelineSchedule, stage: int, sync: bool, chunk: int = 0) -> None:
        """Count this run's forwards from 0; mark the micro-batch whose backward comes last."""
        self._calls = 0
        backwards = [
            a.micro_batch for a in schedule.actions[stage] if a.kind is Kind.BACKWARD and a.chunk == chunk
        ]
        hooked = schedule.name in SYNCHRONOUS and not schedule.splits_backward  # W: outside the hooks
        self._sync_at = backwards[-1] if sync and hooked and backwards else -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i, self._calls = self._calls, self._calls + 1
        ddp = self.body if isinstance(self.body, DistributedDataParallel | ShardedDataParallel) else None
        ctx: AbstractContextManager[Any] = self.autocast()
        with ctx:
            if ddp is None:
                return self.body(x, **self.kwargs)  # type: ignore[no-any-return]
            with ddp.no_sync():
                out: torch.Tensor = ddp(x, **self.kwargs)
        if i == self._sync_at:  # synchronous schedules run forwards in micro-batch order
            out = _SyncBeforeBackward.apply(out, ddp)  # type: ignore[no-untyped-call]
        return out


class Chunks(nn.Module):
    """Interleaved 1F1B: this rank's chunks, each a Stage (in DDP without overlap: the step
    synchronizes them one after another, see ChunkDDPs, so no two DDPs talk on the group at once)."""

    def __init__(self, stages: list[Stage]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(stages)

    def arm(self, schedule: PipelineSchedule, stage: int, sync: bool) -> None:
        for c, chunk in enumerate(self.chunks):
            assert isinstance(chunk, Stage)
            chunk.arm(schedule, stage, sync=False, chunk=c)


class ChunkPair(nn.Module):
    """The V placement's two chunks of one rank as one module (one ZeRO wrapper for both):
    forward(x, chunk) runs chunk `chunk`."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def forward(self, x: torch.Tensor, chunk: int) -> torch.Tensor:
        return self.chunks[chunk](x)  # type: ignore[no-any-return]


def syncs_at_step(schedule: str) -> bool:
    """Whether a schedule's gradients reach DDP outside its hooks, so the step synchronizes them."""
    return schedule not in SYNCHRONOUS or schedule in ZERO_BUBBLE


class ChunkDDPs:
    """The DDPs of a rank's chunks, synchronized in chunk order; their costs added up."""

    def __init__(self, ddps: list[DistributedDataParallel]) -> None:
        self.ddps = ddps
        self.last_sync = SyncStats()

    def sync_gradients(self) -> None:
        for ddp in self.ddps:
            ddp.sync_gradients()
        stats = [d.last_sync for d in self.ddps]
        self.last_sync = SyncStats(
            sum(s.comm_time_s for s in stats),
            sum(s.exposed_s for s in stats),
            [span for s in stats for span in s.spans],
        )

    def close(self) -> None:
        for ddp in self.ddps:
            ddp.close()


class _Layers(nn.Module):
    """A stage's layers run through run_blocks (activation checkpointing when segments > 0)."""

    def __init__(self, layers: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.layers = layers
        self.segments = min(segments, len(layers)) if segments else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_blocks(self.layers, x, self.segments)


def checkpointed(layers: nn.Sequential, segments: int, enabled: bool) -> tuple[nn.Module, int]:
    """The stage's module and its checkpoint segments (0: off; `segments` 0 means about sqrt(n))."""
    if not enabled:
        return layers, 0
    chosen = min(segments or default_segments(len(layers)), len(layers))
    return _Layers(layers, chosen), chosen


class _SyncBeforeBackward(torch.autograd.Function):
    """Identity whose backward (the first step of a stage's backward) makes DDP synchronize."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, ddp: DistributedDataParallel | ShardedDataParallel
    ) -> torch.Tensor:
        ctx.ddp = ddp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.ddp.sync_next_backward()
        return grad, None


def runs(loader: Any, schedule: str, micro_batches: int) -> Iterator[list[MicroBatch]]:
    """Synchronous schedules: each batch cut into micro-batches; pipedream: the whole epoch at once."""
    if schedule in SYNCHRONOUS:
        for x, y in loader:
            cuts = zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches), strict=True)
            yield [(a, b) for a, b in cuts if len(b)]  # a short last batch may leave some empty
        return
    yield [(x, y) for x, y in loader]


def measured_bubble(windows: torch.Tensor) -> float:
    """1 - busy / (p x makespan) per run, averaged over runs after the first (warm-up) one.

    windows: [p, runs, 3] of (start, end, busy seconds) per stage and run.
    """
    p = windows.shape[0]
    makespan = windows[:, :, 1].max(dim=0).values - windows[:, :, 0].min(dim=0).values  # [runs]
    bubble = 1.0 - windows[:, :, 2].sum(dim=0) / (p * makespan)
    kept = bubble[1:] if len(bubble) > 1 else bubble
    return float(kept.mean())


def theoretical_bubble(schedule: str, p: int, m: int, v: int) -> float:
    """The schedule's bubble with equal stages and free transfers: (p-1)/(v m+p-1) for GPipe, 1F1B
    and interleaved; the zero-bubble ones replayed with F, B and W of equal time (ZB-H1: (p-1)/(3m+p-1))."""
    if schedule not in ZERO_BUBBLE:
        return theoretical_bubble_fraction(p, m, v)
    costs = StageCosts.uniform(p, 1.0, 2.0, weight_s=(1.0,) * p)  # type: ignore[arg-type]
    return replay_pipeline(build(schedule, p, m, v), costs).bubble_fraction


def gather_stages(stages: list[nn.Sequential], mine: int, group: dist.ProcessGroup) -> None:
    """Every rank of a pipeline loads every stage's weights, so that its whole model is the trained one."""
    states: list[Any] = [None] * len(stages)
    dist.all_gather_object(states, {k: v.cpu() for k, v in stages[mine].state_dict().items()}, group=group)
    for j, (stage, state) in enumerate(zip(stages, states, strict=True)):
        if j != mine:
            stage.load_state_dict(state)
