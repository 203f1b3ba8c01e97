"""Parameter servers: one central server (`ps`), or the buffer sharded over every rank (`bfb`)."""

from __future__ import annotations

from ringtree.schedules.base import Builder


def gather_to(b: Builder, ranks: list[int], server: int, start: int, stop: int, reduce: bool) -> int:
    """One step: every rank sends [start, stop) to the server (which reduces it, or keeps it)."""
    for r in ranks:
        b.transfer(0, r, server, start, stop, reduce=reduce)
    return 1


def scatter_from(b: Builder, ranks: list[int], server: int, start: int, stop: int) -> int:
    """One step: the server sends [start, stop) to every other rank."""
    for r in ranks:
        b.transfer(0, server, r, start, stop, reduce=False)
    return 1


def ps_all_reduce(b: Builder, ranks: list[int], server: int, start: int, stop: int) -> int:
    """Push every gradient to one server, which sums and sends the result back: 2 steps.

    The server's link carries 2(p-1) whole buffers per all-reduce, the bottleneck of this design.
    """
    return b.sequence(
        lambda: gather_to(b, ranks, server, start, stop, reduce=True),
        lambda: scatter_from(b, ranks, server, start, stop),
    )


def bfb_reduce_scatter(b: Builder, ranks: list[int], bounds: list[int]) -> int:
    """Balanced fusion buffers, first half: ranks[j] serves block j and receives it from everyone."""
    for j, server in enumerate(ranks):
        gather_to(b, ranks, server, bounds[j], bounds[j + 1], reduce=True)
    return 1


def bfb_all_gather(b: Builder, ranks: list[int], bounds: list[int]) -> int:
    """Balanced fusion buffers, second half: ranks[j] sends its block j to everyone."""
    for j, server in enumerate(ranks):
        scatter_from(b, ranks, server, bounds[j], bounds[j + 1])
    return 1


def bfb_all_reduce(b: Builder, ranks: list[int], bounds: list[int]) -> int:
    """A sharded parameter server: every rank serves 1/p of the buffer, so no link is a hot spot."""
    return b.sequence(
        lambda: bfb_reduce_scatter(b, ranks, bounds),
        lambda: bfb_all_gather(b, ranks, bounds),
    )
