"""MoE: a mixture-of-experts layer in place of a transformer block's MLP.

    y = sum over the token's k chosen experts e of  w_e(x) * expert_e(x)   (+ shared(x))

Router (router.py) -> dispatch (dispatch.py: locally, or by all-to-all over expert-parallel
ranks) -> SwiGLU experts (experts.py) -> combine, weighted on the sending rank in fp32 ->
plus the optional shared experts, which see every token: their first half (gate and up, the
activation) runs while the dispatch travels, their down projection while the combine does.
`ExpertParallel` (ringtree.parallel.expert) swaps the dispatcher and keeps this rank's slice of
the experts; nothing else changes.
"""

from __future__ import annotations

import torch
from torch import nn

from ringtree.parallel.moe.dispatch import AllToAllDispatcher, LocalDispatcher, sort_by_expert
from ringtree.parallel.moe.experts import GroupedExperts
from ringtree.parallel.moe.router import AttachAux, Router


class SharedExperts(nn.Module):
    """A SwiGLU every token goes through (DeepSeek's shared experts, fused into one of n x hidden)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(self.hidden(x))  # type: ignore[no-any-return]

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x): the part before the down projection."""
        h: torch.Tensor = nn.functional.silu(self.w_gate(x)) * self.w_up(x)
        return h


class SharedWork:
    """The shared experts on tokens h, in the two halves a dispatcher runs beside its exchanges."""

    def __init__(self, shared: SharedExperts, h: torch.Tensor) -> None:
        self.shared, self.h = shared, h
        self.hidden: torch.Tensor | None = None
        self.out: torch.Tensor | None = None

    def during_dispatch(self) -> None:
        self.hidden = self.shared.hidden(self.h)

    def during_combine(self) -> None:
        assert self.hidden is not None, "during_dispatch runs first"
        self.out = self.shared.w_down(self.hidden)


class MoE(nn.Module):
    """Top-k mixture of `experts` SwiGLU experts of width `hidden` (and `shared` shared ones).

    ```python
    block.mlp = MoE(dim=64, hidden=64, experts=8, top_k=2)
    ```
    Options: score softmax|sigmoid; capacity_factor None (dropless) or C; aux_loss 0 (balance by
    the expert bias, updated by ringtree.parallel.expert.balance_experts before each optimizer
    step) or the auxiliary loss's coefficient; bias_rate, the bias's step.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        experts: int = 8,
        top_k: int = 2,
        *,
        shared: int = 0,
        score: str = "softmax",
        capacity_factor: float | None = None,
        aux_loss: float = 0.0,
        bias_rate: float = 1e-3,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.router = Router(
            dim,
            experts,
            top_k,
            score,
            capacity_factor=capacity_factor,
            aux_loss=aux_loss,
            bias_rate=bias_rate,
        )
        self.experts = GroupedExperts(experts, dim, hidden)
        self.shared = SharedExperts(dim, shared * hidden) if shared else None
        self.dispatcher: LocalDispatcher | AllToAllDispatcher = LocalDispatcher()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, d = x.shape, x.shape[-1]
        h = x.reshape(-1, d)  # [T, d]
        routing, aux = self.router(h)
        order, counts = sort_by_expert(routing.experts, routing.keep, self.num_experts)
        token = order // self.top_k  # the token of each sorted copy
        shared = SharedWork(self.shared, h) if self.shared is not None else None
        rows = self.dispatcher(h[token], counts, self.experts, shared)  # [N, d], same order
        weights = routing.weights.flatten()[order, None]  # fp32, kept on this rank
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        out = out.index_add(0, token, rows.float() * weights).to(x.dtype)
        if shared is not None:
            assert shared.out is not None, "the dispatcher runs both halves"
            out = out + shared.out
        if aux is not None:
            out = AttachAux.apply(out, aux)  # type: ignore[no-untyped-call]
        return out.view(shape)
