"""Straggler detection: a rank that sleeps inside its steps is named, and no other."""

from __future__ import annotations

import time

import pytest

from ringtree.processes import spawn
from ringtree.train.stragglers import StragglerMonitor


def test_a_rank_is_named_only_after_patience_windows_in_a_row() -> None:
    warned: list[str] = []
    monitor = StragglerMonitor(every=1, threshold=0.25, patience=2, warn=warned.append)
    assert monitor.judge([1.0, 1.0, 2.0, 1.0]) == []  # one slow window: a hiccup
    assert monitor.judge([1.0, 1.0, 1.0, 1.0]) == []  # recovered: strikes reset
    assert monitor.judge([1.0, 1.0, 2.0, 1.1]) == []
    assert monitor.judge([1.0, 1.0, 2.0, 1.2]) == [2]  # second slow window in a row
    assert monitor.judge([1.0, 1.0, 2.0, 1.0]) == []  # named once
    assert [s["rank"] for s in monitor.summary()] == [2]
    assert monitor.summary()[0]["slowdown"] == pytest.approx(2.0)
    assert len(warned) == 1 and "rank 2 is a straggler" in warned[0] and "1.82x" in warned[0]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="threshold > 0"):
        StragglerMonitor(threshold=0)


def sleepy(rank: int) -> tuple[list[dict[str, float]], list[str]]:
    """Rank 1 sleeps 30 ms more than the others in each of its steps."""
    warned: list[str] = []
    monitor = StragglerMonitor(every=3, patience=2, warn=warned.append)
    for _ in range(9):
        start = time.perf_counter()
        time.sleep(0.01 + (0.03 if rank == 1 else 0.0))
        monitor.step(time.perf_counter() - start)
    return monitor.summary(), warned


def test_the_rank_that_sleeps_in_its_steps_is_named_on_rank_0() -> None:
    results = spawn(sleepy, 3, timeout_s=60)
    for summary, _ in results:
        assert [s["rank"] for s in summary] == [1]
        assert summary[0]["slowdown"] > 2
    assert len(results[0][1]) == 1 and "rank 1 is a straggler" in results[0][1][0]
    assert results[1][1] == [] and results[2][1] == []  # only rank 0 warns
