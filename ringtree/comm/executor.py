"""Runs one rank's part of a schedule over torch.distributed point-to-point operations."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from ringtree.comm import shm
from ringtree.comm.errors import CollectiveError
from ringtree.comm.plan import COPY, DIRECT, REDUCE, Plan, compile_plan
from ringtree.comm.reduce_ops import Combine
from ringtree.schedules import Op, OpKind, Schedule, Step

# Pipelined execution cuts every op into messages of at most this many bytes, so that a piece's
# reduction overlaps the next piece's transfer. Every gloo message costs a "ready to receive"
# notice and a few thread wake-ups: measured on a loaded 2-core machine, 512 KiB pieces spent
# more CPU and wall time than whole blocks at 64 MiB, 4 MiB about the same CPU as none.
PIECE_BYTES = 4 << 20
PIPELINED = True  # False: every backend runs the batched path (to measure what pipelining buys)


def execute(
    buf: torch.Tensor,
    schedule: Schedule,
    rank: int,
    combine: Combine,
    *,
    peers: list[int],
    group: dist.ProcessGroup | None,
    timeout: timedelta,
    what: str,
) -> None:
    """Run group rank `rank`'s steps of `schedule` on the flat contiguous tensor `buf` in place.

    `peers[i]` is the global rank of group rank i. When every rank of the group is on this
    host the steps run over shared memory (`ringtree.comm.shm`). Otherwise, on gloo with CPU
    tensors the steps run pipelined (see `ringtree.comm.plan`); elsewhere (NCCL, whose
    point-to-point calls must be batched to avoid deadlock) each step posts all its sends and
    receives at once, waits for them, then applies the reductions. Either way every rank
    reduces in the same order and results agree bitwise.
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if shm.usable(buf.device, pg, timeout):
        shm.execute(buf, schedule, rank, combine, pg=pg, timeout=timeout, what=what)
    elif PIPELINED and buf.device.type == "cpu" and dist.get_backend(pg) == "gloo":
        _pipelined(buf, schedule, rank, combine, pg, peers, timeout, what)
    else:
        _batched(buf, schedule, rank, combine, peers, group, timeout, what)


