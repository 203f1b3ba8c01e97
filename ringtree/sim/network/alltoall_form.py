"""Closed-form all-to-all times: each algorithm's flows per step, costed by `ringtree.sim.network.flows`.

Every generator here mirrors one all-to-all schedule of `ringtree.schedules.alltoall` step for
step, with a step's blocks to one peer taken as one message (as the executor packs them), and
describes each step by arrays of flows (or, where every rank does the same, by its busiest
resource's load) instead of enumerating p^2 blocks. With b = n/p bytes per block of an n-byte
buffer, on one level without sharing:
  linear        alpha + (p-1) b beta                    (all p-1 messages at once, one port)
  pairwise      (p-1) (alpha + b beta)                  (one partner per step)
  bruck         ceil(lg p) alpha + sum_i m_i b beta     (m_i of the p-1 blocks have bit i set: ~p/2)
  hierarchical  alpha + (L-1) N b beta_intra + alpha + (N-1) L b beta_inter  (N nodes of L)
Across nodes a NIC carries the messages of the ranks that share it (device j uses NIC j mod nics).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ringtree.sim.network.flows import AllToAll, Chain, FlowGroup, Group
from ringtree.sim.network.hardware import Cluster

# p ranks, L ranks per node, N nodes, b bytes per block (one rank's buffer over p).


def _is_power_of_two(p: int) -> bool:
    return p & (p - 1) == 0


def pairwise(cluster: Cluster, block: float) -> list[Group]:
    """p-1 steps; at step s rank r sends to r XOR s (p a power of two) or r+s (otherwise)."""
    p = cluster.ranks
    r = np.arange(p)
    out: list[Group] = []
    for s in range(1, p):
        to = r ^ s if _is_power_of_two(p) else (r + s) % p
        out.append(FlowGroup(r, to, block, False, s - 1, s))
    return out


def bruck_blocks(p: int, i: int) -> int:
    """How many of the distances 1..p-1 have bit i set: the blocks one rank sends at step i."""
    hop = 1 << i
    return (p >> (i + 1)) * hop + max(0, p % (2 * hop) - hop)


def bruck(cluster: Cluster, block: float) -> list[Group]:
    """ceil(lg p) steps; at step i every rank sends its blocks with bit i of the distance set to r + 2^i."""
    p = cluster.ranks
    r = np.arange(p)
    return [
        FlowGroup(r, (r + (1 << i)) % p, block * bruck_blocks(p, i), False, i, i + 1)
        for i in range((p - 1).bit_length())
    ]


def linear(cluster: Cluster, block: float) -> list[Group]:
    """One step: every rank sends one block to each of the p-1 others at once."""
    return [AllToAll(block, False, 0, 1)] if cluster.ranks > 1 else []


def exchange_s(cluster: Cluster, intra: int, intra_bytes: float, inter: int, inter_bytes: float) -> float:
    """One step in which every rank sends `intra` messages inside its node and `inter` across:
    the busier of its port and its NIC (which the rails j, j + nics, ... share)."""
    per_nic = -(-cluster.gpus_per_node // cluster.nics_per_node)
    cost = 0.0
    if intra:
        cost = cluster.intra.alpha_s + intra * intra_bytes * cluster.intra.beta
    if inter:
        cost = max(cost, cluster.inter.alpha_s + per_nic * inter * inter_bytes * cluster.inter.beta)
    return cost


def hierarchical(cluster: Cluster, block: float) -> list[Group]:
    """Inside each node (N blocks to each local peer), then across nodes per rail (L blocks a message)."""
    local, nodes = cluster.gpus_per_node, cluster.nodes
    steps = (
        exchange_s(cluster, local - 1, nodes * block, 0, 0.0),
        exchange_s(cluster, 0, 0.0, nodes - 1, local * block),
    )
    return [Chain(s, t, t + 1) for t, s in enumerate(steps) if s > 0] if cluster.ranks > 1 else []


def one_partner_s(cluster: Cluster, groups: list[Group]) -> float | None:
    """Seconds of steps in which every rank sends one message and receives one (pairwise, Bruck),
    along each rank's dependency path, where no two flows ever share a port or NIC (one NIC per
    GPU, or one node); None where they may (`flows.total_time` shares them event by event).

    A flow starts when both its ends have finished their previous step, takes alpha + bytes x beta
    of its link alone, and a rank's step ends with the later of its send and its receive: O(p)
    numpy work per step, so 4,096 ranks' 4,095 pairwise steps take a fraction of a second.
    """
    if cluster.nodes > 1 and cluster.nics_per_node < cluster.gpus_per_node:
        return None
    local = cluster.gpus_per_node
    ready = np.zeros(cluster.ranks)
    for g in groups:
        assert isinstance(g, FlowGroup) and g.stop == g.first + 1 and len(g.src) == cluster.ranks
        inter = g.src // local != g.dst // local
        alpha = np.where(inter, cluster.inter.alpha_s, cluster.intra.alpha_s)
        end = (
            np.maximum(ready[g.src], ready[g.dst])
            + alpha
            + g.nbytes * np.where(inter, cluster.inter.beta, cluster.intra.beta)
        )
        done = np.empty_like(ready)
        done[g.src] = end  # each rank sends once ...
        np.maximum.at(done, g.dst, end)  # ... and receives once
        ready = done
    return float(ready.max(initial=0.0))


GROUPS: dict[str, Callable[[Cluster, float], list[Group]]] = {
    "pairwise": pairwise,
    "bruck": bruck,
    "linear": linear,
    "hierarchical": hierarchical,
}
ALGORITHMS = tuple(GROUPS)
# Algorithms whose ranks cross different links at one step are costed along their dependency
# paths (a rank that exchanged over NVLink starts its next step before one that used the network).
ALONG_PATHS = frozenset({"pairwise", "bruck"})
