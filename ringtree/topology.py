"""Ranks grouped into nodes, and the link level between any two ranks (pure Python)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum


class LinkLevel(str, Enum):
    """Which kind of link carries traffic between two ranks."""

    LOCAL = "local"  # a rank to itself: no link at all
    INTRA = "intra"  # two ranks on one node (PCIe, NVLink, shared memory)
    INTER = "inter"  # two ranks on different nodes (Ethernet, InfiniBand)


@dataclass(frozen=True)
class Topology:
    """`world_size` ranks on `nodes` nodes of `local_world_size` ranks each.

    Ranks are numbered node by node, as torchrun numbers them: rank r lives on node
    r // local_world_size with local rank r % local_world_size.
    """

    world_size: int
    local_world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ValueError(
                f"local_world_size={self.local_world_size} must divide world_size="
                f"{self.world_size}: ringtree assumes every node runs the same number of ranks"
            )

    @classmethod
    def single_node(cls, world_size: int) -> Topology:
        return cls(world_size, world_size)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Topology:
        """The topology torchrun describes with WORLD_SIZE and LOCAL_WORLD_SIZE."""
        env = os.environ if env is None else env
        try:
            world_size = int(env["WORLD_SIZE"])
        except KeyError:
            raise ValueError("WORLD_SIZE is not set: run under torchrun or pass a Topology") from None
        local = int(env.get("LOCAL_WORLD_SIZE", world_size))
        return cls(world_size, local)

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def local_rank_of(self, rank: int) -> int:
        return rank % self.local_world_size

    def node_ranks(self, node: int) -> list[int]:
        """The ranks of one node, in local-rank order."""
        first = node * self.local_world_size
        return list(range(first, first + self.local_world_size))

    def cross_node_ranks(self, local_rank: int) -> list[int]:
        """The ranks with one local rank on every node, in node order ("rails")."""
        return [n * self.local_world_size + local_rank for n in range(self.nodes)]

    def link_level(self, a: int, b: int) -> LinkLevel:
        if a == b:
            return LinkLevel.LOCAL
        return LinkLevel.INTRA if self.node_of(a) == self.node_of(b) else LinkLevel.INTER
