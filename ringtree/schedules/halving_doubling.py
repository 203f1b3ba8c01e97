"""Recursive halving and doubling (Rabenseifner), with the usual fold for non-powers of two."""

from __future__ import annotations

from ringtree.schedules.base import Builder, split

# m members; m2 the largest power of two <= m; r = m - m2 members fold into a partner.
# v a member's index among the m2 "core" members; mask the distance of an exchange.


def core_members(ranks: list[int]) -> tuple[list[int], list[int]]:
    """(core, folded): of the first 2r members, the odd ones stay in the core, the even fold."""
    m = len(ranks)
    m2 = 1 << (m.bit_length() - 1)
    r = m - m2
    core = [ranks[2 * i + 1] for i in range(r)] + ranks[2 * r :]
    folded = [ranks[2 * i] for i in range(r)]
    return core, folded


def core_bounds(bounds: list[int]) -> list[int]:
    """Per-member block bounds grouped into per-core-member bounds (a folded pair shares one)."""
    m = len(bounds) - 1
    m2 = 1 << (m.bit_length() - 1)
    r = m - m2
    return [bounds[2 * j] if j <= r else bounds[j + r] for j in range(m2 + 1)]


def recursive_halving(b: Builder, core: list[int], bounds: list[int]) -> int:
    """lg(m2) steps; core[v] ends holding block v reduced over the core. Largest distance first."""
    m2 = len(core)
    steps = 0
    mask = m2 // 2
    while mask:
        for v in range(m2):
            lo = v & ~(2 * mask - 1)
            give = lo if v & mask else lo + mask  # the half that holds the partner's block
            b.transfer(steps, core[v], core[v ^ mask], bounds[give], bounds[give + mask], reduce=True)
        mask //= 2
        steps += 1
    return steps


def recursive_doubling(b: Builder, core: list[int], bounds: list[int]) -> int:
    """lg(m2) steps; core[v] starts with block v and ends with every block."""
    m2 = len(core)
    steps = 0
    mask = 1
    while mask < m2:
        for v in range(m2):
            lo = v & ~(mask - 1)
            b.transfer(steps, core[v], core[v ^ mask], bounds[lo], bounds[lo + mask], reduce=False)
        mask *= 2
        steps += 1
    return steps


def fold_in(b: Builder, ranks: list[int], start: int, stop: int, reduce: bool) -> int:
    """One step: each folded member hands [start, stop) to its core partner."""
    _, folded = core_members(ranks)
    for i, rank in enumerate(folded):
        b.transfer(0, rank, ranks[2 * i + 1], start, stop, reduce=reduce)
    return 1 if folded else 0


def fold_out(b: Builder, ranks: list[int], bounds_of: list[tuple[int, int]]) -> int:
    """One step: each core partner returns bounds_of[i] to folded member i."""
    _, folded = core_members(ranks)
    for i, rank in enumerate(folded):
        start, stop = bounds_of[i]
        b.transfer(0, ranks[2 * i + 1], rank, start, stop, reduce=False)
    return 1 if folded else 0


def rabenseifner_all_reduce(b: Builder, ranks: list[int], start: int, stop: int) -> int:
    """Fold, halving reduce-scatter, doubling all-gather, unfold: 2 lg(m2) steps (+2 if folded)."""
    core, folded = core_members(ranks)
    bounds = split(start, stop, len(core))
    return b.sequence(
        lambda: fold_in(b, ranks, start, stop, reduce=True),
        lambda: recursive_halving(b, core, bounds),
        lambda: recursive_doubling(b, core, bounds),
        lambda: fold_out(b, ranks, [(start, stop)] * len(folded)),
    )


def halving_reduce_scatter(b: Builder, ranks: list[int], bounds: list[int]) -> int:
    """Member i ends holding block i reduced: fold, recursive halving, hand back the folded block."""
    core, folded = core_members(ranks)
    return b.sequence(
        lambda: fold_in(b, ranks, bounds[0], bounds[-1], reduce=True),
        lambda: recursive_halving(b, core, core_bounds(bounds)),
        lambda: fold_out(b, ranks, [(bounds[2 * i], bounds[2 * i + 1]) for i in range(len(folded))]),
    )


def doubling_all_gather(b: Builder, ranks: list[int], bounds: list[int]) -> int:
    """Member i starts with block i: fold its block in, recursive doubling, hand everything back."""
    core, folded = core_members(ranks)

    def fold_blocks() -> int:
        for i, rank in enumerate(folded):
            b.transfer(0, rank, ranks[2 * i + 1], bounds[2 * i], bounds[2 * i + 1], reduce=False)
        return 1 if folded else 0

    return b.sequence(
        fold_blocks,
        lambda: recursive_doubling(b, core, core_bounds(bounds)),
        lambda: fold_out(b, ranks, [(bounds[0], bounds[-1])] * len(folded)),
    )
