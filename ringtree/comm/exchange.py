"""Runs one rank's part of an all-to-all schedule: shared memory on one host, point-to-point elsewhere.

An all-to-all schedule addresses the block matrix (`ringtree.schedules.alltoall`); a rank keeps
only its part of it. `Storage` maps every block a rank touches to real memory: its own row to
the caller's input, its own column to the caller's output, and a block it only forwards
(Bruck, hierarchical) to scratch. Every op of these schedules covers exactly one block.

Point-to-point (gloo across hosts, NCCL): each step posts one message per peer and direction,
packing the step's blocks for one peer into one buffer (Bruck's point: few, larger messages),
and waits for them. Shared memory (every rank on this host, gloo): each rank publishes in its
shared buffer only the blocks it sends (copied in before the first barrier, or received there
when it forwards them); a receive copies a block straight out of the peer's shared buffer into
its place, and steps are separated by barriers among the ranks that exchange data. The blocks
move unchanged, so every algorithm and transport gives torch's result bit for bit.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ringtree.comm import shm
from ringtree.comm.errors import CollectiveError
from ringtree.comm.executor import describe_failure, wait_step
from ringtree.schedules import Op, OpKind, Schedule


def block_of(schedule: Schedule, start: int) -> tuple[int, int]:
    """(src, dst) of the non-empty block that begins at `start`."""
    k = bisect.bisect_right(schedule.blocks, start) - 1
    return divmod(k, schedule.world_size)


@dataclass(frozen=True)
class Layout:
    """Where rank `rank` keeps each block it touches: ("in"|"out"|"relay", offset) by block start."""

    places: dict[int, tuple[str, int]]
    relay_count: int


_derived: dict[tuple[int, str, int], tuple[Schedule, Any]] = {}


def _cached(schedule: Schedule, what: str, rank: int, make: Any) -> Any:
    """`make()` once per schedule object (schedules are cached, so repeated calls hit this): by
    identity, since hashing a schedule walks all its steps."""
    key = (id(schedule), what, rank)
    have = _derived.get(key)
    if have is None or have[0] is not schedule:
        if len(_derived) > 1024:
            _derived.clear()
        have = _derived[key] = (schedule, make())
    return have[1]


def layout(schedule: Schedule, rank: int) -> Layout:
    result: Layout = _cached(schedule, "layout", rank, lambda: _layout(schedule, rank))
    return result


def _layout(schedule: Schedule, rank: int) -> Layout:
    p, bounds = schedule.world_size, schedule.blocks
    row = bounds[rank * p]
    out_offsets = [0]
    for i in range(p):
        a = i * p + rank
        out_offsets.append(out_offsets[-1] + bounds[a + 1] - bounds[a])
    places: dict[int, tuple[str, int]] = {}
    relay = 0
    for step in schedule.for_rank(rank):
        for op in step:
            if op.start in places:
                continue
            src, dst = block_of(schedule, op.start)
            if src == rank:
                places[op.start] = ("in", op.start - row)
            elif dst == rank:
                places[op.start] = ("out", out_offsets[src] + op.start - bounds[src * p + dst])
            else:
                places[op.start] = ("relay", relay)
                relay += op.numel
    return Layout(places, relay)


class Storage:
    """One call's memory of one rank: the views of its input, output and relay scratch."""

    def __init__(self, schedule: Schedule, rank: int, input: torch.Tensor, output: torch.Tensor) -> None:
        self.layout = layout(schedule, rank)
        self.tensors = {"in": input, "out": output}

    def view(self, op: Op) -> torch.Tensor:
        where, at = self.layout.places[op.start]
        if where not in self.tensors:  # scratch for forwarded blocks, made when first needed
            like = self.tensors["in"]
            self.tensors[where] = torch.empty(self.layout.relay_count, dtype=like.dtype, device=like.device)
        return self.tensors[where][at : at + op.numel]


