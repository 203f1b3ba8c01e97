"""One entry point for an all-reduce time: closed form, event replay, or the right one for the size.

`native` on a GPU cluster is NCCL: it is priced by NCCL's own cost model (`nccl_model`), which
also says which algorithm and protocol NCCL runs. Elsewhere `native` is torch's gloo ring. Where a
calibration measured the algorithm at the cluster's node shape, `auto` reads the time off those
rows (`ringtree.sim.network.measured`: log-log between sizes, the model beyond them) and says "measured".
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtree.sim.network import nccl_model
from ringtree.sim.network.closed_form import check_algorithm, estimate
from ringtree.sim.network.hardware import Cluster
from ringtree.sim.network.replay import replay_all_reduce

METHODS = ("closed-form", "replay", "auto")
# `auto` replays up to this many ranks (a few seconds at most) and uses the closed form beyond.
AUTO_REPLAY_MAX_RANKS = 64


@dataclass(frozen=True)
class Estimate:
    """An all-reduce time and the method that produced it (and NCCL's algorithm/protocol if NCCL)."""

    algorithm: str
    seconds: float
    method: str
    nccl: str = ""  # e.g. "ring/LL128" when method is "nccl-model"


def allreduce_time(
    algorithm: str, cluster: Cluster, nbytes: int, method: str = "auto", itemsize: int = 4
) -> Estimate:
    """Seconds for one all-reduce of `nbytes` with `algorithm` on `cluster`."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    name = check_algorithm(algorithm)
    rows = cluster.measured if method == "auto" and cluster.ranks > 1 else None
    measured = rows is not None and rows.reads(algorithm, cluster)
    if algorithm == "native" and method != "replay":
        tuning = nccl_model.tuning_for(cluster)
        if tuning is not None:
            seconds, choice = nccl_model.allreduce_seconds(tuning, cluster.ranks, cluster.nodes, nbytes)
            if rows is not None and measured:
                return Estimate(
                    algorithm, rows.seconds(algorithm, cluster, nbytes, itemsize), "measured", choice.label
                )
            return Estimate(algorithm, seconds, "nccl-model", choice.label)
    if rows is not None and measured:
        return Estimate(algorithm, rows.seconds(algorithm, cluster, nbytes, itemsize), "measured")
    if method == "auto":
        method = "replay" if cluster.ranks <= AUTO_REPLAY_MAX_RANKS else "closed-form"
    if method == "replay":
        return Estimate(algorithm, replay_all_reduce(name, cluster, nbytes, itemsize), method)
    return Estimate(algorithm, estimate(algorithm, cluster, nbytes, itemsize), method)
