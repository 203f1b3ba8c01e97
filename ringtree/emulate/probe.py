"""What the shaping really delivers: node 0 to every other node, back to back and after a pause.

Run by torchrun, one rank per emulated node: `python -m ringtree.emulate.probe OUT.json RATES`
(RATES: each node's configured bits/s, comma-separated). Rank 0 writes, per node i > 0, the
configured rate of the path (the slower of the two nodes' links) and the measured one, in
Gbit/s, measured twice: after a warm-up, back to back, and again after an idle pause, when a
token bucket would have refilled (its burst is kept near 1 ms, so it should not matter).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch.distributed as dist

from ringtree.doctor import measure_pair
from ringtree.processes import run_under_torchrun

IDLE_PAUSE_S = 1.0
ITERS = 3


def message_bytes(rate: float) -> int:
    """About 50 ms of the configured rate, between 256 KiB and 16 MiB."""
    return int(min(max(rate / 8 * 0.05, 256 << 10), 16 << 20))


def probe(rank: int, rates: list[float]) -> list[dict[str, Any]]:
    rows = []
    for i in range(1, dist.get_world_size()):
        configured = min(rates[0], rates[i])
        size = message_bytes(configured)
        row: dict[str, Any] = {"node": i, "configured_gbps": configured / 1e9, "bytes": size}
        for key, pause in (("measured_gbps", 0.0), ("after_idle_gbps", IDLE_PAUSE_S)):
            time.sleep(pause)
            if rank in (0, i):
                got = measure_pair(0, i, size, ITERS)
                if got is not None:
                    row[key], row["latency_us"] = got
            dist.barrier()
        rows.append(row)
    return rows


def main(argv: list[str]) -> None:
    out, rates = argv[0], [float(r) for r in argv[1].split(",")]
    rows = run_under_torchrun(probe, (rates,))
    if os.environ["RANK"] == "0":
        with open(out, "w") as f:
            json.dump(rows, f)
    sys.stdout.flush()
    os._exit(0)  # as the CLI does under torchrun: no interpreter teardown after a clean run


if __name__ == "__main__":
    main(sys.argv[1:])
