"""Weight stashing for PipeDream: each micro-batch's backward uses the weight version its forward used.

A version v is a copy of the stage's parameters after v optimizer steps. The forward of micro-batch
i runs the stage with fresh leaf tensors of the version the schedule names (torch.func.functional_call),
so its autograd graph keeps that version alive however often the live parameters are stepped
meanwhile; the backward's gradients are then handed to the live parameters for the step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call

from ringtree.schedules.pipeline import Action, Kind

Weights = dict[str, torch.Tensor]


class WeightStash:
    """One stage's weight versions: snapshots still to be used by a forward, and those in flight."""

    def __init__(self, module: nn.Module, actions: Sequence[Action]) -> None:
        self.module = module
        self.version = 0
        self._forwards_left = Counter(a.version for a in actions if a.kind is Kind.FORWARD)
        self._snapshots: dict[int, Weights] = {}
        self._in_flight: dict[int, tuple[int, Weights]] = {}  # micro-batch -> (version, its leaves)
        self.peak_versions = 1
        self._snapshot()

    def forward(self, i: int, version: int, x: torch.Tensor) -> torch.Tensor:
        """The stage's output for micro-batch i computed with weight version `version`."""
        if version not in self._snapshots:
            raise RuntimeError(f"weight version {version} is not stashed (have {sorted(self._snapshots)})")
        leaves = {n: t.detach().requires_grad_() for n, t in self._snapshots[version].items()}
        self._forwards_left[version] -= 1
        if not self._forwards_left[version] and version != self.version:
            del self._snapshots[version]
        self._in_flight[i] = (version, leaves)
        self._track()
        return functional_call(self.module, leaves, (x,))  # type: ignore[no-any-return]

    def backward_done(self, i: int) -> None:
        """Move micro-batch i's gradients (of its stashed version) onto the live parameters."""
        _, leaves = self._in_flight.pop(i)
        for name, param in self.module.named_parameters():
            param.grad = leaves[name].grad

    def stepped(self) -> None:
        """The live parameters were updated: they become the next version."""
        if not self._forwards_left[self.version]:
            self._snapshots.pop(self.version, None)
        self.version += 1
        self._snapshot()
        self._track()

    def storages(self, version: int) -> set[int]:
        """The storage addresses of a stashed version's tensors (weights, not activations)."""
        return {t.untyped_storage().data_ptr() for t in self._snapshots.get(version, {}).values()}

    def alive(self) -> int:
        """Versions held now: the live one and those stashed by micro-batches in flight."""
        return len({self.version, *(v for v, _ in self._in_flight.values())})

    def _snapshot(self) -> None:
        if self._forwards_left[self.version]:
            self._snapshots[self.version] = {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def _track(self) -> None:
        self.peak_versions = max(self.peak_versions, self.alive())
