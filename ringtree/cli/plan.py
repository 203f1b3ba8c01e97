"""`ringtree plan`: predicted training step time per all-reduce algorithm, and a recommendation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from ringtree.cli.app import app
from ringtree.cli.output import check_output, console, print_table, write_json
from ringtree.cli.plan_moe import MoeOptions, moe_options, print_transformer

_COUNT_UNITS = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}


@app.command()
@moe_options
def plan(
    model: str | None = typer.Option(
        None,
        help="A model preset (vit-base, resnet50, gpt3-175b, llama-7b, ...) or 'transformer'.",
        rich_help_panel="Model",
    ),
    layers: int | None = typer.Option(None, help="Transformer model: layers.", rich_help_panel="Model"),
    hidden: int | None = typer.Option(None, help="Transformer model: hidden size.", rich_help_panel="Model"),
    heads: int | None = typer.Option(
        None, help="Transformer model: attention heads.", rich_help_panel="Model"
    ),
    seq: int | None = typer.Option(None, help="Transformer model: sequence length.", rich_help_panel="Model"),
    vocab: int | None = typer.Option(
        None, help="Transformer model: vocabulary size.", rich_help_panel="Model"
    ),
    kv_heads: int | None = typer.Option(
        None, help="Key/value heads (grouped-query attention; default: --heads).", rich_help_panel="Model"
    ),
    ffn_hidden: int | None = typer.Option(
        None, help="MLP width (default 4 x --hidden).", rich_help_panel="Model"
    ),
    mlp: str | None = typer.Option(
        None, help="MLP: gelu (two h x F matrices) or swiglu (three).", rich_help_panel="Model"
    ),
    dropout: bool | None = typer.Option(
        None,
        "--dropout/--no-dropout",
        help="Dropout masks stored for the backward (default: GPT shapes yes, as Megatron-LM's 0.1; "
        "the Llama 3 presets no).",
        rich_help_panel="Model",
    ),
    pp: int = typer.Option(
        1, help="Pipeline stages: also predict a pipeline step (replayed schedule).", rich_help_panel="Layout"
    ),
    schedule: str = typer.Option(
        "1f1b", help="Pipeline schedule for --pp: gpipe, 1f1b, pipedream.", rich_help_panel="Layout"
    ),
    tp: int = typer.Option(
        1,
        help="Tensor-parallel degree: also predict a DP x TP step (transformers).",
        rich_help_panel="Layout",
    ),
    cp: int = typer.Option(
        1, help="Context-parallel degree: the sequence split over CP ranks.", rich_help_panel="Layout"
    ),
    cp_comm: str = typer.Option(
        "p2p",
        help="How CP ranks exchange K and V: p2p (a ring overlapped with the attention: Megatron-Core's "
        "default, Transformer Engine) or all-gather (gathered before the attention, exposed: Llama 3).",
        rich_help_panel="Layout",
    ),
    virtual_stages: int = typer.Option(
        1, help="Model chunks per pipeline rank (interleaved 1F1B).", rich_help_panel="Layout"
    ),
    sequence_parallel: bool = typer.Option(
        False,
        "--sequence-parallel",
        help="Megatron's sequence parallelism over the TP group.",
        rich_help_panel="Layout",
    ),
    zero: int = typer.Option(
        0,
        help="ZeRO stage: 0 replicated, 1 optimizer, 2 + gradients, 3 + parameters sharded.",
        rich_help_panel="Layout",
    ),
    shard_group: int = typer.Option(
        0,
        help="Data-parallel ranks that shard ZeRO's states, replicated across the rest: HSDP (FSDP's "
        "HYBRID_SHARD: one node's ranks). 0: all of them.",
        rich_help_panel="Layout",
    ),
    flash_attention: bool = typer.Option(
        True,
        "--flash-attention/--no-flash-attention",
        help="Attention as flash attention (default) or unfused.",
        rich_help_panel="Layout",
    ),
    attention_kernel: str = typer.Option(
        "fused",
        help="Flash attention's kernel: fused (the GPU's own: cuDNN, Transformer Engine, FlashAttention-3 "
        "on Hopper) or flash2 (FlashAttention-2, as PyTorch's scaled_dot_product_attention runs it).",
        rich_help_panel="Layout",
    ),
    elementwise: str = typer.Option(
        "fused",
        help="Norms, activation, rotary and residual adds: fused (torch.compile, Megatron-LM's fused "
        "kernels) or eager (one kernel per PyTorch op, as torchtitan's Llama runs without torch.compile).",
        rich_help_panel="Layout",
    ),
    global_batch: int | None = typer.Option(
        None, help="Transformer model: sequences per optimizer step.", rich_help_panel="Layout"
    ),
    micro_batch: int | None = typer.Option(
        None, help="Transformer model: sequences per micro-batch (1).", rich_help_panel="Layout"
    ),
    dtype: str = typer.Option("bf16", help="Transformer model: fp16 or bf16.", rich_help_panel="Layout"),
    grad_dtype: str | None = typer.Option(
        None,
        help="Gradient dtype, accumulated and reduced over DP: fp32, bf16 or fp16. Default fp32 (a "
        "transformer under --dtype fp16: fp16); bf16 runs reduce in fp32 in Megatron-LM, torchtitan, "
        "NeMo's distributed Adam and Llama 3 unless told otherwise.",
        rich_help_panel="Layout",
    ),
    recompute: str | None = typer.Option(
        None,
        help="Transformer model: activation recompute none (default)|selective|full|op|dots (op: "
        "torchtitan's per-op selective AC, every second matmul and the elementwise ops rerun; dots: "
        "MaxText's save_dot_except_mlpwi, the MLP's input projections, the attention and the elementwise "
        "ops rerun).",
        rich_help_panel="Layout",
    ),
    recompute_layers: int = typer.Option(
        0,
        help="With --recompute full: only this many layers of each stage (of each chunk when "
        "interleaved) recompute, the rest keep their activations (Megatron's --recompute-method block "
        "--recompute-num-layers). 0: all.",
        rich_help_panel="Layout",
    ),
    search: bool = typer.Option(
        False, help="Rank every TP x PP x DP x micro-batch that fits in memory.", rich_help_panel="Layout"
    ),
    nodes: int = typer.Option(1, help="Nodes.", rich_help_panel="Cluster"),
    gpus_per_node: int | None = typer.Option(
        None, help="Devices per node (default 8, or the --cluster's).", rich_help_panel="Cluster"
    ),
    intra: str | None = typer.Option(
        None, help="Intra-node link: a preset, FILE.json or 'bw=..,lat=..'.", rich_help_panel="Cluster"
    ),
    inter: str | None = typer.Option(
        None, help="Inter-node link: a preset, FILE.json or 'bw=..,lat=..'.", rich_help_panel="Cluster"
    ),
    nics_per_node: int | None = typer.Option(
        None, help="NICs per node (default 1, or the --cluster's).", rich_help_panel="Cluster"
    ),
    cluster_name: str | None = typer.Option(
        None,
        "--cluster",
        help="A cluster preset: dgx-a100, dgx-h100, p4d.24xlarge, eth-10g, ...",
        rich_help_panel="Cluster",
    ),
    calibration: Path | None = typer.Option(
        None, help="A `ringtree calibrate` file for unnamed links.", rich_help_panel="Cluster"
    ),
    algorithm: str = typer.Option(
        "auto", help="The algorithm to report, or auto (the fastest).", rich_help_panel="Cluster"
    ),
    params: str | None = typer.Option(
        None,
        help="Parameter count instead of a preset, e.g. 86M, 1.5B.",
        rich_help_panel="Data-parallel planner",
    ),
    module: str | None = typer.Option(
        None,
        help="pkg.mod:factory returning a torch.nn.Module to count.",
        rich_help_panel="Data-parallel planner",
    ),
    compute_time: float | None = typer.Option(
        None,
        help="Seconds of forward+backward per step on one device.",
        rich_help_panel="Data-parallel planner",
    ),
    measure: bool = typer.Option(
        False,
        help="Time the --module here instead (needs --input-shape).",
        rich_help_panel="Data-parallel planner",
    ),
    input_shape: str | None = typer.Option(
        None, help="Input shape for --measure, e.g. 32,3,224,224.", rich_help_panel="Data-parallel planner"
    ),
    overlap: bool = typer.Option(
        False,
        "--overlap/--no-overlap",
        help="Overlap all-reduce with backward.",
        rich_help_panel="Data-parallel planner",
    ),
    bucket_mb: float = typer.Option(
        25.0, help="Fusion bucket size in MiB.", rich_help_panel="Data-parallel planner"
    ),
    compression: str | None = typer.Option(
        None, help="All-reduce gradients as fp16 or bf16.", rich_help_panel="Data-parallel planner"
    ),
    accumulate: int = typer.Option(
        1,
        help="Micro-steps of gradient accumulation per all-reduce.",
        rich_help_panel="Data-parallel planner",
    ),
    batch_size: int = typer.Option(
        32, help="Samples per device per micro-step (for samples/s).", rich_help_panel="Data-parallel planner"
    ),
    micro_batches: int = typer.Option(
        4, help="Micro-batches per pipeline step (with --pp).", rich_help_panel="Data-parallel planner"
    ),
    activation_mb: float = typer.Option(
        0.0,
        help="MB of one micro-batch's activation between stages.",
        rich_help_panel="Data-parallel planner",
    ),
    shape: str | None = typer.Option(
        None,
        help="With --tp: LAYERS,HIDDEN,SEQ of the transformer (presets know theirs), e.g. 96,12288,2048.",
        rich_help_panel="Data-parallel planner",
    ),
    from_run: Path | None = typer.Option(
        None,
        help="A `ringtree train --json` summary of a one-node run.",
        rich_help_panel="Data-parallel planner",
    ),
    json_path: Path | None = typer.Option(
        None, "--json", help="Write the plan as JSON here.", rich_help_panel="Output"
    ),
    plot: Path | None = typer.Option(
        None, help="PNG of the speedup from 1 to --nodes nodes.", rich_help_panel="Output"
    ),
    moe: MoeOptions = MoeOptions(),  # the options of ringtree.cli.plan_moe
) -> None:
    """Predict the step time of training on a cluster: data parallel per algorithm, or a transformer
    under DP x TP x PP; --search ranks configurations, --from-run scales a finished run."""
    from ringtree.sim import ALGORITHMS
    from ringtree.sim.plan import MODELS, StepConfig
    from ringtree.sim.transformer import MODELS as TRANSFORMERS

    check_output(json_path, "--json")
    check_output(plot, "--plot")
    links = ClusterOptions(nodes, gpus_per_node, intra, inter, nics_per_node, cluster_name, calibration)
    shape_given = any(
        x is not None
        for x in (layers, hidden, heads, seq, vocab, global_batch, kv_heads, ffn_hidden, mlp, dropout)
    )
    parallel_given = (
        cp > 1 or virtual_stages > 1 or sequence_parallel or zero > 0 or not flash_attention
        or attention_kernel != "fused" or elementwise != "fused" or cp_comm != "p2p" or shard_group != 0
        or recompute_layers != 0
    )  # fmt: skip
    transformer_only = (
        shape_given or parallel_given or search or micro_batch is not None or recompute is not None
        or bool(moe.given())
    )  # fmt: skip
    if from_run is not None:
        given = {"--model": model, "--params": params, "--module": module, "--compute-time": compute_time,
                 "--measure": measure or None, "--input-shape": input_shape, "--overlap": overlap or None,
                 "--bucket-mb": None if bucket_mb == 25.0 else bucket_mb, "--compression": compression,
                 "--accumulate": None if accumulate == 1 else accumulate, "--tp": None if tp == 1 else tp,
                 "--batch-size": None if batch_size == 32 else batch_size, "--pp": None if pp == 1 else pp,
                 "--grad-dtype": grad_dtype, "--shape": shape,
                 "--plot": plot, "--search": search or None}  # fmt: skip
        named = [k for k, v in given.items() if v is not None]
        named += ["transformer options"] if transformer_only else []  # the MoE options among them
        _refuse(named, "--from-run (the step comes from the run)")
        return _from_run(from_run, links, algorithm, json_path)
    dp_inputs = compute_time is not None or measure  # a preset in both lists (llama-7b) goes by these
    only = model == "transformer" or (model in TRANSFORMERS and model not in MODELS) or transformer_only
    transformer = only or (model in TRANSFORMERS and not dp_inputs)
    if transformer and dp_inputs:
        _refuse(["--compute-time" if compute_time is not None else "--measure"], "the transformer model")
    if transformer:
        dims = {"layers": layers, "hidden": hidden, "heads": heads, "seq": seq, "vocab": vocab,
                "kv_heads": kv_heads, "ffn_hidden": ffn_hidden, "mlp": mlp, "dropout": dropout}  # fmt: skip
        legacy = {"--params": params, "--module": module, "--compression": compression, "--plot": plot,
                  "--shape": shape, "--accumulate": None if accumulate == 1 else accumulate,
                  "--batch-size": None if batch_size == 32 else batch_size}  # fmt: skip
        chosen = {"--tp": tp > 1, "--pp": pp > 1, "--cp": cp > 1, "--virtual-stages": virtual_stages > 1,
                  "--sequence-parallel": sequence_parallel, "--zero": zero > 0,
                  "--shard-group": shard_group != 0, "--recompute-layers": recompute_layers != 0,
                  "--micro-batch": micro_batch is not None}  # fmt: skip
        if search:
            _refuse([k for k, v in chosen.items() if v], "--search (it chooses them)")
            attention = {
                "--no-flash-attention": not flash_attention,
                "--attention-kernel": attention_kernel != "fused",
            }
            _refuse(
                [k for k, v in attention.items() if v], "--search (it prices the GPU's fused flash attention)"
            )
            if elementwise != "fused":
                _refuse(["--elementwise"], "--search (it prices fused elementwise kernels)")
        layout = {"tp": tp, "pp": pp, "cp": cp, "virtual_stages": virtual_stages,
                  "sequence_parallel": sequence_parallel, "zero": zero,
                  "flash_attention": flash_attention, "attention_kernel": attention_kernel,
                  "elementwise": elementwise, "grad_dtype": grad_dtype, "cp_comm": cp_comm,
                  "shard_group": shard_group, "recompute_layers": recompute_layers}  # fmt: skip
        return _transformer(
            model, {**dims, **moe.model_dims()}, global_batch, micro_batch or 1, layout, dtype, recompute,
            overlap, bucket_mb, schedule, links, algorithm, search, json_path, legacy, moe,
        )  # fmt: skip
    try:
        count = _param_count(model, params, module)
        seconds = _compute_time(compute_time, measure, module, input_shape)
        cluster = links.cluster()
        config = StepConfig(
            count, seconds, grad_dtype or "fp32", compression, overlap, bucket_mb, accumulate, batch_size
        )
        if algorithm not in ("auto", *ALGORITHMS, "native"):
            raise ValueError(
                f"unknown algorithm {algorithm!r}; choose auto or one of {', '.join(ALGORITHMS)}"
            )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    result = _plan(config, cluster, algorithm)
    _print(result, config, cluster)
    _explain(result, config, cluster, calibration)
    if pp > 1:
        result["pipeline"] = _pipeline(pp, micro_batches, schedule, seconds, cluster, activation_mb)
    if tp > 1:
        result["tensor_parallel"] = _tensor_parallel(config, cluster, tp, model, shape, result["algorithm"])
    if json_path is not None:
        write_json(json_path, result)
    if plot is not None:
        from ringtree.plots import plot_scaling
        from ringtree.sim.plan import speedup_vs_one_node

        counts = [1 << i for i in range(nodes.bit_length()) if 1 << i < nodes] + [nodes]
        curves = {
            a: [speedup_vs_one_node(config, cluster.with_nodes(n), a) for n in counts]
            for a in dict.fromkeys(["ring", result["recommended_algorithm"], result["algorithm"]])
        }
        plot_scaling(counts, curves, plot, f"{count / 1e6:.0f}M params, {result['cluster_title']}")
        console.print(f"wrote {plot}", highlight=False)


@dataclass(frozen=True)
class ClusterOptions:
    """The cluster options of the command line, resolved on demand (a preset, links, a calibration)."""

    nodes: int
    gpus_per_node: int | None
    intra: str | None
    inter: str | None
    nics_per_node: int | None
    name: str | None
    calibration: Path | None

    def cluster(self) -> Any:
        from ringtree.sim import make_cluster
        from ringtree.sim.clusters import preset_cluster

        if self.name is None:
            return make_cluster(
                self.nodes,
                self.gpus_per_node or 8,
                self.intra,
                self.inter,
                self.calibration,
                self.nics_per_node,
            )
        if self.calibration is not None:
            raise ValueError(
                f"--cluster {self.name} and --calibration both describe the links: pass one of them"
            )
        c = preset_cluster(self.name, self.nodes, self.gpus_per_node, self.intra, self.inter)
        return dataclasses.replace(c, nics_per_node=self.nics_per_node) if self.nics_per_node else c

    def gpu(self) -> Any:
        from ringtree.sim.clusters import get

        if self.name is None:
            raise ValueError(
                "the transformer model needs the GPU's peak and memory: pass --cluster "
                "(dgx-a100, dgx-h100, p4d.24xlarge, ...)"
            )
        return get(self.name).gpu


def _plan(config: Any, cluster: Any, algorithm: str) -> dict[str, Any]:
    """Every algorithm's prediction, the chosen one's headline numbers, and the recommendation."""
    from ringtree.sim import ALGORITHMS
    from ringtree.sim.plan import predict_step, recommend, speedup_vs_one_node

    best, reason = recommend(config, cluster)
    chosen = best if algorithm == "auto" else algorithm
    rows = []
    for a in dict.fromkeys([*ALGORITHMS, chosen]):
        p = predict_step(config, cluster, a)
        speedup = speedup_vs_one_node(config, cluster, a)
        rows.append(
            {**p.as_dict(), "speedup_vs_one_node": speedup, "scaling_efficiency": speedup / cluster.nodes}
        )
    head = next(r for r in rows if r["algorithm"] == chosen)
    return {
        **head,
        "recommended_algorithm": best,
        "reason": reason,
        "grad_bytes": config.grad_bytes,
        "config": dataclasses.asdict(config),
        "cluster": cluster.as_dict(),
        "cluster_title": _cluster_title(cluster),
        "algorithms": rows,
    }


def _pipeline(pp: int, m: int, schedule: str, seconds: float, cluster: Any, activation_mb: float) -> Any:
    """The pipeline step replayed over the intra-node link (the inter-node one when pp spans nodes)."""
    from ringtree.schedules.pipeline import check_pipeline
    from ringtree.sim.plan import predict_pipeline

    try:
        check_pipeline(pp, m, schedule, "params")
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    link = cluster.intra if pp <= cluster.gpus_per_node else cluster.inter
    out = predict_pipeline(schedule, pp, m, seconds, link, int(activation_mb * 1e6))
    console.print(
        f"pipeline: {schedule}, pp={pp}, m={m}: step {out['pipeline_step_time_s']:.4f} s, bubble "
        f"{out['bubble_fraction']:.1%} (theory (p-1)/(m+p-1) = {out['theoretical_bubble_fraction']:.1%})",
        highlight=False,
    )
    return out


def _tensor_parallel(
    config: Any, cluster: Any, tp: int, model: str | None, shape: str | None, algorithm: str
) -> dict[str, Any]:
    """The DP x TP step with the TP group inside a node (as the Mesh places it) and spread across nodes."""
    from ringtree.sim.plan import DTYPE_BYTES
    from ringtree.sim.tensor_parallel import SHAPES, TPShape, predict_tp_step

    try:
        dims = SHAPES.get(model or "") if shape is None else tuple(int(x) for x in shape.split(","))
        if dims is None or len(dims) != 3:
            raise ValueError(
                f"--tp needs the transformer's shape: pass --shape LAYERS,HIDDEN,SEQ (got {shape!r}) or "
                f"a --model preset with a known shape: {', '.join(SHAPES)}"
            )
        layers, hidden, seq = dims
        tshape = TPShape(layers, hidden, seq, config.batch_size, DTYPE_BYTES[config.grad_dtype])
        inside = predict_tp_step(config, tshape, cluster, tp, algorithm).as_dict()
        across = (
            predict_tp_step(config, tshape, cluster, tp, algorithm, spread=True).as_dict()
            if cluster.nodes >= tp
            else None
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    for where, row in (("inside a node", inside), ("one rank per node", across)):
        if row is not None:
            console.print(
                f"tensor parallel tp={tp}, {where} ({row['tp_link']}): step {row['step_s']:.4f} s, TP "
                f"all-reduces {row['breakdown']['tp_comm_s']:.4f} s, {row['samples_per_s']:.1f} samples/s",
                highlight=False,
            )
    return {"inside_node": inside, "across_nodes": across}


def _cluster_title(cluster: Any) -> str:
    return f"{cluster.nodes} x {cluster.gpus_per_node}, {cluster.intra.name} / {cluster.inter.name}"


def _print(result: dict[str, Any], config: Any, cluster: Any) -> None:
    """The table of algorithms, the bottleneck (in the JSON under `explain`) and the recommendation."""
    from ringtree.sim.plan import bottleneck

    level, share = bottleneck(config, cluster, result["algorithm"])
    print_table(
        f"ringtree plan: {result['config']['params'] / 1e6:.1f}M params, "
        f"{result['grad_bytes'] / 1e6:.0f} MB of gradients, {result['cluster_title']}",
        ["algorithm", "all-reduce (s)", "step (s)", "samples/s", "speedup vs 1 node", "efficiency"],
        [
            [
                r["algorithm"],
                f"{r['dp_allreduce_s']:.4f}",
                f"{r['step_s']:.4f}",
                f"{r['samples_per_s']:.1f}",
                f"{r['speedup_vs_one_node']:.2f}x",
                f"{r['scaling_efficiency']:.0%}",
            ]
            for r in result["algorithms"]
        ],
    )
    console.print(f"bottleneck: {level} ({share:.0%})", highlight=False)
    console.print(f"recommended: {result['reason']}", highlight=False)


def _param_count(model: str | None, params: str | None, module: str | None) -> int:
    """Exactly one of a preset, a number, or a module to count."""
    from ringtree.sim.plan import MODELS

    given = [x for x in (model, params, module) if x is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of --model ({', '.join(MODELS)}), --params or --module")
    if model is not None:
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)} or pass --params")
        return MODELS[model]
    if params is not None:
        return parse_count(params)
    from ringtree.cli.modules import count_parameters

    return count_parameters(str(module))


def _compute_time(seconds: float | None, measure: bool, module: str | None, shape: str | None) -> float:
    if measure:
        if module is None or shape is None:
            raise ValueError("--measure times a real module: pass --module pkg.mod:factory and --input-shape")
        from ringtree.cli.modules import measure_step

        return measure_step(module, [int(d) for d in shape.split(",")])
    if seconds is None:
        raise ValueError("pass --compute-time SECONDS (one step on one device) or --measure")
    return seconds


def parse_count(text: str) -> int:
    """'86M' -> 86_000_000, '1.5B' -> 1_500_000_000 (decimal multiples, as parameter counts are given)."""
    s = text.strip().upper()
    unit = s[-1:] if s[-1:] in _COUNT_UNITS else ""
    try:
        value = float(s[: len(s) - len(unit)]) * _COUNT_UNITS.get(unit, 1.0)
    except ValueError:
        raise ValueError(f"cannot read parameter count {text!r}; write it like 25.6M or 1.5B") from None
    if value < 0:
        raise ValueError(f"parameter count must not be negative, got {text!r}")
    return int(value)


def _refuse(options: list[str], what: str) -> None:
    """Exit 2 naming options that would be ignored."""
    if options:
        raise typer.BadParameter(f"{', '.join(options)} do not apply with {what}: drop them")


def _explain(result: dict[str, Any], config: Any, cluster: Any, calibration: Path | None) -> None:
    """Why: the bound per link level, the bottleneck, the network for 90% efficiency, an error bar;
    with the seed's own arithmetic beside the plan's."""
    from ringtree.sim.explain import explain, seed_derivation

    why = explain(config, cluster, result["algorithm"], calibration)
    # The seed's arithmetic is a flat ring through one NIC per node: shown where the plan is that.
    flat_ring = result["algorithm"] in ("ring", "native") and cluster.nics_per_node == 1
    shown = cluster.nodes > 1 and flat_ring
    derivation = seed_derivation(config, cluster, result["algorithm"]) if shown else []
    for line in [*why["lines"], *derivation]:
        console.print(line, highlight=False)
    result["explain"] = {k: v for k, v in why.items() if k != "lines"} | {"lines": why["lines"] + derivation}


def _from_run(path: Path, links: ClusterOptions, algorithm: str, json_path: Path | None) -> None:
    """A finished one-node run's measured compute time, scaled to --nodes x --gpus-per-node."""
    from ringtree import files
    from ringtree.sim.plan import StepConfig, predict_step, with_run_wait

    try:
        summary = files.read_json(path, "--from-run")
        if not isinstance(summary, dict):
            raise ValueError(f"{path} is not a `ringtree train --json` summary (expected one JSON object)")
        config = StepConfig.from_summary(summary)
        cluster = links.cluster()
        run_nodes = int(summary.get("nodes") or 1)
        run_ranks = int(summary.get("world_size") or 1)
        chosen = str(summary.get("algorithm") or "ring") if algorithm == "auto" else algorithm
        if chosen not in (*_algorithms(), "native"):
            chosen = "ring"  # an algorithm the planner does not know is planned as ring
    except (ValueError, OSError) as e:
        raise typer.BadParameter(str(e)) from None
    if run_nodes != 1:
        raise typer.BadParameter(f"--from-run expects a one-node run, {path} ran on {run_nodes} nodes")
    base_cluster = dataclasses.replace(cluster, nodes=1, gpus_per_node=run_ranks)
    config = with_run_wait(config, summary, base_cluster)
    row = predict_step(config, cluster, chosen)
    base = predict_step(config, base_cluster, chosen)
    speedup = row.samples_per_s / (
        config.accumulate * config.batch_size * run_ranks / float(summary["step_time_s"])
    )
    result = {
        **row.as_dict(),
        "speedup": speedup,
        "speedup_vs_predicted_run": row.samples_per_s / base.samples_per_s if base.samples_per_s else 0.0,
        "measured_run_step_s": float(summary["step_time_s"]),
        "predicted_run_step_s": base.step_s,
        "from_run": str(path),
        "zero": config.zero,
        "cluster": cluster.as_dict(),
    }
    console.print(
        f"ringtree plan --from-run {path}: {config.params / 1e6:.1f}M params, compute "
        f"{config.compute_time_s:.4f} s "
        f"per micro-step (measured); on {_cluster_title(cluster)} with {chosen}: step {row.step_s:.4f} s, "
        f"speedup {speedup:.2f}x over the measured {run_ranks}-rank run",
        highlight=False,
    )
    if config.sync_wait_s > 0:
        console.print(
            f"the run waited {config.sync_wait_s * 1e3:.2f} ms per step beyond the all-reduce predicted "
            f"for its own {run_ranks} ranks (a straggler, ranks sharing cores): kept in the plan",
            highlight=False,
        )
    _explain(result, config, cluster, links.calibration)
    if json_path is not None:
        write_json(json_path, result)


