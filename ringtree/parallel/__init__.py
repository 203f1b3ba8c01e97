"""Data, tensor and pipeline parallelism: DDP, the master-rank DP, the process mesh, parallel layers."""

from ringtree.parallel.ddp import DistributedDataParallel, SyncStats
from ringtree.parallel.dp import MasterDataParallel
from ringtree.parallel.mesh import Mesh, MeshShape
from ringtree.parallel.tensor import (
    ColumnParallelLinear,
    ParallelBlock,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
)

__all__ = [
    "ColumnParallelLinear",
    "DistributedDataParallel",
    "MasterDataParallel",
    "Mesh",
    "MeshShape",
    "ParallelBlock",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "SyncStats",
]