def _pipelined(
    buf: torch.Tensor,
    schedule: Schedule,
    rank: int,
    combine: Combine,
    pg: dist.ProcessGroup,
    peers: list[int],
    timeout: timedelta,
    what: str,
) -> None:
    plan = _plan(schedule, rank, max(1, PIECE_BYTES // buf.element_size()))
    scratch = _scratch(plan.scratch_count, buf.dtype, buf.device)
    steps, n = plan.steps, len(plan.steps)
    recv_works: list[list[dist.Work] | None] = [None] * n
    send_works: list[dict[int, dist.Work]] = [{} for _ in range(n)]  # by send piece index

    def post_recvs(t: int) -> None:
        if t < n and recv_works[t] is None:
            works = []
            for r in steps[t].recvs:
                into = (
                    buf[r.start : r.stop]
                    if r.mode == DIRECT
                    else scratch[r.scratch : r.scratch + r.stop - r.start]
                )
                try:
                    works.append(pg.recv([into], r.peer, r.tag))
                except RuntimeError as e:  # gloo raises at once when the peer's connection is gone
                    raise _failure(e, r.peer, False, t, n, peers, timeout, what) from e
            recv_works[t] = works

    def post_sends(t: int, after: int) -> None:
        if t < n:
            for k, s in enumerate(steps[t].sends):
                if s.after == after:
                    try:
                        send_works[t][k] = pg.send([buf[s.start : s.stop]], s.peer, s.tag)
                    except RuntimeError as e:
                        raise _failure(e, s.peer, True, t, n, peers, timeout, what) from e

    for t in range(min(n, 2)):
        if t == 0 or steps[t].early:
            post_recvs(t)
    post_sends(0, -1)
    for t in range(n):
        post_recvs(t)
        post_sends(t + 1, -1)
        step, works = steps[t], recv_works[t]
        assert works is not None
        for j, (r, work) in enumerate(zip(step.recvs, works, strict=True)):
            _wait_one(work, r.peer, False, t, n, peers, timeout, what)
            for k in r.guard:
                _wait_one(send_works[t][k], step.sends[k].peer, True, t, n, peers, timeout, what)
            if r.mode != DIRECT:
                incoming = scratch[r.scratch : r.scratch + r.stop - r.start]
                if r.mode == REDUCE:
                    combine(buf[r.start : r.stop], incoming)
                else:
                    assert r.mode == COPY
                    buf[r.start : r.stop].copy_(incoming)
            post_sends(t + 1, j)
        for k, work in send_works[t].items():
            _wait_one(work, step.sends[k].peer, True, t, n, peers, timeout, what)
        if t + 2 < n and steps[t + 2].early:
            post_recvs(t + 2)


_plans: dict[tuple[int, int, int], tuple[Schedule, Plan]] = {}


def _plan(schedule: Schedule, rank: int, piece: int) -> Plan:
    """The compiled plan, kept per schedule object (schedules are cached, so training hits this)."""
    key = (id(schedule), rank, piece)
    have = _plans.get(key)
    if have is None or have[0] is not schedule:
        if len(_plans) > 256:
            _plans.clear()
        have = _plans[key] = (schedule, compile_plan(schedule, rank, piece))
    return have[1]


def _batched(
    buf: torch.Tensor,
    schedule: Schedule,
    rank: int,
    combine: Combine,
    peers: list[int],
    group: dist.ProcessGroup | None,
    timeout: timedelta,
    what: str,
) -> None:
    steps = schedule.for_rank(rank)
    scratch = _scratch(schedule.scratch_count(rank), buf.dtype, buf.device)
    for t, step in enumerate(steps):
        if not step:
            continue
        p2p, reductions, offset = [], [], 0
        for op in step:
            view = buf[op.start : op.stop]
            if op.kind is OpKind.SEND:
                p2p.append(dist.P2POp(dist.isend, view, peers[op.peer], group))
                continue
            if op.kind is OpKind.RECV_REDUCE:
                incoming = scratch[offset : offset + op.numel]
                offset += op.numel
                reductions.append((view, incoming))
                view = incoming
            p2p.append(dist.P2POp(dist.irecv, view, peers[op.peer], group))
        try:
            works = dist.batch_isend_irecv(p2p)
        except RuntimeError as e:  # posting failed: the peer's connection is already gone
            raise CollectiveError(describe_failure(e, None, None, t, len(steps), timeout, what)) from e
        wait_step(works, step, t, len(steps), peers, timeout, what)
        for acc, incoming in reductions:
            combine(acc, incoming)


_cache = threading.local()


def _scratch(count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A receive buffer of `count` elements, kept between calls (per thread, dtype and device).

    A fresh large tensor costs a page fault per 4 KiB page on first touch; reusing one keeps
    that out of every call, as gloo and NCCL keep their own buffers.
    """
    buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = _cache.__dict__.setdefault("buffers", {})
    have = buffers.get((dtype, device))
    if have is None or have.numel() < count:
        have = buffers[(dtype, device)] = torch.empty(count, dtype=dtype, device=device)
    return have[:count]


def _wait_one(
    work: dist.Work, peer: int, sending: bool, t: int, n: int, peers: list[int], timeout: timedelta, what: str
) -> None:
    try:
        work.wait(timeout)
    except RuntimeError as e:
        raise _failure(e, peer, sending, t, n, peers, timeout, what) from e


def _failure(
    e: RuntimeError, peer: int, sending: bool, t: int, n: int, peers: list[int], timeout: timedelta, what: str
) -> CollectiveError:
    """The error of a send to or receive from group rank `peer` that failed, posted or waited on."""
    op = Op(OpKind.SEND if sending else OpKind.RECV, peer, 0, 0)
    return CollectiveError(describe_failure(e, op, peers[peer], t, n, timeout, what), peer=peers[peer])


def wait_step(
    works: list[dist.Work],
    step: Step,
    t: int,
    n: int,
    peers: list[int],
    timeout: timedelta,
    what: str,
) -> None:
    """Wait for one step's posted works; a failure names the peer of the op that failed.

    batch_isend_irecv returns one work per op, in order (gloo); NCCL may return a single one."""
    ops: list[Op | None] = list(step) if len(works) == len(step) else [None] * len(works)
    for work, op in zip(works, ops, strict=True):
        try:
            work.wait(timeout)
        except RuntimeError as e:
            peer = None if op is None else peers[op.peer]
            raise CollectiveError(describe_failure(e, op, peer, t, n, timeout, what), peer=peer) from e


def describe_failure(
    e: RuntimeError, op: Op | None, peer: int | None, t: int, n: int, timeout: timedelta, what: str
) -> str:
    rank = dist.get_rank()
    doing = ""
    if op is not None:
        doing = f" {'sending to' if op.kind is OpKind.SEND else 'receiving from'} rank {peer}"
    cause = "timed out" if "Timed out" in str(e) else "failed"
    return (
        f"{what} on rank {rank}{doing} {cause} at step {t + 1}/{n} "
        f"(timeout {timeout.total_seconds():g}s): {str(e).splitlines()[0][:300]}. "
        "A peer probably died or stopped calling this collective; check the other ranks' logs."
    )
