"""The planner: a data-parallel training step's time on a modelled cluster, and what to change.

One step (one optimizer update) of data parallelism over `cluster.ranks` devices:
  * compute: `accumulate` micro-steps of `compute_time_s` each (forward then backward, the
    backward taking BACKWARD_FRACTION of it), the same on every device;
  * gradients: params x bytes of the gradient dtype (or of the compression dtype), cut into
    fusion buckets of `bucket_mb` MiB, all-reduced one after another with `algorithm`;
  * without overlap the all-reduces follow the compute; with overlap bucket i may start once
    the last backward has produced its share of the gradients (buckets fill evenly through the
    backward) and the previous bucket is done: step = max(compute, last bucket's end).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ringtree.sim.closed_form import ALGORITHMS, check_algorithm, estimate
from ringtree.sim.hardware import Cluster, Link

MODELS: dict[str, int] = {
    "vit-base": 86_000_000,
    "vit-large": 307_000_000,
    "vit-huge": 632_000_000,
    "resnet50": 25_600_000,
    "bert-large": 340_000_000,
    "gpt2-xl": 1_500_000_000,
    "llama-7b": 6_740_000_000,
}
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
BACKWARD_FRACTION = 2 / 3  # backward costs about twice the forward
_FREE = Link("free", 0.0, 1e30)


@dataclass(frozen=True)
class StepConfig:
    """What one training step needs besides the cluster and the algorithm."""

    params: int
    compute_time_s: float
    grad_dtype: str = "fp32"
    compression: str | None = None  # cast gradients to fp16/bf16 for the all-reduce
    overlap: bool = False
    bucket_mb: float = 25.0  # torch DDP's default bucket_cap_mb
    accumulate: int = 1
    batch_size: int = 32  # samples per device per micro-step

    def __post_init__(self) -> None:
        if self.params < 0 or self.compute_time_s < 0:
            raise ValueError(
                f"need params >= 0 and compute time >= 0, got {self.params}, {self.compute_time_s}"
            )
        for name in (self.grad_dtype, self.compression):
            if name is not None and name not in DTYPE_BYTES:
                raise ValueError(f"unknown gradient dtype {name!r}; choose one of {', '.join(DTYPE_BYTES)}")
        if self.bucket_mb <= 0 or self.accumulate < 1 or self.batch_size < 1:
            raise ValueError(
                f"need bucket_mb > 0, accumulate >= 1, batch_size >= 1; got {self.bucket_mb}, "
                f"{self.accumulate}, {self.batch_size}"
            )

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.compression or self.grad_dtype]

    @property
    def grad_bytes(self) -> int:
        return self.params * self.itemsize

    def buckets(self) -> list[int]:
        """Bucket sizes in bytes, whole elements, in the order the backward fills them."""
        cap = max(self.itemsize, int(self.bucket_mb * (1 << 20)) // self.itemsize * self.itemsize)
        full, rest = divmod(self.grad_bytes, cap)
        return [cap] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class StepPrediction:
    """One algorithm's predicted step on one cluster."""

    algorithm: str
    ranks: int
    nodes: int
    allreduce_time_s: float
    compute_time_s: float
    step_time_s: float
    samples_per_s: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def allreduce_time(config: StepConfig, cluster: Cluster, algorithm: str) -> float:
    """Seconds to all-reduce every bucket once, one after another (closed form)."""
    return sum(_bucket_times(config, cluster, algorithm))


def _bucket_times(config: StepConfig, cluster: Cluster, algorithm: str) -> list[float]:
    cache: dict[int, float] = {}
    for size in config.buckets():
        if size not in cache:
            cache[size] = estimate(algorithm, cluster, size, config.itemsize)
    return [cache[size] for size in config.buckets()]


def predict_step(config: StepConfig, cluster: Cluster, algorithm: str = "ring") -> StepPrediction:
    """The predicted time of one optimizer step (all micro-steps and the gradient all-reduce)."""
    name = check_algorithm(algorithm)
    times = _bucket_times(config, cluster, name)
    compute = config.accumulate * config.compute_time_s
    if config.overlap:
        backward = BACKWARD_FRACTION * config.compute_time_s
        start_of_backward = compute - backward
        end, produced = 0.0, 0
        for size, seconds in zip(config.buckets(), times, strict=True):
            produced += size
            ready = start_of_backward + backward * produced / config.grad_bytes
            end = max(end, ready) + seconds
        step = max(compute, end)
    else:
        step = compute + sum(times)
    samples = config.accumulate * config.batch_size * cluster.ranks
    return StepPrediction(
        algorithm, cluster.ranks, cluster.nodes, sum(times), compute, step, samples / step if step else 0.0
    )


def speedup_vs_one_node(config: StepConfig, cluster: Cluster, algorithm: str) -> float:
    """Throughput on the cluster over throughput on one of its nodes."""
    mine = predict_step(config, cluster, algorithm).samples_per_s
    one = predict_step(config, cluster.with_nodes(1), algorithm).samples_per_s
    return mine / one if one else 0.0


def bottleneck(config: StepConfig, cluster: Cluster, algorithm: str) -> tuple[str, float]:
    """The link level whose removal would save most all-reduce time, and that share of it."""
    total = allreduce_time(config, cluster, algorithm)
    if total == 0:
        return "none", 0.0
    saved = {
        f"intra ({cluster.intra.name})": total
        - allreduce_time(config, dataclasses.replace(cluster, intra=_FREE), algorithm),
        f"inter ({cluster.inter.name})": total
        - allreduce_time(config, dataclasses.replace(cluster, inter=_FREE), algorithm),
    }
    level = max(saved, key=lambda k: saved[k])
    return level, saved[level] / total


def recommend(
    config: StepConfig, cluster: Cluster, algorithms: tuple[str, ...] = ALGORITHMS
) -> tuple[str, str]:
    """The algorithm with the shortest step, and why (including what else would help)."""
    steps = {a: predict_step(config, cluster, a) for a in algorithms}
    best = min(steps, key=lambda a: steps[a].step_time_s)
    ring = steps.get("ring", steps[best])
    reason = (
        f"{best} gives the shortest step: {steps[best].step_time_s:.3f} s "
        f"(all-reduce {steps[best].allreduce_time_s:.3f} s) vs {ring.step_time_s:.3f} s with ring"
    )
    level, share = bottleneck(config, cluster, best)
    if share > 0:
        reason += f"; {share:.0%} of its all-reduce time is due to the {level} link"
    hints = []
    if not config.overlap and steps[best].allreduce_time_s > 0:
        hinted = predict_step(dataclasses.replace(config, overlap=True), cluster, best)
        hints.append(f"--overlap: {hinted.step_time_s:.3f} s")
    if config.itemsize == 4:
        hinted = predict_step(dataclasses.replace(config, compression="fp16"), cluster, best)
        hints.append(f"--compression fp16: {hinted.step_time_s:.3f} s")
    if hints:
        reason += "; also try " + ", ".join(hints)
    return best, reason
