"""Activation checkpointing: peak memory and step time of one training step, with and without.

    .venv/bin/python benchmarks/checkpointing.py --json checkpointing.json

The model is ringtree's vit made deep (16 blocks of width 64, batch 512 digits-shaped inputs),
checkpointed in sqrt(16) = 4 segments by default. Each variant runs in a fresh subprocess and
rounds alternate between variants, so machine-load drift touches both alike; the median round is
reported. Peak memory of a step is measured as:
- CPU: the peak resident set size during the step minus the resident size just before it (Linux
  VmHWM, reset through /proc/self/clear_refs), with glibc's mmap threshold pinned at 64 KiB so
  that every tensor of more than 64 KiB is its own mapping, returned to the system when freed:
  the figure follows the live tensors instead of the allocator's cache;
- CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() before the step.
Warm-up steps are not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ringtree.bench import environment
from ringtree.train.models import ViT
from ringtree.train.techniques import enable_checkpointing

DEPTH, DIM, BATCH = 16, 64, 512
WARMUP, STEPS = 1, 3


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def measure(segments: int, device: str, batch: int = BATCH) -> dict[str, float]:
    """In this process: median peak bytes and seconds of a training step (segments 0: off)."""
    torch.manual_seed(0)
    model = ViT(dim=DIM, depth=DEPTH).to(device)
    if segments:
        enable_checkpointing(model, segments)
    x, y = torch.rand(batch, 64, device=device), torch.randint(0, 10, (batch,), device=device)
    peaks, times = [], []
    for i in range(WARMUP + STEPS):
        before = _reset_peak(device)
        start = time.perf_counter()
        F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=False)  # gradients stay allocated: only activations differ
        if i >= WARMUP:
            peaks.append(_peak(device) - before)
            times.append(elapsed)
    return {"peak_bytes": statistics.median(peaks), "step_time_s": statistics.median(times)}


def _reset_peak(device: str) -> int:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    return _rss("VmRSS")


def _peak(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device == "cuda" else _rss("VmHWM")


def in_subprocess(segments: int, device: str, batch: int = BATCH) -> dict[str, float]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, __file__, "--worker", str(segments), "--device", device, "--batch", str(batch)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=600)
    result: dict[str, float] = json.loads(out.stdout.splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--segments", type=int, default=4, help="checkpointed segments (default sqrt(16))")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(measure(args.worker, args.device, args.batch)))
        return
    rounds: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        rounds["off"].append(in_subprocess(0, args.device, args.batch))
        rounds["on"].append(in_subprocess(args.segments, args.device, args.batch))
    report(rounds, args)


def report(rounds: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    med = {
        k: {m: statistics.median(r[m] for r in v) for m in ("peak_bytes", "step_time_s")}
        for k, v in rounds.items()
    }
    result: dict[str, Any] = {
        "environment": environment(args.device),
        "model": f"vit depth={DEPTH} dim={DIM}",
        "batch": args.batch,
        "segments": args.segments,
        "memory_measure": "peak RSS delta (CPU)" if args.device == "cpu" else "max_memory_allocated delta",
        "off": med["off"],
        "on": med["on"],
        "memory_ratio": med["on"]["peak_bytes"] / med["off"]["peak_bytes"],
        "time_ratio": med["on"]["step_time_s"] / med["off"]["step_time_s"],
        "rounds": rounds,
    }
    print("# " + "  ".join(f"{k}={v}" for k, v in result["environment"].items()))
    print(f"# {result['model']}, batch {args.batch}, {args.segments} segments, {result['memory_measure']}")
    for k in ("off", "on"):
        mib, seconds = med[k]["peak_bytes"] / 2**20, med[k]["step_time_s"]
        print(f"checkpointing {k:>3}: peak {mib:8.1f} MiB  step {seconds:.3f} s")
    print(f"memory on/off = {result['memory_ratio']:.2f}   time on/off = {result['time_ratio']:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
