"""Where one rank's time goes, with Holistic Trace Analysis's definitions (`get_temporal_breakdown`,
`get_comm_comp_overlap`, `get_idle_time_breakdown`) and the splits it does not make.

- kernel time: from the first busy interval's start to the last one's end, all lanes merged;
- idle: kernel time less the union of everything busy;
- compute: the union of compute; communication or memcpy concurrent with compute is compute;
- non-compute: kernel time - compute - idle = exposed communication + exposed memcpy;
- overlap: the share of communication's union that compute covers;
- idle by cause, for each gap between busy intervals: host wait if the next work was launched
  after the gap began, kernel wait if the gap is under 30 us (back-to-back launch delay), other
  (a CUDA event, a collective's peer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ringtree.trace import intervals as iv
from ringtree.trace.events import COMM, COMPUTE, OTHER, Intervals

KERNEL_WAIT_NS = 30_000  # HTA's consecutive_kernel_delay: 30 (trace microseconds)


@dataclass(frozen=True)
class Breakdown:
    """One rank's figures, in seconds (percentages of kernel time)."""

    kernel_s: float
    compute_s: float
    non_compute_s: float
    idle_s: float
    comm_s: float
    exposed_comm_s: float
    overlapped_comm_s: float
    exposed_memcpy_s: float
    idle_host_wait_s: float
    idle_kernel_wait_s: float
    idle_other_s: float

    def pct(self, seconds: float) -> float:
        return 100.0 * seconds / self.kernel_s if self.kernel_s > 0 else 0.0

    @property
    def comm_overlap_pct(self) -> float | None:
        return 100.0 * self.overlapped_comm_s / self.comm_s if self.comm_s > 0 else None


def breakdown(busy: Intervals, cpu: bool = False) -> Breakdown:
    """The breakdown of a rank's busy intervals (already cut to the steps analysed)."""
    if len(busy) == 0:
        return Breakdown(*([0.0] * 11))
    every = iv.union(busy.start, busy.end)
    kernel = int(every[1][-1] - every[0][0])
    idle = kernel - iv.measure(every)
    comp = _union(busy.of(COMPUTE))
    comm = _union(busy.of(COMM))
    compute = iv.measure(comp)
    overlapped = iv.overlap(comm, comp)
    exposed = iv.measure(comm) - overlapped
    non_compute = kernel - compute - idle
    host, kernel_wait, other = (idle, 0, 0) if cpu else _idle_causes(busy, every)
    s = 1e-9
    return Breakdown(
        kernel * s,
        compute * s,
        non_compute * s,
        idle * s,
        iv.measure(comm) * s,
        exposed * s,
        overlapped * s,
        (non_compute - exposed) * s,
        host * s,
        kernel_wait * s,
        other * s,
    )


def _union(x: Intervals) -> iv.Union:
    return iv.union(x.start, x.end)


def _idle_causes(busy: Intervals, every: iv.Union) -> tuple[int, int, int]:
    """(host wait, kernel wait, other) nanoseconds over the gaps of the merged timeline."""
    lo, hi = iv.gaps(every)
    if lo.size == 0:
        return 0, 0, 0
    order = np.argsort(busy.start, kind="stable")
    starts = busy.start[order]
    nxt = order[np.searchsorted(starts, hi, side="left")]  # the work that ends each gap
    gap = hi - lo
    host = busy.launch[nxt] > lo
    short = ~host & (gap < KERNEL_WAIT_NS)
    return int(gap[host].sum()), int(gap[short].sum()), int(gap[~host & ~short].sum())


def idle_by_stream(busy: Intervals) -> dict[int, dict[str, float]]:
    """HTA's `get_idle_time_breakdown` per stream, seconds: the gaps between one stream's
    consecutive kernels and copies, by cause (synchronisation rows left out, as HTA does)."""
    out = {}
    work = busy.select(busy.kind != OTHER)
    for stream in np.unique(work.lane):
        x = work.select(work.lane == stream)
        order = np.argsort(x.start, kind="stable")
        start, end, launch = x.start[order], x.end[order], x.launch[order]
        gap, prev_end, nxt_launch = start[1:] - end[:-1], end[:-1], launch[1:]
        host = nxt_launch > prev_end
        short = ~host & (gap < KERNEL_WAIT_NS)
        out[int(stream)] = {
            "host_wait": float(gap[host].sum()) * 1e-9,
            "kernel_wait": float(gap[short].sum()) * 1e-9,
            "other": float(gap[~host & ~short].sum()) * 1e-9,
        }
    return out
