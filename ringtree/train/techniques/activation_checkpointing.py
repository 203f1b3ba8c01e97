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


def enable_checkpointing(model: nn.Module, segments: int = 0) -> int:
    """Make `model` checkpoint its blocks in `segments` segments (0: about sqrt(n)); the number used.

    The model holds its blocks as `blocks` (a transformer's nn.ModuleList) or `layers` (an
    nn.Sequential) and runs them with run_blocks(..., self.checkpoint_segments).
    """
    blocks = getattr(model, "blocks", getattr(model, "layers", None))
    if not isinstance(blocks, nn.Sequential | nn.ModuleList) or not hasattr(model, "checkpoint_segments"):
        raise ValueError(
            f"{type(model).__name__} has no `blocks` or `layers` run through run_blocks; "
            "activation checkpointing supports ringtree's mlp and vit models"
        )
    chosen = segments or default_segments(len(blocks))
    if chosen > len(blocks):
        raise ValueError(f"checkpoint segments={segments} exceeds the model's {len(blocks)} blocks")
    setattr(model, "checkpoint_segments", chosen)  # noqa: B010  # nn.Module types attributes as tensors
    return chosen
