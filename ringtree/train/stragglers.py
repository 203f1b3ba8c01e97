"""Stragglers: ranks whose own work is persistently slower than the median rank's.

A synchronous step takes as long as its slowest rank on every rank (the others wait for it in
the gradient all-reduce), so the step time cannot tell who is slow. Each rank instead times its
own work (forward and backward, before it waits for the others) and every `every` steps the
ranks all-gather the mean of that window: one float per rank, a negligible cost. A rank slower
than the median by more than `threshold` in `patience` windows in a row is a straggler: rank 0
warns once, and the summary lists every straggler with its slowdown.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

EVERY = 20  # steps between gathers: a gather costs about one small all-reduce
THRESHOLD = 0.25  # 25% slower than the median: beyond the jitter of a shared machine
PATIENCE = 2  # windows in a row, so one hiccup (a checkpoint, a page fault) is not blamed


@dataclass
class StragglerMonitor:
    """Times each rank's work and names the ranks that lag (see the module docstring)."""

    group: dist.ProcessGroup | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # cuda under NCCL
    every: int = EVERY
    threshold: float = THRESHOLD
    patience: int = PATIENCE
    warn: Callable[[str], None] = field(default=lambda text: print(text, file=sys.stderr, flush=True))
    stragglers: dict[int, dict[str, float]] = field(default_factory=dict)
    _window: list[float] = field(default_factory=list)
    _strikes: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.every < 1 or self.threshold <= 0 or self.patience < 1:
            raise ValueError(
                f"straggler detection needs every >= 1, threshold > 0 and patience >= 1; got "
                f"every={self.every}, threshold={self.threshold}, patience={self.patience}"
            )

    def step(self, work_s: float) -> None:
        """Add one step's own-work seconds; every `every` steps, gather and judge (collective)."""
        self._window.append(work_s)
        if len(self._window) >= self.every:
            self.judge(self._gather(statistics.fmean(self._window)))
            self._window.clear()

    def judge(self, means: list[float]) -> list[int]:
        """Update the strikes from one window's per-rank means; return the ranks newly named."""
        median = statistics.median(means)
        named = []
        for rank, mean in enumerate(means):
            slow = median > 0 and mean > (1 + self.threshold) * median
            self._strikes[rank] = self._strikes.get(rank, 0) + 1 if slow else 0
            if self._strikes[rank] < self.patience:
                continue
            if rank not in self.stragglers:
                named.append(rank)
            self.stragglers[rank] = {
                "rank": rank,
                "slowdown": mean / median,
                "step_s": mean,
                "median_s": median,
            }
        if named and _rank(self.group) == 0:
            for rank in named:
                s = self.stragglers[rank]
                self.warn(
                    f"ringtree: rank {rank} is a straggler: its own work takes {s['slowdown']:.2f}x the "
                    f"median rank's ({s['step_s'] * 1e3:.1f} ms vs {s['median_s'] * 1e3:.1f} ms per step) "
                    f"over {self.patience} windows of {self.every} steps; every step waits for it"
                )
        return named

    def summary(self) -> list[dict[str, float]]:
        """The stragglers, slowest first (the summary's `stragglers`)."""
        return sorted(self.stragglers.values(), key=lambda s: -s["slowdown"])

    def _gather(self, mean: float) -> list[float]:
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return [mean]
        mine = torch.tensor([mean], dtype=torch.float64, device=self.device)
        every = torch.empty(dist.get_world_size(self.group), dtype=torch.float64, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13
        gather(every, mine, group=self.group)
        return [float(v) for v in every.tolist()]


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0
