"""Why a data-parallel plan predicts what it does: the seeds' bound per link level, the bottleneck,
the network a team would need for 90% scaling efficiency, and an error bar from the calibration.

The bound of one level is the seeds' 2(p-1)/p x S/B: S the gradient bytes, B that level's
bandwidth (a device's port inside a node; all of a node's NICs between nodes), p the devices (or
nodes) at that level: no algorithm moves less across it. It ignores latency and reductions, which
the plan adds.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from ringtree import files
from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.network.measured import allreduce_seconds
from ringtree.sim.training.plan import StepConfig, bottleneck, predict_step, speedup_vs_one_node

TARGET_EFFICIENCY = 0.9


def level_bounds(config: StepConfig, cluster: Cluster) -> list[dict[str, Any]]:
    """2(p-1)/p x S/B for the intra-node and the inter-node link, with the numbers filled in."""
    s = config.grad_bytes
    out = []
    levels = [("intra", cluster.intra, cluster.gpus_per_node, 1)]
    if cluster.nodes > 1:
        levels.append(("inter", cluster.inter, cluster.nodes, cluster.nics_per_node))
    for level, link, p, nics in levels:
        bandwidth = link.bandwidth_Bps * nics  # a node's NICs carry its share together
        seconds = 2 * (p - 1) / p * s / bandwidth
        rails = f" x {nics} NICs" if nics > 1 else ""
        out.append(
            {
                "level": level,
                "link": link.name,
                "ranks": p,
                "bytes": s,
                "bandwidth_Bps": bandwidth,
                "seconds": seconds,
                "formula": f"2({p}-1)/{p} x {s / 1e6:.1f} MB / ({link.bandwidth_Bps / 1e9:.3g} GB/s{rails}) "
                f"= {seconds:.4f} s",
            }
        )
    return out


def bandwidth_for_efficiency(
    config: StepConfig, cluster: Cluster, algorithm: str, target: float = TARGET_EFFICIENCY
) -> float | None:
    """The inter-node bandwidth (bytes/s per NIC) at which speedup / nodes reaches `target`.

    None on one node, or when even an infinitely fast network falls short (latency, intra link).
    """
    if cluster.nodes < 2:
        return None

    def efficiency(bandwidth: float) -> float:
        inter = Link(cluster.inter.name, cluster.inter.alpha_s, bandwidth)
        c = dataclasses.replace(cluster, inter=inter)
        return speedup_vs_one_node(config, c, algorithm) / cluster.nodes

    lo, hi = 1e6, 1e15
    if efficiency(hi) < target:
        return None
    if efficiency(lo) >= target:
        return lo
    for _ in range(60):  # bisection on a log scale: about 0.1% at the end
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if efficiency(mid) >= target else (mid, hi)
    return hi


def calibration_error(path: Path | None) -> float | None:
    """The calibration's relative RMS residual: its `residuals` list if it has one; else, for a
    two-level fit, the larger of its levels' `rms_rel_error` (a multi-node plan leans on both);
    else its `rms_rel_error`. None without a file or any of those keys."""
    if path is None:
        return None
    data = files.read_json(path)
    residuals = data.get("residuals")
    if isinstance(residuals, list) and residuals:
        values = [float(r["rel_error"] if isinstance(r, dict) else r) for r in residuals]
        return math.sqrt(sum(v * v for v in values) / len(values))
    levels = data.get("levels")
    if isinstance(levels, dict) and levels:
        return max(float(v["rms_rel_error"]) for v in levels.values())
    rms = data.get("rms_rel_error")
    return float(rms) if rms is not None else None


def measured_error(
    config: StepConfig, cluster: Cluster, algorithm: str
) -> tuple[float | None, float | None, list[str]]:
    """(seconds, relative error, notes) from a calibration's measured rows: the notes say where
    each bucket's all-reduce time comes from, the error is the calibration's residual at each
    bucket's size. The error is None when the cluster has no measured rows of `algorithm`."""
    table = cluster.measured
    sizes = config.buckets()
    if table is None or not sizes:
        return None, None, []
    notes = [table.describe(algorithm, cluster, n) for n in dict.fromkeys(sizes)]
    residuals = [table.residual(algorithm, cluster, n) for n in sizes]
    if any(r is None for r in residuals):
        return None, None, notes
    seconds = [allreduce_seconds(algorithm, cluster, n, config.itemsize) for n in sizes]
    total = sum(seconds)
    error_s = sum(float(r or 0.0) * t for r, t in zip(residuals, seconds, strict=True))
    return error_s, error_s / total if total else 0.0, notes


