"""Signals instead of barriers for a call on tensors that stay in shared memory: who waits for whom.

In an in-place call (`shm.shared_buffer`) every rank reads its peers' ranges where they lie. A
barrier after every step makes a rank wait for all its neighbours, also for those that only read
from it (a ring's successor). The data needs less: before step t a rank needs only the peers it
reads from at step t to have finished step t - 1 (what it reads is written), and a peer must not
rewrite a range before every rank that reads it has read it. `rounds` gives each rank that much
and no more: in round k (before step k; round n at the end) it signals the ranks that read from
it at step k and waits for the ranks it reads from; at the end it tells the ranks it read from
that it is done and waits for those that read from it, so that the caller may rewrite its tensor.

Whether waiting for the writers also keeps every later write behind its readers depends on the
schedule; `rounds` proves it with vector clocks over every rank's steps, and answers None (keep
the barriers) where it does not hold. For the ring it holds: a rank's next write of a range its
successor reads lies a whole turn of the ring later, behind a chain of signals through every rank.
A 4-rank ring call then rings 7 pipes per rank instead of 15 and never waits for its successor
before the end.
"""

from __future__ import annotations

import weakref

from ringtree.schedules import OpKind, Schedule

Round = tuple[tuple[int, ...], tuple[int, ...]]  # (ranks to signal, ranks to wait for)

_cache: weakref.WeakKeyDictionary[Schedule, list[list[Round]] | None] = weakref.WeakKeyDictionary()


def rounds(schedule: Schedule, rank: int) -> list[Round] | None:
    """Group rank `rank`'s n + 1 signalling rounds for an in-place call of `schedule`, or None
    when signals between writers and readers alone would let a range be rewritten while read."""
    if schedule not in _cache:
        _cache[schedule] = _all_rounds(schedule) if _safe(schedule) else None
    every = _cache[schedule]
    return None if every is None else every[rank]


def _reads(schedule: Schedule) -> list[list[list[tuple[int, int, int]]]]:
    """Per rank and step, the (peer, start, stop) ranges it reads from peers (and writes in its own)."""
    return [
        [[(op.peer, op.start, op.stop) for op in step if op.kind is not OpKind.SEND] for step in steps]
        for steps in (schedule.for_rank(r) for r in range(schedule.world_size))
    ]


def _all_rounds(schedule: Schedule) -> list[list[Round]]:
    reads = _reads(schedule)
    p, n = schedule.world_size, schedule.num_steps
    sources = [[sorted({q for q, _, _ in step} - {r}) for step in reads[r]] for r in range(p)]
    readers = [[sorted(q for q in range(p) if r in sources[q][t]) for t in range(n)] for r in range(p)]
    out = []
    for r in range(p):
        steps: list[Round] = [(tuple(readers[r][t]), tuple(sources[r][t])) for t in range(n)]
        read_from = tuple(sorted({q for t in range(n) for q in sources[r][t]}))
        read_by = tuple(sorted({q for t in range(n) for q in readers[r][t]}))
        out.append([*steps, (read_from, read_by)])
    return out


def _safe(schedule: Schedule) -> bool:
    """Whether, with only the writer-to-reader signals, every read at step t sees its peer's range
    as it was after the peer's step t - 1: the peer's next write of it must come after the read.

    Vector clocks: known[r][t][x] is the last step of rank x that rank r has heard finished when it
    starts step t (-1: x entered the call; -2: nothing heard), through the signals it waited for.
    """
    reads = _reads(schedule)
    p, n = schedule.world_size, schedule.num_steps
    done = [[-1 if x == r else -2 for x in range(p)] for r in range(p)]  # after round 0's signals
    known: list[list[list[int]]] = [[] for _ in range(p)]
    for t in range(n):
        after = []
        for r in range(p):
            clock = list(done[r])
            for q in {q for q, _, _ in reads[r][t]} - {r}:
                clock = [max(a, b) for a, b in zip(clock, done[q], strict=True)]
            known[r].append(clock)
            after.append([t if x == r else c for x, c in enumerate(clock)])
        done = after
    for r in range(p):
        for t in range(n):
            for q, start, stop in reads[r][t]:
                s = _next_write(reads[q], t, start, stop)
                if s is not None and known[q][s][r] < t:
                    return False
    return True


def _next_write(writes: list[list[tuple[int, int, int]]], t: int, start: int, stop: int) -> int | None:
    """The first step from t on at which a rank writes a range overlapping [start, stop)."""
    for s in range(t, len(writes)):
        if any(a < stop and start < b for _, a, b in writes[s]):
            return s
    return None
