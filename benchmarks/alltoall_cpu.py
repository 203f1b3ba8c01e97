"""What one all-to-all costs each rank in CPU time, beside its wall time: a measure the load of a
shared host disturbs less than wall time (a rank waiting for a core spends no CPU).

    .venv/bin/python benchmarks/alltoall_cpu.py --nproc 4 --mib 64 --iters 4

One spawned world; per algorithm two warm-up calls, then `--iters` timed calls of
ringtree.comm.all_to_all_single (validate=False, equal blocks of float32); per rank the mean wall
time, CPU time (user + system, all threads) and minor page faults per call.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ringtree import comm
from ringtree.processes import spawn


def _world(rank: int, numel: int, algorithms: list[str], iters: int) -> dict[str, dict[str, float]]:
    x = torch.arange(numel, dtype=torch.float32) + rank
    out = torch.empty(numel)
    rows = {}
    for algorithm in algorithms:
        for _ in range(2):
            comm.all_to_all_single(out, x, algorithm=algorithm, validate=False)
        dist.barrier()
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(iters):
            comm.all_to_all_single(out, x, algorithm=algorithm, validate=False)
        wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        rows[algorithm] = {
            "wall_ms": wall / iters * 1e3,
            "cpu_ms": cpu / iters * 1e3,
            "minor_faults": (after.ru_minflt - before.ru_minflt) / iters,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--mib", type=float, default=64.0, help="each rank's buffer, MiB")
    parser.add_argument("--algorithms", default=",".join(comm.algorithms("all_to_all")))
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    numel = int(args.mib * (1 << 20)) // 4 // args.nproc * args.nproc
    names = args.algorithms.split(",")
    results: list[Any] = spawn(_world, args.nproc, (numel, names, args.iters), timeout_s=1800)
    for rank, rows in enumerate(results):
        cells = ", ".join(f"{a} {r['wall_ms']:.1f}/{r['cpu_ms']:.1f}" for a, r in rows.items())
        print(f"rank {rank} (wall/cpu ms per call): {cells}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
