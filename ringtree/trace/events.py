"""What a trace becomes: per rank, typed intervals (what ran, on which lane, when) and collectives.

Times are integer nanoseconds on the trace's own clock (Kineto's `baseTimeNanoseconds` added
where the file has one), so the ranks of one run share a time line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

KINDS = ("compute", "comm", "memcpy", "runtime", "other")
COMPUTE, COMM, MEMCPY, RUNTIME, OTHER = range(len(KINDS))


@dataclass
class Intervals:
    """Busy intervals of one rank's devices: a GPU's kernels, or a CPU run's operators and
    collectives. `lane` is the GPU stream or the CPU thread; `launch` is when the host launched
    a kernel (its runtime call, -1 when the trace does not link one), or the interval's own
    start on a CPU run."""

    start: NDArray[np.int64]
    end: NDArray[np.int64]
    kind: NDArray[np.int8]
    lane: NDArray[np.int64]
    launch: NDArray[np.int64]

    def select(self, mask: NDArray[np.bool_]) -> Intervals:
        return Intervals(
            self.start[mask], self.end[mask], self.kind[mask], self.lane[mask], self.launch[mask]
        )

    def of(self, kind: int) -> Intervals:
        return self.select(self.kind == kind)

    def __len__(self) -> int:
        return int(self.start.size)


def intervals(rows: list[tuple[int, int, int, int, int]]) -> Intervals:
    """Intervals from (start, end, kind, lane, launch) rows."""
    a = np.array(rows, dtype=np.int64).reshape(-1, 5)
    return Intervals(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].astype(np.int8), a[:, 3].copy(), a[:, 4].copy())


@dataclass(frozen=True)
class Collective:
    """One collective call on one rank. `seq` is the trace's own sequence number when it has one
    (Kineto's `Seq`), else -1; `step` the ProfilerStep it was launched in (-1: outside any)."""

    op: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, reduce, send, recv, ...
    group: str
    group_size: int
    nbytes: int
    dtype: str
    start: int
    end: int
    launch: int
    seq: int = -1
    step: int = -1
    source: str = ""  # where the op and size came from: kernel args, cpu op, kernel name

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / 1e9


@dataclass(frozen=True)
class Step:
    """A `ProfilerStep#N` window on the host."""

    number: int
    start: int
    end: int


@dataclass
class RankTrace:
    """One rank's trace, reduced to what the analysis reads."""

    path: str
    rank: int
    world_size: int | None
    backend: str
    device: str  # "gpu": kernels on streams; "cpu": operators and collectives on threads
    busy: Intervals
    collectives: list[Collective]
    steps: list[Step]
    first: int  # the earliest and latest timestamps of any event
    last: int
    groups: dict[str, list[int]] = field(default_factory=dict)  # process group name -> its ranks
