"""`ringtree plan`: the one command in front of three planners. Each planner's options and output
live in its own module (transformer, data_parallel, from_run; the cluster and output options all
share in cluster); this module lists the options in the order `--help` shows them and sends a call
to the planner its options name, refusing options that planner would ignore."""

from __future__ import annotations

from pathlib import Path

import typer

from ringtree import dtypes
from ringtree.cli.app import app
from ringtree.cli.output import check_output
from ringtree.cli.plan import data_parallel as dp
from ringtree.cli.plan import from_run as run_scaling
from ringtree.cli.plan import from_trace as trace_scaling
from ringtree.cli.plan import transformer as tf
from ringtree.cli.plan.cluster import (
    ALGORITHM,
    CALIBRATION,
    CLUSTER_NAME,
    GPUS_PER_NODE,
    INTER,
    INTRA,
    JSON_PATH,
    NICS_PER_NODE,
    NODES,
    PLOT,
    ClusterOptions,
    refuse,
)
from ringtree.cli.plan.lowcomm import SyncOptions, sync_options
from ringtree.cli.plan.moe import MoeOptions, moe_options
from ringtree.cli.plan.presets import resolve


@app.command()
@moe_options
@sync_options
def plan(
    model: str | None = tf.MODEL_NAME,
    layers: int | None = tf.LAYERS,
    hidden: int | None = tf.HIDDEN,
    heads: int | None = tf.HEADS,
    seq: int | None = tf.SEQ,
    vocab: int | None = tf.VOCAB,
    kv_heads: int | None = tf.KV_HEADS,
    ffn_hidden: int | None = tf.FFN_HIDDEN,
    mlp: str | None = tf.MLP,
    dropout: bool | None = tf.DROPOUT,
    pp: int = tf.PP,
    schedule: str = tf.SCHEDULE,
    tp: int = tf.TP,
    cp: int = tf.CP,
    cp_comm: str = tf.CP_COMM,
    virtual_stages: int = tf.VIRTUAL_STAGES,
    pp_layout: str = tf.PP_LAYOUT,
    first_stage_layers: int = tf.FIRST_STAGE_LAYERS,
    last_stage_layers: int = tf.LAST_STAGE_LAYERS,
    sequence_parallel: bool = tf.SEQUENCE_PARALLEL,
    zero: int = tf.ZERO,
    shard_group: int = tf.SHARD_GROUP,
    flash_attention: bool = tf.FLASH_ATTENTION,
    attention_kernel: str = tf.ATTENTION_KERNEL,
    elementwise: str = tf.ELEMENTWISE,
    global_batch: int | None = tf.GLOBAL_BATCH,
    micro_batch: int | None = tf.MICRO_BATCH,
    dtype: str = tf.DTYPE,
    grad_dtype: str | None = tf.GRAD_DTYPE,
    recompute: str | None = tf.RECOMPUTE,
    recompute_layers: int = tf.RECOMPUTE_LAYERS,
    search: bool = tf.SEARCH,
    nodes: int = NODES,
    gpus_per_node: int | None = GPUS_PER_NODE,
    intra: str | None = INTRA,
    inter: str | None = INTER,
    nics_per_node: int | None = NICS_PER_NODE,
    cluster_name: str | None = CLUSTER_NAME,
    calibration: Path | None = CALIBRATION,
    algorithm: str = ALGORITHM,
    params: str | None = dp.PARAMS,
    module: str | None = dp.MODULE,
    compute_time: float | None = dp.COMPUTE_TIME,
    measure: bool = dp.MEASURE,
    input_shape: str | None = dp.INPUT_SHAPE,
    overlap: bool = dp.OVERLAP,
    bucket_mb: float = dp.BUCKET_MB,
    compression: str | None = dp.COMPRESSION,
    accumulate: int = dp.ACCUMULATE,
    batch_size: int = dp.BATCH_SIZE,
    micro_batches: int = dp.MICRO_BATCHES,
    activation_mb: float = dp.ACTIVATION_MB,
    shape: str | None = dp.SHAPE,
    from_run: Path | None = run_scaling.FROM_RUN,
    from_trace: Path | None = trace_scaling.FROM_TRACE,
    run_gpus_per_node: int | None = trace_scaling.RUN_GPUS_PER_NODE,
    json_path: Path | None = JSON_PATH,
    plot: Path | None = PLOT,
    moe: MoeOptions = MoeOptions(),  # the options of ringtree.cli.plan.moe
    sync: SyncOptions = SyncOptions(),  # the options of ringtree.cli.plan.lowcomm
) -> None:
    """Predict the step time of training on a cluster: data parallel per algorithm, or a transformer
    under DP x TP x PP; --search ranks configurations, --from-run scales a finished run."""
    from ringtree.sim.training.transformer import MODELS as TRANSFORMERS

    check_output(json_path, "--json")
    check_output(plot, "--plot")
    if model is not None:
        try:
            model = resolve(model)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    dtype, grad_dtype = dtypes.short(dtype), None if grad_dtype is None else dtypes.short(grad_dtype)
    links = ClusterOptions(nodes, gpus_per_node, intra, inter, nics_per_node, cluster_name, calibration)
    shape_given = any(
        x is not None
        for x in (layers, hidden, heads, seq, vocab, global_batch, kv_heads, ffn_hidden, mlp, dropout)
    )
    parallel_given = (
        cp > 1 or virtual_stages > 1 or sequence_parallel or zero > 0 or not flash_attention
        or attention_kernel != "fused" or elementwise != "fused" or cp_comm != "p2p" or shard_group != 0
        or recompute_layers != 0 or bool(pp_layout) or first_stage_layers != 0 or last_stage_layers != 0
    )  # fmt: skip
    transformer_only = (
        shape_given or parallel_given or search or micro_batch is not None or recompute is not None
        or bool(moe.given())
    )  # fmt: skip
    if run_gpus_per_node is not None and from_trace is None:
        refuse(["--run-gpus-per-node"], "no --from-trace (it describes the traced run)")
    if from_trace is not None:
        given = {"--model": model, "--params": params, "--module": module, "--compute-time": compute_time,
                 "--measure": measure or None, "--input-shape": input_shape, "--overlap": overlap or None,
                 "--bucket-mb": None if bucket_mb == 25.0 else bucket_mb, "--compression": compression,
                 "--accumulate": None if accumulate == 1 else accumulate, "--tp": None if tp == 1 else tp,
                 "--batch-size": None if batch_size == 32 else batch_size, "--pp": None if pp == 1 else pp,
                 "--grad-dtype": grad_dtype, "--shape": shape, "--from-run": from_run, "--plot": plot,
                 "--search": search or None}  # fmt: skip
        named = [k for k, v in given.items() if v is not None]
        named += ["transformer options"] if transformer_only else []
        refuse(named + sync.given(), "--from-trace (the step comes from the trace)")
        return trace_scaling.run(from_trace, links, algorithm, json_path, run_gpus_per_node)
    if from_run is not None:
        given = {"--model": model, "--params": params, "--module": module, "--compute-time": compute_time,
                 "--measure": measure or None, "--input-shape": input_shape, "--overlap": overlap or None,
                 "--bucket-mb": None if bucket_mb == 25.0 else bucket_mb, "--compression": compression,
                 "--accumulate": None if accumulate == 1 else accumulate, "--tp": None if tp == 1 else tp,
                 "--batch-size": None if batch_size == 32 else batch_size, "--pp": None if pp == 1 else pp,
                 "--grad-dtype": grad_dtype, "--shape": shape,
                 "--search": search or None}  # fmt: skip
        named = [k for k, v in given.items() if v is not None]
        named += ["transformer options"] if transformer_only else []  # the MoE options among them
        # the method and its words come from the run; the planned cluster's replica groups and the
        # sweep are the plan's own
        kept = [f for f in sync.given() if f not in ("--replicas", "--sweep")]
        refuse(named + kept, "--from-run (the step and its --sync come from the run)")
        return run_scaling.run(from_run, links, algorithm, json_path, plot, sync)
    dp_inputs = compute_time is not None or measure  # a preset in both lists (llama-7b) goes by these
    # a transformer preset with --compute-time or --measure: its parameter count, data-parallel planner
    only = model == "transformer" or transformer_only or (model in TRANSFORMERS and not dp_inputs)
    transformer = only or (model in TRANSFORMERS and not dp_inputs)
    if transformer and dp_inputs:
        refuse(["--compute-time" if compute_time is not None else "--measure"], "the transformer model")
    if transformer:
        dims = {"layers": layers, "hidden": hidden, "heads": heads, "seq": seq, "vocab": vocab,
                "kv_heads": kv_heads, "ffn_hidden": ffn_hidden, "mlp": mlp, "dropout": dropout}  # fmt: skip
        legacy = {"--params": params, "--module": module, "--compression": compression, "--shape": shape,
                  "--accumulate": None if accumulate == 1 else accumulate,
                  "--batch-size": None if batch_size == 32 else batch_size}  # fmt: skip
        chosen = {"--tp": tp > 1, "--pp": pp > 1, "--cp": cp > 1, "--virtual-stages": virtual_stages > 1,
                  "--sequence-parallel": sequence_parallel, "--zero": zero > 0,
                  "--shard-group": shard_group != 0, "--recompute-layers": recompute_layers != 0,
                  "--micro-batch": micro_batch is not None, "--pp-layout": bool(pp_layout),
                  "--first-stage-layers": first_stage_layers != 0,
                  "--last-stage-layers": last_stage_layers != 0}  # fmt: skip
        if search:
            tf.refuse_for_search(chosen, flash_attention, attention_kernel, elementwise)
        layout = {"tp": tp, "pp": pp, "cp": cp, "virtual_stages": virtual_stages,
                  "sequence_parallel": sequence_parallel, "zero": zero,
                  "flash_attention": flash_attention, "attention_kernel": attention_kernel,
                  "elementwise": elementwise, "grad_dtype": grad_dtype, "cp_comm": cp_comm,
                  "shard_group": shard_group, "recompute_layers": recompute_layers, "pp_layout": pp_layout,
                  "first_stage_layers": first_stage_layers,
                  "last_stage_layers": last_stage_layers}  # fmt: skip
        return tf.run(
            model, {**dims, **moe.model_dims()}, global_batch, micro_batch or 1, layout, dtype, recompute,
            overlap, bucket_mb, schedule, links, algorithm, search, json_path, legacy, moe, plot, sync,
        )  # fmt: skip
    return dp.run(
        model, params, module, compute_time, measure, input_shape, grad_dtype, compression, overlap,
        bucket_mb, accumulate, batch_size, pp, micro_batches, schedule, activation_mb, tp, shape, links,
        algorithm, json_path, plot, sync,
    )  # fmt: skip
