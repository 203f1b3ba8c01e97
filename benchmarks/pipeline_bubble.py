"""Pipeline measurements: bubble against (p-1)/(m+p-1), activation memory, sync vs async throughput.

    .venv/bin/python benchmarks/pipeline_bubble.py --stages 2 4 --out docs
    .venv/bin/python benchmarks/pipeline_bubble.py --target-only --json bubble.json   # the vit target
    .venv/bin/python benchmarks/pipeline_bubble.py --target-only --pin --json bubble.json  # a core per stage
    .venv/bin/python benchmarks/pipeline_bubble.py --gpt --virtual-stages 2 --json gpt.json  # interleaved
    .venv/bin/python benchmarks/pipeline_bubble.py --gpt --zero-bubble --json zb.json  # + zb-h1 ... dualpipev

The gpt rows run `--model gpt` (embedding, 4 blocks, head) on the sort task, 2 stages and 8
micro-batches of 32 sequences, under gpipe and 1f1b (the model cut in 2) and interleaved 1F1B
(cut in 2 x V chunks, rank j holding chunks j and 2 + j), each the median of --repeats runs.
With --zero-bubble the same gpt also runs zb-h1 and zb-h2 (cut in p) and zb-v and dualpipev (cut
in 2p, rank j holding chunks j and 2p-1-j), and every gpt row gets the schedule's formula with the
measured times: the replay (ringtree.sim.training.pipeline) of the schedule on each stage's
measured mean F, B and W (B + W: the whole backward where it is not split), without transfers.

The target rows run the real `vit` cut into 2 stages with 8 micro-batches of 32 (what
`ringtree train --model vit --pp 2 --micro-batches 8` runs) under gpipe and 1f1b, and report the
measured bubble beside (p-1)/(m+p-1) and their difference (the runtime's goal: at most 0.15).
The bubble of one run is 1 - (sum of every stage's forward and backward time) / (p x the run's
makespan, first action's start to last action's end), which is (p-1)/(m+p-1) for equal stages
and free transfers. `--pin` binds stage j's process to core j, as one device per stage would be,
so that the stages do not take each other's core when a transfer wakes the other process.

For the bubble and the throughput every stage is a small linear layer that sleeps `--forward-ms`
in its forward and twice that in its backward: a stand-in for a device's compute, so that the
stages of one pipeline do not compete for the host's cores (the reference machine has 2) and the
bubble measured is the schedule's. The memory rows use the real `vit` (4 layers, one per stage at
p = 4). Each case runs once as warm-up and then `--repeats` times; the median is reported, and
the replay of the same schedule (ringtree.sim.training.pipeline) with the measured per-stage times
predicts each step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtree.bench import environment
from ringtree.parallel.pipeline.interleaved import InterleavedStage
from ringtree.parallel.pipeline.partition import partition
from ringtree.parallel.pipeline.runtime import ActionSpan, MicroBatch, PipelineStage
from ringtree.plots import plot_bubble, plot_gantt
from ringtree.processes import spawn
from ringtree.schedules.pipeline import PipelineSchedule, build, theoretical_bubble_fraction
from ringtree.sim.training.pipeline import StageCosts, replay_pipeline
from ringtree.train import trace
from ringtree.train.factories import cross_entropy
from ringtree.train.gpt import GPT
from ringtree.train.language import sort_task
from ringtree.train.models import ViT
from ringtree.train.pipelining import theoretical_bubble
from ringtree.train.stages import model_layers

MICRO_BATCHES = (1, 2, 4, 8, 16)
STREAM = 32  # micro-batches for the throughput comparison


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        time.sleep(seconds)
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.seconds)
        return grad.clone(), None


class SleepStage(nn.Module):
    """Linear(10, 10), then a sleep of `seconds` forward and 2 x `seconds` backward."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.linear, self.seconds = nn.Linear(10, 10), seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.linear(x), self.seconds)  # type: ignore[no-any-return, no-untyped-call]


