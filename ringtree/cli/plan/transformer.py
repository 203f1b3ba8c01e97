"""`ringtree plan`'s transformer planner: its model and layout options, one layout or --search over
all that fit, and its output (the table, where the time goes, memory, the JSON and the picture).

The mixture-of-experts, FP8 and --gpus options join these from `ringtree.cli.plan.moe`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from ringtree.cli.output import console, print_table, write_json
from ringtree.cli.plan.cluster import ClusterOptions, cluster_title, refuse
from ringtree.cli.plan.lowcomm import SyncOptions, tf_sync_model, tf_sync_report
from ringtree.cli.plan.moe import MoeOptions

MODEL, LAYOUT = "Model", "Layout"

# The model: a preset or the transformer's shape.
MODEL_NAME = typer.Option(
    None,
    help="A model preset (vit-base, resnet50, gpt3-175b, llama-7b, ...) or 'transformer'.",
    rich_help_panel=MODEL,
)
LAYERS = typer.Option(None, help="Transformer model: layers.", rich_help_panel=MODEL)
HIDDEN = typer.Option(None, help="Transformer model: hidden size.", rich_help_panel=MODEL)
HEADS = typer.Option(None, help="Transformer model: attention heads.", rich_help_panel=MODEL)
SEQ = typer.Option(None, help="Transformer model: sequence length.", rich_help_panel=MODEL)
VOCAB = typer.Option(None, help="Transformer model: vocabulary size.", rich_help_panel=MODEL)
KV_HEADS = typer.Option(
    None, help="Key/value heads (grouped-query attention; default: --heads).", rich_help_panel=MODEL
)
FFN_HIDDEN = typer.Option(None, help="MLP width (default 4 x --hidden).", rich_help_panel=MODEL)
MLP = typer.Option(None, help="MLP: gelu (two h x F matrices) or swiglu (three).", rich_help_panel=MODEL)
DROPOUT = typer.Option(
    None,
    "--dropout/--no-dropout",
    help="Dropout masks stored for the backward (default: GPT shapes yes, as Megatron-LM's 0.1; "
    "the Llama 3 presets no).",
    rich_help_panel=MODEL,
)

# The layout: --pp, --schedule, --tp and --grad-dtype serve the data-parallel planner too.
PP = typer.Option(
    1, help="Pipeline stages: also predict a pipeline step (replayed schedule).", rich_help_panel=LAYOUT
)
SCHEDULE = typer.Option(
    "1f1b",
    help="Pipeline schedule for --pp: gpipe, 1f1b, pipedream, or the split backward's zb-h1, zb-h2, zb-v, "
    "dualpipev.",
    rich_help_panel=LAYOUT,
)
TP = typer.Option(
    1,
    help="Tensor-parallel degree: also predict a DP x TP step (transformers).",
    rich_help_panel=LAYOUT,
)
CP = typer.Option(
    1, help="Context-parallel degree: the sequence split over CP ranks.", rich_help_panel=LAYOUT
)
CP_COMM = typer.Option(
    "p2p",
    help="How CP ranks exchange K and V: p2p (a ring overlapped with the attention: Megatron-Core's "
    "default, Transformer Engine) or all-gather (gathered before the attention, exposed: Llama 3).",
    rich_help_panel=LAYOUT,
)
VIRTUAL_STAGES = typer.Option(
    1, help="Model chunks per pipeline rank (interleaved 1F1B).", rich_help_panel=LAYOUT
)
PP_LAYOUT = typer.Option(
    "",
    help="Which layers each of the PP x VP model chunks holds, in Megatron-Core's "
    "pipeline_model_parallel_layout syntax: E embedding, t layer, m MTP layer, L loss, | chunk end, "
    "x*k and (...)*k repeat (DeepSeek-V3 on PP 4 x VP 4: 'Et*4|(t*4|)*14tmL'). Priced by the "
    "heaviest chunk when interleaved.",
    rich_help_panel=LAYOUT,
)
FIRST_STAGE_LAYERS = typer.Option(
    0,
    help="Layers of the first pipeline stage, the other stages sharing the rest evenly (Megatron's "
    "--decoder-first-pipeline-num-layers). 0: an even split.",
    rich_help_panel=LAYOUT,
)
LAST_STAGE_LAYERS = typer.Option(
    0,
    help="Layers of the last pipeline stage, the other stages sharing the rest evenly (Megatron's "
    "--decoder-last-pipeline-num-layers). 0: an even split.",
    rich_help_panel=LAYOUT,
)
SEQUENCE_PARALLEL = typer.Option(
    False,
    "--sequence-parallel",
    help="Megatron's sequence parallelism over the TP group.",
    rich_help_panel=LAYOUT,
)
ZERO = typer.Option(
    0,
    help="ZeRO stage: 0 replicated, 1 optimizer, 2 + gradients, 3 + parameters sharded.",
    rich_help_panel=LAYOUT,
)
SHARD_GROUP = typer.Option(
    0,
    help="Data-parallel ranks that shard ZeRO's states, replicated across the rest: HSDP (FSDP's "
    "HYBRID_SHARD: one node's ranks). 0: all of them.",
    rich_help_panel=LAYOUT,
)
FLASH_ATTENTION = typer.Option(
    True,
    "--flash-attention/--no-flash-attention",
    help="Attention as flash attention (default) or unfused.",
    rich_help_panel=LAYOUT,
)
ATTENTION_KERNEL = typer.Option(
    "fused",
    help="Flash attention's kernel: fused (the GPU's own: cuDNN, Transformer Engine, FlashAttention-3 "
    "on Hopper) or flash2 (FlashAttention-2, as PyTorch's scaled_dot_product_attention runs it).",
    rich_help_panel=LAYOUT,
)
ELEMENTWISE = typer.Option(
    "fused",
    help="Norms, activation, rotary and residual adds: fused (torch.compile, Megatron-LM's fused "
    "kernels) or eager (one kernel per PyTorch op, as torchtitan's Llama runs without torch.compile).",
    rich_help_panel=LAYOUT,
)
GLOBAL_BATCH = typer.Option(
    None, help="Transformer model: sequences per optimizer step.", rich_help_panel=LAYOUT
)
MICRO_BATCH = typer.Option(
    None, help="Transformer model: sequences per micro-batch (1).", rich_help_panel=LAYOUT
)
DTYPE = typer.Option(
    "bf16",
    help="Transformer model: the matmuls' dtype, bf16, fp16 or fp8 (see --fp8-recipe); torch's names "
    "(bfloat16, float16) are accepted too.",
    rich_help_panel=LAYOUT,
)
GRAD_DTYPE = typer.Option(
    None,
    help="Gradient dtype, accumulated and reduced over DP: fp32, bf16 or fp16. Default fp32 (a "
    "transformer under --dtype fp16: fp16); bf16 runs reduce in fp32 in Megatron-LM, torchtitan, "
    "NeMo's distributed Adam and Llama 3 unless told otherwise.",
    rich_help_panel=LAYOUT,
)
RECOMPUTE = typer.Option(
    None,
    help="Transformer model: activation recompute none (default)|selective|full|op|dots (op: "
    "torchtitan's per-op selective AC, every second matmul and the elementwise ops rerun; dots: "
    "MaxText's save_dot_except_mlpwi, the MLP's input projections, the attention and the elementwise "
    "ops rerun).",
    rich_help_panel=LAYOUT,
)
RECOMPUTE_LAYERS = typer.Option(
    0,
    help="With --recompute full: only this many layers of each stage (of each chunk when "
    "interleaved) recompute, the rest keep their activations (Megatron's --recompute-method block "
    "--recompute-num-layers). 0: all.",
    rich_help_panel=LAYOUT,
)
SEARCH = typer.Option(
    False,
    help="Rank the layouts of the GPUs: every TP (within a node), PP, DP and micro-batch that fits in "
    "memory, by step time, with why each loses to the best; the model, --dtype and the cluster "
    "stay as given.",
    rich_help_panel=LAYOUT,
)


def refuse_for_search(
    chosen: dict[str, bool], flash_attention: bool, attention_kernel: str, elementwise: str
) -> None:
    """Exit 2 naming the layout options --search would override."""
    refuse([k for k, v in chosen.items() if v], "--search (it chooses them)")
    attention = {
        "--no-flash-attention": not flash_attention,
        "--attention-kernel": attention_kernel != "fused",
    }
    refuse([k for k, v in attention.items() if v], "--search (it prices the GPU's fused flash attention)")
    if elementwise != "fused":
        refuse(["--elementwise"], "--search (it prices fused elementwise kernels)")


def run(
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
    plot: Path | None = None,
    sync: SyncOptions = SyncOptions(),
) -> None:
    """The transformer model: one layout, or --search over all that fit; with --sync, the layout's
    step under each low-communication method."""
    from ringtree.sim.training.layout import CP_COMMS, Training
    from ringtree.sim.training.predictor import default_algorithm, plan
    from ringtree.sim.training.search import alike_words, why
    from ringtree.sim.training.search import search as search_layouts
    from ringtree.sim.training.transformer import RECOMPUTE, SEARCHED

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
        if sync.given():
            sync.check(
                cluster, tf_sync_model(shape, layout["tp"], layout["pp"], layout["cp"], layout["zero"])
            )
        chosen = default_algorithm(cluster) if algorithm == "auto" else algorithm
        if search and sync.given():
            raise ValueError(f"{', '.join(sync.given())} price one layout: drop --search, or them")
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
                pp_layout=layout["pp_layout"], first_stage_layers=layout["first_stage_layers"],
                last_stage_layers=layout["last_stage_layers"], **moe.training(dtype),
            )  # fmt: skip
            rows = [plan(shape, run, cluster, gpu, chosen)]
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    print_transformer(rows, shape, cluster, gpu, search)
    searched = tf_sync_report(sync, shape, run, cluster, gpu, chosen) if sync.given() else {}
    if search:
        searched = {
            "layouts_fit": found.fitted,
            "why": why(found),
            "configurations": [r.as_dict() for r in rows[:10]],
        }
        for i, row in enumerate(rows[:10], 1):
            if row.details.get("alike"):
                console.print(
                    f"row {i} also stands for: {alike_words(row)} (same step and memory)", highlight=False
                )
        console.print(f"why: {searched['why']}", highlight=False)
    console.print(f"planner: transformer ({transformer_model(rows[0])})", highlight=False)
    if json_path is not None:
        write_json(json_path, {**rows[0].as_dict(), "planner": "transformer", **searched})
    if plot is not None:
        from ringtree.plan_plot import draw

        draw(rows, shape, gpu, plot, search)
        console.print(f"wrote {plot}", highlight=False)


def transformer_model(row: Any) -> str:
    """What the transformer planner models, in words (where it differs from the data-parallel one)."""
    t = row.details["training"]
    when = "overlapped with the last backward" if t["overlap"] else "after the backward"
    return (
        f"compute from the model's FLOPs on the GPU, tp {row.tp} x cp {row.cp} x pp {row.pp} x dp "
        f"{row.dp}, the {t['grad_dtype']} gradients reduced {when}, ZeRO {row.zero}"
    )


def with_article(name: str) -> str:
    """'an A100-SXM4-80GB', 'a B200': the article as the name's first letter is spoken."""
    return f"{'an' if name[:1].lower() in 'aefhilmnorsx' else 'a'} {name}"


