"""The paired autograd collectives of tensor parallelism, each defined with its dual (Megatron's f and g).

| operator                   | forward                  | backward                 |
|----------------------------|--------------------------|--------------------------|
| copy_to_tp_region (f)      | identity                 | all-reduce               |
| reduce_from_tp_region (g)  | all-reduce               | identity                 |
| gather_from_tp_region      | all-gather (last dim)    | split (keep own slice)   |
| scatter_to_tp_region       | split (keep own slice)   | all-gather (last dim)    |
| all_gather_last_dim        | all-gather (last dim)    | reduce-scatter           |
| reduce_scatter_last_dim    | reduce-scatter           | all-gather (last dim)    |

The gather/split pair is for a gathered output that every rank then uses identically (its gradient
is replicated); the gather/reduce-scatter pair is for one whose ranks use it differently (each holds
a partial gradient). Communication runs over ringtree.comm with any algorithm; the tensor-parallel
hot path skips comm's per-call handshake (every rank of the group runs the same layers).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ringtree import comm

Group = dist.ProcessGroup | None


def tp_size(group: Group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def tp_rank(group: Group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _all_reduce(x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
    if tp_size(group) == 1:
        return x
    return comm.all_reduce(x.contiguous().clone(), "sum", algorithm, group, validate=False)


def _split(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's slice of the last dimension: [..., n] -> [..., n / tp]."""
    p = tp_size(group)
    if x.shape[-1] % p:
        raise ValueError(f"the last dimension {x.shape[-1]} is not divisible by the tensor-parallel size {p}")
    return x.chunk(p, dim=-1)[tp_rank(group)].contiguous()


def gather_last_dim(x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension: [..., n] -> [..., tp * n] (no autograd)."""
    p = tp_size(group)
    if p == 1:
        return x
    pieces = torch.empty((p, *x.shape), dtype=x.dtype, device=x.device)  # [tp, ..., n]
    comm.all_gather(pieces, x.contiguous(), algorithm, group, validate=False)
    return torch.cat(pieces.unbind(0), dim=-1)


def _reduce_scatter(x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
    """Sum x over the ranks and keep this rank's slice of the last dimension: [..., n] -> [..., n / tp]."""
    p = tp_size(group)
    if p == 1:
        return x
    if x.shape[-1] % p:
        raise ValueError(f"the last dimension {x.shape[-1]} is not divisible by the tensor-parallel size {p}")
    blocks = torch.stack(x.chunk(p, dim=-1)).contiguous()  # [tp, ..., n / tp]
    out = torch.empty(blocks.shape[1:], dtype=x.dtype, device=x.device)
    return comm.reduce_scatter(out, blocks, "sum", algorithm, group, validate=False)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(grad, ctx.group, ctx.algorithm), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
        return _all_reduce(x, group, algorithm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
        ctx.group = group
        return gather_last_dim(x, group, algorithm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split(grad, ctx.group), None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        return _split(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return gather_last_dim(grad, ctx.group, ctx.algorithm), None, None


class _AllGatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        return gather_last_dim(x, group, algorithm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.group, ctx.algorithm), None, None


class _ReduceScatterLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        return _reduce_scatter(x, group, algorithm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return gather_last_dim(grad, ctx.group, ctx.algorithm), None, None


def copy_to_tp_region(x: torch.Tensor, group: Group = None, algorithm: str = "ring") -> torch.Tensor:
    """f: identity forward, all-reduce backward (the input of a column-parallel layer)."""
    return _CopyToRegion.apply(x, group, algorithm)  # type: ignore[no-untyped-call,no-any-return]  # torch leaves apply untyped


def reduce_from_tp_region(x: torch.Tensor, group: Group = None, algorithm: str = "ring") -> torch.Tensor:
    """g: all-reduce forward, identity backward (the output of a row-parallel layer)."""
    return _ReduceFromRegion.apply(x, group, algorithm)  # type: ignore[no-untyped-call,no-any-return]  # torch leaves apply untyped


def gather_from_tp_region(x: torch.Tensor, group: Group = None, algorithm: str = "ring") -> torch.Tensor:
    """All-gather the last dimension forward; keep this rank's slice of the gradient backward."""
    return _GatherFromRegion.apply(x, group, algorithm)  # type: ignore[no-untyped-call,no-any-return]  # torch leaves apply untyped


def scatter_to_tp_region(x: torch.Tensor, group: Group = None, algorithm: str = "ring") -> torch.Tensor:
    """Keep this rank's slice of the last dimension forward; all-gather the gradient backward."""
    return _ScatterToRegion.apply(x, group, algorithm)  # type: ignore[no-untyped-call,no-any-return]  # torch leaves apply untyped


def all_gather_last_dim(x: torch.Tensor, group: Group = None, algorithm: str = "ring") -> torch.Tensor:
    """All-gather the last dimension forward; reduce-scatter the gradient backward."""
    return _AllGatherLastDim.apply(x, group, algorithm)  # type: ignore[no-untyped-call,no-any-return]  # torch leaves apply untyped


def reduce_scatter_last_dim(x: torch.Tensor, group: Group = None, algorithm: str = "ring") -> torch.Tensor:
    """Reduce-scatter the last dimension forward; all-gather the gradient backward."""
    return _ReduceScatterLastDim.apply(x, group, algorithm)  # type: ignore[no-untyped-call,no-any-return]  # torch leaves apply untyped
