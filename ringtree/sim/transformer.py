"""A GPT-style transformer's work and memory per GPU, for the planner (Megatron-LM's formulas).

FLOPs (Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 5.1): a layer's forward on B sequences of s tokens is 24 B s h^2 (the QKV,
projection and two MLP matmuls) + 4 B s^2 h (scores and their product with V); the logits are
2 B s h V. A backward is twice its forward; `full` recompute runs every layer's forward again in the
backward, `selective` only the attention core (4 B s^2 h), as Korthikanti et al. (2022).

Time: each matmul of the TP slice runs on the roofline of the GPU (its dense peak x GEMM_EFFICIENCY,
or its HBM bandwidth for the operands) plus a kernel launch; the elementwise work (layer norms,
softmax, dropout, GeLU, residuals) streams the activations through HBM. Small hidden sizes, TP
slices and micro-batches therefore run far below peak, large ones near GEMM_EFFICIENCY.

Memory per GPU (Korthikanti et al., 2022, table 2, no sequence parallelism): weights and gradients
in 16 bits and fp32 master weights with Adam's two moments (16 bytes per parameter, as ZeRO's
accounting), and activations s b h (10 + 24/t + 5 a s / (h t)) bytes per layer without recompute,
s b h (10 + 24/t) selective, 2 s b h full (the layer's input), for the micro-batches in flight.
Indices: l layers, h hidden, a heads, s sequence, V vocabulary, b micro-batch, t TP, p PP.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ringtree.sim.clusters import GPU
from ringtree.sim.hardware import Cluster
from ringtree.sim.plan import Layout, StepPrediction, StepWork, predict

RECOMPUTE = ("none", "selective", "full")
GEMM_EFFICIENCY = 0.72  # large fp16 GEMMs on an A100 reach about 225 of 312 TFLOP/s (72%) in cuBLAS
KERNEL_S = 6e-6  # launch and tail of one kernel
ELEMENTWISE_BYTES = 2.0  # HBM bytes moved per byte of stored activation (read it once, write once)
BYTES_PER_PARAM = 16  # 2 weights + 2 gradients + 4 master weights + 8 Adam moments
GiB = 1 << 30


@dataclass(frozen=True)
class Transformer:
    """The shape of a GPT-style decoder."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads}")

    @property
    def params(self) -> int:
        """12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)): Narayanan et al. 2021, eq. 2."""
        n, h = self.layers, self.hidden
        return int(12 * n * h * h * (1 + 13 / (12 * h) + (self.vocab + self.seq) / (12 * n * h)))

    def layer_flops(self, tokens: int) -> float:
        """One layer's forward over `tokens` = b s tokens."""
        return 24 * tokens * self.hidden**2 + 4 * tokens * self.seq * self.hidden

    def logit_flops(self, tokens: int) -> float:
        return 2 * tokens * self.hidden * self.vocab

    def step_flops(self, samples: int, recompute: str = "none") -> float:
        """Forward + backward (+ recomputed forward) of `samples` sequences, all layers and logits."""
        tokens = samples * self.seq
        layers = self.layers * self.layer_flops(tokens) * 3 + 3 * self.logit_flops(tokens)
        return layers + self.layers * self.recompute_flops(tokens, recompute)

    def model_flops(self, samples: int) -> float:
        """The FLOPs MFU counts: no recompute."""
        return self.step_flops(samples, "none")

    def recompute_flops(self, tokens: int, recompute: str) -> float:
        """Extra forward FLOPs per layer in the backward."""
        if recompute == "full":
            return self.layer_flops(tokens)
        return 4 * tokens * self.seq * self.hidden if recompute == "selective" else 0.0


# name: (layers, hidden, heads, seq, vocab), from each model's paper or config.
MODELS: dict[str, Transformer] = {
    "gpt-1.3b": Transformer(24, 2048, 16, 2048, 51200),  # GPT-3 paper, table 2.1 (XL)
    "gpt3-175b": Transformer(96, 12288, 96, 2048, 51200),  # GPT-3 paper, table 2.1
    "llama-7b": Transformer(32, 4096, 32, 2048, 32000),  # LLaMA paper, table 2 (SwiGLU as a 4h MLP)
    "llama-13b": Transformer(40, 5120, 40, 2048, 32000),
    "llama-70b": Transformer(80, 8192, 64, 4096, 32000),  # Llama 2 paper (GQA and SwiGLU approximated)
    "megatron-1t": Transformer(128, 25600, 160, 2048, 51200),  # Narayanan et al. 2021, table 1
}


