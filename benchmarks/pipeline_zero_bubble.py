"""ringtree's zero-bubble schedules against torch.distributed.pipelining's, side by side in one run.

    .venv/bin/python benchmarks/pipeline_zero_bubble.py --stages 2 --micro-batches 8 --json zb.json

The same `--model gpt` (embedding, 4 blocks, head; the sort task, micro-batches of --batch
sequences) and the same micro-batches go through

- ringtree's zb-v (2p chunks, rank r holding chunks r and 2p-1-r) and torch's ScheduleZBVZeroBubble
  on the same chunks (torch's stage_to_rank "v" mapping);
- ringtree's zb-h1 (p chunks) and torch's ScheduleInterleavedZeroBubble with one stage a rank (the
  ZB-H1 order, torch's "ZB1P");

all on gloo over CPU processes. Each is run once as warm-up, then --repeats times: the table gives
the per-micro-batch losses and every parameter's gradient, ringtree's against torch's (max
relative difference), samples/s (the median of the repeats; one run = forward, B and W of every
micro-batch, no optimizer step) and the measured bubble: 1 - (busy time of every rank) / (p x the
run's makespan), busy being the forward, B and W actions (torch's from its schedule's action
spans is not exposed, so torch's bubble is not measured; its step time is).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

from ringtree.bench import environment
from ringtree.parallel.pipeline.interleaved import InterleavedStage
from ringtree.parallel.pipeline.partition import partition
from ringtree.parallel.pipeline.runtime import ActionSpan, MicroBatch, PipelineStage
from ringtree.processes import spawn
from ringtree.schedules.pipeline import build
from ringtree.train.factories import cross_entropy
from ringtree.train.gpt import GPT
from ringtree.train.language import sort_task

PAIRS = {"zb-v": ScheduleZBVZeroBubble, "zb-h1": ScheduleInterleavedZeroBubble}  # ringtree's : torch's


def _chunks(name: str, p: int) -> list[nn.Module]:
    """Every chunk of the gpt, the same init on every rank: 2p for zb-v, p for zb-h1."""
    torch.manual_seed(0)
    layers = GPT().layers()
    n = 2 * p if name == "zb-v" else p
    return [nn.Sequential(*c) for c in partition(layers, n)]


def _mine(name: str, p: int, rank: int) -> list[int]:
    """The chunks (virtual stages) this rank holds: r and 2p-1-r in the V, r otherwise."""
    return [rank, 2 * p - 1 - rank] if name == "zb-v" else [rank]


def _batches(m: int, b: int) -> list[MicroBatch]:
    x, y = sort_task(b * m)
    return list(zip(x.split(b), y.split(b), strict=True))


def _grads(chunks: list[nn.Module], mine: list[int]) -> dict[str, torch.Tensor]:
    return {
        f"{s}.{n}": q.grad.clone()
        for s in mine
        for n, q in chunks[s].named_parameters()
        if q.grad is not None
    }


def _ringtree(name: str, p: int, rank: int, batches: list[MicroBatch], repeats: int) -> dict[str, Any]:
    chunks = _chunks(name, p)
    mine = _mine(name, p, rank)
    schedule = build(name, p, len(batches), 2 if name == "zb-v" else 1)
    runner: PipelineStage | InterleavedStage
    if name == "zb-v":
        modules = [chunks[s] for s in mine]
        runner = InterleavedStage(modules, rank, list(range(p)), loss_fn=cross_entropy, placement="v")
    else:
        runner = PipelineStage(chunks[rank], rank, list(range(p)), loss_fn=cross_entropy)
    runner.run(schedule, batches)  # warm-up: shapes recorded, receives posted early from now on
    seconds, bubbles, losses = [], [], []
    for _ in range(repeats):
        for c in chunks:
            c.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        run = runner.run(schedule, batches)
        dist.barrier()
        seconds.append(time.perf_counter() - start)
        losses = run.losses
        bubbles.append(_bubble(run.spans, p))
    return {"seconds": seconds, "bubbles": bubbles, "losses": losses, "grads": _grads(chunks, mine)}


def _bubble(spans: list[ActionSpan], p: int) -> float:
    offset = time.time() - time.perf_counter()
    mine = [(s.start + offset, s.end + offset) for s in spans if s.kind != "step"]
    every: list[Any] = [None] * p
    dist.all_gather_object(every, mine)
    start = min(a for rank in every for a, _ in rank)
    end = max(b for rank in every for _, b in rank)
    busy = sum(b - a for rank in every for a, b in rank)
    return 1.0 - busy / (p * (end - start))


def _torch(name: str, p: int, rank: int, batches: list[MicroBatch], repeats: int) -> dict[str, Any]:
    chunks = _chunks(name, p)
    mine = _mine(name, p, rank)
    n = len(chunks)
    stages = [TorchStage(chunks[s], s, n, torch.device("cpu")) for s in mine]
    m = len(batches)
    schedule = PAIRS[name](stages, m, loss_fn=cross_entropy)
    x = torch.cat([a for a, _ in batches])
    y = torch.cat([b for _, b in batches])
    first, last = 0 in mine, n - 1 in mine

    def step() -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        schedule.step(*args, target=y if last else None, losses=losses if last else None)
        return losses

    step()  # warm-up (torch infers the shapes here)
    seconds, losses = [], []
    for _ in range(repeats):
        for c in chunks:
            c.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        losses = step()
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds, "losses": [float(v) for v in losses], "grads": _grads(chunks, mine)}


def worker(rank: int, m: int, b: int, repeats: int) -> dict[str, Any]:
    p = dist.get_world_size()
    batches = _batches(m, b)
    rows = []
    for name in PAIRS:
        ours, theirs = _ringtree(name, p, rank, batches, repeats), _torch(name, p, rank, batches, repeats)
        diffs = [
            float((ours["grads"][k] - g).abs().max() / g.abs().max().clamp_min(1e-30))
            for k, g in theirs["grads"].items()
        ]
        every: list[Any] = [None] * p
        dist.all_gather_object(every, (ours["losses"], theirs["losses"], max(diffs, default=0.0)))
        ours_losses = next(o for o, _, _ in every if o)
        theirs_losses = next(t for _, t, _ in every if t)
        samples = b * m
        rows.append(
            {
                "schedule": name,
                "torch_schedule": PAIRS[name].__name__,
                "stages": p,
                "micro_batches": m,
                "micro_batch_size": b,
                "ringtree_samples_per_s": samples / statistics.median(ours["seconds"]),
                "torch_samples_per_s": samples / statistics.median(theirs["seconds"]),
                "ringtree_bubble_fraction": statistics.median(ours["bubbles"]),
                "max_loss_difference": max(
                    abs(a - c) for a, c in zip(ours_losses, theirs_losses, strict=True)
                ),
                "max_relative_grad_difference": max(d for *_, d in every),
                "ringtree_losses": ours_losses,
                "torch_losses": theirs_losses,
            }
        )
        rows[-1]["speedup"] = rows[-1]["ringtree_samples_per_s"] / rows[-1]["torch_samples_per_s"]
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write every measured figure here")
    args = parser.parse_args()
    if args.json is not None and args.json.exists():
        parser.error(f"--json {args.json} exists; remove it or name another file")
    if args.micro_batches < 2 * args.stages:
        parser.error(f"--micro-batches must be at least 2 x --stages = {2 * args.stages} (zb-v needs it)")
    rows = spawn(worker, args.stages, (args.micro_batches, args.batch, args.repeats), timeout_s=600)[0][
        "rows"
    ]
    print(f"{'ringtree':>9} {'torch':>30} {'rt samples/s':>13} {'torch samples/s':>16} {'x':>5} "
          f"{'rt bubble':>9} {'loss diff':>9} {'grad diff':>9}")  # fmt: skip
    for r in rows:
        print(
            f"{r['schedule']:>9} {r['torch_schedule']:>30} {r['ringtree_samples_per_s']:>13.1f} "
            f"{r['torch_samples_per_s']:>16.1f} {r['speedup']:>5.2f} {r['ringtree_bubble_fraction']:>9.3f} "
            f"{r['max_loss_difference']:>9.1e} {r['max_relative_grad_difference']:>9.1e}"
        )
    if args.json is not None:
        load = Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "n/a"
        env = {**environment(), "backend": "gloo", "world_size": args.stages, "loadavg": load}
        out = {"environment": env, "rows": rows}
        args.json.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
