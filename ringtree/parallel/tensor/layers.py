"""Column- and row-parallel linear layers (Megatron-LM), built from or gathered back to nn.Linear.

ColumnParallelLinear splits the weight [out, in] along out: each rank computes out/tp features of
the output from the whole input. RowParallelLinear splits it along in: each rank multiplies its
slice of the input by its slice of the weight, the partial outputs are summed by an all-reduce,
and the bias (replicated) is added once, after the sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ringtree.parallel.tensor.ops import (
    Group,
    copy_to_tp_region,
    gather_from_tp_region,
    gather_last_dim,
    reduce_from_tp_region,
    scatter_to_tp_region,
    tp_rank,
    tp_size,
)
from ringtree.parallel.tensor.sequence import SharedGather, reduce_scatter_sequence


@dataclass(frozen=True)
class Shard:
    """How one parameter is cut: along `dim`, in `stride` interleaved groups (3 for a fused qkv).

    The full dimension is viewed as [stride, tp, n] and rank r keeps [:, r, :] (Megatron's
    partition stride), so a fused [q; k; v] projection gives each rank its own heads of all three.
    """

    dim: int
    stride: int = 1

    def take(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """This rank's shard of a full tensor."""
        parts = _unflatten(full, self.dim, (self.stride, tp, -1))  # [..., stride, tp, n, ...]
        return parts.select(self.dim + 1, rank).flatten(self.dim, self.dim + 1).contiguous()

    def gather(self, local: torch.Tensor, group: Group, algorithm: str = "ring") -> torch.Tensor:
        """The full tensor from every rank's shard (collective over the group)."""
        tp = tp_size(group)
        moved = local.detach().movedim(self.dim, -1).contiguous()  # cut dim last: [..., stride * n]
        full = gather_last_dim(moved, group, algorithm)  # [..., tp * stride * n], rank-major
        ranks = _unflatten(full, full.dim() - 1, (tp, self.stride, -1)).transpose(
            -3, -2
        )  # [..., stride, tp, n]
        return ranks.flatten(-3).movedim(-1, self.dim).contiguous()


class _ParallelLinear(nn.Module):
    """What both layers share: the group, the shards of weight and bias, and gathering them back."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    weight_shard: Shard
    bias_shard: Shard | None

    def __init__(self, in_features: int, out_features: int, group: Group, algorithm: str) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.algorithm = group, algorithm
        self.tp, self.tp_rank = tp_size(group), tp_rank(group)
        self.sequence_parallel = False  # True: the input (column) or output (row) is split along tokens

    def shards(self) -> dict[str, Shard | None]:
        """Each parameter's cut, None for a replicated one (what checkpoints gather and split)."""
        out: dict[str, Shard | None] = {"weight": self.weight_shard}
        if self.bias is not None:
            out["bias"] = self.bias_shard
        return out

    def full_weight(self) -> torch.Tensor:
        """The dense [out_features, in_features] weight, gathered from every rank of the group."""
        return self.weight_shard.gather(self.weight, self.group, self.algorithm)

    def full_bias(self) -> torch.Tensor | None:
        if self.bias is None:
            return None
        if self.bias_shard is None:
            return self.bias.detach().clone()
        return self.bias_shard.gather(self.bias, self.group, self.algorithm)

    def to_dense(self) -> nn.Linear:
        """An nn.Linear computing what this layer computes (collective over the group)."""
        dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        with torch.no_grad():
            dense.weight.copy_(self.full_weight())
            bias = self.full_bias()
            if dense.bias is not None and bias is not None:
                dense.bias.copy_(bias)
        return dense

    def load_dense(self, linear: nn.Linear) -> None:
        """Copy this rank's shard of a dense layer's weight and bias (same shapes as this layer's)."""
        if (linear.in_features, linear.out_features) != (self.in_features, self.out_features):
            raise ValueError(
                f"a dense Linear({linear.in_features}, {linear.out_features}) cannot load into "
                f"{type(self).__name__}({self.in_features}, {self.out_features})"
            )
        with torch.no_grad():
            self.weight.copy_(self.weight_shard.take(linear.weight, self.tp_rank, self.tp))
            if self.bias is not None and linear.bias is not None:
                full = linear.bias
                bias = full if self.bias_shard is None else self.bias_shard.take(full, self.tp_rank, self.tp)
                self.bias.copy_(bias)

    def _init(self, out_local: int, in_local: int, bias: int | None) -> None:
        """nn.Linear's initialization with the dense layer's fan-in: U(-1/sqrt(in), 1/sqrt(in))."""
        bound = 1 / math.sqrt(self.in_features)
        self.weight = nn.Parameter(torch.empty(out_local, in_local).uniform_(-bound, bound))
        self.bias = None if bias is None else nn.Parameter(torch.empty(bias).uniform_(-bound, bound))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp}"


