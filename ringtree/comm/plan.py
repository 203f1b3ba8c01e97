"""One rank's schedule compiled for pipelined execution: pieces, tags, dependencies, scratch.

The executor's pipelined path (gloo on CPU) does not run a step as one barrier. Every op is
cut into pieces of at most `piece` elements, each piece its own tagged message, and:
  - a piece received to reduce lands in scratch and is combined into the buffer as soon as it
    arrives, while later pieces are still on the wire;
  - a piece to send at step t+1 is posted as soon as the step-t receptions it reads from are
    combined (`after`), so the next transfer starts while this step's reductions go on;
  - receptions are posted a step ahead (`early`), so the peer's "ready to receive" notice is
    out before either side queues data behind it on the socket.
The rules keep the step semantics of `ringtree.schedules.base`: a send carries the data as it
was when its step began (a reception overlapping a same-step send waits for it: `guard`), and
receptions into the same range are combined in schedule order, so results stay bitwise equal.

Indices: t a step, j a reception piece of a step, s a send piece.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from ringtree.schedules import OpKind, Schedule
from ringtree.schedules.base import split

# A reception's target: straight into the buffer, or into scratch then combined or copied.
DIRECT, REDUCE, COPY = 0, 1, 2


@dataclass(frozen=True)
class Recv:
    peer: int  # group rank
    tag: int
    start: int
    stop: int
    mode: int  # DIRECT, REDUCE or COPY
    scratch: int  # offset into scratch (REDUCE, COPY)
    guard: tuple[int, ...]  # same-step send pieces to wait for before writing the buffer


@dataclass(frozen=True)
class Send:
    peer: int
    tag: int
    start: int
    stop: int
    after: int  # post once reception piece `after` of the previous step is done; -1: at its start


@dataclass(frozen=True)
class StepPlan:
    recvs: tuple[Recv, ...]
    sends: tuple[Send, ...]
    early: bool  # its receptions may be posted when step t-2 has finished


@dataclass(frozen=True)
class Plan:
    steps: tuple[StepPlan, ...]
    scratch_count: int  # two halves: steps of even and odd index use different ones


_RawRecv = tuple[int, int, int, int, bool]  # peer, tag, start, stop, reduce
_RawSend = tuple[int, int, int, int]  # peer, tag, start, stop
_Raw = list[tuple[list[_RawRecv], list[_RawSend]]]  # per step: reception and send pieces


def compile_plan(schedule: Schedule, rank: int, piece: int) -> Plan:
    """Cut `rank`'s steps into pieces of at most `piece` elements and work out their order."""
    raws: dict[int, _Raw] = {}

    def raw_of(r: int) -> _Raw:
        if r not in raws:
            raws[r] = _pieces(schedule, r, piece)
        return raws[r]

    raw, half = raw_of(rank), 0
    steps: list[StepPlan] = []
    for t, (recvs, sends) in enumerate(raw):
        plan_recvs, offset = [], 0
        for peer, tg, a, b, reduce in recvs:
            guard = tuple(s for s, (_, _, c, d) in enumerate(sends) if c < b and a < d)
            mode = REDUCE if reduce else (COPY if guard else DIRECT)
            plan_recvs.append(Recv(peer, tg, a, b, mode, offset if mode != DIRECT else 0, guard))
            offset += b - a if mode != DIRECT else 0
        half = max(half, offset)
        prev = raw[t - 1][0] if t else []
        plan_sends = tuple(Send(peer, tg, a, b, _last_overlap(prev, a, b)) for peer, tg, a, b in sends)
        early = all(r.mode != DIRECT or _early_direct(raw_of, rank, t, r) for r in plan_recvs)
        steps.append(StepPlan(tuple(plan_recvs), plan_sends, early))
    # scratch offsets of odd steps move to the second half
    steps = [_shift(sp, half) if t % 2 else sp for t, sp in enumerate(steps)]
    return Plan(tuple(steps), 2 * half)


def _pieces(schedule: Schedule, rank: int, piece: int) -> _Raw:
    """Every op of `rank` cut into pieces; a piece's tag counts the messages src -> dst so far.

    Builder.transfer adds a send and its reception together, so both ends count alike.
    """
    counters: dict[tuple[int, int], int] = {}

    def tag(src: int, dst: int) -> int:
        n = counters.get((src, dst), 0)
        counters[(src, dst)] = n + 1
        return n

    raw: _Raw = []
    for step in schedule.for_rank(rank):
        recvs: list[_RawRecv] = []
        sends: list[_RawSend] = []
        for op in step:
            bounds = split(op.start, op.stop, max(1, -(-op.numel // piece)))
            for a, b in itertools.pairwise(bounds):
                if op.kind is OpKind.SEND:
                    sends.append((op.peer, tag(rank, op.peer), a, b))
                else:
                    recvs.append((op.peer, tag(op.peer, rank), a, b, op.kind is OpKind.RECV_REDUCE))
        raw.append((recvs, sends))
    return raw


def _last_overlap(recvs: list[_RawRecv], a: int, b: int) -> int:
    """The last reception piece of a step that writes into [a, b), or -1."""
    return max((j for j, r in enumerate(recvs) if r[2] < b and a < r[3]), default=-1)


def _early_direct(raw_of: Callable[[int], _Raw], rank: int, t: int, r: Recv) -> bool:
    """Whether a reception straight into the buffer at step t may be posted during step t-1.

    Not if step t-1 receives into its range. If step t-1 sends from its range, only when the
    data cannot arrive before those sends are done: every such send goes to the same peer q,
    and q posts the matching send only after receiving them (its `after` covers their tags).
    """
    if t == 0:
        return True
    prev_recvs, prev_sends = raw_of(rank)[t - 1]
    if any(c < r.stop and r.start < d for _, _, c, d, _ in prev_recvs):
        return False
    readers = [s for s in prev_sends if s[2] < r.stop and r.start < s[3]]
    if not readers:
        return True
    q = r.peer
    if any(s[0] != q for s in readers):
        return False
    q_recvs, q_sends = raw_of(q)[t - 1][0], raw_of(q)[t][1]
    match = next(s for s in q_sends if s[0] == rank and s[1] == r.tag)
    after = _last_overlap(q_recvs, match[2], match[3])
    seen = {(p, tg) for p, tg, *_ in q_recvs[: after + 1]}
    return all((rank, s[1]) in seen for s in readers)


def _shift(sp: StepPlan, by: int) -> StepPlan:
    recvs = tuple(
        Recv(r.peer, r.tag, r.start, r.stop, r.mode, r.scratch + by, r.guard) if r.mode != DIRECT else r
        for r in sp.recvs
    )
    return StepPlan(recvs, sp.sends, sp.early)
