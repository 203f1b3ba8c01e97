"""`ringtree plan`'s mixture-of-experts, expert-parallel, FP8 and GPU-count options, as one group.

`moe_options` adds them to the plan command's signature (typer reads `__signature__`) and hands the
command one `MoeOptions` as its `moe` argument: the model words (experts, top-k, MLA, sliding window),
the layout words (EP, ETP, dispatcher, imbalance, capacity, overlap, FP8 recipe) and `--gpus`, which
it turns into --nodes of the cluster's node (an NVL72 rack: one node of 72 GPUs, or of the largest
part of it that divides the count).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import typer

MODEL, LAYOUT, CLUSTER = "Model", "Layout", "Cluster"


@dataclass(frozen=True)
class MoeOptions:
    """The values of the options below, None where not given."""

    experts: int | None = None
    top_k: int | None = None
    moe_ffn_hidden: int | None = None
    shared_experts: int | None = None
    dense_layers: int | None = None
    moe_every: int | None = None
    attention: str | None = None
    head_dim: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_dim: int | None = None
    v_head_dim: int | None = None
    sliding_window: int | None = None
    ep: int | None = None
    etp: int | None = None
    moe_dispatcher: str | None = None
    expert_imbalance: float | None = None
    capacity_factor: float | None = None
    moe_overlap: bool | None = None
    fp8_recipe: str | None = None

    def model_dims(self) -> dict[str, Any]:
        """The model words given, as `Transformer` fields."""
        names = [f.name for f in dataclasses.fields(self)][:13]
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    def training(self, dtype: str) -> dict[str, Any]:
        """The layout words given, as `Training` fields; --fp8-recipe only with --dtype fp8."""
        if self.fp8_recipe is not None and dtype != "fp8":
            raise ValueError(f"--fp8-recipe {self.fp8_recipe} says how FP8 matmuls scale: add --dtype fp8")
        names = [f.name for f in dataclasses.fields(self)][13:]
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    def given(self) -> list[str]:
        """The options given, as flags."""
        return [
            f"--{f.name.replace('_', '-')}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        ]


def _option(kind: type, help_text: str, panel: str, *flags: str) -> tuple[type, Any]:
    return kind | None, typer.Option(None, *flags, help=help_text, rich_help_panel=panel)  # type: ignore[return-value]


OPTIONS: dict[str, tuple[type, Any]] = {
    "experts": _option(int, "MoE: routed experts per MoE layer (0: dense).", MODEL),
    "top_k": _option(int, "MoE: experts each token is routed to (default 1).", MODEL),
    "moe_ffn_hidden": _option(int, "MoE: each expert's width (default --ffn-hidden).", MODEL),
    "shared_experts": _option(int, "MoE: shared experts every token passes (DeepSeek-V3: 1).", MODEL),
    "dense_layers": _option(int, "MoE: the first N layers keep a dense MLP (DeepSeek-V3: 3).", MODEL),
    "moe_every": _option(
        int, "MoE: every K-th layer after them is an MoE layer (Llama 4 Maverick: 2).", MODEL
    ),
    "attention": _option(str, "Attention: gqa (default) or mla (multi-head latent attention).", MODEL),
    "head_dim": _option(int, "Attention head size (default --hidden / --heads; MLA: qk nope dim).", MODEL),
    "q_lora_rank": _option(int, "MLA: the query's low rank (0: full rank).", MODEL),
    "kv_lora_rank": _option(int, "MLA: the compressed key/value width.", MODEL),
    "qk_rope_dim": _option(int, "MLA: the rotary part of each query/key head.", MODEL),
    "v_head_dim": _option(int, "MLA: each value head's size (default --head-dim).", MODEL),
    "sliding_window": _option(int, "Every other layer attends to its last W keys (gpt-oss: 128).", MODEL),
    "ep": _option(int, "Expert-parallel degree, folded over TP x CP x DP.", LAYOUT),
    "etp": _option(int, "Expert tensor-parallel degree (default 1).", LAYOUT),
    "moe_dispatcher": _option(
        str,
        "MoE token dispatcher: alltoall (default), allgather or flex (DeepEP/HybridEP, priced as alltoall).",
        LAYOUT,
    ),
    "expert_imbalance": _option(
        float, "The busiest expert rank's tokens over the mean (default 1.0).", LAYOUT
    ),
    "capacity_factor": _option(
        float, "Tokens an expert takes over the mean, the rest dropped (dropless).", LAYOUT
    ),
    "moe_overlap": (
        bool | None,  # type: ignore[dict-item]
        typer.Option(
            None,
            "--moe-overlap/--no-moe-overlap",
            help="Dispatch and combine all-to-alls behind another micro-batch's compute (Megatron-Core's "
            "--overlap-moe-expert-parallel-comm, DeepSeek-V3's DualPipe); default: exposed.",
            rich_help_panel=LAYOUT,
        ),
    ),
    "fp8_recipe": _option(
        str,
        "With --dtype fp8: delayed (default), tensorwise, rowwise, blockwise or mxfp8 (Blackwell).",
        LAYOUT,
    ),
    "gpus": _option(int, "GPUs in all, instead of --nodes (whole nodes, or one NVL72 rack's part).", CLUSTER),
}


def moe_options(command: Callable[..., None]) -> Callable[..., None]:
    """The command with the options above added; it receives them as `moe` (and --gpus as nodes)."""
    signature = inspect.signature(command)
    kept = [p for p in signature.parameters.values() if p.name != "moe"]
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
        for name, (kind, option) in OPTIONS.items()
    ]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        gpus = kwargs.pop("gpus", None)
        moe = MoeOptions(**{name: kwargs.pop(name, None) for name in OPTIONS if name != "gpus"})
        if gpus is not None:
            kwargs["nodes"], kwargs["gpus_per_node"] = gpu_count(
                gpus, kwargs.get("nodes", 1), kwargs.get("gpus_per_node"), kwargs.get("cluster_name")
            )
        command(*args, moe=moe, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*kept, *added])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {**command.__annotations__, **{n: k for n, (k, _) in OPTIONS.items()}}
    return wrapper


def gpu_count(gpus: int, nodes: int, gpus_per_node: int | None, cluster: str | None) -> tuple[int, int]:
    """(nodes, GPUs per node) for --gpus: whole nodes of the cluster's size, or under one node (or a
    rack whose GPUs the count does not fill: 64 of an NVL72's 72) the largest divisor of the count
    that fits in one."""
    from ringtree.sim.network.clusters import CLUSTERS

    if nodes != 1:
        raise typer.BadParameter(f"--gpus {gpus} and --nodes {nodes} both size the cluster: pass one of them")
    if gpus < 1:
        raise typer.BadParameter(f"--gpus must be at least 1, got {gpus}")
    size = gpus_per_node or (CLUSTERS[cluster].gpus_per_node if cluster in CLUSTERS else 8)
    if gpus % size == 0:
        return gpus // size, size
    local = max(d for d in range(1, min(gpus, size) + 1) if gpus % d == 0)
    if gpus > size and local < size and size <= 8:
        raise typer.BadParameter(
            f"--gpus {gpus} is not a whole number of {size}-GPU nodes; choose a multiple of {size}"
        )
    return gpus // local, local
