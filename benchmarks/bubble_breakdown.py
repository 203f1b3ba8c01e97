"""Where the vit pipeline's bubble goes beyond (p-1)/(m+p-1): stage imbalance, jitter, hand-offs.

    .venv/bin/python benchmarks/bubble_breakdown.py --repeats 5 --json breakdown.json

Runs the vit target of benchmarks/pipeline_bubble.py (p = 2 stages, m = 8 micro-batches of 32,
gpipe and 1f1b, the same runtime) and splits each run's measured bubble into four parts, from
the actions' own spans:

- theory: (p-1)/(m+p-1), equal stages and free transfers;
- imbalance: the schedule replayed with each stage's mean forward and backward times (unequal
  stages leave the faster one waiting), minus theory;
- jitter: the schedule replayed with every action's measured duration and no hand-off delay,
  minus the imbalance replay (one slow action holds up its neighbour);
- hand-off: the measured bubble minus that replay: the time between an action's input being
  ready (its neighbour's action ended and its own stage was free) and the action starting, i.e.
  the transfer, the wake-up of the waiting process and the runtime's own bookkeeping.

It also reports the hand-off delays themselves (per action that waited for a neighbour, median
and total per run), so the remaining gap is named down to the operation.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pipeline_bubble import _analyse, _timed, _vit_batches

from ringtree.bench import environment
from ringtree.parallel.pipeline.partition import partition
from ringtree.parallel.pipeline.runtime import ActionSpan, PipelineStage
from ringtree.processes import spawn
from ringtree.schedules.pipeline import build, theoretical_bubble_fraction
from ringtree.sim.training.pipeline import StageCosts, replay_pipeline
from ringtree.train.models import ViT
from ringtree.train.stages import model_layers

Key = tuple[int, str, int]  # (stage j, kind, micro-batch i)


def _dependency(j: int, kind: str, i: int, p: int) -> Key | None:
    """The neighbour's action whose output this one needs: forward i of j-1, backward i of j+1."""
    if kind == "forward" and j > 0:
        return (j - 1, "forward", i)
    if kind == "backward" and j < p - 1:
        return (j + 1, "backward", i)
    return None


def _replay(spans: list[list[ActionSpan]], duration: dict[Key, float]) -> dict[Key, tuple[float, float]]:
    """Every action at its measured order and the given duration, starting as soon as its stage
    is free and its input exists (no hand-off delay)."""
    p, done, free = len(spans), [0] * len(spans), [0.0] * len(spans)
    at: dict[Key, tuple[float, float]] = {}
    while any(done[j] < len(spans[j]) for j in range(p)):
        moved = False
        for j in range(p):
            while done[j] < len(spans[j]):
                s = spans[j][done[j]]
                dep = _dependency(j, s.kind, s.micro_batch, p)
                if dep is not None and dep not in at:
                    break
                start = max(free[j], at[dep][1] if dep is not None else 0.0)
                free[j] = start + duration[(j, s.kind, s.micro_batch)]
                at[(j, s.kind, s.micro_batch)] = (start, free[j])
                done[j], moved = done[j] + 1, True
        assert moved, "the measured order deadlocks"
    return at


def _bubble(at: dict[Key, tuple[float, float]], p: int) -> float:
    busy = sum(e - s for s, e in at.values())
    return 1 - busy / (p * (max(e for _, e in at.values()) - min(s for s, _ in at.values())))


def breakdown(name: str, spans: list[list[ActionSpan]], m: int) -> dict[str, Any]:
    """One run's bubble in parts (see the module's docstring) and its hand-off delays."""
    p = len(spans)
    work = [[s for s in stage if s.kind != "step"] for stage in spans]
    measured, _, fwd, bwd = _analyse(work)
    mean_costs = replay_pipeline(build(name, p, m), StageCosts(tuple(fwd), tuple(bwd)))
    duration = {(j, s.kind, s.micro_batch): s.end - s.start for j in range(p) for s in work[j]}
    jitter = _bubble(_replay(work, duration), p)
    actual = {(j, s.kind, s.micro_batch): (s.start, s.end) for j in range(p) for s in work[j]}
    handoffs = []
    for j in range(p):
        for k, s in enumerate(work[j]):
            dep = _dependency(j, s.kind, s.micro_batch, p)
            if dep is None:
                continue
            ready = max(actual[dep][1], work[j][k - 1].end if k else actual[dep][1])
            handoffs.append(max(0.0, s.start - ready))
    theory = theoretical_bubble_fraction(p, m)
    makespan = max(s.end for st in work for s in st) - min(s.start for st in work for s in st)
    return {
        "schedule": name,
        "measured_bubble": measured,
        "theoretical_bubble": theory,
        "imbalance": mean_costs.bubble_fraction - theory,
        "jitter": jitter - mean_costs.bubble_fraction,
        "handoff": measured - jitter,
        "forward_ms_per_stage": [f * 1e3 for f in fwd],
        "backward_ms_per_stage": [b * 1e3 for b in bwd],
        "handoff_median_ms": statistics.median(handoffs) * 1e3,
        "handoff_total_ms": sum(handoffs) * 1e3,
        "makespan_ms": makespan * 1e3,
    }


def worker(rank: int, m: int, repeats: int) -> list[dict[str, Any]]:
    p = dist.get_world_size()
    torch.manual_seed(0)
    stage = PipelineStage(partition(model_layers(ViT()), p)[rank], rank, list(range(p)))
    batches = _vit_batches(m)
    rows = []
    for name in ("gpipe", "1f1b"):
        _timed(stage, name, m, batches)  # warm-up
        for _ in range(repeats):
            spans: list[Any] = [None] * p
            dist.all_gather_object(spans, _timed(stage, name, m, batches))
            rows.append(breakdown(name, spans, m))
    return rows


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per schedule: the median of every numeric part over the runs."""
    out: dict[str, Any] = {"schedule": rows[0]["schedule"], "runs": len(rows)}
    for key, value in rows[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(r[key] for r in rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = spawn(worker, 2, (args.micro_batches, args.repeats), timeout_s=600)[0]
    medians = [_median_row([r for r in rows if r["schedule"] == n]) for n in ("gpipe", "1f1b")]
    for r in medians:
        print(
            f"{r['schedule']:>5}: measured {r['measured_bubble']:.3f} = theory {r['theoretical_bubble']:.3f}"
            f" + imbalance {r['imbalance']:+.3f} + jitter {r['jitter']:+.3f} + hand-off {r['handoff']:+.3f}"
            f" (hand-offs: median {r['handoff_median_ms']:.2f} ms, {r['handoff_total_ms']:.1f} ms per run"
            f" of {r['makespan_ms']:.1f} ms)"
        )
    if args.json is not None:
        env = {**environment(), "world_size": 2}
        data = {"medians": medians, "runs": rows, "environment": env}
        args.json.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
