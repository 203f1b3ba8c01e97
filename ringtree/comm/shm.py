"""Shared-memory transport: a schedule's steps between ranks of one host, through /dev/shm.

gloo has one transport, TCP: between two processes of the same host every byte is copied
into the kernel's loopback and out again, and every message costs a "ready to receive" notice
and thread wake-ups. NCCL, on GPUs of one node without a direct path, moves data through
shared memory (its SHM transport), as Open MPI's shared-memory BTL and DeepSpeed's CPU
all-reduce do on CPUs. This module is that transport for ringtree's schedules:

- every rank of the group keeps one buffer in a file under /dev/shm that every other rank
  maps (`torch.from_file(..., shared=True)`); the file is unlinked as soon as all have
  mapped it, so nothing is left behind even if a process dies;
- a collective runs the schedule unchanged: a receive reads the sender's range straight out
  of the sender's buffer and combines it into the receiver's own (no socket, no intermediate
  copy); after each step but the last the ranks meet at a barrier rung through named pipes
  (a few tens of microseconds, where a gloo message round costs a millisecond on a busy
  host), so that a range is read only when its sender has finished writing it, and
  overwritten only when every reader is done with it. Alternate calls use alternate halves of
  the buffers, so the last step needs no barrier (see `_Group`). A step in which some rank
  receives into a range it also sends first stages what it reads, meets the others, then
  combines;
- only what peers read goes through shared memory (see `_compile`): the rest of the work
  reads and writes the caller's tensor directly.
- a tensor that already lives in shared memory on every rank (`shared_buffer`: DDP's buckets)
  is reduced where it lies: peers read its ranges in place, nothing is copied in or out, and
  instead of barriers a rank signals the ranks that read from it and waits only for those it
  reads from (`shm_flow`, where the schedule allows it: every all-reduce ringtree has; else
  barriers among the ranks that exchange data).
- a rank waiting for a peer sleeps as a batch thread: woken, it queues for the core instead of
  preempting the rank that rang it.

The schedule, the order of the reductions and so the result are exactly those of the
point-to-point executor: only the transport differs. It serves CPU tensors on gloo, of any
size (measured faster than gloo's loopback TCP from 4 KiB to 64 MiB), when every rank of the
group sits on this host (same hostname, network namespace and /dev/shm: ranks of different
`ringtree emulate` nodes never share memory). RINGTREE_TRANSPORT=p2p turns it off.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import select
import socket
import struct
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple, overload

import torch
import torch.distributed as dist

from ringtree.comm import shm_flow
from ringtree.comm.errors import CollectiveError
from ringtree.comm.flight_recorder import default_store
from ringtree.comm.reduce_ops import COMBINE_INTO, Combine, CombineInto
from ringtree.schedules import OpKind, Schedule, Step

SHM_DIR = Path("/dev/shm")
TRANSPORTS = ("shm", "p2p")
TRANSPORT_ENV = "RINGTREE_TRANSPORT"


def transport() -> str:
    """The transport asked for: RINGTREE_TRANSPORT = shm (the default: shared memory where the
    group is on one host, point-to-point elsewhere) or p2p (always gloo's point-to-point)."""
    name = os.environ.get(TRANSPORT_ENV, "shm")
    if name not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT_ENV}={name!r} is not a transport; use one of {', '.join(TRANSPORTS)}")
    return name


def usable(device: torch.device, pg: dist.ProcessGroup, timeout: timedelta) -> bool:
    """Whether a collective on `device` runs over shared memory. The same answer on every rank of
    the group: everything it reads is the same everywhere (device, backend, the gathered hosts).
    """
    if transport() == "p2p" or device.type != "cpu" or dist.get_backend(pg) != "gloo":
        return False
    if not SHM_DIR.is_dir() or default_store() is None:
        return False
    return _group(pg, timeout).one_host


