"""Stragglers: the ranks the others wait for, consistently over steps, from the cross-rank match
of collectives (so any NCCL version and gloo alike). In each matched call the last rank to start
kept the others waiting for as long as it started after the next-latest one; a rank is a
straggler when it costs the most in at least half the steps (two at least) and, over all steps, at least
`share` of a step and at least `floor_s` a step: below a couple of milliseconds, the operating system's
scheduling of ranks that share cores makes some rank "late" in most steps of a short step."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from ringtree.trace.matching import Call


@dataclass(frozen=True)
class Straggler:
    rank: int
    late_s_per_step: float
    steps: tuple[int, ...]  # the steps in which it cost the most

    def as_dict(self) -> dict[str, object]:
        return {"rank": self.rank, "late_s_per_step": self.late_s_per_step, "steps": list(self.steps)}


def stragglers(
    calls: list[Call], steps: list[int], step_s: float | None, share: float = 0.1, floor_s: float = 2e-3
) -> list[Straggler]:
    """The stragglers among the ranks of the matched calls in `steps`, the costliest first."""
    cost: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))  # step -> rank -> s
    for c in calls:
        if len(c.ranks) >= 2 and c.step in steps:
            cost[c.step][c.last] += c.lateness_s
    if len(steps) < 2 or not cost:
        return []  # one step cannot show a rank late consistently
    owners: dict[int, list[int]] = defaultdict(list)
    total: dict[int, float] = defaultdict(float)
    for step, by_rank in cost.items():
        owner = max(by_rank, key=lambda r: by_rank[r])
        owners[owner].append(step)
        for rank, s in by_rank.items():
            total[rank] += s
    threshold = max(share * step_s, floor_s) if step_s else floor_s
    out = []
    for rank, owned in owners.items():
        per_step = total[rank] / len(steps)
        if 2 * len(owned) >= len(steps) and per_step >= threshold:
            out.append(Straggler(rank, per_step, tuple(sorted(owned))))
    return sorted(out, key=lambda s: -s.late_s_per_step)


def median_step(seconds: list[float | None]) -> float | None:
    known = [s for s in seconds if s]
    return statistics.median(known) if known else None
