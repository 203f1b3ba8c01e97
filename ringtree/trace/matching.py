"""One collective across ranks: the calls of all ranks matched by (group, sequence number).

Where the trace carries no sequence number (older Kineto, gloo), a call's number is its place
among the rank's calls of the same group, op, dtype (and size, except for all-to-all, whose
sizes differ by rank) within its ProfilerStep. Point-to-point sends and receives are not matched.
Every rank's call ends when the data has moved, so the shortest duration among the ranks is the
transfer; the rest of each rank's duration is waiting, and the last rank to start is the one
the others waited for.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ringtree.trace.events import Collective

UNMATCHED = ("send", "recv", "send_recv", "barrier")


@dataclass(frozen=True)
class Call:
    """One collective call across the ranks that made it."""

    op: str
    group: str
    group_size: int
    nbytes: int
    dtype: str
    step: int
    ranks: tuple[int, ...]
    starts: tuple[int, ...]  # ns, per rank
    ends: tuple[int, ...]

    @property
    def transfer_s(self) -> float:
        return min(e - s for s, e in zip(self.starts, self.ends, strict=True)) / 1e9

    def waits_s(self) -> list[float]:
        t = self.transfer_s
        return [(e - s) / 1e9 - t for s, e in zip(self.starts, self.ends, strict=True)]

    @property
    def last(self) -> int:
        """The rank that started last (the others waited for it)."""
        return self.ranks[max(range(len(self.starts)), key=lambda i: self.starts[i])]

    @property
    def lateness_s(self) -> float:
        """How much later the last rank started than the next-latest one."""
        if len(self.starts) < 2:
            return 0.0
        s = sorted(self.starts)
        return (s[-1] - s[-2]) / 1e9


def match(per_rank: dict[int, list[Collective]]) -> list[Call]:
    """The calls of every rank grouped into cross-rank calls, in the order of their first start."""
    by_key: dict[tuple[object, ...], list[tuple[int, Collective]]] = defaultdict(list)
    for rank, calls in per_rank.items():
        for key, c in _keys(calls):
            by_key[key].append((rank, c))
    out = []
    for key, members in by_key.items():
        if key[0] == "p2p":
            out += [_call([m]) for m in members]
            continue
        seen: dict[int, tuple[int, Collective]] = {}
        for rank, c in members:
            seen.setdefault(rank, (rank, c))  # one call per rank and key
        out.append(_call(sorted(seen.values())))
    return sorted(out, key=lambda c: min(c.starts))


def _keys(calls: list[Collective]) -> list[tuple[tuple[object, ...], Collective]]:
    counts: dict[tuple[object, ...], int] = defaultdict(int)
    out: list[tuple[tuple[object, ...], Collective]] = []
    for c in sorted(calls, key=lambda c: (c.launch if c.launch >= 0 else c.start, c.start)):
        if c.op in UNMATCHED:
            out.append((("p2p", c.op, c.start), c))
            continue
        if c.seq >= 0:
            out.append((("seq", c.group, c.seq, c.op), c))
            continue
        base = ("nth", c.group, c.step, c.op, c.dtype, None if c.op == "all_to_all" else c.nbytes)
        out.append(((*base, counts[base]), c))
        counts[base] += 1
    return out


def _call(members: list[tuple[int, Collective]]) -> Call:
    first = members[0][1]
    return Call(
        op=first.op,
        group=first.group,
        group_size=max(c.group_size for _, c in members),
        nbytes=max(c.nbytes for _, c in members),
        dtype=first.dtype,
        step=first.step,
        ranks=tuple(r for r, _ in members),
        starts=tuple(c.start for _, c in members),
        ends=tuple(c.end for _, c in members),
    )
