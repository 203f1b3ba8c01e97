"""Data, tensor, pipeline and expert parallelism: DDP, ZeRO, the master-rank DP, the mesh, parallel
layers, the mixture-of-experts layer and its expert parallelism."""

from ringtree.parallel.ddp import DistributedDataParallel, SyncStats
from ringtree.parallel.dp import MasterDataParallel
from ringtree.parallel.expert import ExpertParallel
from ringtree.parallel.mesh import Mesh, MeshShape
from ringtree.parallel.moe import MoE
from ringtree.parallel.sharded import ShardedDataParallel
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
    "ExpertParallel",
    "MasterDataParallel",
    "Mesh",
    "MeshShape",
    "MoE",
    "ParallelBlock",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "ShardedDataParallel",
    "SyncStats",
]