def execute(
    buf: torch.Tensor,
    schedule: Schedule,
    rank: int,
    combine: Combine,
    *,
    pg: dist.ProcessGroup,
    timeout: timedelta,
    what: str,
) -> None:
    """Run group rank `rank`'s steps of `schedule` on `buf` in place, through shared memory."""
    plan = _plan(schedule, rank)
    into = COMBINE_INTO[combine]
    group = _group(pg, timeout)
    with group.lock:
        placed = group.in_place(plan, buf)
        if placed is not None:
            flow = shm_flow.rounds(schedule, rank)
            if flow is None:
                _execute_in_place(placed, plan, into, group, timeout, what, schedule.num_steps)
            else:
                _flow_in_place(placed, plan, into, group, timeout, what, flow)
            return
        views = group.views(plan, rank, buf.numel() * buf.element_size(), buf.dtype, timeout)
        n = schedule.num_steps
        near = plan.neighbours  # inside a call a rank meets only the ranks it exchanges with
        for (a, b), own in zip(plan.copy_in, views.copy_in, strict=True):
            own.copy_(buf[a:b])
        group.sync(timeout, what, 0, n)  # every rank: each has finished the call before last
        for t, ops in enumerate(plan.steps):
            if t in plan.staged:
                held = [v.clone() for v in views.reads[t]]
                group.sync(timeout, what, t + 1, n, near)
            else:
                held = views.reads[t]
            for o, incoming, own in zip(ops, held, views.own[t], strict=True):
                out = own if o.to_shared else buf[o.start : o.stop]
                if o.reduce:
                    into(own if o.from_shared else buf[o.start : o.stop], incoming, out)
                else:
                    out.copy_(incoming)
            if t + 1 < n:  # no barrier after the last step: the next call uses the other half
                group.sync(timeout, what, t + 1, n, near)
        for (a, b), own in zip(plan.copy_out, views.copy_out, strict=True):
            buf[a:b].copy_(own)


def shared_buffer(
    numel: int, dtype: torch.dtype, pg: dist.ProcessGroup, timeout: timedelta
) -> torch.Tensor | None:
    """A zeroed CPU tensor of `numel` elements that lives in shared memory, or None where the
    group does not use shared memory (collective: every rank asks for the same, in the same order).

    A collective on such a tensor (or a slice of it) runs in place when every rank passes its own
    at the same offset: peers read it where it lies, so nothing is copied in or out of the
    transport (torch DDP's buckets registered with the transport, as NCCL's registered buffers).
    """
    if not usable(torch.device("cpu"), pg, timeout):
        return None
    nbytes = numel * dtype.itemsize
    mapped = _map_all(pg, max(nbytes, 1), timeout, required=False)
    if mapped is None:  # /dev/shm too small on some rank: private memory on every rank, as before
        return None
    own = mapped[dist.get_rank(pg)][:nbytes].view(dtype)
    _group(pg, timeout).register(own, mapped)
    return own


