"""Tensor parallelism: paired autograd collectives, column/row-parallel linears, the parallel block."""

from ringtree.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, Shard
from ringtree.parallel.tensor.ops import (
    all_gather_last_dim,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_last_dim,
    scatter_to_tp_region,
)
from ringtree.parallel.tensor.state import (
    copy_from_dense,
    copy_to_dense,
    gather_optimizer_state,
    shard_optimizer_state,
)
from ringtree.parallel.tensor.transformer import (
    ParallelBlock,
    ParallelMLP,
    ParallelSelfAttention,
    parallelize_blocks,
)

__all__ = [
    "ColumnParallelLinear",
    "ParallelBlock",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "Shard",
    "all_gather_last_dim",
    "copy_from_dense",
    "copy_to_dense",
    "copy_to_tp_region",
    "gather_from_tp_region",
    "gather_optimizer_state",
    "parallelize_blocks",
    "reduce_from_tp_region",
    "reduce_scatter_last_dim",
    "scatter_to_tp_region",
    "shard_optimizer_state",
]
