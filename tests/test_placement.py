"""Where the ranks of one host run: the decision (pure) and the pin on this process's threads."""

from __future__ import annotations

import os
import threading

import pytest

from ringtree.parallel import placement


def test_ranks_that_outnumber_the_cores_are_spread_evenly() -> None:
    assert [placement.core_for(r, 4, {0, 1}, 2) for r in range(4)] == [0, 1, 0, 1]
    assert [placement.core_for(r, 2, {0, 1}, 2) for r in range(2)] == [0, 1]


def test_placement_is_left_alone_where_pinning_is_not_clearly_right() -> None:
    assert placement.core_for(0, 3, {0, 1}, 2) is None  # two ranks on one core, one on the other
    assert placement.core_for(0, 2, {0, 1, 2, 3}, 4) is None  # cores to spare: threads may use them
    assert placement.core_for(0, 4, {1}, 2) is None  # an affinity the user set


def test_every_thread_is_pinned_and_released(monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = os.sched_getaffinity(0)
    if len(allowed) != os.cpu_count():
        pytest.skip("this process may not use every core")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(allowed)))
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, args=(10.0,))
    other.start()
    try:
        undo = placement.spread()
        assert undo is not None
        want = {sorted(allowed)[1 % len(allowed)]}
        assert os.sched_getaffinity(0) == want and os.sched_getaffinity(other.native_id) == want
        undo()
        assert os.sched_getaffinity(0) == allowed and os.sched_getaffinity(other.native_id) == allowed
    finally:
        stop.set()
        other.join()
        os.sched_setaffinity(0, allowed)


def test_ringtree_pin_ranks_0_leaves_the_placement_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = os.sched_getaffinity(0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(allowed)))
    monkeypatch.setenv(placement.PIN_ENV, "0")
    assert placement.spread() is None and os.sched_getaffinity(0) == allowed
    monkeypatch.setenv(placement.PIN_ENV, "yes")
    with pytest.raises(ValueError, match="RINGTREE_PIN_RANKS='yes' is not 0 or 1"):
        placement.spread()
