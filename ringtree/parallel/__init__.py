"""Data, tensor, pipeline and context parallelism: DDP, ZeRO, master-rank DP, the mesh, parallel layers."""

from ringtree.parallel.context import SDPA, ContextParallel
from ringtree.parallel.ddp import DistributedDataParallel, SyncStats
from ringtree.parallel.dp import MasterDataParallel
from ringtree.parallel.mesh import Mesh, MeshShape
from ringtree.parallel.sharded import ShardedDataParallel
from ringtree.parallel.tensor import (
    ColumnParallelLinear,
    ParallelBlock,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
)

__all__ = [
    "SDPA",
    "ColumnParallelLinear",
    "ContextParallel",
    "DistributedDataParallel",
    "MasterDataParallel",
    "Mesh",
    "MeshShape",
    "ParallelBlock",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "ShardedDataParallel",
    "SyncStats",
]
