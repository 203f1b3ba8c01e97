"""What one step's synchronisation costs: the shared-memory doorbell against gloo's own.

    .venv/bin/python benchmarks/shm_sync.py --json sync.json

For 2, 4 and 8 ranks (one spawned world each, one intra-op thread per rank), the mean time of
one meeting of all ranks, the slowest rank's, over `--iters` meetings after a warm-up:
  doorbell     the barrier the shared-memory transport rings after every step (named pipes)
  all_reduce   a one-element gloo all-reduce (what the transport's first version used)
  barrier      gloo's dist.barrier
Ratios are taken within each world (measured moments apart).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ringtree.bench import environment
from ringtree.comm import shm
from ringtree.processes import spawn

TIMEOUT = timedelta(seconds=60)


def _mean_us(fn: Callable[[], None], iters: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    mine = torch.tensor([(time.perf_counter() - start) / iters * 1e6], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine.item())


def worker(rank: int, iters: int) -> dict[str, float]:
    torch.set_num_threads(1)
    pg = dist.distributed_c10d._get_default_group()
    group = shm._group(pg, TIMEOUT)
    one = torch.zeros(1)

    def all_reduce() -> None:
        work = dist.all_reduce(one, async_op=True)
        assert work is not None
        work.wait()

    return {
        "doorbell_us": _mean_us(lambda: group.sync(TIMEOUT, "sync", 0, 0), iters),
        "all_reduce_us": _mean_us(all_reduce, iters),
        "barrier_us": _mean_us(lambda: dist.barrier(), iters),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    report: dict[str, Any] = {"environment": environment(), "worlds": {}}
    for p in args.ranks:
        r = spawn(worker, p, (args.iters,), timeout_s=600)[0]
        report["worlds"][str(p)] = r
        print(
            f"{p} ranks: doorbell {r['doorbell_us']:.0f} us, one-element all_reduce "
            f"{r['all_reduce_us']:.0f} us ({r['all_reduce_us'] / r['doorbell_us']:.1f}x), barrier "
            f"{r['barrier_us']:.0f} us ({r['barrier_us'] / r['doorbell_us']:.1f}x)"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
