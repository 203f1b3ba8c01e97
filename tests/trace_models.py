"""A model for the profiled-run tests: the digits MLP with one rank made slow before each step's
all-reduce (`--model trace_models:slow_rank_mlp`, the tests' folder on the path).
RINGTREE_TEST_SLOW_RANK=R:SECONDS:STEPS makes rank R sleep SECONDS in each forward of its first
STEPS steps (one forward a step: no accumulation), so its peers wait for it in those steps and
not after; unset, no rank sleeps."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class _Sleep(nn.Module):
    def __init__(self, rank: int, seconds: float, steps: int) -> None:
        super().__init__()
        self.rank, self.seconds, self.steps, self.calls = rank, seconds, steps, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and dist.is_initialized() and dist.get_rank() == self.rank:
            self.calls += 1
            if self.calls <= self.steps:
                time.sleep(self.seconds)
        return x


def slow_rank_mlp(cfg: Any = None) -> nn.Module:
    rank, seconds, steps = (os.environ.get("RINGTREE_TEST_SLOW_RANK") or "-1:0:0").split(":")
    sleep = _Sleep(int(rank), float(seconds), int(steps))
    return nn.Sequential(sleep, nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
