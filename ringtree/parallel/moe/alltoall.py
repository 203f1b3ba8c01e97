"""The all-to-all that moves tokens to their experts and back: one seam, with autograd and a clock.

`exchange(input, output_splits, input_splits, algorithm, group)` sends rows `input_splits[j]` of
`input` to rank j and returns the rows every rank sent here (`output_splits[i]` from rank i). Its
backward is the same exchange with the splits swapped (what was sent comes back). `algorithm`
picks the schedule: `native` is torch.distributed's all_to_all_single (called directly); ringtree's
own (pairwise, bruck, linear, hierarchical, and auto, which picks one by its cost) run through
`ringtree.comm.all_to_all_single`. Every call is timed into CLOCK: the trainer reads the seconds
spent and the calls made per step (`a2a_time_s`; the tests count the exchanges).
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
    calls: int = 0
    rows: int = 0  # rows sent (token copies; counts exchanges excluded)


CLOCK = Clock()


def available() -> tuple[str, ...]:
    """The algorithms `algorithm` may name."""
    return A2A_ALGORITHMS


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int] | None,
    input_splits: list[int] | None,
    algorithm: str,
    group: dist.ProcessGroup | None,
) -> None:
    """One exchange into `output`, timed: ringtree's schedule, or torch's (`native`)."""
    start = time.perf_counter()
    if algorithm == "native":
        dist.all_to_all_single(output, input, output_splits, input_splits, group=group)
    else:  # the splits agree by construction (the counts exchange): no validating all-gather
        comm.all_to_all_single(output, input, output_splits, input_splits, algorithm, group, validate=False)
    CLOCK.seconds += time.perf_counter() - start
    CLOCK.calls += 1


def exchange_counts(counts: torch.Tensor, algorithm: str, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Equal-split exchange of a [ranks, k] integer table: row j goes to rank j, row i comes from rank i."""
    out = torch.empty_like(counts)
    all_to_all_single(out, counts.contiguous(), None, None, algorithm, group)
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        algorithm: str,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.splits, ctx.algorithm, ctx.group = (output_splits, input_splits), algorithm, group
        out = input.new_empty((sum(output_splits), *input.shape[1:]))
        all_to_all_single(out, input.contiguous(), output_splits, input_splits, algorithm, group)
        CLOCK.rows += input.shape[0]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        all_to_all_single(back, grad.contiguous(), input_splits, output_splits, ctx.algorithm, ctx.group)
        return back, None, None, None, None


def exchange(
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    algorithm: str,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """The variable-split all-to-all of rows, differentiable (backward: the splits swapped)."""
    out: torch.Tensor = _Exchange.apply(  # type: ignore[no-untyped-call]
        input, output_splits, input_splits, algorithm, group
    )
    return out