def is_shared(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lies in a buffer from `shared_buffer` (of any group)."""
    start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    with _groups_lock:
        groups = list(_groups.values())
    for group in groups:
        with group.lock:
            if group.arena_of(start, nbytes) is not None:
                return True
    return False


def _execute_in_place(
    placed: _Placed, plan: _Plan, into: CombineInto, group: _Group, timeout: timedelta, what: str, n: int
) -> None:
    """The schedule's steps on a tensor every rank keeps in shared memory: read the peers' ranges
    where they lie, combine into this rank's own. The first barrier (every rank) says every input
    is written; one among the neighbours after the last step says no peer still reads this
    rank's tensor when the caller writes it again."""
    near = plan.neighbours
    group.sync(timeout, what, 0, n)
    for t, (reads, own) in enumerate(zip(placed.reads, placed.own, strict=True)):
        held = reads
        if t in plan.staged:
            held = [v.clone() for v in reads]
            group.sync(timeout, what, t + 1, n, near)
        for (_, _, _, reduce), incoming, mine in zip(plan.in_place[t], held, own, strict=True):
            if reduce:
                into(mine, incoming, mine)
            else:
                mine.copy_(incoming)
        group.sync(timeout, what, t + 1, n, near)


def _flow_in_place(
    placed: _Placed,
    plan: _Plan,
    into: CombineInto,
    group: _Group,
    timeout: timedelta,
    what: str,
    flow: list[shm_flow.Round],
) -> None:
    """An in-place call with signals instead of barriers (`shm_flow`): before step t this rank
    signals the ranks that read from it at step t and waits for those it reads from; at the end
    it releases the ranks it read from and waits for its readers."""
    n = len(flow) - 1
    for t, (notify, wait) in enumerate(flow):
        if notify or wait:
            group.sync(timeout, what, t, n, notify, wait)
        if t == n:
            return
        for (_, _, _, reduce), incoming, mine in zip(
            plan.in_place[t], placed.reads[t], placed.own[t], strict=True
        ):
            if reduce:
                into(mine, incoming, mine)
            else:
                mine.copy_(incoming)


class _Placed(NamedTuple):
    """One in-place call's slices: per step, what this rank reads from peers and its own ranges."""

    reads: list[list[torch.Tensor]]
    own: list[list[torch.Tensor]]


class _Read(NamedTuple):
    """One receive over shared memory: read [start, stop) of `peer`'s buffer and either copy it
    or combine it with this rank's value (held in its shared buffer or still in the caller's
    tensor), writing the result to its shared buffer or straight to the caller's tensor."""

    peer: int
    start: int
    stop: int
    reduce: bool
    from_shared: bool
    to_shared: bool


@dataclass(frozen=True)
class _Plan:
    copy_in: list[tuple[int, int]]  # ranges peers read before this rank writes them
    steps: list[list[_Read]]
    staged: frozenset[int]
    copy_out: list[tuple[int, int]]  # ranges whose final value is only in the shared buffer
    neighbours: tuple[int, ...]  # the peers this rank sends to or receives from at any step
    in_place: list[list[tuple[int, int, int, bool]]]  # per step (peer, start, stop, reduce) received


_plans: weakref.WeakKeyDictionary[Schedule, dict[int, _Plan]] = weakref.WeakKeyDictionary()


def _plan(schedule: Schedule, rank: int) -> _Plan:
    per_rank = _plans.setdefault(schedule, {})
    if rank not in per_rank:
        per_rank[rank] = _compile(schedule, rank)
    return per_rank[rank]


def _compile(schedule: Schedule, rank: int) -> _Plan:
    """Decide, for every elementary range of the buffer, where its value lives at each step.

    A value goes into shared memory only when a peer reads it before it is rewritten (this
    rank's sends are the peers' reads); otherwise it stays in the caller's tensor. So the
    original data is copied in only where a peer reads it first, a first reduction combines
    straight from the caller's tensor, a last write that no peer reads goes straight to it,
    and only final values left in shared memory are copied out: for the ring, one block in and
    p - 2 blocks out instead of the whole buffer twice.
    """
    steps = schedule.for_rank(rank)
    cuts = sorted({0, schedule.count, *(x for step in steps for op in step for x in (op.start, op.stop))})
    pieces = list(itertools.pairwise(cuts))
    reads: dict[tuple[int, int], list[int]] = {piece: [] for piece in pieces}
    writes: dict[tuple[int, int], list[int]] = {piece: [] for piece in pieces}
    for t, step in enumerate(steps):
        for op in step:
            for piece in _covered(pieces, op.start, op.stop):
                (reads if op.kind is OpKind.SEND else writes)[piece].append(t)
    copy_in = [p for p in pieces if reads[p] and (not writes[p] or reads[p][0] <= writes[p][0])]
    in_shared = set(copy_in)  # pieces whose current value is (also) in the shared buffer
    plan_steps: list[list[_Read]] = []
    for t, step in enumerate(steps):
        ops = []
        for op in step:
            if op.kind is OpKind.SEND:
                continue
            for piece in _covered(pieces, op.start, op.stop):
                later = [w for w in writes[piece] if w > t]
                until = later[0] if later else schedule.num_steps
                shared = any(t < r <= until for r in reads[piece])  # read before it is rewritten
                ops.append(_Read(op.peer, *piece, op.kind is OpKind.RECV_REDUCE, piece in in_shared, shared))
                (in_shared.add if shared else in_shared.discard)(piece)
        plan_steps.append(_merge(ops))
    copy_out = [p for p in pieces if writes[p] and p in in_shared]
    neighbours = tuple(sorted({op.peer for step in steps for op in step} - {rank}))
    in_place = [
        [
            (op.peer, op.start, op.stop, op.kind is OpKind.RECV_REDUCE)
            for op in step
            if op.kind is not OpKind.SEND
        ]
        for step in steps
    ]
    staged = _staged_steps(schedule)
    return _Plan(_join(copy_in), plan_steps, staged, _join(copy_out), neighbours, in_place)


def _covered(pieces: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    i = bisect.bisect_left(pieces, (start, start))
    out = []
    while i < len(pieces) and pieces[i][1] <= stop:
        out.append(pieces[i])
        i += 1
    return out


def _merge(ops: list[_Read]) -> list[_Read]:
    """Adjacent reads from one peer with the same treatment become one (fewer, larger calls)."""
    out: list[_Read] = []
    for o in ops:
        prev = out[-1] if out else None
        if prev is not None and prev.stop == o.start and _kind(prev) == _kind(o):
            out[-1] = prev._replace(stop=o.stop)
        else:
            out.append(o)
    return out


def _kind(o: _Read) -> _Read:
    return o._replace(start=0, stop=0)


def _join(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _staged_steps(schedule: Schedule) -> frozenset[int]:
    """Steps in which some rank receives into a range it also sends: what it reads must be
    staged before anyone writes (a send transmits the data as it was when the step began)."""
    return frozenset(
        t
        for t in range(schedule.num_steps)
        if any(_overlaps(schedule.steps[r][t]) for r in range(schedule.world_size))
    )


def _overlaps(step: Step) -> bool:
    sends = [(op.start, op.stop) for op in step if op.kind is OpKind.SEND]
    recvs = [(op.start, op.stop) for op in step if op.kind is not OpKind.SEND]
    return any(a < d and c < b for a, b in sends for c, d in recvs)


class _Doorbells:
    """A barrier among the ranks of one host through named pipes (FIFOs) under /dev/shm.

    Ringing is one 4-byte write of this rank's number into a peer's pipe; waiting is reading
    this rank's own pipe until every peer it meets has rung as often as this rank expects. The
    kernel wakes the reader at once and orders the writes to shared memory before the ring:
    47 us against 1.1 ms for a one-element gloo all-reduce on 4 ranks of the 2-core reference
    machine (benchmarks/shm_sync.py), and a ring all-reduce synchronises after every step.
    A barrier may be among a subset of the ranks (a schedule's neighbours): counts are kept per
    pair, so every pair must meet equally often on both sides, which symmetric subsets ensure.
    """

    def __init__(self, rank: int, inbox: int, outboxes: list[int], pids: list[int], names: list[int]) -> None:
        self.rank, self.inbox, self.pids, self.names = rank, inbox, pids, names
        self.token = struct.pack("<I", rank)
        self.peers = tuple(q for q in range(len(pids)) if q != rank)
        self.outboxes = dict(zip(self.peers, outboxes, strict=True))
        self.rung = [0] * len(pids)  # tokens received from each peer
        self.expected = [0] * len(pids)  # barriers met with each peer
        self.epoch = 0  # barriers this rank has entered, with any peers

    def sync(
        self, timeout: timedelta, peers: tuple[int, ...] | None = None, wait: tuple[int, ...] | None = None
    ) -> None:
        """Ring `peers` (every peer by default), then wait for `wait` (the same peers by default);
        a peer whose process is gone fails the wait within LIVENESS_S, one that is alive but never
        comes after `timeout`."""
        peers = self.peers if peers is None else peers
        wait = peers if wait is None else wait
        self.epoch += 1
        for q in peers:
            try:
                os.write(self.outboxes[q], self.token)
            except BrokenPipeError:  # nobody reads q's pipe any more: q has exited
                raise RuntimeError(self._gone([q])) from None
        for q in wait:
            self.expected[q] += 1
        deadline = time.monotonic() + timeout.total_seconds()
        while late := [q for q in wait if self.rung[q] < self.expected[q]]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"Timed out waiting for rank(s) {[self.names[q] for q in late]} of the group"
                )
            if _sleep_until_readable(self.inbox, min(left, LIVENESS_S)):
                for (q,) in struct.iter_unpack("<I", os.read(self.inbox, 1 << 16)):
                    self.rung[q] += 1
            elif dead := [q for q in late if not alive(self.pids[q])]:
                raise RuntimeError(self._gone(dead))

    def _gone(self, dead: list[int]) -> str:
        """Name the late peers that exited, and any other rank gone too: inside a call a rank waits
        only for its neighbours, which may have given up because a rank further away died. (A rank
        that is not waited for may also have exited after finishing, so only a late one fails.)"""
        also = [q for q in self.peers if q not in dead and not alive(self.pids[q])]
        named = ", ".join(f"rank {self.names[q]} (pid {self.pids[q]})" for q in dead)
        text = f"{named} exited while this rank waited for it"
        if also:
            text += (
                "; "
                + ", ".join(f"rank {self.names[q]} (pid {self.pids[q]})" for q in also)
                + " had exited too"
            )
        return text


def _sleep_until_readable(fd: int, timeout_s: float) -> bool:
    """Wait for `fd` to be readable, as a batch thread: when a peer's ring wakes this thread it
    queues for the core instead of preempting the thread that rang (which has its own next
    signal or step to do). Where ranks outnumber cores, waking up preemptively made the ranks
    take the core from each other at every signal: 4 ranks on 2 cores, exposed communication
    6.2 -> 5.0 ms of a 39 ms step (docs/benchmarks.md). The thread's policy is restored on
    waking, and left alone unless it is the default one (SCHED_OTHER)."""
    batch = _SCHED_BATCH >= 0 and os.sched_getscheduler(0) == os.SCHED_OTHER
    if batch:
        try:
            os.sched_setscheduler(0, _SCHED_BATCH, os.sched_param(0))
        except OSError:  # not allowed here (a sandbox): wait as any thread
            batch = False
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        if batch:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


_SCHED_BATCH: int = getattr(os, "SCHED_BATCH", -1)  # Linux only
LIVENESS_S = 0.2  # how often a waiting rank checks that the peers it waits for still run


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _doorbells(pg: dist.ProcessGroup, timeout: timedelta) -> _Doorbells:
    """Every rank makes its pipe and opens it (read and write, so it never blocks nor sees an
    end), then opens every peer's for writing; each pipe is unlinked once all have opened it."""
    path = SHM_DIR / f"ringtree-{os.getpid()}-{uuid.uuid4().hex[:12]}.fifo"
    os.mkfifo(path, 0o600)
    try:
        inbox = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        entries = _exchange(pg, "opening the shared-memory doorbells", [str(path), os.getpid()], timeout)
        rank = dist.get_rank(pg)
        outboxes = [os.open(p, os.O_WRONLY | os.O_NONBLOCK) for i, (p, _) in enumerate(entries) if i != rank]
        _exchange(pg, "opening the shared-memory doorbells", None, timeout)
        names = [_global_rank(pg, q) for q in range(len(entries))]
        return _Doorbells(rank, inbox, outboxes, [pid for _, pid in entries], names)
    finally:
        path.unlink(missing_ok=True)


class _Views(NamedTuple):
    """One call's slices of the shared buffers, in the order the plan uses them: where this rank's
    values are copied in (and out), and per step what it reads from peers and its own range."""

    copy_in: list[torch.Tensor]
    reads: list[list[torch.Tensor]]
    own: list[list[torch.Tensor]]
    copy_out: list[torch.Tensor]


def _slice(shared: list[torch.Tensor], rank: int, plan: _Plan) -> _Views:
    own = shared[rank]
    return _Views(
        [own[a:b] for a, b in plan.copy_in],
        [[shared[o.peer][o.start : o.stop] for o in ops] for ops in plan.steps],
        [[own[o.start : o.stop] for o in ops] for ops in plan.steps],
        [own[a:b] for a, b in plan.copy_out],
    )


VIEW_CACHE = 256  # sliced plans kept per group (a few per DDP bucket size); cleared when full


class _Group:
    """One process group's shared buffers (one per rank, grown as needed) and its barrier.

    Each rank's buffer has two halves, used by alternate calls: a call's last step needs no
    barrier after it, since the next call writes the other half, and the call after that passes
    the next call's barriers (which every peer reaches only once done with this one) before it
    writes this half again. The slices a plan uses are cut once per (plan, size, dtype, half).
    """

    def __init__(self, pg: dist.ProcessGroup, one_host: bool) -> None:
        self.pg, self.one_host = pg, one_host
        self.lock = threading.Lock()
        self.capacity = 0  # bytes per half
        self.mapped: list[torch.Tensor] = []
        self.bells: _Doorbells | None = None
        self.half = 0  # the half the next call uses (every rank makes the same calls in order)
        self.sliced: dict[tuple[int, int, int, torch.dtype, int], tuple[_Plan, _Views]] = {}
        self.arenas: dict[int, tuple[int, list[torch.Tensor]]] = {}  # own address: (bytes, every rank's)
        self.placed: dict[tuple[int, int, int, torch.dtype], tuple[_Plan, _Placed]] = {}
        self._dead: list[int] = []  # addresses of shared tensors collected since the last purge

    def register(self, own: torch.Tensor, mapped: list[torch.Tensor]) -> None:
        """Remember every rank's mapping of a shared tensor, for as long as `own` lives."""
        base = own.data_ptr()
        with self.lock:
            self._purge()
            self.arenas[base] = (own.numel() * own.element_size(), mapped)
        weakref.finalize(own, self._dead.append, base)

    def _purge(self) -> None:
        """Forget the shared tensors that died (under the lock; the finalizer, which may run on
        any thread, only queues them). Until then the entry keeps the mapping, so its address
        cannot be reused by another tensor."""
        while self._dead:
            self.arenas.pop(self._dead.pop(), None)
            self.placed.clear()

    def arena_of(self, start: int, nbytes: int) -> int | None:
        """The address of the shared buffer that holds [start, start + nbytes), if one does
        (under the lock)."""
        self._purge()
        return next(
            (b for b, (size, _) in self.arenas.items() if b <= start and start + nbytes <= b + size), None
        )

    def in_place(self, plan: _Plan, buf: torch.Tensor) -> _Placed | None:
        """The slices of an in-place call on `buf`, or None when `buf` is not in shared memory
        (under the lock)."""
        start, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
        base = self.arena_of(start, nbytes)
        if base is None:
            return None
        mapped = self.arenas[base][1]
        key = (id(plan), start, nbytes, buf.dtype)
        have = self.placed.get(key)
        if have is None or have[0] is not plan:
            if len(self.placed) >= VIEW_CACHE:
                self.placed.clear()
            at = start - base
            # slices of the mappings, not of `buf`: a view keeps its base tensor alive, and the
            # caller's tensor must be free to die (its finalizer forgets the mapping)
            peers = [m[at : at + nbytes].view(buf.dtype) for m in mapped]
            mine = peers[dist.get_rank(self.pg)]
            reads = [[peers[q][a:b] for q, a, b, _ in ops] for ops in plan.in_place]
            own = [[mine[a:b] for _, a, b, _ in ops] for ops in plan.in_place]
            have = self.placed[key] = (plan, _Placed(reads, own))
        return have[1]

    def views(self, plan: _Plan, rank: int, nbytes: int, dtype: torch.dtype, timeout: timedelta) -> _Views:
        """The call's slices of every rank's buffer (collective when the buffers grow)."""
        half = self.next_half(nbytes, timeout)
        key = (id(plan), rank, nbytes, dtype, half)
        have = self.sliced.get(key)
        if have is None or have[0] is not plan:
            if len(self.sliced) >= VIEW_CACHE:
                self.sliced.clear()
            start = half * self.capacity
            shared = [v[start : start + nbytes].view(dtype) for v in self.mapped]
            have = self.sliced[key] = (plan, _slice(shared, rank, plan))
        return have[1]

    def next_half(self, nbytes: int, timeout: timedelta) -> int:
        """The half of every rank's buffer this call uses (collective when the buffers grow to
        `nbytes`); the next call gets the other one."""
        if nbytes > self.capacity:
            size = 1 << max(nbytes - 1, 1).bit_length()
            self.mapped = _map_all(self.pg, 2 * size, timeout)
            self.capacity = size
            self.sliced.clear()
        half, self.half = self.half, 1 - self.half
        return half

    def regions(self, nbytes: int, timeout: timedelta) -> list[torch.Tensor]:
        """Every rank's `nbytes` (uint8) of this call's half: for collectives with their own layout."""
        start = self.next_half(nbytes, timeout) * self.capacity
        return [v[start : start + nbytes] for v in self.mapped]

    def sync(
        self,
        timeout: timedelta,
        what: str,
        t: int,
        n: int,
        peers: tuple[int, ...] | None = None,
        wait: tuple[int, ...] | None = None,
    ) -> None:
        """A barrier with `peers` (group ranks; every rank of the group by default), or, with
        `wait`, a signal to `peers` and a wait for `wait`."""
        if self.bells is None:
            self.bells = _doorbells(self.pg, timeout)
        try:
            if wait is None:
                self.bells.sync(timeout, peers)
            else:
                self.bells.sync(timeout, peers, wait)
        except RuntimeError as e:
            raise CollectiveError(_failed(f"{what} at step {t}/{n}", e, timeout)) from e


# By id: process groups cannot be weakly referenced; each entry holds its group, so the id
# stays its own while the entry lives.
_groups: dict[int, _Group] = {}
_groups_lock = threading.Lock()


def group_state(pg: dist.ProcessGroup, timeout: timedelta) -> _Group:
    """The group's shared buffers and doorbells, for transports of collectives with their own
    layout (all-to-all); usable() must have said yes."""
    return _group(pg, timeout)


def _group(pg: dist.ProcessGroup, timeout: timedelta) -> _Group:
    """The group's shared-memory state; the first call gathers every rank's host (collective)."""
    with _groups_lock:
        have = _groups.get(id(pg))
        if have is None or have.pg is not pg:
            hosts = [str(h) for h in _exchange(pg, "setting up shared memory", host_key(), timeout)]
            have = _groups[id(pg)] = _Group(pg, len(set(hosts)) == 1 and hosts[0] != "None")
        return have


def host_key() -> list[object] | None:
    """What makes two processes able to share /dev/shm and count as one node: the hostname,
    the network namespace (each emulated node has its own) and the /dev/shm filesystem."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
        return [socket.gethostname(), netns, SHM_DIR.stat().st_dev]
    except OSError:
        return None


@overload
def _map_all(pg: dist.ProcessGroup, size: int, timeout: timedelta) -> list[torch.Tensor]: ...
@overload
def _map_all(
    pg: dist.ProcessGroup, size: int, timeout: timedelta, required: bool
) -> list[torch.Tensor] | None: ...
def _map_all(
    pg: dist.ProcessGroup, size: int, timeout: timedelta, required: bool = True
) -> list[torch.Tensor] | None:
    """Create this rank's buffer of `size` bytes, map every rank's, then unlink this rank's file.

    Space is reserved up front (posix_fallocate), so a full /dev/shm is an error here and not a
    SIGBUS later; if any rank fails, every rank gets the same error (or, when not `required`,
    every rank gets None).
    """
    path = SHM_DIR / f"ringtree-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    error = ""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    except OSError as e:
        error = f"rank {dist.get_rank()} could not reserve {size} bytes in {SHM_DIR}: {e}"
    try:
        entries = _exchange(pg, "mapping the shared buffers", [str(path), error], timeout)
        errors = [e for _, e in entries if e]
        if errors and not required:
            return None
        if errors:
            raise CollectiveError(f"{errors[0]}; free space there or set {TRANSPORT_ENV}=p2p")
        views = [torch.from_file(p, shared=True, size=size, dtype=torch.uint8) for p, _ in entries]
        _exchange(pg, "mapping the shared buffers", None, timeout)
        return views
    finally:
        path.unlink(missing_ok=True)


def _global_rank(pg: dist.ProcessGroup, q: int) -> int:
    try:
        return dist.get_global_rank(pg, q)
    except (ValueError, RuntimeError):
        return q


_rounds: dict[str, int] = {}


def _exchange(pg: dist.ProcessGroup, doing: str, mine: Any, timeout: timedelta) -> list[Any]:
    """Every rank of the group posts `mine` (JSON) and gets everyone's, in group rank order.

    Setting up goes through the default group's store (torch's TCPStore or FileStore, as the
    flight recorder does) rather than a gloo collective, so that it keeps the call's timeout
    and names a rank that never comes, as the steps do.
    """
    store = default_store()
    assert store is not None  # usable() said so
    name = f"{pg.group_name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    n = _rounds[name] = _rounds.get(name, 0) + 1
    keys = [f"ringtree-shm/{name}/{n}/{q}" for q in range(dist.get_world_size(pg))]
    store.set(keys[dist.get_rank(pg)], json.dumps(mine))
    try:
        store.wait(keys, timeout)
    except RuntimeError as e:
        late = [_global_rank(pg, q) for q, key in enumerate(keys) if not store.check([key])]
        raise CollectiveError(
            _failed(doing, RuntimeError(f"Timed out waiting for rank(s) {late}"), timeout)
        ) from e
    return [json.loads(store.get(key)) for key in keys]


def _failed(doing: str, e: RuntimeError, timeout: timedelta) -> str:
    return (
        f"{doing} on rank {dist.get_rank()} over shared memory failed or timed out "
        f"(timeout {timeout.total_seconds():g}s): "
        f"{str(e).splitlines()[0][:300]}. A peer probably died or stopped calling this collective; "
        "check the other ranks' logs."
    )
