"""The all-to-all that moves tokens to their experts and back: one seam, with autograd and a clock.

`exchange(input, matrix, algorithm, group)` sends rows `matrix[me][j]` of `input` to rank j and
returns the rows every rank sent here (`matrix[i][me]` from rank i). Its backward is the same
exchange with the splits swapped (what was sent comes back). `algorithm` picks the schedule:
`native` is torch.distributed's all_to_all_single (called directly); ringtree's own (pairwise,
bruck, linear, hierarchical, and auto, which picks one by its cost) run through
`ringtree.comm.all_to_all_single`.

`exchange_beside(..., work)` is the same exchange with `work` (independent of it: the shared
experts) computed by the calling thread while the rows travel, Megatron-Core's shared-expert
overlap: `start` hands the exchange to a background thread (ringtree's schedules: their copies
and shared-memory waits release the GIL) or to torch's own asynchronous work (`native`,
async_op=True), `work` runs, and an autograd Function whose forward waits for the handle returns
the rows (its backward: the reverse exchange, on the calling thread, as `exchange`'s). One
exchange of a group is in flight at a time: the dispatcher waits for each before it starts the
next, and `start` refuses a group that still has one.

Every exchange is timed into CLOCK: the trainer reads per step the seconds the exchanges took
(`a2a_time_s`: each from its start to its end) and the seconds the calling thread waited for them
(`a2a_exposed_s`: all of a blocking exchange, only the part of a wait while the rows were still
travelling for a started one); the tests count the exchanges, the benchmark also reads the CPU
time of the threads that ran them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ringtree import comm

A2A_ALGORITHMS = ("auto", "pairwise", "bruck", "linear", "hierarchical", "native")


@dataclass
class Clock:
    """Seconds spent in all-to-alls and their number, since the process started (read differences)."""

    seconds: float = 0.0  # each exchange from its start to its end
    exposed: float = 0.0  # of them, the calling thread's waits while an exchange was still running
    cpu_seconds: float = 0.0  # the CPU time of the thread that ran them (copies, signalling)
    calls: int = 0
    rows: int = 0  # rows sent (token copies; counts exchanges excluded)


CLOCK = Clock()
now = time.perf_counter  # every figure of CLOCK is read off this clock (a test may replace it)


def available() -> tuple[str, ...]:
    """The algorithms `algorithm` may name."""
    return A2A_ALGORITHMS


Matrix = list[list[int]]  # [i][j]: rows rank i sends rank j (every rank's splits)


def _run(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int] | None,
    input_splits: list[int] | None,
    algorithm: str,
    group: dist.ProcessGroup | None,
    matrix: Matrix | None,
) -> None:
    """The exchange itself, untimed: ringtree's schedule, or torch's (`native`)."""
    if algorithm == "native":
        dist.all_to_all_single(output, input, output_splits, input_splits, group=group)
    else:  # the splits agree by construction (the counts exchange): no validating all-gather
        comm.all_to_all_single(
            output, input, output_splits, input_splits, algorithm, group, validate=False, split_matrix=matrix
        )


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int] | None,
    input_splits: list[int] | None,
    algorithm: str,
    group: dist.ProcessGroup | None,
    matrix: Matrix | None = None,
) -> None:
    """One exchange into `output`, timed, the calling thread blocked in it (all of it exposed).

    matrix: every rank's splits, when the caller knows them (the dispatch does, from the counts
    exchange): ringtree's schedules then skip their own exchange of the sizes.
    """
    _claim(group)
    try:
        start, cpu = now(), time.thread_time()
        _run(output, input, output_splits, input_splits, algorithm, group, matrix)
        elapsed = now() - start
    finally:
        _release(group)
    CLOCK.seconds += elapsed
    CLOCK.exposed += elapsed
    CLOCK.cpu_seconds += time.thread_time() - cpu
    CLOCK.calls += 1


def exchange_counts(counts: torch.Tensor, algorithm: str, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's [E] counts, as a [ranks, E] table on every rank: an equal-split all-to-all of
    this rank's row sent to every rank (an all-gather: the split matrix every schedule needs)."""
    ranks = dist.get_world_size(group)
    out = counts.new_empty((ranks, counts.numel()))
    all_to_all_single(out, counts.reshape(1, -1).expand(ranks, -1).contiguous(), None, None, algorithm, group)
    return out


# Groups with an exchange in flight, by id (a process group cannot be weakly referenced).
_busy: set[int] = set()
_worker: ThreadPoolExecutor | None = None


def _claim(group: dist.ProcessGroup | None) -> None:
    """Refuse a second exchange of one group while one runs: the schedules of one group share its
    buffers and its sequence of collectives, so two at once would corrupt both."""
    key = _key(group)
    if key in _busy:
        raise RuntimeError(
            "an all-to-all of this process group is still in flight; wait for it (Pending.wait) "
            "before starting another one on the same group"
        )
    _busy.add(key)


def _release(group: dist.ProcessGroup | None) -> None:
    _busy.discard(_key(group))


def _key(group: dist.ProcessGroup | None) -> int:
    return id(group if group is not None else dist.group.WORLD)  # None: the default group


def _background() -> ThreadPoolExecutor:
    """The one thread that runs started exchanges, in the order they were started."""
    global _worker
    if _worker is None:
        _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringtree-a2a")
    return _worker


def exposed_seconds(waited_from: float, waited_to: float, done: float) -> float:
    """The part of a wait [waited_from, waited_to] in which the exchange, ended at `done`, still
    ran: what the waiting thread lost to it (0 when the work beside it outlasted the exchange)."""
    return max(0.0, min(waited_to, done) - waited_from)


