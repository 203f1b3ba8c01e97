"""The time of one transformer layer on one GPU, from its dense peak, memory bandwidth and op shapes.

Three kinds of work (constants named, sourced and listed in docs/simulator.md, "Compute model"):
  * matmuls: 2 m n k FLOPs at the GPU's dense peak x its matmul share (the best matmul measured on
    it, MAMF, over its peak: Hopper reaches a smaller share than Ampere) x GEMM_EFFICIENCY (what a
    training run's large cuBLAS GEMMs reach of that best), scaled by the shape: output tiles of
    TILE x TILE are padded (tile quantization), and a GEMM of fewer tiles than the GPU has SMs
    leaves SMs idle; a GEMM whose operands take longer to stream from HBM than its FLOPs is priced
    by its bytes; every kernel costs KERNEL_S more;
  * attention as flash attention computes it (or, for runs without it, as two GEMMs per head whose
    s x s scores go through HBM): its FLOPs at FLASH_EFFICIENCY of the dense peak, the
    backward FLASH_BACKWARD times the forward (it recomputes the scores; Dao 2023), nothing stored
    or streamed of the s x s score matrix;
  * memory-bound work (norms, residuals, dropout, activation functions, rotary, softmax of the
    logits) priced by the bytes it moves through HBM: ELEMENTWISE_BYTES per byte of activation;
    unfused attention's softmax outside its fused kernel's shapes (`softmax_fallback_s`) by its
    fp32 passes' bytes.
Shapes per TP rank with t TP, c CP (each rank holds s / c of the sequence), b micro-batch.
"""

from __future__ import annotations

from ringtree.sim.network.clusters import GPU
from ringtree.sim.training.transformer import Transformer

# large fp16 GEMMs on an A100 reach about 225 of 312 TFLOP/s in cuBLAS: 0.72 of the peak, 0.838 of
# the A100's MAMF (267.9); other GPUs reach the same share of their own MAMF
GEMM_EFFICIENCY = 0.72 / 0.859
TILE = 128  # cuBLAS's usual output tile edge for 16-bit GEMMs on Ampere and Hopper
FLASH_EFFICIENCY = 0.6  # FlashAttention-2 forward: 50-73% of A100 peak (Dao 2023, figure 4)
FLASH_BACKWARD = 2.5  # the backward runs 5 matmuls to the forward's 2
KERNEL_S = 6e-6  # launch and tail of one kernel
# a grouped GEMM's share of a dense GEMM's rate at the same tile use: our choice, fitted to the
# published MoE rows (docs/results/planner-accuracy-moe.md)
GROUPED_EFFICIENCY = 0.9
ELEMENTWISE_BYTES = 2.0  # HBM bytes moved per byte of stored activation (read it once, write once)
# Megatron-LM's fused scale-mask-softmax kernel: its longest sequence (megatron/core/fusions/
# fused_softmax.py, `is_kernel_available`; 2,048 in the 2021 code), and the bytes per score its
# fp32 fallback moves beyond the kernel's (forward: .float() 2 + 4, x scale 4 + 4, masked_fill_
# 4 + 1 + 4, softmax 4 + 4, .half() 4 + 2 = 37 against the kernel's 2 + 2; backward: the five
# ops' 6 + 12 + 9 + 8 + 6 = 41 against its 6), counted from the ops, not fitted
FUSED_SOFTMAX_MAX_SEQ = 4096
SOFTMAX_FALLBACK_BYTES = (33, 35)
# a fixed cost per layer forward (twice it backward) of Megatron-LM's 2021-2022 stack (runs without
# flash attention), whatever the TP degree and micro-batch: our choice, fitted to Narayanan et al.'s
# TP 1 rows (figure 14 at batch 512) and checked on their TP 2-32 rows (docs/results/planner-accuracy.md,
# "Small GPT models with tensor parallelism on A100")
UNFUSED_LAYER_S = 0.33e-3


