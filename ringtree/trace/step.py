"""A traced run's data-parallel step, as the planner describes one: the compute per step, the
gradient bytes all-reduced per step and whether they overlap the backward, from the trace; the
links, the all-reduce and any number of nodes from the planner (ringtree.sim.training.plan)."""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from dataclasses import dataclass

from ringtree.sim.network.hardware import Cluster
from ringtree.sim.training.plan import StepConfig, StepPrediction, predict_step, with_run_wait
from ringtree.trace.report import Report

_GRAD_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
OVERLAP_PCT = 10.0  # a run whose communication overlaps compute more than this overlaps (DDP's)


@dataclass(frozen=True)
class TracedStep:
    """What the trace measured of one step, averaged over its steps and ranks."""

    step_s: float  # the median rank's mean ProfilerStep
    exposed_comm_s: float  # per step
    grad_bytes: int  # all-reduced per step
    grad_dtype: str
    bucket_bytes: int  # the largest all-reduce
    overlap_pct: float
    world_size: int
    gpus_per_node: int

    def config(self) -> StepConfig:
        """The planner's step: compute = the measured step less its exposed communication."""
        itemsize = {"fp32": 4, "fp16": 2, "bf16": 2}[self.grad_dtype]
        return StepConfig(
            params=self.grad_bytes // itemsize,
            compute_time_s=max(0.0, self.step_s - self.exposed_comm_s),
            grad_dtype=self.grad_dtype,
            overlap=self.overlap_pct > OVERLAP_PCT,
            bucket_mb=max(self.bucket_bytes, 1) / 2**20,
        )


def traced_step(r: Report) -> TracedStep:
    """The step of the report's run (ValueError when the trace lacks what the planner needs)."""
    if r.step_s is None:
        raise ValueError(f"{r.traces[0].path} has no ProfilerStep windows: profile whole steps")
    steps = r.steps
    per_step: dict[int, int] = defaultdict(int)
    dtypes = set()
    largest = 0
    for c in r.calls:
        if c.op == "all_reduce" and c.step in steps:
            per_step[c.step] += c.nbytes
            dtypes.add(c.dtype)
            largest = max(largest, c.nbytes)
    if not per_step:
        raise ValueError(
            f"{r.traces[0].path}: no gradient all-reduce in steps {steps}: not a data-parallel run"
        )
    grad_dtype = _GRAD_DTYPES.get(next(iter(dtypes)) if len(dtypes) == 1 else "", "fp32")
    ranks = r.rank_rows()
    n = max(1, len(steps))
    exposed = statistics.median(x["exposed_comm_s"] for x in ranks) / n
    overlaps = [x["comm_overlap_pct"] for x in ranks if x["comm_overlap_pct"] is not None]
    world = r.traces[0].world_size or len(r.traces)
    return TracedStep(
        step_s=r.step_s,
        exposed_comm_s=exposed,
        grad_bytes=int(statistics.median(per_step.values())),
        grad_dtype=grad_dtype,
        bucket_bytes=largest,
        overlap_pct=statistics.fmean(overlaps) if overlaps else 0.0,
        world_size=world,
        gpus_per_node=world,  # one node unless the caller says otherwise
    )


def planned(
    traced: TracedStep, run: Cluster, cluster: Cluster, algorithm: str
) -> tuple[StepConfig, StepPrediction, StepPrediction]:
    """(the step config with the run's wait, the prediction for the run's own cluster, the asked one's).

    The run's exposed communication beyond what the planner predicts for its own cluster is the
    ranks waiting for each other; the plan keeps it (the planner's `with_run_wait`)."""
    config = traced.config()
    summary = {"algorithm": algorithm, "exposed_comm_time_s": traced.exposed_comm_s}
    config = with_run_wait(config, summary, run)
    return config, predict_step(config, run, algorithm), predict_step(config, cluster, algorithm)


def run_cluster(traced: TracedStep, like: Cluster) -> Cluster:
    """The run's own shape on `like`'s links: its ranks on ceil(world / gpus per node) nodes."""
    g = min(traced.gpus_per_node, traced.world_size)
    return dataclasses.replace(like, nodes=max(1, traced.world_size // g), gpus_per_node=g)
