"""Bytes per GPU on every pipeline stage: weights, gradients and optimizer states, and activations.

States (mixed precision with Adam, ZeRO's accounting): 2 bytes of weights, the gradients in the run's
gradient dtype (4 bytes in fp32, as Megatron-LM's distributed optimizer counts bf16 training: "bf16
param, fp32 grads: 6 + 12/d" bytes per parameter, Megatron-LM README, "Distributed Optimizer"; 2 in 16
bits), 12 of optimizer (fp32 master weights and two moments) per parameter. ZeRO shards them over the
dp x cp ranks that hold the same weights (with a shard group S, HSDP, over S x cp of them, the
states replicated across the dp / S groups): 1 the optimizer's 12, 2 the gradients too, 3 the weights
too (and holds two gathered layers, the one computing and the one prefetched). Under ZeRO-3 the
sharded states are 16 bytes a parameter whatever the gradient dtype: FSDP2 keeps the sharded
parameter in fp32 (it is the master: 4), its sharded gradient in the parameter's dtype (4: the
reduce-scatter's output cast up) and two moments (8); DeepSpeed's ZeRO-3 2 + 2 + 12.

Activations per layer and micro-batch, 16 bits (Korthikanti et al. 2022, table 2, with flash
attention, which stores no s x s scores): the replicated part 10 s b h (norm inputs 4, the inputs of
the QKV and first MLP matmuls 4, the two dropout masks 1 byte each: 8 without dropout, as Llama
trains), divided by t with sequence parallelism; the TP-split part (4 + 4 k/a) s b h / t for Q, K, V
and the attention output, and 4 s b F / t (GeLU) or 6 s b F / t (SwiGLU) for the MLP; with CP each
rank holds s / c of the sequence. Without flash attention (Megatron-LM 2021) a layer also stores its
softmax output, dropout mask and dropout output, 5 a s^2 b / t (2 a s^2 b without dropout: the
softmax output alone), unless recompute rebuilds them. `full`
recompute keeps each layer's input (2 s b h, / t with SP) and rebuilds one layer at a time;
`selective` stores what flash attention stores; `op` (torchtitan's per-op selective AC) keeps the
layer's input, the outputs of the matmuls it does not rerun, the attention's output and log-sum-exp
and the reduce-scatters' outputs, and rebuilds one layer at a time.
Under 1F1B stage j holds min(m, p - j) micro-batches; interleaved with V chunks, its chunks of
l / (p V) layers in flight are min(m V, 2 (p - j - 1) + (V - 1) p + 1) (Megatron-LM's warm-up). The
zero-bubble schedules keep a micro-batch's activations until its W, every stage alike: ZB-H1 p,
ZB-H2 2p - 1, ZB-V p (2p chunks of half a stage), DualPipeV p + 1/2 (2p + 1 chunks), their published
bounds (ringtree.schedules.pipeline_verify.peak_bound), which their orders reach.
The first stage holds the embedding, the last the output matrix and the fp32 logits; an uneven run
(`--pp-layout`, ringtree.sim.training.stage_layout) puts them where its layout says, a
multi-token-prediction layer (`m`) counted as one more layer of the model's last kind with its own
2h x h projection and logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringtree.schedules.pipeline import V_SHAPED, ZERO_BUBBLE
from ringtree.schedules.pipeline_verify import peak_bound
from ringtree.sim.network.clusters import GPU
from ringtree.sim.training import fp8, moe
from ringtree.sim.training.layout import Training
from ringtree.sim.training.stage_layout import Chunk
from ringtree.sim.training.transformer import Transformer

WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 2, 12  # GRAD_BYTES: ZeRO-3's (see above); else the run's
GiB = 1 << 30


def activation_bytes_per_layer(
    model: Transformer, run: Training, recompute: str | None = None, moe_layer: bool = False
) -> float:
    """One layer's stored activations for one micro-batch on one rank (an MoE layer's MLP part:
    `ringtree.sim.training.moe.activation_bytes`)."""
    t, c = run.tp, run.cp
    sbh = model.seq // c * run.micro_batch * model.hidden
    shared = sbh / t if run.sequence_parallel else float(sbh)
    if (recompute or run.recompute) == "full":
        return 2.0 * shared
    if (recompute or run.recompute) == "op":
        return 2.0 * shared + _op_saved(model, run, sbh)
    if (recompute or run.recompute) == "dots":  # the input, Q, K, V and the two row-parallel outputs
        return 2.0 * (3 * shared + sbh * (model.hidden + 2 * model.kv_hidden) / model.hidden / t)
    attention = (4 + 4 * model.kv_hidden / model.hidden) * sbh / t
    if not run.flash_attention and (recompute or run.recompute) == "none":  # softmax (and dropout)
        scores = 5 if model.dropout else 2
        attention += scores * model.heads * model.seq * model.seq // c * run.micro_batch / t
    if moe_layer:
        mlp = moe.activation_bytes(model, run)
    else:
        mlp = (6 if model.mlp == "swiglu" else 4) * sbh * model.ffn_hidden / model.hidden / t
    return (10 if model.dropout else 8) * shared + attention + mlp


def _op_saved(model: Transformer, run: Training, sbh: int) -> float:
    """What torchtitan's per-op selective AC saves of a layer besides its input ("Saves output of all
    compute ops, except every second mm": its _save_list holds mm, the SDPA kernels and
    reduce_scatter_tensor): the 1st, 3rd, 5th (and 7th) matmuls' outputs (Q, V, w1 and w2; the
    row-parallel w2's partial sums are full width before their reduction), the attention's output
    and fp32 log-sum-exp, and with sequence parallelism the two reduce-scatters' outputs."""
    t, tokens = run.tp, sbh / model.hidden
    shapes = model.matmul_shapes()
    rows = {3, len(shapes) - 1}  # the output and down projections: row-parallel
    widths = sum(n if i in rows else n / t for i, (_, n) in enumerate(shapes) if i % 2 == 0)
    saved = 2 * tokens * widths + 2 * sbh / t + 4 * tokens * model.heads / t
    return saved + (4 * sbh / t if t > 1 and run.sequence_parallel else 0.0)


