"""Per-step timings of a training run on one rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ringtree.comm.powersgd import PowerSGD
from ringtree.parallel.expert import ExpertParallel


@dataclass
class Meter:
    """Wall time, communication time and exposed communication of every optimizer step on this rank."""

    step_s: list[float] = field(default_factory=list)
    comm_s: list[float] = field(default_factory=list)
    exposed_s: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)  # global samples per step

    def add(self, step_s: float, comm_s: float, exposed_s: float, samples: int) -> None:
        self.step_s.append(step_s)
        self.comm_s.append(comm_s)
        self.exposed_s.append(exposed_s)
        self.samples.append(samples)

    def rate(self) -> float:
        """Samples per second over the steps so far (first, warm-up step excluded when there are more)."""
        skip = 1 if len(self.step_s) > 1 else 0
        seconds = sum(self.step_s[skip:])
        return sum(self.samples[skip:]) / seconds if seconds > 0 else 0.0

    def slowest_rank_means(self, device: torch.device | str = "cpu") -> dict[str, float]:
        """Mean step, comm and exposed time after the warm-up step, the slowest rank's (a collective)."""
        skip = 1 if len(self.step_s) > 1 else 0
        n = max(1, len(self.step_s) - skip)
        means = torch.tensor(
            [sum(self.step_s[skip:]) / n, sum(self.comm_s[skip:]) / n, sum(self.exposed_s[skip:]) / n],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(means, op=dist.ReduceOp.MAX)
        step, comm, exposed = means.tolist()
        return {
            "step_time_s": step,
            "comm_time_s": comm,
            "exposed_comm_time_s": exposed,
            "samples_per_s": (sum(self.samples[skip:]) / n) / step if step > 0 else 0.0,
        }


def powersgd_work_s(states: list[PowerSGD], device: torch.device | str = "cpu") -> float | None:
    """Seconds per step of PowerSGD's own work (its all-reduces excluded), summed over this rank's
    compressing DDPs, the slowest rank's (a collective where any rank has PowerSGD: every rank then
    has it); None without PowerSGD, before its first compressed step or on GPU (where the host's
    clock does not see the kernels)."""
    if not states:
        return None
    mine = [s.work_s_per_step() for s in states]
    known = None not in mine
    figures = torch.tensor(
        [sum(m for m in mine if m is not None), 0.0 if known else 1.0], dtype=torch.float64, device=device
    )
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    seconds, missing = figures.tolist()
    return None if missing else seconds


def moe_metrics(
    experts: ExpertParallel, a2a_s: list[tuple[float, float]], device: torch.device | str = "cpu"
) -> dict[str, Any]:
    """The MoE layers' figures, the worst rank's (a collective): experts and top-k of the layers, the
    last step's max / mean tokens per expert in its worst layer, the fraction of token copies the
    capacity dropped over the run, and the mean seconds per step (after warm-up) in all-to-alls and
    of those the training thread waited for (a2a_s: one (seconds, waited) pair a step).

    Each is the slowest rank's on its own. A blocking exchange is waited for all along; one started
    beside the shared experts (`AllToAllDispatcher(overlap=True)`) only while it outlasts them.
    """
    skip = 1 if len(a2a_s) > 1 else 0
    steps = max(1, len(a2a_s) - skip)
    mean = sum(s for s, _ in a2a_s[skip:]) / steps
    waited = sum(w for _, w in a2a_s[skip:]) / steps
    worst = torch.tensor(
        [experts.load, experts.dropped_fraction(), mean, waited], dtype=torch.float64, device=device
    )
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    load, dropped, a2a, exposed = worst.tolist()
    return {
        "experts": max(layer.num_experts for layer in experts.layers),
        "top_k": max(layer.top_k for layer in experts.layers),
        "expert_load": load,
        "tokens_dropped": dropped,
        "a2a_time_s": a2a,
        "a2a_exposed_s": exposed,
    }
