"""A collective schedule walked step by step: who sends what to whom, and what every rank holds after.

Indices: p ranks, r a rank, t a step, c a chunk. A chunk here is one of the segments the schedule's
operations cut the buffer into (for the ring: the p blocks; for pipelined trees: the 1 MiB
pipeline chunks). What a rank holds is tracked as the set of ranks whose input each of its chunks
contains (a bitmask, as `ringtree.schedules.verify` tracks it): {1, 2} is the partial sum of ranks
1 and 2, all p ranks is the fully reduced chunk.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ringtree.schedules import OpKind, Request, Schedule, build
from ringtree.schedules.verify import expected_state, initial_state
from ringtree.topology import Topology

MAX_RANKS = 256  # building and walking the ring's 2(p-1) x p operations takes seconds, not minutes


@dataclass(frozen=True)
class Move:
    """One transfer seen from one rank: the peer, the chunks, the bytes; `reduce` for a receive that sums."""

    peer: int
    chunks: tuple[int, ...]
    nbytes: int
    reduce: bool = False

    def as_dict(self, direction: str) -> dict[str, Any]:
        d: dict[str, Any] = {direction: self.peer, "chunks": list(self.chunks), "bytes": self.nbytes}
        return d if direction == "to" else {**d, "reduce": self.reduce}


@dataclass(frozen=True)
class StepView:
    """One step: what tracked ranks hold after it (chunk -> contributor mask), and the fewest and
    most chunks any rank holds complete (as the collective promises them) after it."""

    t: int
    holds: dict[int, dict[int, int]]
    done_min: int
    done_max: int


@dataclass(frozen=True)
class Walkthrough:
    """A schedule with its chunks, each rank's holdings before step 0, and every step."""

    schedule: Schedule
    itemsize: int
    cuts: tuple[int, ...]  # chunk c is elements [cuts[c], cuts[c+1])
    initial: tuple[dict[int, int], ...]
    steps: tuple[StepView, ...]
    root: int = 0

    @property
    def p(self) -> int:
        return self.schedule.world_size

    @property
    def num_chunks(self) -> int:
        return len(self.cuts) - 1

    @property
    def nbytes(self) -> int:
        return self.schedule.count * self.itemsize

    def bytes_sent(self, r: int) -> int:
        return (
            sum(op.numel for st in self.schedule.steps[r] for op in st if op.kind is OpKind.SEND)
            * self.itemsize
        )

    def moves(self, r: int, t: int) -> tuple[tuple[Move, ...], tuple[Move, ...]]:
        """Rank r's sends and receives at step t, in chunks."""
        sends: list[Move] = []
        recvs: list[Move] = []
        for op in self.schedule.steps[r][t]:
            chunks = tuple(range(_i(self.cuts, op.start), _i(self.cuts, op.stop)))
            move = Move(op.peer, chunks, op.numel * self.itemsize, op.kind is OpKind.RECV_REDUCE)
            (sends if op.kind is OpKind.SEND else recvs).append(move)
        return tuple(sends), tuple(recvs)

    def kind(self, t: int) -> str:
        """'reduce' (receives that sum), 'copy' (receives that overwrite) or 'reduce+copy' at step t."""
        kinds = {op.kind for rank in self.schedule.steps for op in rank[t] if op.kind is not OpKind.SEND}
        names = {frozenset({OpKind.RECV_REDUCE}): "reduce", frozenset({OpKind.RECV}): "copy"}
        return names.get(frozenset(kinds), "reduce+copy")

    def messages(self, t: int) -> int:
        return sum(op.kind is OpKind.SEND for rank in self.schedule.steps for op in rank[t])

    def busiest_bytes(self, t: int) -> int:
        """The most bytes one rank sends or receives at step t."""
        return self.itemsize * max(
            max(
                sum(op.numel for op in rank[t] if (op.kind is OpKind.SEND) is sending)
                for rank in self.schedule.steps
            )
            for sending in (True, False)
        )

    def final(self, r: int) -> dict[int, int]:
        """What tracked rank r holds after the last step."""
        return self.steps[-1].holds[r] if self.steps else self.initial[r]


