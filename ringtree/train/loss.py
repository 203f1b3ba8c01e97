"""The loss a training step backpropagates: the user's loss_fn, plus distillation's soft term.

The same object serves the replica step and the pipeline's last stage (the runtime calls it with
the stage's output and the targets). Its running sums stay on the device; the trainer reads them
once per log interval and at the end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch
from torch import nn

from ringtree.train.config import TrainConfig
from ringtree.train.factories import LossFn
from ringtree.train.techniques import MixedPrecision
from ringtree.train.techniques.distill import soft_loss


class TrainingLoss:
    """loss_fn on the last stage (distillation's soft term added with a teacher), sums kept on device."""

    def __init__(self, fn: LossFn, cfg: TrainConfig, teacher: nn.Module | None, amp: MixedPrecision) -> None:
        self.fn, self.cfg, self.teacher, self.amp = fn, cfg, teacher, amp
        self.soft: deque[torch.Tensor] = deque()  # teacher logits of the micro-batches to come, in order
        self.weight = 1.0  # 1 / accumulated pipeline runs
        self.total: torch.Tensor | None = None  # sum of per-sample losses since reset()
        self.count = 0

    def reset(self) -> None:
        self.total, self.count = None, 0

    def prepare(self, inputs: Iterable[torch.Tensor]) -> None:
        """Queue the teacher's outputs for these micro-batches (the loss has only the outputs)."""
        if self.teacher is None:
            return
        with torch.no_grad(), self.amp.autocast():
            self.soft.extend(self.teacher(x).float() for x in inputs)

    def record(self, loss: torch.Tensor, samples: int) -> None:
        """Count a mean loss computed elsewhere (the threaded DataParallel computes its own)."""
        weighted = loss.detach() * samples
        self.total = weighted if self.total is None else self.total + weighted
        self.count += samples

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = out.float()
        loss = self.fn(out, target)
        if self.teacher is not None:
            alpha = self.cfg.get("distill_alpha")
            soft = soft_loss(out, self.soft.popleft(), self.cfg.get("distill_temperature"))
            loss = alpha * soft + (1 - alpha) * loss
        weighted = loss.detach() * len(target)
        self.total = weighted if self.total is None else self.total + weighted
        self.count += len(target)
        scaled = loss if self.amp.scaler is None else self.amp.scaler.scale(loss)
        return scaled * self.weight
