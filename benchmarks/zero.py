"""ZeRO-3: ringtree's ShardedDataParallel against torch's FSDP2 in one world, and the memory per rank.

    flock /tmp/ringtree-bench.lock .venv/bin/python benchmarks/zero.py --nproc 4 --json zero.json \
        --plot docs/images/zero-memory.png

Both train the same MLP on the same synthetic batches with AdamW: ringtree ZeRO-3 (one bucket per
linear layer, its ring reduce-scatter and all-gather over shared memory; and over torch's own
collectives, `native`) and FSDP2 (`torch.distributed.fsdp.fully_shard` per linear layer, then
the root). Variants are interleaved over several rounds so that a drift in machine load touches
all alike; the ratio to FSDP2 is taken per round and its median reported, absolute figures are
each variant's median round. Warm-up steps are not timed; every rank runs one intra-op thread.
Model-state memory (parameters + gradients + optimizer states, counted from the tensors after a
step, the fullest rank) is measured for ringtree ZeRO 0-3 and FSDP2; `--plot` draws it per rank
against world sizes 1, 2 and 4.
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

from ringtree.bench import environment
from ringtree.parallel import DistributedDataParallel, ShardedDataParallel
from ringtree.processes import spawn
from ringtree.train.memory import MB, model_state_bytes


@dataclass(frozen=True)
class Setup:
    width: int = 1024  # 3 hidden layers of 1024: about 2.4M parameters, 9.5 MB of fp32 weights
    batch: int = 64  # samples per rank per step
    bucket_mb: float = 1.0  # below one layer's 4 MB: a bucket per linear layer, as FSDP2's units
    warmup: int = 2
    steps: int = 8
    rounds: int = 3


VARIANTS = ("fsdp2", "ringtree_ring", "ringtree_native")


def model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def wrap(net: nn.Sequential, variant: str, setup: Setup) -> tuple[nn.Module, list[nn.Parameter]]:
    """The wrapped model and what the optimizer steps."""
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net, list(net.parameters())
    if variant.startswith("zero"):
        zero = int(variant[4:])
        if zero == 0:
            return DistributedDataParallel(net, bucket_cap_mb=setup.bucket_mb), list(net.parameters())
        sdp = ShardedDataParallel(net, zero=zero, bucket_cap_mb=setup.bucket_mb)
        return sdp, sdp.shard_parameters()
    algorithm = variant.removeprefix("ringtree_")
    sdp = ShardedDataParallel(net, zero=3, algorithm=algorithm, bucket_cap_mb=setup.bucket_mb)
    return sdp, sdp.shard_parameters()


def measure(variant: str, setup: Setup, timed: bool = True) -> dict[str, float]:
    """Samples per second (slowest rank) and the fullest rank's model state after the steps."""
    net = model(setup.width)
    wrapped, params = wrap(net, variant, setup)
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(setup.batch, 256, generator=g), torch.randint(0, 10, (setup.batch,), generator=g)

    def step() -> None:
        opt.zero_grad(set_to_none=False)  # keep the gradients: counted with the state below
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()

    seconds = _timed(step, setup) if timed else 1.0
    if not timed:
        step()
    state = torch.tensor([float(model_state_bytes(net, opt))], dtype=torch.float64)
    dist.all_reduce(state, op=dist.ReduceOp.MAX)
    if isinstance(wrapped, ShardedDataParallel | DistributedDataParallel):
        wrapped.close()
    return {
        "samples_per_s": setup.batch * dist.get_world_size() * setup.steps / seconds,
        "model_state_mb": float(state.item()) / MB,
    }


def _timed(step: Callable[[], None], setup: Setup) -> float:
    for _ in range(setup.warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(setup.steps):
        step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def speed_worker(rank: int, setup: Setup) -> dict[str, Any]:
    torch.set_num_threads(1)
    rounds: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(setup.rounds):
        for variant in VARIANTS:
            rounds[variant].append(measure(variant, setup))
    median = {v: sorted(r, key=lambda m: m["samples_per_s"])[len(r) // 2] for v, r in rounds.items()}
    ratios = {  # a round's ratio compares variants measured moments apart; the median is the figure
        v: statistics.median(
            m["samples_per_s"] / f["samples_per_s"] for m, f in zip(r, rounds["fsdp2"], strict=True)
        )
        for v, r in rounds.items()
    }
    ddp = measure("zero0", setup, timed=False)["model_state_mb"]
    env = {**environment(), "parameters": sum(p.numel() for p in model(setup.width).parameters())}
    return {"variants": median, "ratios_vs_fsdp2": ratios, "ddp_model_state_mb": ddp, "environment": env}


def memory_worker(rank: int, setup: Setup) -> dict[str, float]:
    """Model state per rank of ZeRO 0-3 at this world size (one untimed step each)."""
    torch.set_num_threads(1)
    return {f"zero{z}": measure(f"zero{z}", setup, timed=False)["model_state_mb"] for z in range(4)}


def plot(curves: dict[str, list[float]], sizes: list[int], path: Path, env: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, values in curves.items():
        ax.plot(sizes, values, marker="o", label=name.replace("zero", "ZeRO-"))
    ax.set_xticks(sizes)
    ax.set_xlabel("data-parallel ranks")
    ax.set_ylabel("model state per rank (MiB)")
    ax.set_title(
        f"params + grads + AdamW states, {env['parameters'] / 1e6:.1f}M-parameter MLP\n"
        f"torch {env['torch']}, {env['backend']}, {env['host_cores']} cores",
        fontsize=9,
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=Setup.steps)
    parser.add_argument("--rounds", type=int, default=Setup.rounds)
    parser.add_argument("--width", type=int, default=Setup.width)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    setup = Setup(width=args.width, steps=args.steps, rounds=args.rounds)
    result = spawn(speed_worker, args.nproc, (setup,), timeout_s=1800)[0]
    v = result["variants"]
    summary: dict[str, Any] = {
        "ringtree_samples_per_s": v["ringtree_ring"]["samples_per_s"],
        "fsdp_samples_per_s": v["fsdp2"]["samples_per_s"],
        "ratio_ringtree_vs_fsdp": result["ratios_vs_fsdp2"]["ringtree_ring"],  # target >= 1.0
        "ratio_ringtree_native_vs_fsdp": result["ratios_vs_fsdp2"]["ringtree_native"],
        "ringtree_model_state_mb": v["ringtree_ring"]["model_state_mb"],
        "fsdp_model_state_mb": v["fsdp2"]["model_state_mb"],
        "ddp_model_state_mb": result["ddp_model_state_mb"],
        "variants": v,
        "setup": setup.__dict__,
        "environment": result["environment"],
    }
    if args.plot is not None:
        sizes = [1, 2, 4]
        per_size = [spawn(memory_worker, n, (setup,), timeout_s=600)[0] for n in sizes]
        curves = {f"zero{z}": [m[f"zero{z}"] for m in per_size] for z in range(4)}
        summary["model_state_mb_by_world_size"] = {"world_sizes": sizes, **curves}
        plot(curves, sizes, args.plot, result["environment"])
    print(json.dumps({k: summary[k] for k in list(summary)[:7]}, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
