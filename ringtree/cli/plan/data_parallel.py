"""`ringtree plan`'s data-parallel planner: its options (a parameter count and a compute time, or a
module to count and time), the step per all-reduce algorithm with a recommendation and why, the
pipeline and DP x TP steps it adds, and its output (the table, the JSON, the speed-up picture)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import typer

from ringtree.cli.output import console, print_table, write_json
from ringtree.cli.plan.cluster import ClusterOptions, cluster_title
from ringtree.cli.plan.lowcomm import SyncOptions, dp_sync_model, dp_sync_report

DP = "Data-parallel planner"
_COUNT_UNITS = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}

PARAMS = typer.Option(None, help="Parameter count instead of a preset, e.g. 86M, 1.5B.", rich_help_panel=DP)
MODULE = typer.Option(None, help="pkg.mod:factory returning a torch.nn.Module to count.", rich_help_panel=DP)
COMPUTE_TIME = typer.Option(
    None, help="Seconds of forward+backward per step on one device.", rich_help_panel=DP
)
MEASURE = typer.Option(
    False, help="Time the --module here instead (needs --input-shape).", rich_help_panel=DP
)
INPUT_SHAPE = typer.Option(None, help="Input shape for --measure, e.g. 32,3,224,224.", rich_help_panel=DP)
OVERLAP = typer.Option(
    False, "--overlap/--no-overlap", help="Overlap all-reduce with backward.", rich_help_panel=DP
)
BUCKET_MB = typer.Option(25.0, help="Fusion bucket size in MiB.", rich_help_panel=DP)
COMPRESSION = typer.Option(None, help="All-reduce gradients as fp16 or bf16.", rich_help_panel=DP)
ACCUMULATE = typer.Option(1, help="Micro-steps of gradient accumulation per all-reduce.", rich_help_panel=DP)
BATCH_SIZE = typer.Option(32, help="Samples per device per micro-step (for samples/s).", rich_help_panel=DP)
MICRO_BATCHES = typer.Option(4, help="Micro-batches per pipeline step (with --pp).", rich_help_panel=DP)
ACTIVATION_MB = typer.Option(
    0.0, help="MB of one micro-batch's activation between stages.", rich_help_panel=DP
)
SHAPE = typer.Option(
    None,
    help="With --tp: LAYERS,HIDDEN,SEQ of the transformer (presets know theirs), e.g. 96,12288,2048.",
    rich_help_panel=DP,
)


def run(
    model: str | None,
    params: str | None,
    module: str | None,
    compute_time: float | None,
    measure: bool,
    input_shape: str | None,
    grad_dtype: str | None,
    compression: str | None,
    overlap: bool,
    bucket_mb: float,
    accumulate: int,
    batch_size: int,
    pp: int,
    micro_batches: int,
    schedule: str,
    activation_mb: float,
    tp: int,
    shape: str | None,
    links: ClusterOptions,
    algorithm: str,
    json_path: Path | None,
    plot: Path | None,
    sync: SyncOptions = SyncOptions(),
) -> None:
    """The data-parallel plan of one model on the cluster, with --pp's and --tp's steps beside it,
    and with --sync the low-communication methods priced on the same step."""
    from ringtree.sim import ALGORITHMS
    from ringtree.sim.training.plan import StepConfig

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
        if sync.given():
            sync.check(cluster, dp_sync_model(config, model, shape, module=module))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    result = _plan(config, cluster, algorithm)
    _print(result, config, cluster)
    console.print(f"planner: {result['planner']} ({data_parallel_model(config)})", highlight=False)
    explain_plan(result, config, cluster, links.calibration)
    if pp > 1:
        result["pipeline"] = _pipeline(pp, micro_batches, schedule, seconds, cluster, activation_mb)
    if tp > 1:
        result["tensor_parallel"] = _tensor_parallel(config, cluster, tp, model, shape, result["algorithm"])
    if sync.given():
        result |= dp_sync_report(sync, config, links, result["algorithm"], model, shape, module)
    if json_path is not None:
        write_json(json_path, result)
    if plot is not None:
        drawn = list(dict.fromkeys(["ring", result["recommended_algorithm"], result["algorithm"]]))
        plot_speedup(config, cluster, drawn, plot, f"{count / 1e6:.0f}M params, {result['cluster_title']}")


def _plan(config: Any, cluster: Any, algorithm: str) -> dict[str, Any]:
    """Every algorithm's prediction, the chosen one's headline numbers, and the recommendation."""
    from ringtree.sim import ALGORITHMS
    from ringtree.sim.training.plan import predict_step, recommend, speedup_vs_one_node

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
        "planner": "data-parallel",
        "recommended_algorithm": best,
        "reason": reason,
        "grad_bytes": config.grad_bytes,
        "config": dataclasses.asdict(config),
        "cluster": cluster.as_dict(),
        "cluster_title": cluster_title(cluster),
        "algorithms": rows,
    }


def data_parallel_model(config: Any) -> str:
    """What the data-parallel planner models, in words (where it differs from the transformer one)."""
    when = "overlapped with the backward" if config.overlap else "after the backward"
    return (
        f"the whole model on every GPU, the typed compute time, {config.params / 1e6:,.0f}M gradients "
        f"in {config.grad_dtype if config.compression is None else config.compression} all-reduced {when}, "
        "no ZeRO, pipeline or TP in the step (--pp, --tp: priced beside it); the transformer planner "
        "(--global-batch) models the layout"
    )


def _pipeline(pp: int, m: int, schedule: str, seconds: float, cluster: Any, activation_mb: float) -> Any:
    """The pipeline step replayed over the link of its slowest stage boundary, as the ranks are placed."""
    from ringtree.schedules.pipeline import check_pipeline
    from ringtree.sim.training.plan import predict_pipeline

    try:
        check_pipeline(pp, m, schedule, "params")
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    link = _stage_link(cluster, pp)
    out = predict_pipeline(schedule, pp, m, seconds, link, int(activation_mb * 1e6))
    from ringtree.schedules.pipeline import ZERO_BUBBLE
    from ringtree.sim.training.pipeline import FORMULAS

    theory = (
        f"{FORMULAS[schedule]} with W a third of the backward" if schedule in ZERO_BUBBLE else "(p-1)/(m+p-1)"
    )
    console.print(
        f"pipeline: {schedule}, pp={pp}, m={m}: step {out['pipeline_step_time_s']:.4f} s, bubble "
        f"{out['bubble_fraction']:.1%} (theory {theory} = {out['theoretical_bubble_fraction']:.1%})",
        highlight=False,
    )
    return out


def _stage_link(cluster: Any, pp: int) -> Any:
    """The slowest boundary's link with the cluster's ranks split into pp stages (pp outermost), or
    one pipeline's p ranks placed alone when pp does not divide them."""
    from ringtree.ranks import Placement
    from ringtree.sim.training.plan import placed_stage_link

    ranks = cluster.ranks if cluster.ranks % pp == 0 else pp
    alone = dataclasses.replace(cluster, nodes=-(-ranks // cluster.gpus_per_node)) if ranks == pp else cluster
    return placed_stage_link(alone, Placement(dp=ranks // pp, pp=pp, gpus_per_node=alone.gpus_per_node))


def _tensor_parallel(
    config: Any, cluster: Any, tp: int, model: str | None, shape: str | None, algorithm: str
) -> dict[str, Any]:
    """The DP x TP step with the TP group inside a node (as the Mesh places it) and spread across nodes."""
    from ringtree.sim.training.plan import DTYPE_BYTES
    from ringtree.sim.training.tensor_parallel import SHAPES, TPShape, predict_tp_step

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


def _print(result: dict[str, Any], config: Any, cluster: Any) -> None:
    """The table of algorithms, the bottleneck (in the JSON under `explain`) and the recommendation."""
    from ringtree.sim.training.plan import bottleneck

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
    from ringtree.cli.plan.presets import param_count, preset_names, resolve

    given = [x for x in (model, params, module) if x is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of --model ({', '.join(preset_names())}), --params or --module")
    if model is not None:
        name = resolve(model)
        if name == "transformer":
            raise ValueError("--model transformer needs --global-batch and its shape, not --compute-time")
        return param_count(name)
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


def explain_plan(result: dict[str, Any], config: Any, cluster: Any, calibration: Path | None) -> None:
    """Why: the bound per link level, the bottleneck, the network for 90% efficiency, an error bar;
    with the seed's own arithmetic beside the plan's."""
    from ringtree.sim.training.explain import explain, seed_derivation

    why = explain(config, cluster, result["algorithm"], calibration)
    # The seed's arithmetic is a flat ring through one NIC per node: shown where the plan is that.
    flat_ring = result["algorithm"] in ("ring", "native") and cluster.nics_per_node == 1
    shown = cluster.nodes > 1 and flat_ring
    derivation = seed_derivation(config, cluster, result["algorithm"]) if shown else []
    for line in [*why["lines"], *derivation]:
        console.print(line, highlight=False)
    result["explain"] = {k: v for k, v in why.items() if k != "lines"} | {"lines": why["lines"] + derivation}


def plot_speedup(config: Any, cluster: Any, algorithms: list[str], path: Path, title: str) -> None:
    """PNG of the predicted speedup from 1 to the cluster's nodes, one curve per algorithm."""
    from ringtree.plots import plot_scaling
    from ringtree.sim.training.plan import speedup_vs_one_node

    nodes = cluster.nodes
    counts = [1 << i for i in range(nodes.bit_length()) if 1 << i < nodes] + [nodes]
    curves = {a: [speedup_vs_one_node(config, cluster.with_nodes(n), a) for n in counts] for a in algorithms}
    plot_scaling(counts, curves, path, title)
    console.print(f"wrote {path}", highlight=False)


def known_algorithms() -> tuple[str, ...]:
    from ringtree.sim import ALGORITHMS

    return ALGORITHMS
