"""Ring attention (`--cp-comm p2p`): K/V travel around the context-parallel ranks while each computes.

A torch.autograd.Function with hand-written attention (as picotron's RingAttentionFunc), run block
by block as ringtree.schedules.ring_attention lays them out. Shapes: b sequences, h query heads,
g key/value heads (h a multiple of g), c tokens a chunk, e head width; this rank's q is
[b, h, n c, e] and its k, v [b, g, n c, e] for its n chunks (2 head-tail, else 1).

Forward, for each step s: start shifting the K/V held to the next rank, compute this rank's query
chunks against the held key chunks (whole, causal or skipped), merge each block's output into the
chunk's running output by their log-sum-exps in fp32 (PyTorch's _SDPAMerger rule), then take the
K/V that arrived. Backward recomputes each block's probabilities from the final log-sum-exp (P =
exp(S - lse)), adds its dQ locally and its dK/dV to the accumulator of that K/V block, which rides
the ring with the K/V: received from the previous rank, added to, sent on; after p shifts every
block's dK/dV is back at its owner.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ringtree.comm.p2p import Ring
from ringtree.schedules.ring_attention import CAUSAL, SKIP, Block, chunks, ring_step


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, h, c, e], lse [b, h, c]) of q [b, h, c, e] against k, v [b, h, c', e], in fp32."""
    s = (q @ k.transpose(-1, -2)) * scale  # [b, h, c, c']
    if causal:
        s = s.masked_fill(_future(s), float("-inf"))
    lse = s.logsumexp(dim=-1)  # [b, h, c]
    return torch.exp(s - lse[..., None]) @ v, lse


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block; grads = (dO, the final lse, D = rowsum(dO * O)), all fp32."""
    do, lse, delta = grads
    s = (q @ k.transpose(-1, -2)) * scale  # [b, h, c, c']
    if causal:
        s = s.masked_fill(_future(s), float("-inf"))
    p = torch.exp(s - lse[..., None])  # this block's share of the whole row's softmax
    dp = do @ v.transpose(-1, -2)  # [b, h, c, c']
    ds = p * (dp - delta[..., None])
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, p.transpose(-1, -2) @ do


def merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries as one, by their log-sum-exps (stable form)."""
    if out is None or lse is None:
        return block_out, block_lse
    out = out - torch.sigmoid(block_lse - lse)[..., None] * (out - block_out)
    return out, lse - F.logsigmoid(lse - block_lse)


def _future(s: torch.Tensor) -> torch.Tensor:
    """The causal mask of a diagonal block: True where the key follows the query."""
    c, c2 = s.shape[-2], s.shape[-1]
    return torch.ones(c, c2, dtype=torch.bool, device=s.device).triu(1)


def _repeat(kv: torch.Tensor, h: int) -> torch.Tensor:
    """[b, g, t, e] -> [b, h, t, e]: each key/value head serves h/g query heads (GQA)."""
    return kv.repeat_interleave(h // kv.shape[1], dim=1) if kv.shape[1] != h else kv


def _fold(grad: torch.Tensor, g: int) -> torch.Tensor:
    """[b, h, t, e] -> [b, g, t, e]: the gradients of the query heads sharing a K/V head summed."""
    b, h, t, e = grad.shape
    return grad.view(b, g, h // g, t, e).sum(dim=2) if h != g else grad


class _Plan:
    """This rank's chunks and the blocks of each step (from the schedule), with chunk slicing."""

    def __init__(self, ring: Ring, causal: bool, balanced: bool) -> None:
        self.ring, self.causal, self.balanced = ring, causal, balanced
        self.mine = chunks(ring.rank, ring.size, balanced)

    def blocks(self, step: int) -> tuple[int, tuple[Block, ...]]:
        s = ring_step(step, self.ring.rank, self.ring.size, self.causal, self.balanced)
        return s.source, tuple(b for b in s.blocks if b.kind != SKIP)

    def index(self, chunk: int, owner: int) -> int:
        """Position of `chunk` among the chunks of rank `owner`."""
        return chunks(owner, self.ring.size, self.balanced).index(chunk)


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan, timeout_s: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, h, n c, e], lse [b, h, n c]) in fp32: the ring's p steps, each shift in flight
    while the step's blocks compute."""
    h, n = q.shape[1], len(plan.mine)
    scale = 1.0 / math.sqrt(q.shape[-1])
    qs = q.float().chunk(n, dim=2)  # per own chunk: [b, h, c, e]
    kv = torch.stack([k, v])  # [2, b, g, n c, e]: one message a step
    outs: list[torch.Tensor | None] = [None] * n
    lses: list[torch.Tensor | None] = [None] * n
    for step in range(plan.ring.size):
        shift = plan.ring.shift(kv, "kv") if step + 1 < plan.ring.size else None
        source, blocks = plan.blocks(step)
        ks, vs = (_repeat(t.float(), h).chunk(n, dim=2) for t in kv)
        for blk in blocks:
            i, j = plan.index(blk.q, plan.ring.rank), plan.index(blk.k, source)
            o, lse = block_forward(qs[i], ks[j], vs[j], scale, blk.kind == CAUSAL)
            outs[i], lses[i] = merge(outs[i], lses[i], o, lse)
        if shift is not None:
            kv = shift.wait(timeout_s)
    assert all(o is not None for o in outs), "every query chunk sees at least its own keys"
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)  # type: ignore[arg-type]


