"""A small Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP.

Shapes: b sequences, t tokens, d model width, h query heads, g key/value heads (h a multiple of g),
e = d / h the head width, V the vocabulary. The projections are separate nn.Linear layers without
bias (q, k, v, o; gate, up, down), so a tensor-parallel plan can name each: q, k, v, gate and up
column-parallel, o and down row-parallel (TP_PLAN). Attention reads its head counts from the
projections' outputs, so a rank holding h/tp query heads and g/tp key/value heads runs unchanged.

With sequence parallelism (Megatron-LM), the blocks' residual stream holds t/tp tokens on every
rank: the embedding's output is split along the sequence on the way in, the column-parallel
layers all-gather it, the row-parallel ones reduce-scatter back, and the output is gathered
before the final norm. `sp_group` set by the TP plan turns it on.

Attention runs through an `SDPA` module (`attn.core`), so context parallelism can replace it by
attention over the whole sequence when each rank holds a share of the tokens; the rotary positions
come from the same module (the positions of the tokens held), so they travel with the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ringtree.parallel.context import SDPA
from ringtree.parallel.tensor.sequence import gather_sequence, scatter_sequence
from ringtree.train.techniques.activation_checkpointing import run_blocks

# The plan ringtree's gpt carries (module names with * for any block), as torch's parallelize_module.
TP_PLAN = {
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.mlp.gate": "colwise",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
}


@dataclass(frozen=True)
class GPTConfig:
    """Sized to learn the synthetic language task in about a minute on two CPU cores."""

    vocab: int = 20
    dim: int = 64
    depth: int = 4  # four blocks: --pp 2 and --virtual-stages 2 still get one block per chunk
    heads: int = 4
    kv_heads: int = 2  # grouped-query attention: two query heads share a key/value head
    hidden: int = 128  # SwiGLU's inner width (about 8/3 x dim, rounded to divide by tp)
    max_len: int = 64
    tied: bool = False  # Llama 2/3: untied input embedding and output head
    rope_base: float = 10000.0


def rotary(x: torch.Tensor, base: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate each pair (x[..., i], x[..., i + e/2]) by angle pos / base^(2i/e): x is [b, t, heads, e],
    pos the tokens' positions [t] (default 0..t-1)."""
    t, e = x.shape[1], x.shape[-1]
    inv = base ** (-torch.arange(0, e, 2, device=x.device, dtype=torch.float32) / e)  # [e/2]
    pos = torch.arange(t, device=x.device) if positions is None else positions
    angles = pos.to(torch.float32)[:, None] * inv  # [t, e/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]  # [1, t, 1, e/2]
    x1, x2 = x.float().chunk(2, dim=-1)  # each [b, t, heads, e/2]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.heads or cfg.heads % cfg.kv_heads:
            raise ValueError(
                f"dim={cfg.dim} must be a multiple of heads={cfg.heads}, itself a multiple of "
                f"kv_heads={cfg.kv_heads}"
            )
        self.head_dim, self.rope_base = cfg.dim // cfg.heads, cfg.rope_base
        self.q = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)
        self.core = SDPA()  # context parallelism swaps in attention over the whole sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)  # [b, t, heads * e] (t: whole, even under SP)
        b, t, e = q.shape[0], q.shape[1], self.head_dim
        pos = self.core.positions(t, x.device)  # [t]: where the tokens held sit in the sequence
        q = rotary(q.view(b, t, -1, e), self.rope_base, pos).transpose(1, 2)  # [b, h, t, e]
        k = rotary(k.view(b, t, -1, e), self.rope_base, pos).transpose(1, 2)  # [b, g, t, e]
        v = v.view(b, t, -1, e).transpose(1, 2)  # [b, g, t, e]
        out = self.core(q, k, v, is_causal=True)  # [b, h, t, e]
        return self.o(out.transpose(1, 2).reshape(b, t, -1))  # type: ignore[no-any-return]


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))  # type: ignore[no-any-return]


class DecoderBlock(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)) (pre-norm, as Llama)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))  # type: ignore[no-any-return]


class Embed(nn.Module):
    """Token ids [b, t] to vectors [b, t, d] (t/tp of them under sequence parallelism)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.sp_group: torch.distributed.ProcessGroup | None = None  # set by enable_sequence_parallel
        self.sequence_parallel, self.sp_algorithm = False, "ring"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.tokens(ids)  # [b, t, d]
        if self.sequence_parallel:
            h = scatter_sequence(h, self.sp_group, self.sp_algorithm)  # [b, t/tp, d]
        return h


class Head(nn.Module):
    """Vectors [b, t(/tp), d] to next-token logits [b, t, V]: gather the sequence, norm, project."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.sp_group: torch.distributed.ProcessGroup | None = None  # set by enable_sequence_parallel
        self.sequence_parallel, self.sp_algorithm = False, "ring"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            h = gather_sequence(h, self.sp_group, self.sp_algorithm)  # [b, t, d]
        return self.out(self.norm(h))  # type: ignore[no-any-return]


class GPT(nn.Module):
    """embed -> blocks -> norm -> head; `layers()` gives the same as a list a pipeline can cut."""

    tp_plan = TP_PLAN

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.embed = Embed(cfg)
        self.blocks = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.depth))
        self.head = Head(cfg)
        if cfg.tied:
            self.head.out.weight = self.embed.tokens.weight
        self.checkpoint_segments = 0  # > 0: activation checkpointing (see enable_checkpointing)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.cfg.max_len:
            raise ValueError(f"{ids.shape[1]} tokens exceed the gpt's max_len={self.cfg.max_len}; use fewer")
        h = run_blocks(self.blocks, self.embed(ids), self.checkpoint_segments)
        return self.head(h)  # type: ignore[no-any-return]

    def layers(self) -> list[nn.Module]:
        """embed, every block, head: applied in turn they compute forward()."""
        return [self.embed, *self.blocks, self.head]

    def check_tp(self, tp: int) -> None:
        """Refuse a tensor-parallel size that does not divide the query and key/value heads."""
        for name, heads in (("heads", self.cfg.heads), ("kv_heads", self.cfg.kv_heads)):
            if heads % tp:
                raise ValueError(
                    f"--tp {tp} must divide the gpt's {name}={heads} (each rank keeps whole heads); "
                    f"choose --tp among {[d for d in range(1, heads + 1) if heads % d == 0]}"
                )

    def check_cp(self, cp: int, tp: int, comm: str) -> None:
        """Refuse an all-to-all (Ulysses) context parallelism that cannot give each rank whole heads."""
        if comm == "all-to-all" and (self.cfg.heads // tp) % cp:
            raise ValueError(
                f"--cp-comm all-to-all gives each of the --cp {cp} ranks 1/{cp} of the "
                f"{self.cfg.heads // tp} query heads a tensor-parallel rank holds; choose --cp dividing "
                f"{self.cfg.heads // tp}, or --cp-comm p2p or all-gather"
            )

    def enable_sequence_parallel(
        self, group: torch.distributed.ProcessGroup | None, algorithm: str
    ) -> nn.Module:
        """Split the residual stream along the sequence between the embedding and the head; the
        region split (the blocks) is returned."""
        for end in (self.embed, self.head):
            end.sp_group, end.sequence_parallel, end.sp_algorithm = group, True, algorithm
        return self.blocks
