"""Checkpoint saves: how long the training loop waits per save, synchronous against --checkpoint-async.

    .venv/bin/python benchmarks/checkpoint_save.py --json checkpoint_save.json

One spawned world (2 gloo ranks by default) trains an MLP of about 6.3 M parameters under ZeRO-3
twice, with a sharded checkpoint every 10 steps (3 saves a run): once with synchronous saves,
once with --checkpoint-async. The summary's checkpoint_s is the median wait per save on the
slowest rank; the ratio async / sync is what --checkpoint-async saves the loop. Runs alternate
(sync, async, sync, async, ...) so that machine-load drift touches both alike; each figure is
the median over the rounds. The first save of a run includes DCP's planning warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ringtree.bench import environment
from ringtree.processes import spawn
from ringtree.train import TrainConfig, Trainer

WIDTH, STEPS, EVERY, BATCH = 2048, 30, 10, 32


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(512, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)
    )


def data(ranks: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * BATCH * ranks, 512, generator=g)
    return TensorDataset(x, x[:, :1].clone())


def run(rank: int, ranks: int, rounds: int, folder: str) -> dict[str, Any]:
    base = TrainConfig(
        epochs=1, batch_size=BATCH, lr=1e-3, progress=False, zero=3, checkpoint_every=EVERY, straggler_every=0
    )
    out: dict[str, Any] = {"sync": [], "async": [], "environment": environment("cpu")}
    for k in range(rounds):
        for name in ("sync", "async"):
            cfg = replace(base, checkpoint_dir=f"{folder}/{name}-{k}", checkpoint_async=name == "async")
            summary = Trainer(model(), data(ranks), nn.MSELoss(), cfg).fit()
            out[name].append({"checkpoint_s": summary["checkpoint_s"], "step_time_s": summary["step_time_s"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ringtree-ckpt-") as folder:
        result = spawn(run, args.nproc, (args.nproc, args.rounds, folder), timeout_s=1800)[0]
    sync = statistics.median(r["checkpoint_s"] for r in result["sync"])
    asyn = statistics.median(r["checkpoint_s"] for r in result["async"])
    ratios = [
        a["checkpoint_s"] / s["checkpoint_s"] for s, a in zip(result["sync"], result["async"], strict=True)
    ]
    result |= {
        "model": f"MLP 512-{WIDTH}-{WIDTH}-1, ZeRO-3, {args.nproc} ranks",
        "saves_per_run": STEPS // EVERY,
        "sync_checkpoint_s": sync,
        "async_checkpoint_s": asyn,
        "median_ratio": statistics.median(ratios),
    }
    print("# " + "  ".join(f"{k}={v}" for k, v in result["environment"].items()))
    print(f"# {result['model']}, a save every {EVERY} steps, {args.rounds} rounds")
    print(f"loop wait per save: synchronous {sync:.3f} s   --checkpoint-async {asyn:.3f} s")
    print(f"async / sync = {result['median_ratio']:.2f} (median of the rounds' ratios)")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
