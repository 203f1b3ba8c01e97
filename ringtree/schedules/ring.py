"""Ring algorithms: reduce-scatter and all-gather around a ring, and pipelined chains."""

from __future__ import annotations

from ringtree.schedules.base import Builder

# m ring members, i a member's position on the ring, s a step of the phase.


def ring_reduce_scatter(b: Builder, ranks: list[int], bounds: list[int]) -> int:
    """m-1 steps; afterwards ranks[i] holds block i (bounds[i]:bounds[i+1]) fully reduced.

    At step s member i sends block (i-s-1) mod m to member i+1, which reduces it into its own.
    """
    m = len(ranks)
    for s in range(m - 1):
        for i in range(m):
            blk = (i - s - 1) % m
            b.transfer(s, ranks[i], ranks[(i + 1) % m], bounds[blk], bounds[blk + 1], reduce=True)
    return m - 1


def ring_all_gather(b: Builder, ranks: list[int], bounds: list[int]) -> int:
    """m-1 steps; ranks[i] starts with block i and ends with every block."""
    m = len(ranks)
    for s in range(m - 1):
        for i in range(m):
            blk = (i - s) % m
            b.transfer(s, ranks[i], ranks[(i + 1) % m], bounds[blk], bounds[blk + 1], reduce=False)
    return m - 1


def ring_all_reduce(b: Builder, ranks: list[int], bounds: list[int]) -> int:
    """Reduce-scatter then all-gather: 2(m-1) steps, each member sends 2(m-1)/m of the buffer."""
    return b.sequence(
        lambda: ring_reduce_scatter(b, ranks, bounds),
        lambda: ring_all_gather(b, ranks, bounds),
    )


def chain(b: Builder, ranks: list[int], bounds: list[int], reduce: bool) -> int:
    """Pipelined chain ranks[0] -> ranks[1] -> ... ; k = len(bounds)-1 pipeline chunks.

    Chunk c leaves position j at step c + j: a broadcast (reduce=False) from ranks[0], or a
    reduction (reduce=True) that ends, complete, on ranks[-1].
    """
    k = len(bounds) - 1
    for j in range(len(ranks) - 1):
        for c in range(k):
            b.transfer(c + j, ranks[j], ranks[j + 1], bounds[c], bounds[c + 1], reduce=reduce)
    return k + len(ranks) - 2 if len(ranks) > 1 else 0
