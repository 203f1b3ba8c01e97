"""Replica groups for local SGD and DiLoCo: DDP inside each group, the outer average across them.

Replica r holds ranks [r B, (r + 1) B) with B = world / R (one per node by default): contiguous
blocks, so each replica's DDP runs over the fast links of its node(s) and only the outer average
crosses the slow network. A replica must hold whole tensor-, context- and pipeline-parallel
groups (a replica holds whole pipelines). Rank j of every replica (position j in its block) forms
outer group j: what a rank's outer all-reduce talks to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ringtree.parallel.mesh import Mesh, MeshShape


@dataclass(frozen=True)
class ReplicaLayout:
    """Which global ranks form each replica's data-parallel groups and each outer group (no torch)."""

    world_size: int
    replicas: int
    inner: list[list[int]]  # the mesh's DP x CP groups, cut at the replicas' edges
    outer: list[list[int]]  # outer group j: rank j of every replica

    def replica_of(self, rank: int) -> int:
        return rank // (self.world_size // self.replicas)


def layout(shape: MeshShape, replicas: int) -> ReplicaLayout:
    """The replica groups of `shape`'s world; ValueError naming --replicas when they cannot be."""
    world = shape.world_size
    if replicas < 1 or world % replicas:
        ok = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"--replicas {replicas} must divide the {world} ranks; choose one of {ok}")
    if shape.dp % replicas:
        ok = [d for d in range(1, shape.dp + 1) if shape.dp % d == 0]
        raise ValueError(
            f"--replicas {replicas} would cut a tensor- or pipeline-parallel group: each replica holds whole "
            f"pipelines, so it must divide the data-parallel degree {shape.dp}; choose one of {ok}"
        )
    block = world // replicas
    for name, groups in (
        ("tensor", shape.tp_groups()),
        ("pipeline", shape.pp_groups()),
        ("context", shape.cp_groups()),
    ):
        for ranks in groups:
            if len({r // block for r in ranks}) > 1:
                raise ValueError(
                    f"--replicas {replicas} would cut {name}-parallel group {ranks} in two (each replica "
                    f"holds {block} ranks); choose --replicas dividing the data-parallel degree {shape.dp}"
                )
    inner = [
        [r for r in ranks if r // block == k]
        for ranks in shape.dp_cp_groups()
        for k in sorted({r // block for r in ranks})
    ]
    outer = [[j + k * block for k in range(replicas)] for j in range(block)]
    return ReplicaLayout(world, replicas, inner, outer)


@dataclass
class ReplicaGroups:
    """This rank's replica-local DP x CP group (DDP's), its outer group (the outer average's), and a
    second group of the inner ranks that gathers the outer average's slices (a group of its own: it
    may run on DiLoCo's thread while DDP uses the first)."""

    layout: ReplicaLayout
    inner_ranks: list[int]
    inner: dist.ProcessGroup
    outer_ranks: list[int]
    outer: dist.ProcessGroup
    gather: dist.ProcessGroup


def split(mesh: Mesh, replicas: int) -> ReplicaGroups:
    """Make the groups (collective: every rank calls it, in the same order) and cut the mesh's DP x
    CP group to this rank's replica, so that the DDP the parallelize step builds stays inside it."""
    made = layout(mesh.shape, replicas)
    rank = dist.get_rank()
    inner_ranks, inner = _mine(made.inner, rank)
    outer_ranks, outer = _mine(made.outer, rank)
    _, gather = _mine(made.inner, rank)
    mesh.dp_cp_ranks, mesh.dp_cp_group = inner_ranks, inner
    if mesh.cp == 1:
        mesh.dp_ranks, mesh.dp_group = inner_ranks, inner
    return ReplicaGroups(made, inner_ranks, inner, outer_ranks, outer, gather)


def _mine(groups: list[list[int]], rank: int) -> tuple[list[int], dist.ProcessGroup]:
    mine: tuple[list[int], dist.ProcessGroup] | None = None
    for ranks in groups:
        group = dist.new_group(ranks)  # collective over the world, even for the groups of others
        if rank in ranks:
            assert group is not None and group != dist.GroupMember.NON_GROUP_MEMBER
            mine = (ranks, group)
    assert mine is not None, f"rank {rank} is in no group of {groups}"
    return mine
