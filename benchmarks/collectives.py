"""Collectives against torch's own, side by side: busbw ratios to native, median of several runs.

    .venv/bin/python benchmarks/collectives.py --json collectives.json

Two cases by default, each in one spawned world (one intra-op thread per rank):
  large: 4 ranks, all_reduce of 16 MiB and 64 MiB  (targets: best ringtree >= 1.3x, ring >= 1.0x)
  small: 8 ranks, all_reduce of 4 KiB              (target: best ringtree >= 1.0x)
Each run measures every algorithm at every size with ringtree.bench's nccl-tests-style timing
(sizes outer, algorithms inner, so load drift touches all alike); a run's ratio is an
algorithm's busbw over native's busbw in that same run, and the reported figure is the median
of the runs' ratios. Results are checked (a wrong element fails the benchmark).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ringtree.bench import BenchConfig, environment, run_sweep
from ringtree.launch import spawn


@dataclass(frozen=True)
class Case:
    name: str
    nproc: int
    sizes: tuple[int, ...]
    best_target: float  # best ringtree algorithm's busbw over native's
    ring_target: float | None  # ring's busbw over native's


CASES = {
    "large": Case("large", 4, (16 << 20, 64 << 20), 1.3, 1.0),
    "small": Case("small", 8, (4 << 10,), 1.0, None),
}
ALGORITHMS = ("native", "ring", "halving_doubling", "double_tree", "tree")


def worker(rank: int, sizes: tuple[int, ...], algorithms: tuple[str, ...], runs: int, iters: int) -> Any:
    torch.set_num_threads(1)
    out: list[list[dict[str, Any]]] = []
    for _ in range(runs):
        rows: list[dict[str, Any]] = []
        for size in sizes:
            cfg = BenchConfig(
                algorithms=algorithms, min_bytes=size, max_bytes=size, warmup=2, iters=_iters(size, iters)
            )
            rows += [r.as_dict() for r in run_sweep(cfg)]
        out.append(rows)
    return {"runs": out, "environment": environment()}


def _iters(size: int, iters: int) -> int:
    """Fewer timed calls for big buffers: each 64 MiB call takes a sizeable fraction of a second."""
    return iters if size <= 1 << 20 else max(3, iters // 4)


def summarize(case: Case, result: dict[str, Any], algorithms: tuple[str, ...]) -> dict[str, Any]:
    runs: list[list[dict[str, Any]]] = result["runs"]
    wrong = sum(r["wrong"] for rows in runs for r in rows)
    sizes: dict[str, Any] = {}
    for size in case.sizes:
        per_alg: dict[str, Any] = {}
        for alg in algorithms:
            bw = [_row(rows, size, alg)["busbw_gbps"] for rows in runs]
            native = [_row(rows, size, "native")["busbw_gbps"] for rows in runs]
            per_alg[alg] = {
                "busbw_gbps_median": statistics.median(bw),
                "ratio_to_native_median": statistics.median(b / n for b, n in zip(bw, native, strict=True)),
            }
        ours = {a: v for a, v in per_alg.items() if a != "native"}
        best = max(ours, key=lambda a: ours[a]["ratio_to_native_median"])
        ring = ours.get("ring", {}).get("ratio_to_native_median")
        sizes[str(size)] = {
            "algorithms": per_alg,
            "best_algorithm": best,
            "best_ratio": ours[best]["ratio_to_native_median"],
            "ring_ratio": ring,
            "best_target": case.best_target,
            "ring_target": case.ring_target,
            "met": ours[best]["ratio_to_native_median"] >= case.best_target
            and (case.ring_target is None or ring is None or ring >= case.ring_target),
        }
    return {"nproc": case.nproc, "sizes": sizes, "wrong": wrong, "environment": result["environment"]}


def _row(rows: list[dict[str, Any]], size: int, algorithm: str) -> dict[str, Any]:
    return next(r for r in rows if r["bytes"] == size and r["algorithm"] == algorithm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=[*CASES, "all"], default="all")
    parser.add_argument("--runs", type=int, default=5, help="runs per case; ratios are their median")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement (small sizes)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated; native is added")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    algorithms = tuple(dict.fromkeys(["native", *args.algorithms.split(",")]))
    cases = list(CASES.values()) if args.case == "all" else [CASES[args.case]]
    report: dict[str, Any] = {"runs": args.runs, "algorithms": list(algorithms), "cases": {}}
    for case in cases:
        result = spawn(worker, case.nproc, (case.sizes, algorithms, args.runs, args.iters), timeout_s=3600)[0]
        summary = report["cases"][case.name] = summarize(case, result, algorithms)
        for size, s in summary["sizes"].items():
            ratios = "  ".join(f"{a} {v['ratio_to_native_median']:.2f}x" for a, v in s["algorithms"].items())
            print(
                f"{case.name}: {case.nproc} ranks, {int(size) >> 10} KiB: {ratios}  "
                f"best {s['best_algorithm']} {s['best_ratio']:.2f}x (target {s['best_target']}x)"
                f"{'' if s['met'] else '  NOT MET'}"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if any(c["wrong"] for c in report["cases"].values()):
        sys.exit("some results were wrong")


if __name__ == "__main__":
    main()
