"""An expert-parallel MoE training step: ringtree's all-to-all algorithms against torch's own, side by side.

    flock /tmp/ringtree-bench.lock .venv/bin/python benchmarks/moe.py --nproc 4 --json moe.json

Every rank holds E/P experts of each MoE layer (EP = P = --nproc) and runs forward, backward and
AdamW on its own tokens: per layer one counts exchange and four variable-split all-to-alls (the
dispatch, the combine, and their backwards). The only thing that changes between variants is
the all-to-all: torch.distributed's all_to_all_single (`native`, gloo on CPU) or ringtree's
schedules (`ringtree.comm.all_to_all_single`: auto, pairwise, bruck, linear, hierarchical).
Variants are interleaved over rounds so that a drift in machine load touches all alike; the
ratio to native is taken per round and its median reported. Warm-up steps are not timed; every
rank runs one intra-op thread; with --pin, where the ranks outnumber the cores, each is pinned to
one core for every variant (ringtree.parallel.placement, as ringtree's DDP does in training). The
exposed all-to-all fraction is the time the training thread spent blocked in all-to-alls over
the step time (the slowest rank's). CPU time is counted too, per rank and step (every thread:
gloo runs torch's exchanges on threads of its own): where the ranks outnumber the cores the step
lasts as long as that work shared out, and `ceiling_vs_native` is the most a free all-to-all
could give over torch's.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtree.bench import environment
from ringtree.parallel import ExpertParallel, MoE, placement
from ringtree.parallel.moe import CLOCK
from ringtree.processes import spawn

RINGTREE = ("auto", "pairwise", "bruck", "linear", "hierarchical")
VARIANTS = ("native", *RINGTREE)


@dataclass(frozen=True)
class Setup:
    dim: int = 256
    hidden: int = 256  # each expert's SwiGLU width
    experts: int = 8
    top_k: int = 2
    layers: int = 2
    sequences: int = 8  # samples per rank per step
    tokens: int = 64  # tokens per sample: 512 tokens, 1024 copies, 1 MiB a rank a dispatch
    warmup: int = 2
    steps: int = 6
    rounds: int = 3


def model(setup: Setup) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(setup.layers):
        layers += [nn.LayerNorm(setup.dim), MoE(setup.dim, setup.hidden, setup.experts, setup.top_k)]
    return nn.Sequential(*layers)


def measure(parallel: ExpertParallel, variant: str, setup: Setup) -> dict[str, float]:
    """Samples per second and the exposed all-to-all fraction of the step (slowest rank)."""
    parallel.algorithm = variant
    net = parallel.apply(model(setup))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(setup.sequences, setup.tokens, setup.dim, generator=g)

    def step() -> None:
        opt.zero_grad()
        net(x).square().mean().backward()
        parallel.reduce_expert_gradients()
        opt.step()

    for _ in range(setup.warmup):
        step()
    dist.barrier()
    start, a2a, waited = time.perf_counter(), CLOCK.seconds, CLOCK.exposed
    a2a_cpu, cpu = CLOCK.cpu_seconds, _process_cpu_s()
    for _ in range(setup.steps):
        step()
    elapsed, cpu_s = time.perf_counter() - start, _process_cpu_s() - cpu
    mine = [elapsed, CLOCK.seconds - a2a, CLOCK.exposed - waited, cpu_s, CLOCK.cpu_seconds - a2a_cpu]
    slowest = torch.tensor(mine[:3], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    work = torch.tensor(mine[3:], dtype=torch.float64)
    dist.all_reduce(work)
    seconds, a2a_s, exposed_s = slowest.tolist()
    cpu_s, a2a_cpu_s = (w / dist.get_world_size() / setup.steps for w in work.tolist())
    return {
        "samples_per_s": setup.sequences * dist.get_world_size() * setup.steps / seconds,
        "step_time_s": seconds / setup.steps,
        "a2a_time_s": a2a_s / setup.steps,
        "a2a_exposed_fraction": exposed_s / seconds,  # waited for (all of it: no shared experts here)
        "cpu_s_per_step": cpu_s,  # a rank's CPU time a step, every thread (mean over ranks)
        "a2a_cpu_s_per_step": a2a_cpu_s,  # of it, the thread's that ran the all-to-alls, inside them
    }


def _process_cpu_s() -> float:
    """This process's CPU time, every thread's (gloo's own threads do torch's exchanges)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker(rank: int, setup: Setup, pin: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    unpin = placement.spread() if pin else None  # as ringtree's DDP does: every variant alike
    parallel = ExpertParallel(dist.get_world_size())  # one set of groups for every variant
    rounds: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(setup.rounds):
        for variant in VARIANTS:
            rounds[variant].append(measure(parallel, variant, setup))
    median = {v: sorted(r, key=lambda m: m["samples_per_s"])[len(r) // 2] for v, r in rounds.items()}
    ratios = {  # a round's ratio compares variants measured moments apart; the median is the figure
        v: statistics.median(
            m["samples_per_s"] / n["samples_per_s"] for m, n in zip(r, rounds["native"], strict=True)
        )
        for v, r in rounds.items()
    }
    if unpin is not None:
        unpin()
    return {"variants": median, "ratios_vs_native": ratios, "environment": environment()}


def summarize(result: dict[str, Any], setup: Setup, pinned: bool = False) -> dict[str, Any]:
    v, ratios = result["variants"], result["ratios_vs_native"]
    best = max(RINGTREE, key=lambda a: ratios[a])
    return {
        "ringtree_samples_per_s": v[best]["samples_per_s"],
        "native_samples_per_s": v["native"]["samples_per_s"],
        "ratio_ringtree_vs_native": ratios[best],  # target >= 1.3
        "ringtree_algorithm": best,
        "ringtree_a2a_exposed_fraction": v[best]["a2a_exposed_fraction"],
        "native_a2a_exposed_fraction": v["native"]["a2a_exposed_fraction"],
        "ceiling_vs_native": ceiling(v[best], v["native"]),
        "ratios_vs_native": ratios,
        "variants": v,
        "setup": asdict(setup),
        "pinned": pinned,
        "environment": result["environment"],
    }


def ceiling(ours: dict[str, float], native: dict[str, float]) -> float:
    """The most a free all-to-all could gain over native where the ranks outnumber the cores (the
    step then lasts as long as the ranks' CPU work, shared out): native's CPU a step over ours
    without our exchanges' CPU."""
    return native["cpu_s_per_step"] / (ours["cpu_s_per_step"] - ours["a2a_cpu_s_per_step"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=Setup.steps)
    parser.add_argument("--rounds", type=int, default=Setup.rounds)
    parser.add_argument("--dim", type=int, default=Setup.dim)
    parser.add_argument("--hidden", type=int, default=Setup.hidden, help="each expert's SwiGLU width")
    parser.add_argument("--pin", action="store_true", help="pin each rank to a core (every variant)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    setup = Setup(
        dim=args.dim,
        hidden=args.hidden,
        experts=max(Setup.experts, args.nproc),
        steps=args.steps,
        rounds=args.rounds,
    )
    if setup.experts % args.nproc:
        parser.error(f"--nproc {args.nproc} must divide the {setup.experts} experts")
    summary = summarize(spawn(worker, args.nproc, (setup, args.pin), timeout_s=1800)[0], setup, args.pin)
    print(json.dumps({k: summary[k] for k in list(summary)[:8]}, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
