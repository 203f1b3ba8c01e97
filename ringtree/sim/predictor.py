"""One prediction from a model spec, a parallel layout and a cluster: the transformer planner.

`work` turns the model (ringtree.sim.transformer) and the layout (ringtree.sim.layout) into what one
GPU does per micro-batch, timed by the compute model (ringtree.sim.compute); `plan` prices it on the
cluster with the planner's one predictor (ringtree.sim.plan.predict) and adds per-stage memory
(ringtree.sim.memory). Indices: l layers, h hidden, s sequence, b micro-batch, t TP, c CP, p PP.
"""

from __future__ import annotations

import dataclasses

from ringtree.sim import compute, eager, nccl_model
from ringtree.sim.clusters import GPU
from ringtree.sim.hardware import Cluster
from ringtree.sim.layout import Training, check
from ringtree.sim.memory import activation_bytes_per_layer, memory, stage_layers, states_bytes
from ringtree.sim.plan import StepPrediction, StepWork, predict
from ringtree.sim.transformer import Transformer

ITEMSIZE = 2  # 16-bit weights, activations and their collectives (gradients: the run's grad_itemsize)


def default_algorithm(cluster: Cluster) -> str:
    """What `--algorithm auto` prices a transformer's collectives with: NCCL (`native`, NCCL's own
    cost model) on a GPU cluster NCCL has a model of, as the published GPU runs use; ring elsewhere."""
    return "native" if nccl_model.tuning_for(cluster) is not None else "ring"


def layer_times(model: Transformer, run: Training, gpu: GPU) -> tuple[float, float, float]:
    """One layer's forward and backward (recompute included) on one rank, and its attention forward."""
    tokens = run.micro_batch * model.seq // run.cp
    mats = compute.matmuls_s(model, tokens, run.tp, gpu, run.dtype)
    attention = compute.attention_s(
        model, run.micro_batch, run.tp, run.cp, gpu, run.dtype, run.flash_attention, run.attention_kernel
    )
    if run.elementwise == "eager":
        other, other_back = eager.passes_s(model, tokens, run.tp, run.sequence_parallel, gpu)
    else:
        other = compute.elementwise_s(activation_bytes_per_layer(model, run, "none"), gpu)
        other_back = 2 * other
    forward = mats + attention + other
    backward = 2 * mats + other_back + (compute.FLASH_BACKWARD if run.flash_attention else 2) * attention
    redo = {"none": 0.0, "selective": attention, "full": forward, "op": 0.0, "dots": 0.0}[run.recompute]
    if run.recompute == "op":  # every second matmul and every elementwise op, the attention saved
        redo = other + _op_matmuls_s(model, tokens, run, gpu)
    if run.recompute == "dots":  # the MLP's input projections (column-parallel), the attention, the rest
        mlp_in = sum(
            compute.gemm_s(tokens, n // run.tp, k, gpu, run.dtype) for k, n in model.dots_recomputed()
        )
        redo = other + attention + mlp_in
    return forward, backward + redo, attention


def _op_matmuls_s(model: Transformer, tokens: int, run: Training, gpu: GPU) -> float:
    """The matmuls per-op selective AC reruns (`Transformer.op_recomputed`) on one TP rank: the
    output projection and the MLP's down projection split their input over TP (row-parallel), the
    others their output (column-parallel)."""
    shapes, t = model.matmul_shapes(), run.tp
    rows = {3, len(shapes) - 1}
    return sum(
        compute.gemm_s(tokens, n if i in rows else n // t, k // t if i in rows else k, gpu, run.dtype)
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


def work(model: Transformer, run: Training, gpu: GPU, dp: int) -> StepWork:
    """One GPU's step on the slowest stage: its layers on its TP and CP slice, per micro-batch; the
    logits (output layer and loss) sit on the last stage, as Megatron-LM's `post_process` puts them."""
    t, p = run.tp, run.pp
    forward, backward, attention = layer_times(model, run, gpu)
    kept = layer_times(model, dataclasses.replace(run, recompute="none", recompute_layers=0), gpu)[1]
    tokens = run.micro_batch * model.seq // run.cp
    logits = compute.logits_s(model, tokens, t, gpu, run.dtype)
    counts = stage_layers(model.layers, p)
    redo = [run.mode_layers(n) for n in counts]
    fs = tuple(n * forward + (logits if j == p - 1 else 0.0) for j, n in enumerate(counts))
    bs = tuple(
        r * backward + (n - r) * kept + (2 * logits if j == p - 1 else 0.0)
        for j, (n, r) in enumerate(zip(counts, redo, strict=True))
    )
    k = max(range(p), key=lambda j: fs[j] + bs[j])  # the slowest stage sets the pace
    layers = float(counts[k])
    share = sum(redo) / model.layers  # of the model's layers, priced with the run's recompute
    stage_params = model.params / (t * p)
    m = run.micro_batches(dp)
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
        tp_forward=round(2 * layers),
        tp_backward=round(2 * layers + _tp_rerun(run) * redo[k]),
        activation_bytes=tokens * model.hidden * ITEMSIZE // t,  # scatter-gather over the TP ranks
        flops=model.model_flops(run.global_batch),
        peak_flops=gpu.peak(run.dtype),
        optimizer_s=2 * states_bytes(stage_params, run, run.shards(dp)) / (gpu.hbm_GBps * 1e9),
        layers=layers,
        cp_bytes=2 * run.micro_batch * model.seq * model.kv_hidden // t * ITEMSIZE if run.cp > 1 else 0,
        attention_s=attention,
        cp_overlap=run.cp_comm == "p2p",
        hardware_flops=share * model.step_flops(run.global_batch, run.recompute)
        + (1 - share) * model.step_flops(run.global_batch, "none"),
        stage_forward_s=fs if p > 1 else (),
        stage_backward_s=bs if p > 1 else (),
    )


def plan(
    model: Transformer, run: Training, cluster: Cluster, gpu: GPU, algorithm: str = "auto", fast: bool = False
) -> StepPrediction:
    """The predicted step of `model` trained as `run` on `cluster` of `gpu`s, with per-stage memory.

    `algorithm` "auto" is `default_algorithm(cluster)`, as `ringtree plan` prices it; `fast` bounds
    the pipeline replay by its closed form (the search's first pass)."""
    algorithm = default_algorithm(cluster) if algorithm == "auto" else algorithm
    dp = check(model, run, cluster.ranks)
    w = work(model, run, gpu, dp)
    row = predict(w, cluster, algorithm, run.layout, fast)
    details = {
        "model": dataclasses.asdict(model),
        "params": model.params,
        "training": {**dataclasses.asdict(run), "grad_dtype": run.gradients},  # the default resolved
        "gpu": gpu.name,
        "model_flops_per_step": w.flops,
    }
    return dataclasses.replace(row, memory=memory(model, run, w.micro_batches, dp, gpu), details=details)
