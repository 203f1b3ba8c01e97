"""Evaluation on a held-out split: mean loss, and accuracy when the targets are class (or token) indices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

IGNORE = -100  # a target the loss and the accuracy skip (F.cross_entropy's ignore_index)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def evaluate(
    net: nn.Module, test_set: Dataset[Any] | None, loss_fn: LossFn, device: torch.device, batch: int = 512
) -> tuple[float | None, float | None]:
    """(accuracy as a fraction of 1, or None for non-class targets; mean loss) on the test split."""
    if test_set is None:
        return None, None
    net.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    n, classes, tokens = 0, True, 0  # tokens: scored next tokens (sequence targets), else 0
    for x, y in DataLoader(test_set, batch_size=batch):
        out = net(x.to(device)).float()
        y = y.to(device)
        loss_sum += loss_fn(out, y).float() * len(y)
        n += len(y)
        if out.dim() == 2 and y.dim() == 1 and not y.is_floating_point():
            correct += (out.argmax(dim=1) == y).sum()
        elif out.dim() == y.dim() + 1 and not y.is_floating_point():  # next tokens: [b, t, V] and [b, t]
            scored = y != IGNORE
            correct += ((out.argmax(dim=-1) == y) & scored).sum()
            tokens += int(scored.sum())
        else:
            classes = False
    net.train()
    if not n:
        return None, None
    return (float(correct) / (tokens or n) if classes else None), float(loss_sum) / n
