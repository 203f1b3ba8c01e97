"""Schedules as data: exact small cases, step counts, tree properties, and a dry run of everything."""

from __future__ import annotations

import dataclasses
import math

import pytest

from ringtree.schedules import COLLECTIVES, Op, OpKind, Request, Schedule, algorithms, build
from ringtree.schedules.base import split
from ringtree.schedules.tree import double_trees, inorder_tree, rooted_tree
from ringtree.schedules.verify import ScheduleError, dry_run
from ringtree.topology import Topology

S, R, RR = OpKind.SEND, OpKind.RECV, OpKind.RECV_REDUCE


def schedule(collective: str, algorithm: str, p: int, count: int, local: int = 0, root: int = 0) -> Schedule:
    return build(Request(collective, algorithm, Topology(p, local or p), count, 4, root))


def test_split_is_balanced_and_covers() -> None:
    assert split(0, 10, 3) == [0, 4, 7, 10]
    assert split(5, 7, 4) == [5, 6, 7, 7, 7]  # fewer elements than parts: trailing blocks empty
    assert split(0, 0, 2) == [0, 0, 0]


def test_ring_all_reduce_three_ranks_exactly() -> None:
    s = schedule("all_reduce", "ring", 3, 3)
    # Step s: rank i sends block (i-s-1) mod 3 to rank i+1 (reduce-scatter), then block (i-s) (all-gather).
    assert s.for_rank(0) == (
        (Op(S, 1, 2, 3), Op(RR, 2, 1, 2)),
        (Op(S, 1, 1, 2), Op(RR, 2, 0, 1)),
        (Op(S, 1, 0, 1), Op(R, 2, 2, 3)),
        (Op(S, 1, 2, 3), Op(R, 2, 1, 2)),
    )


def test_ps_and_bfb_two_ranks_exactly() -> None:
    ps = schedule("all_reduce", "ps", 2, 4)
    assert ps.for_rank(0) == ((Op(RR, 1, 0, 4),), (Op(S, 1, 0, 4),))
    assert ps.for_rank(1) == ((Op(S, 0, 0, 4),), (Op(R, 0, 0, 4),))
    bfb = schedule("all_reduce", "bfb", 2, 4)
    assert bfb.for_rank(0) == ((Op(RR, 1, 0, 2), Op(S, 1, 2, 4)), (Op(S, 1, 0, 2), Op(R, 1, 2, 4)))


@pytest.mark.parametrize("p", [2, 3, 4, 5, 7, 8, 16])
def test_step_counts(p: int) -> None:
    lg = p.bit_length() - 1
    folded = 0 if p == 1 << lg else 2
    assert schedule("all_reduce", "ring", p, 1000).num_steps == 2 * (p - 1)
    assert schedule("all_reduce", "halving_doubling", p, 1000).num_steps == 2 * lg + folded
    assert schedule("all_reduce", "ps", p, 1000).num_steps == 2
    assert schedule("all_reduce", "bfb", p, 1000).num_steps == 2
    # Trees: latency grows with log2(p), not p.
    assert schedule("all_reduce", "double_tree", p, 1000).num_steps <= 2 * math.ceil(math.log2(p)) + 1


def test_hierarchical_steps_follow_the_two_levels() -> None:
    # 4 nodes x 2: intra reduce-scatter (1) + inter ring all-reduce (2*3) + intra all-gather (1).
    assert schedule("all_reduce", "hierarchical", 8, 1000, local=2).num_steps == 8
    s = schedule("all_reduce", "hierarchical", 8, 1000, local=2)
    topo = Topology(8, 2)
    inter = {
        (r, op.peer)
        for r in range(8)
        for step in s.for_rank(r)
        for op in step
        if topo.node_of(r) != topo.node_of(op.peer)
    }
    # Only ranks with the same local rank talk across nodes (one rail per local rank).
    assert all(topo.local_rank_of(a) == topo.local_rank_of(b) for a, b in inter)


def test_hierarchical_sends_a_fraction_across_nodes() -> None:
    count, topo = 1 << 12, Topology(8, 4)

    def inter_elements(algorithm: str) -> int:
        s = schedule("all_reduce", algorithm, 8, count, local=4)
        return max(
            sum(
                op.numel
                for step in s.for_rank(r)
                for op in step
                if op.kind is S and topo.link_level(r, op.peer).value == "inter"
            )
            for r in range(8)
        )

    # Each rank sends 2(N-1)/N of its 1/L shard across nodes: 2 * 1/2 * count/4 for N=2, L=4.
    assert inter_elements("hierarchical") == count // 4
    # A flat ring: the rank at a node boundary sends its whole 2(p-1)/p share to the other node.
    assert inter_elements("ring") == 2 * 7 * count // 8


