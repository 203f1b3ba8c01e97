"""Which tokens of a sequence a context-parallel rank holds, as tensors: shard, gather, positions.

The sequence (dimension `dim`, 1 for [b, t, ...]) is cut into chunks as
ringtree.schedules.ring_attention.chunks says (2p head-tail chunks, or p) and rank r keeps its
chunks, in ascending order. Inputs, labels and positions are all sharded by this one function, so
each token keeps its own position: rotary embeddings rotate it by its place in the whole sequence.
"""

from __future__ import annotations

import torch

from ringtree.schedules.ring_attention import chunks, chunks_per_rank, layout


class Layout:
    """Rank `rank` of `p`'s share of every sequence (head-tail when `balanced`)."""

    def __init__(self, rank: int, p: int, balanced: bool) -> None:
        self.rank, self.p, self.balanced = rank, p, balanced
        self.n = p * chunks_per_rank(balanced)  # chunks in a whole sequence

    def check(self, t: int) -> None:
        if t % self.n:
            raise ValueError(
                f"context parallelism over {self.p} ranks cuts each sequence into {self.n} chunks, but "
                f"the sequence holds {t} tokens; use sequences whose length is a multiple of {self.n}"
            )

    def index(self, t: int, device: torch.device | None = None) -> torch.Tensor:
        """The positions (0..t-1) of this rank's tokens in a sequence of t, in the order it holds them."""
        self.check(t)
        c = t // self.n
        mine = chunks(self.rank, self.p, self.balanced)
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in mine])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of x along `dim`: [b, t, ...] -> [b, t/p, ...] (differentiable)."""
        return x.index_select(dim, self.index(x.shape[dim], x.device))

    def positions(self, t_local: int, device: torch.device | None = None) -> torch.Tensor:
        """The positions of the t_local tokens this rank holds: the sequence's arange, sharded."""
        return self.index(t_local * self.p, device)

    def gathered_positions(self, t_local: int, device: torch.device | None = None) -> torch.Tensor:
        """The positions of every rank's tokens laid end to end, rank 0's first (an all-gather's order)."""
        t = t_local * self.p
        self.check(t)
        c = t // self.n
        return torch.cat(
            [torch.arange(i * c, (i + 1) * c, device=device) for i in layout(self.p, self.balanced)]
        )

    def unpermute(self, gathered: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's tokens laid end to end (an all-gather's order) back in sequence order."""
        order = self.gathered_positions(gathered.shape[dim] // self.p, gathered.device)
        return gathered.index_select(dim, torch.argsort(order))
