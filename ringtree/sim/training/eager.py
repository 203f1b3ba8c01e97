"""Eager PyTorch's elementwise kernels of one Llama layer, each its own pass through HBM.

Under `torch.compile` (or hand-fused kernels: Megatron-LM, Transformer Engine, XLA) a layer's norms,
activation, rotary embedding and residual adds run fused, priced by ringtree.sim.training.compute's
`elementwise_s`. Run eagerly, every op is its own kernel that reads its inputs from HBM and writes
its output back. The ops are counted from torchtitan's Llama (torchtitan/models/llama/model.py and
torchtitan/models/norms.py at d4c86e37, the commit of its H100 eager rows):

    h = x + self.attention(self.attention_norm(x), freqs_cis)     # RMSNorm, residual add
    out = h + self.feed_forward(self.ffn_norm(h))                 # RMSNorm, residual add
    output = self._norm(x.float()).type_as(x); output * self.weight
        with _norm(x) = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    xq_ = torch.view_as_complex(xq.float()...); xq_out = view_as_real(xq_ * freqs_cis); .type_as(xq)
        (the same for xk)                                          # rotary on q and k
    keys = repeat_kv(xk, n_rep); values = repeat_kv(xv, n_rep)     # expand + reshape: a copy
    output.transpose(1, 2).contiguous()                            # SDPA's output back to (b, s, h)
    self.w2(F.silu(self.w1(x)) * self.w3(x))                       # SwiGLU

Each op is an `Op`: its width per token (h, q, kv, F; split over TP as the layer splits it), and the
HBM bytes per element and kernels of its forward and of its backward (the autograd formulas of its
pieces: every kernel reads each full-size input once and writes its output once; per-token scalars,
broadcast weights and views move nothing). Constants listed in docs/simulator.md, "Compute model".
Indices: h hidden, kv K (and V) width, F MLP width, t TP, s b tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtree.sim.network.clusters import GPU
from ringtree.sim.training.compute import KERNEL_S
from ringtree.sim.training.transformer import Transformer

ELEMENTWISE = ("fused", "eager")


@dataclass(frozen=True)
class Op:
    """One elementwise op of a layer: bytes per element and kernels, forward and backward."""

    name: str
    forward_bytes: int
    forward_kernels: int
    backward_bytes: int
    backward_kernels: int


# Kernels: the aten ops autograd dispatches for each op, views left out (tests/test_plan_eager.py
# counts them with a TorchDispatchMode). Bytes per element (bf16 2, fp32 4), read + written.
# RMSNorm, fp32 inside (bf16 x): _to_copy 2+4, pow 4+4, mean 4, add eps and rsqrt (per token), x * r
# 4+4, _to_copy 4+2, * weight 2+2 = 36 bytes, 8 kernels. Backward, 16 kernels: * weight 2+2; the
# weight's gradient g * y 2+2+2 and its sum over tokens 2; _to_copy 2+4; g * r 4+4; g * x 4+4+4 and
# its sum over h 4; rsqrt's pow, mul, mul (per token); mean's div 4 (written); pow's pow(x, 1) 4+4,
# * 2 4+4, * g 4+4+4; the two gradients of x added 4+4+4; _to_copy 4+2 = 92 bytes
RMSNORM = Op("rmsnorm", 36, 8, 92, 16)
# residual add (bf16): 2+2+2; its backward is the sum of the two gradients where x branches
RESIDUAL = Op("residual", 6, 1, 6, 1)
# rotary, per element of q or k: _to_copy 2+4, complex product with the cached freqs_cis 4+4,
# _to_copy 4+2; the backward: the gradient to fp32 2+4, conj(freqs_cis) materialised (a clone of the
# s x d/2 table: a kernel, no per-token bytes), the product 4+4, back to bf16 4+2
ROTARY = Op("rotary", 20, 3, 20, 4)
# repeat_kv's copy of K (and V), per element read or written: reads k d, writes h (2 bytes each); the
# backward sums the n_rep copies back (the same bytes)
REPEAT = Op("repeat_kv", 2, 1, 2, 1)
# SDPA's output transposed to (b, s, heads, d) and made contiguous: 2+2 each way
TRANSPOSE = Op("transpose", 4, 1, 4, 1)
# SwiGLU, per element of F: silu 2+2, the product 2+2+2; the backward: the product's two gradients
# 2+2+2 each, silu's 2+2+2
SWIGLU = Op("swiglu", 10, 2, 18, 3)
# a GeLU MLP's activation (--mlp gelu; not in torchtitan's Llama): F.gelu 2+2, its backward 2+2+2
GELU = Op("gelu", 4, 1, 6, 1)


def ops(model: Transformer, tp: int) -> list[tuple[Op, float, int]]:
    """The layer's eager ops on one TP rank: each with its width per token (elements, all its
    instances together) and its instances (kernels launched per layer)."""
    h, kv, f = model.hidden, model.kv_hidden, model.ffn_hidden
    layer: list[tuple[Op, float, int]] = [
        (RMSNORM, 2 * h, 2),  # attention_norm and ffn_norm
        (RESIDUAL, 2 * h, 2),
        (ROTARY, (h + kv) / tp, 2),  # q and k
        (TRANSPOSE, h / tp, 1),
        (SWIGLU if model.mlp == "swiglu" else GELU, f / tp, 1),
    ]
    if model.kv_heads < model.heads:  # repeat_kv copies K and V out to every query head
        layer.append((REPEAT, 2 * (h + kv) / tp, 2))
    return layer


def passes_s(
    model: Transformer, tokens: int, tp: int, sequence_parallel: bool, gpu: GPU
) -> tuple[float, float]:
    """The layer's eager elementwise forward and backward on one TP rank over `tokens` = s b tokens.

    Norms and residual adds run on every token of the replicated (b, s, h) activations, or on s / t
    of them under sequence parallelism; the rest on the rank's heads and MLP columns."""
    rate = gpu.hbm_GBps * 1e9
    forward = backward = 0.0
    for op, width, instances in ops(model, tp):
        shared = op in (RMSNORM, RESIDUAL)
        elements = tokens * width / (tp if shared and sequence_parallel else 1)
        forward += elements * op.forward_bytes / rate + instances * op.forward_kernels * KERNEL_S
        backward += elements * op.backward_bytes / rate + instances * op.backward_kernels * KERNEL_S
    return forward, backward
