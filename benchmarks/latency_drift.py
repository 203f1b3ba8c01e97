"""How much a small all-reduce's time drifts on this host, across the link and without one.

docs/results/emulated-sweeps.md ("Where it still misses") asks whether the emulated sweep's misses on the mlp
(a 104 kB gradient, about 3 ms a step on 2 nodes) come from the shaped link or from the host.
Round after round this script measures, back to back and on the same quiet machine:

- `bench` of ring and native at 64 kB and 128 kB across a link shaped to `--rate`;
- the same across a link shaped to 100 Gbit/s (its 12.5 MB bucket never runs dry: the veth
  and TCP as they are, without the rate);
- the same on ONE emulated node with two ranks (native: gloo's TCP over that node's loopback);
- `train --model mlp` on 2 nodes at `--rate`, ring and native: its mean communication per step.

Each quantity's rounds are summarised as min / median / max. Needs root or CAP_NET_ADMIN:

    flock /tmp/ringtree-bench.lock python benchmarks/latency_drift.py --rounds 6 \
        --out docs/data/latency-drift.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIZES = (65536, 131072)
ALGORITHMS = ("ring", "native")


def ringtree(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "ringtree", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ringtree {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def bench(nodes: int, ranks: int, rate: str, out: Path) -> dict[str, float]:
    """Milliseconds per all-reduce, keyed 'ring 64K', from 100 timed calls per row."""
    ringtree(
        "emulate", "--nodes", str(nodes), "--nproc-per-node", str(ranks), "--inter-bw", rate,
        "--no-measure", "--", "bench", "--algorithms", ",".join(ALGORITHMS),
        "--min-bytes", str(SIZES[0]), "--max-bytes", str(SIZES[-1]), "--iters", "100",
        "--warmup", "5", "--json", str(out),
    )  # fmt: skip
    rows = json.loads(out.read_text())
    return {f"{r['algorithm']} {r['bytes'] // 1024}K": r["time_us"] / 1e3 for r in rows}


def train(rate: str, algorithm: str, out: Path) -> dict[str, float]:
    """The mlp on 2 nodes: mean step and communication per step (ms)."""
    ringtree(
        "emulate", "--nodes", "2", "--inter-bw", rate, "--no-measure", "--", "train", "--model", "mlp",
        "--algorithm", algorithm, "--epochs", "3", "--no-progress", "--json", str(out),
    )  # fmt: skip
    s = json.loads(out.read_text())
    return {f"{algorithm} step": s["step_time_s"] * 1e3, f"{algorithm} comm": s["comm_time_s"] * 1e3}


def one_round(rate: str, tmp: Path) -> dict[str, dict[str, float]]:
    link = bench(2, 1, rate, tmp / "link.json")
    unshaped = bench(2, 1, "100gbit", tmp / "unshaped.json")
    loopback = bench(1, 2, rate, tmp / "loopback.json")
    runs = {**train(rate, "ring", tmp / "ring.json"), **train(rate, "native", tmp / "native.json")}
    return {f"bench {rate}": link, "bench 100gbit": unshaped, "bench 1 node x 2": loopback, "train": runs}


def summary(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, list[float]]]:
    """[min, median, max] over rounds of every quantity."""
    out: dict[str, dict[str, list[float]]] = {}
    for group in rounds[0]:
        out[group] = {}
        for key in rounds[0][group]:
            values = [r[group][key] for r in rounds]
            out[group][key] = [min(values), statistics.median(values), max(values)]
    return out


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ringtree-drift-") as tmp:
        for i in range(args.rounds):
            started = time.strftime("%H:%M:%S", time.gmtime())
            rounds.append({"started": started, **one_round(args.rate, Path(tmp))})
            with open("/proc/loadavg") as f:
                rounds[-1]["load_average_1m"] = float(f.read().split()[0])
            print(f"round {i}: {json.dumps(rounds[-1])}", flush=True)
    measured = [{k: v for k, v in r.items() if isinstance(v, dict)} for r in rounds]
    record: dict[str, Any] = {
        "environment": {
            "python": platform.python_version(),
            "torch": _torch_version(),
            "cores": os.cpu_count(),
        },
        "command": " ".join(sys.argv),
        "rounds": rounds,
        "summary_min_median_max_ms": summary(measured),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for group, values in record["summary_min_median_max_ms"].items():
        for key, (lo, mid, hi) in values.items():
            print(f"{group:18} {key:12} {lo:6.2f} {mid:6.2f} {hi:6.2f}")


if __name__ == "__main__":
    main()
