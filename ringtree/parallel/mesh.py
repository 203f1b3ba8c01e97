"""A process mesh: the world split into tensor-, context-, data- and pipeline-parallel groups.

Ranks are placed by `ringtree.ranks.Placement`, in Megatron-LM's order with tp innermost (adjacent
ranks, so the same node under torchrun), then cp, then dp, then pp outermost:
rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank. A tensor-parallel group talks on
every layer, so it must sit inside one node when the topology has several nodes; a context-parallel
group passes K/V on every attention layer, so it comes next; then the data-parallel replicas, which
reduce gradients once per step, and the pipeline stages outermost: each boundary between two stages
carries only one micro-batch's activations per rank. The planner prices the same groups.
Gradients of parameters replicated over CP (all of them) are reduced over DP x CP together
(`dp_cp_groups`), where other dimensions can also fold their ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from ringtree.ranks import Placement
from ringtree.topology import Topology


@dataclass(frozen=True)
class MeshShape:
    """The degrees of a mesh and which global ranks form each group (pure arithmetic, no torch)."""

    dp: int
    tp: int
    pp: int = 1
    cp: int = 1
    replicas: int = 1  # DiLoCo's replica groups: dp split in contiguous blocks of whole pipelines

    def __post_init__(self) -> None:
        for name, degree in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp), ("cp", self.cp)):
            if degree < 1:
                raise ValueError(f"{name} must be at least 1, got {name}={degree}")

    @property
    def placement(self) -> Placement:
        return Placement(tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, replicas=self.replicas)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, tp_rank, pp_rank) of a global rank (its cp_rank: `cp_rank`)."""
        c = self.placement.coordinates(rank)
        return c.dp, c.tp, c.pp

    def cp_rank(self, rank: int) -> int:
        """The context-parallel coordinate of a global rank."""
        return self.placement.coordinates(rank).cp

    def rank_of(self, dp_rank: int, tp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        return self.placement.rank(tp=tp_rank, cp=cp_rank, dp=dp_rank, pp=pp_rank)

    def tp_groups(self) -> list[list[int]]:
        """Each group of tp adjacent ranks: one per (pp, dp, cp) coordinate."""
        return self.placement.tp_groups()

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same model shard and tokens: one group per (pp, tp, cp) coordinate."""
        return self.placement.dp_groups()

    def pp_groups(self) -> list[list[int]]:
        """The stages of one pipeline: one group per (dp, tp, cp) coordinate."""
        return self.placement.pp_groups()

    def cp_groups(self) -> list[list[int]]:
        """Ranks splitting the same sequences: one group per (pp, dp, tp) coordinate."""
        return self.placement.cp_groups()

    def dp_cp_groups(self) -> list[list[int]]:
        """Ranks holding the same model shard, over which its gradients are reduced: DP x CP."""
        return self.placement.dp_cp_groups()

    def check_topology(self, topology: Topology, allow_cross_node_tp: bool = False) -> None:
        """Raise ValueError unless the mesh fills the topology and (by default) each TP group fits a node."""
        if topology.world_size != self.world_size:
            raise ValueError(
                f"mesh dp={self.dp} x tp={self.tp} x pp={self.pp}{self._cp_words()} = {self.world_size} "
                f"ranks but the "
                f"world has {topology.world_size}; choose degrees whose product is {topology.world_size}"
            )
        if allow_cross_node_tp or topology.nodes == 1:
            return
        if topology.local_world_size % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide the {topology.local_world_size} ranks per node, so a "
                f"tensor-parallel group would span nodes and all-reduce on every layer over the slow "
                f"link; choose tp in {_divisors(topology.local_world_size)} "
                f"(or pass allow_cross_node_tp=True)"
            )

    def _cp_words(self) -> str:
        return f" x cp={self.cp}" if self.cp > 1 else ""


class Mesh:
    """This rank's place in a dp x tp x pp mesh, with its process groups.

    `Mesh(dp=2, tp=2)` on 4 ranks: ranks {0,1} and {2,3} are tensor-parallel groups, {0,2} and
    {1,3} data-parallel groups. dp=None takes whatever the world leaves: world // (tp * pp).
    Every rank must build the same mesh, in the same order relative to other group creation
    (torch.distributed.new_group is collective over the whole world).
    """

    def __init__(
        self,
        dp: int | None = None,
        tp: int = 1,
        pp: int = 1,
        *,
        cp: int = 1,
        replicas: int = 1,
        topology: Topology | None = None,
        allow_cross_node_tp: bool = False,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs a process group: call torch.distributed.init_process_group first")
        world = dist.get_world_size()
        self.shape = MeshShape(_infer_dp(world, tp * cp, pp) if dp is None else dp, tp, pp, cp, replicas)
        self.topology = topology or Topology(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        self.shape.check_topology(self.topology, allow_cross_node_tp)
        self.rank = dist.get_rank()
        self.dp_rank, self.tp_rank, self.pp_rank = self.shape.coordinates(self.rank)
        self.tp_ranks, self.tp_group = _new_groups(self.shape.tp_groups(), self.rank)
        self.dp_ranks, self.dp_group = _new_groups(self.shape.dp_groups(), self.rank)
        self.pp_ranks, self.pp_group = _new_groups(self.shape.pp_groups(), self.rank)
        self.cp_rank = self.shape.cp_rank(self.rank)
        self.cp_ranks: list[int] = [self.rank]
        self.cp_group: dist.ProcessGroup | None = None  # None without CP (no groups of one made)
        self.dp_cp_ranks, self.dp_cp_group = self.dp_ranks, self.dp_group
        if cp > 1:
            self.cp_ranks, self.cp_group = _new_groups(self.shape.cp_groups(), self.rank)
            self.dp_cp_ranks, self.dp_cp_group = _new_groups(self.shape.dp_cp_groups(), self.rank)

    @property
    def dp(self) -> int:
        return self.shape.dp

    @property
    def tp(self) -> int:
        return self.shape.tp

    @property
    def pp(self) -> int:
        return self.shape.pp

    @property
    def cp(self) -> int:
        return self.shape.cp

    def __repr__(self) -> str:
        return (
            f"Mesh(dp={self.dp}, tp={self.tp}, pp={self.pp}; rank {self.rank} at dp_rank={self.dp_rank}, "
            f"tp_rank={self.tp_rank}, pp_rank={self.pp_rank})"
        )


def _infer_dp(world: int, tp: int, pp: int) -> int:
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(
            f"tp={tp} x pp={pp} = {tp * pp} does not divide the world size {world}; "
            f"choose tp and pp whose product divides {world}"
        )
    return world // (tp * pp)


def _new_groups(groups: list[list[int]], rank: int) -> tuple[list[int], dist.ProcessGroup]:
    """Create every group on every rank (new_group is collective); return this rank's one."""
    mine: tuple[list[int], dist.ProcessGroup] | None = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            assert group is not None and group != dist.GroupMember.NON_GROUP_MEMBER
            mine = (ranks, group)
    assert mine is not None, f"rank {rank} is in no group of {groups}"
    return mine


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