def _batches(m: int, b: int = 8, features: int = 10) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(m)
    return [
        (torch.randn(b, features, generator=g), torch.randint(0, 10, (b,), generator=g)) for _ in range(m)
    ]


def _vit_batches(m: int, b: int = 32) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(0)
    return [(torch.rand(b, 64, generator=g), torch.randint(0, 10, (b,), generator=g)) for _ in range(m)]


def _timed(
    stage: PipelineStage, name: str, m: int, batches: list[MicroBatch] | None = None
) -> list[ActionSpan]:
    """Run the schedule once after a barrier; this stage's spans in wall-clock seconds."""
    dist.barrier()
    run = stage.run(build(name, len(stage.ranks), m), _batches(m) if batches is None else batches)
    offset = time.time() - time.perf_counter()
    return [ActionSpan(s.kind, s.micro_batch, s.start + offset, s.end + offset) for s in run.spans]


def _bubble_case(
    stage: PipelineStage, name: str, m: int, repeats: int, batches: list[MicroBatch] | None = None
) -> dict[str, Any] | None:
    p = len(stage.ranks)
    _timed(stage, name, m, batches)  # warm-up
    measured: list[tuple[float, float, list[float], list[float]]] = []
    for _ in range(repeats):
        spans: list[Any] = [None] * p
        dist.all_gather_object(spans, _timed(stage, name, m, batches))
        measured.append(_analyse(spans))
    if dist.get_rank():
        return None
    bubble, step, fwd, bwd = sorted(measured)[len(measured) // 2]  # the median bubble's repeat
    predicted = replay_pipeline(build(name, p, m), StageCosts(tuple(fwd), tuple(bwd)))
    return {
        "schedule": name,
        "stages": p,
        "micro_batches": m,
        "bubble_fraction": bubble,
        "theoretical_bubble_fraction": theoretical_bubble_fraction(p, m),
        "step_time_s": step,
        "predicted_step_time_s": predicted.step_time_s,
        "predicted_bubble_fraction": predicted.bubble_fraction,
    }


def _analyse(spans: list[list[ActionSpan]]) -> tuple[float, float, list[float], list[float]]:
    """(bubble, makespan, mean forward per stage, mean backward per stage) of one run."""
    work = [[s for s in stage if s.kind != "step"] for stage in spans]
    start = min(s.start for stage in work for s in stage)
    end = max(s.end for stage in work for s in stage)
    busy = sum(s.end - s.start for stage in work for s in stage)
    fwd = [statistics.mean(s.end - s.start for s in stage if s.kind == "forward") for stage in work]
    bwd = [statistics.mean(s.end - s.start for s in stage if s.kind == "backward") for stage in work]
    return 1 - busy / (len(spans) * (end - start)), end - start, fwd, bwd


def _throughput(stage: PipelineStage, m: int) -> dict[str, float]:
    """Samples/s over STREAM micro-batches: 1f1b flushing every m, pipedream never (interleaved, 3 rounds)."""
    seconds: dict[str, list[float]] = {"1f1b": [], "pipedream": []}
    for _ in range(3):
        for name in seconds:
            runs = STREAM // m if name == "1f1b" else 1
            dist.barrier()
            start = time.perf_counter()
            for _ in range(runs):
                stage.run(build(name, len(stage.ranks), STREAM // runs), _batches(STREAM // runs))
            dist.barrier()
            seconds[name].append(time.perf_counter() - start)
    return {f"{k}_samples_per_s": STREAM * 8 / statistics.median(v) for k, v in seconds.items()}


def _memory(rank: int, p: int, m: int) -> dict[str, list[int]]:
    """Peak bytes saved for backward per stage of the vit, gpipe vs 1f1b (m micro-batches of 32)."""
    torch.manual_seed(0)
    stage = PipelineStage(partition(model_layers(ViT(depth=2)), p)[rank], rank, list(range(p)))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.rand(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(m)]
    out: dict[str, list[int]] = {}
    for name in ("gpipe", "1f1b"):
        peak = stage.run(build(name, p, m), batches).peak_activation_bytes
        every: list[Any] = [None] * p
        dist.all_gather_object(every, peak)
        out[name] = every
    return out


def _gantt(
    stage: PipelineStage, name: str, m: int, batches: list[MicroBatch] | None = None
) -> list[dict[str, Any]]:
    every: list[Any] = [None] * len(stage.ranks)
    dist.all_gather_object(every, _timed(stage, name, m, batches))
    return [{"stage": j, **vars(s)} for j, spans in enumerate(every) for s in spans]


def _loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "n/a"


def _pin(rank: int) -> int:
    """Bind every thread of this process (main, gloo's transport) to one core of those allowed."""
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[rank % len(cpus)]
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), {cpu})
    return cpu


def target_worker(rank: int, m: int, repeats: int, pin: bool = False) -> dict[str, Any]:
    """The vit cut into p stages, m micro-batches of 32: bubble rows and a Gantt chart per schedule."""
    if pin:
        _pin(rank)
    p = dist.get_world_size()
    torch.manual_seed(0)
    stage = PipelineStage(partition(model_layers(ViT()), p)[rank], rank, list(range(p)))
    batches = _vit_batches(m)
    rows = [_bubble_case(stage, n, m, repeats, batches) for n in ("gpipe", "1f1b")]
    for row in rows:
        if row is not None:
            row["model"] = "vit"
            row["excess"] = row["bubble_fraction"] - row["theoretical_bubble_fraction"]
    return {
        "bubble": [r for r in rows if r is not None],
        "gantt": {n: _gantt(stage, n, m, batches) for n in ("gpipe", "1f1b")},
    }


def _formula(schedule: PipelineSchedule, every: list[list[ActionSpan]]) -> tuple[float, list[list[float]]]:
    """The schedule's bubble replayed on each stage's measured mean F, B and W (free transfers), and
    those times ([F, B, W] ms per stage, a whole stage's: V chunks' worth)."""
    v = schedule.virtual_stages

    def mean(stage: list[ActionSpan], kind: str) -> float:
        times = [s.end - s.start for s in stage if s.kind == kind]
        return v * statistics.mean(times) if times else 0.0  # a chunk is 1/v of the stage

    fwd = tuple(mean(st, "forward") for st in every)
    weight = tuple(mean(st, "weight") for st in every)
    whole = tuple(mean(st, "backward") + w for st, w in zip(every, weight, strict=True))
    costs = StageCosts(fwd, whole, weight_s=weight if schedule.splits_backward else ())
    times = [[1e3 * f, 1e3 * (b - w), 1e3 * w] for f, b, w in zip(fwd, whole, weight, strict=True)]
    return replay_pipeline(schedule, costs).bubble_fraction, times


def gpt_worker(
    rank: int, m: int, repeats: int, v: int, pin: bool = False, zero_bubble: bool = False
) -> dict[str, Any]:
    """The gpt on the sort task in p stages, m micro-batches of 32: gpipe, 1f1b, interleaved with v
    chunks (and with zero_bubble: zb-h1, zb-h2, zb-v, dualpipev)."""
    if pin:
        _pin(rank)
    p = dist.get_world_size()
    torch.manual_seed(0)
    model = GPT()
    x, y = sort_task(32 * m)
    batches = list(zip(x.split(32), y.split(32), strict=True))
    one = PipelineStage(partition(model.layers(), p)[rank], rank, list(range(p)), loss_fn=cross_entropy)
    chunks = partition(model.layers(), p * v)
    mine = [chunks[c * p + rank] for c in range(v)]
    chunked = InterleavedStage(mine, rank, list(range(p)), loss_fn=cross_entropy)
    cases: list[tuple[PipelineStage | InterleavedStage, PipelineSchedule]] = [
        (one, build("gpipe", p, m)),
        (one, build("1f1b", p, m)),
        (chunked, build("interleaved", p, m, v)),
    ]
    if zero_bubble:
        halves = partition(model.layers(), 2 * p)
        vee = InterleavedStage(
            [halves[rank], halves[2 * p - 1 - rank]],
            rank,
            list(range(p)),
            loss_fn=cross_entropy,
            placement="v",
        )
        cases += [(one, build("zb-h1", p, m)), (one, build("zb-h2", p, m))]
        cases += [(vee, build("zb-v", p, m, 2)), (vee, build("dualpipev", p, m, 2))]
    rows = []
    for runner, schedule in cases:
        runner.run(schedule, batches)  # warm-up: shapes recorded, receives posted early from now on
        bubbles = []
        for _ in range(repeats):
            dist.barrier()
            run = runner.run(schedule, batches)
            offset = time.time() - time.perf_counter()
            spans = [ActionSpan(s.kind, s.micro_batch, s.start + offset, s.end + offset) for s in run.spans]
            every: list[Any] = [None] * p
            dist.all_gather_object(every, spans)
            bubbles.append((*_analyse(every)[:2], _formula(schedule, every)))
        bubble, step, (formula, times) = sorted(bubbles)[len(bubbles) // 2]
        theory = theoretical_bubble(schedule.name, p, m, schedule.virtual_stages)
        rows.append(
            {
                "model": "gpt",
                "schedule": schedule.name,
                "stages": p,
                "micro_batches": m,
                "virtual_stages": schedule.virtual_stages,
                "bubble_fraction": bubble,
                "bubbles": [b for b, *_ in bubbles],
                "theoretical_bubble_fraction": theory,
                "excess": bubble - theory,
                "formula_bubble_fraction": formula,
                "stage_fbw_ms": times,
                "excess_over_formula": bubble - formula,
                "step_time_s": step,
            }
        )
    return {"gpt": rows}


def gpt(args: argparse.Namespace) -> dict[str, Any]:
    p, m, v = args.target_stages, args.target_micro_batches, args.virtual_stages
    worker_args = (m, args.repeats, v, args.pin, args.zero_bubble)
    rows = spawn(gpt_worker, p, worker_args, timeout_s=600)[0]["gpt"]
    for r in rows:
        print(
            f"gpt {r['schedule']:>11} p={p} m={m} v={r['virtual_stages']}: measured bubble "
            f"{r['bubble_fraction']:.3f} (median of {args.repeats}), "
            f"theory {r['theoretical_bubble_fraction']:.3f}, "
            f"formula with measured F/B/W {r['formula_bubble_fraction']:.3f} "
            f"({r['excess_over_formula']:+.3f}), step {r['step_time_s'] * 1e3:.1f} ms"
        )
    return {"gpt": rows}


def worker(rank: int, forward_s: float, repeats: int) -> dict[str, Any]:
    p = dist.get_world_size()
    stage = PipelineStage(SleepStage(forward_s), rank, list(range(p)))
    rows = [_bubble_case(stage, n, m, repeats) for n in ("gpipe", "1f1b") for m in MICRO_BATCHES]
    return {
        "bubble": [r for r in rows if r is not None],
        "throughput": {"stages": p, "micro_batches": 4, **_throughput(stage, 4)},
        "memory": {"stages": p, "micro_batches": 8, **_memory(rank, p, 8)},
        "gantt": {n: _gantt(stage, n, 8) for n in ("gpipe", "1f1b")},
    }


def target(args: argparse.Namespace) -> dict[str, Any]:
    """The vit rows at p = --target-stages, m = --target-micro-batches; Gantt charts when --gantt-suffix."""
    p, m = args.target_stages, args.target_micro_batches
    result = spawn(target_worker, p, (m, args.repeats, args.pin), timeout_s=600)[0]
    if args.gantt_suffix is not None:
        for name, spans in result["gantt"].items():
            path = args.out / "images" / f"pipeline-gantt-vit-{name}{args.gantt_suffix}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            plot_gantt(spans, path, f"vit, {name}, p={p}, m={m} of 32, gloo{args.gantt_suffix}")
            print(f"wrote {path}")
    for r in result["bubble"]:
        print(
            f"vit {r['schedule']:>5} p={p} m={m}: measured bubble {r['bubble_fraction']:.3f}, "
            f"(p-1)/(m+p-1) = {r['theoretical_bubble_fraction']:.3f}, excess {r['excess']:+.3f}, "
            f"step {r['step_time_s'] * 1e3:.1f} ms{', pinned' if args.pin else ''}"
        )
    return {"target": result["bubble"], "target_gantt": result["gantt"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--forward-ms", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--target-only", action="store_true", help="only the vit rows (p=2, m=8)")
    parser.add_argument(
        "--gpt", action="store_true", help="only the gpt rows: gpipe, 1f1b, interleaved (p=2, m=8)"
    )
    parser.add_argument(
        "--virtual-stages", type=int, default=2, help="chunks a stage of the gpt's interleaved row"
    )
    parser.add_argument(
        "--zero-bubble", action="store_true", help="with --gpt: also zb-h1, zb-h2, zb-v and dualpipev"
    )
    parser.add_argument("--target-stages", type=int, default=2)
    parser.add_argument("--target-micro-batches", type=int, default=8)
    parser.add_argument(
        "--pin",
        action="store_true",
        help="bind stage j's process to core j (mod the cores allowed), as one device per stage would be",
    )
    parser.add_argument(
        "--gantt-suffix", default=None, help="write docs/images/pipeline-gantt-vit-NAME<SUFFIX>.png"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every measured figure here")
    args = parser.parse_args()
    if args.json is not None and args.json.exists():
        parser.error(f"--json {args.json} exists; remove it or name another file")
    env = {
        **environment(),
        "backend": "gloo",
    }
    if args.gpt:
        where = {"world_size": args.target_stages, "pin": args.pin, "loadavg": _loadavg()}
        out = {"environment": {**env, **where}, **gpt(args)}
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=1))
            print(f"wrote {args.json}")
        return
    if args.target_only:
        out = {"environment": {**env, "world_size": args.target_stages, "pin": args.pin}, **target(args)}
        if args.json is not None:
            args.json.write_text(json.dumps({k: v for k, v in out.items() if k != "target_gantt"}, indent=1))
            print(f"wrote {args.json}")
        return
    env = {
        **environment(),
        "backend": "gloo",
        "forward_ms": args.forward_ms,
        "backward_ms": 2 * args.forward_ms,
    }
    results = {
        p: spawn(worker, p, (args.forward_ms / 1e3, args.repeats), timeout_s=600)[0] for p in args.stages
    }
    bubble = [r for p in args.stages for r in results[p]["bubble"]]
    data = {
        "environment": env,
        "bubble": bubble,
        "throughput": [results[p]["throughput"] for p in args.stages],
        "memory": [results[p]["memory"] for p in args.stages],
    }
    (args.out / "data").mkdir(parents=True, exist_ok=True)
    (args.out / "images").mkdir(parents=True, exist_ok=True)
    (args.out / "data" / "pipeline.json").write_text(json.dumps(data, indent=1))
    ms = args.forward_ms
    title = f"sleep stages {ms:g} ms fwd / {2 * ms:g} ms bwd, gloo, torch {env['torch']}"
    plot_bubble(
        [r for r in bubble if r["schedule"] == "1f1b"],
        args.out / "images" / "pipeline-bubble.png",
        f"1f1b, {title}",
    )
    p = max(args.stages)
    for name, spans in results[p]["gantt"].items():
        plot_gantt(spans, args.out / "images" / f"pipeline-gantt-{name}.png", f"{name}, p={p}, m=8, {title}")
    events = [
        trace.Event(s["kind"], s["stage"], "compute", s["start"], s["end"], {"micro_batch": s["micro_batch"]})
        for s in results[p]["gantt"]["1f1b"]
    ]
    trace.write(args.out / "data" / "pipeline-1f1b-trace.json", events)
    data.update({k: v for k, v in target(args).items() if k != "target_gantt"})
    if args.json is not None:
        args.json.write_text(json.dumps(data, indent=1))
    print(json.dumps({k: v for k, v in data.items() if k != "environment"}, indent=1))


if __name__ == "__main__":
    main()