def _ceil(x: int, to: int) -> int:
    return -(-x // to) * to


def shape_efficiency(m: int, n: int, gpu: GPU) -> float:
    """The share of GEMM_EFFICIENCY an m x n output reaches: padded tiles, and idle SMs below a wave."""
    padded = (m / _ceil(m, TILE)) * (n / _ceil(n, TILE))
    tiles = _ceil(m, TILE) // TILE * (_ceil(n, TILE) // TILE)
    return padded * min(1.0, tiles / gpu.sms)


def gemm_s(m: int, n: int, k: int, gpu: GPU, dtype: str, itemsize: int = 2, efficiency: float = 1.0) -> float:
    """One m x k by k x n matmul on the roofline (FLOPs at the shape's efficiency, or bytes) + a kernel;
    `efficiency` scales the rate (FP8's kernels, ringtree.sim.training.fp8)."""
    if min(m, n, k) < 1:
        return 0.0
    rate = gpu.peak(dtype) * gpu.matmul_share * GEMM_EFFICIENCY * shape_efficiency(m, n, gpu) * efficiency
    flops = 2.0 * m * n * k / rate
    memory = itemsize * (m * k + k * n + m * n) / (gpu.hbm_GBps * 1e9)
    return max(flops, memory) + KERNEL_S


def grouped_gemm_s(
    groups: int, m: float, n: int, k: int, gpu: GPU, dtype: str, itemsize: int = 2, efficiency: float = 1.0
) -> float:
    """One grouped matmul (torch._grouped_mm, Transformer Engine's and Megatron-Core's grouped GEMM):
    `groups` m x k by k x n products in one kernel. Each group's rows are padded to whole tiles; the
    tiles of all groups together fill the SMs; its weights stream from HBM once per group; at
    GROUPED_EFFICIENCY of a dense GEMM's rate."""
    if groups < 1 or min(m, n, k) <= 0:
        return 0.0
    rows = max(1, round(m))
    tiles = _ceil(rows, TILE) // TILE * (_ceil(n, TILE) // TILE) * groups
    padded = (rows / _ceil(rows, TILE)) * (n / _ceil(n, TILE)) * min(1.0, tiles / gpu.sms)
    rate = gpu.peak(dtype) * gpu.matmul_share * GEMM_EFFICIENCY * GROUPED_EFFICIENCY * padded * efficiency
    flops = 2.0 * groups * m * n * k / rate
    memory = itemsize * groups * (m * k + k * n + m * n) / (gpu.hbm_GBps * 1e9)
    return max(flops, memory) + KERNEL_S


def matmuls_s(model: Transformer, tokens: int, tp: int, gpu: GPU, dtype: str) -> float:
    """A layer's forward matmuls on one TP rank: QKV, output projection, and the MLP's two or three."""
    h, f, kv = model.hidden, model.ffn_hidden, model.kv_hidden
    up = 2 if model.mlp == "swiglu" else 1  # SwiGLU's gate and up projections: one h x 2F GEMM
    return (
        gemm_s(tokens, (h + 2 * kv) // tp, h, gpu, dtype)  # QKV
        + gemm_s(tokens, h, h // tp, gpu, dtype)  # output projection
        + gemm_s(tokens, up * f // tp, h, gpu, dtype)  # MLP up (and gate)
        + gemm_s(tokens, h, f // tp, gpu, dtype)  # MLP down
    )


def attention_s(
    model: Transformer,
    micro_batch: int,
    tp: int,
    cp: int,
    gpu: GPU,
    dtype: str,
    flash: bool = True,
    kernel: str = "fused",
) -> float:
    """Attention's forward on one rank: its heads / t, its s / c queries against all s keys.

    Flash attention runs at FLASH_EFFICIENCY, FlashAttention-2 (`kernel` "flash2") at the GPU's
    `flash2_share` of it (less on Hopper, for which it was not written); unfused attention
    (Megatron-LM 2021) is two batched GEMMs per head, s x s x d and back, on the roofline (its
    softmax and dropout are elementwise work)."""
    if flash:
        flops = model.attention_flops(micro_batch * model.seq) / (tp * cp)
        share = gpu.flash2_share if kernel == "flash2" else 1.0
        return flops / (gpu.peak(dtype) * FLASH_EFFICIENCY * share) + KERNEL_S
    s, d = model.seq // cp, model.head_dim
    heads = micro_batch * max(1, model.heads // tp)  # batched over heads: one kernel each
    return 2 * (gemm_s(s, model.seq, d, gpu, dtype) - KERNEL_S) * heads + 2 * KERNEL_S


def softmax_fallback_s(
    model: Transformer, micro_batch: int, tp: int, cp: int, gpu: GPU
) -> tuple[float, float]:
    """What unfused attention's softmax costs beyond its fused kernel, forward and backward, on one rank.

    Megatron-LM's `FusedScaleMaskSoftmax` (also in NeMo and Megatron-DeepSpeed) runs its fused
    scale-mask-softmax kernel only when b x a/t (its "attn_batches") and the sequence are multiples
    of 4 and 16 < s <= FUSED_SOFTMAX_MAX_SEQ; otherwise it runs the softmax in PyTorch in fp32, five
    passes over the b a/t s/c x s scores: .float(), x scale, masked_fill_, softmax, .half(), and their
    five backward ops (SOFTMAX_FALLBACK_BYTES more HBM bytes per score than the fused kernel's)."""
    heads, s = micro_batch * max(1, model.heads // tp), model.seq
    if heads % 4 == 0 and s % 4 == 0 and 16 < s <= FUSED_SOFTMAX_MAX_SEQ:
        return 0.0, 0.0
    scores, rate = heads * (s // cp) * s, gpu.hbm_GBps * 1e9
    forward, backward = SOFTMAX_FALLBACK_BYTES
    return forward * scores / rate + 4 * KERNEL_S, backward * scores / rate + 4 * KERNEL_S


def elementwise_s(stored_bytes: float, gpu: GPU, kernels: int = 8) -> float:
    """Memory-bound work over `stored_bytes` of activations, plus its kernels."""
    return ELEMENTWISE_BYTES * stored_bytes / (gpu.hbm_GBps * 1e9) + kernels * KERNEL_S


def logits_s(model: Transformer, tokens: int, tp: int, gpu: GPU, dtype: str) -> float:
    """The output layer's matmul (vocabulary split over TP) and its fp32 softmax and loss."""
    softmax = 4 * tokens * (model.vocab // tp) * 4 / (gpu.hbm_GBps * 1e9)
    return gemm_s(tokens, model.vocab // tp, model.hidden, gpu, dtype) + softmax
