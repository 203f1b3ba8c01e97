"""Context-parallel attention without a ring: one all-gather of K/V (`--cp-comm all-gather`), or
Ulysses' head exchange (`--cp-comm all-to-all`).

Both end with torch's scaled_dot_product_attention over the whole sequence's keys in the order the
collective delivers them (rank 0's tokens first), masked by positions: a query attends to a key
when the key's position is not after its own. So the head-tail layout needs no reordering.

- all-gather: K and V of every rank gathered in one all-gather before attention (its backward is a
  reduce-scatter of dK/dV); every rank keeps its own queries. Simple, not overlapped, p x K/V held.
- all-to-all (DeepSpeed Ulysses): q, k and v exchanged so that each rank holds h/p heads of the
  whole sequence, attention runs locally, and the output goes back by the reverse exchange; 4
  all-to-alls forward and 4 backward (each is its own backward with the same splits), on ringtree's
  all-to-all (comm.all_to_all_single_autograd). Needs the query heads divisible by p; K/V heads
  that are not are repeated up to the query heads first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringtree import comm
from ringtree.parallel.context.layout import Layout
from ringtree.parallel.tensor.sequence import all_gather_sequence

Group = dist.ProcessGroup | None


def _mask(layout: Layout, t_local: int, q_positions: torch.Tensor) -> torch.Tensor:
    """[t_q, T]: True where the key (in gathered order) is not after the query."""
    keys = layout.gathered_positions(t_local, q_positions.device)
    return q_positions[:, None] >= keys[None, :]


def gathered_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Layout,
    group: dist.ProcessGroup | None,
    *,
    causal: bool,
    algorithm: str = "ring",
) -> torch.Tensor:
    """q [b, h, t/p, e] against K/V [b, g, t/p, e] all-gathered to [b, g, t, e] (rank order)."""
    g, t_local = k.shape[1], k.shape[2]
    kv = torch.cat([k, v], dim=1).transpose(1, 2)  # [b, t/p, 2g, e]: one all-gather for both
    full = all_gather_sequence(kv, group, algorithm).transpose(1, 2)  # [b, 2g, t, e]
    k_all, v_all = full[:, :g], full[:, g:]
    mask = _mask(layout, t_local, layout.positions(t_local, q.device)) if causal else None
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=q.shape[1] != g)


def _exchange(parts: torch.Tensor, group: Group, algorithm: str) -> torch.Tensor:
    """Equal-split all-to-all of [p, ...] (slice j to rank j), ringtree's; its backward is itself."""
    return comm.all_to_all_single_autograd(parts.contiguous(), algorithm=algorithm, group=group)


def _heads_to_sequence(x: torch.Tensor, p: int, group: Group, algorithm: str) -> torch.Tensor:
    """[b, h, t/p, e] (all heads, own tokens) -> [b, h/p, t, e] (own heads, every rank's tokens)."""
    b, h, s, e = x.shape
    parts = x.reshape(b, p, h // p, s, e).permute(1, 0, 2, 3, 4)  # [p (to), b, h/p, s, e]
    got = _exchange(parts, group, algorithm)  # [p (from), b, h/p, s, e]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * s, e)


def _sequence_to_heads(x: torch.Tensor, p: int, group: Group, algorithm: str) -> torch.Tensor:
    """The reverse: [b, h/p, t, e] -> [b, h, t/p, e]."""
    b, hp, t, e = x.shape
    parts = x.reshape(b, hp, p, t // p, e).permute(2, 0, 1, 3, 4)  # [p (to), b, h/p, s, e]
    got = _exchange(parts, group, algorithm)  # [p (from: head group), b, h/p, s, e]
    return got.permute(1, 0, 2, 3, 4).reshape(b, p * hp, t // p, e)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Layout,
    group: dist.ProcessGroup | None,
    *,
    causal: bool,
    algorithm: str = "auto",
) -> torch.Tensor:
    """Attention of q [b, h, t/p, e] over the whole sequence, each rank computing h/p heads of it
    (algorithm: ringtree's all-to-all, auto or one of comm.algorithms("all_to_all"))."""
    p, h, t_local = layout.p, q.shape[1], q.shape[2]
    if h % p:
        raise ValueError(
            f"all-to-all context parallelism gives each of the {p} ranks h/{p} of the {h} query heads; "
            f"use a number of heads divisible by {p}, or another --cp-comm"
        )
    if k.shape[1] % p:  # too few key/value heads to split: repeat them up to the query heads
        k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    qs, ks, vs = (_heads_to_sequence(t, p, group, algorithm) for t in (q, k, v))
    mask = None
    if causal:
        mask = _mask(layout, t_local, layout.gathered_positions(t_local, q.device))
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=qs.shape[1] != ks.shape[1])
    return _sequence_to_heads(out, p, group, algorithm)
