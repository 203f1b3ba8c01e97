"""One prediction from a model spec, a parallel layout and a cluster: the transformer planner.

`work` turns the model (ringtree.sim.training.transformer) and the layout
(ringtree.sim.training.layout) into what one GPU does per micro-batch, timed by the compute model
(ringtree.sim.training.compute); `plan` prices it on the cluster with the planner's one predictor
(ringtree.sim.training.plan.predict) and adds per-stage memory (ringtree.sim.training.memory).
Indices: l layers, h hidden, s sequence, b micro-batch, t TP, c CP, p PP.
"""

from __future__ import annotations

import dataclasses

from ringtree.sim.network import nccl_model
from ringtree.sim.network.clusters import GPU
from ringtree.sim.network.hardware import Cluster
from ringtree.sim.training import compute, eager, fp8, moe
from ringtree.sim.training.layout import Training, check
from ringtree.sim.training.memory import (
    activation_bytes_per_layer,
    chunk_units,
    expert_shards,
    memory,
    stage_chunks,
    states_bytes,
)
from ringtree.sim.training.plan import StepPrediction, StepWork, predict
from ringtree.sim.training.stage_layout import Chunk
from ringtree.sim.training.transformer import Transformer

ITEMSIZE = 2  # 16-bit weights, activations and their collectives (gradients: the run's grad_itemsize)


def default_algorithm(cluster: Cluster) -> str:
    """What `--algorithm auto` prices a transformer's collectives with: NCCL (`native`, NCCL's own
    cost model) on a GPU cluster NCCL has a model of, as the published GPU runs use; ring elsewhere."""
    return "native" if nccl_model.tuning_for(cluster) is not None else "ring"