def walk(
    collective: str,
    algorithm: str,
    p: int,
    nbytes: int,
    nodes: int = 1,
    root: int = 0,
    itemsize: int = 4,
    tracked: set[int] | None = None,
) -> Walkthrough:
    """Build the schedule ringtree runs and play it, keeping holdings for `tracked` ranks (default: all)."""
    if not 2 <= p <= MAX_RANKS:
        raise ValueError(f"--ranks must be between 2 and {MAX_RANKS}, got {p}")
    if nodes < 1 or p % nodes:
        raise ValueError(f"--nodes must divide --ranks, got {nodes} nodes for {p} ranks")
    topology = Topology(p, p // nodes)
    s = build(Request(collective, algorithm, topology, nbytes // itemsize, itemsize, root))
    return play(s, itemsize, root, set(range(p)) if tracked is None else tracked)


def play(s: Schedule, itemsize: int, root: int, tracked: set[int]) -> Walkthrough:
    """Play `s`: sends carry the data as it was when the step began, receives apply after."""
    cuts = sorted(
        {0, s.count} | {x for rank in s.steps for st in rank for op in st for x in (op.start, op.stop)}
    )
    segs = len(cuts) - 1
    state = [[0] * segs for _ in range(s.world_size)]
    for r, held in enumerate(initial_state(s, root)):
        for start, stop, mask in held:
            state[r][_i(cuts, start) : _i(cuts, stop)] = [mask] * (_i(cuts, stop) - _i(cuts, start))
    target = [_target(cuts, want) for want in expected_state(s, root)]
    done = [sum(1 for c, m in enumerate(row) if m and m == target[r].get(c)) for r, row in enumerate(state)]
    initial = tuple(_nonzero(row) for row in state)
    views = []
    for t in range(s.num_steps):
        _play_step(s, t, cuts, state, target, done)
        views.append(StepView(t, {r: _nonzero(state[r]) for r in sorted(tracked)}, min(done), max(done)))
    return Walkthrough(s, itemsize, tuple(cuts), initial, tuple(views), root)


def _play_step(
    s: Schedule,
    t: int,
    cuts: list[int],
    state: list[list[int]],
    target: list[dict[int, int]],
    done: list[int],
) -> None:
    """Apply step t to `state` (contributor masks per rank and chunk), counting complete chunks in `done`."""
    payload = {
        (r, op.peer, op.start): state[r][_i(cuts, op.start) : _i(cuts, op.stop)]
        for r in range(s.world_size)
        for op in s.steps[r][t]
        if op.kind is OpKind.SEND
    }
    for r in range(s.world_size):
        for op in s.steps[r][t]:
            if op.kind is OpKind.SEND:
                continue
            lo = _i(cuts, op.start)
            for j, incoming in enumerate(payload[(op.peer, r, op.start)]):
                c = lo + j
                was = bool(state[r][c]) and state[r][c] == target[r].get(c)
                state[r][c] = incoming if op.kind is OpKind.RECV else state[r][c] | incoming
                done[r] += int(state[r][c] == target[r].get(c)) - int(was)


def _target(cuts: list[int], want: list[tuple[int, int, int]]) -> dict[int, int]:
    return {c: mask for start, stop, mask in want for c in range(_i(cuts, start), _i(cuts, stop))}


def _nonzero(row: list[int]) -> dict[int, int]:
    return {c: m for c, m in enumerate(row) if m}


def _i(cuts: Sequence[int], x: int) -> int:
    return bisect_left(cuts, x)


def members(mask: int) -> list[int]:
    """The ranks in a contributor mask, ascending."""
    return [r for r in range(mask.bit_length()) if mask >> r & 1]


def to_json(w: Walkthrough) -> list[dict[str, Any]]:
    """One entry per step: per rank its sends, its receives and (when tracked) what it holds after."""
    out = []
    for v in w.steps:
        ranks = []
        for r in range(w.p):
            sends, recvs = w.moves(r, v.t)
            entry: dict[str, Any] = {
                "rank": r,
                "sends": [m.as_dict("to") for m in sends],
                "recvs": [m.as_dict("from") for m in recvs],
            }
            if r in v.holds:
                entry["holds"] = {str(c): members(m) for c, m in v.holds[r].items()}
            ranks.append(entry)
        out.append({"step": v.t, "kind": w.kind(v.t), "ranks": ranks})
    return out


def holdings_frames(w: Walkthrough) -> list[dict[str, Any]]:
    """Per step (and the start), for `ringtree.plots.plot_holdings`: how many ranks' inputs every
    rank's chunks sum, and the (rank, chunk) pairs received in the step. Needs every rank tracked."""

    def held(holds: dict[int, dict[int, int]]) -> list[list[int]]:
        return [[holds[r].get(c, 0).bit_count() for c in range(w.num_chunks)] for r in range(w.p)]

    frames: list[dict[str, Any]] = [
        {"title": "start", "held": held(dict(enumerate(w.initial))), "received": []}
    ]
    for v in w.steps:
        got = [(r, c) for r in range(w.p) for m in w.moves(r, v.t)[1] for c in m.chunks]
        frames.append({"title": f"after step {v.t} ({w.kind(v.t)})", "held": held(v.holds), "received": got})
    return frames
