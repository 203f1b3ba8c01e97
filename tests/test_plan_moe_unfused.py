"""gpt-oss's experts in the planner: their biases and clamped activation priced as the passes
Megatron-Core runs unfused (ringtree.sim.training.moe.unfused_s), and nothing else moved."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ringtree.sim.network.clusters import B200
from ringtree.sim.training import compute, moe
from ringtree.sim.training.layout import Training
from ringtree.sim.training.predictor import layer_times
from ringtree.sim.training.transformer import MODELS, Transformer

GPT_OSS = MODELS["gpt-oss-120b"]
RUN = Training(1280, 4, 1, 1, "bf16", "none", ep=8)


def test_the_gpt_oss_preset_carries_its_configs_biases_and_clamp() -> None:
    """config.json: "swiglu_limit": 7.0, and bias tensors on both expert matrices; no other preset."""
    assert GPT_OSS.expert_bias and GPT_OSS.swiglu_limit == 7.0
    others = [m for name, m in MODELS.items() if name != "gpt-oss-120b"]
    assert not any(m.expert_bias or m.swiglu_limit for m in others)


class _Traffic(TorchDispatchMode):
    """Each aten op but a view as one kernel that reads its tensor inputs and writes its outputs."""

    VIEWS = frozenset({"view", "_unsafe_view", "split", "split_with_sizes", "chunk", "slice", "detach"})

    def __init__(self) -> None:
        super().__init__()
        self.kernels, self.bytes = 0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in self.VIEWS:
            flat = [*pytree.tree_leaves(args), *pytree.tree_leaves(kwargs or {}), *pytree.tree_leaves(out)]
            self.kernels += 1
            self.bytes += sum(x.numel() * x.element_size() for x in flat if isinstance(x, torch.Tensor))
        return out


def _replayed(step: Any, rows: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Kernels and bytes per routed row of `step`'s forward and of its backward."""
    with _Traffic() as forward:
        out = step()
    grad = torch.randn_like(out)
    with _Traffic() as backward:
        out.backward(grad)
    return (forward.kernels, backward.kernels), (forward.bytes // rows, backward.bytes // rows)


def test_the_counts_are_megatron_cores_code_replayed() -> None:
    """Megatron-Core's clamp (weighted_bias_quick_geglu_impl) and expert-bias path
    (TEGroupedMLP._apply_bias), as written there, on 16-bit rows: their kernels and HBM bytes per row
    are `UNFUSED_KERNELS` and `UNFUSED_BYTES` (the broadcast bias and probabilities, a few bytes per
    row, round away)."""
    rows, width, local = 1024, 64, 4
    x = torch.randn(rows, 2 * width, dtype=torch.bfloat16, requires_grad=True)

    def clamp() -> torch.Tensor:
        x_glu, x_linear = x.chunk(2, -1)
        return torch.cat((x_glu.clamp(min=None, max=7.0), x_linear.clamp(min=-7.0, max=7.0)), -1)

    kernels, moved = _replayed(clamp, rows)
    assert kernels == moe.UNFUSED_KERNELS["clamp"]
    assert moved == pytest.approx(tuple(b * width for b in moe.UNFUSED_BYTES["clamp"]), rel=0.01)
    out = torch.randn(rows, width, dtype=torch.bfloat16, requires_grad=True)
    biases = [torch.randn(width, dtype=torch.bfloat16, requires_grad=True) for _ in range(local)]
    probs = torch.rand(rows, 1, dtype=torch.bfloat16, requires_grad=True)
    splits = [rows // local] * local

    def bias() -> torch.Tensor:
        parts = zip(torch.split(out, splits), biases, torch.split(probs, splits), strict=True)
        return torch.cat([t + b * p for t, b, p in parts]).view(rows, width).to(out.dtype)

    kernels, moved = _replayed(bias, rows)
    per, once = moe.UNFUSED_KERNELS["bias_per_expert"], moe.UNFUSED_KERNELS["bias"]
    assert kernels == (per[0] * local + once[0], per[1] * local + once[1])
    assert moved == pytest.approx(tuple(b * width for b in moe.UNFUSED_BYTES["bias"]), rel=0.01)


def test_the_passes_are_their_bytes_and_kernels() -> None:
    """4 x 4,096 tokens, 4 copies each: 65,536 rows of F = h = 2,880 on 128 / 8 = 16 local experts."""
    rows, f, h, local = 4 * 4096 * 4, 2880, 2880, 16
    hbm = B200.hbm_GBps * 1e9
    forward = (16 * f + 12 * h) * rows / hbm + (3 + 2 * local + 1) * compute.KERNEL_S
    backward = (30 * f + 16 * h) * rows / hbm + (9 + 4 * local + 2) * compute.KERNEL_S
    assert moe.unfused_s(GPT_OSS, RUN, B200) == pytest.approx((forward, backward))
    clamp_only = dataclasses.replace(GPT_OSS, expert_bias=False)
    assert moe.unfused_s(clamp_only, RUN, B200) == pytest.approx(
        (16 * f * rows / hbm + 3 * compute.KERNEL_S, 30 * f * rows / hbm + 9 * compute.KERNEL_S)
    )


def test_only_the_moe_layers_of_such_experts_pay_them() -> None:
    plain = dataclasses.replace(GPT_OSS, expert_bias=False, swiglu_limit=0.0)
    forward, backward = moe.unfused_s(GPT_OSS, RUN, B200)
    with_passes, without = layer_times(GPT_OSS, RUN, B200, True), layer_times(plain, RUN, B200, True)
    assert with_passes[0] - without[0] == pytest.approx(forward)
    assert with_passes[1] - without[1] == pytest.approx(backward)
    assert layer_times(GPT_OSS, RUN, B200, False) == layer_times(plain, RUN, B200, False)


def test_a_dense_model_cannot_have_them() -> None:
    with pytest.raises(ValueError, match="MoE layers"):
        Transformer(2, 64, 4, 128, 1000, expert_bias=True)
    with pytest.raises(ValueError, match="swiglu_limit"):
        dataclasses.replace(GPT_OSS, swiglu_limit=-1.0)
