"""Small synthetic Kineto traces for the trace tests: steps, kernel launches, collectives."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

BASE_NS = 1_790_000_000_000_000_000  # baseTimeNanoseconds: ts are microseconds after it


def gpu_rank(
    rank: int,
    world: int,
    steps: int = 4,
    step_us: float = 10_000.0,
    late_us: float = 0.0,
    kernel: str = "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
    collective: str = "allreduce",
    nelems: int = 1 << 20,
    seq: bool = False,
) -> dict[str, Any]:
    """One rank: each step a 6 ms compute kernel, then a collective launched at 6 ms (+ late_us on
    this rank, under 3 ms) that ends at 9 ms on every rank."""
    events: list[dict[str, Any]] = []
    corr = 0

    def launch(ts: float, name: str, dur: float, **args: Any) -> None:
        nonlocal corr
        corr += 1
        events.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "pid": 1,
                "tid": 1,
                "ts": ts,
                "dur": 4.0,
                "args": {"correlation": corr},
            }
        )
        events.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": name,
                "pid": 0,
                "tid": 7,
                "ts": ts + 5,
                "dur": dur,
                "args": {"stream": 7, "correlation": corr, "device": 0, **args},
            }
        )

    for k in range(steps):
        t0 = k * step_us
        events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{k}",
                "pid": 1,
                "tid": 1,
                "ts": t0,
                "dur": step_us,
            }
        )
        launch(t0 + 10, "ampere_sgemm_128x64_nn", 5_990.0)
        start = t0 + 6_000 + late_us
        args = {
            "Collective name": collective,
            "In msg nelems": nelems,
            "Out msg nelems": nelems,
            "Group size": world,
            "dtype": "Float",
            "Process Group Name": "0",
            "Process Group Description": "default_pg",
            "Process Group Ranks": str(list(range(world))),
        }
        if seq:
            args["Seq"] = k
        launch(start, kernel, 1.0, **args)
        events[-1]["dur"] = (t0 + 9_000) - events[-1]["ts"]  # every rank's call ends together
    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
        "baseTimeNanoseconds": BASE_NS,
        "traceEvents": events,
    }


def write(doc: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            json.dump(doc, f)
    else:
        path.write_text(json.dumps(doc))
    return path
