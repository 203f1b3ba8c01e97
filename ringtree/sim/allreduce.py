"""One entry point for an all-reduce time: closed form, event replay, or the right one for the size."""

from __future__ import annotations

from dataclasses import dataclass

from ringtree.sim.closed_form import check_algorithm, estimate
from ringtree.sim.hardware import Cluster
from ringtree.sim.replay import replay_all_reduce

METHODS = ("closed-form", "replay", "auto")
# `auto` replays up to this many ranks (a few seconds at most) and uses the closed form beyond.
AUTO_REPLAY_MAX_RANKS = 64


@dataclass(frozen=True)
class Estimate:
    """An all-reduce time and the method that produced it."""

    algorithm: str
    seconds: float
    method: str


def allreduce_time(
    algorithm: str, cluster: Cluster, nbytes: int, method: str = "auto", itemsize: int = 4
) -> Estimate:
    """Seconds for one all-reduce of `nbytes` with `algorithm` on `cluster`."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    name = check_algorithm(algorithm)
    if method == "auto":
        method = "replay" if cluster.ranks <= AUTO_REPLAY_MAX_RANKS else "closed-form"
    if method == "replay":
        return Estimate(algorithm, replay_all_reduce(name, cluster, nbytes, itemsize), method)
    return Estimate(algorithm, estimate(name, cluster, nbytes, itemsize), method)
