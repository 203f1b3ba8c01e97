"""Data parallelism: DistributedDataParallel (buckets, overlap, any algorithm) and the master-rank DP."""

from ringtree.parallel.ddp import DistributedDataParallel, SyncStats
from ringtree.parallel.dp import MasterDataParallel

__all__ = ["DistributedDataParallel", "MasterDataParallel", "SyncStats"]
