"""The all-to-all that moves tokens to their experts and back: one seam, with autograd and a clock.

`exchange(input, output_splits, input_splits, algorithm, group)` sends rows `input_splits[j]` of
`input` to rank j and returns the rows every rank sent here (`output_splits[i]` from rank i). Its
backward is the same exchange with the splits swapped (what was sent comes back). `algorithm`
picks the schedule: `native` is torch.distributed's all_to_all_single (called directly); ringtree's
own (pairwise, bruck, linear, hierarchical, and auto, which picks one by its cost) run through
`ringtree.comm.all_to_all_single`. Every call is timed into CLOCK: the trainer reads the seconds
spent and the calls made per step (`a2a_time_s`; the tests count the exchanges), the benchmark
also the calling thread's CPU time in them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ringtree import comm

A2A_ALGORITHMS = ("auto", "pairwise", "bruck", "linear", "hierarchical", "native")


@dataclass
class Clock:
    """Seconds spent in all-to-alls and their number, since the process started (read differences)."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0  # the calling thread's CPU time inside them (copies, signalling)
    calls: int = 0
    rows: int = 0  # rows sent (token copies; counts exchanges excluded)


CLOCK = Clock()


def available() -> tuple[str, ...]:
    """The algorithms `algorithm` may name."""
    return A2A_ALGORITHMS


Matrix = list[list[int]]  # [i][j]: rows rank i sends rank j (every rank's splits)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int] | None,
    input_splits: list[int] | None,
    algorithm: str,
    group: dist.ProcessGroup | None,
    matrix: Matrix | None = None,
) -> None:
    """One exchange into `output`, timed: ringtree's schedule, or torch's (`native`).

    matrix: every rank's splits, when the caller knows them (the dispatch does, from the counts
    exchange): ringtree's schedules then skip their own exchange of the sizes.
    """
    start, cpu = time.perf_counter(), time.thread_time()
    if algorithm == "native":
        dist.all_to_all_single(output, input, output_splits, input_splits, group=group)
    else:  # the splits agree by construction (the counts exchange): no validating all-gather
        comm.all_to_all_single(
            output, input, output_splits, input_splits, algorithm, group, validate=False, split_matrix=matrix
        )
    CLOCK.seconds += time.perf_counter() - start
    CLOCK.cpu_seconds += time.thread_time() - cpu
    CLOCK.calls += 1


def exchange_counts(counts: torch.Tensor, algorithm: str, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's [E] counts, as a [ranks, E] table on every rank: an equal-split all-to-all of
    this rank's row sent to every rank (an all-gather: the split matrix every schedule needs)."""
    ranks = dist.get_world_size(group)
    out = counts.new_empty((ranks, counts.numel()))
    all_to_all_single(out, counts.reshape(1, -1).expand(ranks, -1).contiguous(), None, None, algorithm, group)
    return out


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
