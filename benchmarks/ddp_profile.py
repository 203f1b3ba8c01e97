"""One DDP variant of ddp_throughput.py for many steps, to profile: step time and bucket timeline.

    .venv/bin/python benchmarks/ddp_profile.py --variant ring --steps 60
    .venv/bin/python benchmarks/ddp_profile.py --variant ring --steps 40 --timeline 2
    .venv/bin/python benchmarks/ddp_profile.py --variant ring --steps 80 --split
    py-spy record --subprocesses -r 500 -f raw -o ring.txt -- \
        .venv/bin/python benchmarks/ddp_profile.py --variant ring --steps 60

Trains the benchmark's MLP with one variant (same setup: 4 ranks, 64 samples per rank, 1 MiB
bucket cap, one intra-op thread) and prints, per rank, the median step, the median exposed
communication, the CPU per step (every thread) and the last step's bucket spans in ms from the
step's start. `--timeline K` also prints the last K steps of every rank on one clock (ms from
the earliest rank's start of that step; time.perf_counter is the system's monotonic clock):
forward done, backward's compute done (`compute`), each bucket's all-reduce (start, end), and
when backward returned; the gap between the last bucket's end and backward's return is the
wake-up of the training thread. `--split` splits each rank's exposure per step into its lead (how
long before the last rank it finished backward's compute) and the tail after the last rank's.
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

from ringtree.parallel import DistributedDataParallel
from ringtree.processes import spawn


def worker(rank: int, variant: str, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    setup = Setup()
    net = model(setup.width)
    ddp = wrap(net, variant, setup)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(setup.batch, 256, generator=g), torch.randint(0, 10, (setup.batch,), generator=g)
    computed: list[float] = []
    if isinstance(ddp, DistributedDataParallel):
        finish = ddp._finish  # the end-of-backward callback: backward's compute is done

        def timed_finish() -> None:
            computed.append(time.perf_counter())
            finish()

        ddp._finish = timed_finish  # type: ignore[method-assign]
    times, exposed, rows = [], [], []
    cpu = time.process_time()
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        row = {"start": start, "forward": forward, "backward": backward, "compute": None, "buckets": []}
        if isinstance(ddp, DistributedDataParallel):
            exposed.append(ddp.last_sync.exposed_s)
            row["compute"] = computed[-1]
            row["buckets"] = [(s.bucket, s.start, s.end) for s in ddp.last_sync.spans]
        rows.append(row)
    cpu_ms = (time.process_time() - cpu) / steps * 1e3
    if isinstance(ddp, DistributedDataParallel):
        ddp.close()
    warm, last = setup.warmup, rows[-1]
    return {
        "step_ms": statistics.median(times[warm:]) * 1e3,
        "exposed_ms": statistics.median(exposed[warm:]) * 1e3 if exposed else None,
        "cpu_ms": cpu_ms,
        "last_step_buckets_ms": [
            (b, _ms(s, last["start"]), _ms(e, last["start"])) for b, s, e in last["buckets"]
        ],
        "rows": rows,
    }


def _ms(t: float, origin: float) -> float:
    return round((t - origin) * 1e3, 1)


def timeline(results: list[dict[str, Any]], k: int) -> None:
    steps = len(results[0]["rows"])
    for s in range(steps - k, steps):
        origin = min(r["rows"][s]["start"] for r in results)
        print(f"step {s} (ms from the earliest rank's start)")
        for rank, r in enumerate(results):
            row = r["rows"][s]
            at = {n: _ms(row[n], origin) for n in ("start", "forward", "backward") if row[n] is not None}
            if row["compute"] is not None:
                at["compute"] = _ms(row["compute"], origin)
            buckets = [(b, _ms(a, origin), _ms(e, origin)) for b, a, e in row["buckets"]]
            print(f"  rank {rank}: {at} buckets {buckets}")


def split(results: list[dict[str, Any]], skip: int) -> None:
    """Each rank's exposure, per step, split into its lead (how long before the last rank it
    finished backward's compute) and the tail (from the last rank's compute end to its return);
    and where the last rank's last two buckets lie after its compute end."""
    lead, tail, late = [], [], []
    for s in range(skip, len(results[0]["rows"])):
        rows = [r["rows"][s] for r in results]
        last = max(row["compute"] for row in rows)
        lead += [(last - row["compute"]) * 1e3 for row in rows]
        tail += [(row["backward"] - last) * 1e3 for row in rows]
        slowest = next(row for row in rows if row["compute"] == last)
        late.append([(e - last) * 1e3 for _, _, e in slowest["buckets"][-2:]])
        late[-1].append((slowest["buckets"][-1][2] - slowest["buckets"][-1][1]) * 1e3)
    med, mean = statistics.median, statistics.fmean
    print(f"lead (ms): median {med(lead):.1f} mean {mean(lead):.1f}", end="; ")
    print(f"tail: median {med(tail):.1f} mean {mean(tail):.1f}")
    b1, b2, took = (med(x) for x in zip(*late, strict=True))
    print(f"last rank, ms after its compute end: next-to-last bucket ends {b1:.1f},", end=" ")
    print(f"last ends {b2:.1f} (took {took:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=list(VARIANTS), default="ring")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument(
        "--timeline", type=int, default=0, metavar="K", help="print the last K steps' timeline"
    )
    parser.add_argument("--split", action="store_true", help="split each rank's exposure into lead and tail")
    args = parser.parse_args()
    results = spawn(worker, args.nproc, (args.variant, args.steps), timeout_s=900)
    for rank, row in enumerate(results):
        shown = {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items() if k != "rows"}
        print(f"rank {rank}: {shown}")
    if args.timeline:
        timeline(results, min(args.timeline, args.steps))
    if args.split and results[0]["rows"][0]["compute"] is not None:
        split(results, Setup.warmup)


if __name__ == "__main__":
    main()
