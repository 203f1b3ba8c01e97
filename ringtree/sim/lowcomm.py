"""Low-communication training, priced: one step under DDP, PowerSGD, local SGD, DiLoCo and Streaming DiLoCo.

Every all-reduce goes through the planner's one `collective_s`; the step inside a replica group
(or the world, for DDP and PowerSGD) is the planner's own prediction, passed in as `step(cluster)`,
so the transformer and the formula planners price alike. Per method (H inner steps, F fragments,
T overlapped steps, R replica groups, S the bytes of one full-model sync):
  * ddp: the planner's step on the whole cluster;
  * powersgd: DDP's step with each bucket's all-reduce replaced by what torch's `powerSGD_hook` runs
    on it, one after another: one plain all-reduce of the uncompressed tensors (1-D, and matrices
    whose compression rate is below the minimum), then the all-reduce of P (rows x rank), then of Q
    (columns x rank); what DDP's overlap hid of its own all-reduce hides as much of these; on the
    device, `POWERSGD_PASSES` memory passes over the compressed tensors (when the GPU is known);
  * local-sgd, diloco: DDP inside each replica group every step, and every H steps a full-model
    all-reduce between the groups; each rank of a group sends its 1/(group's ranks) shard (the
    group's copies are equal) and the group all-gathers the average back, as a hierarchical
    all-reduce does; blocking: mean step = inner step + sync / H;
  * streaming-diloco: 1/F of the model every H/F steps, overlapped with the next T inner steps:
    exposed = max(0, sync - T x compute), mean step = inner step + exposed / (H/F).
Outer payloads are `--outer-dtype` bytes per element (fp32 4, bf16 2, fp8 1, int8 1, int4 0.5) plus
one fp32 scale per `SCALE_BLOCK` elements for the quantised ones.

Bytes over the slowest link are what one node sends to the other nodes (one direction, the
all-reduce's lower bound 2(k-1)/k of the payload for k copies across nodes, which ring, tree and
hierarchical all-reduces reach), averaged per step; on one node, what one rank sends. Compute
utilisation is the step with no data-parallel communication at all over the step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.training.plan import StepPrediction, buckets, collective_s, dp_group

SYNCS = ("ddp", "powersgd", "local-sgd", "diloco", "streaming-diloco")
PERIODIC = ("local-sgd", "diloco", "streaming-diloco")
OUTER_DTYPES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
# PowerSGD's passes over a compressed bucket in memory, as torch's hook runs them with error
# feedback: add the error (2 reads, 1 write), keep a copy (1 + 1), M Q and M^T P (1 read each),
# P Q^T back into the bucket (1 write), the new error (2 reads, 1 write)
POWERSGD_PASSES = 11
SCALE_BLOCK = 128  # elements sharing one fp32 scale in a quantised pseudo-gradient (per-block scales)
TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)  # compute utilisations the bandwidth sweep asks for
CAVEAT = (
    "convergence is not priced: local SGD and DiLoCo take H inner steps per replica between syncs "
    "and PowerSGD sends a rank-r approximation, so the same samples can reach a different loss; "
    "DiLoCo matched data parallelism's perplexity at H = 500 for language models (Douillard et al. "
    "2023), but check your model's held-out loss against DDP's before relying on it"
)


@dataclass(frozen=True)
class SyncMethod:
    """How the replicas synchronise: the words of `ringtree train --sync` and `ringtree plan --sync`."""

    sync: str = "ddp"
    powersgd_rank: int = 2
    replicas: int = 0  # replica groups (local SGD, DiLoCo); 0: one per node
    inner_steps: int = 100  # H
    fragments: int = 1  # F (Streaming DiLoCo)
    overlap_steps: int = 0  # T (Streaming DiLoCo)
    outer_dtype: str = "fp32"
    min_compression_rate: float = 2.0  # torch PowerSGDState's default

    def __post_init__(self) -> None:
        if self.sync not in SYNCS:
            raise ValueError(f"unknown --sync {self.sync!r}; choose one of {', '.join(SYNCS)}")
        if self.powersgd_rank < 1:
            raise ValueError(f"--powersgd-rank must be at least 1, got {self.powersgd_rank}")
        if self.inner_steps < 1:
            raise ValueError(f"--inner-steps must be at least 1, got {self.inner_steps}")
        if self.replicas < 0:
            raise ValueError(f"--replicas must be at least 1 (0: one per node), got {self.replicas}")
        if self.outer_dtype not in OUTER_DTYPES:
            raise ValueError(
                f"unknown --outer-dtype {self.outer_dtype!r}; choose one of {', '.join(OUTER_DTYPES)}"
            )
        self._check_streaming()

    def _check_streaming(self) -> None:
        f, t, h = self.fragments, self.overlap_steps, self.inner_steps
        if f < 1 or h % f:
            raise ValueError(f"--fragments {f} must be at least 1 and divide --inner-steps {h}")
        if t < 0 or t >= h // f:
            raise ValueError(
                f"--overlap-steps {t} must be at least 0 and below --inner-steps / --fragments = {h // f}"
            )

    @property
    def period(self) -> int:
        """Inner steps between two syncs (of one fragment each under Streaming DiLoCo)."""
        return self.inner_steps // self.fragments

    def outer_bytes(self, params: int) -> int:
        """Bytes of one full-model outer sync's payload in `outer_dtype` (scales included)."""
        size = OUTER_DTYPES[self.outer_dtype]
        scales = 4 * math.ceil(params / SCALE_BLOCK) if size < 2 else 0
        return math.ceil(params * size) + scales

    def words(self) -> dict[str, Any]:
        """The method's words as the JSON names them, None where they do not apply to it."""
        periodic, streaming = self.sync in PERIODIC, self.sync == "streaming-diloco"
        return {
            "sync": self.sync,
            "powersgd_rank": self.powersgd_rank if self.sync == "powersgd" else None,
            "inner_steps": self.inner_steps if periodic else None,
            "fragments": self.fragments if streaming else None,
            "overlap_steps": self.overlap_steps if streaming else None,
            "outer_dtype": self.outer_dtype if periodic else None,
        }


