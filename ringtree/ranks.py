"""Where every rank of a layout sits: the ranks of each parallel group and each pipeline-stage boundary.

One placement for the trainer's mesh and the planner, in Megatron-LM's order, innermost first:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

so a tensor-parallel group is tp adjacent ranks (one node under torchrun, which numbers ranks node
by node), then context parallelism, then the data-parallel replicas, and the pipeline stages
outermost: stage j holds the tp x cp x dp ranks [j * tp*cp*dp, (j + 1) * tp*cp*dp). The experts fold
over the tp x cp x dp ranks of a stage as Megatron-Core's expert mesh does, innermost first
etp, ep, expert-dp: expert rank i (a rank's index inside its stage) has etp coordinate i % etp, ep
coordinate (i // etp) % ep, and the rest is its expert-DP coordinate. The trainer folds EP inside
each DP x CP group (`dp_cp_groups`), which is this mesh with etp = tp. With `replicas` R (DiLoCo's
replica groups) the dp dimension splits in R, outermost: replica k holds the contiguous ranks
[k * world / R, (k + 1) * world / R), whole pipelines laid out as above with dp / R.

Every group comes as its members in ascending rank order (their coordinate's order), the groups in
the order of their first member; `node_of` puts rank r on node r // gpus_per_node. Pure Python.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import NamedTuple

DIMENSIONS = ("tp", "cp", "dp", "pp")  # innermost first


class Coordinates(NamedTuple):
    """A rank's place in the mesh, one coordinate per dimension."""

    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class Placement:
    """A layout's degrees and the node size its ranks are packed into (0: everything on one node)."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    virtual_stages: int = 1
    gpus_per_node: int = 0
    replicas: int = 1  # DiLoCo's replica groups: contiguous blocks of whole pipelines, splitting dp

    def __post_init__(self) -> None:
        degrees = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp, "ep": self.ep, "etp": self.etp,
                   "virtual_stages": self.virtual_stages, "replicas": self.replicas}  # fmt: skip
        for name, degree in degrees.items():
            if degree < 1:
                raise ValueError(f"{name} must be at least 1, got {name}={degree}")
        if self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node must be at least 0, got {self.gpus_per_node}")
        if self.dp % self.replicas:
            raise ValueError(
                f"replicas={self.replicas} must divide dp={self.dp} (each replica holds dp / replicas "
                "whole pipelines); change the replicas or the degrees"
            )
        if self.stage_size % (self.ep * self.etp):
            raise ValueError(
                f"ep={self.ep} x etp={self.etp} must divide the {self.stage_size} ranks of a pipeline "
                f"stage (tp {self.tp} x cp {self.cp} x dp {self.dp // self.replicas}); change ep, etp or "
                "the degrees"
            )

    @property
    def stage_size(self) -> int:
        """The ranks of one pipeline stage (of one replica): tp x cp x dp / replicas."""
        return self.tp * self.cp * self.dp // self.replicas

    @property
    def world_size(self) -> int:
        return self.stage_size * self.pp * self.replicas

    @property
    def replica_size(self) -> int:
        """The ranks of one replica: its pipelines' stages, consecutive."""
        return self.stage_size * self.pp

    def rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at these coordinates (dp counts over every replica: replica dp // (dp / R))."""
        inner = self.dp // self.replicas
        replica, dp_in = divmod(dp, inner)
        return replica * self.replica_size + ((pp * inner + dp_in) * self.cp + cp) * self.tp + tp

    def coordinates(self, rank: int) -> Coordinates:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the {self.world_size} ranks of the layout")
        replica, r = divmod(rank, self.replica_size)
        inner = self.dp // self.replicas
        return Coordinates(
            r % self.tp,
            r // self.tp % self.cp,
            replica * inner + r // (self.tp * self.cp) % inner,
            r // self.stage_size,
        )

    def replica_of(self, rank: int) -> int:
        return rank // self.replica_size

    def replica_groups(self) -> list[list[int]]:
        """Each replica's ranks: a contiguous block of whole pipelines."""
        return _collect(range(self.world_size), self.replica_of)

    def replica_dp_groups(self) -> list[list[int]]:
        """The data-parallel ranks inside one replica (its DDP or ZeRO group)."""
        return _collect(range(self.world_size), lambda r: (*self._without_dp(r), self.replica_of(r)))

    def across_replicas_groups(self) -> list[list[int]]:
        """The ranks at one place of every replica (the outer, cross-replica all-reduce's group)."""
        inner = self.dp // self.replicas
        return _collect(
            range(self.world_size), lambda r: (*self._without_dp(r), self.coordinates(r).dp % inner)
        )

    def _without_dp(self, rank: int) -> tuple[int, int, int]:
        c = self.coordinates(rank)
        return c.tp, c.cp, c.pp

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node if self.gpus_per_node else 0

    def groups(self, *varying: str) -> list[list[int]]:
        """The groups whose members differ only in the `varying` dimensions (of DIMENSIONS)."""
        unknown = set(varying) - set(DIMENSIONS)
        if unknown:
            raise ValueError(f"unknown dimension {sorted(unknown)}; choose among {', '.join(DIMENSIONS)}")
        fixed = [i for i, name in enumerate(DIMENSIONS) if name not in varying]
        return _collect(range(self.world_size), lambda r: tuple(self.coordinates(r)[i] for i in fixed))

    def tp_groups(self) -> list[list[int]]:
        return self.groups("tp")

    def cp_groups(self) -> list[list[int]]:
        return self.groups("cp")

    def dp_groups(self) -> list[list[int]]:
        return self.groups("dp")

    def pp_groups(self) -> list[list[int]]:
        return self.groups("pp")

    def dp_cp_groups(self) -> list[list[int]]:
        """The ranks holding the same dense weights, over which their gradients are reduced: DP x CP."""
        return self.groups("dp", "cp")

    def expert_coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """(etp, ep, expert-dp, pp) coordinates of a rank in the expert mesh."""
        i = rank % self.stage_size
        pp = rank // self.stage_size % self.pp
        return i % self.etp, i // self.etp % self.ep, i // (self.etp * self.ep), pp

    def ep_groups(self) -> list[list[int]]:
        """The ranks that share an MoE layer's experts, etp apart."""
        return self._expert_groups(1)

    def etp_groups(self) -> list[list[int]]:
        """The ranks that split each expert's matrices: etp adjacent ranks."""
        return self._expert_groups(0)

    def edp_groups(self) -> list[list[int]]:
        """The ranks holding the same experts, over which the experts' gradients are reduced."""
        return self._expert_groups(2)

    def _expert_groups(self, varying: int) -> list[list[int]]:
        def key(rank: int) -> tuple[int, ...]:
            c = self.expert_coordinates(rank)
            return (*(x for i, x in enumerate(c) if i != varying), self.replica_of(rank))

        return _collect(range(self.world_size), key)

    def stage_boundaries(self) -> list[list[tuple[int, int]]]:
        """Each pipeline boundary's (sender, receiver) pairs in the forward: stage j to j + 1, and with
        virtual stages the last stage back to the first (chunk c to c + 1); none when pp = 1."""
        last = self.pp if self.virtual_stages > 1 and self.pp > 1 else self.pp - 1
        size, block = self.stage_size, self.replica_size
        return [
            [(b + j * size + i, b + (j + 1) % self.pp * size + i) for b in range(0, self.world_size, block)
             for i in range(size)]
            for j in range(last)
        ]  # fmt: skip

    def nodes_of(self, ranks: list[int]) -> Counter[int]:
        """How many of `ranks` sit on each node."""
        return Counter(self.node_of(r) for r in ranks)

    def progression(self, kind: str) -> tuple[int, int]:
        """(stride, size) of a kind of group: every group of it is the ranks b + k * stride, k < size,
        the groups filling blocks of stride x size consecutive ranks (Megatron's order makes each kind
        of group such a progression)."""
        inner = {"tp": 1, "cp": self.tp, "dp": self.tp * self.cp, "dp_cp": self.tp, "pp": self.stage_size,
                 "etp": 1, "ep": self.etp, "edp": self.etp * self.ep}  # fmt: skip
        size = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "dp_cp": self.cp * self.dp, "pp": self.pp,
                "etp": self.etp, "ep": self.ep, "edp": self.stage_size // (self.etp * self.ep)}  # fmt: skip
        if kind not in inner:
            raise ValueError(f"unknown kind of group {kind!r}; choose among {', '.join(inner)}")
        if self.replicas > 1:
            raise ValueError("progression and span describe one replica: use replicas=1")
        return inner[kind], size[kind]

    def span(self, stride: int, size: int) -> Span:
        """Where the groups b + k * stride (k < size, in blocks of stride x size ranks) sit on the nodes:
        the nodes the widest spans and how many crossing groups share one node at most. A node of
        g ranks repeats its pattern every g / gcd(g, block) blocks, so a window of blocks is enough."""
        block, g = stride * size, self.gpus_per_node or self.world_size
        if block < 1 or self.world_size % block:
            raise ValueError(f"groups of {size} ranks {stride} apart do not tile the {self.world_size} ranks")
        window = min(self.world_size // block, 2 * (g // math.gcd(g, block)) + 2 * -(-g // block) + 2)
        widest, sharing = 1, Counter[int]()
        for first in range(0, window * block, block):
            for base in range(first, first + stride):
                nodes = {(base + k * stride) // g for k in range(size)}
                widest = max(widest, len(nodes))
                if len(nodes) > 1:
                    sharing.update(nodes)
        return Span(size, widest, max(sharing.values(), default=0))

    def boundary_span(self) -> Span:
        """The pipeline boundaries' pairs of neighbours on two nodes: size 2, nodes 2 when any pair
        crosses, `sharing` the most crossing pairs one node sends or receives at one boundary."""
        g, size = self.gpus_per_node or self.world_size, self.stage_size
        boundaries = self.pp if self.virtual_stages > 1 and self.pp > 1 else self.pp - 1
        window = min(boundaries, 2 * (g // math.gcd(g, size)) + 2)
        worst = 0
        for j in range(window):  # stage j to j + 1 (the last to the first, wrapped)
            senders = [j * size + i for i in range(min(size, 2 * g))]  # beyond 2g the pattern repeats
            step = (j + 1) % self.pp * size - j * size
            out = Counter(a // g for a in senders if a // g != (a + step) // g)
            into = Counter((a + step) // g for a in senders if a // g != (a + step) // g)
            worst = max(worst, *out.values(), *into.values(), 0)
        return Span(2, 2 if worst else 1, worst)


@dataclass(frozen=True)
class Span:
    """How one kind of group sits on the nodes: its size, the nodes the widest group spans, and the
    most groups of the kind that cross nodes with members on one node (they share its NICs; 0: none)."""

    size: int
    nodes: int
    sharing: int


def _collect(ranks: range, key: Callable[[int], Hashable]) -> list[list[int]]:
    """Ranks bucketed by `key(rank)`, members ascending, buckets in the order of their first member."""
    out: dict[Hashable, list[int]] = {}
    for r in ranks:
        out.setdefault(key(r), []).append(r)
    return list(out.values())
