"""The schedule data model: per rank, ordered steps of sends and receives on chunks of a flat buffer.

A schedule is the single definition of a collective algorithm. The executor in
`ringtree.comm` runs it over torch.distributed; the simulator replays it over a
modelled network. Both read the same `Schedule`, so what is simulated is what runs.

Conventions (used the same way in every generator):
  p        world size; r a rank; t a global step index
  count    elements in the flat buffer; a chunk is the element range [start, stop)
           (all-to-all: the buffer is the block matrix every rank addresses alike)
  bounds   a list of p+1 (or m+1) offsets cutting the buffer into blocks
Every step is global: step t of rank a and step t of rank b happen "together", and every
send at step t has its matching receive at step t. All operations of one step are posted
at once, so a schedule whose sends and receives match step by step cannot deadlock.
A send transmits the data as it was when the step began; receives that reduce are applied
after every operation of the step has completed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple


class OpKind(IntEnum):
    SEND = 0
    RECV = 1  # receive and overwrite the chunk
    RECV_REDUCE = 2  # receive and combine into the chunk with the reduction op


class Op(NamedTuple):
    kind: OpKind
    peer: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


Step = tuple[Op, ...]


@dataclass(frozen=True)
class Schedule:
    """`steps[r][t]` is what rank r does at global step t; every rank has the same number of steps."""

    algorithm: str
    collective: str
    world_size: int
    count: int
    steps: tuple[tuple[Step, ...], ...]
    # all_to_all only: the p*p + 1 offsets of the block matrix (block (i, j) of rank i's input
    # for rank j at index i*p + j); `count` is then the matrix's total (see schedules.alltoall)
    blocks: tuple[int, ...] = ()

    @property
    def num_steps(self) -> int:
        return len(self.steps[0]) if self.steps else 0

    def for_rank(self, rank: int) -> tuple[Step, ...]:
        return self.steps[rank]

    def scratch_count(self, rank: int) -> int:
        """Elements of scratch space a rank needs: the most it receives-to-reduce in one step."""
        return max(
            (sum(op.numel for op in step if op.kind is OpKind.RECV_REDUCE) for step in self.steps[rank]),
            default=0,
        )


@dataclass
class Builder:
    """Collects ops at global steps. Phases write at steps relative to `base` and return their length."""

    world_size: int
    base: int = 0
    _steps: list[list[list[Op]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._steps = [[] for _ in range(self.world_size)]

    def transfer(self, t: int, src: int, dst: int, start: int, stop: int, reduce: bool) -> None:
        """src sends [start, stop) to dst at step base+t; dst overwrites or reduces it."""
        if stop <= start or src == dst:
            return
        kind = OpKind.RECV_REDUCE if reduce else OpKind.RECV
        self._add(self.base + t, src, Op(OpKind.SEND, dst, start, stop))
        self._add(self.base + t, dst, Op(kind, src, start, stop))

    def sequence(self, *phases: Callable[[], int]) -> int:
        """Run phases one after another (each returns its step count); base is left unchanged."""
        start = self.base
        for phase in phases:
            self.base += phase()
        total = self.base - start
        self.base = start
        return total

    def _add(self, t: int, rank: int, op: Op) -> None:
        rank_steps = self._steps[rank]
        while len(rank_steps) <= t:
            rank_steps.append([])
        rank_steps[t].append(op)

    def build(self, algorithm: str, collective: str, count: int) -> Schedule:
        n = max((len(s) for s in self._steps), default=0)
        steps = tuple(tuple(tuple(s[t]) if t < len(s) else () for t in range(n)) for s in self._steps)
        return Schedule(algorithm, collective, self.world_size, count, steps)


def split(start: int, stop: int, parts: int) -> list[int]:
    """parts+1 offsets cutting [start, stop) into near-equal blocks (the first ones larger)."""
    n = stop - start
    return [start + _cut(n, parts, i) for i in range(parts + 1)]


def _cut(n: int, parts: int, i: int) -> int:
    # Blocks differ by at most one element; with fewer elements than parts, trailing blocks are empty.
    q, rem = divmod(n, parts)
    return i * q + min(i, rem)