def _ring_backward(
    saved: tuple[torch.Tensor, ...], grad: torch.Tensor, plan: _Plan, timeout_s: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in fp32: the ring again, dK/dV accumulators riding it with their K/V."""
    q, k, v, out, lse = saved
    h, g, n, p = q.shape[1], k.shape[1], len(plan.mine), plan.ring.size
    scale = 1.0 / math.sqrt(q.shape[-1])
    do = grad.float()
    delta = (do * out).sum(dim=-1)  # [b, h, n c]
    qs, dos = q.float().chunk(n, dim=2), do.chunk(n, dim=2)
    lses, deltas = lse.chunk(n, dim=2), delta.chunk(n, dim=2)
    dq = [torch.zeros_like(t) for t in qs]
    kv = torch.stack([k, v])
    incoming = None  # the dK/dV accumulator of the block held, arriving from the previous rank
    for step in range(p):
        shift = plan.ring.shift(kv, "kv") if step + 1 < p else None
        source, blocks = plan.blocks(step)
        ks, vs = (_repeat(t.float(), h).chunk(n, dim=2) for t in kv)
        dks, dvs = [torch.zeros_like(t) for t in ks], [torch.zeros_like(t) for t in vs]
        for blk in blocks:
            i, j = plan.index(blk.q, plan.ring.rank), plan.index(blk.k, source)
            grads = (dos[i], lses[i], deltas[i])
            a, b, c = block_backward(qs[i], ks[j], vs[j], grads, scale, blk.kind == CAUSAL)
            dq[i] += a
            dks[j] += b
            dvs[j] += c
        mine = torch.stack([_fold(torch.cat(dks, dim=2), g), _fold(torch.cat(dvs, dim=2), g)])
        dkv = mine if incoming is None else incoming.wait(timeout_s) + mine
        incoming = plan.ring.shift(dkv, "dkv")
        if shift is not None:
            kv = shift.wait(timeout_s)
    assert incoming is not None
    dk, dv = incoming.wait(timeout_s)  # this rank's own block, home after p shifts
    return torch.cat(dq, dim=2), dk, dv


class RingAttention(torch.autograd.Function):
    """out = softmax(q k^T * scale [+ causal mask]) v over the whole sequence, held in shards.

    The arithmetic is fp32 whatever the inputs' dtype, autocast off (a bf16 log-sum-exp would lose
    the merge); the outputs and gradients come back in the inputs' dtypes.
    """

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan, timeout_s: float
    ) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _ring_forward(q, k, v, plan, timeout_s)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.timeout_s = plan, timeout_s
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v = ctx.saved_tensors[:3]
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = _ring_backward(ctx.saved_tensors, grad, ctx.plan, ctx.timeout_s)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: Ring,
    *,
    causal: bool,
    balanced: bool,
    timeout_s: float = 60.0,
) -> torch.Tensor:
    """Attention of this rank's queries [b, h, t/p, e] over the whole sequence's keys and values."""
    out: torch.Tensor = RingAttention.apply(  # type: ignore[no-untyped-call]
        q, k, v, _Plan(ring, causal, balanced), timeout_s
    )
    return out
