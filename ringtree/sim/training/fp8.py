"""FP8 training as a precision with a recipe: which matmuls run in FP8, at what rate, for what overhead.

The linear layers' three matmuls (forward, input gradient, weight gradient) run in FP8, as
torchao's Float8Linear ("output = to_fp8(input) @ to_fp8(weight.t())", grad_input and grad_weight
likewise) and Transformer Engine's fp8_autocast do; the attention core and the output layer stay in
BF16 (Megatron-Core's fp8_dot_product_attention False and first_last_layers_bf16; torchtitan's
filter_fqns=["output"]). An FP8 matmul runs at the GPU's FP8 dense peak x its matmul share x
GEMM_EFFICIENCY x FP8_EFFICIENCY x the recipe's kernel share; its operands are first scaled and cast
(memory-bound: CAST_BYTES HBM bytes per element of input and weight in the forward, of the output's
gradient in the backward, and a transposed FP8 copy of input and weight for the backward's
matmuls, as Hopper's FP8 tensor cores take only K-major operands). A matmul whose FP8 time with its
casts exceeds its BF16 time runs in BF16 (torchao's rule, "FP8 wins iff bf16_gemm_time >
fp8_gemm_time + fp8_overhead_time", torchao/float8/README.md; torchtitan's auto_filter_small_kn).

Recipes: `delayed` (Transformer Engine's DelayedScaling, Megatron-Core's default: the scale from the
amax history, the amax taken in the cast); `tensorwise` (torchao's dynamic per-tensor scaling: an
amax pass before each cast); `rowwise` (torchao: one scale per row, its scaled-matmul kernels slower
than the per-tensor ones); `blockwise` (DeepSeek-V3's and Transformer Engine's 1 x 128 activation and
128 x 128 weight blocks, the scales applied in the matmul's main loop); `mxfp8` (Blackwell's block-
scaled MX format, 32-element blocks in hardware: Blackwell only).
"""

from __future__ import annotations

from ringtree.sim.network.clusters import GPU
from ringtree.sim.training import compute

RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8")
# large FP8 matmuls' rate over the FP8 peak, as a share of what BF16 ones reach of the BF16 peak
# (torchao: "Gemm speedup approaching 2x as M, K, N increase"): our choice, checked against the
# published FP8 speed-ups (docs/results/planner-accuracy-moe.md)
FP8_EFFICIENCY = 0.9
# the recipe's matmul kernel against a per-tensor-scaled one: our choice, fitted to torchao's rowwise
# 1.10x against tensorwise 1.25x on Llama 3 8B (docs/results/planner-accuracy-moe.md); blockwise taken as
# rowwise on Hopper (software-applied scales); MX block scales are applied by Blackwell's tensor cores
KERNEL_SHARE = {"delayed": 1.0, "tensorwise": 1.0, "rowwise": 0.8, "blockwise": 0.8, "mxfp8": 1.0}
# HBM bytes per element to scale and cast a 16-bit operand to FP8: read 2 + write 1, with an amax
# pass (read 2 more) where the scale is computed from the tensor itself before the cast
CAST_BYTES = {"delayed": 3.0, "tensorwise": 5.0, "rowwise": 5.0, "blockwise": 3.0, "mxfp8": 3.0}
TRANSPOSE_BYTES = 2.0  # an FP8 copy transposed for the backward: read 1, write 1


def check(dtype: str, recipe: str, gpu: GPU) -> None:
    """Refuse FP8 on a GPU without FP8 tensor cores, and MXFP8 off Blackwell."""
    if dtype != "fp8":
        return
    if not gpu.has_fp8:
        raise ValueError(
            f"--dtype fp8 needs FP8 tensor cores (Hopper or Blackwell); the {gpu.name} has none: use bf16"
        )
    if recipe == "mxfp8" and gpu.arch != "blackwell":
        raise ValueError(
            f"--fp8-recipe mxfp8 needs Blackwell's block-scaled tensor cores; the {gpu.name} is {gpu.arch}: "
            "choose delayed, tensorwise, rowwise or blockwise"
        )


def linear_s(
    m: float, n: int, k: int, gpu: GPU, dtype: str, recipe: str, groups: int = 0
) -> tuple[float, float]:
    """One linear layer's forward and backward (its input gradient and weight gradient) on one rank:
    m rows of k by a k x n weight (`groups` > 0: a grouped matmul of that many experts, m rows each).
    In FP8 each matmul takes the faster of BF16 and FP8 with its casts."""
    bf16 = _matmul_s(m, n, k, gpu, "bf16" if dtype == "fp8" else dtype, groups)
    if dtype != "fp8":
        return bf16, 2 * bf16
    fp8 = _matmul_s(m, n, k, gpu, "fp8", groups, 1, FP8_EFFICIENCY * KERNEL_SHARE[recipe])
    g = max(1, groups)
    cast = CAST_BYTES[recipe] / (gpu.hbm_GBps * 1e9)
    forward_cast = cast * g * (m * k + k * n) + 2 * compute.KERNEL_S
    backward_cast = (cast * m * n + TRANSPOSE_BYTES / (gpu.hbm_GBps * 1e9) * (m * k + k * n)) * g
    backward_cast += 3 * compute.KERNEL_S
    return min(bf16, fp8 + forward_cast), min(2 * bf16, 2 * fp8 + backward_cast)


def _matmul_s(
    m: float, n: int, k: int, gpu: GPU, dtype: str, groups: int, itemsize: int = 2, efficiency: float = 1.0
) -> float:
    if groups:
        return compute.grouped_gemm_s(groups, m, n, k, gpu, dtype, itemsize, efficiency)
    return compute.gemm_s(round(m), n, k, gpu, dtype, itemsize, efficiency)


def weight_bytes(dtype: str, recipe: str) -> float:
    """Extra bytes per linear weight parameter FP8 keeps: its FP8 copy (and the transposed one Hopper's
    backward needs, cached by Transformer Engine across micro-batches); none under BF16."""
    if dtype != "fp8":
        return 0.0
    return 1.0 if recipe == "mxfp8" else 2.0
