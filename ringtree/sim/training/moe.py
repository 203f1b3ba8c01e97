"""A mixture-of-experts layer on one rank under expert parallelism: its tokens, matmuls and traffic.

The expert mesh folds over the attention's TP x CP x DP ranks (Megatron-Core's "MoE parallel
folding": attention TP x CP x DP x PP, experts ETP x EP x expert-DP x PP; torchtitan's EP over
dp_shard x cp x tp). With TP, the MoE layer's tokens are split over the TP ranks (sequence
parallelism, which Megatron-Core requires with MoE and TP), so each rank routes b s / (c t) tokens,
k copies each, to the experts of its EP group; each EP rank holds E / EP experts, their matrices split
over ETP ranks, which gather each other's tokens. Per micro-batch and MoE layer the alltoall
dispatcher runs a dispatch and a combine all-to-all forward, and their mirror images backward ("the
backward pass of MoE dispatch is actually a combine", DeepEP), each rank sending its routed rows of
h 16-bit values; the allgather dispatcher (Megatron-Core's default) all-gathers every rank's tokens
over the EP x ETP group and reduce-scatters the outputs. The busiest rank receives
`Training.expert_load` x the mean (balanced routing, as the published benchmarks force it, is 1).

In dropless training every dispatcher of these stacks waits for the host once per MoE layer forward
(`host_sync_s`): Megatron-Core's `alltoall` copies the token counts to the host before its
all-to-all ("A synchronization is needed before expert parallel AlltoAll communication to get the
`input_splits` and `output_splits` CPU values", token_dispatcher.py), its `flex` dispatcher's
HybridEP "sizes buffers dynamically (CPU sync in dispatch)" and DeepEP's normal kernels wait for the
received counts, the grouped GEMM takes its per-expert rows as a host list (`tokens_per_expert.tolist()`,
experts.py), torchtitan copies its splits with `.tolist()`. The GPU's queue drains and it idles until
the host has launched the next kernel; the backward reuses the forward's counts. NVIDIA's later fused,
"sync-free" MoE kernels keep the counts on the GPU; they are not priced.

gpt-oss's experts (`Transformer.expert_bias`, `swiglu_limit`) add passes no kernel fuses in
Megatron-Core (from its gpt-oss support of September 2025, core_v0.15.0, through core_v0.18.0 of
June 2026, the releases around the published gpt-oss runs), `unfused_s`: the clamp of the gated
activation's inputs before its fused kernel (`weighted_bias_quick_geglu_impl`, fused_bias_geglu.py:
`x_glu.clamp(max=7)`, `x_linear.clamp(-7, 7)`, `torch.cat`), and the experts' output bias, added
expert by expert (`TEGroupedMLP._apply_bias`, experts.py: `torch.cat([t + b * p for t, b, p in
zip(torch.split(...), ...)])`; the first matrix's bias rides in Transformer Engine's grouped GEMM).
Each kernel reads its inputs once and writes its output once, 16-bit, masks a byte an element
(`UNFUSED_BYTES`, `UNFUSED_KERNELS`; tests/test_plan_moe_unfused.py replays the code under a
TorchDispatchMode and counts both): per routed row and width F of one expert on this rank, the
clamp forward moves 16 F (two clamps 4 F each, the cat 8 F) in 3 kernels, its backward 30 F (the
clamps' masks and `where`s 22 F, the chunk's gradients concatenated 8 F) in 9; per routed row and h,
the bias forward 12 h (b * p, the add, the cat) in 2 kernels per local expert and 1, its backward
16 h (grad x p and grad x b, each summed, and the split's gradients concatenated) in 4 per local
expert and 2. Not counted: the clamp again where Megatron-Core recomputes `moe_act`, fp32 router
probabilities (which would widen the bias path), and a per-call scalar copy to the GPU
(`torch.tensor(linear_offset, device=...)`).
"""

from __future__ import annotations

from ringtree.sim.network.clusters import GPU
from ringtree.sim.training import compute, fp8
from ringtree.sim.training.layout import Training
from ringtree.sim.training.transformer import Transformer

ITEMSIZE = 2  # tokens travel in 16 bits (BF16 dispatch and combine)
# the host's work between the wait for the token counts and the next kernel reaching the GPU, in eager
# PyTorch ops of about 20 us each (our estimate, not fitted): the counts' copy and wait, the splits'
# .tolist(), the output buffer, the exchange's launch
HOST_OPS = 4
HOST_OP_S = 20e-6
# gpt-oss's unfused passes (module docstring), forward and backward: HBM bytes per routed row and unit
# of the expert's width F (clamp) or of h (output bias); kernels, the bias's per local expert and once
UNFUSED_BYTES = {"clamp": (16, 30), "bias": (12, 16)}
UNFUSED_KERNELS = {"clamp": (3, 9), "bias_per_expert": (2, 4), "bias": (1, 2)}


