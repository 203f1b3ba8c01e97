"""Training throughput: ringtree's DDP against torch's DDP in one world, and what overlap hides.

    .venv/bin/python benchmarks/ddp_throughput.py --nproc 4 --json ddp.json

Every variant trains the same MLP on the same synthetic batches; variants are interleaved over
several rounds (so a drift in machine load touches all of them alike). Ratios against torch's
DDP are taken per round (variants measured moments apart) and their median reported; absolute
figures are each variant's median round. `torch_hook_*` is torch's own DDP with
`ringtree.comm_hook(algorithm=...)` registered. Warm-up steps are not timed; every rank runs
one intra-op thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ringtree import comm_hook
from ringtree.bench import environment
from ringtree.parallel import DistributedDataParallel
from ringtree.processes import spawn


@dataclass(frozen=True)
class Setup:
    width: int = 1024  # 3 hidden layers of 1024: about 2.4M parameters, 9.5 MB of fp32 gradients
    batch: int = 64  # samples per rank per step
    bucket_mb: float = 1.0  # several buckets, so that there is something to overlap
    warmup: int = 3
    steps: int = 10
    rounds: int = 3


# name: (ringtree algorithm or None for torch's DDP, overlap, ringtree.comm_hook in torch's DDP)
VARIANTS: dict[str, tuple[str | None, bool, str | None]] = {
    "torch": (None, True, None),
    "native": ("native", True, None),
    "native_no_overlap": ("native", False, None),
    "ring": ("ring", True, None),
    "ring_no_overlap": ("ring", False, None),
    "torch_hook_ring": (None, True, "ring"),
    "torch_hook_halving_doubling": (None, True, "halving_doubling"),
}


def model(width: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def wrap(net: nn.Module, variant: str, setup: Setup) -> nn.Module:
    algorithm, overlap, hook = VARIANTS[variant]
    if algorithm is None:
        ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=setup.bucket_mb)
        if hook is not None:
            ddp.register_comm_hook(None, comm_hook(algorithm=hook))
        return ddp
    return DistributedDataParallel(net, bucket_cap_mb=setup.bucket_mb, algorithm=algorithm, overlap=overlap)


def measure(variant: str, setup: Setup) -> dict[str, float | None]:
    """Samples per second (slowest rank), and ringtree's mean comm and exposed comm per step."""
    net = model(setup.width)
    ddp = wrap(net, variant, setup)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(setup.batch, 256, generator=g), torch.randint(0, 10, (setup.batch,), generator=g)
    comm, exposed = [], []

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        if isinstance(ddp, DistributedDataParallel):
            comm.append(ddp.last_sync.comm_time_s)
            exposed.append(ddp.last_sync.exposed_s)

    seconds, cpu_seconds = _timed(step, setup)
    if isinstance(ddp, DistributedDataParallel):
        ddp.close()
    n = setup.steps
    return {
        "samples_per_s": setup.batch * dist.get_world_size() * n / seconds,
        "cpu_time_s": cpu_seconds / n,  # per step and rank, every thread: steadier than wall time under load
        "comm_time_s": statistics.fmean(comm[-n:]) if comm else None,  # torch's DDP does not say
        "exposed_comm_time_s": statistics.fmean(exposed[-n:]) if exposed else None,
        "step_time_s": seconds / n,
    }


def _timed(step: Callable[[], None], setup: Setup) -> tuple[float, float]:
    """Wall seconds of the timed steps (slowest rank) and the CPU seconds a rank spent (mean)."""
    for _ in range(setup.warmup):
        step()
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(setup.steps):
        step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    used = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    dist.all_reduce(used)
    return float(elapsed.item()), float(used.item()) / dist.get_world_size()


def worker(rank: int, setup: Setup) -> dict[str, Any]:
    torch.set_num_threads(1)
    rounds: dict[str, list[dict[str, float | None]]] = {v: [] for v in VARIANTS}
    for _ in range(setup.rounds):
        for variant in VARIANTS:
            rounds[variant].append(measure(variant, setup))
    median = {v: sorted(r, key=lambda m: m["samples_per_s"] or 0.0)[len(r) // 2] for v, r in rounds.items()}
    # a round's ratio compares variants measured moments apart; the median ratio is the figure
    ratios = {
        v: statistics.median(
            m["samples_per_s"] / t["samples_per_s"] for m, t in zip(r, rounds["torch"], strict=True)
        )
        for v, r in rounds.items()
    }
    env = {**environment(), "parameters": sum(p.numel() for p in model(setup.width).parameters())}
    return {"variants": median, "ratios_vs_torch": ratios, "environment": env}


def summarize(result: dict[str, Any], setup: Setup) -> dict[str, Any]:
    v = result["variants"]
    ratios = result["ratios_vs_torch"]
    return {
        "ratio_native_vs_torch": ratios["native"],  # target >= 1.0
        "ratio_ring_vs_torch": ratios["ring"],  # target >= 0.9
        "ratio_torch_hook_ring_vs_torch": ratios["torch_hook_ring"],
        "ringtree_samples_per_s": v["native"]["samples_per_s"],
        "torch_samples_per_s": v["torch"]["samples_per_s"],
        "ringtree_ring_samples_per_s": v["ring"]["samples_per_s"],
        "ratios_vs_torch": ratios,
        "exposed_comm_s": {k: v[k]["exposed_comm_time_s"] for k in VARIANTS if VARIANTS[k][0]},
        "comm_s": {k: v[k]["comm_time_s"] for k in VARIANTS if VARIANTS[k][0]},
        "variants": v,
        "setup": setup.__dict__,
        "environment": result["environment"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=Setup.steps)
    parser.add_argument("--rounds", type=int, default=Setup.rounds)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    setup = Setup(steps=args.steps, rounds=args.rounds)
    summary = summarize(spawn(worker, args.nproc, (setup,), timeout_s=1800)[0], setup)
    print(json.dumps({k: summary[k] for k in list(summary)[:7]}, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
