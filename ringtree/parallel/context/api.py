"""ContextParallel: a model's sequences split over a group of ranks, its attention made whole again.

A model opts in by computing its attention through an `SDPA` module (torch's scaled dot-product
attention over the tokens it holds, positions 0..t-1) instead of calling the function directly:

```python
class Attention(nn.Module):
    def __init__(self):
        ...
        self.core = SDPA()

    def forward(self, x):
        ...                                            # q [b, h, t, e], k, v [b, g, t, e]
        pos = self.core.positions(t, x.device)         # rotate q and k by these positions
        return self.core(q, k, v, is_causal=True)
```

`ContextParallel(group).apply(model)` then replaces every SDPA by one over the whole sequence
(ring, all-gather or Ulysses), shards the model's input along the sequence (dimension 1) on the
way in, and in eval mode gathers its output back. Labels are sharded with `shard`, the same
layout; `positions` are the sharded arange, so rotary embeddings follow the tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ringtree.comm.p2p import Ring
from ringtree.parallel.context.gathered import gathered_attention, ulysses_attention
from ringtree.parallel.context.layout import Layout
from ringtree.parallel.context.ring import ring_attention
from ringtree.parallel.tensor.sequence import gather_sequence
from ringtree.schedules.ring_attention import COMMS


class SDPA(nn.Module):
    """Scaled dot-product attention over the tokens this rank holds: the seat ContextParallel fills."""

    def positions(self, t: int, device: torch.device | None = None) -> torch.Tensor:
        """The positions of the t tokens held: 0..t-1 (the whole sequence)."""
        return torch.arange(t, device=device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
    ) -> torch.Tensor:
        """q [b, h, t, e], k and v [b, g, t, e] (g divides h) -> [b, h, t, e]."""
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1]
        )


class ContextParallel:
    """Context parallelism over `group` (None: the world).

    comm: p2p (ring attention, K/V shifted rank to rank during attention), all-gather (one gather
    of K/V before it) or all-to-all (Ulysses: heads exchanged for tokens). load_balance: head-tail
    chunks (rank r holds chunks r and 2p-1-r of 2p), which balance causal attention; else rank r
    holds chunk r of p. algorithm: the all-gather's (any of ringtree.comm.algorithms("all_gather")).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        comm: str = "p2p",
        *,
        load_balance: bool = True,
        algorithm: str = "ring",
        timeout_s: float = 60.0,
    ) -> None:
        if comm not in COMMS:
            raise ValueError(f"unknown context-parallel comm {comm!r}; choose one of {', '.join(COMMS)}")
        self.group, self.comm, self.algorithm, self.timeout_s = group, comm, algorithm, timeout_s
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.layout = Layout(self.rank, self.size, load_balance)
        self.ring = Ring(group) if comm == "p2p" else None

    @property
    def load_balance(self) -> bool:
        return self.layout.balanced

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of x along `dim` (inputs, labels, positions: one layout)."""
        return self.layout.shard(x, dim)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's tokens of x [b, t/p, ...], in sequence order: [b, t, ...] (backward keeps own)."""
        return self.layout.unpermute(gather_sequence(x, self.group, self.algorithm))

    def positions(self, t_local: int, device: torch.device | None = None) -> torch.Tensor:
        """The positions in the whole sequence of the t_local tokens this rank holds."""
        return self.layout.positions(t_local, device)

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
    ) -> torch.Tensor:
        """This rank's queries [b, h, t/p, e] attending to the whole sequence (k, v [b, g, t/p, e])."""
        if self.size == 1:
            return SDPA().forward(q, k, v, is_causal)
        if self.ring is not None:
            return ring_attention(
                q, k, v, self.ring, causal=is_causal, balanced=self.load_balance, timeout_s=self.timeout_s
            )
        if self.comm == "all-gather":
            return gathered_attention(
                q, k, v, self.layout, self.group, causal=is_causal, algorithm=self.algorithm
            )
        return ulysses_attention(q, k, v, self.layout, self.group, causal=is_causal)

    def apply(self, model: nn.Module, first: nn.Module | None = None, last: nn.Module | None = None) -> int:
        """Make `model` context parallel in place; return the attention modules replaced.

        first: the module whose input (token ids or vectors, sequence in dimension 1) is sharded
        (default: the model); last: the module whose output is gathered back in eval mode (default:
        the model). Under a pipeline they are the first and last layers.
        """
        replaced = 0
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if type(child) is SDPA:
                    setattr(module, name, ContextAttention(self))
                    replaced += 1
        (first or model).register_forward_pre_hook(self._shard_input)
        (last or model).register_forward_hook(self._gather_output)
        return replaced

    def _shard_input(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (self.shard(args[0]), *args[1:])

    def _gather_output(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return out if module.training else self.gather(out)


class ContextAttention(SDPA):
    """SDPA over the whole sequence, of which this rank holds a shard (see ContextParallel)."""

    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self.cp = cp

    def positions(self, t: int, device: torch.device | None = None) -> torch.Tensor:
        return self.cp.positions(t, device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
    ) -> torch.Tensor:
        return self.cp.attention(q, k, v, is_causal)


def has_attention(model: nn.Module) -> bool:
    """Whether `model` computes attention through SDPA modules (what ContextParallel can split)."""
    return any(isinstance(m, SDPA) for m in model.modules())