def explain(
    config: StepConfig, cluster: Cluster, algorithm: str, calibration: Path | None = None
) -> dict[str, Any]:
    """Every line of the explanation, as data (the command prints `lines`)."""
    row = predict_step(config, cluster, algorithm)
    bounds = level_bounds(config, cluster)
    level, share = bottleneck(config, cluster, algorithm)
    needed = bandwidth_for_efficiency(config, cluster, algorithm)
    lines = [f"bound at the {b['level']} level ({b['link']}): {b['formula']}" for b in bounds]
    lines.append(f"bottleneck: {level} link, {share:.0%} of the all-reduce time")
    if cluster.nodes > 1:
        lines.append(
            f"90% scaling efficiency needs {needed * 8 / 1e9:.3g} Gbit/s per NIC between nodes "
            f"(now {cluster.inter.bandwidth_Bps * 8 / 1e9:.3g})"
            if needed
            else "90% scaling efficiency is out of reach at any inter-node bandwidth (latency or intra link)"
        )
    error_s, rel, notes = measured_error(config, cluster, algorithm)
    lines += notes
    if rel is not None:
        what = f"the calibration's {rel:.1%} residual at the planned size"
    else:
        rel = calibration_error(calibration)
        error_s = rel * row.dp_allreduce_s if rel is not None else None
        what = f"the calibration's {rel:.1%} RMS residual" if rel is not None else ""
    if error_s is not None:
        lines.append(f"error bar: +/- {error_s:.4f} s on the step ({what} on the all-reduce time)")
    return {
        "level_bounds": bounds,
        "bottleneck": level,
        "bottleneck_share": share,
        "inter_bandwidth_for_90pct_Bps": needed,
        "error_bar_s": error_s,
        "error_bar_rel": rel,
        "lines": lines,
    }


def seed_derivation(config: StepConfig, cluster: Cluster, algorithm: str) -> list[str]:
    """The first seed's arithmetic beside the plan's: 2S/B, then the step and the speedup."""
    s, b = config.grad_bytes, cluster.inter.bandwidth_Bps
    p = cluster.ranks
    row, one = (
        predict_step(config, cluster, algorithm),
        predict_step(config, cluster.with_nodes(1), algorithm),
    )
    speedup = cluster.nodes * one.step_s / row.step_s
    wait = f" + {row.sync_wait_s:.4f} (the run's wait)" if row.sync_wait_s else ""
    return [
        f"seed: 2S/B = 2 x {s / 1e6:.3g} MB / {b / 1e9:.3g} GB/s = {2 * s / b:.4f} s "
        f"(exactly 2({p}-1)/{p} S/B = {2 * (p - 1) / p * s / b:.4f} s)",
        f"plan: all-reduce {row.dp_allreduce_s:.4f} s = that bound plus latency and reductions over "
        f"{len(config.buckets())} buckets",
        f"plan: step {row.step_s - row.exposed_dp_s - row.sync_wait_s:.3f}{wait} + {row.exposed_dp_s:.4f} "
        f"= {row.step_s:.4f} s on "
        f"{cluster.nodes} nodes, {one.step_s:.4f} s on one; speedup {cluster.nodes} x "
        f"{one.step_s:.4f} / {row.step_s:.4f} = {speedup:.2f}x",
    ]
