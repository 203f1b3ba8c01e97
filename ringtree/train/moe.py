"""`--model moe`: the gpt with its MLP replaced by a mixture of experts in every (or every K-th) block.

The gpt of ringtree/train/gpt.py (RMSNorm, rotary positions, grouped-query attention), where block i
holds an MoE layer (ringtree.parallel.MoE) when i % K == K - 1 and keeps its dense SwiGLU
otherwise. Each routed expert is a SwiGLU half as wide as the dense one, so with top-2 routing a
token computes about what the dense block computes (E x the parameters, k / E of them per token).
Its tensor-parallel plan shards attention and the dense MLPs; the experts are split by --ep.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtree.parallel.moe import MoE
from ringtree.train.gpt import GPT, TP_PLAN, GPTConfig


@dataclass(frozen=True)
class MoESettings:
    """The MoE layers of the model: what --experts, --top-k, ... set."""

    experts: int = 8
    top_k: int = 2
    every: int = 1  # an MoE layer in blocks every-1, 2 every-1, ...
    shared: int = 0
    score: str = "softmax"
    capacity_factor: float | None = None  # None: dropless
    aux_loss: float = 0.0  # 0: balance by the expert bias
    bias_rate: float = 1e-2  # the bias's step per optimizer step (a few hundred steps on the sort task)
    hidden: int | None = None  # each expert's SwiGLU width; None: half the dense one's


class MoEGPT(GPT):
    """GPT with MoE layers; `moe_blocks` are the indices of the blocks that have one."""

    def __init__(self, cfg: GPTConfig | None = None, moe: MoESettings | None = None) -> None:
        super().__init__(cfg)
        moe = moe or MoESettings()
        hidden = moe.hidden or self.cfg.hidden // 2
        self.moe_blocks = [i for i in range(self.cfg.depth) if i % moe.every == moe.every - 1]
        for i in self.moe_blocks:
            self.blocks[i].mlp = MoE(
                self.cfg.dim,
                hidden,
                moe.experts,
                moe.top_k,
                shared=moe.shared,
                score=moe.score,
                capacity_factor=moe.capacity_factor,
                aux_loss=moe.aux_loss,
                bias_rate=moe.bias_rate,
            )
        self.tp_plan = moe_plan(self.cfg.depth, self.moe_blocks)


def moe_plan(depth: int, moe_blocks: list[int]) -> dict[str, str]:
    """The gpt's TP plan for attention everywhere and for the MLPs of the dense blocks only."""
    plan = {k: v for k, v in TP_PLAN.items() if ".mlp." not in k}
    for i in range(depth):
        if i not in moe_blocks:
            plan |= {k.replace("*", str(i)): v for k, v in TP_PLAN.items() if ".mlp." in k}
    return plan
