"""The planner: one training step's time for any DP x TP x PP configuration on a modelled cluster.

Every prediction goes through `predict(work, cluster, algorithm)` and comes back as one
`StepPrediction`, whatever built the work (a typed compute time, a finished run, the transformer
model of `ringtree.sim.transformer`). One step (one optimizer update), per device:
  * m micro-batches, each a forward and a backward on every pipeline stage (one stage when pp = 1),
    the TP all-reduces of the stage on the critical path of each;
  * with pp > 1, the stages run the pipeline schedule (1F1B by default), replayed with the
    stage-to-stage link (`ringtree.sim.pipeline`); the makespan less the work is the bubble;
  * the gradients of the device's 1/(tp pp) of the parameters, params x bytes of the gradient dtype,
    cut into fusion buckets of `bucket_mb` MiB, all-reduced one after another over the DP group;
  * without overlap the all-reduces follow the compute; with overlap bucket i may start once
    the last backward has produced its share of the gradients (buckets fill evenly through the
    backward) and the previous bucket is done: step = max(compute, last bucket's end);
  * a plan from a finished run keeps that run's wait: its exposed communication beyond the
    all-reduce the plan predicts for the run's own shape (ranks waiting for a straggler, for ranks
    sharing their cores, for skewed input). It delays the last backward's gradients by that much.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ringtree.sim.closed_form import ALGORITHMS, check_algorithm, estimate
from ringtree.sim.hardware import Cluster, Link
from ringtree.sim.measured import allreduce_seconds

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
    """A step described by a measured or typed compute time (data parallel; TP and PP split it)."""

    params: int
    compute_time_s: float  # forward + backward of one micro-step on one device, whole model
    grad_dtype: str = "fp32"
    compression: str | None = None  # cast gradients to fp16/bf16 for the all-reduce
    overlap: bool = False
    bucket_mb: float = 25.0  # torch DDP's default bucket_cap_mb
    accumulate: int = 1
    batch_size: int = 32  # samples per device per micro-step
    sync_wait_s: float = 0.0  # per step: ranks waiting for each other, measured (`with_run_wait`)
    zero: int = 0  # the run's ZeRO stage (carried from --from-run; its traffic is planned as DDP's)

    def __post_init__(self) -> None:
        if self.params < 0 or self.compute_time_s < 0 or self.sync_wait_s < 0:
            raise ValueError(
                f"need params >= 0, compute time >= 0 and wait >= 0, got {self.params}, "
                f"{self.compute_time_s}, {self.sync_wait_s}"
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
        return buckets(self.grad_bytes, self.itemsize, self.bucket_mb)

    @classmethod
    def from_summary(cls, summary: dict[str, Any]) -> StepConfig:
        """The step of a finished `ringtree train --json` run: its measured compute time (step time
        less exposed communication, per micro-step) and its gradient settings."""
        try:
            accumulate = int(summary.get("accumulate") or 1)
            compute = float(summary["step_time_s"]) - float(summary.get("exposed_comm_time_s") or 0.0)
            return cls(
                params=int(summary["parameters"]),
                compute_time_s=max(0.0, compute) / accumulate,
                compression=summary.get("compression"),
                overlap=bool(summary.get("overlap", False)),
                bucket_mb=float(summary.get("bucket_mb") or 25.0),
                accumulate=accumulate,
                batch_size=int(summary.get("batch_size") or 1),
                zero=int(summary.get("zero") or 0),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"not a `ringtree train --json` summary: missing or bad {e}; pass the file that command wrote"
            ) from None

    def work(self, ranks: int) -> StepWork:
        """Pure data parallelism over `ranks` devices: the whole model on each."""
        c = self.compute_time_s
        return StepWork(
            forward_s=c * (1 - BACKWARD_FRACTION),
            backward_s=c * BACKWARD_FRACTION,
            micro_batches=self.accumulate,
            grad_bytes=self.grad_bytes,
            itemsize=self.itemsize,
            bucket_mb=self.bucket_mb,
            overlap=self.overlap,
            samples=self.accumulate * self.batch_size * ranks,
            sync_wait_s=self.sync_wait_s,
        )


def buckets(grad_bytes: int, itemsize: int, bucket_mb: float) -> list[int]:
    """Bucket sizes in bytes, whole elements, in the order the backward fills them."""
    cap = max(itemsize, int(bucket_mb * (1 << 20)) // itemsize * itemsize)
    full, rest = divmod(grad_bytes, cap)
    return [cap] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class Layout:
    """How the world splits: tp innermost (inside a node), then dp, then pp (Megatron-LM's order)."""

    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    spread_tp: bool = False  # place each TP group one rank per node instead (for comparison)

    def dp(self, ranks: int) -> int:
        if self.tp < 1 or self.pp < 1 or ranks % (self.tp * self.pp):
            raise ValueError(
                f"tp={self.tp} x pp={self.pp} must divide the {ranks} GPUs; change --tp, --pp or --nodes"
            )
        return ranks // (self.tp * self.pp)


@dataclass(frozen=True)
class StepWork:
    """What one device does in one step, before the cluster prices the communication.

    Times are per micro-batch on one pipeline stage of one TP rank (compute only: the backward
    includes any recomputed forward). TP all-reduces are `tp_bytes` each, `tp_forward` of them in a
    forward and `tp_backward` in a backward; `activation_bytes` go between stages per micro-batch.
    """

    forward_s: float
    backward_s: float
    micro_batches: int
    grad_bytes: int  # this device's gradients (its 1/(tp pp) of the model)
    itemsize: int
    bucket_mb: float = 25.0
    overlap: bool = False
    samples: int = 0  # samples per step, all devices
    tp_bytes: int = 0
    tp_forward: int = 0
    tp_backward: int = 0
    activation_bytes: int = 0
    flops: float = 0.0  # model FLOPs per step, all devices (for MFU)
    peak_flops: float = 0.0  # one device's peak FLOP/s
    optimizer_s: float = 0.0  # the optimizer step, once per step after the gradients are reduced
    sync_wait_s: float = 0.0  # ranks waiting for each other before the last gradients are reduced


@dataclass(frozen=True)
class StepPrediction:
    """One predicted step: its time, where it goes, and (for the transformer model) MFU and memory.

    step_s = compute_s + tp_comm_s + pp_bubble_s + sync_wait_s + exposed_dp_s.
    """

    algorithm: str
    ranks: int
    nodes: int
    step_s: float
    compute_s: float
    tp_comm_s: float
    pp_bubble_s: float
    exposed_dp_s: float
    dp_allreduce_s: float
    samples_per_s: float
    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batches: int = 1
    tp_link: str = "intra"
    mfu: float | None = None
    memory: dict[str, Any] | None = None
    details: dict[str, Any] = field(default_factory=dict)
    sync_wait_s: float = 0.0

    # The names the planner's JSON had before the unified model, kept for its users.
    @property
    def step_time_s(self) -> float:
        return self.step_s

    @property
    def allreduce_time_s(self) -> float:
        return self.dp_allreduce_s

    @property
    def compute_time_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.pp_bubble_s

    @property
    def breakdown(self) -> dict[str, float]:
        return {
            "compute_s": self.compute_s,
            "tp_comm_s": self.tp_comm_s,
            "pp_bubble_s": self.pp_bubble_s,
            "sync_wait_s": self.sync_wait_s,
            "exposed_dp_s": self.exposed_dp_s,
        }

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["breakdown"] = self.breakdown
        out.update(
            step_time_s=self.step_s, allreduce_time_s=self.dp_allreduce_s, compute_time_s=self.compute_time_s
        )
        return out


def tp_group(cluster: Cluster, tp: int, spread: bool = False) -> Cluster:
    """The cluster one TP group sees: inside a node when tp divides the GPUs per node, else across.

    `spread` places it one rank per node (what a mesh with dp innermost would do).
    """
    if tp < 1 or cluster.ranks % tp:
        raise ValueError(f"tp={tp} must divide the {cluster.ranks} ranks of the cluster")
    if spread:
        return Cluster(tp, 1, cluster.intra, cluster.inter, cluster.gamma, cluster.nics_per_node)
    if cluster.gpus_per_node % tp == 0:
        return Cluster(1, tp, cluster.intra, cluster.inter, cluster.gamma, cluster.nics_per_node)
    if tp % cluster.gpus_per_node:
        raise ValueError(f"tp={tp} must divide or be a multiple of the {cluster.gpus_per_node} GPUs per node")
    return Cluster(
        tp // cluster.gpus_per_node, cluster.gpus_per_node, cluster.intra, cluster.inter, cluster.gamma
    )


def dp_group(cluster: Cluster, tp: int, dp: int) -> Cluster:
    """The cluster one DP group sees, its members tp ranks apart; the tp groups of a node run their
    DP all-reduces at once, so they share the node's NICs (each gets nics / groups, or a share of one)."""
    local = max(1, min(dp, cluster.gpus_per_node // tp)) if tp <= cluster.gpus_per_node else 1
    nodes = -(-dp // local)
    concurrent = min(tp, cluster.gpus_per_node)
    nics = max(1, cluster.nics_per_node // concurrent)
    inter = cluster.inter
    if cluster.nics_per_node < concurrent:  # several groups on one NIC: each gets its share
        share = cluster.nics_per_node / concurrent
        inter = Link(inter.name, inter.alpha_s, inter.bandwidth_Bps * share)
    return Cluster(
        nodes, local, cluster.intra, inter, cluster.gamma, min(nics, local), measured=cluster.measured
    )


def stage_link(cluster: Cluster, tp: int, dp: int) -> Link:
    """Consecutive pipeline stages are tp x dp ranks apart: another node once that fills a node."""
    return cluster.inter if tp * dp >= cluster.gpus_per_node and cluster.nodes > 1 else cluster.intra


def predict(
    work: StepWork, cluster: Cluster, algorithm: str = "ring", layout: Layout = Layout()
) -> StepPrediction:
    """The predicted time of one optimizer step of `work` laid out as `layout` on `cluster`."""
    name = check_algorithm(algorithm)
    dp = layout.dp(cluster.ranks)
    m, tp, pp = work.micro_batches, layout.tp, layout.pp
    group = tp_group(cluster, tp, layout.spread_tp) if tp > 1 else None
    one_tp = estimate(name, group, work.tp_bytes, work.itemsize) if group and work.tp_bytes else 0.0
    forward = work.forward_s + work.tp_forward * one_tp
    backward = work.backward_s + work.tp_backward * one_tp
    busy = m * (forward + backward)
    if pp > 1:
        from ringtree.schedules.pipeline import build
        from ringtree.sim.pipeline import StageCosts, replay_pipeline

        costs = StageCosts.uniform(pp, forward, backward, activation_bytes=work.activation_bytes)
        link = stage_link(cluster, tp, dp)
        makespan = replay_pipeline(build(layout.schedule, pp, m), costs, link).step_time_s
    else:
        makespan = busy
    bubble = makespan - busy
    makespan += work.sync_wait_s
    sizes = buckets(work.grad_bytes, work.itemsize, work.bucket_mb)
    if layout.spread_tp:  # dp innermost: each DP group fills nodes by itself
        local = min(dp, cluster.gpus_per_node)
        group_dp = dataclasses.replace(cluster, nodes=-(-dp // local), gpus_per_node=local)
    else:
        group_dp = dp_group(cluster, tp, dp)
    cache = {n: allreduce_seconds(algorithm, group_dp, n, work.itemsize) for n in set(sizes)}
    times = [cache[n] for n in sizes]
    if work.overlap:
        end, produced = 0.0, 0
        for size, seconds in zip(sizes, times, strict=True):
            produced += size
            end = max(end, makespan - backward + backward * produced / work.grad_bytes) + seconds
        step = max(makespan, end)
    else:
        step = makespan + sum(times)
    step += work.optimizer_s
    peak = work.peak_flops * cluster.ranks
    return StepPrediction(
        algorithm,
        cluster.ranks,
        cluster.nodes,
        step,
        m * (work.forward_s + work.backward_s) + work.optimizer_s,
        m * (work.tp_forward + work.tp_backward) * one_tp,
        bubble,
        step - makespan - work.optimizer_s,
        sum(times),
        work.samples / step if step else 0.0,
        dp,
        tp,
        pp,
        m,
        "inter" if group is not None and group.nodes > 1 else "intra",
        work.flops / (step * peak) if work.flops and peak and step else None,
        sync_wait_s=work.sync_wait_s,
    )


def allreduce_time(config: StepConfig, cluster: Cluster, algorithm: str) -> float:
    """Seconds to all-reduce every bucket once, one after another (closed form)."""
    return predict(config.work(cluster.ranks), cluster, algorithm).dp_allreduce_s


def predict_step(config: StepConfig, cluster: Cluster, algorithm: str = "ring") -> StepPrediction:
    """Data parallelism only: `predict` of the config's work on every device of the cluster."""
    return predict(config.work(cluster.ranks), cluster, algorithm)


def with_run_wait(config: StepConfig, summary: dict[str, Any], run_cluster: Cluster) -> StepConfig:
    """`config` (from the run's summary) with the run's wait: its measured exposed communication
    beyond what the plan predicts for the run's own algorithm on the run's own shape, never below 0.

    On one node that wait is ranks waiting for each other (a straggler, ranks sharing cores, skewed
    input), not the network; a plan for more nodes keeps it and adds the bigger all-reduce. With a
    calibration that has rows of the run's shape the prediction it is measured against is those
    rows; without one, the modelled links.
    """
    run_algorithm = str(summary.get("algorithm") or "ring")
    if run_algorithm not in (*ALGORITHMS, "native"):
        run_algorithm = "ring"  # an algorithm the planner does not know is planned as ring
    exposed = float(summary.get("exposed_comm_time_s") or 0.0)
    modelled = predict_step(config, run_cluster, run_algorithm).exposed_dp_s
    return dataclasses.replace(config, sync_wait_s=max(0.0, exposed - modelled))


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
