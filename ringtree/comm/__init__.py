"""Collectives over torch.distributed: every classic algorithm, one executor."""

from ringtree.comm.alltoall import all_to_all_single, all_to_all_single_autograd
from ringtree.comm.collectives import (
    DEFAULT_TIMEOUT_S,
    algorithms,
    all_gather,
    all_reduce,
    broadcast,
    reduce,
    reduce_scatter,
)
from ringtree.comm.errors import CollectiveError, MismatchError
from ringtree.comm.hook import comm_hook
from ringtree.comm.reduce_ops import DTYPES, OPS

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DTYPES",
    "OPS",
    "CollectiveError",
    "MismatchError",
    "algorithms",
    "all_gather",
    "all_reduce",
    "all_to_all_single",
    "all_to_all_single_autograd",
    "broadcast",
    "comm_hook",
    "reduce",
    "reduce_scatter",
]
