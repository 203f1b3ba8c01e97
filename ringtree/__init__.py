"""ringtree: every classic all-reduce, a simulator that predicts them, and parallel training."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from ringtree.topology import Topology

if TYPE_CHECKING:
    from ringtree.comm.hook import comm_hook, powersgd_hook
    from ringtree.parallel import DistributedDataParallel, ShardedDataParallel

try:
    __version__ = version("ringtree")  # pyproject.toml's, as installed: one version for all to read
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
__all__ = [
    "DistributedDataParallel",
    "ShardedDataParallel",
    "Topology",
    "__version__",
    "comm_hook",
    "powersgd_hook",
]


def __getattr__(name: str) -> Any:
    # torch-backed names load on first use, so pure-Python parts (schedules, sim, plan) start fast.
    if name == "DistributedDataParallel":
        from ringtree.parallel import DistributedDataParallel

        return DistributedDataParallel
    if name == "ShardedDataParallel":
        from ringtree.parallel import ShardedDataParallel

        return ShardedDataParallel
    if name == "comm_hook":
        from ringtree.comm.hook import comm_hook, powersgd_hook

        return comm_hook
    if name == "powersgd_hook":
        from ringtree.comm.hook import powersgd_hook

        return powersgd_hook
    raise AttributeError(f"module 'ringtree' has no attribute {name!r}")
