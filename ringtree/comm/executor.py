"""Runs one rank's part of a schedule over torch.distributed point-to-point operations."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from ringtree.comm.errors import CollectiveError
from ringtree.comm.reduce_ops import Combine
from ringtree.schedules import Op, OpKind, Schedule, Step


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

    `peers[i]` is the global rank of group rank i. Each step posts all its sends and receives
    at once (batch_isend_irecv), waits for them with `timeout`, then applies the reductions in
    schedule order, so every rank reduces in the same order and results agree bitwise.
    """
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
        _wait(dist.batch_isend_irecv(p2p), step, t, len(steps), peers, timeout, what)
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


def _wait(
    works: list[dist.Work],
    step: Step,
    t: int,
    n: int,
    peers: list[int],
    timeout: timedelta,
    what: str,
) -> None:
    # batch_isend_irecv returns one work per op, in order (gloo); NCCL may return a single one.
    ops: list[Op | None] = list(step) if len(works) == len(step) else [None] * len(works)
    for work, op in zip(works, ops, strict=True):
        try:
            work.wait(timeout)
        except RuntimeError as e:
            peer = None if op is None else peers[op.peer]
            raise CollectiveError(_describe(e, op, peer, t, n, timeout, what), peer=peer) from e


def _describe(
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
