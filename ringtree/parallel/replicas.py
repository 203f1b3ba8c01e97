"""Making replicas equal: broadcast a module's parameters and buffers from rank 0."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ringtree import comm


def replicated(param: torch.Tensor) -> bool:
    """False for a parameter another module keeps in step (an expert under expert parallelism is
    marked `allreduce = False`, as in Megatron-Core): data-parallel wrappers leave it alone."""
    return getattr(param, "allreduce", True) is not False


def broadcast_state(
    module: nn.Module,
    group: dist.ProcessGroup | None,
    algorithm: str,
    timeout_s: float,
    *,
    params: bool = True,
    src: int = 0,
    validate: bool = True,
) -> None:
    """Overwrite every rank's parameters (when `params`) and buffers with rank `src`'s, in place.

    Tensors are flattened per dtype into one buffer each, so a model costs one broadcast per dtype.
    """
    tensors: list[torch.Tensor] = [p for p in module.parameters() if replicated(p)] if params else []
    tensors += [b for b in module.buffers() if b.dtype in comm.DTYPES]
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        group_tensors = [t for t in tensors if t.dtype == dtype]
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1) for t in group_tensors])
            comm.broadcast(flat, src, algorithm, group, timeout_s=timeout_s, validate=validate)
            offset = 0
            for t in group_tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
