"""`plan --search`: every layout of a model on a cluster that fits in memory, fastest first.

The space is TP (powers of two up to two nodes' GPUs, dividing the heads: a TP group across two
nodes, as Megatron-LM's figure 13 ran TP 16 on 8-GPU nodes, is priced on the NICs it spans) x CP
(1, 2, 4, 8, dividing s / 2) x PP (dividing the layers) x DP (the rest) x virtual stages (1, 2, 4)
x the schedule (1F1B; with one chunk a stage also ZB-H1, ZB-H2, ZB-V and DualPipeV) x ZeRO (0-3)
x sequence parallelism x micro-batch (1, 2, 4, 8) x recompute; for an MoE model x EP
(powers of two dividing the experts and the stage's TP x CP x DP ranks) x ETP (1, or the TP degree),
and under FP8 the recipes the GPU runs, each unless the command pins it. A first pass prices
every layout with the pipeline's closed-form bound (`fast`); the REPLAYED fastest, and the
PER_DEPTH fastest of every pipeline depth (with its TP and CP), are priced again with the replayed
pipeline (under FP8 in every recipe: a recipe changes the matmuls, not the layout's memory) and
ranked by that. Sequence parallelism is always on with TP (the same
traffic as the all-reduces, less memory and elementwise time), and each layout takes the lowest
ZeRO stage that fits.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from ringtree.schedules.pipeline import MIN_MICRO_BATCHES_PER_STAGE, V_SHAPED, ZERO_BUBBLE
from ringtree.sim.network.clusters import GPU
from ringtree.sim.network.hardware import Cluster
from ringtree.sim.training import fp8
from ringtree.sim.training.layout import Training, check
from ringtree.sim.training.memory import fits
from ringtree.sim.training.plan import StepPrediction, StepWork, placed_stage_link, placement, predict
from ringtree.sim.training.predictor import default_algorithm, plan, work
from ringtree.sim.training.transformer import SEARCHED, Transformer

REPLAYED = 30  # layouts re-priced with the replayed pipeline after the closed-form pass
PER_DEPTH = 4  # and at least this many of each pipeline depth (with its TP and CP degrees)
MICRO_BATCHES = (1, 2, 4, 8)
VIRTUAL = (1, 2, 4)
TP_NODES = 2  # the widest TP group tried, in nodes (our choice: beyond two, TP traffic on the NICs loses)


def _degrees(model: Transformer, cluster: Cluster) -> Iterator[tuple[int, int, int]]:
    """(tp, cp, pp) that divide what they split and the GPU count."""
    n, g = cluster.ranks, cluster.gpus_per_node
    widest = g * min(TP_NODES, cluster.nodes)
    tps = [
        t for t in (1, 2, 4, 8, 16, 32) if t <= widest and (g % t == 0 or t % g == 0) and model.heads % t == 0
    ]
    cps = [c for c in (1, 2, 4, 8) if c == 1 or model.seq % (2 * c) == 0]
    pps = [p for p in range(1, model.layers + 1) if model.layers % p == 0]
    for t, c, p in itertools.product(tps, cps, pps):
        if n % (t * c * p) == 0 and model.ffn_hidden % t == 0:
            yield t, c, p


def candidates(
    model: Transformer,
    global_batch: int,
    cluster: Cluster,
    dtype: str,
    recompute: tuple[str, ...],
    grad_dtype: str | None = None,
    cp_comm: str = "p2p",
    extra: dict[str, object] | None = None,
    gpu: GPU | None = None,
) -> Iterator[list[Training]]:
    """Every layout the model and the GPU count allow, memory not yet checked, in groups that differ
    only in the ZeRO stage (0 to 3: each slower or as fast, and smaller). `extra`: the MoE and FP8
    words the command pins (the others are searched)."""
    extra = extra or {}
    for t, c, p in _degrees(model, cluster):
        dp = cluster.ranks // (t * c * p)
        sp = t > 1  # the all-reduce's traffic, less memory and elementwise time: always taken
        for v, b, r, words in itertools.product(
            VIRTUAL, MICRO_BATCHES, recompute, _expert_words(model, t, dp * c * t, dtype, extra, gpu)
        ):
            chunks = p * v  # as `check`: the layers, or the layers + 2 (the embedding and loss as chunks)
            if global_batch % (dp * b) or (
                v > 1 and (p == 1 or (model.layers % chunks and (model.layers + 2) % chunks))
            ):
                continue
            if v > 1 and (global_batch // (dp * b)) % p:
                continue
            stages = (0, 1, 2, 3) if dp * c > 1 else (0,)  # nothing to shard over a single rank
            for schedule in _schedules(model, p, v, global_batch // (dp * b)):
                yield [
                    Training(
                        global_batch,
                        b,
                        t,
                        p,
                        dtype,
                        r,
                        True,
                        25.0,
                        schedule,
                        c,
                        v,
                        sp,
                        z,
                        grad_dtype=grad_dtype,
                        cp_comm=cp_comm if c > 1 else "p2p",
                        **words,  # type: ignore[arg-type]
                    )
                    for z in stages
                ]


def _schedules(model: Transformer, p: int, v: int, m: int) -> list[str]:
    """1F1B, and with one chunk a stage the zero-bubble schedules whose micro-batches and layers suffice."""
    if p == 1 or v > 1:
        return ["1f1b"]
    chunks = {name: 2 * p if name in V_SHAPED else p for name in ZERO_BUBBLE}
    least = {name: MIN_MICRO_BATCHES_PER_STAGE[name] * p for name in ZERO_BUBBLE}
    return ["1f1b", *(n for n in ZERO_BUBBLE if m >= least[n] and model.layers >= chunks[n])]


def _expert_words(
    model: Transformer, t: int, folded: int, dtype: str, extra: dict[str, object], gpu: GPU | None
) -> list[dict[str, object]]:
    """The EP, ETP and FP8 recipe choices for one TP degree and stage size, with the pinned words."""
    eps = [int(str(extra["ep"]))] if "ep" in extra else [1]
    etps = [int(str(extra["etp"]))] if "etp" in extra else [1]
    if model.experts and "ep" not in extra:
        eps = [e for e in (1, 2, 4, 8, 16, 32, 64, 128, 256) if model.experts % e == 0 and folded % e == 0]
    if model.experts and "etp" not in extra and t > 1:
        etps = [1, t] if model.moe_ffn_hidden % t == 0 else [1]
    rest = {k: v for k, v in extra.items() if k not in ("ep", "etp")}
    return [{**rest, "ep": e, "etp": x} for e, x in itertools.product(eps, etps) if folded % (e * x) == 0]


def _recipes(run: Training, extra: dict[str, object], gpu: GPU) -> list[Training]:
    """The run under every FP8 recipe the GPU runs, unless the command pinned one (or trains in BF16)."""
    if run.dtype != "fp8" or "fp8_recipe" in extra:
        return [run]
    blackwell = gpu.arch == "blackwell"
    return [dataclasses.replace(run, fp8_recipe=r) for r in fp8.RECIPES if r != "mxfp8" or blackwell]


@dataclass(frozen=True)
class Found:
    """The search's answer: the fastest layouts (replayed), fastest first, and how many fit."""

    rows: list[StepPrediction]
    fitted: int