def copy_own_block(schedule: Schedule, rank: int, input: torch.Tensor, output: torch.Tensor) -> None:
    """Block (rank, rank) never travels: copy it from input to output."""
    p, bounds = schedule.world_size, schedule.blocks
    k = rank * p + rank
    n = bounds[k + 1] - bounds[k]
    if n:
        at_in = bounds[k] - bounds[rank * p]
        at_out = sum(bounds[i * p + rank + 1] - bounds[i * p + rank] for i in range(rank))
        output[at_out : at_out + n].copy_(input[at_in : at_in + n])


def execute(
    input: torch.Tensor,
    output: torch.Tensor,
    schedule: Schedule,
    rank: int,
    *,
    peers: list[int],
    group: dist.ProcessGroup | None,
    timeout: timedelta,
    what: str,
) -> None:
    """Run group rank `rank`'s steps of the all-to-all `schedule` from flat `input` to flat `output`."""
    copy_own_block(schedule, rank, input, output)
    if schedule.num_steps == 0:
        return
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if shm.usable(input.device, pg, timeout):
        _shared(Storage(schedule, rank, input, output), schedule, rank, pg, timeout, what)
    else:
        _point_to_point(Storage(schedule, rank, input, output), schedule, rank, peers, group, timeout, what)


def linear_shared(
    input: torch.Tensor,
    output: torch.Tensor,
    matrix: tuple[int, ...],
    rank: int,
    pg: dist.ProcessGroup,
    timeout: timedelta,
    what: str,
) -> None:
    """The linear schedule over shared memory, its offsets read off the block matrix instead of
    walked op by op: what `_shared` does with the built "linear" schedule (publish, one barrier,
    every peer's block copied out), without building it. An MoE layer's every exchange has new
    splits, so a built schedule is never reused, and building one costs more than the copies.

    matrix: p x p elements, [i * p + j] what rank i sends rank j; input and output flat, the
    blocks in rank order. Every rank passes the same matrix (usable() said yes for the group).
    """
    p = round(len(matrix) ** 0.5)
    rows = [matrix[i * p : i * p + p] for i in range(p)]
    travels = any(rows[i][j] for i in range(p) for j in range(p) if i != j)  # alike on every rank
    item, dtype = input.element_size(), input.dtype
    group = shm.group_state(pg, timeout)
    with group.lock:
        regions: list[torch.Tensor] = []
        if travels:
            regions = [r.view(dtype) for r in group.regions(max(map(sum, rows)) * item, timeout)]
            regions[rank][: input.numel()].copy_(input)
            group.sync(timeout, what, 0, 1)  # every rank: inputs published, the call before last done
        at = 0
        for i, row in enumerate(rows):
            n, offset = row[rank], sum(row[:rank])  # block (i, rank): where rank i keeps it
            if n:
                source = input if i == rank else regions[i]
                output[at : at + n].copy_(source[offset : offset + n])
            at += n


def _by_peer(step: tuple[Op, ...], kind: OpKind) -> Iterator[tuple[int, list[Op]]]:
    """A step's ops of one kind grouped by peer, in the order of each peer's first op."""
    groups: dict[int, list[Op]] = {}
    for op in step:
        if (op.kind is OpKind.SEND) == (kind is OpKind.SEND):
            groups.setdefault(op.peer, []).append(op)
    yield from groups.items()


def _point_to_point(
    storage: Storage,
    schedule: Schedule,
    rank: int,
    peers: list[int],
    group: dist.ProcessGroup | None,
    timeout: timedelta,
    what: str,
) -> None:
    steps = schedule.for_rank(rank)
    n = len(steps)
    for t, step in enumerate(steps):
        if not step:
            continue
        p2p: list[dist.P2POp] = []
        posted: list[Op] = []  # the first op of each message, to name its peer and direction
        unpack: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        for peer, ops in _by_peer(step, OpKind.SEND):
            views = [storage.view(op) for op in ops]
            data = views[0] if len(views) == 1 else torch.cat(views)
            p2p.append(dist.P2POp(dist.isend, data, peers[peer], group))
            posted.append(ops[0])
        for peer, ops in _by_peer(step, OpKind.RECV):
            views = [storage.view(op) for op in ops]
            into = views[0]
            if len(views) > 1:
                into = torch.empty(sum(v.numel() for v in views), dtype=into.dtype, device=into.device)
                unpack.append((into, views))
            p2p.append(dist.P2POp(dist.irecv, into, peers[peer], group))
            posted.append(ops[0])
        works = _post(p2p, posted, group, peers, t, n, timeout, what)
        wait_step(works, tuple(posted), t, n, peers, timeout, what)
        for packed, views in unpack:
            _scatter(packed, views)


