"""The pipelined executor: plans (pure) and many small pieces per op against torch (3 ranks)."""

from __future__ import annotations

import os

from collective_checks import against_torch

from ringtree import schedules
from ringtree.comm import executor
from ringtree.comm.plan import DIRECT, REDUCE, compile_plan
from ringtree.comm.shm import TRANSPORT_ENV
from ringtree.processes import spawn
from ringtree.topology import Topology


def ring_plan(p: int, count: int, piece: int, rank: int = 0) -> object:
    s = schedules.build(schedules.Request("all_reduce", "ring", Topology.single_node(p), count, 4))
    return compile_plan(s, rank, piece)


def test_ring_plan_pieces_order_and_early_posting() -> None:
    plan = ring_plan(2, 8, 2)  # blocks of 4 elements, pieces of 2
    rs, ag = plan.steps  # type: ignore[attr-defined]
    # reduce-scatter: rank 0 receives block 0 in two pieces to reduce, sends block 1 at once
    assert [(r.mode, r.start, r.stop, r.tag) for r in rs.recvs] == [(REDUCE, 0, 2, 0), (REDUCE, 2, 4, 1)]
    assert [(s.start, s.stop, s.after) for s in rs.sends] == [(4, 6, -1), (6, 8, -1)]
    # all-gather: each piece of block 0 leaves as soon as its reduction is done
    assert [(s.start, s.stop, s.after) for s in ag.sends] == [(0, 2, 0), (2, 4, 1)]
    # its receptions go straight into block 1, which step 0 sends from: safe to post early only
    # because the peer sends them after receiving block 1 from us
    assert [r.mode for r in ag.recvs] == [DIRECT, DIRECT] and ag.early
    assert plan.scratch_count == 2 * 4  # type: ignore[attr-defined]


def every_collective_in_small_pieces(rank: int) -> list[str]:
    os.environ[TRANSPORT_ENV] = "p2p"  # the point-to-point path, not shared memory
    executor.PIECE_BYTES = 16  # 4 float32 per message: many pieces, deep pipelines
    return against_torch(rank, 203)


def test_many_pieces_match_torch_and_agree_across_ranks() -> None:
    assert spawn(every_collective_in_small_pieces, 3, timeout_s=180) == [[], [], []]