def stage_layers(layers: int, p: int) -> tuple[int, ...]:
    """Layers per pipeline stage: l/p each when p divides l; else ceil(l/p) on the middle stages and
    the shortfall split between the first and the last (which also hold the embedding and the
    logits), as BLOOM (70 on 12: 5, 6 x 10, 5) and Llama 3 (126 on 16: 7, 8 x 14, 7) ran theirs."""
    if p == 1 or layers % p == 0:
        return (layers // p,) * p
    middle = -(-layers // p)
    ends = layers - (p - 2) * middle
    return (ends // 2, *(middle,) * (p - 2), ends - ends // 2)


def stage_chunks(model: Transformer, run: Training) -> list[tuple[Chunk, ...]]:
    """Each pipeline stage's model chunks: an uneven run's from its layout (chunk i on stage i mod
    PP); else one chunk a stage of `stage_layers`, the embedding on the first, the loss on the last."""
    p = run.pp
    if run.uneven:
        chunks = run.chunks(model.layers)
        return [chunks[j::p] for j in range(p)]
    counts, out = stage_layers(model.layers, p), list[tuple[Chunk, ...]]()
    for j, n in enumerate(counts):
        out.append((Chunk(sum(counts[:j]), n, 0, j == 0, j == p - 1),))
    return out


def chunk_units(model: Transformer, chunks: tuple[Chunk, ...]) -> tuple[int, int, int]:
    """Chunks' layers, MoE layers among them and output layers (an MTP layer is one more layer of
    the model's last kind with its own logits)."""
    mtp = sum(c.mtp for c in chunks)
    last_moe = model.is_moe_layer(model.layers - 1)
    layers = sum(c.layers for c in chunks) + mtp
    moes = sum(model.moe_layers_in(c.start, c.layers) for c in chunks) + (mtp if last_moe else 0)
    return layers, moes, sum(c.loss for c in chunks) + mtp


def in_flight(run: Training, m: int, j: int) -> float:
    """Micro-batches' worth of the stage's layers whose activations stage j holds at its peak."""
    p, v = run.pp, run.virtual_stages
    if run.schedule in ZERO_BUBBLE and p > 1:
        chunks = 2 if run.schedule in V_SHAPED else 1
        return float(peak_bound(run.schedule, p, m) or 0) / chunks
    if v == 1:
        return float(min(m, p - j))
    return min(m * v, 2 * (p - j - 1) + (v - 1) * p + 1) / v


def expert_shards(run: Training, dp: int) -> int:
    """The ranks ZeRO shards the experts' states over: the expert-data-parallel group, the stage's
    dp x cp x tp ranks over EP x ETP (Megatron-Core's expert-DP group; torchtitan's FSDP over
    dp_shard x cp x tp / EP for the experts)."""
    return max(1, dp * run.cp * run.tp // (run.ep * run.etp))


def states_bytes(params: float, run: Training, shard: int) -> float:
    """Weights, gradients and optimizer states of `params` parameters under the run's ZeRO stage."""
    z = run.zero
    weights = WEIGHT_BYTES / (shard if z >= 3 else 1)
    grads = (GRAD_BYTES if z >= 3 else run.grad_itemsize) / (shard if z >= 2 else 1)
    optimizer = OPTIMIZER_BYTES / (shard if z >= 1 else 1)
    return params * (weights + grads + optimizer)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage's bytes per GPU."""

    states: float
    activations: float

    @property
    def total(self) -> float:
        return self.states + self.activations


def stages(model: Transformer, run: Training, m: int, dp: int) -> list[Stage]:
    """Every pipeline stage's bytes per GPU."""
    p, t = run.pp, run.tp
    shard = run.shards(dp)
    tokens = model.seq // run.cp * run.micro_batch
    layer = activation_bytes_per_layer(model, run)
    kept = activation_bytes_per_layer(model, run, "none")
    moe_kept = activation_bytes_per_layer(model, run, "none", True) if model.experts else kept
    out = []
    for j, chunks in enumerate(stage_chunks(model, run)):
        params = experts = 0
        for c in chunks:
            dense, routed = model.layers_params(c.start, c.layers)
            params, experts = params + dense, experts + routed
        n, mo, heads = chunk_units(model, chunks)
        mtp = n - sum(c.layers for c in chunks)
        if mtp:  # the MTP layers: the last layer's kind, with their 2h x h projection
            dense, routed = model.layers_params(model.layers - 1, 1)
            params += mtp * (dense + 2 * model.hidden * model.hidden)
            experts += mtp * routed
        params += model.embedding_params if any(c.embedding for c in chunks) else 0
        last = model.logit_params or (model.vocab * model.hidden if p > 1 else 0)  # tied: a copy
        params += last if any(c.loss for c in chunks) else 0
        states = states_bytes(params / t, run, shard)
        states += states_bytes(experts / (run.ep * run.etp), run, expert_shards(run, dp))
        states += fp8.weight_bytes(run.dtype, run.fp8_recipe) * (params / t + experts / (run.ep * run.etp))
        if run.zero >= 3:
            layer_params = model.layer_params / t
            if mo:  # an MoE layer's: its dense part over TP, its experts over EP x ETP
                moe_params = model.moe_dense_weights + model.small_params
                layer_params = max(layer_params, moe_params / t + model.expert_weights / (run.ep * run.etp))
            states += 2 * WEIGHT_BYTES * layer_params  # the gathered layer and the prefetched one
        redo = run.mode_layers(n)
        if mo:  # per layer, averaged over the stage's dense and MoE layers
            moe_layer = activation_bytes_per_layer(model, run, None, True)
            acts = (
                in_flight(run, m, j)
                / n
                * (
                    redo * ((n - mo) * layer + mo * moe_layer)
                    + (n - redo) * ((n - mo) * kept + mo * moe_kept)
                )
            )
        else:
            acts = in_flight(run, m, j) * (redo * layer + (n - redo) * kept)
        if run.recompute in ("full", "op", "dots") and redo:
            acts += max(kept, moe_kept) if mo else kept  # the layer being rebuilt
        acts += heads * 4 * tokens * model.vocab / t  # the logits and their gradient, fp32 for the loss
        out.append(Stage(states, acts))
    return out


def memory(model: Transformer, run: Training, m: int, dp: int, gpu: GPU) -> dict[str, Any]:
    """Per-stage memory, the fullest stage's total, and whether (and where, by how much) it overflows."""
    rows = stages(model, run, m, dp)
    capacity = gpu.memory_GB * GiB
    j = max(range(len(rows)), key=lambda i: rows[i].total)
    full = rows[j]
    return {
        "total_GiB": full.total / GiB,
        "fits": full.total <= capacity,
        "capacity_GiB": capacity / GiB,
        "fullest_stage": j,
        "overflow_GiB": max(0.0, full.total - capacity) / GiB,
        "weights_grads_optimizer_GiB": full.states / GiB,
        "activations_GiB": full.activations / GiB,
        "stages": [
            {"stage": i, "weights_grads_optimizer_GiB": r.states / GiB,
             "activations_GiB": r.activations / GiB, "total_GiB": r.total / GiB}
            for i, r in enumerate(rows)
        ],
    }  # fmt: skip


def fits(model: Transformer, run: Training, m: int, dp: int, gpu: GPU) -> bool:
    """Whether every stage fits (the search's filter, without building the report)."""
    capacity = gpu.memory_GB * GiB
    return all(r.total <= capacity for r in stages(model, run, m, dp))
