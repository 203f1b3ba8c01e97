"""Evaluation on a held-out split: mean loss, and accuracy when the targets are class indices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

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
    n, classes = 0, True
    for x, y in DataLoader(test_set, batch_size=batch):
        out = net(x.to(device)).float()
        y = y.to(device)
        loss_sum += loss_fn(out, y).float() * len(y)
        n += len(y)
        if out.dim() == 2 and y.dim() == 1 and not y.is_floating_point():
            correct += (out.argmax(dim=1) == y).sum()
        else:
            classes = False
    net.train()
    if not n:
        return None, None
    return (float(correct) / n if classes else None), float(loss_sum) / n
