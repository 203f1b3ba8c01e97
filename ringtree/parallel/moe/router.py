"""The router: each token's top-k experts and their weights, from scores computed in fp32.

Scores are softmax or sigmoid of x W^T (W: [E, d]). Load balancing is one of two:

- without an auxiliary loss (DeepSeek-V3, torchtitan's default): a per-expert bias added to the
  scores only to choose the experts; the weights stay the unbiased scores. The bias moves after
  every optimizer step toward the experts that got fewer tokens (balance.py);
- with the classic auxiliary loss (Switch/GShard, `aux_loss` > 0): coef * E * sum_i f_i P_i,
  f_i the fraction of token copies routed to expert i, P_i its mean score. Its gradient joins
  backward through the layer's output (Megatron's MoEAuxLossAutoScaler), not the user's loss.

With a capacity factor C, an expert keeps at most ceil(C x T k / E) of a rank's T tokens (the
earliest ones); the rest of its copies are dropped (the residual carries those tokens on).
Without one, routing is dropless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtree.parallel.tensor.sequence import sequence_group

SCORES = ("softmax", "sigmoid")


@dataclass
class Routing:
    """A batch's routing: T tokens, k choices each."""

    experts: torch.Tensor  # [T, k] expert index of each choice
    weights: torch.Tensor  # [T, k] fp32 gate weight of each choice
    keep: torch.Tensor  # [T, k] bool: False where the capacity dropped the copy


class Router(nn.Module):
    """Top-k token choice over `experts` experts."""

    expert_bias: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor

    def __init__(
        self,
        dim: int,
        experts: int,
        top_k: int,
        score: str = "softmax",
        *,
        capacity_factor: float | None = None,
        aux_loss: float = 0.0,
        bias_rate: float = 1e-3,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k={top_k} must be between 1 and the {experts} experts")
        if score not in SCORES:
            raise ValueError(f"unknown router score {score!r}; choose one of {', '.join(SCORES)}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
        self.experts, self.top_k, self.score = experts, top_k, score
        self.capacity_factor, self.aux_loss, self.bias_rate = capacity_factor, aux_loss, bias_rate
        self.weight = nn.Parameter(torch.randn(experts, dim) * dim**-0.5)
        self.register_buffer("expert_bias", torch.zeros(experts))  # moves only with bias balancing
        # this step's routed token copies per expert (local; summed over the data ranks at the step)
        self.register_buffer("tokens_per_expert", torch.zeros(experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(2), persistent=False)  # [dropped, routed] copies
        self.last_load = 0.0  # max / mean of the last step's global counts (balance.py sets it)

    @property
    def balances_by_bias(self) -> bool:
        return self.aux_loss == 0.0

    def forward(self, x: torch.Tensor) -> tuple[Routing, torch.Tensor | None]:
        """Routing of x [T, d]; and the auxiliary loss (None without one)."""
        logits = x.float() @ self.weight.float().t()  # [T, E], fp32
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias if self.balances_by_bias else scores
        experts = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, experts)
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        keep = self._capacity(experts)
        if self.training:
            self._count(experts, keep)
        aux = self._aux(scores, experts) if self.aux_loss and self.training else None
        return Routing(experts, weights, keep), aux

    def _capacity(self, experts: torch.Tensor) -> torch.Tensor:
        """True for the copies within their expert's capacity (all, when dropless)."""
        if self.capacity_factor is None:
            return torch.ones_like(experts, dtype=torch.bool)
        flat = experts.flatten()
        capacity = math.ceil(self.capacity_factor * flat.numel() / self.experts)
        order = flat.argsort(stable=True)  # token order within each expert
        counts = torch.bincount(flat, minlength=self.experts)
        starts = counts.cumsum(0) - counts
        position = torch.empty_like(flat)
        position[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        return (position < capacity).view_as(experts)

    @torch.no_grad()
    def _count(self, experts: torch.Tensor, keep: torch.Tensor) -> None:
        kept = experts[keep]
        self.tokens_per_expert += torch.bincount(kept, minlength=self.experts).to(self.tokens_per_expert)
        self.dropped += torch.tensor([float(keep.numel() - kept.numel()), float(keep.numel())]).to(
            self.dropped
        )

    def _aux(self, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """coef * E * sum_i f_i P_i (f_i: fraction of copies to expert i; P_i: its mean normalized score).

        Under sequence parallelism (the weight marked by the TP plan) the rank holds t/tp of the
        tokens: f_i is counted over the TP group's tokens, and P_i sums this rank's scores over all
        of them, so this rank's loss is its share and the gradients summed over the group are the
        whole sequence's (Megatron-Core's switch_load_balancing_loss_func)."""
        probs = scores / scores.sum(-1, keepdim=True)
        counts = torch.bincount(experts.flatten(), minlength=self.experts).float()
        copies, tokens = experts.numel(), probs.shape[0]
        marked, group = sequence_group(self.weight)
        if marked:
            dist.all_reduce(counts, group=group)
            ranks = dist.get_world_size(group)
            copies, tokens = copies * ranks, tokens * ranks
        return self.aux_loss * self.experts * (counts / copies * probs.sum(0) / tokens).sum()


class AttachAux(torch.autograd.Function):
    """Return `out` unchanged; in backward, give `aux` the gradient 1 (it joins the training loss)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)
