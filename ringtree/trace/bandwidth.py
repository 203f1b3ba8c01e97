"""Collectives by kind and size: how many, how long, how much waiting, and the bandwidth reached
(algbw = bytes / transfer time; busbw = algbw x nccl-tests' factor), beside the model's."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from ringtree.sim.network.busbw import busbw_factor
from ringtree.trace.matching import Call

Model = Callable[[str, int, int], float | None]  # (op, bytes, group size) -> busbw GB/s, or None


@dataclass(frozen=True)
class Row:
    """One kind and size of collective in one group."""

    group: str
    op: str
    nbytes: int
    dtype: str
    group_size: int
    count: int
    time_s: float  # total transfer time (each call's shortest duration among its ranks)
    median_s: float
    wait_s: float  # total waiting beyond the transfer, averaged over the ranks of each call
    ranks: int  # how many ranks' calls were matched (1: durations include waiting)
    model_busbw_gbps: float | None

    @property
    def algbw_gbps(self) -> float:
        return self.count * self.nbytes / self.time_s / 1e9 if self.time_s > 0 else 0.0

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps * busbw_factor(self.op, self.group_size)

    def as_dict(self) -> dict[str, object]:
        return {
            "group": self.group,
            "op": self.op,
            "bytes": self.nbytes,
            "dtype": self.dtype,
            "group_size": self.group_size,
            "count": self.count,
            "time_s": self.time_s,
            "median_s": self.median_s,
            "wait_s": self.wait_s,
            "matched_ranks": self.ranks,
            "algbw_gbps": self.algbw_gbps,
            "busbw_gbps": self.busbw_gbps,
            "model_busbw_gbps": self.model_busbw_gbps,
        }


def rows(calls: list[Call], model: Model | None = None) -> list[Row]:
    """One row per (group, op, bytes, dtype), the most time first."""
    by: dict[tuple[str, str, int, str], list[Call]] = defaultdict(list)
    for c in calls:
        by[(c.group, c.op, c.nbytes, c.dtype)].append(c)
    out = []
    for (group, op, nbytes, dtype), cs in by.items():
        transfers = [c.transfer_s for c in cs]
        size = max(c.group_size for c in cs)
        out.append(
            Row(
                group,
                op,
                nbytes,
                dtype,
                size,
                len(cs),
                sum(transfers),
                statistics.median(transfers),
                sum(statistics.fmean(c.waits_s()) for c in cs),
                max(len(c.ranks) for c in cs),
                model(op, nbytes, size) if model is not None and nbytes > 0 else None,
            )
        )
    return sorted(out, key=lambda r: -r.time_s)
