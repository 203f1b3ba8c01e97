"""Collectives against torch's own, side by side: busbw ratios to native, median of several runs.

    .venv/bin/python benchmarks/collectives.py --json collectives.json

Two cases by default, each in one spawned world (one intra-op thread per rank):
  large: 4 ranks, all_reduce of 16 MiB and 64 MiB  (targets: best ringtree >= 1.3x, ring >= 1.0x)
  small: 8 ranks, all_reduce of 4 KiB              (target: best ringtree >= 1.0x)
and, with `--case transport`, each schedule over shared memory and over gloo's point-to-point
transport ("ring/p2p") on 4 ranks from 4 KiB to 16 MiB.
Each run times every algorithm at every size nccl-tests style (one validated warm-up call, then
timed calls; the slowest rank's mean; busbw = 2(p-1)/p x bytes / time), sizes outer and
algorithms inner so that load drift touches all alike. A run's ratio is an algorithm's busbw
over native's in that same run; the reported figure is the median of the runs' ratios. Every
algorithm's result is then checked against the exact sum (a wrong element fails the benchmark).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ringtree import comm
from ringtree.bench import busbw_factor, environment
from ringtree.comm.shm import TRANSPORT_ENV
from ringtree.processes import spawn


@dataclass(frozen=True)
class Case:
    name: str
    nproc: int
    sizes: tuple[int, ...]
    algorithms: tuple[str, ...]  # native first
    best_target: float  # best ringtree algorithm's busbw over native's
    ring_target: float | None  # ring's busbw over native's


CASES = {
    "large": Case(
        "large",
        4,
        (16 << 20, 64 << 20),
        ("native", "ring", "halving_doubling", "double_tree", "ring/p2p", "halving_doubling/p2p"),
        1.3,
        1.0,
    ),
    "small": Case(
        "small", 8, (4 << 10,), ("native", "ring", "halving_doubling", "tree", "double_tree"), 1.0, None
    ),
    # not a target: each schedule over shared memory against the same schedule over gloo's
    # point-to-point transport, from latency-bound to bandwidth-bound sizes
    "transport": Case(
        "transport",
        4,
        (4 << 10, 64 << 10, 1 << 20, 16 << 20),
        ("native", "ring", "ring/p2p", "tree", "tree/p2p", "double_tree", "double_tree/p2p"),
        1.0,
        None,
    ),
}
TARGETS = ("large", "small")


def worker(rank: int, case: Case, runs: int, iters: int) -> Any:
    """Per run, per size, per algorithm: the slowest rank's mean seconds per call; then a check."""
    torch.set_num_threads(1)
    p = dist.get_world_size()
    out: list[list[dict[str, Any]]] = []
    for _ in range(runs):
        rows = []
        for size in case.sizes:
            x = _values(rank, size // 4)
            for algorithm in case.algorithms:
                seconds = _time(x, algorithm, _iters(size, iters))
                algbw = size / seconds / 1e9
                rows.append(
                    {
                        "bytes": size,
                        "algorithm": algorithm,
                        "time_us": seconds * 1e6,
                        "busbw_gbps": algbw * busbw_factor("all_reduce", p),
                    }
                )
        out.append(rows)
    wrong = sum(_wrong(rank, size, algorithm) for size in case.sizes for algorithm in case.algorithms)
    return {"runs": out, "wrong": wrong, "environment": environment()}


def _values(rank: int, count: int) -> torch.Tensor:
    """Small integers in float32: every summation order gives the exact same result."""
    return (1 + (torch.arange(count) + 3 * rank) % 4).float()


def _transport(variant: str) -> str:
    """Run `variant` ("ring", or "ring/p2p" for gloo's point-to-point transport) in this process."""
    algorithm, _, transport = variant.partition("/")
    os.environ[TRANSPORT_ENV] = transport or "shm"
    return algorithm


def _time(x: torch.Tensor, variant: str, iters: int) -> float:
    algorithm = _transport(variant)
    comm.all_reduce(x, algorithm=algorithm)  # warm-up, validating arguments across ranks
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        comm.all_reduce(x, algorithm=algorithm, validate=False)
    mine = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine.item())


def _wrong(rank: int, size: int, variant: str) -> int:
    """Elements that differ from the exact sum, on any rank."""
    x = _values(rank, size // 4)
    comm.all_reduce(x, algorithm=_transport(variant))
    want = sum(_values(r, size // 4) for r in range(dist.get_world_size()))
    wrong = torch.tensor([int((x != want).sum())])
    dist.all_reduce(wrong)
    return int(wrong.item())


def _iters(size: int, iters: int) -> int:
    """Fewer timed calls for big buffers: each 64 MiB call takes a sizeable fraction of a second."""
    return iters if size <= 1 << 20 else max(3, iters // 4)


def summarize(case: Case, result: dict[str, Any]) -> dict[str, Any]:
    runs: list[list[dict[str, Any]]] = result["runs"]
    wrong, algorithms = result["wrong"], case.algorithms
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
    return {
        "nproc": case.nproc,
        "sizes": sizes,
        "wrong": wrong,
        "runs": runs,
        "environment": result["environment"],
    }


def _row(rows: list[dict[str, Any]], size: int, algorithm: str) -> dict[str, Any]:
    return next(r for r in rows if r["bytes"] == size and r["algorithm"] == algorithm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=[*CASES, "all"], default="all", help="all: the target cases")
    parser.add_argument("--runs", type=int, default=5, help="runs per case; ratios are their median")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement (small sizes)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    cases = [CASES[c] for c in TARGETS] if args.case == "all" else [CASES[args.case]]
    report: dict[str, Any] = {"runs": args.runs, "cases": {}}
    for case in cases:
        result = spawn(worker, case.nproc, (case, args.runs, args.iters), timeout_s=3600)[0]
        summary = report["cases"][case.name] = summarize(case, result)
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
