"""Activation checkpointing: keep only segment boundaries in forward, recompute the rest in backward."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential


def default_segments(n: int) -> int:
    """About sqrt(n) segments for n blocks: memory ~ n/s + s activations is smallest at s = sqrt(n)."""
    if n < 1:
        raise ValueError(f"need at least one block to checkpoint, got {n}")
    return max(1, round(math.sqrt(n)))


def run_blocks(blocks: nn.Sequential | nn.ModuleList, x: torch.Tensor, segments: int) -> torch.Tensor:
    """x through every block in order; with segments > 0, under torch's checkpoint_sequential.

    segments == 0 runs the blocks plainly. Checkpointing applies only while autograd records
    (training); torch keeps the last segment's activations, since backward needs them at once.
    """
    if segments < 0 or segments > len(blocks):
        raise ValueError(f"segments must be between 0 (off) and the {len(blocks)} blocks, got {segments}")
    if segments == 0 or not torch.is_grad_enabled():
        for block in blocks:
            x = block(x)
        return x
    out: torch.Tensor = checkpoint_sequential(  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        blocks, segments, x, use_reentrant=False
    )
    return out
