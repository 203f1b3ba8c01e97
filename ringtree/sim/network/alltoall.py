"""One entry point for an all-to-all time: NCCL's on a GPU cluster, or an algorithm's closed form or replay.

    alltoall_seconds(cluster, nbytes, algorithm="native") -> float

Seconds for one all-to-all over the ranks of `cluster` (a `ringtree.sim.Cluster`: nodes x
gpus_per_node ranks, as `ringtree.sim.training.plan.tp_group` / `dp_group` build a group), where `nbytes`
is the per-rank buffer, nccl-tests' size column: the bytes one rank sends to all ranks together,
its own block included (so each peer gets nbytes / p). `algorithm`:

  * "native": torch's own `all_to_all_single`. On a GPU cluster (an NVLink or PCIe intra link, or
    an nccl-tests calibration) that is NCCL's grouped point-to-point sends and receives
    (`ringtree.sim.network.nccl_alltoall`): inside a node, which may be a whole NVLink domain (72 GPUs of
    an NVL72 rack), over NVLink; across nodes over the NICs with PXN (rail-aligned, through
    NVLink first). Elsewhere (gloo) all sends and receives posted at once: `linear`.
  * "pairwise", "bruck", "linear", "hierarchical": ringtree's schedules, by their closed form.

`alltoall_time` also says how the time was found, and can replay the executor's schedule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ringtree.sim.network import nccl_alltoall, nccl_model
from ringtree.sim.network.alltoall_form import ALGORITHMS, ALONG_PATHS, GROUPS, one_partner_s
from ringtree.sim.network.flows import total_time
from ringtree.sim.network.hardware import Cluster

METHODS = ("closed-form", "replay", "auto")
# `auto` replays up to this many ranks and uses the closed form beyond (a schedule has p^2 blocks)
AUTO_REPLAY_MAX_RANKS = 32
NATIVE = "native"


@dataclass(frozen=True)
class Estimate:
    """An all-to-all time and the method that produced it (and the protocol if NCCL's model)."""

    algorithm: str
    seconds: float
    method: str
    nccl: str = ""  # e.g. "p2p/Simple" when method is "nccl-model"


def check_algorithm(algorithm: str) -> str:
    """The schedule an algorithm name replays; `native` off a GPU cluster is gloo's `linear`."""
    if algorithm == NATIVE:
        return "linear"
    if algorithm not in GROUPS:
        raise ValueError(
            f"unknown all-to-all algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}, {NATIVE}"
        )
    return algorithm


def estimate(algorithm: str, cluster: Cluster, nbytes: int, itemsize: int = 4) -> float:
    """Closed-form seconds of one all-to-all of `nbytes` per rank (whole elements of `itemsize`)."""
    if nbytes < 0:
        raise ValueError(f"bytes must be >= 0, got {nbytes}")
    name = check_algorithm(algorithm)
    count = nbytes // itemsize
    if count == 0 or cluster.ranks == 1:
        return 0.0
    block = count * itemsize / cluster.ranks
    groups = GROUPS[name](cluster, block)
    if name in ALONG_PATHS:
        fast = one_partner_s(cluster, groups)
        if fast is not None:
            return fast
    return total_time(groups, cluster, name in ALONG_PATHS)


def replay(algorithm: str, cluster: Cluster, nbytes: int, itemsize: int = 4) -> float:
    """Seconds of one all-to-all: build the executor's schedule and replay it on the cluster."""
    from ringtree.sim.network.replay import replay_schedule

    if nbytes < 0:
        raise ValueError(f"bytes must be >= 0, got {nbytes}")
    return replay_schedule("all_to_all", check_algorithm(algorithm), cluster, nbytes // itemsize, itemsize)


def alltoall_time(
    algorithm: str, cluster: Cluster, nbytes: int, method: str = "auto", itemsize: int = 4
) -> Estimate:
    """Seconds for one all-to-all of `nbytes` per rank with `algorithm` on `cluster`, and how found."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    name = check_algorithm(algorithm)
    if algorithm == NATIVE and method != "replay":
        tuning = nccl_model.tuning_for(cluster)
        if tuning is not None:
            seconds, priced = nccl_alltoall.seconds(tuning, cluster.ranks, cluster.nodes, nbytes)
            how = (
                "measured" if nccl_alltoall.reads_rows(tuning, cluster.ranks, cluster.nodes) else "nccl-model"
            )
            return Estimate(algorithm, seconds, how, f"p2p/{priced.protocol}" if priced else "")
    if method == "auto":
        method = "replay" if cluster.ranks <= AUTO_REPLAY_MAX_RANKS else "closed-form"
    if method == "replay":
        return Estimate(algorithm, replay(name, cluster, nbytes, itemsize), method)
    return Estimate(algorithm, estimate(name, cluster, nbytes, itemsize), method)


@functools.lru_cache(maxsize=4096)
def alltoall_seconds(cluster: Cluster, nbytes: int, algorithm: str = NATIVE) -> float:
    """Seconds for one all-to-all of `nbytes` per rank (nccl-tests' size: what one rank sends to all
    ranks, its own block included) over the ranks of `cluster`; `native` is NCCL's grouped
    point-to-point on a GPU cluster (NVLink inside a node or NVLink domain, PXN over the NICs
    across), gloo's all-at-once exchange elsewhere. The closed form, never a replay: fast at any scale."""
    if nbytes <= 0 or cluster.ranks < 2:
        return 0.0
    return alltoall_time(algorithm, cluster, nbytes, "closed-form", 1).seconds


__all__ = ["ALGORITHMS", "METHODS", "Estimate", "alltoall_seconds", "alltoall_time", "estimate", "replay"]
