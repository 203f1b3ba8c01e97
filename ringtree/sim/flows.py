"""Lockstep cost of step-structured algorithms: groups of equal flows over steps, with shared links.

An algorithm's closed form is a list of flow groups: flows src[i] -> dst[i] of `nbytes` each, one
per step of [first, stop). At one step, a flow's time is alpha + nbytes * beta * load, where load is
how many flows of that step share its busiest resource (the sender's port and the receiver's port
inside a node; the two NICs between nodes): the equal-share rule the event replay uses. A step
costs its slowest flow plus gamma times the most bytes one rank reduces in it; the total is the
sum over steps. On one level without sharing this is the alpha-beta-gamma textbook formula.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ringtree.sim.hardware import Cluster

Ranks = npt.NDArray[np.int64]


@dataclass(frozen=True)
class FlowGroup:
    """Flows src[i] -> dst[i] of `nbytes` each, repeated at every step of [first, stop)."""

    src: Ranks
    dst: Ranks
    nbytes: float
    reduce: bool
    first: int
    stop: int


@dataclass(frozen=True)
class AllToAll:
    """Every rank sends `nbytes` to every other rank at each step of [first, stop) (loads analytic)."""

    nbytes: float
    reduce: bool
    first: int
    stop: int


@dataclass(frozen=True)
class Chain:
    """A dependency chain costed directly: `step_s` seconds at each step of [first, stop)."""

    step_s: float
    first: int
    stop: int


Group = FlowGroup | AllToAll | Chain


def total_time(groups: Sequence[Group], cluster: Cluster, along_paths: bool = False) -> float:
    """Seconds until the last rank finishes.

    In lockstep (the default) the total is the sum over steps of the step cost, and steps where the
    active groups do not change are costed once: O(groups) work for any number of steps. Along
    paths, every rank starts a step when it has finished its own previous one and a flow starts
    when both its ends have: the same per-flow costs propagated rank by rank, so a subtree that
    only uses fast links does not wait for a slow link elsewhere (O(steps x flows) work, for
    algorithms with O(k + log p) steps).
    """
    if not along_paths:
        return sum((t1 - t0) * step_cost(active, cluster) for t0, t1, active in _segments(groups))
    ready = np.zeros(cluster.ranks)
    for t0, t1, active in _segments(groups):
        step = StepFlows(active, cluster)
        for _ in range(t1 - t0):
            ready = step.advance(ready)
    return float(ready.max())


def step_cost(groups: Sequence[Group], cluster: Cluster) -> float:
    """One step with these groups active: slowest flow, then the largest reduction of one rank."""
    step = StepFlows(groups, cluster)
    return step.barrier_s + float(step.cost.max(initial=0.0)) + float(step.reduce_s.max(initial=0.0))


def _segments(groups: Sequence[Group]) -> list[tuple[int, int, list[Group]]]:
    """Runs of steps [t0, t1) over which the same groups are active."""
    cuts = sorted({g.first for g in groups} | {g.stop for g in groups})
    runs = []
    for t0, t1 in itertools.pairwise(cuts):
        active = [g for g in groups if g.first <= t0 < g.stop]
        if active:
            runs.append((t0, t1, active))
    return runs


class StepFlows:
    """The flows of one step with their costs at this step's loads, and each rank's reduction time."""

    def __init__(self, groups: Sequence[Group], cluster: Cluster) -> None:
        flows = [g for g in groups if isinstance(g, FlowGroup)]
        self.barrier_s = max(
            (_all_to_all_cost(g, cluster) for g in groups if isinstance(g, AllToAll)), default=0.0
        ) + sum(g.step_s for g in groups if isinstance(g, Chain))
        empty = FlowGroup(np.zeros(0, np.int64), np.zeros(0, np.int64), 0.0, False, 0, 0)
        flows = flows or [empty]
        self.src = np.concatenate([g.src for g in flows])
        self.dst = np.concatenate([g.dst for g in flows])
        size = np.concatenate([np.full(len(g.src), float(g.nbytes)) for g in flows])
        reduce = np.concatenate([np.full(len(g.src), g.reduce) for g in flows])
        self.cost = _flow_costs(self.src, self.dst, size, cluster)
        red = np.bincount(self.dst[reduce], weights=size[reduce], minlength=cluster.ranks)
        self.reduce_s = cluster.gamma * red

    def advance(self, ready: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """Ready times after this step, from ready times before it."""
        if self.barrier_s:
            ready = np.full_like(ready, ready.max() + self.barrier_s)
        end = np.maximum(ready[self.src], ready[self.dst]) + self.cost
        done = ready.copy()
        np.maximum.at(done, self.src, end)
        np.maximum.at(done, self.dst, end)
        return done + self.reduce_s


def _flow_costs(
    src: Ranks, dst: Ranks, size: npt.NDArray[np.float64], cluster: Cluster
) -> npt.NDArray[np.float64]:
    """alpha + bytes x beta x load for every flow, load counted on its busier resource."""
    local = cluster.gpus_per_node
    inter = src // local != dst // local
    cost = np.zeros(len(src))
    for mask, link, out_id, in_id in (
        (~inter, cluster.intra, src, dst),
        (inter, cluster.inter, _nic(src, cluster), _nic(dst, cluster)),
    ):
        if mask.any():
            out_id, in_id = out_id[mask], in_id[mask]
            load = np.maximum(np.bincount(out_id)[out_id], np.bincount(in_id)[in_id])
            cost[mask] = link.alpha_s + size[mask] * load * link.beta
    return cost


def _all_to_all_cost(g: AllToAll, cluster: Cluster) -> float:
    local, p = cluster.gpus_per_node, cluster.ranks
    cost = 0.0
    if local > 1:
        cost = cluster.intra.alpha_s + g.nbytes * cluster.intra.beta * (local - 1)
    if cluster.nodes > 1:
        per_nic = -(-local // cluster.nics_per_node) * (p - local)
        cost = max(cost, cluster.inter.alpha_s + g.nbytes * cluster.inter.beta * per_nic)
    return cost + (cluster.gamma * g.nbytes * (p - 1) if g.reduce else 0.0)


def _nic(ranks: Ranks, cluster: Cluster) -> Ranks:
    """The NIC a rank's inter-node traffic uses: its node's NIC number local_rank mod nics_per_node."""
    local, k = cluster.gpus_per_node, cluster.nics_per_node
    return (ranks // local) * k + (ranks % local) % k