def _post(
    p2p: list[dist.P2POp],
    posted: list[Op],
    group: dist.ProcessGroup | None,
    peers: list[int],
    t: int,
    n: int,
    timeout: timedelta,
    what: str,
) -> list[dist.Work]:
    """Post a step's messages: batched where the backend needs it (NCCL), one by one on gloo, so
    that a message that fails as it is posted (the peer's connection is gone) names its peer."""
    if dist.get_backend(group) != "gloo":
        try:
            return dist.batch_isend_irecv(p2p)
        except RuntimeError as e:
            raise CollectiveError(describe_failure(e, None, None, t, n, timeout, what)) from e
    works = []
    for message, op in zip(p2p, posted, strict=True):
        try:
            work = message.op(message.tensor, message.peer, message.group)
        except RuntimeError as e:
            who = peers[op.peer]
            raise CollectiveError(describe_failure(e, op, who, t, n, timeout, what), peer=who) from e
        assert work is not None
        works.append(work)
    return works


def _scatter(packed: torch.Tensor, views: list[torch.Tensor]) -> None:
    at = 0
    for v in views:
        v.copy_(packed[at : at + v.numel()])
        at += v.numel()


@dataclass(frozen=True)
class _Published:
    """Where each rank keeps, in its shared buffer, the blocks it sends: offset by block start."""

    slots: list[dict[int, int]]
    sizes: list[int]


def _published(schedule: Schedule) -> _Published:
    result: _Published = _cached(schedule, "published", -1, lambda: _publish(schedule))
    return result


def _publish(schedule: Schedule) -> _Published:
    slots: list[dict[int, int]] = []
    sizes: list[int] = []
    for r in range(schedule.world_size):
        mine: dict[int, int] = {}
        at = 0
        for step in schedule.for_rank(r):
            for op in step:
                if op.kind is OpKind.SEND and op.start not in mine:
                    mine[op.start] = at
                    at += op.numel
        slots.append(mine)
        sizes.append(at)
    return _Published(slots, sizes)


def _neighbours(schedule: Schedule, rank: int) -> tuple[int, ...]:
    steps = schedule.for_rank(rank)
    result: tuple[int, ...] = _cached(
        schedule, "neighbours", rank, lambda: tuple(sorted({op.peer for step in steps for op in step}))
    )
    return result


def _shared(
    storage: Storage, schedule: Schedule, rank: int, pg: dist.ProcessGroup, timeout: timedelta, what: str
) -> None:
    pub = _published(schedule)
    dtype, item = storage.tensors["in"].dtype, storage.tensors["in"].element_size()
    group = shm.group_state(pg, timeout)
    n, near = schedule.num_steps, _neighbours(schedule, rank)
    with group.lock:
        regions = [r.view(dtype) for r in group.regions(max(pub.sizes) * item, timeout)]
        mine = pub.slots[rank]
        steps = schedule.for_rank(rank)
        for step in steps:  # blocks of its own input that this rank sends: published up front
            for op in step:
                if op.kind is OpKind.SEND and storage.layout.places[op.start][0] == "in":
                    at = mine[op.start]
                    regions[rank][at : at + op.numel].copy_(storage.view(op))
        group.sync(timeout, what, 0, n)  # every rank: inputs published, the call before last done
        for t, step in enumerate(steps):
            for op in step:
                if op.kind is OpKind.SEND:
                    continue
                at = pub.slots[op.peer][op.start]
                incoming = regions[op.peer][at : at + op.numel]
                if op.start in mine:  # forwarded later: keep it where peers will read it
                    regions[rank][mine[op.start] : mine[op.start] + op.numel].copy_(incoming)
                else:
                    storage.view(op).copy_(incoming)
            if t + 1 < n:  # no barrier after the last step: the next call uses the other half
                group.sync(timeout, what, t + 1, n, near)