@pytest.mark.parametrize("p", list(range(2, 65)))
def test_double_tree_is_complementary(p: int) -> None:
    first, second = double_trees(p)
    for tree in (first, second):
        assert sorted(tree.preorder()) == list(range(p))  # spans every rank once
        assert max(tree.depths().values()) <= p.bit_length()  # log depth
        assert all(len(kids) <= 2 for kids in tree.children.values())
    assert not first.interior() & second.interior()  # no rank forwards for both trees
    assert first.leaves() | second.leaves() == set(range(p))


def test_inorder_tree_keeps_neighbours_close() -> None:
    tree = inorder_tree(list(range(8)))
    assert tree.root == 7
    assert tree.children == {0: [], 1: [0, 2], 2: [], 3: [1, 5], 4: [], 5: [4, 6], 6: [], 7: [3]}


def test_rooted_tree_puts_root_on_top() -> None:
    for p in (1, 2, 5, 8):
        for root in range(p):
            assert rooted_tree(p, root).root == root


def test_tree_pipelines_large_buffers() -> None:
    small = schedule("all_reduce", "tree", 4, 1024)
    large = schedule("all_reduce", "tree", 4, 16 << 20)  # 64 MiB of float32: 64 chunks of 1 MiB
    assert large.num_steps - small.num_steps == 63


CASES = [
    (coll, alg, p, local, count, root)
    for coll in COLLECTIVES
    for alg in algorithms(coll)
    for p in range(1, 11)
    for local in sorted({p, *(d for d in (1, 2, 3) if p % d == 0)})
    if alg == "hierarchical" or local == p
    for count in sorted({0, 1, max(p - 1, 0), 7, 5 * p, 1000})
    if coll not in ("reduce_scatter", "all_gather") or count % p == 0
    for root in sorted({0, p - 1} if coll in ("broadcast", "reduce") else {0})
]


@pytest.mark.parametrize(("collective", "algorithm", "p", "local", "count", "root"), CASES)
def test_dry_run_delivers_every_collective(
    collective: str, algorithm: str, p: int, local: int, count: int, root: int
) -> None:
    """Matching sends and receives at every step (so no deadlock), and each contribution reduced
    exactly once into exactly what the collective promises on every rank."""
    dry_run(schedule(collective, algorithm, p, count, local, root), root)


def _without(s: Schedule, rank: int, t: int, j: int) -> Schedule:
    steps = [list(r) for r in s.steps]
    steps[rank][t] = steps[rank][t][:j] + steps[rank][t][j + 1 :]
    return dataclasses.replace(s, steps=tuple(tuple(r) for r in steps))


def test_dry_run_catches_broken_schedules() -> None:
    s = schedule("all_reduce", "ring", 4, 8)
    with pytest.raises(ScheduleError, match="unmatched"):
        dry_run(_without(s, 0, 0, 0))  # a send nobody sends: its receiver would wait forever
    steps = [list(r) for r in s.steps]
    steps[1][0] = (Op(S, 2, 0, 2), Op(RR, 0, 6, 8))  # the wrong chunk
    steps[2][0] = (steps[2][0][0], Op(RR, 1, 0, 2))
    with pytest.raises(ScheduleError):
        dry_run(dataclasses.replace(s, steps=tuple(tuple(r) for r in steps)))
    twice = schedule("all_reduce", "ps", 3, 4)
    steps = [list(r) for r in twice.steps]
    steps[0][0] = (*steps[0][0], Op(RR, 1, 0, 4))  # the server adds rank 1's gradient twice
    steps[1][0] = (*steps[1][0], Op(S, 0, 0, 4))
    with pytest.raises(ScheduleError, match="twice"):
        dry_run(dataclasses.replace(twice, steps=tuple(tuple(r) for r in steps)))


def test_unknown_names_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="double_tree"):
        schedule("all_reduce", "butterfly", 4, 8)
    with pytest.raises(ValueError, match="all_reduce"):
        algorithms("allreduce")
    with pytest.raises(ValueError, match="root 4"):
        schedule("broadcast", "tree", 4, 8, root=4)


def test_topology() -> None:
    topo = Topology.from_env({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert (topo.nodes, topo.node_of(5), topo.local_rank_of(5)) == (2, 1, 1)
    assert topo.node_ranks(1) == [4, 5, 6, 7] and topo.cross_node_ranks(2) == [2, 6]
    assert topo.link_level(0, 3).value == "intra" and topo.link_level(3, 4).value == "inter"
    with pytest.raises(ValueError, match="must divide"):
        Topology(6, 4)
    with pytest.raises(ValueError, match="torchrun"):
        Topology.from_env({})
