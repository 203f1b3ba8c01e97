"""Event replay: run the very schedule the executor runs over the modelled cluster, in virtual time.

The rules (the executor's, with links in place of sockets):
  * a rank posts all operations of step t once it has finished step t-1 and its reductions;
  * a message starts when both its sender and its receiver have posted it: after the link's
    latency alpha it streams its bytes at its share of the bandwidth;
  * sharing is equal-share per resource: a resource (a device's port into its node's fabric in
    each direction, a NIC in each direction) split between n flows gives each 1/n of its
    bandwidth, and a flow runs at the rate of its tighter resource. Rates change whenever a flow
    starts or ends on one of its resources;
  * a rank's step ends when its last message ends, and it then reduces what it received with
    RECV_REDUCE, at gamma seconds per byte.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Iterator
from contextlib import contextmanager

from ringtree.schedules import OpKind, Request, Schedule, build
from ringtree.sim.network.hardware import Cluster

_ACTIVATE, _FINISH = 0, 1
_SEND, _RECV_REDUCE = int(OpKind.SEND), int(OpKind.RECV_REDUCE)


@contextmanager
def _paused_gc() -> Iterator[None]:
    """Millions of small op tuples make the cyclic collector run again and again; none form cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def replay_all_reduce(algorithm: str, cluster: Cluster, nbytes: int, itemsize: int = 4) -> float:
    """Seconds for one all-reduce of `nbytes`: build the executor's schedule and replay it."""
    if nbytes < 0:
        raise ValueError(f"bytes must be >= 0, got {nbytes}")
    return replay_schedule("all_reduce", algorithm, cluster, nbytes // itemsize, itemsize)


def replay_schedule(
    collective: str, algorithm: str, cluster: Cluster, count: int, itemsize: int = 4
) -> float:
    """Seconds for one collective of `count` elements per rank: build its schedule and replay it."""
    request = Request(collective, algorithm, cluster.topology, count, itemsize)
    with _paused_gc():
        return Replay(build.__wrapped__(request), cluster, itemsize).run()


class Replay:
    """One replay of a schedule; `run()` returns the time the last rank finishes."""

    def __init__(self, schedule: Schedule, cluster: Cluster, itemsize: int) -> None:
        if schedule.world_size != cluster.ranks:
            raise ValueError(
                f"schedule has {schedule.world_size} ranks but the cluster {cluster.ranks}: "
                "build it for cluster.topology"
            )
        self.steps, self.cluster, self.itemsize = schedule.steps, cluster, itemsize
        p, local, k = cluster.ranks, cluster.gpus_per_node, cluster.nics_per_node
        nics = cluster.nodes * k
        # Resources: 0..p-1 device out-ports, p..2p-1 in-ports, then NIC outs, then NIC ins.
        self.capacity = [cluster.intra.bandwidth_Bps] * (2 * p) + [cluster.inter.bandwidth_Bps] * (2 * nics)
        self.members: list[set[int]] = [set() for _ in self.capacity]
        self.nic = [2 * p + (r // local) * k + (r % local) % k for r in range(p)]
        self.nic_in = nics
        self.cur, self.pending = [-1] * p, [0] * p
        self.reduce_s, self.done = [0.0] * p, [0.0] * p
        self.reached = [0.0] * p  # when each rank became ready for its current step
        self.heap: list[tuple[float, int, int, int]] = []  # (time, flow, kind, version)
        # Per flow: its two resources, ranks, bytes left, rate, time of the last update, version.
        self.res: list[tuple[int, int]] = []
        self.ends: list[tuple[int, int]] = []
        self.left: list[float] = []
        self.rate: list[float] = []
        self.last: list[float] = []
        self.version: list[int] = []

    def run(self) -> float:
        for r in range(len(self.steps)):
            self._advance(r, 0.0)
        while self.heap:
            now = self.heap[0][0]
            dirty: set[int] = set()
            limit = now * (1 + 1e-12) + 1e-18  # events this close together form one batch
            while self.heap and self.heap[0][0] <= limit:
                _, f, kind, version = heapq.heappop(self.heap)
                if kind == _ACTIVATE:
                    self._activate(f, now, dirty)
                elif version == self.version[f]:
                    self._finish(f, now, dirty)
            self._rerate(dirty, now)
        return max(self.done, default=0.0)

    def _advance(self, r: int, ready: float) -> None:
        """Rank r is ready for its next step at `ready`: post that step's ops (or finish).

        Of a message's two ends, the one that posts second finds the other already at this step
        and starts the message; ranks post in event order, so that is always well defined.
        """
        steps, cur, reached = self.steps[r], self.cur, self.reached
        t = cur[r] + 1
        while t < len(steps) and not steps[t]:
            t += 1
        cur[r], reached[r] = t, ready
        if t == len(steps):
            self.done[r] = ready
            return
        ops = steps[t]
        self.pending[r] = len(ops)
        reduced = 0
        for kind, peer, start, stop in ops:
            if kind == _RECV_REDUCE:
                reduced += stop - start
            if cur[peer] == t:
                src, dst = (r, peer) if kind == _SEND else (peer, r)
                self._post(src, dst, (stop - start) * self.itemsize, max(ready, reached[peer]))
        self.reduce_s[r] = reduced * self.itemsize * self.cluster.gamma

    def _post(self, src: int, dst: int, nbytes: float, ready: float) -> None:
        """Both ends are ready at `ready`: the flow joins its links after the latency."""
        cluster = self.cluster
        local = cluster.gpus_per_node
        if src // local == dst // local:
            res, alpha = (src, cluster.ranks + dst), cluster.intra.alpha_s
        else:
            res, alpha = (self.nic[src], self.nic[dst] + self.nic_in), cluster.inter.alpha_s
        f = len(self.res)
        self.res.append(res)
        self.ends.append((src, dst))
        self.left.append(float(nbytes))
        self.rate.append(0.0)
        self.last.append(ready + alpha)
        self.version.append(0)
        heapq.heappush(self.heap, (ready + alpha, f, _ACTIVATE, 0))

    def _activate(self, f: int, now: float, dirty: set[int]) -> None:
        for res in self.res[f]:
            self.members[res].add(f)
            dirty.add(res)

    def _finish(self, f: int, now: float, dirty: set[int]) -> None:
        for res in self.res[f]:
            self.members[res].discard(f)
            dirty.add(res)
        self.version[f] = -1
        for r in self.ends[f]:
            self.pending[r] -= 1
            if self.pending[r] == 0:
                self._advance(r, now + self.reduce_s[r])

    def _rerate(self, dirty: set[int], now: float) -> None:
        """New equal shares for every flow on a resource whose membership changed."""
        touched = set().union(*(self.members[res] for res in dirty)) if dirty else set()
        cap, members = self.capacity, self.members
        for f in touched:
            a, b = self.res[f]
            rate = min(cap[a] / len(members[a]), cap[b] / len(members[b]))
            if rate == self.rate[f]:
                continue
            self.left[f] -= self.rate[f] * (now - self.last[f])
            self.last[f], self.rate[f] = now, rate
            self.version[f] += 1
            end = now + max(self.left[f], 0.0) / rate
            heapq.heappush(self.heap, (end, f, _FINISH, self.version[f]))