@dataclass(frozen=True)
class Model:
    """What the pricing needs of the model: its parameter count, the gradients' wire itemsize and
    buckets, its parameter shapes (PowerSGD; empty: unknown), and how the layout splits a copy."""

    params: int
    grad_itemsize: int
    bucket_mb: float = 25.0
    shapes: tuple[tuple[int, ...], ...] = ()
    tp: int = 1
    pp: int = 1
    cp: int = 1
    layers: int = 0  # the layers Streaming DiLoCo's fragments split (0: unknown)
    zero: int = 0  # the ZeRO stage inside a replica group (PowerSGD compresses DDP's all-reduce only)
    hbm_Bps: float = 0.0  # the device's memory bandwidth, for PowerSGD's passes (0: unknown, not priced)
    powersgd_work_s: float | None = None  # PowerSGD's own work per step, measured (None: priced)

    @property
    def split(self) -> int:
        """Ranks of one model copy (tp x cp x pp): a replica group holds whole copies."""
        return self.tp * self.cp * self.pp


@dataclass(frozen=True)
class SyncPrice:
    """One method's step: the mean step time, its parts, the traffic and compute utilisation."""

    method: dict[str, Any]
    replicas: int
    step_s: float
    inner_step_s: float
    outer_sync_s: float  # one sync between the replica groups (one fragment's); 0 for ddp/powersgd
    outer_comm_exposed_s: float  # per step, averaged over the steps between syncs
    dp_comm_s: float  # per step: the data-parallel reduction of every step (DDP's or PowerSGD's)
    slow_link_bytes_per_step: float
    peak_sync_bytes: float
    peak_bandwidth_gbps: float
    compute_utilisation: float
    samples_per_s: float

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {**out.pop("method"), **out}


StepFn = Callable[[Cluster], StepPrediction]


