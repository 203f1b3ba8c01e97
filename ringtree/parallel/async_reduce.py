"""Asynchronous bucket all-reduces: torch's async work for `native`, a comm thread for the rest.

Both launchers start buckets in the order they are given (every rank gives the same order, which
the ring, tree and server schedules need to pair up), record when each bucket was in flight, and
wait for all of them with a timeout, re-raising a failure on the caller's thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from ringtree import comm
from ringtree.comm import CollectiveError

# What a launcher runs for one bucket instead of a plain all-reduce: (bucket, tensor, validate).
Reduce = Callable[[int, torch.Tensor, bool], None]


@dataclass(frozen=True)
class Span:
    """One bucket's all-reduce: when it started and ended (time.perf_counter seconds) and its bytes."""

    bucket: int
    start: float
    end: float
    nbytes: int


class Launcher:
    """Starts bucket all-reduces (sum, in place) without blocking, then waits for all of them."""

    def __init__(self, algorithm: str, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        self.algorithm, self.group, self.timeout_s = algorithm, group, timeout_s

    def launch(self, bucket: int, tensor: torch.Tensor, validate: bool, defer: bool = False) -> None:
        """Start reducing `tensor`; defer=True: the caller waits next, so it may run on its thread."""
        raise NotImplementedError

    def wait_all(self) -> list[Span]:
        """Block until every launched bucket is reduced; return their spans in launch order."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the launcher's resources (the comm thread)."""


class NativeLauncher(Launcher):
    """torch.distributed.all_reduce(async_op=True): the backend's own threads do the work."""

    def __init__(self, algorithm: str, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        super().__init__(algorithm, group, timeout_s)
        self._pending: list[tuple[_Waitable, int, float, int, list[float]]] = []

    def launch(self, bucket: int, tensor: torch.Tensor, validate: bool, defer: bool = False) -> None:
        start = time.perf_counter()
        if validate:  # the first sync checks sizes across ranks, synchronously
            comm.all_reduce(tensor, "sum", "native", self.group, timeout_s=self.timeout_s)
            self._pending.append((_DoneWork(), bucket, start, _nbytes(tensor), [time.perf_counter()]))
            return
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        assert work is not None
        end: list[float] = []
        work.get_future().add_done_callback(lambda _: end.append(time.perf_counter()))
        self._pending.append((work, bucket, start, _nbytes(tensor), end))

    def wait_all(self) -> list[Span]:
        pending, self._pending = self._pending, []
        spans = []
        for work, bucket, start, nbytes, end in pending:
            try:
                work.wait(timedelta(seconds=self.timeout_s))
            except RuntimeError as e:
                raise CollectiveError(
                    f"DDP bucket {bucket} all-reduce (native, {nbytes} bytes) on rank {dist.get_rank()} "
                    f"failed or timed out after {self.timeout_s:g}s: {str(e).splitlines()[0][:300]}"
                ) from e
            spans.append(Span(bucket, start, end[0] if end else time.perf_counter(), nbytes))
        return spans


class ThreadLauncher(Launcher):
    """ringtree's schedules, run one bucket after another on a dedicated communication thread.

    wait_all() does not hand the tail back and forth: buckets the thread has not started by then
    are taken back and run on the caller's thread, which would only sleep otherwise. On a host
    where ranks outnumber cores, every hand-off costs a wake-up that waits for a core (measured:
    up to 7 ms of a 40 ms step on 4 ranks over 2 cores, counted as exposed communication).
    """

    def __init__(
        self,
        algorithm: str,
        group: dist.ProcessGroup | None,
        timeout_s: float,
        reduce: Reduce | None = None,
    ) -> None:
        super().__init__(algorithm, group, timeout_s)
        self._reduce = reduce
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringtree-ddp-comm")
        self._pending: list[tuple[int, torch.Tensor, bool, Future[Span] | None]] = []

    def launch(self, bucket: int, tensor: torch.Tensor, validate: bool, defer: bool = False) -> None:
        future = None if defer else self._pool.submit(self._run, bucket, tensor, validate)
        self._pending.append((bucket, tensor, validate, future))

    def _run(self, bucket: int, tensor: torch.Tensor, validate: bool) -> Span:
        start = time.perf_counter()
        if self._reduce is not None:
            self._reduce(bucket, tensor, validate)
        else:
            comm.all_reduce(
                tensor, "sum", self.algorithm, self.group, timeout_s=self.timeout_s, validate=validate
            )
        return Span(bucket, start, time.perf_counter(), _nbytes(tensor))

    def wait_all(self) -> list[Span]:
        pending, self._pending = self._pending, []
        on_thread = _take_back_unstarted([f for *_, f in pending])
        # Every bucket ahead of the last may take its own timeout before raising: allow them all.
        deadline = time.monotonic() + self.timeout_s * (len(pending) + 1)
        spans = []
        for (bucket, tensor, validate, future), here in zip(pending, on_thread, strict=True):
            if here:  # same order as every other rank: the comm thread will not touch it
                spans.append(self._run(bucket, tensor, validate))
                continue
            assert future is not None
            try:
                spans.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                raise CollectiveError(
                    f"DDP bucket {bucket} all-reduce ({self.algorithm}) on rank {dist.get_rank()} did not "
                    f"finish in time; a peer probably stopped training"
                ) from None
        return spans

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _take_back_unstarted(futures: list[Future[Span] | None]) -> list[bool]:
    """Cancel the launched buckets the comm thread has not started; which ones the caller runs.

    Cancelling goes from the last back and stops at the first one already started (or done):
    the thread runs buckets in order, so what it gave up is a suffix and it never runs one of
    them beside the caller. A deferred bucket (None) was never handed over.
    """
    here = [False] * len(futures)
    for k in reversed(range(len(futures))):
        future = futures[k]
        if future is not None and not future.cancel():
            break
        here[k] = True
    return here


class _Waitable(Protocol):
    def wait(self, timeout: timedelta) -> bool: ...


class _DoneWork:
    """A stand-in for a Work that already completed (the synchronous first bucket)."""

    def wait(self, timeout: timedelta) -> bool:
        return True


def make_launcher(
    algorithm: str, group: dist.ProcessGroup | None, timeout_s: float, reduce: Reduce | None = None
) -> Launcher:
    """The launcher for `algorithm`: torch's async work for native, a comm thread otherwise, and
    always the comm thread for a `reduce` of several dependent all-reduces (PowerSGD's)."""
    if algorithm not in comm.algorithms("all_reduce"):
        raise ValueError(
            f"unknown all_reduce algorithm {algorithm!r}; choose one of {', '.join(comm.algorithms())}"
        )
    if reduce is not None:
        return ThreadLauncher(algorithm, group, timeout_s, reduce)
    cls = NativeLauncher if algorithm == "native" else ThreadLauncher
    return cls(algorithm, group, timeout_s)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