def linears_s(model: Transformer, run: Training, gpu: GPU, moe_layer: bool = False) -> tuple[float, float]:
    """A layer's matmuls on one TP rank, forward and backward: the attention's (split over TP by
    columns or rows, or replicated: `Transformer.attention_matmuls`) and the MLP's, or under an MoE
    layer the router's and the experts' (ringtree.sim.training.moe); FP8 where the run's recipe pays."""
    tokens, t = run.micro_batch * model.seq // run.cp, run.tp
    forward, backward = _attention_linears(model, run, gpu)
    if moe_layer:
        f, b = moe.mlp_s(model, run, gpu)
        return forward + f, backward + b
    f_ = model.ffn_hidden
    for n, k in (((model.gated - 1) * f_ // t, model.hidden), (model.hidden, f_ // t)):
        f, b = fp8.linear_s(tokens, n, k, gpu, run.dtype, run.fp8_recipe)
        forward, backward = forward + f, backward + b
    return forward, backward


def _attention_linears(model: Transformer, run: Training, gpu: GPU) -> tuple[float, float]:
    """The attention's matmuls on one TP rank, forward and backward: split over TP by columns or rows,
    or replicated (`Transformer.attention_matmuls`)."""
    tokens, t = run.micro_batch * model.seq // run.cp, run.tp
    forward = backward = 0.0
    for k, n, split in model.attention_matmuls():
        shape = (n // t, k) if split == "col" else (n, k // t) if split == "row" else (n, k)
        f, b = fp8.linear_s(tokens, *shape, gpu, run.dtype, run.fp8_recipe)
        forward, backward = forward + f, backward + b
    return forward, backward


def layer_times(
    model: Transformer, run: Training, gpu: GPU, moe_layer: bool = False
) -> tuple[float, float, float]:
    """One layer's forward and backward (recompute included) on one rank, and its attention forward.

    Remembered per model, GPU and the training words a layer's time depends on (the search asks for
    the same layer under many pipeline, ZeRO and batch layouts)."""
    key = (model, _layer_words(run), gpu.name, gpu.hbm_GBps, moe_layer)
    if key not in _LAYER_TIMES:
        if len(_LAYER_TIMES) > 65536:
            _LAYER_TIMES.clear()
        _LAYER_TIMES[key] = _layer_times(model, run, gpu, moe_layer)
    return _LAYER_TIMES[key]


_LAYER_TIMES: dict[tuple[object, ...], tuple[float, float, float]] = {}


def _layer_words(run: Training) -> tuple[object, ...]:
    return (run.micro_batch, run.tp, run.cp, run.dtype, run.recompute, run.sequence_parallel,
            run.flash_attention, run.attention_kernel, run.elementwise, run.ep, run.etp,
            run.expert_load, run.fp8_recipe)  # fmt: skip


def _layer_times(model: Transformer, run: Training, gpu: GPU, moe_layer: bool) -> tuple[float, float, float]:
    tokens = run.micro_batch * model.seq // run.cp
    dtype = run.compute_dtype
    mats, mats_back = linears_s(model, run, gpu, moe_layer)
    attention = compute.attention_s(
        model, run.micro_batch, run.tp, run.cp, gpu, dtype, run.flash_attention, run.attention_kernel
    )
    if run.elementwise == "eager":
        other, other_back = eager.passes_s(model, tokens, run.tp, run.sequence_parallel, gpu)
    else:
        other = compute.elementwise_s(activation_bytes_per_layer(model, run, "none", moe_layer), gpu)
        other_back = 2 * other
    if moe_layer and (model.expert_bias or model.swiglu_limit):  # gpt-oss's unfused expert passes
        unfused, unfused_back = moe.unfused_s(model, run, gpu)
        other, other_back = other + unfused, other_back + unfused_back
    if not run.flash_attention:  # Megatron-LM's 2021-2022 stack: its softmax fallback, its per-layer cost
        softmax, softmax_back = compute.softmax_fallback_s(model, run.micro_batch, run.tp, run.cp, gpu)
        other = other + softmax + compute.UNFUSED_LAYER_S
        other_back = other_back + softmax_back + 2 * compute.UNFUSED_LAYER_S
    forward = mats + attention + other
    backward = mats_back + other_back + (compute.FLASH_BACKWARD if run.flash_attention else 2) * attention
    redo = {"none": 0.0, "selective": attention, "full": forward, "op": 0.0, "dots": 0.0}[run.recompute]
    if run.recompute == "op":  # every second matmul and every elementwise op, the attention saved
        redo = other + _op_matmuls_s(model, tokens, run, gpu)
    if run.recompute == "dots":  # the MLP's input projections (column-parallel), the attention, the rest
        mlp_in = sum(compute.gemm_s(tokens, n // run.tp, k, gpu, dtype) for k, n in model.dots_recomputed())
        redo = other + attention + mlp_in
    return forward, backward + redo, attention


def _op_matmuls_s(model: Transformer, tokens: int, run: Training, gpu: GPU) -> float:
    """The matmuls per-op selective AC reruns (`Transformer.op_recomputed`) on one TP rank: the
    output projection and the MLP's down projection split their input over TP (row-parallel), the
    others their output (column-parallel)."""
    shapes, t = model.matmul_shapes(), run.tp
    rows = {3, len(shapes) - 1}
    return sum(
        compute.gemm_s(tokens, n if i in rows else n // t, k // t if i in rows else k, gpu, run.compute_dtype)
        for i, (k, n) in enumerate(shapes)
        if i % 2 == 1
    )


def _tp_rerun(run: Training) -> float:
    """TP collectives (in all-reduces' worth) a layer's recompute runs again: `full` its forward's
    two; `op` the collectives whose outputs torchtitan does not save (it saves reduce-scatters):
    with sequence parallelism the two all-gathers (one all-reduce's worth), else the two all-reduces;
    `dots` the MLP input's: its all-gather (half an all-reduce) with sequence parallelism, else the
    all-reduce of the saved output projection's partial sums."""
    if run.recompute == "full":
        return 2
    if run.recompute == "op":
        return 1 if run.sequence_parallel else 2
    if run.recompute == "dots":
        return 0.5 if run.sequence_parallel else 1
    return 0


def weight_fraction(model: Transformer, run: Training, gpu: GPU) -> float:
    """The share of a layer's backward (recompute included) that is its weight gradients, W of the
    split backward: each matmul's dW = G^T X is one GEMM of the forward's shape (Qi et al. 2024,
    section 2), so W takes the layer's forward matmul time; attention and elementwise backwards are
    all B (about a third of the backward for a transformer layer)."""
    backward = layer_times(model, run, gpu)[1]
    return min(1.0, linears_s(model, run, gpu)[0] / backward) if backward > 0 else 0.0


def work(model: Transformer, run: Training, gpu: GPU, dp: int) -> StepWork:
    """One GPU's step on the slowest stage: its layers on its TP and CP slice, per micro-batch; the
    logits (output layer and loss) sit on the last stage, as Megatron-LM's `post_process` puts them,
    or where an uneven run's layout puts them (interleaved, each stage as V of the heaviest chunk:
    `_heaviest`). An MoE model's stages price their dense and MoE layers each as what they are."""
    t, p = run.tp, run.pp
    forward, backward, attention = layer_times(model, run, gpu)
    kept = layer_times(model, dataclasses.replace(run, recompute="none", recompute_layers=0), gpu)[1]
    tokens = run.micro_batch * model.seq // run.cp
    logits = compute.logits_s(model, tokens, t, gpu, run.compute_dtype)
    placed = stage_chunks(model, run)
    units = [chunk_units(model, chunks) for chunks in placed]
    counts = tuple(n for n, _, _ in units)
    moes = [mo for _, mo, _ in units]
    redo = [run.mode_layers(n) for n in counts]
    times = _stage_times(model, run, gpu, counts, moes, redo, (forward, backward, kept))
    fs = tuple(f + heads * logits for f, (_, _, heads) in zip(times[0], units, strict=True))
    bs = tuple(b + 2 * heads * logits for b, (_, _, heads) in zip(times[1], units, strict=True))
    if run.uneven and run.virtual_stages > 1:  # every chunk priced as the heaviest one
        f, b, n, mo = _heaviest(model, run, gpu, [c for chunks in placed for c in chunks], logits)
        fs, bs, counts, moes = (f,) * p, (b,) * p, (n,) * p, [mo] * p
        redo = [run.mode_layers(n)] * p
    k = max(range(p), key=lambda j: fs[j] + bs[j])  # the slowest stage sets the pace
    layers = float(counts[k])
    real = [sum(c.layers for c in chunks) for chunks in placed]
    share = sum(run.mode_layers(n) for n in real) / model.layers  # layers priced with the recompute
    experts = model.moe_layer_count * model.expert_weights / (run.ep * run.etp * p)
    stage_params = _rank_params(model, run) / p - experts
    m = run.micro_batches(dp)
    moe_k = moes[k]
    tp_layer = 2 * (counts[k] - moe_k) + (1 + bool(model.shared_experts)) * moe_k  # MoE: no MLP TP pair
    ep_redo = 2 * round(moe_k * redo[k] / counts[k]) if run.recompute == "full" and counts[k] else 0
    return StepWork(
        forward_s=fs[k],
        backward_s=bs[k],
        micro_batches=m,
        grad_bytes=int(stage_params) * run.grad_itemsize,
        itemsize=run.grad_itemsize,
        param_itemsize=ITEMSIZE,
        bucket_mb=run.bucket_mb,
        overlap=run.overlap,
        samples=run.global_batch,
        tp_bytes=tokens * model.hidden * ITEMSIZE,
        tp_forward=round(tp_layer),
        tp_backward=round(tp_layer + _tp_rerun(run) * redo[k]),
        activation_bytes=tokens * model.hidden * ITEMSIZE // t,  # scatter-gather over the TP ranks
        flops=model.model_flops(run.global_batch),
        peak_flops=gpu.peak(run.compute_dtype),  # MFU against the 16-bit peak, FP8 runs too
        optimizer_s=2 * _states(model, run, dp, p) / (gpu.hbm_GBps * 1e9),
        layers=layers,
        cp_bytes=2 * run.micro_batch * model.seq * model.kv_hidden // t * ITEMSIZE if run.cp > 1 else 0,
        attention_s=attention,
        cp_overlap=run.cp_comm == "p2p",
        hardware_flops=share * model.step_flops(run.global_batch, run.recompute)
        + (1 - share) * model.step_flops(run.global_batch, "none"),
        stage_forward_s=fs if p > 1 else (),
        stage_backward_s=bs if p > 1 else (),
        weight_fraction=weight_fraction(model, run, gpu),
        ep=run.ep,
        etp=run.etp,
        ep_bytes=(moe.gather_bytes if run.moe_dispatcher == "allgather" else moe.dispatch_bytes)(model, run),
        ep_forward=2 * moe_k,
        ep_backward=2 * moe_k + ep_redo,
        etp_bytes=moe.etp_bytes(model, run),
        ep_dispatcher=run.moe_dispatcher,
        ep_windows=_ep_windows(model, run, gpu) if run.moe_overlap and moe_k else (),
        ep_sync_s=(moe_k + ep_redo // 2) * moe.host_sync_s(),
        expert_grad_bytes=int(experts) * run.grad_itemsize,
        expert_dp=expert_shards(run, dp),
    )


def _heaviest(
    model: Transformer, run: Training, gpu: GPU, chunks: list[Chunk], logits: float
) -> tuple[float, float, int, int]:
    """An interleaved stage priced as V of its heaviest chunk: a chunk's forward and backward pass
    through every stage in turn, so the heaviest chunk sets both the steady state and the bubble.
    V times the heaviest chunk's forward and backward (its layers and output layers: its compute; the
    exchanges do not choose it) and V times its layers and MoE layers (their TP and EP exchanges)."""
    units = [chunk_units(model, (c,)) for c in chunks]
    counts = tuple(n for n, _, _ in units)
    redo = [min(n, run.recompute_layers or n) for n in counts]  # block recompute: per chunk
    dense = layer_times(model, run, gpu)[:2]
    kept = layer_times(model, dataclasses.replace(run, recompute="none", recompute_layers=0), gpu)[1]
    fs, bs = _stage_times(model, run, gpu, counts, [mo for _, mo, _ in units], redo, (*dense, kept))
    f = [x + heads * logits for x, (_, _, heads) in zip(fs, units, strict=True)]
    b = [x + 2 * heads * logits for x, (_, _, heads) in zip(bs, units, strict=True)]
    c = max(range(len(units)), key=lambda i: f[i] + b[i])
    v = run.virtual_stages
    return v * f[c], v * b[c], v * units[c][0], v * units[c][1]


def _stage_times(
    model: Transformer,
    run: Training,
    gpu: GPU,
    counts: tuple[int, ...],
    moes: list[int],
    redo: list[int],
    dense: tuple[float, float, float],
) -> tuple[list[float], list[float]]:
    """Each stage's layers' forward and backward per micro-batch: its `redo` layers with the run's
    recompute, the others keeping their activations; its MoE layers priced as MoE layers."""
    forward, backward, kept = dense
    if not any(moes):
        fs = [n * forward for n in counts]
        bs = [r * backward + (n - r) * kept for n, r in zip(counts, redo, strict=True)]
        return fs, bs
    moe_f, moe_b, _ = layer_times(model, run, gpu, True)
    keeping_run = dataclasses.replace(run, recompute="none", recompute_layers=0)
    moe_kept = layer_times(model, keeping_run, gpu, True)[1]
    fs, bs = [], []
    for n, mo, r in zip(counts, moes, redo, strict=True):
        if not n:
            fs.append(0.0)
            bs.append(0.0)
            continue
        fs.append((n - mo) * forward + mo * moe_f)
        recomputed = (n - mo) * backward + mo * moe_b
        keeping = (n - mo) * kept + mo * moe_kept
        bs.append(r / n * recomputed + (n - r) / n * keeping)
    return fs, bs


def _ep_windows(model: Transformer, run: Training, gpu: GPU) -> tuple[float, float, float, float]:
    """An MoE layer's compute that `--moe-overlap` hides the exchanges behind: its attention (matmuls
    and core) and its MLP (router, experts, shared experts), forward and backward."""
    attention_f, attention_b = _attention_linears(model, run, gpu)
    mlp_f, mlp_b = moe.mlp_s(model, run, gpu)
    core = compute.attention_s(
        model,
        run.micro_batch,
        run.tp,
        run.cp,
        gpu,
        run.compute_dtype,
        run.flash_attention,
        run.attention_kernel,
    )
    return attention_f + core, mlp_f, attention_b + compute.FLASH_BACKWARD * core, mlp_b


def _rank_params(model: Transformer, run: Training) -> float:
    """The parameters one rank holds of the whole model: the dense ones / TP, the experts / (EP ETP)."""
    experts = model.moe_layer_count * model.expert_weights
    return (model.params - experts) / run.tp + experts / (run.ep * run.etp)


def _states(model: Transformer, run: Training, dp: int, p: int) -> float:
    """The bytes of weights, gradients and optimizer states one rank steps: the dense ones sharded over
    the data-parallel ranks, the experts' over the expert-data-parallel ones."""
    experts = model.moe_layer_count * model.expert_weights
    dense = states_bytes((model.params - experts) / (run.tp * p), run, run.shards(dp))
    return dense + states_bytes(experts / (run.ep * run.etp * p), run, expert_shards(run, dp))


def plan(
    model: Transformer, run: Training, cluster: Cluster, gpu: GPU, algorithm: str = "auto", fast: bool = False
) -> StepPrediction:
    """The predicted step of `model` trained as `run` on `cluster` of `gpu`s, with per-stage memory.

    `algorithm` "auto" is `default_algorithm(cluster)`, as `ringtree plan` prices it; `fast` bounds
    the pipeline replay by its closed form (the search's first pass)."""
    algorithm = default_algorithm(cluster) if algorithm == "auto" else algorithm
    fp8.check(run.dtype, run.fp8_recipe, gpu)
    dp = check(model, run, cluster.ranks)
    w = work(model, run, gpu, dp)
    row = predict(w, cluster, algorithm, run.layout, fast)
    tokens = run.global_batch * model.seq / (row.step_s * cluster.ranks) if row.step_s else None
    details = {
        "model": dataclasses.asdict(model),
        "params": model.params,
        "active_params": model.active_params,
        "training": {**dataclasses.asdict(run), "grad_dtype": run.gradients},  # the default resolved
        "gpu": gpu.name,
        "model_flops_per_step": w.flops,
    }
    mem = memory(model, run, w.micro_batches, dp, gpu)
    return dataclasses.replace(row, memory=mem, details=details, tokens_per_s_per_gpu=tokens)