def search(
    model: Transformer,
    global_batch: int,
    cluster: Cluster,
    gpu: GPU,
    dtype: str = "bf16",
    recompute: tuple[str, ...] = SEARCHED,
    algorithm: str = "auto",
    grad_dtype: str | None = None,
    cp_comm: str = "p2p",
    extra: dict[str, object] | None = None,
) -> Found:
    """The fastest layouts that fit in memory, each with the least ZeRO sharding it needs
    (gradient reduction overlapped, as today's runs do); "auto" prices as `ringtree plan` does."""
    algorithm = default_algorithm(cluster) if algorithm == "auto" else algorithm
    rough = []
    fp8.check(dtype, str((extra or {}).get("fp8_recipe", "delayed")), gpu)
    for group in candidates(model, global_batch, cluster, dtype, recompute, grad_dtype, cp_comm, extra, gpu):
        dp = check(model, group[0], cluster.ranks)
        m = group[0].micro_batches(dp)
        run = next((r for r in group if fits(model, r, m, dp, gpu)), None)
        if run is not None:
            w = work(model, run, gpu, dp)
            step = predict(w, cluster, algorithm, run.layout, fast=True).step_s
            rough.append((step, _floor(w, cluster, run, dp, step), run))
    rough.sort(key=lambda x: x[0])
    exact = [
        plan(model, each, cluster, gpu, algorithm)
        for run in _to_replay(rough)
        for each in _recipes(run, extra or {}, gpu)
    ]
    return Found(fold(sorted(exact, key=lambda row: row.step_s)), len(rough))


