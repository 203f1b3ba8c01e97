"""The cost of tensor parallelism: per transformer block, two activation all-reduces forward and two backward.

Megatron's layout puts one all-reduce at the end of attention and one at the end of the MLP in
forward (g), and one at the input of each in backward (f). Each reduces the block's activation,
batch x seq x hidden elements, over the TP group's link: the intra-node link when the group fits
in a node (ringtree's Mesh puts it there), the inter-node link when it must span nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtree.sim.closed_form import estimate
from ringtree.sim.hardware import Cluster

ALL_REDUCES_PER_BLOCK = 4  # 2 forward (g after attention and MLP) + 2 backward (f before them)


@dataclass(frozen=True)
class TPShape:
    """The transformer's dimensions that set the size of every TP all-reduce."""

    layers: int
    hidden: int
    seq: int
    batch_size: int  # samples per TP group per micro-step
    dtype_bytes: int = 4

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "seq", "batch_size", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def activation_bytes(self) -> int:
        return self.batch_size * self.seq * self.hidden * self.dtype_bytes


def tp_cluster(cluster: Cluster, tp: int) -> Cluster:
    """The cluster one TP group sees: inside a node when tp divides the GPUs per node, else across nodes."""
    if tp < 1 or cluster.ranks % tp:
        raise ValueError(f"tp={tp} must divide the {cluster.ranks} ranks of the cluster")
    if cluster.gpus_per_node % tp == 0:
        return Cluster(1, tp, cluster.intra, cluster.inter, cluster.gamma, cluster.nics_per_node)
    if tp % cluster.gpus_per_node:
        raise ValueError(f"tp={tp} must divide or be a multiple of the {cluster.gpus_per_node} GPUs per node")
    return Cluster(
        tp // cluster.gpus_per_node, cluster.gpus_per_node, cluster.intra, cluster.inter, cluster.gamma
    )


def spread_cluster(cluster: Cluster, tp: int) -> Cluster:
    """A TP group of tp ranks placed one per node (what a mesh with dp innermost would do)."""
    return Cluster(tp, 1, cluster.intra, cluster.inter, cluster.gamma, cluster.nics_per_node)


def tp_comm_time(shape: TPShape, group: Cluster, algorithm: str = "ring") -> float:
    """Seconds per micro-step spent in the TP all-reduces (they sit on the critical path)."""
    one = estimate(algorithm, group, shape.activation_bytes, shape.dtype_bytes)
    return ALL_REDUCES_PER_BLOCK * shape.layers * one
