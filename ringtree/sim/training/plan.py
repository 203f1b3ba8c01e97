"""The planner: one training step's time for any DP x TP x PP configuration on a modelled cluster.

Every prediction goes through `predict(work, cluster, algorithm)` and comes back as one
`StepPrediction`, whatever built the work (a typed compute time, a finished run, the transformer
model of `ringtree.sim.training.transformer`). One step (one optimizer update), per device:
  * m micro-batches, each a forward and a backward on every pipeline stage (one stage when pp = 1),
    the TP all-reduces of the stage on the critical path of each;
  * with pp > 1, the stages run the pipeline schedule (1F1B by default), replayed with the
    stage-to-stage link (`ringtree.sim.training.pipeline`); the makespan less the work is the bubble;
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
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ringtree.ranks import Placement, Span
from ringtree.schedules.pipeline import V_SHAPED, ZERO_BUBBLE, build, theoretical_bubble_fraction
from ringtree.sim.network.allreduce import allreduce_time as sim_allreduce_time
from ringtree.sim.network.closed_form import ALGORITHMS, check_algorithm
from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.network.measured import allreduce_seconds
from ringtree.sim.training.pipeline import StageCosts, bubble_formula_s, replay_pipeline

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
# of a backward's compute, the weight gradients' share (W of a split backward) when nothing better is
# known: Qi et al. 2024 profiled T_B 18.09 ms and T_W 9.34 ms for their 1.5B model (Table 9), 0.34
WEIGHT_FRACTION = 1 / 3
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
    # the run's ZeRO stage (from --from-run): 1-2 reduce-scatter the gradients and all-gather the
    # stepped parameters before the next forward; 3 all-gathers each bucket before its module's
    # forward and backward (prefetched) and reduce-scatters in the backward, as ShardedDataParallel
    zero: int = 0

    def __post_init__(self) -> None:
        for what, value in (("the parameter count", self.params), ("--compute-time", self.compute_time_s),
                            ("the run's wait", self.sync_wait_s)):  # fmt: skip
            if value < 0:
                raise ValueError(f"{what} must not be negative, got {value}")
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
        less exposed communication, the outer sync's included, per micro-step) and its gradient
        settings (a PowerSGD run's as its uncompressed DDP: `--sync powersgd` prices the factors)."""
        try:
            accumulate = int(summary.get("accumulate") or 1)
            compute = float(summary["step_time_s"]) - float(summary.get("exposed_comm_time_s") or 0.0)
            # local SGD / DiLoCo: the outer sync's exposed share is priced by the --sync planner
            compute -= float(summary.get("outer_comm_exposed_s") or 0.0)
            compression = summary.get("compression")
            return cls(
                params=int(summary["parameters"]),
                compute_time_s=max(0.0, compute) / accumulate,
                # PowerSGD's factors are priced by the --sync planner; its gradients are fp32
                compression=None if compression == "powersgd" else compression,
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

    @property
    def layout(self) -> Layout:
        """Pure data parallelism, with the run's ZeRO stage."""
        return Layout(zero=self.zero)

    def work(self, ranks: int) -> StepWork:
        """Pure data parallelism over `ranks` devices: the whole model on each. Under ZeRO-3 each
        bucket is gathered behind its share of the compute, as the layers of a transformer are."""
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
            layers=float(len(self.buckets())) if self.zero == 3 else 0.0,
        )


