"""The 2D hierarchical ring: intra-node reduce-scatter, inter-node all-reduce per shard, intra all-gather."""

from __future__ import annotations

from ringtree.schedules.base import Builder, split
from ringtree.schedules.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from ringtree.topology import Topology


def hierarchical_all_reduce(b: Builder, topo: Topology, start: int, stop: int) -> int:
    """Every node cuts the buffer into L shards (L ranks per node); local rank j ends with shard j
    reduced inside its node, rings shard j with local rank j of every other node, then the node
    all-gathers. Only 1/L of the buffer crosses the inter-node network from each rank.
    """
    local = topo.local_world_size
    bounds = split(start, stop, local)
    nodes = [topo.node_ranks(n) for n in range(topo.nodes)]
    rails = [topo.cross_node_ranks(j) for j in range(local)]

    def intra_reduce_scatter() -> int:
        return max(ring_reduce_scatter(b, ranks, bounds) for ranks in nodes)

    def inter_all_reduce() -> int:
        return max(
            ring_all_reduce(b, rail, split(bounds[j], bounds[j + 1], len(rail)))
            for j, rail in enumerate(rails)
        )

    def intra_all_gather() -> int:
        return max(ring_all_gather(b, ranks, bounds) for ranks in nodes)

    return b.sequence(intra_reduce_scatter, inter_all_reduce, intra_all_gather)
