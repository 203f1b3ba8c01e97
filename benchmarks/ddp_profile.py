"""One DDP variant of ddp_throughput.py for many steps, to profile: step time and bucket timeline.

    .venv/bin/python benchmarks/ddp_profile.py --variant ring --steps 60
    py-spy record --subprocesses -r 500 -f raw -o ring.txt -- \
        .venv/bin/python benchmarks/ddp_profile.py --variant ring --steps 60

Trains the benchmark's MLP with one variant (same setup: 4 ranks, 64 samples per rank, 1 MiB
bucket cap, one intra-op thread) and prints, per rank, the median step, the median exposed
communication and the last step's bucket spans in ms from the step's start.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_throughput import VARIANTS, Setup, model, wrap

from ringtree.launch import spawn
from ringtree.parallel import DistributedDataParallel


def worker(rank: int, variant: str, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    setup = Setup()
    net = model(setup.width)
    ddp = wrap(net, variant, setup)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(setup.batch, 256, generator=g), torch.randint(0, 10, (setup.batch,), generator=g)
    times, exposed, spans = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
        if isinstance(ddp, DistributedDataParallel):
            exposed.append(ddp.last_sync.exposed_s)
            spans = [(s.bucket, (s.start - start) * 1e3, (s.end - start) * 1e3) for s in ddp.last_sync.spans]
    if isinstance(ddp, DistributedDataParallel):
        ddp.close()
    warm = setup.warmup
    return {
        "step_ms": statistics.median(times[warm:]) * 1e3,
        "exposed_ms": statistics.median(exposed[warm:]) * 1e3 if exposed else None,
        "last_step_buckets_ms": [(b, round(s, 1), round(e, 1)) for b, s, e in spans],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=list(VARIANTS), default="ring")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    for rank, row in enumerate(spawn(worker, args.nproc, (args.variant, args.steps), timeout_s=900)):
        print(f"rank {rank}: {row}")


if __name__ == "__main__":
    main()
