"""Memory you can see: the model state a rank holds, counted from its tensors, its peak, and the
activations autograd saves for backward (what sequence parallelism and recompute shrink)."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

MB = 1 << 20


def model_state_bytes(net: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer states this rank holds now.

    Counted per storage, so views (ZeRO's shards of a flat buffer, parameters inside it) count
    once and a freed storage (ZeRO-3 between layers) counts nothing.
    """
    tensors: list[torch.Tensor] = [*net.parameters()]
    tensors += [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [p.grad for p in list(tensors) if p.grad is not None]
    tensors += [
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    ]
    seen: set[int] = set()
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensors: this rank's shard
        storage = local.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def peak_bytes(device: torch.device) -> int:
    """This process's peak: CUDA's allocator peak on a GPU, else the peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def fullest_rank_mb(model_state: int, activations: int, device: torch.device) -> dict[str, float]:
    """model_state_mb, peak_memory_mb and activation_memory_mb of the fullest rank (one all-reduce,
    every rank calls it)."""
    mine = torch.tensor(
        [float(model_state), float(peak_bytes(device)), float(activations)],
        dtype=torch.float64,
        device=device,
    )
    if dist.is_initialized():
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    state, peak, saved = mine.tolist()
    return {"model_state_mb": state / MB, "peak_memory_mb": peak / MB, "activation_memory_mb": saved / MB}


class ActivationMeter:
    """The most bytes of activations saved for backward by one forward (`with meter.forward():`).

    Counts the distinct storages autograd saves (weights excluded, as the pipeline runtime counts a
    stage's), over the first `samples` forwards only: shapes repeat, and the hook costs a Python call
    per saved tensor, which a training step should not pay for ever.
    """

    def __init__(self, net: nn.Module, samples: int = 4) -> None:
        self.net, self.peak_bytes, self.left = net, 0, samples

    @contextmanager
    def forward(self) -> Iterator[None]:
        if self.left <= 0:
            yield
            return
        self.left -= 1
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
