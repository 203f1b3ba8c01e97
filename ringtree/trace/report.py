"""The analysis of one run's traces: per-rank breakdown, collectives, stragglers and a verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringtree.trace.bandwidth import Model, Row, rows
from ringtree.trace.breakdown import Breakdown, breakdown
from ringtree.trace.events import Collective, RankTrace
from ringtree.trace.matching import Call, match
from ringtree.trace.stragglers import Straggler, median_step, stragglers
from ringtree.trace.window import Window, step_seconds, window


@dataclass
class Report:
    traces: list[RankTrace]
    windows: list[Window]
    breakdowns: list[Breakdown]
    calls: list[Call]
    collectives: list[Row]
    stragglers: list[Straggler]
    step_s: float | None

    @property
    def steps(self) -> list[int]:
        common = set(self.windows[0].steps).intersection(*(w.steps for w in self.windows[1:]))
        return sorted(common)

    @property
    def matched(self) -> bool:
        return any(len(c.ranks) > 1 for c in self.calls)

    def rank_rows(self) -> list[dict[str, Any]]:
        return [
            _rank_row(t, w, b) for t, w, b in zip(self.traces, self.windows, self.breakdowns, strict=True)
        ]

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": verdict(self),
            "world_size": self.traces[0].world_size,
            "device": self.traces[0].device,
            "steps": self.steps,
            "step_time_s": self.step_s,
            "files": [t.path for t in self.traces],
            "ranks": self.rank_rows(),
            "collectives": [r.as_dict() for r in self.collectives],
            "stragglers": [s.as_dict() for s in self.stragglers],
        }


def analyse(
    traces: list[RankTrace], steps: tuple[int, int] | None = None, model: Model | None = None
) -> Report:
    """The report on `traces` (one run's ranks) over `steps` (default: HTA's)."""
    windows = [window(t, steps) for t in traces]
    breakdowns = [breakdown(w.busy(t), t.device == "cpu") for t, w in zip(traces, windows, strict=True)]
    per_rank = {t.rank: _in_window(t.collectives, w) for t, w in zip(traces, windows, strict=True)}
    calls = match(per_rank)
    step_s = median_step([step_seconds(t, w) for t, w in zip(traces, windows, strict=True)])
    report = Report(traces, windows, breakdowns, calls, rows(calls, model), [], step_s)
    report.stragglers = stragglers(calls, report.steps, step_s)
    return report


def _in_window(calls: list[Collective], w: Window) -> list[Collective]:
    if not w.filtered:
        return calls
    return [c for c in calls if c.launch >= 0 and w.holds(c.launch)]


def _rank_row(t: RankTrace, w: Window, b: Breakdown) -> dict[str, Any]:
    return {
        "rank": t.rank,
        "file": t.path,
        "device": t.device,
        "kernel_s": b.kernel_s,
        "compute_s": b.compute_s,
        "non_compute_s": b.non_compute_s,
        "idle_s": b.idle_s,
        "compute_pct": b.pct(b.compute_s),
        "non_compute_pct": b.pct(b.non_compute_s),
        "idle_pct": b.pct(b.idle_s),
        "comm_overlap_pct": b.comm_overlap_pct,
        "comm_s": b.comm_s,
        "exposed_comm_s": b.exposed_comm_s,
        "overlapped_comm_s": b.overlapped_comm_s,
        "exposed_memcpy_s": b.exposed_memcpy_s,
        "idle_host_wait_s": b.idle_host_wait_s,
        "idle_kernel_wait_s": b.idle_kernel_wait_s,
        "idle_other_s": b.idle_other_s,
        "step_time_s": step_seconds(t, w),
        "steps": list(w.steps),
    }


def verdict(r: Report) -> list[str]:
    """What to look at first, in a few lines: the biggest loss, the straggler, the slowest link."""
    ranks = r.rank_rows()
    n = len(ranks)
    mean = {k: sum(x[k] for x in ranks) / n for k in ("compute_pct", "non_compute_pct", "idle_pct")}
    busy = "the GPU" if r.traces[0].device == "gpu" else "the training thread"
    lines = [
        f"{busy} computes {mean['compute_pct']:.0f}% of the time, waits on exposed communication "
        f"{mean['non_compute_pct']:.0f}% and is idle {mean['idle_pct']:.0f}% (mean of {n} rank"
        f"{'s' if n > 1 else ''}, steps {_span(r.steps)})"
    ]
    worst = max(("non_compute_pct", "idle_pct"), key=lambda k: mean[k])
    if mean[worst] >= 10:
        lines.append(_why(worst, ranks))
    if r.stragglers:
        s = r.stragglers[0]
        lines.append(
            f"rank {s.rank} is the straggler: the others wait {s.late_s_per_step * 1e3:.1f} ms a step for it "
            f"(it is last in {len(s.steps)} of {len(r.steps)} steps)"
        )
    elif r.matched:
        lines.append("no straggler: no rank keeps the others waiting consistently")
    else:
        lines.append(
            "one rank only: no straggler can be told, and busbw is a lower bound (durations include waiting)"
        )
    slowest = _slowest_link(r.collectives)
    if slowest:
        lines.append(slowest)
    return lines


def _why(key: str, ranks: list[dict[str, Any]]) -> str:
    if key == "non_compute_pct":
        comm = sum(x["exposed_comm_s"] for x in ranks)
        total = sum(x["non_compute_s"] for x in ranks) or 1.0
        hidden = [x["comm_overlap_pct"] for x in ranks if x["comm_overlap_pct"] is not None]
        share = f"; {sum(hidden) / len(hidden):.0f}% of communication overlaps compute" if hidden else ""
        return (
            f"exposed communication is the largest loss ({100 * comm / total:.0f}% of it collectives{share})"
        )
    idle = sum(x["idle_s"] for x in ranks) or 1.0
    host = sum(x["idle_host_wait_s"] for x in ranks)
    return (
        f"idle time is the largest loss: {100 * host / idle:.0f}% of it waits for the host to launch "
        "work (data loading, Python, synchronisation)"
    )


def _slowest_link(rows_: list[Row]) -> str | None:
    known = [r for r in rows_ if r.nbytes > 0 and r.time_s > 0 and r.op not in ("send", "recv", "send_recv")]
    if not known:
        return None
    r = max(known, key=lambda r: r.time_s)
    size = f"{r.nbytes / 1e6:.1f} MB" if r.nbytes >= 1e5 else f"{r.nbytes} B"
    line = (
        f"the most time goes to {size} {r.op}s ({r.count}, {r.time_s:.3f} s): {r.busbw_gbps:.2f} GB/s busbw"
    )
    if r.model_busbw_gbps:
        line += f" where the cluster's model gives {r.model_busbw_gbps:.2f}"
    return line


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else (str(steps[0]) if steps else "all")
