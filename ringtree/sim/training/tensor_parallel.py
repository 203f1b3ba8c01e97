"""The cost of tensor parallelism: per transformer block, two activation all-reduces forward and two backward.

Megatron's layout puts one all-reduce at the end of attention and one at the end of the MLP in
forward (g), and one at the input of each in backward (f). Each reduces the block's activation,
batch x seq x hidden elements, over the TP group's link: the intra-node link when the group fits
in a node (ringtree's Mesh puts it there), the inter-node link when it must span nodes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ringtree.sim.network.closed_form import estimate
from ringtree.sim.network.hardware import Cluster
from ringtree.sim.training.plan import Layout, StepConfig, StepPrediction, dp_group, predict, tp_group

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
    return tp_group(cluster, tp)


def spread_cluster(cluster: Cluster, tp: int) -> Cluster:
    """A TP group of tp ranks placed one per node (what a mesh with dp innermost would do)."""
    return tp_group(cluster, tp, spread=True)


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
    return dp_group(cluster, tp, cluster.ranks // tp)


def predict_tp_step(
    config: StepConfig,
    shape: TPShape,
    cluster: Cluster,
    tp: int,
    algorithm: str = "ring",
    spread: bool = False,
) -> StepPrediction:
    """A DP x TP step: compute / tp, plus the TP all-reduces on the critical path, plus the DP
    all-reduce of each rank's 1/tp of the gradients over its DP group. `spread` places the TP
    group one rank per node (across the network) instead of inside a node, for comparison."""
    work = dataclasses.replace(
        config.work(cluster.ranks // tp),
        forward_s=config.work(1).forward_s / tp,
        backward_s=config.work(1).backward_s / tp,
        grad_bytes=config.params // tp * config.itemsize,
        tp_bytes=shape.activation_bytes,
        tp_forward=ALL_REDUCES_PER_BLOCK // 2 * shape.layers,
        tp_backward=ALL_REDUCES_PER_BLOCK // 2 * shape.layers,
    )
    return predict(work, cluster, algorithm, Layout(tp=tp, spread_tp=spread))