class Pending:
    """An exchange `start` began: `wait()` returns the rows it received, once (a dead or silent
    peer raises there what the blocking exchange raises: the CollectiveError that names it)."""

    def __init__(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        matrix: Matrix,
        algorithm: str,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.output, self.matrix, self.algorithm, self.group = output, matrix, algorithm, group
        self.rows = input.shape[0]
        self.issued = now()
        self.done: float | None = None  # when the exchange ended (stamped by the thread that ran it)
        self.cpu = 0.0
        self.future: Future[None] | None = None
        self.work: dist.Work | None = None
        self.waited = False
        # on CUDA the background thread orders its work on the caller's stream (and device): a
        # thread's current stream and device are its own, and the rows were made on the caller's
        self.stream = torch.cuda.current_stream(output.device) if output.is_cuda else None

    def run(self, input: torch.Tensor, receives: list[int], sends: list[int]) -> None:
        """The exchange, on the background thread."""
        cpu = time.thread_time()
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                _run(self.output, input, receives, sends, self.algorithm, self.group, self.matrix)
        finally:
            self.done = now()
            self.cpu = time.thread_time() - cpu

    def stamp(self, _: Any) -> None:
        """torch's asynchronous work ended (called on the thread that ran it)."""
        self.done = now()

    def wait(self) -> torch.Tensor:
        """Block until the rows arrived; account the exchange and the wait; return the rows."""
        if self.waited:
            return self.output
        self.waited = True
        waited = now()
        try:
            if self.future is not None:
                self.future.result()
            elif self.work is not None:
                self.work.wait()
        finally:
            _release(self.group)
        end = now()
        done = end if self.done is None else min(self.done, end)
        CLOCK.seconds += done - self.issued
        CLOCK.exposed += exposed_seconds(waited, end, done)
        CLOCK.cpu_seconds += self.cpu
        CLOCK.calls += 1
        CLOCK.rows += self.rows
        return self.output


def start(
    input: torch.Tensor,
    matrix: Matrix,
    algorithm: str,
    group: dist.ProcessGroup | None,
    background: bool = True,
) -> Pending:
    """Begin `exchange(input, ...)` and return its handle (no autograd: `arrive` joins it to the
    graph); `input` must not change until the handle was waited for. background=False: the
    exchange runs here, blocking (its handle is done; all of its time is exposed)."""
    me = dist.get_rank(group)
    sends, receives = matrix[me], [row[me] for row in matrix]
    data = input.detach().contiguous()
    out = data.new_empty((sum(receives), *input.shape[1:]))
    if not background:
        all_to_all_single(out, data, receives, sends, algorithm, group, matrix)
        CLOCK.rows += data.shape[0]
        pending = Pending(out, data, matrix, algorithm, group)
        pending.waited = True
        return pending
    _claim(group)
    pending = Pending(out, data, matrix, algorithm, group)
    try:
        if algorithm == "native":
            pending.work = dist.all_to_all_single(out, data, receives, sends, group=group, async_op=True)
            if pending.work is not None:
                pending.work.get_future().add_done_callback(pending.stamp)
        else:
            pending.future = _background().submit(pending.run, data, receives, sends)
    except BaseException:
        _release(group)
        raise
    return pending


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        matrix: Matrix,
        algorithm: str,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.matrix, ctx.algorithm, ctx.group = matrix, algorithm, group
        me = dist.get_rank(group)
        sends, receives = matrix[me], [row[me] for row in matrix]
        out = input.new_empty((sum(receives), *input.shape[1:]))
        all_to_all_single(out, input.contiguous(), receives, sends, algorithm, group, matrix)
        CLOCK.rows += input.shape[0]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back: torch.Tensor = _Exchange.apply(grad, transpose(ctx.matrix), ctx.algorithm, ctx.group)  # type: ignore[no-untyped-call]
        return back, None, None, None


class _Arrive(torch.autograd.Function):
    """Forward: wait for a started exchange of `input`; backward: the reverse exchange, blocking."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, pending: Pending) -> torch.Tensor:
        ctx.matrix, ctx.algorithm, ctx.group = pending.matrix, pending.algorithm, pending.group
        return pending.wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return exchange(grad, transpose(ctx.matrix), ctx.algorithm, ctx.group), None


def transpose(matrix: Matrix) -> Matrix:
    """The reverse exchange's matrix: what i sent j, j now sends i."""
    return [list(column) for column in zip(*matrix, strict=True)]


def exchange(
    input: torch.Tensor, matrix: Matrix, algorithm: str, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The variable-split all-to-all of rows, differentiable: this rank sends matrix[me][j] rows to
    rank j and receives matrix[i][me] from rank i; backward is the exchange of the transpose."""
    out: torch.Tensor = _Exchange.apply(input, matrix, algorithm, group)  # type: ignore[no-untyped-call]
    return out


def arrive(input: torch.Tensor, pending: Pending) -> torch.Tensor:
    """The rows of `pending` (started from `input`), waited for, as `exchange(input, ...)` in autograd."""
    out: torch.Tensor = _Arrive.apply(input, pending)  # type: ignore[no-untyped-call]
    return out


def exchange_beside(
    input: torch.Tensor,
    matrix: Matrix,
    algorithm: str,
    group: dist.ProcessGroup | None,
    work: Callable[[], None],
    overlap: bool = True,
) -> torch.Tensor:
    """`exchange(input, ...)` with `work`, which must not depend on it, run by this thread while the
    rows travel. overlap=False: the exchange first, blocking, then `work`: the same autograd graph
    (so the same bits, in outputs and gradients) without the second thread."""
    pending = start(input, matrix, algorithm, group, background=overlap)
    try:
        work()
    except BaseException:
        with contextlib.suppress(Exception):  # the work's error is the one to report
            pending.wait()  # the exchange still ends before the group's next one may start
        raise
    return arrive(input, pending)
