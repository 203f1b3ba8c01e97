"""Which steps a figure covers: `--steps a:b`, or Holistic Trace Analysis's default (everything
launched before the last ProfilerStep starts: the last step is often cut short by the profiler)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ringtree.trace.events import Intervals, RankTrace

NEVER, ALWAYS = -(1 << 62), 1 << 62


@dataclass(frozen=True)
class Window:
    """Work launched in [lo, hi) on the host counts; `filtered` False keeps everything (a trace
    with fewer than two steps, as HTA does)."""

    lo: int
    hi: int
    steps: tuple[int, ...]
    filtered: bool

    def busy(self, trace: RankTrace) -> Intervals:
        if not self.filtered:
            return trace.busy
        launch = trace.busy.launch
        return trace.busy.select((launch >= 0) & (launch >= self.lo) & (launch < self.hi))

    def holds(self, t: int) -> bool:
        return not self.filtered or self.lo <= t < self.hi


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """'3:5' -> (3, 5): ProfilerStep#3 to ProfilerStep#5, both included."""
    if text is None:
        return None
    a, sep, b = text.partition(":")
    try:
        first, last = int(a), int(b)
    except ValueError:
        raise ValueError(
            f"--steps {text!r}: write it as FIRST:LAST, e.g. 3:5 (ProfilerStep numbers)"
        ) from None
    if not sep or first > last:
        raise ValueError(f"--steps {text!r}: write it as FIRST:LAST with FIRST <= LAST, e.g. 3:5")
    return first, last


def window(trace: RankTrace, steps: tuple[int, int] | None) -> Window:
    """The window of `steps` on this rank (ValueError naming the file if it lacks them)."""
    numbers = [s.number for s in trace.steps]
    if steps is None:
        if len(set(numbers)) < 2:
            return Window(NEVER, ALWAYS, tuple(numbers), False)
        last = max(trace.steps, key=lambda s: s.start)
        kept = tuple(n for n in numbers if n != last.number)
        return Window(NEVER, last.start, kept, True)
    first, final = steps
    inside = [s for s in trace.steps if first <= s.number <= final]
    missing = [n for n in range(first, final + 1) if n not in numbers]
    if missing or not inside:
        have = f"{min(numbers)}:{max(numbers)}" if numbers else "none"
        raise ValueError(
            f"{trace.path}: --steps {first}:{final} is outside the trace (its ProfilerSteps: {have}); "
            "choose steps it holds"
        )
    return Window(
        min(s.start for s in inside), max(s.end for s in inside), tuple(s.number for s in inside), True
    )


def step_seconds(trace: RankTrace, w: Window) -> float | None:
    """The mean duration of the window's steps on the host."""
    d = [s.end - s.start for s in trace.steps if s.number in w.steps]
    return float(np.mean(d)) / 1e9 if d else None
