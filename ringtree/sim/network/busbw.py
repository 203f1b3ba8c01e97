"""nccl-tests' bus bandwidth: what each rank's link carries relative to the data size."""

from __future__ import annotations


def busbw_factor(collective: str, p: int) -> float:
    """busbw = algbw x this: all-reduce 2(p-1)/p; reduce-scatter, all-gather, all-to-all (p-1)/p;
    broadcast, reduce and point-to-point 1 (nccl-tests' doc/PERFORMANCE.md)."""
    name = collective.replace("-", "_")
    if name == "all_reduce":
        return 2 * (p - 1) / p
    if name in ("reduce_scatter", "all_gather", "all_to_all"):
        return (p - 1) / p
    return 1.0
