"""The cost of tensor parallelism: per transformer block, two activation all-reduces forward and two backward.

Megatron's layout puts one all-reduce at the end of attention and one at the end of the MLP in
forward (g), and one at the input of each in backward (f). Each reduces the block's activation,
batch x seq x hidden elements, over the TP group's link: the intra-node link when the group fits
in a node (ringtree's Mesh puts it there), the inter-node link when it must span nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ringtree.sim.closed_form import estimate
from ringtree.sim.hardware import Cluster
from ringtree.sim.plan import StepConfig, predict_step

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


# Transformer shapes of the planner's model presets: (layers, hidden, sequence length).
SHAPES: dict[str, tuple[int, int, int]] = {
    "vit-base": (12, 768, 197),
    "vit-large": (24, 1024, 197),
    "vit-huge": (32, 1280, 257),
    "bert-large": (24, 1024, 512),
    "gpt2-xl": (48, 1600, 1024),
    "llama-7b": (32, 4096, 2048),
}


def dp_cluster(cluster: Cluster, tp: int) -> Cluster:
    """The cluster one data-parallel group sees when tp ranks (innermost) form each TP group."""
    if cluster.gpus_per_node % tp == 0:
        return Cluster(
            cluster.nodes,
            cluster.gpus_per_node // tp,
            cluster.intra,
            cluster.inter,
            cluster.gamma,
            cluster.nics_per_node,
        )
    return Cluster(cluster.ranks // tp, 1, cluster.intra, cluster.inter, cluster.gamma, cluster.nics_per_node)


def predict_tp_step(
    config: StepConfig,
    shape: TPShape,
    cluster: Cluster,
    tp: int,
    algorithm: str = "ring",
    spread: bool = False,
) -> dict[str, Any]:
    """A DP x TP step: compute / tp, plus the TP all-reduces on the critical path, plus the DP
    all-reduce of each rank's 1/tp of the gradients over its DP group. `spread` places the TP
    group one rank per node (across the network) instead of inside a node, for comparison."""
    group = spread_cluster(cluster, tp) if spread else tp_cluster(cluster, tp)
    tp_s = tp_comm_time(shape, group, algorithm) * config.accumulate
    local = replace(
        config,
        params=config.params // tp,
        compute_time_s=config.compute_time_s / tp + tp_s / config.accumulate,
    )
    dp = predict_step(local, dp_cluster(cluster, tp), algorithm)
    return {
        "tp": tp,
        "tp_link": "inter" if group.nodes > 1 else "intra",
        "tp_comm_time_s": tp_s,
        "dp_allreduce_time_s": dp.allreduce_time_s,
        "step_time_s": dp.step_time_s,
        "samples_per_s": dp.samples_per_s,
    }