def price(method: SyncMethod, model: Model, cluster: Cluster, algorithm: str, step: StepFn) -> SyncPrice:
    """One step of `model` on `cluster` under `method`; `step(c)` is the planner's DDP step on c."""
    world = step(cluster)
    compute = world.step_s - world.exposed_dp_s - world.exposed_zero_gather_s
    samples = world.samples_per_s * world.step_s
    if method.sync == "ddp":
        nbytes = slow_link_bytes(model.params * model.grad_itemsize, cluster.ranks // model.split, cluster)
        return _result(method, 1, world.step_s, world.step_s, 0.0, 0.0, world.exposed_dp_s, nbytes, nbytes,
                       compute, samples)  # fmt: skip
    if method.sync == "powersgd":
        return _powersgd(method, model, cluster, algorithm, world, compute, samples)
    return _periodic(method, model, cluster, algorithm, step, compute, samples)


def _result(
    method: SyncMethod, replicas: int, step_s: float, inner_s: float, outer_s: float, exposed: float,
    dp_s: float, per_step: float, peak: float, compute: float, samples: float,
) -> SyncPrice:  # fmt: skip
    window = max(1, method.overlap_steps if method.sync == "streaming-diloco" else 0) * compute
    return SyncPrice(
        method.words(), replicas, step_s, inner_s, outer_s, exposed, dp_s, per_step, peak,
        peak * 8 / window / 1e9 if window else math.inf, compute / step_s if step_s else 0.0,
        samples / step_s if step_s else 0.0,
    )  # fmt: skip


def slow_link_bytes(payload: float, copies: int, cluster: Cluster) -> float:
    """Bytes one node sends to the others (one rank to the others on one node) to all-reduce
    `payload` held by `copies` groups: 2(k-1)/k of its share of the payload, k the copies across
    the slowest link's ends (a copy spread over several of them sends its share from each)."""
    ends = cluster.nodes if cluster.nodes > 1 else cluster.ranks
    k = min(copies, ends)
    return 2 * (k - 1) / k * payload * k / ends if k > 1 else 0.0


def powersgd_payload(shapes: Sequence[tuple[int, ...]], rank: int, min_rate: float) -> tuple[int, int, int]:
    """Elements of one step's PowerSGD all-reduces, as torch's hook splits them: (uncompressed, P, Q).

    A tensor of shape (n, ...) is the matrix n x m with m the rest; it travels uncompressed when
    1-D or when (n + m) r x min_rate is not below n m (torch's `_should_compress`)."""
    plain = p = q = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = math.prod(shape[1:]) if len(shape) > 1 else 1
        if len(shape) < 2 or (n + m) * rank * min_rate >= n * m:
            plain += n * m
        else:
            r = min(rank, n, m)
            p, q = p + n * r, q + m * r
    return plain, p, q


def _powersgd_buckets(model: Model, rank: int, min_rate: float) -> list[tuple[int, int, int]]:
    """The (uncompressed, P, Q) elements of each DDP bucket: tensors in reverse order (the order the
    backward produces them), a bucket closed once it holds `bucket_mb` MiB, as DDP fills them."""
    cap = model.bucket_mb * (1 << 20)
    out, current, size = [], [], 0.0
    for shape in reversed(model.shapes):
        current.append(shape)
        size += math.prod(shape) * model.grad_itemsize
        if size >= cap:
            out.append(powersgd_payload(current, rank, min_rate))
            current, size = [], 0.0
    if current:
        out.append(powersgd_payload(current, rank, min_rate))
    return out


def powersgd_compute_s(model: Model, method: SyncMethod) -> float:
    """PowerSGD's work on the device per step: the measured figure where there is one, else
    `POWERSGD_PASSES` passes over the compressed tensors at the memory's bandwidth (its rank-r
    matmuls are memory-bound; the orthogonalisation of P, n x r, is smaller still); 0 when the
    bandwidth is unknown."""
    if model.powersgd_work_s is not None:
        return model.powersgd_work_s
    if not model.hbm_Bps:
        return 0.0
    compressed = sum(
        math.prod(s)
        for s in model.shapes
        if powersgd_payload([s], method.powersgd_rank, method.min_compression_rate)[0] == 0
    )
    return POWERSGD_PASSES * compressed * model.grad_itemsize / model.hbm_Bps


def _powersgd(
    method: SyncMethod, model: Model, cluster: Cluster, algorithm: str, world: StepPrediction,
    compute: float, samples: float,
) -> SyncPrice:  # fmt: skip
    check_powersgd(model)
    group = dp_group(cluster, 1, cluster.ranks)
    size = model.grad_itemsize
    total, elements = 0.0, 0
    for bucket in _powersgd_buckets(model, method.powersgd_rank, method.min_compression_rate):
        total += sum(collective_s("all_reduce", algorithm, group, n * size, size) for n in bucket if n)
        elements += sum(bucket)
    hidden = world.dp_allreduce_s - world.exposed_dp_s  # what DDP's overlap hid of its own all-reduce
    exposed = max(0.0, total - hidden)
    step_s = world.step_s - world.exposed_dp_s + exposed + powersgd_compute_s(model, method)
    nbytes = slow_link_bytes(elements * size, cluster.ranks, cluster)
    return _result(method, 1, step_s, step_s, 0.0, 0.0, exposed, nbytes, nbytes, compute, samples)


def replica_cluster(cluster: Cluster, replicas: int, split: int) -> Cluster:
    """The cluster one replica group sees: nodes / R whole nodes, or a part of one node."""
    n, g = cluster.nodes, cluster.gpus_per_node
    if replicas < 2:
        raise ValueError(
            f"local SGD and DiLoCo need at least 2 replica groups, got {replicas} (default: one per node); "
            "pass --replicas R or more --nodes"
        )
    if n % replicas == 0:
        group = cluster.with_nodes(n // replicas)
    elif replicas % n == 0 and g % (replicas // n) == 0:
        group = dataclasses.replace(cluster, nodes=1, gpus_per_node=g * n // replicas)
    else:
        raise ValueError(
            f"--replicas {replicas} must divide the {n} nodes or split each node's {g} GPUs evenly"
        )
    if group.ranks % split:
        raise ValueError(
            f"--replicas {replicas} gives groups of {group.ranks} ranks, which cut a tp x cp x pp = "
            f"{split} model copy; choose --replicas so that each group holds whole copies"
        )
    return group


def check(method: SyncMethod, model: Model, cluster: Cluster) -> None:
    """Refuse, before anything is priced, a method this model or cluster cannot take."""
    if method.sync == "powersgd":
        check_powersgd(model)
    if method.sync in PERIODIC:
        replica_cluster(cluster, method.replicas or cluster.nodes, model.split)
        check_fragments(method, model)


def check_powersgd(model: Model) -> None:
    """PowerSGD compresses DDP's all-reduce of whole tensors, whose shapes it needs."""
    if not model.shapes:
        raise ValueError(
            "--sync powersgd needs the model's tensor shapes: pass --shape or a model preset with one"
        )
    if model.tp * model.pp > 1 or model.zero:
        raise ValueError("--sync powersgd compresses DDP's all-reduce: drop --tp, --pp and --zero")


def check_fragments(method: SyncMethod, model: Model) -> None:
    """Streaming DiLoCo's fragments are groups of whole layers, each inside one pipeline stage."""
    if method.sync != "streaming-diloco":
        return
    f = method.fragments
    if model.layers and f > model.layers:
        raise ValueError(
            f"--fragments {f} is more than the model's {model.layers} layers; choose at most that"
        )
    if f % model.pp:
        raise ValueError(
            f"--fragments {f} must be a multiple of --pp {model.pp}, so that each fragment lies in one "
            "pipeline stage"
        )


def outer_sync_s(
    payload: int, itemsize: int, model: Model, cluster: Cluster, group: Cluster, algorithm: str
) -> float:
    """One outer all-reduce of `payload` bytes between the replica groups: each of a group's ranks
    all-reduces its 1/(group ranks) shard with the same rank of the other groups (bucketed, the
    node's ranks sharing its NICs), then the group all-gathers the averaged copy back (as INTELLECT-1
    all-reduces each rank's FSDP shard across nodes)."""
    replicas, ranks = cluster.ranks // group.ranks, group.ranks
    across = dp_group(cluster, ranks, replicas)
    shard = payload // ranks
    seconds = sum(
        collective_s("all_reduce", algorithm, across, b, itemsize)
        for b in buckets(shard, itemsize, model.bucket_mb)
    )
    copies = ranks // (model.tp * model.pp)
    inside = dp_group(group, model.tp, copies)
    return seconds + collective_s("all_gather", algorithm, inside, payload // (model.tp * model.pp), itemsize)


def _periodic(
    method: SyncMethod, model: Model, cluster: Cluster, algorithm: str, step: StepFn, compute: float,
    samples: float,
) -> SyncPrice:  # fmt: skip
    replicas = method.replicas or cluster.nodes
    group = replica_cluster(cluster, replicas, model.split)
    check_fragments(method, model)
    inner = step(group)
    payload = method.outer_bytes(model.params)
    if method.sync == "streaming-diloco":
        payload = method.outer_bytes(model.params // method.fragments)
    itemsize = max(1, int(OUTER_DTYPES[method.outer_dtype]))  # sub-byte codecs: bytes on the wire
    sync_s = outer_sync_s(payload, itemsize, model, cluster, group, algorithm)
    overlap = method.overlap_steps if method.sync == "streaming-diloco" else 0
    exposed = max(0.0, sync_s - overlap * compute) / method.period
    step_s = inner.step_s + exposed
    inner_bytes = 0.0  # a group inside one node of many keeps its DDP off the slow link
    if group.nodes > 1 or cluster.nodes == 1:
        inner_bytes = slow_link_bytes(model.params * model.grad_itemsize, group.ranks // model.split, group)
    outer_bytes = slow_link_bytes(payload, replicas, cluster)
    per_step = inner_bytes + outer_bytes / method.period
    return _result(method, replicas, step_s, inner.step_s, sync_s, exposed, inner.exposed_dp_s, per_step,
                   max(inner_bytes, outer_bytes), compute, samples)  # fmt: skip


def with_bandwidth(cluster: Cluster, gbps: float) -> Cluster:
    """The cluster with its inter-node link at `gbps` Gbit/s per direction (its latency kept)."""
    inter = Link(cluster.inter.name, cluster.inter.alpha_s, gbps * 1e9 / 8)
    return dataclasses.replace(cluster, inter=inter, measured=None)


def bandwidth_for(
    target: float, method: SyncMethod, model: Model, cluster: Cluster, algorithm: str, step: StepFn,
    low: float = 1e-3, high: float = 1e6,
) -> float | None:  # fmt: skip
    """The inter-node Gbit/s at which `method` reaches `target` compute utilisation (bisected on a
    log scale to 0.1%); None when even `high` does not."""

    def cu(gbps: float) -> float:
        return price(method, model, with_bandwidth(cluster, gbps), algorithm, step).compute_utilisation

    if cu(high) < target:
        return None
    if cu(low) >= target:
        return low
    while high / low > 1.001:
        mid = math.sqrt(low * high)
        low, high = (mid, high) if cu(mid) < target else (low, mid)
    return high


def sweep(
    methods: Sequence[SyncMethod], model: Model, cluster: Cluster, algorithm: str, step: StepFn,
    targets: Sequence[float] = TARGETS,
) -> list[dict[str, Any]]:  # fmt: skip
    """Per method, the Gbit/s between replica groups (nodes) each compute utilisation needs, as
    {"50%": Gbit/s or None, ...}."""
    if cluster.nodes < 2:
        raise ValueError("--sweep bandwidth varies the link between nodes: pass --nodes 2 or more")
    return [
        {
            **m.words(),
            "gbps": {f"{t:.0%}": bandwidth_for(t, m, model, cluster, algorithm, step) for t in targets},
        }
        for m in methods
    ]


def recommend(chosen: SyncPrice, ddp: SyncPrice) -> str:
    """Whether `chosen` pays off against DDP's all-reduce, and why, with the convergence caveat."""
    name = chosen.method["sync"]
    if name == "ddp":
        return f"ddp: the all-reduce every step, {ddp.step_s:.3f} s per step"
    gain = chosen.samples_per_s / ddp.samples_per_s if ddp.samples_per_s else math.inf
    fewer = ddp.slow_link_bytes_per_step / max(chosen.slow_link_bytes_per_step, 1.0)
    numbers = (
        f"{chosen.step_s:.3f} s per step vs {ddp.step_s:.3f} s, {gain:.2f}x the samples/s, compute "
        f"utilisation {chosen.compute_utilisation:.0%} vs {ddp.compute_utilisation:.0%}, "
        f"{fewer:.3g}x fewer bytes per step over the slowest link"
    )
    if gain <= 1.0:
        return f"ddp: {name} does not pay off here ({numbers})"
    return f"{name} over the all-reduce: {numbers}; {CAVEAT}"
