"""All-to-all schedules: pairwise exchange, Bruck, linear (all at once) and hierarchical (two hops).

All-to-all moves blocks, it reduces nothing: rank i sends block (i, j) of its input to rank j,
which stores it as block i of its output. Its schedules use the same `Op`s on chunk ranges as
every other collective, in one address space shared by every rank: the block matrix. Block
(i, j) has its own range `[bounds[i*p + j], bounds[i*p + j + 1])` of a virtual buffer of
`sum(splits)` elements, the same range on every rank that ever holds it. Rank i starts with row
i (its input), must end with column i (its output), and holds a block of another row and column
only while it forwards it (Bruck, hierarchical): the executor keeps such blocks in scratch. So
a block may travel through intermediate ranks, every send still matches its receive range for
range, and the verifier checks deliveries as for every collective. Variable splits are only
other bounds: every rank knows the whole matrix (the call exchanges it first).

Conventions: p ranks, r a rank, `splits[i*p + j]` elements from rank i to rank j.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from ringtree.schedules.base import Builder, split
from ringtree.topology import Topology


def block_bounds(splits: Sequence[int]) -> list[int]:
    """p*p + 1 offsets of the block matrix, row-major: block (i, j) at index i*p + j."""
    return [0, *itertools.accumulate(splits)]


def equal_splits(p: int, count: int) -> tuple[int, ...]:
    """Every rank cuts its `count` elements into p near-equal blocks, one per destination."""
    sizes = [b - a for a, b in itertools.pairwise(split(0, count, p))]
    return tuple(sizes * p)


class Blocks:
    """The block matrix of one call: where block (src, dst) lies in the shared address space."""

    def __init__(self, p: int, splits: Sequence[int]) -> None:
        if len(splits) != p * p:
            raise ValueError(f"all_to_all needs p*p = {p * p} split sizes, got {len(splits)}")
        if any(s < 0 for s in splits):
            raise ValueError(f"all_to_all split sizes must be >= 0, got {list(splits)}")
        self.p = p
        self.bounds = block_bounds(splits)

    def range(self, src: int, dst: int) -> tuple[int, int]:
        k = src * self.p + dst
        return self.bounds[k], self.bounds[k + 1]

    def move(self, b: Builder, t: int, via: int, to: int, src: int, dst: int) -> None:
        """At step t rank `via` sends block (src, dst) to rank `to` (nothing if it is empty)."""
        b.transfer(t, via, to, *self.range(src, dst), reduce=False)


def pairwise(b: Builder, blocks: Blocks) -> int:
    """p-1 steps; at step s rank r exchanges with r XOR s (p a power of two, partners pair up)
    or sends to r+s and receives from r-s (otherwise), MPICH's pairwise exchange."""
    p = blocks.p
    for s in range(1, p):
        for r in range(p):
            to = r ^ s if p & (p - 1) == 0 else (r + s) % p
            blocks.move(b, s - 1, r, to, r, to)
    return p - 1


def linear(b: Builder, blocks: Blocks) -> int:
    """One step: every rank posts all its sends and receives at once, in shifted order (to r+1,
    r+2, ... and from r-1, r-2, ...), as gloo's alltoallv and NCCL's grouped send/receive do."""
    p = blocks.p
    for s in range(1, p):
        for r in range(p):
            blocks.move(b, 0, r, (r + s) % p, r, (r + s) % p)
    return 1 if p > 1 else 0


def bruck(b: Builder, blocks: Blocks) -> int:
    """ceil(log2 p) steps of store and forward (Bruck et al., 1997).

    Rank r numbers its blocks by distance k = (dst - r) mod p (the local rotation). At step i it
    sends every block whose distance has bit i set to rank r + 2^i, which keeps the distance; a
    block thus hops along the binary digits of its distance. After the steps with bits below i,
    rank x holds at distance k the block from x - (k mod 2^i) to x - (k mod 2^i) + k; once every
    bit is done that is block (x - k, x), the inverse rotation. Each step is one message per rank
    (the executor packs a step's blocks to one peer into one message) of about half the blocks.
    """
    p = blocks.p
    steps = (p - 1).bit_length()
    for i in range(steps):
        hop = 1 << i
        for x in range(p):
            for k in range(1, p):
                if k & hop:
                    src = (x - (k % hop)) % p
                    blocks.move(b, i, x, (x + hop) % p, src, (src + k) % p)
    return steps


def hierarchical(b: Builder, blocks: Blocks, topo: Topology) -> int:
    """Two hops: inside each node, then one exchange per rail across nodes (NCCL's PXN, DeepEP).

    Step 0: rank (n, l) gives local rank l' of its own node every block bound for local rank l'
    of any node. Step 1: rank (n, l') sends node n'' in one message everything its node has for
    rank (n'', l'). Across nodes a rank sends nodes-1 messages, each g = local_world_size times
    larger, instead of (nodes-1)*g.
    """
    g, p = topo.local_world_size, blocks.p
    for r in range(p):
        for dst in range(p):
            via = topo.node_of(r) * g + topo.local_rank_of(dst)
            blocks.move(b, 0, r, via, r, dst)  # nothing when via == r
            blocks.move(b, 1, via, dst, r, dst)  # nothing when via == dst
    return 2 if p > 1 else 0