def _floor(w: StepWork, cluster: Cluster, run: Training, dp: int, step: float) -> float:
    """A floor under a pipeline's replayed step: the bound less what it prices the stage messages'
    bytes at (`ringtree.sim.training.plan._pipeline_s`'s fast term)."""
    if run.pp == 1:
        return step
    p, m, v = run.pp, w.micro_batches, run.virtual_stages
    link = placed_stage_link(cluster, placement(cluster, run.layout, dp, w))
    return step - v * (m + p - 1) * 2 * (p - 1) / p * w.activation_bytes * link.beta


def _to_replay(rough: list[tuple[float, float, Training]]) -> list[Training]:
    """The REPLAYED fastest by the closed-form bound, and the pipelines (up to PER_DEPTH of each
    depth with its TP and CP) whose floor is below the last of them: the bound prices a pipeline's
    messages as if no stage had slack to hide them, which on a slow network can push the layouts
    that cross it least out of the top."""
    chosen = [run for _, _, run in rough[:REPLAYED]]
    if len(rough) <= REPLAYED:
        return chosen
    cut = rough[REPLAYED - 1][0]
    seen = Counter((r.tp, r.cp, r.pp) for r in chosen)
    for _, floor, run in sorted(rough[REPLAYED:], key=lambda x: x[1]):
        depth = (run.tp, run.cp, run.pp)
        if floor >= cut:
            break
        if seen[depth] < PER_DEPTH:
            seen[depth] += 1
            chosen.append(run)
    return chosen


_WORDS = {"tp": "TP", "cp": "CP", "pp": "PP", "schedule": "schedule", "dp": "DP",
          "virtual_stages": "virtual stages", "zero": "ZeRO", "sequence_parallel": "sequence parallel",
          "micro_batch": "micro-batch",
          "recompute": "recompute", "ep": "EP", "etp": "ETP", "fp8_recipe": "FP8 recipe"}  # fmt: skip


def _layout(row: StepPrediction) -> dict[str, object]:
    t = row.details["training"]
    return {"tp": row.tp, "cp": row.cp, "pp": row.pp, "schedule": t["schedule"], "dp": row.dp,
            "virtual_stages": row.virtual_stages,
            "zero": row.zero, "sequence_parallel": row.sequence_parallel, "micro_batch": t["micro_batch"],
            "recompute": t["recompute"], "ep": row.ep, "etp": row.etp,
            "fp8_recipe": t["fp8_recipe"] if t["dtype"] == "fp8" else None}  # fmt: skip


def fold(rows: list[StepPrediction]) -> list[StepPrediction]:
    """Rows with the step time and memory of an earlier row fold into it (they differ only in a
    dimension that changes nothing the plan prices): its details' `alike` lists their layouts."""
    kept: list[StepPrediction] = []
    for row in rows:
        i = next((i for i, k in enumerate(kept) if _same(k, row)), None)
        if i is None:
            kept.append(row)
        else:
            twin = kept[i]
            alike = [*twin.details.get("alike", []), _layout(row)]
            kept[i] = dataclasses.replace(twin, details={**twin.details, "alike": alike})
    return kept


def _same(a: StepPrediction, b: StepPrediction) -> bool:
    mem_a, mem_b = (a.memory or {}).get("total_GiB", 0.0), (b.memory or {}).get("total_GiB", 0.0)
    return abs(a.step_s - b.step_s) <= 1e-9 * max(a.step_s, b.step_s) and abs(mem_a - mem_b) < 0.01


def alike_words(row: StepPrediction) -> str:
    """The layouts folded into a row, each by what differs from it ('CP 2, DP 6, micro-batch 4')."""
    mine = _layout(row)
    return "; ".join(
        ", ".join(f"{_WORDS[k]} {other[k]}" for k in mine if other[k] != mine[k])
        for other in row.details.get("alike", [])
    )


def why(found: Found) -> str:
    """Why the first layout wins: what it spends its step on, and what the runner-up does differently."""
    rows = found.rows
    best = rows[0]
    parts = sorted(best.breakdown.items(), key=lambda kv: -kv[1])
    shares = ", ".join(
        f"{k.removesuffix('_s').replace('_', ' ')} {v / best.step_s:.0%}" for k, v in parts if v > 0
    )
    text = f"{found.fitted} layouts fit; the first spends its step on {shares}"
    if len(rows) > 1:
        second = rows[1]
        a, b = _layout(best), _layout(second)
        diff = ", ".join(f"{_WORDS[k]} {b[k]} instead of {a[k]}" for k in a if a[k] != b[k])
        text += f"; the runner-up ({diff}) is {second.step_s / best.step_s - 1:.1%} slower"
    return text
