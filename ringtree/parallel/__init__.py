"""Data, tensor and pipeline parallelism: DDP, the master-rank DP, the process mesh, parallel layers."""

from ringtree.parallel.ddp import DistributedDataParallel, SyncStats
from ringtree.parallel.dp import MasterDataParallel
from ringtree.parallel.mesh import Mesh, MeshShape

__all__ = ["DistributedDataParallel", "MasterDataParallel", "Mesh", "MeshShape", "SyncStats"]
