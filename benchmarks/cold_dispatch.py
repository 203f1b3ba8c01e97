"""What a small step between two pipeline actions costs right after an action: cold caches.

    .venv/bin/python benchmarks/cold_dispatch.py --json cold.json

Times small operations of the kind the pipeline runtime does between two actions (a tensor
operation, a 139 KB copy by tensor and by memmove, a short Python loop) alone in a loop ("warm")
and right after a compute step: a 512 x 512 matmul (3 MB of operands, more than the core's L2),
the same FLOPs as 64 x 64 matmuls (operands that stay in L1/L2), or a 4 MB fill. One thread, the
median of --repeats each. The gap between the columns is what every operation at a stage's
action boundary pays on top of its own work (docs/pipeline.md, "Fifth look").
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ringtree.bench import environment

Step = Callable[[], object]


def _matmuls(n: int) -> Step:
    """512^3 multiply-adds as (512 / n)^3 matmuls of n x n."""
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    count = max(1, (512 // n) ** 3)
    return lambda: [torch.mm(a, b, out=c) for _ in range(count)]


def _operations() -> dict[str, Step]:
    x = torch.randn(32, 17, 64)  # a vit activation of one micro-batch, 139 KB
    dst = torch.empty_like(x)
    return {
        "x + 1 (one dispatched op)": lambda: x + 1,
        "copy_ of 139 KB": lambda: dst.copy_(x),
        "memmove of 139 KB": lambda: ctypes.memmove(dst.data_ptr(), x.data_ptr(), x.nbytes),
        "sum(range(200)) (Python)": lambda: sum(range(200)),
    }


def measure(repeats: int) -> list[dict[str, object]]:
    fill = torch.empty(4 << 20, dtype=torch.uint8)
    before: dict[str, Step] = {
        "warm": lambda: None,
        "after 512x512 matmul": _matmuls(512),
        "after 64x64 matmuls": _matmuls(64),
        "after a 4 MB fill": lambda: fill.fill_(1),
    }
    rows = []
    for name, op in _operations().items():
        row: dict[str, object] = {"operation": name}
        for when, pre in before.items():
            times = []
            for _ in range(repeats):
                pre()
                start = time.perf_counter()
                op()
                times.append(time.perf_counter() - start)
            row[when] = statistics.median(times) * 1e6
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.json is not None and args.json.exists():
        parser.error(f"--json {args.json} exists; remove it or name another file")
    torch.set_num_threads(1)  # as every stage process of ringtree.processes runs
    rows = measure(args.repeats)
    columns = [k for k in rows[0] if k != "operation"]
    print(f"{'microseconds, median':28}" + "".join(f"{c:>22}" for c in columns))
    for row in rows:
        print(f"{row['operation']:28}" + "".join(f"{row[c]:22.1f}" for c in columns))
    if args.json is not None:
        data = {"environment": {**environment(), "threads": 1}, "microseconds": rows}
        args.json.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