class ColumnParallelLinear(_ParallelLinear):
    """Y = X A^T + b with A split along its output dimension: input replicated, output sharded.

    gather_output=True all-gathers the output so every rank holds all out_features. `stride`
    cuts fused projections (3 for [q; k; v]) so each rank gets matching slices of every part.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        group: Group = None,
        algorithm: str = "ring",
        stride: int = 1,
    ) -> None:
        super().__init__(in_features, out_features, group, algorithm)
        _check_divisible("out_features", out_features, self.tp * stride, f"tp={self.tp} x stride={stride}")
        if gather_output and stride != 1:
            raise ValueError(
                f"gather_output=True needs stride=1 (got stride={stride}): the gather is rank-major"
            )
        self.gather_output = gather_output
        self.shared_gather = SharedGather()  # sequence parallel: one gather per input (set by the plan)
        self.weight_shard, self.bias_shard = Shard(0, stride), Shard(0, stride)
        self._init(out_features // self.tp, in_features, out_features // self.tp if bias else None)

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        group: Group = None,
        gather_output: bool = False,
        algorithm: str = "ring",
        stride: int = 1,
    ) -> ColumnParallelLinear:
        """Shard an nn.Linear (identical on every rank of the group) so the result computes the same."""
        bias = linear.bias is not None
        layer = cls(linear.in_features, linear.out_features, bias, gather_output, group, algorithm, stride)
        layer.load_dense(linear)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # [b, t/tp, in] -> [b, t, in]; backward reduce-scatters
            x = self.shared_gather(x, self.group, self.algorithm)
        else:
            x = copy_to_tp_region(x, self.group, self.algorithm)  # f: all-reduce of the input's gradient
        y = F.linear(x, self.weight, self.bias)  # [..., out / tp]
        return gather_from_tp_region(y, self.group, self.algorithm) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """Y = X A^T + b with A split along its input dimension: input sharded, partial outputs summed.

    input_is_parallel=False splits a replicated input first (its gradient is all-gathered back).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        group: Group = None,
        algorithm: str = "ring",
    ) -> None:
        super().__init__(in_features, out_features, group, algorithm)
        _check_divisible("in_features", in_features, self.tp, f"tp={self.tp}")
        self.input_is_parallel = input_is_parallel
        self.weight_shard, self.bias_shard = Shard(1), None
        self._init(out_features, in_features // self.tp, out_features if bias else None)

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        group: Group = None,
        input_is_parallel: bool = True,
        algorithm: str = "ring",
    ) -> RowParallelLinear:
        """Shard an nn.Linear (identical on every rank of the group) so the result computes the same."""
        bias = linear.bias is not None
        layer = cls(linear.in_features, linear.out_features, bias, input_is_parallel, group, algorithm)
        layer.load_dense(linear)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group, self.algorithm)  # [..., in / tp]
        partial = F.linear(x, self.weight)  # [..., out]: this rank's share of the sum
        if self.sequence_parallel:  # [b, t, out] partial -> [b, t/tp, out] summed
            y = reduce_scatter_sequence(partial, self.group, self.algorithm)
        else:
            y = reduce_from_tp_region(partial, self.group, self.algorithm)  # g: sum over the group
        return y if self.bias is None else y + self.bias


def _unflatten(t: torch.Tensor, dim: int, sizes: tuple[int, ...]) -> torch.Tensor:
    """Split dimension `dim` of t into `sizes` (one of them may be -1)."""
    return t.reshape(*t.shape[:dim], *sizes, *t.shape[dim + 1 :])


def _check_divisible(name: str, value: int, by: int, what: str) -> None:
    if value % by:
        raise ValueError(
            f"{name}={value} is not divisible by {what} = {by}; choose a tensor-parallel size that "
            f"divides {value}"
        )
