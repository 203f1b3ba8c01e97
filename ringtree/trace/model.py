"""What the planner's collective model says a collective should reach on a cluster (busbw)."""

from __future__ import annotations

import dataclasses
import math

from ringtree.sim.network.allreduce import allreduce_time
from ringtree.sim.network.alltoall import alltoall_time
from ringtree.sim.network.busbw import busbw_factor
from ringtree.sim.network.hardware import Cluster
from ringtree.trace.bandwidth import Model

REDUCING = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


def collective_model(cluster: Cluster) -> Model:
    """busbw (GB/s) the model predicts for (op, bytes, group size): a group of n ranks is placed
    on consecutive devices (ceil(n / gpus per node) nodes), NCCL's own choice (`native`).
    All-gather, reduce-scatter, broadcast and reduce are priced as the all-reduce of the same size:
    in nccl-tests' terms their busbw is the all-reduce's (each is half of a ring all-reduce)."""

    def busbw(op: str, nbytes: int, n: int) -> float | None:
        if n < 2 or nbytes <= 0 or op not in (*REDUCING, "all_to_all"):
            return None
        g = cluster.gpus_per_node
        group = dataclasses.replace(cluster, nodes=math.ceil(n / g), gpus_per_node=min(g, n))
        if op == "all_to_all":
            seconds = alltoall_time("native", group, nbytes).seconds
            return nbytes / seconds / 1e9 * busbw_factor("all_to_all", group.ranks) if seconds > 0 else None
        seconds = allreduce_time("native", group, nbytes).seconds
        return nbytes / seconds / 1e9 * busbw_factor("all_reduce", group.ranks) if seconds > 0 else None

    return busbw
