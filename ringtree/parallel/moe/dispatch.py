"""Token dispatch: routed token copies to their experts' rows and back, locally or over EP ranks.

Locally the T x k copies are sorted by expert (a stable argsort: token order within an expert).
With expert parallelism over P ranks (rank r holds experts r E/P .. (r+1) E/P - 1, so the sorted
rows are also rank-major), a step of one MoE layer (torchtitan's AllToAllTokenDispatcher):

1. counts: each rank's copies per expert [E] go to every rank by an equal-split all-to-all (its
   row sent to each rank: an all-gather), so every rank knows the whole P x P split matrix
   (ringtree's Bruck and hierarchical schedules forward other ranks' blocks, so they need all of
   it; knowing it, no all-to-all below exchanges sizes again) and how many rows each source
   sends to each of its own experts;
2. dispatch: the rows go through a variable-split all-to-all (rows per rank: the table's sums);
3. the received rows (source-rank major) are permuted to expert-major order for the experts;
4. combine: unpermuted, they return by the reverse all-to-all (the splits swapped).

The gate weights never travel: the sender multiplies the returning rows by them and adds the k
copies of each token. In backward each data all-to-all runs once more with its splits swapped:
four data all-to-alls and one counts exchange per layer and micro-batch.

Work beside the exchanges (`Beside`: the layer's shared experts, which need none of the routed
rows) runs in two halves, one while the dispatch travels and one while the combine does
(Megatron-Core's shared-expert overlap); with `overlap=False`, or without expert parallelism,
each half runs after its exchange, in the same order, so the results are the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from ringtree.parallel.moe.alltoall import Matrix, exchange, exchange_beside, exchange_counts, transpose

Experts = Callable[[torch.Tensor, list[int]], torch.Tensor]  # (expert-major rows, counts) -> rows


class Beside(Protocol):
    """Work independent of the routed rows, in two halves the dispatcher runs in order."""

    def during_dispatch(self) -> None: ...

    def during_combine(self) -> None: ...


def sort_by_expert(
    experts: torch.Tensor, keep: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of each kept copy into the flattened [T k] choices, in expert order; copies per expert)."""
    flat = experts.flatten()
    kept = keep.flatten().nonzero().squeeze(1)
    order = kept[flat[kept].argsort(stable=True)]
    return order, torch.bincount(flat[order], minlength=num_experts)


def expert_major(counts: torch.Tensor) -> torch.Tensor:
    """The permutation of received rows to expert-major order.

    counts [P, L]: rows from source rank s for local expert j, received source-major ((s0: e0, e1,
    ...), (s1: e0, ...)). Returns idx with rows[idx] ordered (e0: s0, s1, ...), (e1: ...).
    """
    flat = counts.flatten()
    starts = flat.cumsum(0) - flat  # where block (s, j) starts in the received rows
    blocks = torch.arange(flat.numel()).view(counts.shape).t().flatten()  # (j, s) order
    lengths, first = flat[blocks], starts[blocks]
    total = int(lengths.sum())
    before = lengths.cumsum(0) - lengths  # where each block starts in expert-major order
    return torch.repeat_interleave(first - before, lengths, output_size=total) + torch.arange(total)


def inverse(permutation: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(permutation)
    out[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return out


class LocalDispatcher:
    """No expert parallelism: the sorted rows are already expert-major."""

    ranks = 1

    def __call__(
        self, rows: torch.Tensor, counts: torch.Tensor, experts: Experts, beside: Beside | None = None
    ) -> torch.Tensor:
        if beside is not None:
            beside.during_dispatch()
        out = experts(rows, counts.tolist())
        if beside is not None:
            beside.during_combine()
        return out


class AllToAllDispatcher:
    """Expert parallelism over `group`: counts exchange, dispatch, permute, experts, combine.

    overlap: run the `beside` work while the dispatch and the combine travel (a background thread,
    or torch's asynchronous work for `native`); False: each exchange blocks, then its half runs.
    """

    def __init__(
        self, group: dist.ProcessGroup | None, algorithm: str = "auto", overlap: bool = True
    ) -> None:
        self.group, self.algorithm, self.overlap = group, algorithm, overlap
        self.ranks = dist.get_world_size(group)

    def __call__(
        self, rows: torch.Tensor, counts: torch.Tensor, experts: Experts, beside: Beside | None = None
    ) -> torch.Tensor:
        """rows [N, d] sorted by (global) expert, counts [E] -> the experts' outputs in the same order."""
        p, me = self.ranks, dist.get_rank(self.group)
        every = exchange_counts(counts, self.algorithm, self.group).cpu()  # [P, E]; the one host sync
        per_rank = every.view(p, p, -1)  # [source, destination rank, its local expert]
        matrix = per_rank.sum(2).tolist()  # rows source i sends destination j
        received = per_rank[:, me]  # [source, my local expert]
        arrived = self._exchange(rows, matrix, beside.during_dispatch if beside else None)  # by source
        order = expert_major(received).to(rows.device)
        out = experts(arrived[order], received.sum(0).tolist())
        back = out[inverse(order)]  # source-rank major again
        return self._exchange(back, transpose(matrix), beside.during_combine if beside else None)

    def _exchange(self, rows: torch.Tensor, matrix: Matrix, work: Callable[[], None] | None) -> torch.Tensor:
        if work is None:
            return exchange(rows, matrix, self.algorithm, self.group)
        return exchange_beside(rows, matrix, self.algorithm, self.group, work, self.overlap)
