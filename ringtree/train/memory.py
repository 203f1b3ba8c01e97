"""A rank's peak training memory: measured by CUDA's allocator on a GPU, counted on the CPU.

On the CPU there is no allocator to ask, so the peak is counted: parameters, their gradients and
the optimizer's state, plus the most activation bytes autograd held for backward at once (the
distinct storages saved during a forward, weights excluded, as the pipeline runtime counts them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

MB = 2**20


class ActivationMeter:
    """The most bytes of activations saved for backward by one forward (`with meter.forward():`)."""

    def __init__(self, net: nn.Module) -> None:
        self.net, self.peak_bytes = net, 0

    @contextmanager
    def forward(self) -> Iterator[None]:
        weights = {p.untyped_storage().data_ptr() for p in self.net.parameters()}
        seen: set[int] = set()
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights and ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.peak_bytes = max(self.peak_bytes, total)


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def peak_memory_mb(
    params: list[nn.Parameter], optimizer: torch.optim.Optimizer, activation_bytes: int, device: torch.device
) -> float:
    """The peak: CUDA's max allocated, or (CPU) weights + gradients + optimizer state + activations."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MB
    mine = {id(p) for p in params}
    state = [
        t
        for p, s in optimizer.state.items()
        if id(p) in mine
        for t in s.values()
        if isinstance(t, torch.Tensor)
    ]
    return (2 * _bytes(params) + _bytes(state) + activation_bytes) / MB
