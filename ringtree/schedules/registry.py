"""Which schedule generator implements each (collective, algorithm) pair."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

from ringtree.schedules import alltoall
from ringtree.schedules.base import Builder, Schedule, split
from ringtree.schedules.halving_doubling import (
    doubling_all_gather,
    halving_reduce_scatter,
    rabenseifner_all_reduce,
)
from ringtree.schedules.hierarchical import hierarchical_all_reduce
from ringtree.schedules.ring import chain, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from ringtree.schedules.server import (
    bfb_all_gather,
    bfb_all_reduce,
    bfb_reduce_scatter,
    gather_to,
    ps_all_reduce,
    scatter_from,
)
from ringtree.schedules.tree import (
    double_trees,
    inorder_tree,
    rooted_tree,
    tree_all_reduce,
    tree_broadcast,
    tree_reduce,
)
from ringtree.topology import Topology

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")

# Pipelined trees and chains cut each buffer into chunks of about this size. Every chunk is one
# message and one executor step, so smaller chunks shorten the pipeline's fill time but pay the
# per-message latency more often; 1 MiB keeps the fill short for buffers of tens of MiB while
# staying far above the size where per-message cost dominates.
PIPELINE_CHUNK_BYTES = 1 << 20
MAX_PIPELINE_CHUNKS = 64


@dataclass(frozen=True)
class Request:
    """Everything a generator needs: the same on every rank, so every rank builds the same schedule."""

    collective: str
    algorithm: str
    topology: Topology
    count: int
    itemsize: int = 4
    root: int = 0
    # all_to_all: p*p element counts, splits[i*p + j] from rank i to rank j (count: their
    # total); empty: every rank cuts its `count` elements into p near-equal blocks
    splits: tuple[int, ...] = ()

    @property
    def ranks(self) -> list[int]:
        return list(range(self.topology.world_size))

    @property
    def p(self) -> int:
        return self.topology.world_size

    def blocks(self) -> alltoall.Blocks:
        """The all-to-all block matrix of this request."""
        return alltoall.Blocks(self.p, self.splits or alltoall.equal_splits(self.p, self.count))

    def pipeline_bounds(self, start: int, stop: int) -> list[int]:
        nbytes = (stop - start) * self.itemsize
        k = min(MAX_PIPELINE_CHUNKS, max(1, -(-nbytes // PIPELINE_CHUNK_BYTES)), max(1, stop - start))
        return split(start, stop, k)


Generator = Callable[[Builder, Request], int]


def _blocks(q: Request) -> list[int]:
    return split(0, q.count, q.p)


def _double_tree(b: Builder, q: Request) -> int:
    half = q.count // 2
    first, second = double_trees(q.p)
    return max(
        tree_all_reduce(b, first, q.pipeline_bounds(0, half)),
        tree_all_reduce(b, second, q.pipeline_bounds(half, q.count)),
    )


def _chain_ranks(q: Request, root_last: bool) -> list[int]:
    order = [(q.root + i) % q.p for i in range(q.p)]
    return order[1:] + order[:1] if root_last else order


GENERATORS: dict[str, dict[str, Generator]] = {
    "all_reduce": {
        "ring": lambda b, q: ring_all_reduce(b, q.ranks, _blocks(q)),
        "halving_doubling": lambda b, q: rabenseifner_all_reduce(b, q.ranks, 0, q.count),
        "tree": lambda b, q: tree_all_reduce(b, inorder_tree(q.ranks), q.pipeline_bounds(0, q.count)),
        "double_tree": _double_tree,
        "hierarchical": lambda b, q: hierarchical_all_reduce(b, q.topology, 0, q.count),
        "ps": lambda b, q: ps_all_reduce(b, q.ranks, q.root, 0, q.count),
        "bfb": lambda b, q: bfb_all_reduce(b, q.ranks, _blocks(q)),
    },
    "reduce_scatter": {
        "ring": lambda b, q: ring_reduce_scatter(b, q.ranks, _blocks(q)),
        "halving_doubling": lambda b, q: halving_reduce_scatter(b, q.ranks, _blocks(q)),
        "bfb": lambda b, q: bfb_reduce_scatter(b, q.ranks, _blocks(q)),
    },
    "all_gather": {
        "ring": lambda b, q: ring_all_gather(b, q.ranks, _blocks(q)),
        "halving_doubling": lambda b, q: doubling_all_gather(b, q.ranks, _blocks(q)),
        "bfb": lambda b, q: bfb_all_gather(b, q.ranks, _blocks(q)),
    },
    "broadcast": {
        "ring": lambda b, q: chain(b, _chain_ranks(q, False), q.pipeline_bounds(0, q.count), False),
        "tree": lambda b, q: tree_broadcast(b, rooted_tree(q.p, q.root), q.pipeline_bounds(0, q.count)),
        "ps": lambda b, q: scatter_from(b, q.ranks, q.root, 0, q.count),
    },
    "reduce": {
        "ring": lambda b, q: chain(b, _chain_ranks(q, True), q.pipeline_bounds(0, q.count), True),
        "tree": lambda b, q: tree_reduce(b, rooted_tree(q.p, q.root), q.pipeline_bounds(0, q.count)),
        "ps": lambda b, q: gather_to(b, q.ranks, q.root, 0, q.count, reduce=True),
    },
    "all_to_all": {
        "pairwise": lambda b, q: alltoall.pairwise(b, q.blocks()),
        "bruck": lambda b, q: alltoall.bruck(b, q.blocks()),
        "linear": lambda b, q: alltoall.linear(b, q.blocks()),
        "hierarchical": lambda b, q: alltoall.hierarchical(b, q.blocks(), q.topology),
    },
}


def algorithms(collective: str) -> list[str]:
    """The schedule algorithms that implement `collective`."""
    check_collective(collective)
    return list(GENERATORS[collective])


def check_collective(collective: str) -> None:
    if collective not in GENERATORS:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")


@lru_cache(maxsize=256)
def build(q: Request) -> Schedule:
    """The schedule for one request (cached: training calls the same shapes every step)."""
    check_collective(q.collective)
    table = GENERATORS[q.collective]
    if q.algorithm not in table:
        raise ValueError(
            f"unknown {q.collective} algorithm {q.algorithm!r}; choose one of {', '.join(table)}"
        )
    if q.count < 0:
        raise ValueError(f"count must be >= 0, got {q.count}")
    if q.splits and q.count != sum(q.splits):
        raise ValueError(f"an all_to_all request's count must be its splits' total {sum(q.splits)}")
    if not 0 <= q.root < q.p:
        raise ValueError(f"root {q.root} is not a rank of a world of {q.p}")
    b = Builder(q.p)
    table[q.algorithm](b, q)
    if q.collective != "all_to_all":
        return b.build(q.algorithm, q.collective, q.count)
    bounds = tuple(q.blocks().bounds)
    return replace(b.build(q.algorithm, q.collective, bounds[-1]), blocks=bounds)