def _algorithms() -> tuple[str, ...]:
    from ringtree.sim import ALGORITHMS

    return ALGORITHMS


def _transformer(
    model: str | None,
    dims: dict[str, Any],
    global_batch: int | None,
    micro_batch: int,
    layout: dict[str, Any],
    dtype: str,
    recompute: str | None,
    overlap: bool,
    bucket_mb: float,
    schedule: str,
    links: ClusterOptions,
    algorithm: str,
    search: bool,
    json_path: Path | None,
    legacy: dict[str, Any],
    moe: MoeOptions,
) -> None:
    """The transformer model: one layout, or --search over all that fit."""
    from ringtree.sim.layout import CP_COMMS, Training
    from ringtree.sim.predictor import default_algorithm, plan
    from ringtree.sim.search import search as search_layouts
    from ringtree.sim.search import why
    from ringtree.sim.transformer import RECOMPUTE, SEARCHED

    try:
        unused = [k for k, v in legacy.items() if v is not None]
        if unused:
            raise ValueError(
                f"{', '.join(unused)} do not apply to the transformer model: drop them, or pass "
                "--compute-time for the data-parallel planner"
            )
        shape = _shape(model, dims)
        if global_batch is None:
            raise ValueError("the transformer model needs --global-batch (sequences per optimizer step)")
        gpu, cluster = links.gpu(), links.cluster()
        chosen = default_algorithm(cluster) if algorithm == "auto" else algorithm
        if search:
            if layout["cp_comm"] not in CP_COMMS:
                raise ValueError(f"unknown --cp-comm {layout['cp_comm']!r}; choose {' or '.join(CP_COMMS)}")
            if recompute is not None and recompute not in RECOMPUTE:
                raise ValueError(f"unknown --recompute {recompute!r}; choose one of {', '.join(RECOMPUTE)}")
            modes = SEARCHED if recompute is None else (recompute,)
            found = search_layouts(
                shape,
                global_batch,
                cluster,
                gpu,
                dtype,
                modes,
                chosen,
                layout["grad_dtype"],
                layout["cp_comm"],
                moe.training(dtype),
            )
            rows = found.rows
            if not rows:
                raise ValueError(
                    f"no layout of this model fits {cluster.ranks} x {gpu.name}: add nodes or shrink "
                    "the model"
                )
        else:
            run = Training(
                global_batch, micro_batch, layout["tp"], layout["pp"], dtype, recompute or "none", overlap,
                bucket_mb, schedule, layout["cp"], layout["virtual_stages"], layout["sequence_parallel"],
                layout["zero"], layout["flash_attention"], layout["attention_kernel"], layout["elementwise"],
                layout["grad_dtype"], layout["cp_comm"], layout["shard_group"], layout["recompute_layers"],
                **moe.training(dtype),
            )  # fmt: skip
            rows = [plan(shape, run, cluster, gpu, chosen)]
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    print_transformer(rows, shape, cluster, gpu, search)
    searched = {}
    if search:
        searched = {
            "layouts_fit": found.fitted,
            "why": why(found),
            "configurations": [r.as_dict() for r in rows[:10]],
        }
        console.print(f"why: {searched['why']}", highlight=False)
    if json_path is not None:
        write_json(json_path, {**rows[0].as_dict(), **searched})


def _shape(model: str | None, dims: dict[str, Any]) -> Any:
    """A preset's shape with any of the named dimensions replacing its part."""
    from ringtree.sim.transformer import MODELS, Transformer, with_dims

    base = MODELS.get(model or "")
    if base is None and model not in (None, "transformer"):
        raise ValueError(f"unknown transformer {model!r}; choose transformer or one of {', '.join(MODELS)}")
    given = {k: v for k, v in dims.items() if v is not None}
    for name in ("kv_heads", "ffn_hidden"):
        if given.get(name, 1) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {given[name]}")
    if base is None:
        missing = [f"--{k}" for k in ("layers", "hidden", "heads", "seq", "vocab") if k not in given]
        if missing:
            raise ValueError(
                f"--model transformer needs {' '.join(missing)} (or a preset: {', '.join(MODELS)})"
            )
        return Transformer(**given)
    return with_dims(base, **given)
