"""`ringtree plan`: predicted training step time per all-reduce algorithm, and a recommendation."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import typer

from ringtree.cli.app import app
from ringtree.cli.output import console, print_table, write_json

_COUNT_UNITS = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}


@app.command()
def plan(
    model: str | None = typer.Option(None, help="A model preset: vit-base, resnet50, gpt2-xl, llama-7b, ..."),
    params: str | None = typer.Option(None, help="Parameter count instead of a preset, e.g. 86M, 1.5B."),
    module: str | None = typer.Option(None, help="pkg.mod:factory returning a torch.nn.Module to count."),
    grad_dtype: str = typer.Option("fp32", help="Gradient dtype: fp32, fp16 or bf16."),
    compute_time: float | None = typer.Option(
        None, help="Seconds of forward+backward per step on one device."
    ),
    measure: bool = typer.Option(False, help="Time the --module here instead (needs --input-shape)."),
    input_shape: str | None = typer.Option(None, help="Input shape for --measure, e.g. 32,3,224,224."),
    nodes: int = typer.Option(1, help="Nodes."),
    gpus_per_node: int = typer.Option(8, help="Devices per node."),
    intra: str | None = typer.Option(None, help="Intra-node link: a preset, FILE.json or 'bw=..,lat=..'."),
    inter: str | None = typer.Option(None, help="Inter-node link: a preset, FILE.json or 'bw=..,lat=..'."),
    nics_per_node: int = typer.Option(1, help="NICs per node."),
    calibration: Path | None = typer.Option(None, help="A `ringtree calibrate` file for unnamed links."),
    algorithm: str = typer.Option("auto", help="The algorithm to report, or auto (the fastest)."),
    overlap: bool = typer.Option(False, "--overlap/--no-overlap", help="Overlap all-reduce with backward."),
    bucket_mb: float = typer.Option(25.0, help="Fusion bucket size in MiB."),
    compression: str | None = typer.Option(None, help="All-reduce gradients as fp16 or bf16."),
    accumulate: int = typer.Option(1, help="Micro-steps of gradient accumulation per all-reduce."),
    batch_size: int = typer.Option(32, help="Samples per device per micro-step (for samples/s)."),
    pp: int = typer.Option(1, help="Pipeline stages: also predict a pipeline step (replayed schedule)."),
    micro_batches: int = typer.Option(4, help="Micro-batches per pipeline step (with --pp)."),
    schedule: str = typer.Option("1f1b", help="Pipeline schedule for --pp: gpipe, 1f1b, pipedream."),
    activation_mb: float = typer.Option(0.0, help="MB of one micro-batch's activation between stages."),
    tp: int = typer.Option(1, help="Tensor-parallel degree: also predict a DP x TP step (transformers)."),
    shape: str | None = typer.Option(
        None,
        help="With --tp: LAYERS,HIDDEN,SEQ of the transformer (presets know theirs), e.g. 96,12288,2048.",
    ),
    json_path: Path | None = typer.Option(None, "--json", help="Write the plan as JSON here."),
    plot: Path | None = typer.Option(None, help="PNG of the speedup from 1 to --nodes nodes."),
) -> None:
    """Predict the step time of data-parallel training on a cluster, per algorithm, and recommend one."""
    from ringtree.sim import ALGORITHMS, make_cluster
    from ringtree.sim.plan import StepConfig

    try:
        count = _param_count(model, params, module)
        seconds = _compute_time(compute_time, measure, module, input_shape)
        cluster = make_cluster(nodes, gpus_per_node, intra, inter, calibration, nics_per_node)
        config = StepConfig(
            count, seconds, grad_dtype, compression, overlap, bucket_mb, accumulate, batch_size
        )
        if algorithm not in ("auto", *ALGORITHMS, "native"):
            raise ValueError(
                f"unknown algorithm {algorithm!r}; choose auto or one of {', '.join(ALGORITHMS)}"
            )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    result = _plan(config, cluster, algorithm)
    _print(result)
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


def _plan(config: Any, cluster: Any, algorithm: str) -> dict[str, Any]:
    """Every algorithm's prediction, the chosen one's headline numbers, and the recommendation."""
    from ringtree.sim import ALGORITHMS
    from ringtree.sim.plan import bottleneck, predict_step, recommend, speedup_vs_one_node

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
    level, share = bottleneck(config, cluster, chosen)
    return {
        **head,
        "recommended_algorithm": best,
        "reason": reason,
        "bottleneck": level,
        "bottleneck_share": share,
        "params": config.params,
        "grad_bytes": config.grad_bytes,
        "config": dataclasses.asdict(config),
        "cluster": cluster.as_dict(),
        "cluster_title": _cluster_title(cluster),
        "algorithms": rows,
    }


def _pipeline(pp: int, m: int, schedule: str, seconds: float, cluster: Any, activation_mb: float) -> Any:
    """The pipeline step replayed over the intra-node link (the inter-node one when pp spans nodes)."""
    from ringtree.schedules.pipeline import check_pipeline
    from ringtree.sim.pipeline import predict_pipeline

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
                f"tensor parallel tp={tp}, {where} ({row['tp_link']}): step {row['step_time_s']:.4f} s, TP "
                f"all-reduces {row['tp_comm_s']:.4f} s, {row['samples_per_s']:.1f} samples/s",
                highlight=False,
            )
    return {"inside_node": inside, "across_nodes": across}


def _cluster_title(cluster: Any) -> str:
    return f"{cluster.nodes} x {cluster.gpus_per_node}, {cluster.intra.name} / {cluster.inter.name}"


def _print(result: dict[str, Any]) -> None:
    print_table(
        f"ringtree plan: {result['params'] / 1e6:.1f}M params, {result['grad_bytes'] / 1e6:.0f} MB of "
        f"gradients, {result['cluster_title']}",
        ["algorithm", "all-reduce (s)", "step (s)", "samples/s", "speedup vs 1 node", "efficiency"],
        [
            [
                r["algorithm"],
                f"{r['allreduce_time_s']:.4f}",
                f"{r['step_time_s']:.4f}",
                f"{r['samples_per_s']:.1f}",
                f"{r['speedup_vs_one_node']:.2f}x",
                f"{r['scaling_efficiency']:.0%}",
            ]
            for r in result["algorithms"]
        ],
    )
    console.print(f"bottleneck: {result['bottleneck']} ({result['bottleneck_share']:.0%})", highlight=False)
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
