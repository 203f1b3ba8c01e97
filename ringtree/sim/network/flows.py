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

from ringtree.sim.network.hardware import Cluster

Ranks = npt.NDArray[np.int64]
# Along paths, at most this many crowded resources per step are shared event by event (exact, in
# Python); more (clusters of thousands of ranks) are costed at their whole-step load (numpy).
EXACT_SHARING_MAX = 256


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
    busy = np.zeros(2 * cluster.ranks + 2 * cluster.nodes * cluster.nics_per_node)
    for t0, t1, active in _segments(groups):
        step = StepFlows(active, cluster)
        for _ in range(t1 - t0):
            ready = step.advance(ready, busy)
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
        self.size, self.cluster = size, cluster
        self._shared: SharedResources | None = None
        red = np.bincount(self.dst[reduce], weights=size[reduce], minlength=cluster.ranks)
        self.reduce_s = cluster.gamma * red

    def advance(
        self, ready: npt.NDArray[np.float64], busy: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.float64]:
        """Ready times after this step, from ready times before it.

        A flow starts when both its ends are ready; flows sharing a resource share it only while
        they overlap in time (processor sharing per resource, as the replay), so a flow that
        starts after another has finished does not pay for it. `busy` holds when each resource
        finishes the flows of earlier steps (a NIC serves ranks that are at different steps); it
        is updated in place.
        """
        if self.barrier_s:
            ready = np.full_like(ready, ready.max() + self.barrier_s)
        if self._shared is None:  # built on first use: lockstep costing never needs it
            self._shared = SharedResources(self.src, self.dst, self.size, self.cluster)
        end = self._shared.ends(np.maximum(ready[self.src], ready[self.dst]), busy)
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