def routed_tokens(model: Transformer, run: Training) -> float:
    """Tokens each rank routes per micro-batch: its b s / (c t) of the sequence."""
    return run.micro_batch * model.seq / (run.cp * run.tp)


def expert_rows(model: Transformer, run: Training) -> float:
    """Rows the busiest rank's experts compute per micro-batch: its routed tokens' k copies at the
    expert load, gathered over the ETP ranks that split each expert."""
    return routed_tokens(model, run) * model.top_k * run.expert_load * run.etp


def mlp_s(model: Transformer, run: Training, gpu: GPU) -> tuple[float, float]:
    """The MoE layer's matmuls (router, routed experts as grouped matmuls, shared experts) on one rank,
    forward and backward."""
    groups = model.experts // run.ep
    rows = expert_rows(model, run) / groups  # per local expert
    width = model.moe_ffn_hidden // run.etp
    up = fp8.linear_s(rows, (model.gated - 1) * width, model.hidden, gpu, run.dtype, run.fp8_recipe, groups)
    down = fp8.linear_s(rows, model.hidden, width, gpu, run.dtype, run.fp8_recipe, groups)
    router = compute.gemm_s(round(routed_tokens(model, run)), model.experts, model.hidden, gpu, "bf16")
    forward, backward = up[0] + down[0] + router, up[1] + down[1] + 2 * router
    if model.shared_experts:
        tokens = run.micro_batch * model.seq // run.cp
        shared = model.shared_experts * model.moe_ffn_hidden // run.tp
        for n, k in (((model.gated - 1) * shared, model.hidden), (model.hidden, shared)):
            f, b = fp8.linear_s(tokens, n, k, gpu, run.dtype, run.fp8_recipe)
            forward, backward = forward + f, backward + b
    return forward, backward


def host_sync_s() -> float:
    """The GPU's idle time per MoE layer forward while the host waits for the token counts and launches
    the next kernel (the same for every dispatcher in dropless training)."""
    return HOST_OPS * HOST_OP_S


def unfused_s(model: Transformer, run: Training, gpu: GPU) -> tuple[float, float]:
    """An MoE layer's passes over its routed rows that Megatron-Core runs unfused for gpt-oss's experts
    (the module docstring): the clamp of the gated activation's inputs and the experts' output bias, by
    the bytes they move through HBM and their kernels, forward and backward."""
    rows, local = expert_rows(model, run), model.experts // run.ep
    moved, kernels = [0.0, 0.0], [0, 0]
    for i in (0, 1):
        if model.swiglu_limit:  # each half of the gated input: F of the gate, F of the linear part
            moved[i] += UNFUSED_BYTES["clamp"][i] * model.moe_ffn_hidden / run.etp * rows
            kernels[i] += UNFUSED_KERNELS["clamp"][i]
        if model.expert_bias:
            moved[i] += UNFUSED_BYTES["bias"][i] * model.hidden * rows
            kernels[i] += UNFUSED_KERNELS["bias_per_expert"][i] * local + UNFUSED_KERNELS["bias"][i]
    bandwidth = gpu.hbm_GBps * 1e9
    forward, backward = (b / bandwidth + k * compute.KERNEL_S for b, k in zip(moved, kernels, strict=True))
    return forward, backward


def dispatch_bytes(model: Transformer, run: Training) -> int:
    """What the busiest rank's dispatch (or combine) all-to-all moves: its routed rows of h values."""
    return int(routed_tokens(model, run) * model.top_k * run.expert_load * model.hidden * ITEMSIZE)


def gather_bytes(model: Transformer, run: Training) -> int:
    """The allgather dispatcher's output: every token of the EP x ETP group, h values each."""
    return int(routed_tokens(model, run) * run.ep * run.etp * model.hidden * ITEMSIZE)


def etp_bytes(model: Transformer, run: Training) -> int:
    """With ETP: the all-gather of the routed rows over the ETP ranks (and the reduce-scatter back)."""
    return int(expert_rows(model, run) * model.hidden * ITEMSIZE) if run.etp > 1 else 0


def activation_bytes(model: Transformer, run: Training) -> float:
    """The MoE layer's stored tensors besides the attention's: the router's fp32 scores, the dispatched
    rows and the experts' outputs (h each), the experts' intermediate tensors (as a dense MLP's, 6
    bytes per width under SwiGLU, 4 under GeLU), and the shared experts' as a dense MLP of their width."""
    per_width = 6 if model.mlp == "swiglu" else 4
    rows = expert_rows(model, run)
    routed = rows * (2 * model.hidden * ITEMSIZE + per_width * model.moe_ffn_hidden / run.etp)
    scores = 4 * routed_tokens(model, run) * model.experts
    tokens = run.micro_batch * model.seq / run.cp
    shared = per_width * tokens * model.shared_experts * model.moe_ffn_hidden / run.tp
    return routed + scores + shared
