"""The loss a training step backpropagates: the user's loss_fn, plus distillation's soft term.

The same object serves the replica step and the pipeline's last stage (the runtime calls it with
the stage's output and the targets). Under context parallelism the outputs hold this rank's share
of each sequence: the targets are sharded the same way, and a token-mean loss is weighted by this
rank's share of the scored tokens, so that the mean over the CP ranks is the whole sequence's loss.
Its running sums stay on the device; the trainer reads them once per log interval and at the end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch
from torch import nn

from ringtree.parallel import ContextParallel
from ringtree.train.config import TrainConfig
from ringtree.train.evaluation import IGNORE
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
        self.context: ContextParallel | None = None  # set by parallelize under --cp

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
        share: torch.Tensor | float = 1.0
        if self.context is not None and target.dim() > 1:
            target, share = self._shard(target)
        loss = self.fn(out, target) * share
        if self.teacher is not None:
            alpha = self.cfg.get("distill_alpha")
            teacher = self.soft.popleft()
            if self.context is not None and teacher.dim() > 2:
                teacher = self.context.shard(teacher)
            soft = soft_loss(out, teacher, self.cfg.get("distill_temperature"))
            loss = alpha * soft + (1 - alpha) * loss
        weighted = loss.detach() * len(target)
        self.total = weighted if self.total is None else self.total + weighted
        self.count += len(target)
        scaled = loss if self.amp.scaler is None else self.amp.scaler.scale(loss)
        return scaled * self.weight

    def _shard(self, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
        """This rank's targets, and cp x its share of the scored tokens (class targets; else 1)."""
        assert self.context is not None
        mine = self.context.shard(target)
        if target.is_floating_point():
            return mine, 1.0  # every rank holds as many elements: the mean of the means is the mean
        scored = (mine != IGNORE).sum().float()
        return mine, self.context.size * scored / (target != IGNORE).sum().clamp(min=1).float()