class SharedResources:
    """Each flow's two resources (ports inside a node, NICs between nodes), its latency and bytes.

    `ends(start)` gives every flow's end when flow i is posted at start[i]: after its latency it
    streams its bytes at an equal share of each of its resources among the flows streaming there at
    the same time; a flow ends when both of its resources have carried its bytes.
    """

    def __init__(self, src: Ranks, dst: Ranks, size: npt.NDArray[np.float64], cluster: Cluster) -> None:
        local, p = cluster.gpus_per_node, cluster.ranks
        inter = src // local != dst // local
        nics = 2 * p + cluster.nodes * cluster.nics_per_node
        self.out = np.where(inter, 2 * p + _nic(src, cluster), src)
        self.into = np.where(inter, nics + _nic(dst, cluster), p + dst)
        self.alpha = np.where(inter, cluster.inter.alpha_s, cluster.intra.alpha_s)
        self.seconds = size * np.where(inter, cluster.inter.beta, cluster.intra.beta)  # alone on a link
        self.resources = 2 * p + 2 * cluster.nodes * cluster.nics_per_node
        self._order: list[Ranks] = []

    def order(self, side: int) -> Ranks:
        """Flow indices sorted by their resource on one side (0: sending, 1: receiving)."""
        if not self._order:
            self._order = [np.argsort(res, kind="stable") for res in (self.out, self.into)]
        return self._order[side]

    def ends(self, start: npt.NDArray[np.float64], busy: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """Each flow's end; a resource still busy with earlier flows counts their rest as one more job.

        Resources whose flows all start together with equal bytes and find the resource free take
        n x their time (vectorised); the others are shared event by event.
        """
        begin = start + self.alpha
        end = begin + self.seconds
        for side, res in enumerate((self.out, self.into)):
            n = np.bincount(res, minlength=self.resources)
            lo, hi = _extremes(res, begin, self.resources)
            wlo, whi = _extremes(res, self.seconds, self.resources)
            free = busy <= lo
            uniform = (lo == hi) & (wlo == whi) & free
            end = np.maximum(end, np.where(uniform[res], begin + n[res] * self.seconds, end))
            # One flow on a resource still busy: two jobs, the earlier flows' rest and this one.
            one = np.flatnonzero((n[res] == 1) & ~free[res])
            if len(one):
                rest = busy[res[one]] - begin[one]
                _, e = _two_jobs(begin[one], rest, begin[one], self.seconds[one])
                end[one] = np.maximum(end[one], e)
            # Two flows on a free resource, starting apart or of unequal bytes.
            pair = np.flatnonzero(~uniform & free & (n == 2))
            if len(pair):
                order = self.order(side)
                first = np.searchsorted(res[order], pair)
                a, b = order[first], order[first + 1]
                ea, eb = _two_jobs(begin[a], self.seconds[a], begin[b], self.seconds[b])
                end[a], end[b] = np.maximum(end[a], ea), np.maximum(end[b], eb)
            # More flows, or two on a busy resource: shared event by event where there are few such
            # resources; beyond that (thousands of ranks) each flow pays for all (whole-step load).
            crowded = np.flatnonzero(~uniform & (n > 2) | ((n == 2) & ~free))
            if len(crowded) > EXACT_SHARING_MAX:
                hit = np.isin(res, crowded)
                end = np.maximum(end, np.where(hit, begin + n[res] * self.seconds, end))
                continue
            order = self.order(side)
            for r, first in zip(crowded, np.searchsorted(res[order], crowded), strict=True):
                idx = order[first : first + n[r]]
                rest = max(float(busy[r] - lo[r]), 0.0)
                arrive = np.append(begin[idx], lo[r]) if rest else begin[idx]
                work = np.append(self.seconds[idx], rest) if rest else self.seconds[idx]
                end[idx] = np.maximum(end[idx], _processor_sharing(arrive, work)[: len(idx)])
        for res in (self.out, self.into):
            np.maximum.at(busy, res, end)
        return end


def _extremes(
    res: Ranks, values: npt.NDArray[np.float64], size: int
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Per resource, the smallest and largest value among its flows (inf and -inf where none)."""
    lo, hi = np.full(size, np.inf), np.full(size, -np.inf)
    np.minimum.at(lo, res, values)
    np.maximum.at(hi, res, values)
    return lo, hi


def _two_jobs(
    b1: npt.NDArray[np.float64],
    w1: npt.NDArray[np.float64],
    b2: npt.NDArray[np.float64],
    w2: npt.NDArray[np.float64],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """End times of two jobs (arrival b, work w) on one equally shared server, elementwise."""
    swap = b2 < b1
    b1, b2 = np.where(swap, b2, b1), np.where(swap, b1, b2)
    w1, w2 = np.where(swap, w2, w1), np.where(swap, w1, w2)
    r1 = w1 - (b2 - b1)  # what the first job has left when the second arrives
    alone = r1 <= 0
    both = np.minimum(np.maximum(r1, 0.0), w2)
    e1 = np.where(alone, b1 + w1, np.where(r1 <= w2, b2 + 2 * both, b2 + r1 + w2))
    e2 = np.where(alone, b2 + w2, np.where(r1 <= w2, b2 + r1 + w2, b2 + 2 * both))
    return np.where(swap, e2, e1), np.where(swap, e1, e2)


def _processor_sharing(
    begin: npt.NDArray[np.float64], work: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """End times of jobs arriving at `begin` with `work` seconds each on one equally shared server."""
    if begin.min() == begin.max():
        order = np.argsort(work, kind="stable")
        w = work[order]
        n = len(w)
        # With equal arrivals the i-th smallest job ends after sum_{j<i} w_j + (n - i) w_i.
        finish = np.cumsum(np.diff(np.concatenate([[0.0], w])) * (n - np.arange(n)))
        out = np.empty(n)
        out[order] = begin[0] + finish
        return out
    left = work.astype(float).copy()
    out = np.full(len(work), np.inf)
    arrivals = np.argsort(begin, kind="stable")
    now, nxt = float(begin[arrivals[0]]), 0
    active: list[int] = []
    while nxt < len(arrivals) or active:
        while nxt < len(arrivals) and begin[arrivals[nxt]] <= now:
            active.append(int(arrivals[nxt]))
            nxt += 1
        if not active:
            now = float(begin[arrivals[nxt]])
            continue
        n = len(active)
        first = min(active, key=lambda i: left[i])
        done_at = now + left[first] * n
        arrive_at = float(begin[arrivals[nxt]]) if nxt < len(arrivals) else np.inf
        until = min(done_at, arrive_at)
        for i in active:
            left[i] -= (until - now) / n
        now = until
        if done_at <= arrive_at:
            out[first] = now
            active.remove(first)
    return out
