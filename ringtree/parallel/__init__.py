"""Data, tensor, pipeline, context and expert parallelism: DDP, ZeRO, master-rank DP, the mesh,
parallel layers, the mixture-of-experts layer and its expert parallelism; local SGD and DiLoCo."""

from ringtree.comm.powersgd import PowerSGD
from ringtree.parallel.context import SDPA, ContextParallel
from ringtree.parallel.ddp import DistributedDataParallel, SyncStats
from ringtree.parallel.diloco import DiLoCo
from ringtree.parallel.dp import MasterDataParallel
from ringtree.parallel.expert import ExpertParallel
from ringtree.parallel.local_sgd import LocalSGD
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
    "SDPA",
    "ColumnParallelLinear",
    "ContextParallel",
    "DiLoCo",
    "DistributedDataParallel",
    "ExpertParallel",
    "LocalSGD",
    "MasterDataParallel",
    "Mesh",
    "MeshShape",
    "MoE",
    "ParallelBlock",
    "ParallelMLP",
    "ParallelSelfAttention",
    "PowerSGD",
    "RowParallelLinear",
    "ShardedDataParallel",
    "SyncStats",
]
