"""Signals instead of barriers for in-place shared-memory calls: the rounds (pure) and their proof."""

from __future__ import annotations

import pytest

from ringtree import schedules
from ringtree.comm import shm_flow
from ringtree.schedules.base import Builder
from ringtree.topology import Topology


def test_a_ring_rank_waits_for_its_predecessor_and_signals_its_successor() -> None:
    s = schedules.build(schedules.Request("all_reduce", "ring", Topology.single_node(4), 400, 4))
    # 2(p - 1) steps: before each, signal rank 2 (it reads from rank 1) and wait for rank 0; at the
    # end release rank 0 (done reading it) and wait for rank 2 (done reading rank 1)
    assert shm_flow.rounds(s, 1) == [((2,), (0,))] * 6 + [((0,), (2,))]


def test_a_read_not_ordered_before_the_next_write_keeps_the_barriers() -> None:
    b = Builder(3)
    b.transfer(0, 0, 1, 0, 8, False)  # step 0: rank 1 reads rank 0's [0, 8)
    b.transfer(1, 2, 0, 0, 8, True)  # step 1: rank 0 rewrites it, having waited only for rank 2
    assert shm_flow.rounds(b.build("late-read", "all_reduce", 8), 0) is None
    b = Builder(2)  # a step that receives into what it sends (a staged step)
    b.transfer(0, 0, 1, 0, 8, True)
    b.transfer(0, 1, 0, 0, 8, True)
    assert shm_flow.rounds(b.build("exchange", "all_reduce", 8), 0) is None


@pytest.mark.parametrize("p", [4, 5])
def test_every_signal_is_waited_for_once(p: int) -> None:
    """Signals are counted per pair: rank r must wait for q exactly as often as q signals r."""
    topology = Topology(p, p // 2 if p % 2 == 0 else p)
    for algorithm in schedules.algorithms("all_reduce"):
        s = schedules.build(schedules.Request("all_reduce", algorithm, topology, 60 * p, 4))
        every = [shm_flow.rounds(s, r) for r in range(p)]
        assert all(r is not None for r in every), algorithm
        sent = {(q, r): 0 for q in range(p) for r in range(p)}
        waited = dict(sent)
        for r, rounds in enumerate(every):
            assert rounds is not None and len(rounds) == s.num_steps + 1
            for notify, wait in rounds:
                for q in notify:
                    sent[r, q] += 1
                for q in wait:
                    waited[q, r] += 1
        assert sent == waited, algorithm
