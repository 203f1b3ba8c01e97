"""A process mesh: the world split into tensor-, context-, data- and pipeline-parallel groups.

Ranks are laid out with tp innermost (adjacent ranks, so the same node under torchrun), then cp,
then pp, then dp outermost: rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank
(with cp = 1: dp_rank * (pp * tp) + pp_rank * tp + tp_rank). A tensor-parallel group talks on
every layer, so it must sit inside one node when the topology has several nodes; a context-
parallel group passes K/V on every attention layer, so it comes next; then the stages of one
pipeline (point-to-point every micro-batch), and the data-parallel replicas, which talk once per
step, span the nodes. Gradients of parameters replicated over CP (all of them) are reduced over
DP x CP together (`dp_cp_groups`), where other dimensions can also fold their ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from ringtree.topology import Topology


@dataclass(frozen=True)
class MeshShape:
    """The degrees of a mesh and which global ranks form each group (pure arithmetic, no torch)."""

    dp: int
    tp: int
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name, degree in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp), ("cp", self.cp)):
            if degree < 1:
                raise ValueError(f"{name} must be at least 1, got {name}={degree}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, tp_rank, pp_rank) of a global rank (its cp_rank: `cp_rank`)."""
        inner = self.tp * self.cp
        return rank // (self.pp * inner), rank % self.tp, (rank // inner) % self.pp

    def cp_rank(self, rank: int) -> int:
        """The context-parallel coordinate of a global rank."""
        return (rank // self.tp) % self.cp

    def rank_of(self, dp_rank: int, tp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        return ((dp_rank * self.pp + pp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def _others(self, *fixed: str) -> list[dict[str, int]]:
        """Every combination of coordinates of the dimensions not in `fixed` (outermost first)."""
        ranges = {"pp": self.pp, "dp": self.dp, "tp": self.tp, "cp": self.cp}
        combos: list[dict[str, int]] = [{}]
        for name in ("pp", "dp", "tp", "cp"):
            if name not in fixed:
                combos = [c | {name: i} for c in combos for i in range(ranges[name])]
        return combos

    def _group(self, c: dict[str, int]) -> int:
        return self.rank_of(c.get("dp", 0), c.get("tp", 0), c.get("pp", 0), c.get("cp", 0))

    def tp_groups(self) -> list[list[int]]:
        """Each group of tp adjacent ranks: one per (pp, dp, cp) coordinate."""
        return [[self._group(c | {"tp": t}) for t in range(self.tp)] for c in self._others("tp")]

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same model shard and tokens: one group per (pp, tp, cp) coordinate."""
        return [[self._group(c | {"dp": d}) for d in range(self.dp)] for c in self._others("dp")]

    def pp_groups(self) -> list[list[int]]:
        """The stages of one pipeline: one group per (dp, tp, cp) coordinate."""
        return [[self._group(c | {"pp": p}) for p in range(self.pp)] for c in self._others("pp")]

    def cp_groups(self) -> list[list[int]]:
        """Ranks splitting the same sequences: one group per (pp, dp, tp) coordinate."""
        return [[self._group(c | {"cp": k}) for k in range(self.cp)] for c in self._others("cp")]

    def dp_cp_groups(self) -> list[list[int]]:
        """Ranks holding the same model shard, over which its gradients are reduced: DP x CP."""
        return [
            sorted(self._group(c | {"dp": d, "cp": k}) for d in range(self.dp) for k in range(self.cp))
            for c in self._others("dp", "cp")
        ]

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
        topology: Topology | None = None,
        allow_cross_node_tp: bool = False,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs a process group: call torch.distributed.init_process_group first")
        world = dist.get_world_size()
        self.shape = MeshShape(_infer_dp(world, tp * cp, pp) if dp is None else dp, tp, pp, cp)
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
