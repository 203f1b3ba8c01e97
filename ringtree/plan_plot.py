"""The transformer planner's picture: one step per pipeline stage beside each stage's memory.

`step_segments` splits a predicted step (ringtree.sim.training.predictor.plan) into what every pipeline stage
spends it on: its forward, backward and recompute, the communication the step's `breakdown` leaves
on the critical path (TP, CP, EP, ZeRO gathers, the exposed data-parallel reduction), the optimizer,
and the bubble, the rest of the step. The slowest stage's parts are the JSON's `breakdown` (its
forward, backward and recompute adding up to `compute_s`); a faster stage waits the difference in
its bubble, so every stage's parts add up to `step_s`. `memory_segments` splits each stage's
`memory.stages` row into weights, gradients, optimizer states and activations. `draw_plan` draws
both for one layout, `draw_search` the top layouts side by side; each returns the segments drawn.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringtree.sim.network.clusters import GPU
from ringtree.sim.training.layout import Training
from ringtree.sim.training.memory import GRAD_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES, GiB
from ringtree.sim.training.plan import StepPrediction
from ringtree.sim.training.predictor import work
from ringtree.sim.training.transformer import Transformer

# The parts of a step, in the order drawn, with their colours; a breakdown key not named here (a
# part the planner learns later) is drawn under its own name in grey.
STEP_PARTS = {
    "forward": ("forward", "#4c72b0"),
    "backward": ("backward", "#55a868"),
    "recompute": ("recompute", "#8fd19e"),
    "tp_comm_s": ("TP comm", "#dd8452"),
    "cp_comm_s": ("CP comm", "#c44e52"),
    "ep_comm_s": ("EP comm", "#da8bc3"),
    "exposed_zero_gather_s": ("ZeRO gathers", "#937860"),
    "pp_bubble_s": ("bubble", "#dddddd"),
    "exposed_dp_s": ("DP comm (exposed)", "#8172b3"),
    "optimizer_s": ("optimizer", "#ccb974"),
    "sync_wait_s": ("wait", "#64b5cd"),
}
MEMORY_PARTS = {
    "weights": "#4c72b0",
    "gradients": "#55a868",
    "optimizer": "#ccb974",
    "activations": "#dd8452",
}


@dataclass(frozen=True)
class Segment:
    """One drawn bar piece: a part of a stage's step (seconds) or of its memory (GiB)."""

    stage: int
    part: str
    start: float
    size: float


def step_segments(row: StepPrediction, model: Transformer, run: Training, gpu: GPU) -> list[Segment]:
    """Every pipeline stage's step, part by part (zero parts left out); each stage adds up to step_s."""
    base = work(model, run, gpu, row.dp)
    kept = work(model, dataclasses.replace(run, recompute="none", recompute_layers=0), gpu, row.dp)
    m = base.micro_batches
    forwards = base.stage_forward_s or (base.forward_s,)
    backwards = base.stage_backward_s or (base.backward_s,)
    plain = kept.stage_backward_s or (kept.backward_s,)
    pace = row.breakdown["compute_s"]  # the slowest stage's, which sets the step
    out = []
    for j, (f, b, b0) in enumerate(zip(forwards, backwards, plain, strict=True)):
        parts = {"forward": m * f, "backward": m * b0, "recompute": m * (b - b0)}
        for key, value in row.breakdown.items():
            if key == "compute_s":
                continue
            parts[key] = value + (pace - m * (f + b) if key == "pp_bubble_s" else 0.0)
        order = [*STEP_PARTS, *(k for k in parts if k not in STEP_PARTS)]
        out += _stack(j, [(k, parts[k]) for k in order if parts.get(k, 0.0) > 0])
    return out


def memory_segments(row: StepPrediction, model: Transformer, run: Training) -> list[Segment]:
    """Every stage's GiB per GPU: weights, gradients, optimizer states, activations."""
    assert row.memory is not None  # the transformer planner's rows carry it
    z, shard = run.zero, run.shards(row.dp)
    w = WEIGHT_BYTES / (shard if z >= 3 else 1)
    g = (GRAD_BYTES if z >= 3 else run.grad_itemsize) / (shard if z >= 2 else 1)
    o = OPTIMIZER_BYTES / (shard if z >= 1 else 1)
    gathered = 2 * WEIGHT_BYTES * model.layer_params / run.tp / GiB if z >= 3 else 0.0  # whole layers
    out = []
    for s in row.memory["stages"]:
        states = s["weights_grads_optimizer_GiB"] - gathered
        parts = {
            "weights": states * w / (w + g + o) + gathered,
            "gradients": states * g / (w + g + o),
            "optimizer": states * o / (w + g + o),
            "activations": s["activations_GiB"],
        }
        out += _stack(s["stage"], list(parts.items()))
    return out


def _stack(stage: int, parts: list[tuple[str, float]]) -> list[Segment]:
    out, start = [], 0.0
    for part, size in parts:
        out.append(Segment(stage, part, start, size))
        start += size
    return out


