"""PowerSGD: ringtree's (its DDP, and its hook in torch's DDP) against torch's powerSGD_hook, one world.

    .venv/bin/python benchmarks/powersgd.py --nproc 2 --json powersgd.json

Every variant trains the same MLP (256-1024-1024-1024-10, 2.37M parameters) on the same
synthetic batches, in one bucket (a cap above the model's 9.5 MB: torch's hook then runs one
bucket at a time, as on every backend, and neither DDP overlaps it with backward). PowerSGD
runs with torch's recommended error feedback and warm start and compresses from the third step
on (start iteration 2, the least torch's DDP allows with them), so every timed step compresses
(the warm-up's last step is the first compressed one, which draws the random Qs). Variants are
interleaved over several rounds (a drift in machine load touches all of them alike) and each
one's median round is reported.

Per variant: samples/s (slowest rank), step time, and the bytes one rank hands to the all-reduce
per step (the P, Q and uncompressed elements of the compressed steps, from each state's own
counters; the whole gradient for a plain all-reduce). A ring moves 2(p-1)/p of that per rank.
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
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

import ringtree
from ringtree.bench import environment
from ringtree.parallel import DistributedDataParallel, PowerSGD
from ringtree.processes import spawn


@dataclass(frozen=True)
class Setup:
    width: int = 1024  # 3 hidden layers of 1024: 2.37M parameters, 9.5 MB of fp32 gradients
    batch: int = 64  # samples per rank per step
    rank: int = 2  # PowerSGD's matrix approximation rank
    bucket_mb: float = 64.0  # one bucket: the whole model
    warmup: int = 3  # two plain all-reduce steps, then the first compressed one
    steps: int = 10
    rounds: int = 3


VARIANTS = (
    "torch_allreduce",  # torch's DDP, its default all-reduce hook
    "torch_powersgd",  # torch's DDP with torch's powerSGD_hook
    "ringtree_powersgd_native",  # ringtree's DDP with PowerSGD, sums by torch's all_reduce
    "ringtree_powersgd_ring",  # ringtree's DDP with PowerSGD, sums by ringtree's ring
    "ringtree_hook_powersgd_ring",  # torch's DDP with ringtree.powersgd_hook("ring")
    "ringtree_allreduce_ring",  # ringtree's DDP, plain ring all-reduce
)


def model(width: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def wrap(net: nn.Module, variant: str, setup: Setup) -> tuple[nn.Module, Callable[[], int] | None]:
    """The wrapped model, and the elements its PowerSGD state has sent so far (None: plain)."""
    options: dict[str, Any] = {
        "rank": setup.rank,
        "start_iter": 2,
        "error_feedback": True,
        "warm_start": True,
    }
    if variant.startswith("ringtree_powersgd") or variant == "ringtree_allreduce_ring":
        algorithm = "native" if variant.endswith("native") else "ring"
        state = PowerSGD(**options) if "powersgd" in variant else None
        ddp = DistributedDataParallel(
            net, bucket_cap_mb=setup.bucket_mb, algorithm=algorithm, compression=state
        )
        return ddp, None if state is None else lambda: state.numel_after
    torch_ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=setup.bucket_mb)
    if variant == "torch_powersgd":
        logging = {"compression_stats_logging_frequency": 10**9}
        torch_state = torch_psgd.PowerSGDState(
            None, setup.rank, 2, use_error_feedback=True, warm_start=True, **logging
        )
        torch_ddp.register_comm_hook(torch_state, torch_psgd.powerSGD_hook)
        return torch_ddp, lambda: torch_state.total_numel_after_compression
    if variant == "ringtree_hook_powersgd_ring":
        hook_state = PowerSGD(**options)
        torch_ddp.register_comm_hook(hook_state, ringtree.powersgd_hook("ring"))
        return torch_ddp, lambda: hook_state.numel_after
    return torch_ddp, None


def measure(variant: str, setup: Setup) -> dict[str, float]:
    """Samples per second (slowest rank), step time and bytes handed to the all-reduce per step."""
    net = model(setup.width)
    ddp, sent = wrap(net, variant, setup)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(setup.batch, 256, generator=g), torch.randint(0, 10, (setup.batch,), generator=g)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()

    for _ in range(setup.warmup):
        step()
    before = 0 if sent is None else sent()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(setup.steps):
        step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    whole = sum(p.numel() for p in net.parameters())
    elements = whole * setup.steps if sent is None else sent() - before  # every timed step compressed
    if isinstance(ddp, DistributedDataParallel):
        ddp.close()
    seconds = float(elapsed.item())
    return {
        "samples_per_s": setup.batch * dist.get_world_size() * setup.steps / seconds,
        "step_time_s": seconds / setup.steps,
        "allreduced_bytes_per_step": 4 * elements / setup.steps,  # fp32 elements
    }


def worker(rank: int, setup: Setup) -> dict[str, Any]:
    torch.set_num_threads(1)
    rounds: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(setup.rounds):
        for variant in VARIANTS:
            rounds[variant].append(measure(variant, setup))
    median = {v: sorted(r, key=lambda m: m["samples_per_s"])[len(r) // 2] for v, r in rounds.items()}
    ratios = {
        v: statistics.median(
            m["samples_per_s"] / t["samples_per_s"] for m, t in zip(r, rounds["torch_powersgd"], strict=True)
        )
        for v, r in rounds.items()
    }
    env = {**environment(), "parameters": sum(p.numel() for p in model(setup.width).parameters())}
    return {
        "variants": median,
        "ratios_vs_torch_powersgd": ratios,
        "setup": setup.__dict__,
        "environment": env,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rank", type=int, default=Setup.rank, help="PowerSGD's rank")
    parser.add_argument("--steps", type=int, default=Setup.steps)
    parser.add_argument("--rounds", type=int, default=Setup.rounds)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    setup = Setup(rank=args.rank, steps=args.steps, rounds=args.rounds)
    result = spawn(worker, args.nproc, (setup,), timeout_s=1800)[0]
    print(
        json.dumps({"variants": result["variants"], "ratios": result["ratios_vs_torch_powersgd"]}, indent=2)
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
