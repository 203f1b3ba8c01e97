"""The parallel transformer block: attention heads and MLP hidden units divided among the TP ranks.

Megatron's layout: each half of the block is a column-parallel linear followed by a row-parallel
one, so activations between them stay sharded and each half costs one all-reduce forward (g, at
the row-parallel output) and one backward (f, at the column-parallel input): two and two a block.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ringtree.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from ringtree.parallel.tensor.ops import Group, tp_size


class DenseAttention(Protocol):
    """What ParallelSelfAttention.from_dense reads: a fused qkv projection, an output one, heads."""

    heads: int
    qkv: nn.Linear
    proj: nn.Linear


class DenseBlock(Protocol):
    """What ParallelBlock.from_dense reads: a pre-norm block as ringtree.train.models.Block lays it out."""

    norm1: nn.LayerNorm
    attn: DenseAttention
    norm2: nn.LayerNorm
    fc1: nn.Linear
    fc2: nn.Linear


class ParallelMLP(nn.Module):
    """fc1 (column-parallel) -> GELU -> fc2 (row-parallel): the hidden units split among ranks."""

    def __init__(self, fc1: ColumnParallelLinear, fc2: RowParallelLinear) -> None:
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    @classmethod
    def build(cls, dim: int, hidden: int, group: Group = None, algorithm: str = "ring") -> ParallelMLP:
        fc1 = ColumnParallelLinear(dim, hidden, group=group, algorithm=algorithm)
        return cls(fc1, RowParallelLinear(hidden, dim, group=group, algorithm=algorithm))

    @classmethod
    def from_dense(
        cls, fc1: nn.Linear, fc2: nn.Linear, group: Group = None, algorithm: str = "ring"
    ) -> ParallelMLP:
        col = ColumnParallelLinear.from_dense(fc1, group, algorithm=algorithm)
        return cls(col, RowParallelLinear.from_dense(fc2, group, algorithm=algorithm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # type: ignore[no-any-return]


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention with heads/tp heads per rank: qkv column-parallel, proj row-parallel."""

    def __init__(self, heads: int, qkv: ColumnParallelLinear, proj: RowParallelLinear) -> None:
        super().__init__()
        _check_heads(heads, qkv.tp, proj.in_features)
        self.heads, self.local_heads = heads, heads // qkv.tp
        self.qkv, self.proj = qkv, proj

    @classmethod
    def build(
        cls, dim: int, heads: int, group: Group = None, algorithm: str = "ring"
    ) -> ParallelSelfAttention:
        _check_heads(heads, tp_size(group), dim)
        qkv = ColumnParallelLinear(dim, 3 * dim, group=group, algorithm=algorithm, stride=3)
        return cls(heads, qkv, RowParallelLinear(dim, dim, group=group, algorithm=algorithm))

    @classmethod
    def from_dense(
        cls, attn: DenseAttention, group: Group = None, algorithm: str = "ring"
    ) -> ParallelSelfAttention:
        """Shard a dense attention whose qkv output is laid out [3, heads, head_dim]."""
        _check_heads(attn.heads, tp_size(group), attn.proj.in_features)
        qkv = ColumnParallelLinear.from_dense(attn.qkv, group, algorithm=algorithm, stride=3)
        return cls(attn.heads, qkv, RowParallelLinear.from_dense(attn.proj, group, algorithm=algorithm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.local_heads, -1)  # [b, t, 3, h/tp, d/h]
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [b, h/tp, t, d/h]
        out = F.scaled_dot_product_attention(q, k, v)  # [b, h/tp, t, d/h]
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))  # type: ignore[no-any-return]


class ParallelBlock(nn.Module):
    """A pre-norm transformer block with parallel attention and MLP; norms replicated on every rank.

    Parameters are registered in the dense Block's order (norm1, qkv, proj, norm2, fc1, fc2), so a
    checkpoint converts parameter by parameter.
    """

    def __init__(self, dim: int, attn: ParallelSelfAttention, mlp: ParallelMLP) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = attn
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = mlp

    @classmethod
    def from_dense(cls, block: DenseBlock, group: Group = None, algorithm: str = "ring") -> ParallelBlock:
        dim = block.norm1.normalized_shape[0]
        attn = ParallelSelfAttention.from_dense(block.attn, group, algorithm)
        layer = cls(dim, attn, ParallelMLP.from_dense(block.fc1, block.fc2, group, algorithm))
        layer.norm1.load_state_dict(block.norm1.state_dict())
        layer.norm2.load_state_dict(block.norm2.state_dict())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))  # type: ignore[no-any-return]


def parallelize_blocks(blocks: nn.ModuleList, group: Group = None, algorithm: str = "ring") -> None:
    """Replace every dense block of a ModuleList, in place, by its ParallelBlock shard."""
    for j, block in enumerate(blocks):
        blocks[j] = ParallelBlock.from_dense(block, group, algorithm)  # type: ignore[arg-type]


def _check_heads(heads: int, tp: int, dim: int) -> None:
    if heads % tp:
        raise ValueError(
            f"heads={heads} is not divisible by the tensor-parallel size tp={tp}; choose tp in "
            f"{[d for d in range(1, heads + 1) if heads % d == 0]}"
        )
    if dim % heads:
        raise ValueError(f"dim={dim} must be a multiple of heads={heads}")