def draw_plan(
    row: StepPrediction, model: Transformer, run: Training, gpu: GPU, path: Path, title: str
) -> tuple[list[Segment], list[Segment]]:
    """PNG of one layout: its step per pipeline stage (left) and each stage's memory (right)."""
    steps, memory = step_segments(row, model, run, gpu), memory_segments(row, model, run)
    left, right = _figure(row.pp)
    _bars(left, steps, lambda s: s.stage, row.pp)
    _bars(right, memory, lambda s: s.stage, row.pp)
    for ax in (left, right):
        ax.set_yticks(range(row.pp), [f"stage {j}" for j in range(row.pp)])
    _finish(left, right, row, gpu, f"one step, {row.micro_batches} micro-batches per pipeline")
    left.figure.suptitle(title, fontsize=9)
    _save(left.figure, path)
    return steps, memory


def draw_search(
    rows: list[tuple[StepPrediction, Training]], model: Transformer, gpu: GPU, path: Path, title: str
) -> tuple[list[Segment], list[Segment]]:
    """PNG of the top layouts: each one's slowest stage's step and fullest stage's memory, side by side.

    A segment's `stage` is the layout's rank in `rows`."""
    steps: list[Segment] = []
    memory: list[Segment] = []
    for i, (row, run) in enumerate(rows):
        slowest = _slowest(step_segments(row, model, run, gpu))
        fullest = row.memory["fullest_stage"] if row.memory else 0
        steps += [dataclasses.replace(s, stage=i) for s in slowest]
        full = [s for s in memory_segments(row, model, run) if s.stage == fullest]
        memory += [dataclasses.replace(s, stage=i) for s in full]
    left, right = _figure(len(rows))
    _bars(left, steps, lambda s: s.stage, len(rows))
    _bars(right, memory, lambda s: s.stage, len(rows))
    names = [_layout_name(r) for r, _ in rows]
    for ax in (left, right):
        ax.set_yticks(range(len(rows)), names, fontsize=8)
    _finish(left, right, rows[0][0], gpu, "one step of the slowest stage (fullest stage's memory)")
    left.figure.suptitle(title, fontsize=9)
    _save(left.figure, path)
    return steps, memory


def _slowest(segments: list[Segment]) -> list[Segment]:
    """The stage with the least bubble: the one whose compute sets the step (the breakdown's)."""
    bubble = {s.stage: 0.0 for s in segments}
    for s in segments:
        bubble[s.stage] += s.size if s.part == "pp_bubble_s" else 0.0
    j = min(bubble, key=lambda k: (bubble[k], k))
    return [s for s in segments if s.stage == j]


def _layout_name(row: StepPrediction) -> str:
    return f"tp{row.tp} cp{row.cp} pp{row.pp} dp{row.dp} z{row.zero}"


def _figure(bars: int) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, axes = plt.subplots(1, 2, figsize=(13, 2.4 + 0.45 * bars), gridspec_kw={"width_ratios": [3, 2]})
    return axes[0], axes[1]


def _bars(ax: Any, segments: list[Segment], y: Any, count: int) -> None:
    labelled: set[str] = set()
    for s in segments:
        name, colour = STEP_PARTS.get(s.part, (s.part, MEMORY_PARTS.get(s.part, "#999999")))
        label = None if name in labelled else name
        labelled.add(name)
        ax.barh(y(s), s.size, left=s.start, height=0.7, color=colour, label=label, edgecolor="white")
    ax.set_ylim(count - 0.5, -0.5)


def _finish(left: Any, right: Any, row: StepPrediction, gpu: GPU, what: str) -> None:
    left.axvline(row.step_s, color="black", lw=0.8, ls="--")
    left.set_xlabel(f"seconds ({what}; step {row.step_s:.3f} s)")
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=6, frameon=False)
    capacity = row.memory["capacity_GiB"] if row.memory else gpu.memory_GB * GiB / GiB
    right.axvline(capacity, color="red", lw=1.0, label=f"{gpu.name} capacity")
    right.set_xlabel("GiB per GPU")
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, frameon=False)


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw(rows: list[StepPrediction], model: Transformer, gpu: GPU, path: Path, search: bool) -> None:
    """`ringtree plan --plot`: one layout's picture, or with --search the top five side by side."""
    runs = [(r, Training(**r.details["training"])) for r in rows[: 5 if search else 1]]
    head = runs[0][0]
    title = (
        f"{model.params / 1e9:.1f}B params on {head.ranks} x {gpu.name}: "
        + ("the top layouts" if search else _layout_name(head))
        + f"; step {head.step_s:.3f} s"
        + (f", MFU {head.mfu:.1%}" if head.mfu else "")
    )
    if search:
        draw_search(runs, model, gpu, path, title)
    else:
        draw_plan(head, model, runs[0][1], gpu, path, title)