def _gemm_s(m: int, n: int, k: int, gpu: GPU, dtype: str, itemsize: int) -> float:
    """One m x k by k x n matmul on the roofline, plus a kernel."""
    flops = 2.0 * m * n * k / (gpu.peak(dtype) * GEMM_EFFICIENCY)
    memory = itemsize * (m * k + k * n + m * n) / (gpu.hbm_GBps * 1e9)
    return max(flops, memory) + KERNEL_S


def layer_forward_s(
    model: Transformer, micro_batch: int, tp: int, gpu: GPU, dtype: str, itemsize: int = 2
) -> float:
    """One layer's forward on one TP rank: four matmuls, attention per head, elementwise work."""
    h, s, t = model.hidden, model.seq, tp
    tokens = micro_batch * s
    mats = (
        _gemm_s(tokens, 3 * h // t, h, gpu, dtype, itemsize)  # QKV
        + _gemm_s(tokens, h, h // t, gpu, dtype, itemsize)  # projection
        + _gemm_s(tokens, 4 * h // t, h, gpu, dtype, itemsize)  # MLP up
        + _gemm_s(tokens, h, 4 * h // t, gpu, dtype, itemsize)  # MLP down
    )
    heads = micro_batch * max(1, model.heads // t)  # batched over heads: one kernel each
    d = h // model.heads
    attention = 2 * (_gemm_s(s, s, d, gpu, dtype, itemsize) - KERNEL_S) * heads + 2 * KERNEL_S
    stored = activation_bytes_per_layer(model, micro_batch, tp, "none")
    elementwise = ELEMENTWISE_BYTES * stored / (gpu.hbm_GBps * 1e9) + 8 * KERNEL_S
    return mats + attention + elementwise


def logits_forward_s(model: Transformer, micro_batch: int, tp: int, gpu: GPU, dtype: str) -> float:
    """The output layer's matmul (vocabulary split over TP) and its softmax."""
    tokens = micro_batch * model.seq
    softmax = 4 * tokens * model.vocab // tp * 4 / (gpu.hbm_GBps * 1e9)
    return _gemm_s(tokens, model.vocab // tp, model.hidden, gpu, dtype, 2) + softmax


def activation_bytes_per_layer(model: Transformer, micro_batch: int, tp: int, recompute: str) -> float:
    """Korthikanti et al. 2022, table 2 (16-bit activations, no sequence parallelism)."""
    sbh = model.seq * micro_batch * model.hidden
    if recompute == "full":
        return 2.0 * sbh
    attention = 5 * model.heads * model.seq / (model.hidden * tp) if recompute == "none" else 0.0
    return sbh * (10 + 24 / tp + attention)


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU on the busiest stage (the first: it holds the most micro-batches in flight)."""

    weights_and_optimizer: float
    activations: float
    capacity: float

    @property
    def total(self) -> float:
        return self.weights_and_optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def as_dict(self) -> dict[str, float | bool]:
        return {
            "weights_grads_optimizer_GiB": self.weights_and_optimizer / GiB,
            "activations_GiB": self.activations / GiB,
            "total_GiB": self.total / GiB,
            "capacity_GiB": self.capacity / GiB,
            "fits": self.fits,
        }


def memory(
    model: Transformer, micro_batch: int, tp: int, pp: int, micro_batches: int, recompute: str, gpu: GPU
) -> Memory:
    """Weights, gradients and Adam states of 1/(t p) of the model; activations of the first stage.

    Under 1F1B the first stage holds min(p, m) micro-batches of its l/p layers; under full
    recompute one layer's activations are rebuilt at a time on top of the stored inputs.
    """
    states = BYTES_PER_PARAM * model.params / (tp * pp)
    in_flight = min(pp, micro_batches)
    layers = -(-model.layers // pp)
    acts = in_flight * layers * activation_bytes_per_layer(model, micro_batch, tp, recompute)
    if recompute != "none":
        acts += activation_bytes_per_layer(model, micro_batch, tp, "none")
    if pp == 1:  # the logits and their softmax (4 bytes per entry, fp32 for the loss)
        acts += 4 * micro_batch * model.seq * model.vocab / tp
    return Memory(states, acts, gpu.memory_GB * GiB)


@dataclass(frozen=True)
class Training:
    """What the planner needs besides the model and the cluster: batch, parallelism, precision."""

    global_batch: int
    micro_batch: int = 1
    tp: int = 1
    pp: int = 1
    dtype: str = "bf16"
    recompute: str = "none"
    overlap: bool = False  # DP all-reduce during the last backward (Megatron-LM 2021: after it)
    bucket_mb: float = 25.0
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"unknown --recompute {self.recompute!r}; choose one of {', '.join(RECOMPUTE)}")
        if self.dtype not in ("fp16", "bf16"):
            raise ValueError(f"unknown --dtype {self.dtype!r}; choose fp16 or bf16")
        if min(self.global_batch, self.micro_batch, self.tp, self.pp) < 1:
            raise ValueError("--global-batch, --micro-batch, --tp and --pp must be at least 1")

    def micro_batches(self, dp: int) -> int:
        """m = B / (dp b): the micro-batches each pipeline (or each DP rank) runs per step."""
        if self.global_batch % (dp * self.micro_batch):
            raise ValueError(
                f"--global-batch {self.global_batch} must be a multiple of dp {dp} x --micro-batch "
                f"{self.micro_batch}; change one of them or the GPU count"
            )
        return self.global_batch // (dp * self.micro_batch)


def work(model: Transformer, run: Training, gpu: GPU, dp: int) -> StepWork:
    """One GPU's step: its stage's l/p layers (and 1/p of the logits) on a TP slice, per micro-batch."""
    b, t, p = run.micro_batch, run.tp, run.pp
    if model.heads % t or model.hidden % t:
        raise ValueError(f"--tp {t} must divide --heads {model.heads} and --hidden {model.hidden}")
    if model.layers < p:
        raise ValueError(f"--pp {p} exceeds the {model.layers} layers; use at most one stage per layer")
    layers = model.layers / p
    layer = layer_forward_s(model, b, t, gpu, run.dtype)
    forward = layers * layer + logits_forward_s(model, b, t, gpu, run.dtype) / p
    tokens = b * model.seq
    redo = {"none": 0.0, "full": layer, "selective": layer * model.recompute_flops(tokens, "selective")
            / model.layer_flops(tokens)}[run.recompute]  # fmt: skip
    state_bytes = BYTES_PER_PARAM * model.params / (t * p)
    m = run.micro_batches(dp)
    return StepWork(
        forward_s=forward,
        backward_s=2 * forward + layers * redo,
        micro_batches=m,
        grad_bytes=int(model.params / (t * p)) * 2,
        itemsize=2,
        bucket_mb=run.bucket_mb,
        overlap=run.overlap,
        samples=run.global_batch,
        tp_bytes=tokens * model.hidden * 2,
        tp_forward=round(2 * layers),
        tp_backward=round((4 if run.recompute == "full" else 2) * layers),
        activation_bytes=tokens * model.hidden * 2 // t,  # scatter-gather over the TP ranks
        flops=model.model_flops(run.global_batch),
        peak_flops=gpu.peak(run.dtype),
        optimizer_s=2 * state_bytes / (gpu.hbm_GBps * 1e9),  # Adam reads and writes its states
    )


def plan(
    model: Transformer, run: Training, cluster: Cluster, gpu: GPU, algorithm: str = "ring"
) -> StepPrediction:
    """The predicted step, with MFU, the TFLOP/s each GPU does (recompute counted) and memory."""
    layout = Layout(run.tp, run.pp, run.schedule)
    dp = layout.dp(cluster.ranks)
    w = work(model, run, gpu, dp)
    row = predict(w, cluster, algorithm, layout)
    mem = memory(model, run.micro_batch, run.tp, run.pp, w.micro_batches, run.recompute, gpu)
    hardware = model.step_flops(run.global_batch, run.recompute)
    details = {
        "model": dataclasses.asdict(model),
        "params": model.params,
        "training": dataclasses.asdict(run),
        "gpu": gpu.name,
        "tflops_per_gpu": hardware / (row.step_s * cluster.ranks) / 1e12 if row.step_s else 0.0,
        "model_flops_per_step": w.flops,
    }
    return dataclasses.replace(row, memory=mem.as_dict(), details=details)


def search(
    model: Transformer,
    global_batch: int,
    cluster: Cluster,
    gpu: GPU,
    dtype: str = "bf16",
    recompute: tuple[str, ...] = RECOMPUTE,
    algorithm: str = "ring",
) -> list[StepPrediction]:
    """Every TP x PP x DP x micro-batch x recompute that fits in memory, fastest first.

    TP stays inside a node (powers of two up to the GPUs per node), PP divides the layers.
    """
    g, n = cluster.gpus_per_node, cluster.ranks
    found = []
    for t in (x for x in (1, 2, 4, 8, 16) if x <= g and g % x == 0 and model.heads % x == 0):
        for p in (x for x in range(1, model.layers + 1) if model.layers % x == 0 and n % (t * x) == 0):
            dp = n // (t * p)
            for b in (1, 2, 4, 8, 16):
                if global_batch % (dp * b):
                    continue
                for r in recompute:
                    run = Training(global_batch, b, t, p, dtype, r)
                    w = work(model, run, gpu, dp)
                    if not memory(model, b, t, p, w.micro_batches, r, gpu).fits:
                        continue
                    found.append(plan(model, run, cluster, gpu, algorithm))
    return sorted(found, key=lambda row: row.step_s)
