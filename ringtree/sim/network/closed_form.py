"""Closed-form all-reduce times: each algorithm's flows per step, costed by `ringtree.sim.network.flows`.

Every generator here mirrors one schedule generator of `ringtree.schedules` step for step, but
describes a whole phase by arrays of flows instead of enumerating ops, so it runs in
O(p log p) numpy work: 24,576 ranks take well under a second. On one level the totals are the
textbook ones (Thakur, Rabenseifner and Gropp 2005), with n the buffer bytes:
  ring              2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma
  halving_doubling  2 lg p alpha + 2(p-1)/p n beta + (p-1)/p n gamma   (p a power of two)
  ps                2 alpha + 2(p-1) n beta + (p-1) n gamma
  bfb               2 alpha + 2(p-1)/p n beta + (p-1)/p n gamma (p-1 messages per rank and step)
and the pipelined trees take (2 lg p + k - 1) steps of one chunk n/k each (k chunks, as NCCL's tree).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ringtree.schedules.registry import MAX_PIPELINE_CHUNKS, PIPELINE_CHUNK_BYTES
from ringtree.schedules.tree import Tree, double_trees, inorder_tree
from ringtree.sim.network.flows import AllToAll, Chain, FlowGroup, Group, Ranks, step_cost, total_time
from ringtree.sim.network.hardware import Cluster

# p ranks, L ranks per node, N nodes; count elements of `itemsize` bytes; k pipeline chunks.


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _ring_groups(
    ranks: Ranks, block: float, first: int, reduce_scatter: bool, all_gather: bool
) -> list[Group]:
    """Ring reduce-scatter and/or all-gather over `ranks` (several disjoint rings: a 2-D array)."""
    src = ranks.reshape(-1)
    dst = np.roll(ranks, -1, axis=-1).reshape(-1)
    m = ranks.shape[-1]
    out: list[Group] = []
    if m < 2:
        return out
    if reduce_scatter:
        out.append(FlowGroup(src, dst, block, True, first, first + m - 1))
        first += m - 1
    if all_gather:
        out.append(FlowGroup(src, dst, block, False, first, first + m - 1))
    return out


def ring(cluster: Cluster, count: int, itemsize: int) -> list[Group]:
    """2(p-1) steps of one block per rank; with fewer elements than ranks, see `_sparse_ring`."""
    p = cluster.ranks
    groups = _ring_groups(np.arange(p), _ceil_div(count, p) * itemsize, 0, True, True)
    return _sparse_ring(cluster, count, itemsize, groups) if count < p else groups


def _sparse_ring(cluster: Cluster, count: int, itemsize: int, lockstep: list[Group]) -> list[Group]:
    """Fewer elements than ranks: most blocks are empty and the schedule skips empty transfers.

    With a few one-element blocks each travels its own chain of p-1 hops per phase, every hop at
    its own link's cost (block 0's reduce-scatter chain skips the edge 0 -> 1, its all-gather
    chain the edge p-1 -> 0). With nearly p blocks every step is paced by the slowest link, as in
    lockstep. In between, chains delay one another; an empirical blend with weight (count/p)^2 on
    the lockstep cost matches the replay within about 7% (tests/test_sim.py).
    """
    p, local, nodes = cluster.ranks, cluster.gpus_per_node, cluster.nodes
    intra = cluster.intra.alpha_s + itemsize * cluster.intra.beta
    inter = cluster.inter.alpha_s + itemsize * cluster.inter.beta
    edges_inter = nodes if nodes > 1 else 0
    rs_inter = edges_inter - (1 if local == 1 and nodes > 1 else 0)
    ag_inter = max(edges_inter - 1, 0)
    rs = rs_inter * inter + (p - 1 - rs_inter) * intra + (p - 1) * cluster.gamma * itemsize
    ag = ag_inter * inter + (p - 1 - ag_inter) * intra
    w = (count / p) ** 2
    return [
        Chain((1 - w) * rs / (p - 1) + w * step_cost([lockstep[0]], cluster), 0, p - 1),
        Chain((1 - w) * ag / (p - 1) + w * step_cost([lockstep[1]], cluster), p - 1, 2 * p - 2),
    ]


def hierarchical(cluster: Cluster, count: int, itemsize: int) -> list[Group]:
    """Intra-node ring reduce-scatter, ring all-reduce of each shard across nodes, intra all-gather."""
    local, nodes = cluster.gpus_per_node, cluster.nodes
    grid = np.arange(cluster.ranks).reshape(nodes, local)  # grid[node, local rank]
    shard = _ceil_div(count, local)
    intra = (local - 1) if local > 1 else 0
    inter = 2 * (nodes - 1) if nodes > 1 else 0
    return [
        *_ring_groups(grid, shard * itemsize, 0, True, False),
        *_ring_groups(grid.T, _ceil_div(shard, nodes) * itemsize, intra, True, True),
        *_ring_groups(grid, shard * itemsize, intra + inter, False, True),
    ]


def halving_doubling(cluster: Cluster, count: int, itemsize: int) -> list[Group]:
    """Fold the extra ranks into partners, halve, double, unfold (as the Rabenseifner schedule)."""
    p = cluster.ranks
    m2 = 1 << (p.bit_length() - 1)
    r = p - m2
    core = np.concatenate([2 * np.arange(r) + 1, np.arange(2 * r, p)])
    folded = 2 * np.arange(r)
    fold = 1 if r else 0
    out: list[Group] = []
    if r:
        out.append(FlowGroup(folded, folded + 1, count * itemsize, True, 0, 1))
    lg = m2.bit_length() - 1
    v = np.arange(m2)
    for j in range(lg):
        halve, double = m2 >> (j + 1), 1 << j
        for mask, t, reduce in ((halve, fold + j, True), (double, fold + lg + j, False)):
            nbytes = _ceil_div(count * mask, m2) * itemsize
            out.append(FlowGroup(core[v], core[v ^ mask], nbytes, reduce, t, t + 1))
    if r:
        out.append(FlowGroup(folded + 1, folded, count * itemsize, False, fold + 2 * lg, fold + 2 * lg + 1))
    return out


def pipeline_chunks(elements: int, itemsize: int) -> int:
    """How many chunks the schedules cut a pipelined buffer into (`Request.pipeline_bounds`)."""
    nbytes = elements * itemsize
    return min(MAX_PIPELINE_CHUNKS, max(1, _ceil_div(nbytes, PIPELINE_CHUNK_BYTES)), max(1, elements))


def _tree_groups(tree: Tree, elements: int, itemsize: int) -> list[Group]:
    """Pipelined reduce up the tree, broadcast down from step H (the root's height), as the schedule."""
    if elements == 0:
        return []
    k = pipeline_chunks(elements, itemsize)
    chunk = _ceil_div(elements, k) * itemsize
    h, d = tree.heights(), tree.depths()
    lead = h[tree.root]
    up: dict[int, list[tuple[int, int]]] = {}
    down: dict[int, list[tuple[int, int]]] = {}
    for child, parent in tree.parent.items():
        if parent >= 0:
            up.setdefault(h[child], []).append((child, parent))
            down.setdefault(d[parent], []).append((parent, child))
    out: list[Group] = []
    for table, start, reduce in ((up, 0, True), (down, lead, False)):
        for level, pairs in table.items():
            a = np.array(pairs, dtype=np.int64)
            out.append(FlowGroup(a[:, 0], a[:, 1], chunk, reduce, start + level, start + level + k))
    return out


def tree(cluster: Cluster, count: int, itemsize: int) -> list[Group]:
    return _tree_groups(inorder_tree(list(range(cluster.ranks))), count, itemsize)


def double_tree(cluster: Cluster, count: int, itemsize: int) -> list[Group]:
    """Both trees run at once, each on its half of the buffer."""
    half = count // 2
    first, second = double_trees(cluster.ranks)
    return _tree_groups(first, half, itemsize) + _tree_groups(second, count - half, itemsize)


def ps(cluster: Cluster, count: int, itemsize: int) -> list[Group]:
    """Every worker pushes to rank 0, which sums and sends the result back."""
    workers = np.arange(1, cluster.ranks)
    server = np.zeros_like(workers)
    n = count * itemsize
    return [FlowGroup(workers, server, n, True, 0, 1), FlowGroup(server, workers, n, False, 1, 2)]


def bfb(cluster: Cluster, count: int, itemsize: int) -> list[Group]:
    """Balanced fusion buffers: an all-to-all reduce-scatter step, then an all-to-all all-gather step."""
    if cluster.ranks < 2:
        return []
    block = _ceil_div(count, cluster.ranks) * itemsize
    return [AllToAll(block, True, 0, 1), AllToAll(block, False, 1, 2)]


def rails(cluster: Cluster) -> int:
    """How many NICs of a node one collective drives at once: NCCL runs a channel per rail."""
    return max(1, min(cluster.nics_per_node, cluster.gpus_per_node)) if cluster.nodes > 1 else 1


def native(cluster: Cluster, count: int, itemsize: int) -> list[Group]:
    """NCCL's ring all-reduce: one ring per rail, each on its share of the buffer.

    Ring r visits each node's GPUs starting at local rank r, so it leaves node k from local rank
    r-1 and enters node k+1 at local rank r: every ring crosses between nodes on NICs of its own
    (device j uses NIC j mod nics), and the node's NICs carry the traffic together. Inside a node
    every GPU sends one block per ring and step through its one port, as the single ring's block.
    With one NIC per node (or one node) this is the ring: gloo's and one-NIC clusters are unchanged.
    """
    r = rails(cluster)
    if r == 1:
        return ring(cluster, count, itemsize)
    local, nodes = cluster.gpus_per_node, cluster.nodes
    order = (np.arange(local)[None, :] + np.arange(r)[:, None]) % local  # order[ring, i]: local rank
    rings = (np.arange(nodes)[None, :, None] * local + order[:, None, :]).reshape(r, nodes * local)
    block = _ceil_div(_ceil_div(count, r), cluster.ranks) * itemsize
    return _ring_groups(rings, block, 0, True, True)


GROUPS: dict[str, Callable[[Cluster, int, int], list[Group]]] = {
    "ring": ring,
    "halving_doubling": halving_doubling,
    "tree": tree,
    "double_tree": double_tree,
    "hierarchical": hierarchical,
    "ps": ps,
    "bfb": bfb,
}
ALGORITHMS = tuple(GROUPS)
# Algorithms with O(k + log p) steps whose ranks do unequal work per step are costed along their
# dependency paths; the rings, where every step is the same on every rank, in lockstep.
ALONG_PATHS = frozenset({"tree", "double_tree", "ps", "halving_doubling"})


def check_algorithm(algorithm: str) -> str:
    """The schedule an algorithm name replays; 'native' (torch's own all-reduce) replays the ring
    (its closed form, `native`, runs one ring per rail as NCCL does)."""
    if algorithm == "native":
        return "ring"
    if algorithm not in GROUPS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}, native")
    return algorithm


def estimate(algorithm: str, cluster: Cluster, nbytes: int, itemsize: int = 4) -> float:
    """Closed-form seconds for one all-reduce of `nbytes` (whole elements of `itemsize`) on `cluster`."""
    if nbytes < 0:
        raise ValueError(f"bytes must be >= 0, got {nbytes}")
    count = nbytes // itemsize
    if count == 0 or cluster.ranks == 1:
        return 0.0
    name = check_algorithm(algorithm)
    groups = native if algorithm == "native" else GROUPS[name]
    return total_time(groups(cluster, count, itemsize), cluster, name in ALONG_PATHS)
