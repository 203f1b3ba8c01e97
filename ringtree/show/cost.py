"""The alpha-beta cost of a walked schedule, with the numbers filled in, and the simulator's time for it.

Every step costs its slowest message, alpha + bytes x beta (bytes counted on the busiest port, as
`ringtree.sim.network.flows` counts them), so a schedule of S steps costs S alpha + B beta, B the sum over
steps of the slowest message's bytes. With ranks on several nodes each step is charged to the
link its slowest message uses. The simulator's event replay adds link sharing in time and the
reduction cost gamma.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ringtree.schedules import OpKind
from ringtree.show.steps import Walkthrough
from ringtree.sim.network.allreduce import AUTO_REPLAY_MAX_RANKS
from ringtree.sim.network.closed_form import estimate
from ringtree.sim.network.flows import FlowGroup, StepFlows
from ringtree.sim.network.hardware import Cluster, Link, parse_link
from ringtree.sim.network.presets import LINKS
from ringtree.sim.network.replay import Replay

# Textbook totals (Thakur, Rabenseifner and Gropp 2005; NCCL's trees), n the buffer bytes,
# k the pipeline chunks, H a tree's height, L ranks per node, N nodes.
TEXTBOOK: dict[tuple[str, str], str] = {
    ("all_reduce", "ring"): "2(p-1)·α + 2(p-1)/p·n·β",
    ("all_reduce", "halving_doubling"): "2·lg(p)·α + 2(p-1)/p·n·β   (p a power of two)",
    ("all_reduce", "tree"): "(2H + k - 1)·(α + n/k·β)   (k chunks of n/k, H = tree height)",
    ("all_reduce", "double_tree"): "(2H + k - 1)·(α + n/(2k)·β)   (each tree carries n/2 in k chunks)",
    (
        "all_reduce",
        "hierarchical",
    ): "2(L-1)·α + 2(L-1)/L·n·β inside nodes + 2(N-1)·α + 2(N-1)/N·(n/L)·β across",
    ("all_reduce", "ps"): "2·α + 2(p-1)·n·β   (the server's port carries every worker's n)",
    ("all_reduce", "bfb"): "2·α + 2(p-1)/p·n·β   (p-1 messages per rank and step)",
    ("reduce_scatter", "ring"): "(p-1)·α + (p-1)/p·n·β",
    ("reduce_scatter", "halving_doubling"): "lg(p)·α + (p-1)/p·n·β   (p a power of two)",
    ("reduce_scatter", "bfb"): "α + (p-1)/p·n·β",
    ("all_gather", "ring"): "(p-1)·α + (p-1)/p·n·β",
    ("all_gather", "halving_doubling"): "lg(p)·α + (p-1)/p·n·β   (p a power of two)",
    ("all_gather", "bfb"): "α + (p-1)/p·n·β",
    ("broadcast", "ring"): "(p + k - 2)·(α + n/k·β)   (pipelined chain, k chunks)",
    ("broadcast", "tree"): "(D + k - 1)·(α + 2·n/k·β)   (D = tree depth, two children per node)",
    ("broadcast", "ps"): "α + (p-1)·n·β   (the root sends n to everyone)",
    ("reduce", "ring"): "(p + k - 2)·(α + n/k·β)   (pipelined chain, k chunks)",
    ("reduce", "tree"): "(H + k - 1)·(α + 2·n/k·β)   (H = tree height, two children per node)",
    ("reduce", "ps"): "α + (p-1)·n·β   (everyone sends n to the root)",
}


@dataclass(frozen=True)
class LevelTerms:
    """Steps charged to one link and the bytes of their slowest messages: steps·α + nbytes·β."""

    link: Link
    steps: int
    nbytes: float

    @property
    def alpha_s(self) -> float:
        return self.steps * self.link.alpha_s

    @property
    def beta_s(self) -> float:
        return self.nbytes * self.link.beta


@dataclass(frozen=True)
class Cost:
    """The filled-in alpha-beta cost, the textbook formula, and the simulator's time."""

    levels: tuple[LevelTerms, ...]
    textbook: str | None
    simulated_s: float | None
    method: str  # how simulated_s was found: the event replay, the closed form, or "" (none)

    @property
    def total_s(self) -> float:
        return sum(lv.alpha_s + lv.beta_s for lv in self.levels)


def make_cluster(p: int, nodes: int, link: str, intra: str | None) -> Cluster:
    """One node: every rank pair uses `link`. Several: `link` between nodes, `intra` inside them."""
    if intra is not None and nodes == 1:
        raise ValueError("--intra names the link inside a node; it needs --nodes 2 or more")
    between = parse_link(link, LINKS)
    inside = parse_link(intra, LINKS) if intra is not None else LINKS["pcie-gen3"] if nodes > 1 else between
    return Cluster(nodes, p // nodes, inside, between)


def cost(w: Walkthrough, cluster: Cluster) -> Cost:
    """Charge every step to its slowest message (the simulator's per-flow cost), then simulate."""
    charged: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    local = cluster.gpus_per_node
    for t in range(w.schedule.num_steps):
        flows = _flows(w, t)
        if not flows:
            continue
        step = StepFlows(flows, cluster)
        k = int(np.argmax(step.cost))
        inter = int(step.src[k]) // local != int(step.dst[k]) // local
        link = cluster.inter if inter else cluster.intra
        charged[link.name][0] += 1
        charged[link.name][1] += round((float(step.cost[k]) - link.alpha_s) / link.beta)
    levels = tuple(
        LevelTerms(link, int(charged[link.name][0]), charged[link.name][1])
        for link in dict.fromkeys((cluster.intra, cluster.inter))
        if link.name in charged
    )
    simulated, method = _simulate(w, cluster)
    return Cost(levels, TEXTBOOK.get((w.schedule.collective, w.schedule.algorithm)), simulated, method)


def _flows(w: Walkthrough, t: int) -> list[FlowGroup]:
    """Step t's messages as flow groups of equal size (the simulator's input)."""
    by_size: dict[tuple[int, bool], list[tuple[int, int]]] = defaultdict(list)
    steps = w.schedule.steps
    for r, rank in enumerate(steps):
        for op in rank[t]:
            if op.kind is OpKind.SEND:  # r -> op.peer; reduced there if its matching receive reduces
                reduce = any(
                    o.kind is OpKind.RECV_REDUCE and o.peer == r and o.start == op.start
                    for o in steps[op.peer][t]
                )
                by_size[(op.numel * w.itemsize, reduce)].append((r, op.peer))
    return [
        FlowGroup(np.array([a for a, _ in pairs]), np.array([b for _, b in pairs]), float(n), red, t, t + 1)
        for (n, red), pairs in by_size.items()
    ]


def _simulate(w: Walkthrough, cluster: Cluster) -> tuple[float | None, str]:
    """The event replay of this very schedule up to 64 ranks; the closed form of all-reduces beyond."""
    if w.p <= AUTO_REPLAY_MAX_RANKS:
        return Replay(w.schedule, cluster, w.itemsize).run(), "event replay of this schedule"
    if w.schedule.collective == "all_reduce":
        return estimate(
            w.schedule.algorithm, cluster, w.nbytes, w.itemsize
        ), f"closed form of {w.schedule.algorithm}"
    return None, ""
