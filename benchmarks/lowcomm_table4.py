"""Streaming DiLoCo's Table 4 (Douillard et al. 2025, arXiv:2501.18512) under its stated assumptions,
priced by ringtree's planner: the Gbit/s between two replicas each method needs for 50/80/90/95/99%
compute utilisation, beside the paper's figures.

The paper's assumptions: a step of 0.1 s (1B, 24 layers), 0.8 s (10B, 48) and 4.9 s (100B, 108)
(Kaplan FLOPs at 60% MFU), H = 100, fragments of 3 layers (here the divisor of H nearest L / 3: 10,
20 and 25 fragments); it does not state the replicas M or its collective model. Ours: M = 2 replicas
of one device each joined by one link (20 us latency), a ring all-reduce, DP's gradients and the
outer pseudo-gradients in bf16 (the paper's FP4 column is 4x below its 16-bit one), DP overlapping
its buckets with the backward (2/3 of the step), Streaming's overlap T = 1 step, FP4 priced as
ringtree's int4 codec (0.5 byte + one fp32 scale per 128).

    python benchmarks/lowcomm_table4.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ringtree.sim.lowcomm import Model, SyncMethod, bandwidth_for
from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.training.plan import StepConfig, predict_step

TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
# model: (parameters, layers, step seconds), and the paper's Gbit/s per column (Table 4)
MODELS: dict[str, tuple[int, int, float]] = {
    "1B": (1_000_000_000, 24, 0.1),
    "10B": (10_000_000_000, 48, 0.8),
    "100B": (100_000_000_000, 108, 4.9),
}
PAPER: dict[str, dict[str, tuple[float, ...]]] = {
    "1B": {
        "DP": (86.8, 152.6, 184.2, 222.3, 569.0),
        "DiLoCo": (1.4, 6.2, 13.3, 23.3, 86.8),
        "Streaming": (1.4, 5.2, 9.1, 16.0, 28.1),
        "+ overlap": (1.4, 4.3, 6.2, 9.1, 11.0),
        "+ overlap + FP4": (0.4, 0.9, 1.7, 2.0, 3.0),
    },
    "10B": {
        "DP": (104.8, 222.3, 222.3, 268.3, 471.5),
        "DiLoCo": (1.7, 7.5, 16.0, 33.9, 104.8),
        "Streaming": (1.7, 5.2, 9.1, 13.3, 19.3),
        "+ overlap": (1.7, 3.6, 5.2, 6.2, 7.5),
        "+ overlap + FP4": (0.4, 0.9, 1.4, 1.4, 1.7),
    },
    "100B": {
        "DP": (184.2, 323.8, 390.7, 390.7, 471.5),
        "DiLoCo": (3.0, 11.0, 23.3, 49.4, 184.2),
        "Streaming": (2.4, 6.2, 9.1, 11.0, 19.3),
        "+ overlap": (1.7, 3.6, 4.3, 5.2, 5.2),
        "+ overlap + FP4": (0.5, 0.9, 1.1, 1.1, 1.4),
    },
}
CLUSTER = Cluster(2, 1, Link("local", 1e-6, 1e12), Link("wan", 20e-6, 1.25e9))


def fragments(layers: int, h: int = 100) -> int:
    """The divisor of H nearest to 3-layer fragments (L / 3): 10, 20 and 25 for 24, 48 and 108 layers."""
    return min((f for f in range(1, h + 1) if h % f == 0), key=lambda f: (abs(f - layers / 3), -f))


def methods(layers: int) -> dict[str, SyncMethod]:
    f = fragments(layers)
    streaming = {"inner_steps": 100, "fragments": f, "outer_dtype": "bf16"}
    return {
        "DP": SyncMethod("ddp"),
        "DiLoCo": SyncMethod("diloco", inner_steps=100, outer_dtype="bf16"),
        "Streaming": SyncMethod("streaming-diloco", **streaming),  # type: ignore[arg-type]
        "+ overlap": SyncMethod("streaming-diloco", overlap_steps=1, **streaming),  # type: ignore[arg-type]
        "+ overlap + FP4": SyncMethod(
            "streaming-diloco", inner_steps=100, fragments=f, overlap_steps=1, outer_dtype="int4"
        ),
    }


def table() -> dict[str, Any]:
    """Per model and column: ours and the paper's Gbit/s per target."""
    out: dict[str, Any] = {}
    for name, (params, layers, seconds) in MODELS.items():
        config = StepConfig(params, seconds, "bf16", overlap=True)
        model = Model(params, 2, config.bucket_mb)

        def step(cluster: Cluster, config: StepConfig = config) -> Any:
            return predict_step(config, cluster, "ring")

        out[name] = {
            column: {
                "words": method.words(),
                "ours": [bandwidth_for(t, method, model, CLUSTER, "ring", step) for t in TARGETS],
                "paper": list(PAPER[name][column]),
            }
            for column, method in methods(layers).items()
        }
    return out


def markdown(data: dict[str, Any]) -> str:
    lines = ["| model | column | ours: Gbit/s at 50/80/90/95/99% | paper's | ours / paper at 99% |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, columns in data.items():
        for column, row in columns.items():
            ours = "/".join("-" if g is None else f"{g:.1f}" for g in row["ours"])
            paper = "/".join(f"{g:.1f}" for g in row["paper"])
            ratio = row["ours"][-1] / row["paper"][-1] if row["ours"][-1] else float("nan")
            lines.append(f"| {name} | {column} | {ours} | {paper} | {ratio:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    data = table()
    print(markdown(data))
    if args.json:
        args.json.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
