"""A dry run of a schedule: matching sends and receives, and what every rank ends up holding.

The dry run tracks, for every segment of every rank's buffer, the set of ranks whose input it
contains (a bitmask). It proves a schedule deadlock-free (every send meets its receive in the
same step) and correct (each contribution reduced exactly once, every all-to-all block received
by a rank at most once, every rank ends with what the collective promises), without torch or
processes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter

from ringtree.schedules.base import Op, OpKind, Schedule, split


class ScheduleError(AssertionError):
    """A schedule that would deadlock, double-count, or leave a rank with the wrong data."""


def check_matching(s: Schedule) -> None:
    """Every send at step t has a receive of the same range from the same peer at step t."""
    for t in range(s.num_steps):
        sends: Counter[tuple[int, int, int, int]] = Counter()
        recvs: Counter[tuple[int, int, int, int]] = Counter()
        for r in range(s.world_size):
            for op in s.steps[r][t]:
                if op.kind is OpKind.SEND:
                    sends[(r, op.peer, op.start, op.stop)] += 1
                else:
                    recvs[(op.peer, r, op.start, op.stop)] += 1
        if sends != recvs:
            raise ScheduleError(f"step {t}: unmatched {dict((sends - recvs) + (recvs - sends))}")


def check_hazards(s: Schedule) -> None:
    """No rank overwrites (receives without reducing) a range it also sends or receives in a step."""
    for r in range(s.world_size):
        for t, step in enumerate(s.steps[r]):
            copies = [op for op in step if op.kind is OpKind.RECV]
            for c in copies:
                for other in step:
                    if other is not c and other.start < c.stop and c.start < other.stop:
                        raise ScheduleError(f"rank {r} step {t}: {c} overlaps {other}")


def initial_state(s: Schedule, root: int) -> list[list[tuple[int, int, int]]]:
    """Per rank, (start, stop, contributors) of the data it holds before the collective."""
    p, n = s.world_size, s.count
    blocks = split(0, n, p)
    everyone = [[(0, n, 1 << r)] for r in range(p)]
    if s.collective == "all_to_all":  # rank r holds row r of the block matrix: its input
        return [[(s.blocks[r * p + j], s.blocks[r * p + j + 1], 1 << r) for j in range(p)] for r in range(p)]
    if s.collective == "all_gather":
        return [[(blocks[r], blocks[r + 1], 1 << r)] for r in range(p)]
    if s.collective == "broadcast":
        return [[(0, n, 1 << root)] if r == root else [] for r in range(p)]
    return everyone


def expected_state(s: Schedule, root: int) -> list[list[tuple[int, int, int]]]:
    """Per rank, (start, stop, contributors) that the collective promises afterwards."""
    p, n = s.world_size, s.count
    full = (1 << p) - 1
    blocks = split(0, n, p)
    if s.collective == "all_to_all":  # rank r ends with column r: block i from rank i
        return [[(s.blocks[i * p + r], s.blocks[i * p + r + 1], 1 << i) for i in range(p)] for r in range(p)]
    if s.collective == "all_reduce":
        return [[(0, n, full)] for _ in range(p)]
    if s.collective == "reduce_scatter":
        return [[(blocks[r], blocks[r + 1], full)] for r in range(p)]
    if s.collective == "all_gather":
        return [[(blocks[i], blocks[i + 1], 1 << i) for i in range(p)] for _ in range(p)]
    if s.collective == "broadcast":
        return [[(0, n, 1 << root)] for _ in range(p)]
    return [[(0, n, full)] if r == root else [] for r in range(p)]


def dry_run(s: Schedule, root: int = 0) -> None:
    """Raise ScheduleError unless `s` matches, has no hazards, and delivers the collective."""
    check_matching(s)
    check_hazards(s)
    cuts = sorted({0, s.count} | {x for rank in s.steps for st in rank for op in st for x in op[2:]})
    segs = len(cuts) - 1
    state = [[0] * segs for _ in range(s.world_size)]
    for r, held in enumerate(initial_state(s, root)):
        _paint(state[r], cuts, held)
    for t in range(s.num_steps):
        payload = {
            (r, op.peer, op.start, op.stop): state[r][_i(cuts, op.start) : _i(cuts, op.stop)]
            for r in range(s.world_size)
            for op in s.steps[r][t]
            if op.kind is OpKind.SEND
        }
        for r in range(s.world_size):
            for op in s.steps[r][t]:
                if op.kind is not OpKind.SEND:
                    data = payload[(op.peer, r, op.start, op.stop)]
                    if s.collective == "all_to_all":
                        _deliver_once(state[r], cuts, op, r, t)
                    _receive(state[r], cuts, op, data, r, t)
    for r, want in enumerate(expected_state(s, root)):
        for start, stop, mask in want:
            got = set(state[r][_i(cuts, start) : _i(cuts, stop)])
            if got and got != {mask}:
                raise ScheduleError(f"rank {r} ends with {sorted(got)} on [{start},{stop}), wants {mask}")


def _receive(mine: list[int], cuts: list[int], op: Op, data: list[int], r: int, t: int) -> None:
    lo = _i(cuts, op.start)
    for j, incoming in enumerate(data):
        if incoming == 0:
            raise ScheduleError(f"step {t}: rank {op.peer} sends rank {r} data it does not hold: {op}")
        if op.kind is OpKind.RECV:
            mine[lo + j] = incoming
        elif mine[lo + j] & incoming or mine[lo + j] == 0:
            raise ScheduleError(f"step {t}: rank {r} reduces {op} twice or into nothing")
        else:
            mine[lo + j] |= incoming


def _deliver_once(mine: list[int], cuts: list[int], op: Op, r: int, t: int) -> None:
    """All-to-all moves every block to a rank at most once: a second copy is wasted traffic."""
    if any(mine[_i(cuts, op.start) : _i(cuts, op.stop)]):
        raise ScheduleError(f"step {t}: rank {r} receives {op}, a block it already holds")


def _paint(row: list[int], cuts: list[int], held: list[tuple[int, int, int]]) -> None:
    for start, stop, mask in held:
        for j in range(_i(cuts, start), _i(cuts, stop)):
            row[j] = mask


def _i(cuts: list[int], x: int) -> int:
    return bisect_left(cuts, x)