def buckets(grad_bytes: int, itemsize: int, bucket_mb: float) -> list[int]:
    """Bucket sizes in bytes, whole elements, in the order the backward fills them."""
    cap = max(itemsize, int(bucket_mb * (1 << 20)) // itemsize * itemsize)
    full, rest = divmod(grad_bytes, cap)
    return [cap] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class Layout:
    """How the world splits (Megatron-LM's order, innermost first): tp inside a node, then cp, dp, pp.

    `virtual_stages` model chunks per pipeline rank (interleaved 1F1B); `sequence_parallel` turns each
    TP all-reduce into a reduce-scatter and an all-gather; `zero` shards optimizer states (1), then
    gradients (2), then parameters (3) over the dp x cp ranks that hold the same weights, or with
    `shard_group` S over S x cp of them, replicated across the dp / S groups (HSDP): the gradients
    are reduce-scattered inside a group, then each shard all-reduced across the groups.
    """

    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    spread_tp: bool = False  # place each TP group one rank per node instead (for comparison)
    cp: int = 1
    virtual_stages: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    shard_group: int = 0  # data-parallel ranks that shard ZeRO's states; 0: all

    def dp(self, ranks: int) -> int:
        split = self.tp * self.pp * self.cp
        if min(self.tp, self.pp, self.cp) < 1 or ranks % split:
            raise ValueError(
                f"tp={self.tp} x cp={self.cp} x pp={self.pp} must divide the {ranks} GPUs; "
                "change --tp, --cp, --pp or --nodes"
            )
        return ranks // split


@dataclass(frozen=True)
class StepWork:
    """What one device does in one step, before the cluster prices the communication.

    Times are per micro-batch on one pipeline stage of one TP rank (compute only: the backward
    includes any recomputed forward). TP all-reduces are `tp_bytes` each, `tp_forward` of them in a
    forward and `tp_backward` in a backward; `activation_bytes` go between stages per micro-batch.
    With CP, each of the stage's `layers` all-gathers `cp_bytes` of K and V in forward (and once more
    with the reduce-scatter of their gradients in backward) behind `attention_s` of attention; with
    `cp_overlap` False (all-gather CP) none of it hides.
    """

    forward_s: float
    backward_s: float
    micro_batches: int
    grad_bytes: int  # this device's gradients (its 1/(tp pp) of the model)
    itemsize: int  # of one gradient element, as the data-parallel reduction moves it
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
    layers: float = 0.0  # transformer layers on this stage (CP exchanges and ZeRO-3 gathers are per layer)
    cp_bytes: int = 0  # K and V of all c sequence chunks of one layer (one all-gather's output)
    attention_s: float = 0.0  # one layer's attention forward, which hides the CP exchange
    # CP's K/V exchange: True passed in a ring behind the attention (p2p), False all-gathered before it
    cp_overlap: bool = True
    hardware_flops: float = 0.0  # model FLOPs plus recompute, all devices
    # each stage's compute when stages differ (uneven layers, the logits on the last stage); empty:
    # every stage is forward_s / backward_s, which are otherwise the slowest stage's
    stage_forward_s: tuple[float, ...] = ()
    stage_backward_s: tuple[float, ...] = ()
    # the share of each stage's backward compute that is weight gradients (W), which the zero-bubble
    # schedules run apart from the input gradients (B); W needs no communication of its own
    weight_fraction: float = WEIGHT_FRACTION
    # of one parameter element as ZeRO's all-gathers move it (16-bit weights beside fp32 gradients);
    # 0: the gradients' itemsize
    param_itemsize: int = 0
    # expert parallelism (ringtree.sim.training.moe): per micro-batch on this stage, `ep_forward` dispatch and
    # combine exchanges in the forward and `ep_backward` in the backward, each of `ep_bytes` per rank
    # over the EP group of `ep` ranks `etp` apart (an all-to-all, or with `ep_dispatcher` "allgather"
    # an all-gather or reduce-scatter of that many output bytes); with ETP each also all-gathers or
    # reduce-scatters `etp_bytes` over the ETP group; with `ep_windows` (an MoE layer's attention and
    # MLP compute, forward and backward) each exchange hides behind one of them, of another micro-batch
    ep: int = 1
    etp: int = 1
    ep_bytes: int = 0
    ep_forward: int = 0
    ep_backward: int = 0
    etp_bytes: int = 0
    ep_dispatcher: str = "alltoall"
    ep_windows: tuple[float, ...] = ()
    # the MoE layers' host synchronisations per micro-batch (ringtree.sim.training.moe.host_sync_s): the GPU
    # idle, nothing hides it
    ep_sync_s: float = 0.0
    # this device's expert gradients (its experts' share), reduced over the expert-data-parallel group
    # of `expert_dp` ranks ep x etp apart (Megatron-Core's expert-DP group), in their own buckets
    expert_grad_bytes: int = 0
    expert_dp: int = 1

    @property
    def param_bytes(self) -> int:
        """This device's parameters as ZeRO all-gathers them: its gradients' elements, in their dtype."""
        return self.grad_bytes // self.itemsize * (self.param_itemsize or self.itemsize)


@dataclass(frozen=True)
class StepPrediction:
    """One predicted step: its time, where it goes, and (for the transformer model) MFU and memory.

    step_s is the sum of `breakdown`: compute, optimizer, TP and CP communication on the critical
    path, the pipeline bubble, the run's wait, and the gradient reduction and ZeRO gathers left exposed.
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
    cp: int = 1
    virtual_stages: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    cp_comm_s: float = 0.0
    optimizer_s: float = 0.0
    exposed_zero_gather_s: float = 0.0
    tflops_per_gpu: float | None = None
    hardware_tflops_per_gpu: float | None = None
    ep_comm_s: float = 0.0  # the expert-parallel exchanges left exposed
    ep: int = 1
    etp: int = 1
    tokens_per_s_per_gpu: float | None = None
    network: dict[str, Any] = field(default_factory=dict)  # what each node has (`Cluster.network`)

    @property
    def breakdown(self) -> dict[str, float]:
        return {
            "compute_s": self.compute_s,
            "optimizer_s": self.optimizer_s,
            "tp_comm_s": self.tp_comm_s,
            "cp_comm_s": self.cp_comm_s,
            "ep_comm_s": self.ep_comm_s,
            "pp_bubble_s": self.pp_bubble_s,
            "sync_wait_s": self.sync_wait_s,
            "exposed_dp_s": self.exposed_dp_s,
            "exposed_zero_gather_s": self.exposed_zero_gather_s,
        }

    def as_dict(self) -> dict[str, Any]:
        """One key per quantity: the parts of the step only under `breakdown`."""
        out = dataclasses.asdict(self)
        for key in self.breakdown:
            out.pop(key)
        out["breakdown"] = self.breakdown
        return out


def tp_group(cluster: Cluster, tp: int, spread: bool = False) -> Cluster:
    """The cluster one TP group sees: inside a node when tp divides the GPUs per node, else across.

    `spread` places it one rank per node (what a mesh with dp innermost would do).
    """
    if tp < 1 or cluster.ranks % tp:
        raise ValueError(f"tp={tp} must divide the {cluster.ranks} ranks of the cluster")
    if spread:
        return Cluster(
            tp, 1, cluster.intra, cluster.inter, cluster.gamma, cluster.nics_per_node, cluster.nccl
        )
    if cluster.gpus_per_node % tp == 0:
        return Cluster(
            1, tp, cluster.intra, cluster.inter, cluster.gamma, cluster.nics_per_node, cluster.nccl
        )
    if tp % cluster.gpus_per_node:
        raise ValueError(f"tp={tp} must divide or be a multiple of the {cluster.gpus_per_node} GPUs per node")
    return Cluster(
        tp // cluster.gpus_per_node,
        cluster.gpus_per_node,
        cluster.intra,
        cluster.inter,
        cluster.gamma,
        cluster.nics_per_node,
        cluster.nccl,
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
        nodes, local, cluster.intra, inter, cluster.gamma, min(nics, local), cluster.nccl, cluster.measured
    )


def collective_s(kind: str, algorithm: str, group: Cluster | None, nbytes: int, itemsize: int) -> float:
    """One collective over a group, priced as `ringtree sim` prices an all-reduce (a calibration's
    measured rows when the cluster has them): a reduce-scatter or an all-gather is half an all-reduce,
    as ring, halving-doubling and NCCL run it (nccl-tests' bus-bandwidth factors, 2(p-1)/p vs (p-1)/p)."""
    if group is None or group.ranks == 1 or nbytes <= 0:
        return 0.0
    if group.measured is not None:
        seconds = allreduce_seconds(algorithm, group, nbytes, itemsize)
    elif group.nccl is None:  # the time depends on the group's (hashable) fields only: remembered
        seconds = _sim_s(algorithm, group, nbytes, itemsize)
    else:
        seconds = sim_allreduce_time(algorithm, group, nbytes, "closed-form", itemsize).seconds
    return seconds if kind == "all_reduce" else seconds / 2


@functools.lru_cache(maxsize=4096)
def _sim_s(algorithm: str, group: Cluster, nbytes: int, itemsize: int) -> float:
    """`ringtree sim`'s all-reduce time: NCCL's own cost model for `native` on a GPU cluster, else
    the algorithm's closed form."""
    return sim_allreduce_time(algorithm, group, nbytes, "closed-form", itemsize).seconds


@dataclass(frozen=True)
class _Groups:
    """The groups a layout's collectives run over, and the link between pipeline stages."""

    tp: Cluster | None
    cp: Cluster | None
    dp: Cluster  # the ranks holding the same weights (dp x cp), or with a shard group its S x cp
    stage: Link
    replicas: Cluster | None = None  # with a shard group: one rank of each, dp / S ranks


def _groups(cluster: Cluster, layout: Layout, dp: int, work: StepWork | None = None) -> _Groups:
    """Each collective's group as `ringtree.ranks.Placement` puts its ranks on the nodes (Megatron's
    order, pp outermost): a group over k nodes pays the network with the NICs it shares there with
    the other groups of its kind; the stage link is the slowest boundary's (`placed_stage_link`)."""
    tp, cp = layout.tp, layout.cp
    where = placement(cluster, layout, dp, work)
    tp_g = (
        (tp_group(cluster, tp, True) if layout.spread_tp else placed(cluster, where, "tp"))
        if tp > 1
        else None
    )
    cp_g = placed(cluster, where, "cp") if cp > 1 else None
    stage = placed_stage_link(cluster, where)
    if layout.spread_tp:  # dp innermost: each DP group fills nodes by itself
        local = min(dp, cluster.gpus_per_node)
        dp_g = dataclasses.replace(cluster, nodes=-(-dp // local), gpus_per_node=local)
    elif layout.shard_group and layout.shard_group < dp:  # HSDP: shard inside, replicate across
        s = layout.shard_group
        shards = _placed_span(cluster, where.span(tp, s * cp))
        replicas = _placed_span(cluster, where.span(tp * cp * s, dp // s))
        return _Groups(tp_g, cp_g, shards, stage, replicas)
    else:
        dp_g = placed(cluster, where, "dp_cp")
    return _Groups(tp_g, cp_g, dp_g, stage)


def placement(cluster: Cluster, layout: Layout, dp: int, work: StepWork | None = None) -> Placement:
    """Where the layout's ranks sit on the cluster's nodes (with the work's expert mesh)."""
    ep, etp = (work.ep, work.etp) if work is not None else (1, 1)
    return Placement(
        layout.tp, layout.cp, dp, layout.pp, ep, etp, layout.virtual_stages, cluster.gpus_per_node
    )


def placed(cluster: Cluster, where: Placement, kind: str) -> Cluster:
    """The cluster one group of `kind` (`Placement.progression`'s words) sees where it sits."""
    return _placed_span(cluster, _span(where, kind))


@functools.lru_cache(maxsize=4096)
def _span(where: Placement, kind: str) -> Span:
    return where.span(*where.progression(kind))


@functools.lru_cache(maxsize=4096)
def _boundary_span(where: Placement) -> Span:
    return where.boundary_span()


def _placed_span(cluster: Cluster, span: Span) -> Cluster:
    """A group of `span.size` ranks on `span.nodes` nodes, evenly (or, split unevenly, a ring of
    ranks each a hop over the network), on the NICs its node shares with `span.sharing` groups."""
    c = cluster
    if span.nodes == 1:
        return Cluster(1, span.size, c.intra, c.inter, c.gamma, c.nics_per_node, c.nccl, c.measured)
    even = span.size % span.nodes == 0
    nodes, local = (span.nodes, span.size // span.nodes) if even else (span.size, 1)
    inter, nics = _shared_nics(c, span.sharing)
    return Cluster(nodes, local, c.intra, inter, c.gamma, min(nics, local), c.nccl, c.measured)


def _shared_nics(cluster: Cluster, sharing: int) -> tuple[Link, int]:
    """The inter-node link and NICs one of `sharing` flows of groups crossing a node gets: whole NICs
    while there are enough, else a share of one's bandwidth."""
    nics, inter = cluster.nics_per_node, cluster.inter
    if nics >= sharing:
        return inter, nics // max(1, sharing)
    return Link(inter.name, inter.alpha_s, inter.bandwidth_Bps * nics / sharing), 1


def placed_stage_link(cluster: Cluster, where: Placement) -> Link:
    """The link of the slowest pipeline boundary: the network when a rank's neighbour stage sits on
    another node, with the node's NICs shared by every rank sending (or receiving) across it."""
    span = _boundary_span(where) if where.pp > 1 else Span(2, 1, 0)
    if span.nodes == 1:
        return cluster.intra
    return _shared_nics(cluster, span.sharing)[0]


def _pipeline_s(
    work: StepWork, layout: Layout, link: Link, forward: float, backward: float, fast: bool
) -> float:
    """The pipeline's makespan for m micro-batches of (forward, backward) per stage.

    1F1B and GPipe are replayed with the stage link (`ringtree.sim.training.pipeline`); `fast` bounds
    the replay by m (f + b) of the slowest stage plus the fill of the others, and the messages the
    replay puts on the critical path of even stages, (m + p - 1) x 2(p - 1)/p of them, for the
    search. Interleaving V chunks per rank divides the ideal bubble (the other stages' f + b) by V
    and multiplies the stage messages' share by V (Narayanan 2021). Stages differ when the work says
    so (the logits on the last stage): the communication is added to each alike.
    """
    m, p, v = work.micro_batches, layout.pp, layout.virtual_stages
    comm_f, comm_b = forward - work.forward_s, backward - work.backward_s
    fs = tuple(f + comm_f for f in work.stage_forward_s) or (forward,) * p
    bs = tuple(b + comm_b for b in work.stage_backward_s) or (backward,) * p
    if layout.schedule in ZERO_BUBBLE:
        return _zero_bubble_s(work, layout, link, (fs, bs), fast)
    busy = m * (forward + backward)
    ideal = sum(fs) + sum(bs) - (forward + backward)
    message = link.alpha_s + work.activation_bytes * link.beta
    if fast:  # the replay's messages on the critical path: (m + p - 1) x 2(p - 1)/p of them (within 11%)
        makespan = busy + ideal + (m + p - 1) * 2 * (p - 1) / p * message
    else:
        costs = StageCosts(fs, bs, activation_bytes=work.activation_bytes)
        makespan = replay_pipeline(build(layout.schedule, p, m), costs, link).step_time_s
    messages = max(0.0, makespan - busy - ideal)
    return busy + ideal / v + v * messages


def _zero_bubble_s(
    work: StepWork,
    layout: Layout,
    link: Link,
    stage_s: tuple[tuple[float, ...], tuple[float, ...]],
    fast: bool,
) -> float:
    """A zero-bubble schedule's makespan: each stage's backward split into B (its communication
    included) and W (`weight_fraction` of its compute), the schedule replayed with the stage link;
    `fast`: the slowest stage's m (F+B+W) plus the published bubble
    (`ringtree.sim.training.pipeline.bubble_formula_s`) and the messages of the fill, for the search."""
    (fs, bs), m, p = stage_s, work.micro_batches, layout.pp
    compute = work.stage_backward_s or (work.backward_s,) * p
    ws = tuple(work.weight_fraction * b for b in compute)
    if fast:
        k = max(range(p), key=lambda j: fs[j] + bs[j])
        message = link.alpha_s + work.activation_bytes * link.beta
        turns = 2 if layout.schedule in V_SHAPED else 1  # the V: twice the stage messages
        idle = bubble_formula_s(layout.schedule, p, fs[k], bs[k] - ws[k], ws[k])
        return m * (fs[k] + bs[k]) + idle + turns * 2 * (p - 1) * message
    costs = StageCosts(fs, bs, activation_bytes=work.activation_bytes, weight_s=ws)
    return replay_pipeline(build(layout.schedule, p, m), costs, link).step_time_s


def _bucket_times(
    total: int, itemsize: int, bucket_mb: float, price: Callable[[int], float]
) -> tuple[np.ndarray, np.ndarray]:
    """`buckets` of `total` bytes as arrays, and each one's time by `price` (the full buckets are one
    size: priced once)."""
    cap = max(itemsize, int(bucket_mb * (1 << 20)) // itemsize * itemsize)
    full, rest = divmod(total, cap)
    sizes = np.full(full + bool(rest), float(cap))
    times = np.full(len(sizes), price(cap) if full else 0.0)
    if rest:
        sizes[-1], times[-1] = rest, price(rest)
    return sizes, times


def _expert_reduce(
    work: StepWork, layout: Layout, cluster: Cluster, algorithm: str, where: Placement
) -> tuple[np.ndarray, np.ndarray]:
    """The expert gradients' buckets (bytes, seconds): reduced (or with ZeRO reduce-scattered) over the
    expert-data-parallel group, whose members are ep x etp ranks apart."""
    if not work.expert_grad_bytes:
        return np.zeros(0), np.zeros(0)
    kind = "all_reduce" if layout.zero == 0 else "reduce_scatter"
    group = placed(cluster, where, "edp")
    return _bucket_times(
        work.expert_grad_bytes,
        work.itemsize,
        work.bucket_mb,
        lambda n: collective_s(kind, algorithm, group, n, work.itemsize),
    )


def _reduce_s(work: StepWork, layout: Layout, g: _Groups, algorithm: str) -> tuple[np.ndarray, np.ndarray]:
    """Each bucket's size and gradient reduction: an all-reduce, or with ZeRO a reduce-scatter; with a
    shard group, the reduce-scatter inside it and then the all-reduce of its shard across the groups."""
    kind = "all_reduce" if layout.zero == 0 else "reduce_scatter"
    share = g.dp.ranks

    def one(n: int) -> float:
        across = collective_s("all_reduce", algorithm, g.replicas, n // share, work.itemsize)
        return collective_s(kind, algorithm, g.dp, n, work.itemsize) + across

    return _bucket_times(work.grad_bytes, work.itemsize, work.bucket_mb, one)


def predict(
    work: StepWork, cluster: Cluster, algorithm: str = "ring", layout: Layout = Layout(), fast: bool = False
) -> StepPrediction:
    """The predicted time of one optimizer step of `work` laid out as `layout` on `cluster`."""
    check_algorithm(algorithm)
    dp = layout.dp(cluster.ranks)
    m, tp, pp = work.micro_batches, layout.tp, layout.pp
    where = placement(cluster, layout, dp, work)
    g = _groups(cluster, layout, dp, work)
    if layout.sequence_parallel:  # reduce-scatter + all-gather: the all-reduce's traffic, split in two
        one_tp = 2 * collective_s("all_gather", algorithm, g.tp, work.tp_bytes, work.itemsize)
    else:
        one_tp = collective_s("all_reduce", algorithm, g.tp, work.tp_bytes, work.itemsize)
    cp_forward, cp_backward = _cp_exchange(work, g.cp, algorithm)
    gather_f, gather_b = _zero3_gathers(work, layout, g.dp, algorithm)
    ep_forward, ep_backward = _ep_exchange(work, cluster, algorithm, where)
    forward = work.forward_s + work.tp_forward * one_tp + cp_forward + gather_f + ep_forward
    backward = work.backward_s + work.tp_backward * one_tp + cp_backward + gather_b + ep_backward
    busy = m * (forward + backward)
    makespan = _pipeline_s(work, layout, g.stage, forward, backward, fast) if pp > 1 else busy
    bubble = makespan - busy
    makespan += work.sync_wait_s
    dense_sizes, dense_times = _reduce_s(work, layout, g, algorithm)
    expert_sizes, expert_times = _expert_reduce(work, layout, cluster, algorithm, where)
    sizes, times = np.concatenate([dense_sizes, expert_sizes]), np.concatenate([dense_times, expert_times])
    reduce_s = float(times.sum())
    if (work.overlap or layout.zero == 3) and len(times):  # FSDP reduce-scatters each layer in its backward
        # bucket i starts once the last backward has produced it and bucket i-1 is done, so the last
        # ends at max over i of (bucket i's start + the times of buckets i..k)
        ready = makespan - backward + backward * np.cumsum(sizes) / sizes.sum()
        end = float(np.max(ready + np.cumsum(times[::-1])[::-1]))
        exposed = max(makespan, end) - makespan
    else:
        exposed = reduce_s
    gathered = _zero_param_gather_s(work, layout, g.dp, algorithm, m * forward)
    if work.expert_grad_bytes and layout.zero in (1, 2):  # the experts' updated shards, over expert-DP
        expert_work = dataclasses.replace(work, grad_bytes=work.expert_grad_bytes)
        expert_group = placed(cluster, where, "edp")
        gathered += _zero_param_gather_s(expert_work, layout, expert_group, algorithm, m * forward - gathered)
    step = makespan + exposed + work.optimizer_s + gathered
    peak = work.peak_flops * cluster.ranks
    return StepPrediction(
        algorithm,
        cluster.ranks,
        cluster.nodes,
        step,
        m * (work.forward_s + work.backward_s),
        m * (work.tp_forward + work.tp_backward) * one_tp,
        bubble,
        exposed,
        reduce_s,
        work.samples / step if step else 0.0,
        dp,
        tp,
        pp,
        m,
        "inter" if g.tp is not None and g.tp.nodes > 1 else "intra",
        work.flops / (step * peak) if work.flops and peak and step else None,
        sync_wait_s=work.sync_wait_s,
        cp=layout.cp,
        virtual_stages=layout.virtual_stages,
        sequence_parallel=layout.sequence_parallel,
        zero=layout.zero,
        cp_comm_s=m * (cp_forward + cp_backward),
        optimizer_s=work.optimizer_s,
        exposed_zero_gather_s=gathered + m * (gather_f + gather_b),
        tflops_per_gpu=work.flops / (step * cluster.ranks) / 1e12 if work.flops and step else None,
        hardware_tflops_per_gpu=(
            work.hardware_flops / (step * cluster.ranks) / 1e12 if work.hardware_flops and step else None
        ),
        ep_comm_s=m * (ep_forward + ep_backward),
        ep=work.ep,
        etp=work.etp,
        network=cluster.network(),
    )


def ep_group(cluster: Cluster, ep: int, etp: int) -> Cluster:
    """The cluster one EP group sees: ep ranks etp apart (the expert mesh's ETP innermost, then EP), in
    one node (an NVLink domain: a DGX node, an NVL72 rack) while ep x etp fit in it, else over nodes,
    the node's concurrent EP groups sharing its NICs."""
    span, g = ep * etp, cluster.gpus_per_node
    local = ep if span <= g else max(1, g // etp)
    nodes = -(-ep // local)
    nics = max(1, min(local, cluster.nics_per_node // min(etp, cluster.nics_per_node)))
    return Cluster(nodes, local, cluster.intra, cluster.inter, cluster.gamma, nics, cluster.nccl)


def _ep_exchange(work: StepWork, cluster: Cluster, algorithm: str, where: Placement) -> tuple[float, float]:
    """The expert-parallel exchanges of one micro-batch left exposed, forward and backward: the
    all-to-alls priced by `ringtree.sim.network.alltoall` on the EP group (the allgather dispatcher's
    collectives as the other collectives are), the ETP gathers, less the compute that hides them."""
    if not (work.ep_forward or work.ep_backward):
        return 0.0, 0.0
    forward, backward = _ep_collectives(work, cluster, algorithm, where)
    return forward + work.ep_sync_s, backward


def _ep_collectives(
    work: StepWork, cluster: Cluster, algorithm: str, where: Placement
) -> tuple[float, float]:
    """The dispatch and combine collectives of one micro-batch left exposed, forward and backward, on
    the expert mesh's groups where the placement puts them."""
    if work.ep_dispatcher == "allgather":  # over the ep x etp adjacent ranks of the expert mesh
        one = collective_s("all_gather", algorithm, _placed_span(cluster, where.span(1, work.ep * work.etp)),
                           work.ep_bytes, 2)  # fmt: skip
    else:
        one = _alltoall_s(placed(cluster, where, "ep"), work.ep_bytes)
    if work.etp > 1:
        one += collective_s("all_gather", algorithm, placed(cluster, where, "etp"), work.etp_bytes, 2)
    forward, backward = work.ep_forward * one, work.ep_backward * one
    if not work.ep_windows:
        return forward, backward
    # DeepSeek-V3's pairing of a forward and a backward chunk (report, figure 4), which Megatron-Core's
    # combined 1F1B follows: the forward's dispatch behind the other micro-batch's MLP backward, its
    # combine behind the attention backward, the backward's behind the attention and MLP forward
    layers = work.ep_forward // 2
    hidden = layers * sum(min(one, window) for window in work.ep_windows)
    exposed = max(0.0, forward + backward - hidden)
    share = forward / (forward + backward)
    return exposed * share, exposed * (1 - share)


@functools.lru_cache(maxsize=1024)
def _alltoall_s(group: Cluster, nbytes: int) -> float:
    from ringtree.sim.network.alltoall import alltoall_seconds

    return alltoall_seconds(group, nbytes)


def _cp_exchange(work: StepWork, group: Cluster | None, algorithm: str) -> tuple[float, float]:
    """Context parallelism's K/V traffic left exposed, forward and backward, per micro-batch.

    p2p (Megatron-Core's default, Transformer Engine's ring): the chunks pass round the ring while
    the attention computes, so only what the attention does not cover shows; the backward passes
    K/V and their gradients behind twice the attention. all-gather (Llama 3's, section 3.3.2; TE's
    `AttnFuncWithCPAndKVAllGather`, "KV all-gather between CP ranks is exposed"): K and V are
    gathered before the forward's attention and again in the backward, whose gradients are
    reduce-scattered after it; nothing hides.
    """
    ag = collective_s("all_gather", algorithm, group, work.cp_bytes, work.itemsize)
    if not work.cp_overlap:
        return work.layers * ag, work.layers * 2 * ag
    return work.layers * max(0.0, ag - work.attention_s), work.layers * max(
        0.0, 2 * ag - 2 * work.attention_s
    )


def _zero3_gathers(work: StepWork, layout: Layout, group: Cluster, algorithm: str) -> tuple[float, float]:
    """ZeRO-3 all-gathers each layer's parameters before its forward and its backward, prefetched
    behind the previous layer's compute (FSDP): per micro-batch, the part compute does not hide."""
    if layout.zero < 3 or not work.layers:
        return 0.0, 0.0
    size = work.param_itemsize or work.itemsize
    one = collective_s("all_gather", algorithm, group, int(work.param_bytes / work.layers), size)
    per_f, per_b = work.forward_s / work.layers, work.backward_s / work.layers
    return work.layers * max(0.0, one - per_f), work.layers * max(0.0, one - per_b)


def _zero_param_gather_s(
    work: StepWork, layout: Layout, group: Cluster, algorithm: str, hidden_behind_s: float
) -> float:
    """ZeRO-1/2 all-gather the updated parameters after the optimizer step; with overlap (Megatron's
    --overlap-param-gather) behind the next step's forwards, else exposed."""
    if layout.zero not in (1, 2):
        return 0.0
    size = work.param_itemsize or work.itemsize
    total = float(
        _bucket_times(
            work.param_bytes,
            size,
            work.bucket_mb,
            lambda n: collective_s("all_gather", algorithm, group, n, size),
        )[1].sum()
    )
    return max(0.0, total - hidden_behind_s) if work.overlap else total


def allreduce_time(config: StepConfig, cluster: Cluster, algorithm: str) -> float:
    """Seconds to all-reduce every bucket once, one after another (closed form)."""
    return predict(config.work(cluster.ranks), cluster, algorithm, config.layout).dp_allreduce_s


def predict_step(config: StepConfig, cluster: Cluster, algorithm: str = "ring") -> StepPrediction:
    """Data parallelism only (with the config's ZeRO stage): `predict` of the config's work on every
    device of the cluster."""
    return predict(config.work(cluster.ranks), cluster, algorithm, config.layout)


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
    row = predict_step(config, run_cluster, run_algorithm)
    modelled = row.exposed_dp_s + row.exposed_zero_gather_s
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
    best = min(steps, key=lambda a: steps[a].step_s)
    ring = steps.get("ring", steps[best])
    reason = (
        f"{best} gives the shortest step: {steps[best].step_s:.3f} s "
        f"(all-reduce {steps[best].dp_allreduce_s:.3f} s) vs {ring.step_s:.3f} s with ring"
    )
    level, share = bottleneck(config, cluster, best)
    if share > 0:
        reason += f"; {share:.0%} of its all-reduce time is due to the {level} link"
    hints = []
    if not config.overlap and steps[best].dp_allreduce_s > 0:
        hinted = predict_step(dataclasses.replace(config, overlap=True), cluster, best)
        hints.append(f"--overlap: {hinted.step_s:.3f} s")
    if config.itemsize == 4:
        hinted = predict_step(dataclasses.replace(config, compression="fp16"), cluster, best)
        hints.append(f"--compression fp16: {hinted.step_s:.3f} s")
    if hints:
        reason += "; also try " + ", ".join(hints)
    return best, reason


def predict_pipeline(
    schedule: str, p: int, m: int, compute_time_s: float, link: Link, activation_bytes: int = 0
) -> dict[str, float | int | str]:
    """One pipeline step: a device's forward+backward of the whole batch split evenly over p stages
    and m micro-batches (backward twice the forward), with `link` between stages: the planner's
    `predict` on p ranks joined by that link, pipeline fields only."""
    per = compute_time_s / (p * m)  # one stage, one micro-batch: forward + backward
    work = StepWork(per / 3, 2 * per / 3, m, 0, 4, activation_bytes=activation_bytes)
    row = predict(work, Cluster(1, p, link, link), "ring", Layout(pp=p, schedule=schedule))
    theory = theoretical_bubble_fraction(p, m)
    if schedule in ZERO_BUBBLE:  # the published bubble with W a third of the backward
        f, w = work.forward_s, work.backward_s * work.weight_fraction
        idle = bubble_formula_s(schedule, p, f, work.backward_s - w, w)
        theory = idle / (m * per + idle)
    return {
        "schedule": schedule,
        "pp": p,
        "micro_batches": m,
        "pipeline_step_time_s": row.step_s,
        "bubble_fraction": row.pp_bubble_s / row.step_s if row.step_s else 0.0,
        "theoretical_bubble_fraction": theory,
    }