def _shape(model: str | None, dims: dict[str, Any]) -> Any:
    """A preset's shape with any of the named dimensions replacing its part."""
    from ringtree.sim.training.transformer import MODELS, Transformer, with_dims

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


def print_transformer(rows: list[Any], shape: Any, cluster: Any, gpu: Any, search: bool) -> None:
    """The transformer plan's table (the first ten under --search), where the time goes, and memory."""

    title = (
        f"ringtree plan: transformer {shape.params / 1e9:.2f}B params (l={shape.layers}, h={shape.hidden}, "
        f"a={shape.heads}, kv={shape.kv_heads}, F={shape.ffn_hidden} {shape.mlp}, s={shape.seq}, "
        f"V={shape.vocab}) "
        f"on {cluster_title(cluster)}, {gpu.name}"
    )
    print_table(
        title,
        ["tp", "cp", "pp", "schedule", "v", "dp", "ep", "etp", "zero", "sp", "mb", "recompute", "step (s)",
         "MFU", "tok/s/GPU", "TP comm", "CP comm", "EP comm",
         "PP bubble", "exposed DP", "memory (GiB)"],
        [
            [r.tp, r.cp, r.pp, r.details["training"]["schedule"] if r.pp > 1 else "-", r.virtual_stages,
             r.dp, r.ep, r.etp, r.zero,
             "yes" if r.sequence_parallel else "no",
             r.details["training"]["micro_batch"], r.details["training"]["recompute"], f"{r.step_s:.3f}",
             f"{r.mfu:.1%}", f"{r.tokens_per_s_per_gpu:,.0f}", f"{r.tp_comm_s:.3f}", f"{r.cp_comm_s:.3f}",
             f"{r.ep_comm_s:.3f}", f"{r.pp_bubble_s:.3f}",
             f"{r.exposed_dp_s:.3f}", f"{r.memory['total_GiB']:.1f}"]
            for r in rows[: 10 if search else 1]
        ],
    )  # fmt: skip
    best = rows[0]
    shares = ", ".join(
        f"{k.removesuffix('_s').replace('_', ' ')} {v / best.step_s:.0%}"
        for k, v in best.breakdown.items()
        if v
    )
    mem = best.memory
    fp8_note = "; MFU against the BF16 peak" if best.details["training"]["dtype"] == "fp8" else ""
    console.print(
        f"where the time goes: {shares}; {best.tflops_per_gpu:.0f} model TFLOP/s per GPU "
        f"({best.hardware_tflops_per_gpu:.0f} counting recompute{fp8_note}); fullest stage "
        f"{mem['fullest_stage']}: "
        "weights, "
        f"gradients and optimizer {mem['weights_grads_optimizer_GiB']:.1f} GiB + activations "
        f"{mem['activations_GiB']:.1f} GiB of {mem['capacity_GiB']:.0f}",
        highlight=False,
    )
    if best.tp_link == "inter":
        console.print(
            f"warning: the TP group of {best.tp} spans nodes of {cluster.gpus_per_node} GPUs: its "
            f"collectives on every layer pay the network ({best.tp_comm_s:.3f} s a step); keep --tp "
            "within a node",
            highlight=False,
        )
    if not mem["fits"]:
        console.print(
            f"warning: does not fit: pipeline stage {mem['fullest_stage']} needs {mem['total_GiB']:.1f} "
            f"GiB per GPU, {mem['overflow_GiB']:.1f} GiB more than the {mem['capacity_GiB']:.0f} GiB of "
            f"{with_article(gpu.name.upper())}; "
            "raise --tp, --pp or --cp, add --zero or --sequence-parallel, use --recompute full, or lower "
            "--micro-batch",
            highlight=False,
        )
